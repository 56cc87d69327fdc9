"""Decode step on the GPU with and without the fused decode ops and PDL, in one run: the unfused step (the named
baseline, ``base``: ``LUMEN_CUDA_DECODE_FUSION=0``), the fused step (``fused``: the shared expert as a routed slot, the
fused norms, the gates in the Gated-DeltaNet step) and that with the opt-ins: ``LUMEN_CUDA_PDL`` (``fused+pdl``,
``-noprefetch``, ``-late``: programmatic dependent launch in the captured step) and ``LUMEN_CUDA_PARTIAL_FUSION=1``
(``fused+partial``: the agreeing members of a projection group fused where others differ, e.g. the Gated-DeltaNet's fp8
qkv, z, b, a in one launch) and ``LUMEN_CUDA_ROUTE_IN_EXPERTS=1`` (``fused+route``: the MoE routing inside the gate/up
kernel, one launch fewer a MoE layer) and ``LUMEN_CUDA_MOE_GATE_UP_BLOCKS=5`` (``fused+gu5``: the gate/up kernels
compiled to fit 5 blocks an SM) and ``LUMEN_CUDA_GDN_DECODE=1`` (``fused+gdn``: the Gated-DeltaNet's conv, step and
gated norm in one kernel) and ``LUMEN_CUDA_MOE_DOWN_SPLIT=1`` (``fused+split``: the one-token down GEMV with the
slots over the block's warps); ``fused+all``: all of them but the last (PDL as ``noprefetch``), ``all+split`` with
it, ``all-<one>``: all but that one.
Every variant sets every setting (``fused``: fusion on, every other one off), whatever the defaults; ``default`` sets
none (what a user gets). Per row and variant: the captured decode graph
replayed alone (GPU ms a step, the median of ``--repeat`` runs of ``--steps`` replays), tok/s, the fraction of the
bandwidth bound (bytes a step reads / the read bandwidth measured in the same run; a MoE step reads top-k of E routed
experts) and the ratio to ``base``; then the greedy tokens of each variant against ``base``'s (the fusions change the
MoE sum's f32 order only).

    python benchmarks/cuda_decode_paths.py [--models 35b-a3b-fp8,9b-fp8] [--layers 4] [--steps 64] [--repeat 5]
    python benchmarks/cuda_decode_paths.py --models 35b-a3b-fp8 --layers 40   # the real depth (35.7 GB of disk)

Checkpoints: ``full_depth.write_checkpoint`` (random weights written in their format, no bf16 copy) under
``--workdir``, kept. ``--layers`` defaults to one period of each shape's layer kinds (4 for Qwen 3.5; Gemma-4-26B-A4B:
6), where the per-layer launch overhead these paths attack is the larger share; at the real depth the lm_head's share
shrinks. Dev tool: cupy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KNOBS = ("LUMEN_CUDA_DECODE_FUSION", "LUMEN_CUDA_PDL", "LUMEN_CUDA_PARTIAL_FUSION", "LUMEN_CUDA_ROUTE_IN_EXPERTS",
         "LUMEN_CUDA_MOE_GATE_UP_BLOCKS", "LUMEN_CUDA_GDN_DECODE", "LUMEN_CUDA_MOE_DOWN_SPLIT")
# Every variant sets every knob, so that a row means the same whatever the defaults are; ``default`` sets none.
_OFF = dict.fromkeys(KNOBS, "0") | {"LUMEN_CUDA_DECODE_FUSION": "1"}
_ON = {"pdl": {"LUMEN_CUDA_PDL": "1"}, "pdl-noprefetch": {"LUMEN_CUDA_PDL": "noprefetch"},
       "pdl-late": {"LUMEN_CUDA_PDL": "late"}, "partial": {"LUMEN_CUDA_PARTIAL_FUSION": "1"},
       "route": {"LUMEN_CUDA_ROUTE_IN_EXPERTS": "1"}, "gu5": {"LUMEN_CUDA_MOE_GATE_UP_BLOCKS": "5"},
       "gdn": {"LUMEN_CUDA_GDN_DECODE": "1"}, "split": {"LUMEN_CUDA_MOE_DOWN_SPLIT": "1"}}
_ALL = ("partial", "route", "gu5", "gdn", "pdl-noprefetch")


def _variant(*parts: str) -> dict:
    env = dict(_OFF)
    for part in parts:
        env |= _ON[part]
    return env


VARIANTS = {"base": _OFF | {"LUMEN_CUDA_DECODE_FUSION": "0"}, "fused": _variant(), "default": {},
            **{f"fused+{k}": _variant(k) for k in _ON},
            "fused+partial+pdl-noprefetch": _variant("partial", "pdl-noprefetch"),
            "fused+partial+route+pdl-noprefetch": _variant("partial", "route", "pdl-noprefetch"),
            "fused+all": _variant(*_ALL), "all+split": _variant(*_ALL, "split"),
            **{f"all-{k}": _variant(*(o for o in _ALL if o != k)) for k in _ALL}}


def replay_ms(cp, runner, steps: int, repeat: int) -> float:
    stream, times = runner.stream, []
    for _ in range(repeat):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        with stream:
            e0.record(stream)
            for _ in range(steps):
                runner.graph.launch(stream)
            e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / steps)
    return statistics.median(times)


def run_variant(path: Path, env: dict, steps: int, repeat: int) -> tuple[float, list[int]]:
    import cupy as cp
    import numpy as np

    import lumen_core as lumen
    from lumen_core.sampling import SamplingParams

    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update(env)
    config = {"model": {"path": str(path), "compute": "cuda:0", "store": "vram",
                        "hidden-layers": {"kv-cache": {"context-size": 64 + steps + 16}}}}
    engine = lumen.load(config, progress=False)
    try:
        ids = np.random.RandomState(0).randint(0, engine.model.vocab_size, 64).tolist()
        greedy = SamplingParams(temperature=0.0)
        tokens = list(engine.generate_tokens(ids, 16, greedy))  # captures the step with this variant's env
        runner = engine.decode_runner()
        if not runner:
            raise SystemExit(f"{path.name}: the decode step was not captured")
        return replay_ms(cp, runner, steps, repeat), tokens
    finally:
        engine.close()
        for k in KNOBS:
            os.environ.pop(k, None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="35b-a3b-fp8,9b-fp8", help="shape-format pairs, as cuda_models.py names them")
    p.add_argument("--layers", type=int, default=0, help="layers (0: one period of the shape's layer kinds)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or variants[0] != "base":
        raise SystemExit(f"--variants: {bad or variants[0]!r}: the first must be base (the baseline), then any of "
                         f"{', '.join(VARIANTS)}")
    from cuda_models import FULL_DEPTH, bytes_per_token, read_bandwidth
    from full_depth import write_checkpoint

    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e9:.0f} GB/s\n")
    print("| model | layers | variant | graph ms/step | tok/s | % of bound | vs base | tokens as base |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        shape, fmt = name.rsplit("-", 1)
        if shape not in FULL_DEPTH:
            raise SystemExit(f"--models: unknown shape {shape!r} (one of {', '.join(FULL_DEPTH)})")
        layers = args.layers or FULL_DEPTH[shape][1]
        path = write_checkpoint(shape, layers, fmt, Path(args.workdir))
        step_bytes = bytes_per_token(path)[0]
        base_ms = base_tokens = None
        for v in variants:
            ms, tokens = run_variant(path, VARIANTS[v], args.steps, args.repeat)
            if base_ms is None:
                base_ms, base_tokens = ms, tokens
            bound = step_bytes / bw * 1e3  # ms
            agree = sum(a == b for a, b in zip(tokens, base_tokens, strict=True))
            same = "yes" if tokens == base_tokens else f"no ({agree}/{len(tokens)})"
            print(f"| {name} | {layers} | {v} | {ms:.3f} | {1e3 / ms:.1f} | {bound / ms:.1%} | {base_ms / ms:.2f}x "
                  f"| {same} |", flush=True)


if __name__ == "__main__":
    main()
