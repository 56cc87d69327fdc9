"""Routed experts' prefill on the GPU, one MoE layer at the real shapes: the grouped path's tensor-core kernels (the
default, ``lumen_cuda.fp8_mma``: bf16 MMA, activations as three bf16 planes, f32-exact products) against the
CUDA-core grouped kernels they replaced (``LUMEN_CUDA_MMA_PREFILL=0``, the named baseline), for every expert
format, in one run.

    python benchmarks/cuda_moe_prefill.py [--tokens 512,4096] [--reps 10] [--slots 16,32,64] [--pipes 2x1,3x2]
                                          [--json PATH]

Rows: the Qwen3.5-35B-A3B experts (256 of 2048 x 512, top 8) in fp8 (128 x 128 block scales), NVFP4 and bf16
(per-expert lists, as Qwen's checkpoints load), and the Gemma-4-26B-A4B experts (128 of 2816 x 704, top 8) packed
bf16 (E, 2I, H) as Gemma 4's load. Random weights, uniform random routing. Each call is ``moe.experts`` /
``experts_packed`` (bucketing, gate, up, activation, down, weighted sum), timed with CUDA events, median of --reps
after a warm-up. "bound" is the larger of the expert bytes the call must read once (every expert some token picks:
all of them at these T) over the read bandwidth measured in the same run, and its useful FLOPs (2 x 3 x I x H per
slot) over the dense bf16 tensor-core rate (990 TFLOP/s, the H100 / H200 SXM datasheet: a lead, not a
measurement). "max diff": the two paths' largest output difference over the largest output (f32 rounding order).
The default block width in slots is ``fp8_mma_model.slot_block``'s (printed); ``--slots`` also times each width
forced (``LUMEN_CUDA_X3_SLOTS``), the data the default was chosen from; ``--pipes`` times the default width with
each x3 pipeline forced (``fp8_mma.x3_pipe`` replaced: STAGESxKMUL, stages in flight x the stage's columns over the
format's base; 2x1 is the two-stage geometry before the deeper pipeline; the device's own choice is printed). Dev
tool: needs cupy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np
from cuda_fp8_gemm import timed  # CUDA-event median of reps calls after a warm-up

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PEAK_BF16 = 990e12
ROWS = [("35B-A3B fp8", 256, 8, 2048, 512, "fp8-block128"), ("35B-A3B nvfp4", 256, 8, 2048, 512, "nvfp4"),
        ("35B-A3B bf16", 256, 8, 2048, 512, "bf16"), ("26B-A4B bf16 packed", 128, 8, 2816, 704, "packed")]
BYTES = {"fp8-block128": 1.0, "nvfp4": 0.5 + 1 / 16, "bf16": 2.0, "packed": 2.0}  # per weight, scales included


def read_bandwidth() -> float:
    a = cp.ones(1 << 29, cp.float32)  # 2 GiB, read once per sum
    a.sum()
    cp.cuda.Device().synchronize()
    ev = cp.cuda.Event(), cp.cuda.Event()
    ev[0].record()
    for _ in range(5):
        a.sum()
    ev[1].record()
    ev[1].synchronize()
    return 5 * a.nbytes / (cp.cuda.get_elapsed_time(*ev) / 1e3)


def layer(gpu, rng, E: int, H: int, I: int, kind: str):
    """The layer's expert weights and the call that runs them on (x, ids, weights)."""
    from lumen_cuda import moe
    from test_cuda_moe import experts

    if kind == "packed":
        gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        return lambda x, ids, w: moe.experts_packed(x, ids, w, gate_up, down, "gelu_tanh")
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    return lambda x, ids, w: moe.experts(x, ids, w, gate_up, down, "silu")


