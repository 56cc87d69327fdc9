"""wgpu Gated-DeltaNet ops (causal conv, gated delta rule, gdn_gates) against the CPU backend.

A prompt of 80 tokens (more than one of the CPU's 64-token chunks: its chunked form against the wgpu recurrence),
then decode steps on the states it left, outputs and states compared after each call; inputs as strided views of
one projection's output, as the model hands them over. Qwen 3.5 9B's shapes (Hk 16, Hv 32, Dk = Dv 128, 8192 conv
channels, K 4) and small odd ones (Dk not a multiple of 8, Dv not of 32, K-1 longer than a decode step).
Tolerance: 1e-5 relative (gpu_util.close), states of the conv exact (they are copies).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import close

pytestmark = pytest.mark.wgpu

DECODE = 3


def test_wgpu_registers_the_gated_deltanet_ops(wgpu_pair):
    from lumen_core.plugins import get_registry

    ops = get_registry().ops_of("wgpu")
    assert {"conv_state", "causal_conv1d", "delta_state", "gated_delta_rule", "gdn_gates"} <= ops


@pytest.mark.parametrize("T,C,K", [(80, 8192, 4), (2, 100, 4), (20, 33, 2), (1, 10, 5)])
def test_causal_conv1d_matches_cpu(wgpu_pair, T, C, K):
    wg, cpu = wgpu_pair
    rng = np.random.default_rng(T + C)
    w = rng.standard_normal((C, K)).astype(np.float32)
    wg.use()
    ws, cs = wg.ops.conv_state(C, K), cpu.ops.conv_state(C, K)
    assert ws.x.shape == (K - 1, C) and not ws.x.get().any()
    ww = wg.tensor(w)
    for n in [T] + [1] * DECODE:
        x = rng.standard_normal((n, C + 9)).astype(np.float32)
        xv = wg.tensor(x)[:, 5:5 + C]  # a column view: row stride C + 9
        got = wg.ops.causal_conv1d(xv, ww, ws)
        want = cpu.ops.causal_conv1d(x[:, 5:5 + C], w, cs)
        close(got, want)
        assert np.array_equal(ws.x.get(), cs.x)


def qkv_views(wg, rng, T, Hk, Hv, Dk, Dv):
    """Host q, k, v, g, beta and the same as strided wgpu views of wider tensors."""
    q, k = (rng.standard_normal((T, Hk, Dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32) * 2
    g = (-np.abs(rng.standard_normal((T, Hv))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, Hv))))).astype(np.float32)
    qk = wg.tensor(np.stack([q, k], axis=1))  # (T, 2, Hk, Dk): q = [:, 0] has row stride 2 Hk Dk
    vw = wg.tensor(np.concatenate([v, np.zeros((T, Hv, 3), np.float32)], axis=-1))[..., :Dv]
    gb = wg.tensor(np.concatenate([g, beta], axis=1))  # g and beta: column views of one (T, 2 Hv)
    views = (qk[:, 0], qk[:, 1], vw, gb[:, :Hv], gb[:, Hv:])
    assert T == 1 or not any(x.is_dense for x in views)
    return (q, k, v, g, beta), views


@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(16, 32, 128, 128), (2, 4, 16, 8), (3, 3, 12, 40)],
                         ids=["qwen3.5-9b", "small", "odd"])
def test_gated_delta_rule_matches_cpu(wgpu_pair, Hk, Hv, Dk, Dv):
    wg, cpu = wgpu_pair
    rng = np.random.default_rng(Dk + Dv)
    wg.use()
    ws, cs = wg.ops.delta_state(Hv, Dk, Dv), cpu.ops.delta_state(Hv, Dk, Dv)
    assert ws.s.shape == (Hv, Dk, Dv) and not ws.s.get().any()
    for T in [80] + [1] * DECODE:
        host, views = qkv_views(wg, rng, T, Hk, Hv, Dk, Dv)
        ctx = wg.ctx
        before = ctx.dispatches, ctx.submits
        got = wg.ops.gated_delta_rule(*views, ws)
        assert (ctx.dispatches - before[0], ctx.submits - before[1]) == (2, 0)  # no read-back inside the op
        want = cpu.ops.gated_delta_rule(*host, cs)
        assert got.shape == (T, Hv, Dv)
        close(got, want)
        close(ws.s.get(), cs.s)


def test_gated_delta_rule_decode_from_a_nonzero_state(wgpu_pair):
    """The state as a decode step finds it: random (not what a prefill leaves), Hv/Hk = 2."""
    from lumen_cpu.delta import DeltaState as CPUState
    from lumen_wgpu.delta import DeltaState

    wg, cpu = wgpu_pair
    rng = np.random.default_rng(7)
    Hk, Hv, Dk, Dv = 2, 4, 32, 64
    s0 = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32)
    ws, cs = DeltaState(wg.tensor(s0)), CPUState(s0.copy())
    host, views = qkv_views(wg, rng, 1, Hk, Hv, Dk, Dv)
    close(wg.ops.gated_delta_rule(*views, ws), cpu.ops.gated_delta_rule(*host, cs))
    close(ws.s.get(), cs.s)


@pytest.mark.parametrize("T", [1, 80])
def test_gdn_gates_matches_the_composite(wgpu_pair, T):
    """One kernel for g = neg_a softplus(a + dt_bias), beta = sigmoid(b); softplus to 1e-5 relative on every
    element, also where a + dt_bias is far below zero (softplus ~ e^x: a log near 1 would lose it)."""
    wg, cpu = wgpu_pair
    rng = np.random.default_rng(T)
    H = 32
    a = (rng.standard_normal((T, H + 4)) * 12).astype(np.float32)
    a[0, 2:6] = [-40.0, -17.0, 25.0, 0.0]
    b = (rng.standard_normal((T, H)) * 6).astype(np.float32)
    neg_a = -np.exp(rng.standard_normal(H)).astype(np.float32)
    dt = rng.standard_normal(H).astype(np.float32)
    ab = wg.tensor(a)[:, 2:2 + H]  # a column view
    before = wg.ctx.dispatches
    g, beta = wg.ops.gdn_gates(ab, wg.tensor(b), wg.tensor(neg_a), wg.tensor(dt))
    assert wg.ctx.dispatches - before == 1
    want_g, want_beta = cpu.ops.gdn_gates(a[:, 2:2 + H], b, neg_a, dt)
    got_g = g.get()
    assert np.all(np.abs(got_g - want_g) <= 1e-5 * np.abs(want_g) + 1e-30), np.abs(got_g / want_g - 1).max()
    close(beta, want_beta, 1e-6)
