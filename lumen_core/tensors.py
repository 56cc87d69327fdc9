"""Accounting for checkpoint tensors: what is needed, missing, skipped on purpose, or left unused."""

from __future__ import annotations

from dataclasses import dataclass, field

from .architecture import TensorLayout
from .errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # HF FP8: ``X.weight_scale_inv`` belongs to ``X.weight``


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
    scales = {n + SCALE_SUFFIX for n in needed}
    unused = sorted(set(ckpt.tensors) - needed - scales - set(layout.skipped))
    skipped = {n: r for n, r in layout.skipped.items() if n in ckpt.tensors}
    return LoadReport(loaded=needed | (scales & set(ckpt.tensors)), skipped=skipped, unused=unused)