def both(run, inputs, reps: int, slots=(), pipes=()) -> tuple[dict, float]:
    """The call's median time with LUMEN_CUDA_MMA_PREFILL=0, unset, unset with each forced block width in ``slots``
    and with each forced pipeline in ``pipes`` (keys "0", "", "s16" ..., "p3x2" ...), and the largest difference of
    any of them from "0" over its largest output."""
    from lumen_cuda import fp8_mma

    got, out, chosen = {}, {}, fp8_mma.x3_pipe
    runs = [("0", "", None), ("", "", None)] + [("", str(n), None) for n in slots] + [("", "", p) for p in pipes]
    for mode, width, pipe in runs:
        os.environ["LUMEN_CUDA_MMA_PREFILL"] = mode
        os.environ["LUMEN_CUDA_X3_SLOTS"] = width
        fp8_mma.x3_pipe = (lambda p=pipe: p) if pipe else chosen
        key = f"p{pipe[0]}x{pipe[1]}" if pipe else f"s{width}" if width else mode
        got[key] = timed(lambda: run(*inputs), reps)
        out[key] = cp.asnumpy(run(*inputs)).astype(np.float64)
    fp8_mma.x3_pipe = chosen
    os.environ.pop("LUMEN_CUDA_MMA_PREFILL")
    os.environ.pop("LUMEN_CUDA_X3_SLOTS")
    return got, max(float(np.abs(o - out["0"]).max() / np.abs(out["0"]).max()) for o in out.values())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--slots", default="16,32,64",
                    help="block widths to time forced besides the default's choice (empty: none)")
    ap.add_argument("--pipes", default="",
                    help="x3 pipelines to time forced at the default width, STAGESxKMUL comma-separated (e.g. 2x1,3x2)")
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="row names, comma-separated")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from lumen_cuda import fp8_mma
    from lumen_cuda.fp8_mma_model import slot_block

    try:
        pipes = [tuple(int(v) for v in p.split("x")) for p in args.pipes.split(",") if p]
    except ValueError:
        raise SystemExit(f"--pipes {args.pipes!r}: expected STAGESxKMUL entries, e.g. 2x1,3x2") from None
    if any(len(p) != 2 or p[0] < 2 or p[1] < 1 for p in pipes):
        raise SystemExit(f"--pipes {args.pipes!r}: each entry is STAGESxKMUL with STAGES >= 2, KMUL >= 1")

    from lumen_core.plugins import get_registry

    reg = get_registry()
    gpu = reg.backend_class("cuda")("cuda:0", reg)
    bw = read_bandwidth()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; read bandwidth {bw / 1e9:.0f} GB/s; "
          f"x3 pipeline (stages x column multiple): {fp8_mma.x3_pipe()}")
    wanted = set(args.rows.split(","))
    widths = [int(n) for n in args.slots.split(",") if n]
    results = []
    print("| experts | T | CUDA-core grouped (=0) | tensor cores (default) | default's slots | "
          + "".join(f"{n} slots | " for n in widths) + "".join(f"pipe {p[0]}x{p[1]} | " for p in pipes)
          + "speed-up | bound | bound / default | max diff |")
    print("|---|---:|---:|---:|---:|" + "---:|" * (len(widths) + len(pipes)) + "---:|---:|---:|---:|")
    for name, E, k, H, I, kind in ROWS:
        if name not in wanted:
            continue
        rng = np.random.default_rng(len(name))
        run = layer(gpu, rng, E, H, I, kind)
        for T in (int(t) for t in args.tokens.split(",")):
            x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
            ids = cp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64))
            w = cp.asarray(np.full((T, k), 1.0 / k, np.float32))
            got, diff = both(run, (x, ids, w), args.reps, widths, pipes)
            picked = len(np.unique(cp.asnumpy(ids)))
            nbytes = picked * 3 * H * I * BYTES[kind]
            flops = 2 * T * k * 3 * H * I
            bound = max(nbytes / bw, flops / PEAK_BF16)
            row = {"experts": name, "T": T, "cuda_core_ms": got["0"] * 1e3, "tensor_core_ms": got[""] * 1e3,
                   "speedup": got["0"] / got[""], "bound_ms": bound * 1e3, "fraction": bound / got[""],
                   "max_diff": diff, "default_slots": slot_block({}),
                   "forced_ms": {n: got[f"s{n}"] * 1e3 for n in widths}, "pipeline": list(fp8_mma.x3_pipe()),
                   "pipes_ms": {f"{p[0]}x{p[1]}": got[f"p{p[0]}x{p[1]}"] * 1e3 for p in pipes}}
            results.append(row)
            print(f"| {name} | {T} | {row['cuda_core_ms']:.3f} ms | {row['tensor_core_ms']:.3f} ms | "
                  f"{row['default_slots']} | " + "".join(f"{got[f's{n}'] * 1e3:.3f} ms | " for n in widths)
                  + "".join(f"{got[f'p{p[0]}x{p[1]}'] * 1e3:.3f} ms | " for p in pipes)
                  + f"{row['speedup']:.2f}x | {row['bound_ms']:.3f} ms | {row['fraction']:.1%} | {diff:.1e} |",
                  flush=True)
        run = None
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        Path(args.json).write_text(json.dumps({"read_bandwidth": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
