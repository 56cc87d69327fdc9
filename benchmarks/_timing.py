"""Timing helpers shared by the benchmarks: thread pinning, machine description, and measurements that
notice (and redo) a block during which other processes kept the cores busy."""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from pathlib import Path


def limit_threads(n: int) -> None:
    """Before numpy/torch are imported: pin every BLAS/OpenMP pool to n threads (unless the user set one)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n))


def machine() -> dict:
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def cpu_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Probe:
    """Wall time of a block, and how busy the cores were with *other* processes meanwhile (busy CPU time
    minus this process's own, as a fraction of all cores over the block): ~0 on a quiet machine."""

    def __enter__(self):
        gc.collect()
        self.busy, self.own, self.t0 = cpu_busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        own, busy = time.process_time() - self.own, cpu_busy_s()
        slack = 2 / os.sysconf("SC_CLK_TCK")  # /proc/stat counts in ticks: allow the rounding of two reads
        self.foreign = (None if busy is None or self.busy is None
                        else max(0.0, (busy - self.busy - own - slack) / (self.wall * (os.cpu_count() or 1))))
        return False


def measured(fn, args, label: str):
    """fn() -> (Probe, result). Repeat while other processes kept the cores busy (> --max-foreign) during
    the probe, up to --tries times; -> (seconds, result, record of every attempt)."""
    attempts = []
    for _ in range(max(1, args.tries)):
        quiet_pause()
        probe, out = fn()
        attempts.append({"s": probe.wall, "foreign": probe.foreign})
        if probe.foreign is None or probe.foreign <= args.max_foreign:
            break
        print(f"  {label}: other processes kept {probe.foreign:.0%} of the cores busy; measuring again",
              file=sys.stderr)
        time.sleep(args.backoff)
    return probe.wall, out, attempts


def quiet_pause():
    # Let the other runtime's spinning worker threads (OpenBLAS / OpenMP busy-wait) go to sleep first.
    time.sleep(0.2)


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second a parallel numba loop reads from DRAM: 4096 rows of uint64 words summed, eight
    independent sums a row (one sum per row would be bound by its add latency, not by memory)."""
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def total(words):
        out = np.empty(words.shape[0], np.uint64)
        for r in prange(words.shape[0]):
            row, s = words[r], np.zeros(8, np.uint64)
            for i in range(0, row.shape[0], 8):
                for j in range(8):
                    s[j] += row[i + j]
            out[r] = s.sum()
        return out

    words = np.ones((4096, nbytes // 8 // 4096), np.uint64)
    total(words[:2])
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        total(words)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
