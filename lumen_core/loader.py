"""Load each component's tensors onto its backend, and account for every tensor in the checkpoint."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .architecture import Architecture, Component, TensorLayout, component_label
from .errors import CheckpointError
from .plan import SCALE_SUFFIX, weight_format


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


def load_component(ckpt, arch: Architecture, backend, store: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        array = ckpt.read(name)
        if arch.is_matrix(name):
            scale = ckpt.tensors.get(name + SCALE_SUFFIX)
            scale_arr = ckpt.read(scale.name) if scale else None
            out[name] = backend.weight(array, weight_format(ckpt, name), store, scale=scale_arr)
        else:
            out[name] = backend.tensor(array)
    return out


def load_weights(ckpt, arch: Architecture, layout: TensorLayout, placements: dict, backends: dict,
                 progress: bool = True) -> tuple[dict[Component, dict], LoadReport]:
    report = check_tensors(ckpt, layout)
    weights: dict[Component, dict] = {}
    bar = _progress(len(layout.needs), progress)
    for comp, names in layout.needs.items():
        bar.set_postfix_str(component_label(comp), refresh=False)
        weights[comp] = load_component(ckpt, arch, backends[comp], placements[comp].store, names)
        bar.update(1)
    bar.close()
    if report.unused:
        print(f"lumen: {len(report.unused)} checkpoint tensor(s) unused: {', '.join(report.unused[:8])}",
              file=sys.stderr)
    return weights, report


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="loading", unit="component", file=sys.stderr,
                disable=not enabled or total < 2, leave=False)
