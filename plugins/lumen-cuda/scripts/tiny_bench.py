"""Prefill and per-token decode time of small random checkpoints, cpu vs cuda:0.

The tiny models are launch-bound: they measure per-op overhead (CuPy launches, host syncs), the number the
hand-written kernels and CUDA-graph decode must shrink. The "medium" Qwen 3.5 (f32, ~0.4B parameters) shows
how far the CuPy baseline is from the bandwidth bound. Usage: python tiny_bench.py [steps]
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
COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (docs/cuda.md)
MEDIUM = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
              linear_key_head_dim=128, linear_value_head_dim=128)
MODELS = (("qwen3_5", {}), ("qwen3_5_moe", {}), ("gemma4", {}), ("qwen3_5-medium", MEDIUM))


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
    head = ("model", "device", "weights MB", "prefill ms", "decode ms/tok", "% of bw bound")
    print(f"{head[0]:15} {head[1]:7} {head[2]:>10} {head[3]:>10} {head[4]:>13} {head[5]:>13}")
    for name, over in MODELS:
        path = mk.make(name.split("-")[0], Path(tempfile.mkdtemp()), **over)
        for compute, store in (("cpu", "ram"), ("cuda:0", "vram")):
            engine = lumen.load({"model": {"path": str(path), "compute": compute, "store": store,
                                           "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}, progress=False)
            nbytes = sum(e.nbytes for e in engine.plan.entries if e.kind != "cache")
            ids = np.random.RandomState(0).randint(3, engine.model.vocab_size, PROMPT).tolist()
            timed(engine.model, ids, 2)  # warm-up: CuPy compiles its elementwise kernels on first use
            pre, dec = timed(engine.model, ids, steps if compute != "cpu" or not over else 4)
            bound = f"{100 * nbytes / COPY_BW / dec:12.1f}%" if compute != "cpu" else ""
            print(f"{name:15} {compute:7} {nbytes / 1e6:10.1f} {pre * 1e3:10.1f} {dec * 1e3:13.2f} {bound:>13}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
