"""What one CPU-experts crossing of a captured GPU decode step costs, per LUMEN_HOSTCALL mode (lumen_cuda/hostcall.py).

One MoE layer's routed experts of the 35B-A3B shape (hidden 2048, expert width 512, 8 of 32 fp8 experts, 128 x 128
block scales) are asked 40 times in one CUDA graph (a 40-layer step's crossings with nothing else between them),
the graph replayed 10 times, three rounds; the same job asked from the host alone (``Server.ask``, no GPU) is the
job's own time. Baseline: ``python``, a Python host node per crossing (the default). Needs a GPU and the C library.

    python benchmarks/hostcall_crossings.py

Prints per mode the µs a crossing takes in the graph, that less the job's own time (the crossing's overhead), and
the ratio to the baseline; each mode's output is checked equal to the CPU path's to the bit.
"""

from __future__ import annotations

import time

import cupy as cp
import ml_dtypes
import numpy as np
from lumen_cpu import hostjob, moe_fused
from lumen_cuda import hostcall
from lumen_cuda.step import StepInputs

from lumen_core.backend import Weight, scale_block

F32 = np.float32
H, I, E, K, LAYERS, REPLAYS = 2048, 512, 32, 8, 40, 10


class _Target:  # the CPU backend as hostcall sees it
    def host_jobs(self):
        return hostjob


class _Owner:  # the GPU backend that keeps the mailbox
    pass


def _experts(rng):
    def one(n, k):
        data = (rng.normal(size=(n, k)) * 40).astype(ml_dtypes.float8_e4m3fn)
        s = rng.uniform(0.5, 2, size=(-(-n // 128), -(-k // 128))).astype(F32) * 0.01
        return Weight(data, "fp8", (n, k), s, scale_block((n, k), s.shape))

    return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]


def _graph(queue, args):
    """LAYERS crossings captured in one graph, each fed the previous output times 0 plus x (so the same job)."""
    s = cp.cuda.Stream(non_blocking=False)
    with s:
        s.begin_capture()
        o = args[0]
        for _ in range(LAYERS):
            o = queue([o.reshape(1, H) * 0 + args[0], args[1], args[2]])
        return s, s.end_capture(), o


def _time(s, g, arm) -> float:
    best = []
    for _ in range(3):
        arm()
        t = time.perf_counter()
        for _ in range(REPLAYS):
            g.launch(s)
        s.synchronize()
        best.append((time.perf_counter() - t) / (REPLAYS * LAYERS))
    return min(best)


def main() -> None:
    rng = np.random.default_rng(0)
    gate_up, down = _experts(rng)

    def fn(x, ids, w):
        return moe_fused.experts(x, ids, w, gate_up, down, "silu")

    x = rng.normal(size=(1, H)).astype(F32)
    ids = rng.choice(E, size=(1, K), replace=False).astype(np.int64)
    w = rng.uniform(size=(1, K)).astype(F32)
    want = fn(x, ids, w)
    args = [cp.asarray(x), cp.asarray(ids), cp.asarray(w)]
    rows, job_s = {}, None
    owner, target = _Owner(), _Target()
    for how in ("native", "node"):
        nc = hostcall.NativeCall.make(owner, target, fn, args, how)
        assert nc is not None, "the experts are not a native job here (is lumen_cpu's C library built?)"
        nc.queue(args)
        cp.cuda.Device().synchronize()  # compiles, warms
        if job_s is None:
            nc.server.arm(100)
            t = time.perf_counter()
            for _ in range(100):
                nc.server.ask(nc.index)
            job_s = (time.perf_counter() - t) / 100
        s, g, o = _graph(nc.queue, args)
        rows[how] = _time(s, g, lambda nc=nc: nc.server.arm(LAYERS * REPLAYS))
        assert np.array_equal(cp.asnumpy(o), want), how
    step = StepInputs(cp.zeros((1,), cp.int64), cp.zeros((1,), cp.int32))
    s, g, o = _graph(lambda a: hostcall.call(fn, a, step, None, None), args)
    g.launch(s)
    s.synchronize()  # the first replay runs numba's first parallel calls on the driver thread
    rows["python"] = _time(s, g, lambda: None)
    assert np.array_equal(cp.asnumpy(o), want), "python"
    print(f"one layer's experts asked from the host alone: {job_s * 1e6:.1f} µs "
          f"({hostjob.server_threads(moe_fused.get_num_threads())} server threads)\n")
    print("| LUMEN_HOSTCALL | µs a crossing | overhead µs (less the job) | vs python |")
    print("|---|---:|---:|---:|")
    for how in ("python", "node", "native"):
        print(f"| {how} | {rows[how] * 1e6:.1f} | {(rows[how] - job_s) * 1e6:.1f} | "
              f"{rows['python'] / rows[how]:.2f}x |")


if __name__ == "__main__":
    main()
