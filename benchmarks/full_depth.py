"""Full-depth random checkpoints written directly in their storage format (bf16, fp8, NVFP4), one tensor at a time,
with no bf16 copy first (issue 21's method): the 35B-A3B shape's 40 layers are ~35 GB in fp8 where a bf16 source
would need ~70 GB of the GPU machine's 64 GB disk.

- **Names, dtypes, the config.** The tensor names a checkpoint of the shape has on disk come from transformers:
  a model of the same structure (layer count, layer kinds, expert count) at tiny sizes is saved with
  ``save_pretrained`` (a few MB) and its safetensors header read; the real shapes come from the same model built on
  the meta device (no memory) at the real sizes. Where the two name sets differ (transformers keeps Qwen 3.5 MoE's
  experts fused in memory, ``experts.gate_up_proj`` (E, 2I, H), and writes them per expert) the per-expert shapes
  are derived from the fused parameter; any other difference is refused by name.
- **What is quantized and how it is laid out** comes from ``lumen_core.quantize.layout``: exactly the tensors,
  dtypes, shapes and ``quantization_config`` that ``lumen quantize`` would write from a bf16 checkpoint of that
  config.
- **Values** are random, generated on the GPU (CuPy) and written as they come: bf16 tensors as the model's init
  would have them in spirit (linears and embeddings normal(0, 0.02), norms at scale ~1 through the architecture's
  own ``norm_weight_offset``, ``A_log`` = log(uniform(1, 16)), other vectors 1), fp8 weights as random finite E4M3
  codes of magnitude < 2 with block scales ~0.01, NVFP4 weights as random E2M1 nibbles with E4M3 block scales in
  [0.5, 2) and a global scale of 0.005. Speed does not depend on the values; no value is NaN or infinite. These
  are not the values ``lumen quantize`` would compute from a random bf16 model (that would need the bf16 copy).

    from full_depth import write_checkpoint
    path = write_checkpoint("35b-a3b", 40, "fp8", Path("/tmp/lumen-bench"))  # reused when present
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_models import hf_config  # noqa: E402

from lumen_core.checkpoint import TensorInfo  # noqa: E402

# tiny sizes for the name template: the structure (layers, kinds, experts) is the real one
TINY = dict(hidden_size=32, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            global_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, sliding_window=16)
SHARD_BYTES = 4 << 30
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass
class VirtualCheckpoint:
    """What ``lumen_core.quantize.layout`` and an architecture read of a checkpoint: its config and tensor table."""

    path: Path
    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    format: str = "hf"


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head


def tensor_table(shape: str, layers: int, vocab: int, scratch: Path,
                 dims: dict | None = None) -> tuple[dict, dict[str, TensorInfo]]:
    """(config dict as ``save_pretrained`` writes it, {name: TensorInfo} in file order) of the shape at full size
    (or at ``dims``)."""
    import torch

    fields = set(hf_config(shape, 1, vocab)[0].to_dict())
    tiny = {**(dims or {}), **{k: v for k, v in TINY.items() if k in fields}}  # the structure stays the real one
    tiny_cfg, model_cls = hf_config(shape, layers, 64, tiny)
    template = scratch / f"template-{shape}-l{layers}"
    if template.exists():
        shutil.rmtree(template)
    with torch.device("cpu"):
        model_cls(tiny_cfg).to(torch.bfloat16).save_pretrained(template)
    names = []
    for f in sorted(template.glob("*.safetensors")):
        names += [(n, m["dtype"]) for n, m in _header(f).items()]
    shutil.rmtree(template)
    cfg, model_cls = hf_config(shape, layers, vocab, dims)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in model_cls(cfg).state_dict().items()}
    table = {}
    for name, dtype in names:
        if name in shapes:
            shp = shapes[name]
        elif (m := _EXPERT.match(name)) and (fused := shapes.get(m.group(1) + ".gate_up_proj")):
            _, two_i, hidden = fused
            shp = (hidden, two_i // 2) if m.group(3) == "down" else (two_i // 2, hidden)
        else:
            raise SystemExit(f"full_depth: {name} is in the saved template but not in the model's state dict")
        n = 1
        for d in shp:
            n *= d
        table[name] = TensorInfo(name, dtype, shp, n * {"BF16": 2, "F16": 2, "F32": 4}[dtype])
    cfg.architectures = [model_cls.__name__]
    config = json.loads(cfg.to_json_string(use_diff=True))
    config.setdefault("dtype", "bfloat16")
    return config, table


def _array_module():
    """CuPy where a GPU is there (the benchmark machine), else numpy (the CPU test of the writer)."""
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
        return cp
    except Exception:  # no CuPy, or no device
        import numpy as np

        return np


def _values(name: str, dtype: str, shape: tuple, offset, rng, cp):
    """Random bytes (a uint8 array of ``cp``: CuPy or numpy) of one output tensor, as the module docstring says."""
    n = 1
    for d in shape:
        n *= d
    if dtype == "BF16" or dtype == "F32":
        if name.endswith("A_log"):
            x = cp.log(1.0 + 15.0 * rng.random(n, dtype=cp.float32))
        elif offset is not None:  # a norm: (offset + w) ~ 1
            x = (1.0 - offset) + 0.02 * rng.standard_normal(n, dtype=cp.float32)
        elif len(shape) <= 1:
            x = cp.ones(n, cp.float32)
        else:
            x = 0.02 * rng.standard_normal(n, dtype=cp.float32)
        if name.endswith("_scale_inv"):  # fp8 block scales
            x = 0.008 + 0.004 * rng.random(n, dtype=cp.float32)
        elif name.endswith("_scale_2"):  # NVFP4 global scale
            x = cp.full(n, 0.005, cp.float32)
        if dtype == "F32":
            return x.view(cp.uint8)
        u = x.view(cp.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16).view(cp.uint8)
    if dtype == "F8_E4M3":
        if name.endswith("_scale"):  # NVFP4 block scales in [0.5, 2): exponent field 6..7
            return rng.integers(0x30, 0x40, n, dtype=cp.int32).astype(cp.uint8)
        b = rng.integers(0, 0x40, n, dtype=cp.int32).astype(cp.uint8)  # |v| < 2, never the NaN codes
        return b | (rng.integers(0, 2, n, dtype=cp.int32).astype(cp.uint8) << 7)
    if dtype == "U8":  # packed E2M1 pairs: every code is a finite value
        return rng.integers(0, 256, n, dtype=cp.int32).astype(cp.uint8)
    raise SystemExit(f"full_depth: no generator for {name} ({dtype})")


def write_checkpoint(shape: str, layers: int, fmt: str, workdir: Path, vocab: int = 248320,
                     progress: bool = True, dims: dict | None = None) -> Path:
    """The checkpoint of ``shape`` at ``layers`` layers in ``fmt`` (bf16, fp8, nvfp4) under ``workdir``, written
    once (reused when its config.json exists: written last). ``dims`` overrides the shape's sizes (a test writes the
    real structure at small sizes)."""
    from lumen_core.plugins import get_registry
    from lumen_core.quantize import layout, shard_header

    out = workdir / f"{shape}-l{layers}-{fmt}-direct" if dims is None else workdir / f"{shape}-l{layers}-{fmt}-small"
    if (out / "config.json").exists():
        return out
    t0 = time.perf_counter()
    config, table = tensor_table(shape, layers, vocab, workdir, dims)
    ckpt = VirtualCheckpoint(out, config, table)
    if fmt == "bf16":
        tensors, quant = [(n, i.dtype, i.shape, i.nbytes) for n, i in table.items()], None
    else:
        tensors, quant = layout(ckpt, fmt)
    arch = get_registry().architecture_class(config["model_type"]).from_checkpoint(ckpt)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t[3] > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[3]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    cp = _array_module()
    rng = cp.random.default_rng(0)
    total = sum(t[3] for t in tensors)
    done = 0
    for fname, shard in zip(files, shards, strict=True):
        with open(out / fname, "wb") as f:
            f.write(shard_header(shard))
            for name, dtype, shp, nbytes in shard:
                base = name.removesuffix("_scale_inv").removesuffix("_scale_2").removesuffix("_scale")
                raw = _values(name, dtype, shp, arch.norm_weight_offset(base), rng, cp)
                if raw.nbytes != nbytes:
                    raise AssertionError(f"{name}: generated {raw.nbytes} bytes, the header says {nbytes}")
                f.write(memoryview(raw.get() if hasattr(raw, "get") else raw))
                done += nbytes
        if progress:
            print(f"  {out.name}: {done / 1e9:.1f} of {total / 1e9:.1f} GB ({time.perf_counter() - t0:.0f}s)",
                  file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": total},
             "weight_map": {t[0]: fname for fname, shard in zip(files, shards, strict=True) for t in shard}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    if quant is not None:
        config = {**config, "quantization_config": quant}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: marks the checkpoint complete
    return out
