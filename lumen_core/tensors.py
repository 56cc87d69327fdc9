"""Accounting for checkpoint tensors: what is needed, missing, skipped on purpose, or left unused."""

from __future__ import annotations

from dataclasses import dataclass, field

from .architecture import TensorLayout
from .errors import CheckpointError

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
    skipped = {n: r for n, r in layout.skipped.items() if n in ckpt.tensors}
    skipped.update((n, "activation scale: Lumen keeps activations unquantized") for n in sorted(inputs))
    return LoadReport(loaded=needed | (scales & set(ckpt.tensors)), skipped=skipped, unused=unused)
