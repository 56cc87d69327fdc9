"""Prefill and per-token decode time of tiny random checkpoints, cpu vs cuda:0.

Tiny models are launch-bound, so this measures per-op overhead (CuPy launches, host syncs), not bandwidth:
the number the hand-written kernels and CUDA-graph decode must shrink. Usage: python tiny_bench.py [steps]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import lumen_core as lumen

ROOT = Path(__file__).resolve().parents[3]
PROMPT, CONTEXT = 128, 512


def maker():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", ROOT / "scripts" / "make_tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(model, ids, steps: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decoded token); forward returns host logits, so each call is synced."""
    cache = model.new_cache(CONTEXT)
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    t1 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward([int(np.argmax(logits[-1]))], cache)
    return t1 - t0, (time.perf_counter() - t1) / steps


def main(steps: int = 32) -> None:
    mk = maker()
    print(f"{'model':14} {'device':7} {'prefill ms':>10} {'decode ms/tok':>13}")
    for kind, over in (("qwen3_5", {}), ("qwen3_5_moe", {}), ("gemma4", {})):
        path = mk.make(kind, Path(tempfile.mkdtemp()), **over)
        for compute, store in (("cpu", "ram"), ("cuda:0", "vram")):
            engine = lumen.load({"model": {"path": str(path), "compute": compute, "store": store,
                                           "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}, progress=False)
            ids = np.random.RandomState(0).randint(3, engine.model.vocab_size, PROMPT).tolist()
            timed(engine.model, ids, 2)  # warm-up: CuPy compiles its elementwise kernels on first use
            pre, dec = timed(engine.model, ids, steps)
            print(f"{kind:14} {compute:7} {pre * 1e3:10.1f} {dec * 1e3:13.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
