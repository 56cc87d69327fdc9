"""The CPU's one-token attention kernel (lumen_cpu.attention._decode_step: f32 caches read in place, a ring's slots
wrapping) against the general path (gather + softmax over the window), which a many-token call takes: each decode
step's output equals the same query's row of one call over the whole sequence."""

from __future__ import annotations

import numpy as np
import pytest
from lumen_cpu import attention as att

HQ, HKV, D, DV = 4, 2, 16, 8


def _qkv(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, HQ, D)).astype(np.float32), rng.normal(size=(n, HKV, D)).astype(np.float32),
            rng.normal(size=(n, HKV, DV)).astype(np.float32))


@pytest.mark.parametrize("ring,window,softcap", [(False, None, None), (False, 5, None), (True, 6, None),
                                                 (True, 6, 3.0), (False, None, 2.0)],
                         ids=["full", "full-window", "ring", "ring-softcap", "full-softcap"])
def test_one_token_steps_equal_one_call_over_the_sequence(ring, window, softcap):
    n, prompt = 20, 3  # a ring of 6 wraps three times
    q, k, v = _qkv(n, 0)
    make = (lambda: att.sliding_kv_cache(window, HKV, D, head_dim_v=DV)) if ring else \
        (lambda: att.kv_cache(32, HKV, D, head_dim_v=DV))
    whole = att.attention(q, k, v, make(), 0, 0.25, window, softcap)  # T > 1: the general path
    cache = make()
    att.attention(q[:prompt], k[:prompt], v[:prompt], cache, 0, 0.25, window, softcap)
    for t in range(prompt, n):
        step = att.attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache, t, 0.25, window, softcap)
        np.testing.assert_allclose(step[0], whole[t], rtol=1e-5, atol=1e-6)


def test_a_kv_sharing_reader_after_a_decode_step_reads_the_ring():
    window = 4
    q, k, v = _qkv(9, 1)
    cache = att.sliding_kv_cache(window, HKV, D, head_dim_v=DV)
    att.attention(q[:8], k[:8], v[:8], cache, 0, 0.5, window)
    written = att.attention(q[8:], k[8:], v[8:], cache, 8, 0.5, window)
    assert cache.recent[1] is None  # the one-token path leaves the ring to be read
    shared = att.attention_shared(q[8:], cache, 8, 0.5, window)
    np.testing.assert_allclose(shared, written, rtol=1e-5, atol=1e-6)  # two summation orders


def test_nan_in_a_value_reaches_the_output():
    q, k, v = _qkv(2, 2)
    v[0, 0, 0] = np.nan
    cache = att.kv_cache(4, HKV, D, head_dim_v=DV)
    att.attention(q[:1], k[:1], v[:1], cache, 0, 0.5)
    out = att.attention(q[1:], k[1:], v[1:], cache, 1, 0.5)
    assert np.isnan(out[0, 0]).any() and not np.isnan(out[0, HQ - 1]).any()  # only the heads that read it


@pytest.mark.parametrize("ring", [False, True], ids=["full", "ring"])
def test_unwritten_cache_slots_are_never_read(ring):
    """Caches are allocated without zeroing (np.empty): filled with NaN first, every prefill, decode step and
    KV-sharing read gives the numbers a zeroed cache gives, so no path reads a slot it has not written."""
    q, k, v = _qkv(14, 4)
    outs = []
    for fill in (0.0, np.nan):
        cache = att.sliding_kv_cache(5, HKV, D, head_dim_v=DV) if ring else att.kv_cache(32, HKV, D, head_dim_v=DV)
        cache.k[:], cache.v[:] = fill, fill
        window = 5 if ring else None
        got = [att.attention(q[:4], k[:4], v[:4], cache, 0, 0.25, window),
               att.attention_shared(q[:4], cache, 0, 0.25, window)]
        for t in range(4, 14):
            got.append(att.attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache, t, 0.25, window))
            got.append(att.attention_shared(q[t:t + 1], cache, t, 0.25, window))
        outs.append(np.concatenate([g.reshape(-1) for g in got]))
    assert np.isfinite(outs[1]).all() and np.array_equal(outs[0], outs[1])
