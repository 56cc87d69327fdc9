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
