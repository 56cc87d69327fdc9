"""Rotary tables, computed on the host: the math every backend shares (principle 7). A backend's ``rope_tables``
op returns these values on its device; the CPU backend returns them as they are."""

from __future__ import annotations

import numpy as np

F32 = np.float32


def rope_tables(positions, inv_freq, mrope_section=None, interleaved=False):
    """cos/sin (T, rot) for positions (T,) or (3, T) (M-RoPE: temporal, height, width rows)."""
    pos = np.asarray(positions, dtype=F32)
    inv = np.asarray(inv_freq, dtype=F32)
    if pos.ndim == 1:
        freqs = pos[:, None] * inv[None, :]
    else:
        freqs = _mrope_freqs(pos, inv, mrope_section, interleaved)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def _mrope_freqs(pos, inv, section, interleaved):
    per_axis = pos[:, :, None] * inv[None, None, :]  # (3, T, rot/2)
    out = per_axis[0].copy()
    if interleaved:  # frequency i takes axis i % 3 while that axis' section lasts
        for axis in (1, 2):
            idx = np.arange(axis, section[axis] * 3, 3)
            out[:, idx] = per_axis[axis][:, idx]
        return out
    start = 0
    for axis, n in enumerate(section):
        out[:, start:start + n] = per_axis[axis][:, start:start + n]
        start += n
    return out
