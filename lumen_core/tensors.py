"""Accounting for checkpoint tensors: what is needed, missing, skipped on purpose, or left unused."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .architecture import LAYER_INDEX, TensorLayout, tensor_label
from .errors import CheckpointError

CORRUPT = "the checkpoint is corrupt (damaged on disk or in transfer): download it again"

SCALE_SUFFIX = "_scale_inv"  # HF FP8: ``X.weight_scale_inv`` belongs to ``X.weight``
# Every scale that may sit beside a weight: HF FP8 ``_scale_inv``; ModelOpt ``_scale`` (FP8: f32, NVFP4: e4m3
# per 16 values) and ``_scale_2`` (NVFP4: the f32 global scale).
SCALE_SUFFIXES = (SCALE_SUFFIX, "_scale", "_scale_2")
INPUT_SCALE = "input_scale"  # ModelOpt's static activation scale: Lumen keeps activations unquantized


def is_nvfp4(ckpt, name: str) -> bool:
    """ModelOpt NVFP4: a U8 weight (N, K/2) of packed E2M1 pairs with ``_scale`` and ``_scale_2`` beside it."""
    t = ckpt.tensors
    return t[name].dtype == "U8" and name + "_scale" in t and name + "_scale_2" in t


def scale_name(ckpt, name: str) -> str | None:
    """The FP8 scale of ``name`` (HF ``weight_scale_inv`` or ModelOpt ``weight_scale``; both multiply)."""
    for suffix in (SCALE_SUFFIX, "_scale"):
        if name + suffix in ckpt.tensors:
            return name + suffix
    return None


def logical_shape(ckpt, name: str) -> tuple[int, ...]:
    """(N, K) of the matrix a weight stands for: NVFP4 stores (N, K/2) bytes."""
    shape = tuple(ckpt.tensors[name].shape)
    return (*shape[:-1], shape[-1] * 2) if is_nvfp4(ckpt, name) else shape


@dataclass
class LoadReport:
    loaded: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)


def check_tensors(ckpt, layout: TensorLayout) -> LoadReport:
    """Raise on missing tensors; report the ones nothing will use."""
    needed = {n for names in layout.needs.values() for n in names}
    missing = sorted(needed - set(ckpt.tensors))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{ckpt.path}: {len(missing)} tensor(s) the architecture needs are missing: "
            f"{', '.join(missing[:5])}{more}"
        )
    scales = {n + s for n in needed for s in SCALE_SUFFIXES}
    inputs = {n.removesuffix("weight") + INPUT_SCALE for n in needed if n.endswith(".weight")} & set(ckpt.tensors)
    unused = sorted(set(ckpt.tensors) - needed - scales - inputs - set(layout.skipped))
    layers = {c[1] for c in layout.needs if c[0] == "layer"}
    extra = [n for n in unused if (m := LAYER_INDEX.search(n)) and int(m.group(1)) not in layers]
    if extra:  # whole layers the config does not have: its layer count disagrees with the weights
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise CheckpointError(
            f"{ckpt.path}: {len(extra)} tensor(s) belong to layers the config does not have (it has {len(layers)}): "
            f"{', '.join(extra[:3])}{more}; the config's layer count does not match the weights"
        )
    skipped = {n: r for n, r in layout.skipped.items() if n in ckpt.tensors}
    skipped.update((n, "activation scale: Lumen keeps activations unquantized") for n in sorted(inputs))
    return LoadReport(loaded=needed | (scales & set(ckpt.tensors)), skipped=skipped, unused=unused)


def check_finite(ckpt, name: str, values, what: str = "") -> None:
    """Refuse NaN or infinity in a tensor the loader reads whole (norms and other small tensors, quantization
    scales): one corrupt byte there turns every logit into NaN. ``what`` says which part (e.g. " (its scale)")."""
    values = np.asarray(values)
    if np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_:
        return
    ok = np.isfinite(values)
    if ok.all():
        return
    bad = np.flatnonzero(~ok.reshape(-1))
    index = tuple(int(i) for i in np.unravel_index(int(bad[0]), values.shape))
    raise CheckpointError(
        f"{ckpt.path}: tensor {tensor_label(ckpt, name)}{what} holds {len(bad)} non-finite value(s) (the first, "
        f"{values[index]}, at index {list(index)}): {CORRUPT}"
    )


def check_norm(ckpt, name: str, values, offset: float) -> None:
    """Refuse a norm weight whose RMSNorm would multiply every channel by 0 (``values + offset`` all zero): no trained
    model has one, a zeroed region of the file does (it silences the layer, or every logit at the output)."""
    values = np.asarray(values, dtype=np.float32)
    if values.size and not np.any(values + np.float32(offset)):
        raise CheckpointError(
            f"{ckpt.path}: norm weight {tensor_label(ckpt, name)} multiplies every channel by 0 (all {values.size} "
            f"values read as {float(values.reshape(-1)[0]):g}): a zeroed region of the file; {CORRUPT}"
        )
