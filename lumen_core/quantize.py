"""``lumen quantize``: write an FP8 or NVFP4 copy of an HF safetensors checkpoint.

Formats (what other engines read, and what Lumen's loader recognises):

- **fp8** — the HF FP8 layout (DeepSeek-V3 / Qwen FP8 releases): ``X.weight`` F8_E4M3 (N, K) and
  ``X.weight_scale_inv`` F32 (ceil(N/b), ceil(K/b)), one scale per b×b tile; value = e4m3 × scale.
  ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [b, b], ...}``.
- **nvfp4** — the ModelOpt layout (NVIDIA's ``*-FP4`` releases, vLLM's ``ModelOptNvFp4LinearMethod``):
  ``X.weight`` U8 (N, K/2) holding two E2M1 codes a byte, element 2j in the low nibble and 2j+1 in the high
  one (code = sign << 3 | index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}); ``X.weight_scale`` F8_E4M3 (N, K/16), one
  scale per 16 consecutive values of a row; ``X.weight_scale_2`` F32 scalar, the global scale
  (amax / (6 × 448)). value = e2m1 × weight_scale × weight_scale_2.
  ``quantization_config``: ``{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, ...}``.
  Weight-only: no ``input_scale`` is written (activations stay in the engine's compute type).

Only the weights the architecture feeds to ``linear`` are quantized; embeddings, norms, the lm_head and MoE
routers keep their checkpoint type. The checkpoint is read tensor by tensor from memory-mapped files and the
output written tensor by tensor, so the model is never held in memory at once.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import CheckpointError, InputError

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_GROUP = 16
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)
FORMATS = ("fp8", "nvfp4")
SOURCE_DTYPES = ("F32", "BF16", "F16")
SLAB_VALUES = 1 << 24  # source values converted to f32 at once (64 MB)
ST_DTYPE = {np.dtype(F32): "F32", np.dtype(E4M3): "F8_E4M3", np.dtype(np.uint8): "U8"}
# Tensors an architecture feeds to linear but that stay unquantized, as HF FP8 / ModelOpt releases keep them.
EXCLUDE = (
    (re.compile(r"embed"), "embedding"),
    (re.compile(r"(^|\.)lm_head\."), "output head (lm_head)"),
    (re.compile(r"\.mlp\.gate\.weight$|\.router(\.proj)?\.weight$|\.shared_expert_gate\.weight$"), "MoE router"),
)
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# -- the formats -------------------------------------------------------------------------------------------
def quantize_fp8(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) → e4m3 values (N, K) and f32 ``weight_scale_inv`` (ceil(N/b), ceil(K/b)): scale = tile amax / 448."""
    n, k = w.shape
    rb, cb = -(-n // block), -(-k // block)
    q = np.empty((n, k), E4M3)
    scale = np.empty((rb, cb), F32)
    step = max(1, SLAB_VALUES // max(k, 1) // block) * block
    for r in range(0, n, step):
        slab = np.asarray(w[r:r + step], F32)
        rows = slab.shape[0]
        pad = np.zeros((-(-rows // block) * block, cb * block), F32)
        pad[:rows, :k] = slab
        tiles = pad.reshape(-1, block, cb, block)
        amax = np.abs(tiles).max(axis=(1, 3))
        s = np.where(amax > 0, amax / F32(E4M3_MAX), F32(1)).astype(F32)
        scale[r // block:r // block + s.shape[0]] = s
        q[r:r + rows] = (tiles / s[:, None, :, None]).reshape(pad.shape)[:rows, :k].astype(E4M3)
    return q, scale


def dequantize_fp8(q: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    s = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[: q.shape[0], : q.shape[1]]
    return q.astype(F32) * s


def nvfp4_global_scale(amax: float) -> np.float32:
    """ModelOpt's ``weight_scale_2``: the tensor's amax / (6 × 448), so every block scale fits e4m3."""
    return F32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else F32(1.0)


def quantize_nvfp4(w: np.ndarray, scale_2: np.float32 | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(N, K) → packed codes U8 (N, K/2), e4m3 block scales (N, K/16), f32 global scale.

    Block scale = block amax / 6 / global, rounded to e4m3; each value is divided by the effective scale
    (e4m3 block scale × global), clipped to ±6 and rounded to the nearest E2M1 value (ties to even)."""
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"nvfp4 needs a multiple of {NVFP4_GROUP} columns, not {k}")
    if scale_2 is None:
        scale_2 = nvfp4_global_scale(_amax(w))
    packed = np.empty((n, k // 2), np.uint8)
    bscale = np.empty((n, k // NVFP4_GROUP), E4M3)
    step = max(1, SLAB_VALUES // max(k, 1))
    for r in range(0, n, step):
        g = np.asarray(w[r:r + step], F32).reshape(-1, k // NVFP4_GROUP, NVFP4_GROUP)
        bs = (np.abs(g).max(axis=-1) / (F32(E2M1_MAX) * scale_2)).astype(E4M3)
        eff = (bs.astype(F32) * scale_2)[..., None]
        x = np.divide(g, eff, out=np.zeros_like(g), where=eff > 0)
        codes = np.clip(x, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
        codes = codes.reshape(g.shape[0], k)
        packed[r:r + g.shape[0]] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        bscale[r:r + g.shape[0]] = bs
    return packed, bscale, F32(scale_2)


def dequantize_nvfp4(packed: np.ndarray, scale: np.ndarray, scale_2) -> np.ndarray:
    """U8 (N, K/2), e4m3 (N, K/16), scalar → f32 (N, K): (e2m1 × block scale) × global scale."""
    n = packed.shape[0]
    codes = np.empty((n, packed.shape[1] * 2), np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    vals = E2M1_VALUES[codes].reshape(n, -1, NVFP4_GROUP) * scale.astype(F32)[..., None]
    return (vals * F32(np.asarray(scale_2, F32).reshape(()))).reshape(n, -1)


def _amax(w: np.ndarray) -> float:
    step = max(1, SLAB_VALUES // max(w.shape[-1], 1))
    return max((float(np.abs(np.asarray(w[r:r + step], F32)).max(initial=0)) for r in range(0, w.shape[0], step)),
               default=0.0)


# -- the command -------------------------------------------------------------------------------------------
@dataclass
class _Out:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class _Job:
    """One source tensor and what it becomes (the weight and its scales, or an unchanged copy)."""

    name: str
    action: str  # "copy", "fp8", "nvfp4"
    outs: list[_Out]

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outs)


@dataclass
class QuantizeResult:
    output: Path
    format: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # linear weight left unquantized -> why
    files: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0

    def summary(self) -> str:
        by_reason: dict[str, list[str]] = {}
        for name, why in self.kept.items():
            by_reason.setdefault(why, []).append(name)
        lines = [f"quantized {len(self.quantized)} weight(s) to {self.format}: "
                 f"{_size(self.bytes_in)} -> {_size(self.bytes_out)} in {len(self.files)} file(s) at {self.output}"]
        for why, names in sorted(by_reason.items()):
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            lines.append(f"  kept as is ({why}): {', '.join(names[:4])}{more}")
        return "\n".join(lines)


def quantize_checkpoint(src, dst, fmt: str, block: int = 128, skip: str | None = None, force: bool = False,
                        max_shard_bytes: int = 5 << 30, progress: bool = True) -> QuantizeResult:
    """Quantize the linear weights of the HF checkpoint ``src`` into a new checkpoint directory ``dst``."""
    from .checkpoint.hf import HFCheckpoint

    src, dst = Path(src), Path(dst)
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if block < 1:
        raise InputError(f"--block must be a positive number of rows/columns, not {block}")
    try:
        skip_re = re.compile(skip) if skip else None
    except re.error as exc:
        raise InputError(f"--skip is not a valid regular expression ({skip!r}: {exc})") from None
    if not src.exists():
        raise CheckpointError(f"input checkpoint not found: {src}")
    if not src.is_dir():
        raise CheckpointError(f"--input must be a Hugging Face checkpoint directory, not a file: {src}")
    if dst.resolve() == src.resolve():
        raise InputError("--output must differ from --input (the input is read while the output is written)")
    if dst.exists() and not dst.is_dir():
        raise InputError(f"--output {dst} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise InputError(f"--output {dst} already exists and is not empty; pass --force to overwrite it")
    ckpt = HFCheckpoint(src)
    if ckpt.config.get("quantization_config"):
        method = ckpt.config["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{src} is already quantized (quant_method {method!r}); quantize a bf16/f16/f32 one")
    jobs, result = _plan_jobs(ckpt, fmt, block, skip_re)
    result.output = dst
    dst.mkdir(parents=True, exist_ok=True)
    for old in list(dst.glob("*.safetensors")) + list(dst.glob("model.safetensors.index.json")):
        old.unlink()  # --force: no stale shard may survive beside the new ones
    shards = _shard(jobs, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    bar = _progress(len(jobs), progress)
    for fname, shard in zip(names, shards, strict=True):
        _write_shard(dst / fname, shard, ckpt, fmt, block, bar)
    bar.close()
    if len(shards) > 1:
        weight_map = {o.name: fname for fname, shard in zip(names, shards, strict=True) for j in shard for o in j.outs}
        index = {"metadata": {"total_size": sum(j.nbytes for j in jobs)}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(src, dst)
    config = dict(ckpt.config)
    config["quantization_config"] = _quant_config(fmt, block, result)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    result.files = names
    result.bytes_in = sum(i.nbytes for i in ckpt.tensors.values())
    result.bytes_out = sum(j.nbytes for j in jobs)
    return result


def _plan_jobs(ckpt, fmt: str, block: int, skip_re) -> tuple[list[_Job], QuantizeResult]:
    from .plugins import get_registry

    arch = get_registry().architecture_class(ckpt.config.get("model_type", "<missing>")).from_checkpoint(ckpt)
    needed = {n for names in arch.layout(ckpt.tensors).needs.values() for n in names}
    result = QuantizeResult(output=Path(), format=fmt)
    jobs = []
    for name, info in ckpt.tensors.items():
        if info.dtype not in SOURCE_DTYPES and (name in needed and arch.is_matrix(name)):
            raise CheckpointError(
                f"{ckpt.path}: {name} is stored as {info.dtype}; lumen quantize reads f32/bf16/f16 checkpoints"
            )
        linear = name in needed and arch.is_matrix(name) and name.endswith(".weight") and len(info.shape) == 2
        why = _keep_reason(name, info, fmt, skip_re) if linear else None
        if linear and why:
            result.kept[name] = why
        if not linear or why:
            jobs.append(_Job(name, "copy", [_Out(name, info.dtype, info.shape, info.nbytes)]))
            continue
        n, k = info.shape
        if fmt == "fp8":
            rb, cb = -(-n // block), -(-k // block)
            outs = [_Out(name, "F8_E4M3", (n, k), n * k), _Out(name + "_scale_inv", "F32", (rb, cb), 4 * rb * cb)]
        else:
            g = k // NVFP4_GROUP
            outs = [_Out(name, "U8", (n, k // 2), n * k // 2), _Out(name + "_scale", "F8_E4M3", (n, g), n * g),
                    _Out(name + "_scale_2", "F32", (), 4)]
        jobs.append(_Job(name, fmt, outs))
        result.quantized.append(name)
    if not result.quantized:
        raise CheckpointError(f"{ckpt.path}: no weight to quantize (every linear weight was kept: {result.kept})")
    return jobs, result


def _keep_reason(name: str, info, fmt: str, skip_re) -> str | None:
    for pattern, why in EXCLUDE:
        if pattern.search(name):
            return why
    if skip_re is not None and skip_re.search(name):
        return "--skip"
    if fmt == "nvfp4" and info.shape[1] % NVFP4_GROUP:
        return f"{info.shape[1]} columns, not a multiple of {NVFP4_GROUP}"
    return None


def _shard(jobs: list[_Job], max_bytes: int) -> list[list[_Job]]:
    shards: list[list[_Job]] = [[]]
    size = 0
    for job in jobs:
        if shards[-1] and size + job.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += job.nbytes
    return shards


def layout(ckpt, fmt: str, block: int = 128) -> tuple[list[tuple[str, str, tuple, int]], dict]:
    """What ``quantize_checkpoint`` writes for ``ckpt``, without reading a tensor: the output tensors as (name,
    safetensors dtype, shape, bytes), in file order, and the ``quantization_config``."""
    jobs, result = _plan_jobs(ckpt, fmt, block, None)
    return [(o.name, o.dtype, o.shape, o.nbytes) for j in jobs for o in j.outs], _quant_config(fmt, block, result)


def shard_header(tensors) -> bytes:
    """A safetensors file's length prefix and header for ``tensors`` (name, dtype, shape, bytes), in order."""
    header, offset = {"__metadata__": {"format": "pt", "quantized_by": "lumen"}}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def _write_shard(path: Path, jobs: list[_Job], ckpt, fmt: str, block: int, bar) -> None:
    """Header first (every output's size is known from the source shapes), then each tensor's bytes."""
    with open(path, "wb") as f:
        f.write(shard_header((o.name, o.dtype, o.shape, o.nbytes) for j in jobs for o in j.outs))
        for job in jobs:
            bar.set_postfix_str(job.name, refresh=False)
            for out, arr in zip(job.outs, _run(job, ckpt, fmt, block), strict=True):
                raw = np.ascontiguousarray(arr)
                if raw.nbytes != out.nbytes or (job.action != "copy" and ST_DTYPE.get(raw.dtype) != out.dtype):
                    raise AssertionError(f"{out.name}: wrote {raw.dtype} {raw.shape}, header says {out}")
                f.write(memoryview(raw.reshape(-1).view(np.uint8)))
            bar.update(1)


def _run(job: _Job, ckpt, fmt: str, block: int) -> tuple[np.ndarray, ...]:
    w = ckpt.read(job.name)
    if job.action == "copy":
        return (w,)
    if job.action == "fp8":
        return quantize_fp8(w, block)
    packed, scale, scale_2 = quantize_nvfp4(w)
    return packed, scale, np.asarray(scale_2, F32).reshape(())


def _quant_config(fmt: str, block: int, result: QuantizeResult) -> dict:
    kept = sorted(n.removesuffix(".weight") for n in result.kept)
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                "activation_scheme": "dynamic", "modules_to_not_convert": kept}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP,
            "kv_cache_quant_algo": None, "exclude_modules": kept, "producer": {"name": "lumen"}}


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template...: every top-level file but the weights and config."""
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in ("config.json", "model.safetensors.index.json") \
                and not p.name.endswith(WEIGHT_FILES):
            shutil.copy2(p, dst / p.name)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise InputError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2000000")
    unit = m.group(2).rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def _size(n: int) -> str:
    for unit, b in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= b:
            return f"{n / b:.2f} {unit}"
    return f"{n} B"


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="quantizing", unit="tensor", file=sys.stderr, disable=not enabled, leave=False)


__all__ = ["E2M1_VALUES", "FORMATS", "NVFP4_GROUP", "QuantizeResult", "dequantize_fp8", "dequantize_nvfp4",
           "nvfp4_global_scale", "parse_size", "quantize_checkpoint", "quantize_fp8", "quantize_nvfp4"]
