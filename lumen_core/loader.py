"""Load each component's tensors onto its backend, and account for every tensor in the checkpoint."""

from __future__ import annotations

import sys

from .architecture import Architecture, Component, TensorLayout, component_label
from .plan import weight_format
from .progress import Progress
from .tensors import LoadReport, check_finite, check_norm, is_nvfp4, logical_shape, scale_name


def load_component(ckpt, arch: Architecture, backend, store: str, names: list[str], shared: dict) -> dict:
    """``shared`` maps (tensor, backend, store) to what is already loaded there: a tied embedding that the
    input and output layers both use is held once per device, as the plan counts it.

    What is cheap to check is checked as it is read: small tensors (norms) and quantization scales hold no NaN or
    infinity (GGUF block scales: ``check_scales``; FP8 and NVFP4 scale tensors), and no norm multiplies by 0."""
    out = {}
    read_f32 = getattr(ckpt, "read_f32", ckpt.read)
    check_scales = getattr(ckpt, "check_scales", None)  # GGUF: the f16 scale of every block
    for name in names:
        key = (name, id(backend), store)
        if key in shared:
            out[name] = shared[key]
        elif arch.is_matrix(name):
            if is_nvfp4(ckpt, name):  # (e4m3 scale per 16 values (N, K/16), f32 global scale)
                scale_arr = (ckpt.read(name + "_scale"), ckpt.read(name + "_scale_2"))
                check_finite(ckpt, name + "_scale", scale_arr[0])
                check_finite(ckpt, name + "_scale_2", scale_arr[1])
            else:
                scale = scale_name(ckpt, name)
                scale_arr = ckpt.read(scale) if scale else None
                if scale:
                    check_finite(ckpt, scale, scale_arr)
            if check_scales is not None:
                check_scales(name)
            out[name] = backend.weight(ckpt.read(name), weight_format(ckpt, name), store, scale=scale_arr,
                                       shape=logical_shape(ckpt, name))
            if out[name].store is None:  # a Weight carries its store (the CUDA backend sets it itself)
                out[name].store = store
        else:
            values = read_f32(name)
            check_finite(ckpt, name, values)
            offset = arch.norm_weight_offset(name)
            if offset is not None:
                check_norm(ckpt, name, values, offset)
            out[name] = backend.tensor(values)
        shared[key] = out[name]
    return out


def load_weights(ckpt, arch: Architecture, layout: TensorLayout, placements: dict, backends: dict,
                 report: LoadReport, progress: Progress | None = None) -> dict[Component, dict]:
    weights: dict[Component, dict] = {}
    shared: dict = {}
    bar = (progress or Progress(False)).bar(len(layout.needs), "loading weights", "component")
    for comp, names in layout.needs.items():
        bar.set_postfix_str(component_label(comp), refresh=False)
        weights[comp] = load_component(ckpt, arch, backends[comp], placements[comp].store, names, shared)
        bar.update(1)
    bar.close()
    for comp in [c for c in weights if c[0] == "attention"]:  # a token mixer stored apart (plan.split_mixers):
        weights[("layer", comp[1])].update(weights.pop(comp))  # the architecture sees one layer, as always
    if report.unused:
        print(f"lumen: {len(report.unused)} checkpoint tensor(s) unused: {', '.join(report.unused[:8])}",
              file=sys.stderr)
    return weights

