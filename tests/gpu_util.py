"""Helpers shared by the GPU test files (the `cp` fixture that skips without a GPU lives in conftest.py)."""

from __future__ import annotations

import numpy as np


def host(x):
    """numpy of a device array (anything with .get()), or the numpy array itself."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def close(got, want, tol=1e-5):
    """Every element written (finite) and max |got - want| <= tol × max(1, max |want|)."""
    got, want = host(got).astype(np.float64), host(want).astype(np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err, scale = np.abs(got - want).max(initial=0.0), max(1.0, np.abs(want).max(initial=0.0))
    assert err <= tol * scale, f"max |Δ| {err:.3g} > {tol * scale:.3g}"
    return err


def greedy_run(model, ids, context: int, steps: int):
    """(prefill logits of every row, ``steps`` greedy tokens, their logits) from a fresh cache of ``context``."""
    cache = model.new_cache(context)
    prefill = model.forward(ids, cache, all_logits=True)
    logits, tokens, out = prefill[-1:], [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward([tokens[-1]], cache)
        out.append(logits[-1])
    return prefill, tokens, np.stack(out)
