"""Gated-DeltaNet pieces on the GPU: the causal depthwise conv with its rolling state, and the gated delta rule
(chunked for prefill, the one-token recurrence for decode). Mirrors lumen_cpu.delta step by step."""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp

F32 = cp.float32
CHUNK = 64


@dataclass
class ConvState:
    x: cp.ndarray  # (kernel-1, channels): the last inputs seen


@dataclass
class DeltaState:
    s: cp.ndarray  # (v_heads, k_dim, v_dim)


def conv_state(channels: int, kernel: int):
    return ConvState(cp.zeros((kernel - 1, channels), F32))


def delta_state(v_heads: int, k_dim: int, v_dim: int):
    return DeltaState(cp.zeros((v_heads, k_dim, v_dim), F32))


def causal_conv1d(x, w, state: ConvState):
    """silu(depthwise causal conv): x (T, C), w (C, K) -> (T, C); state keeps the last K-1 inputs."""
    K, T = w.shape[1], x.shape[0]
    full = cp.concatenate([state.x, x], axis=0)  # (K-1+T, C)
    y = cp.zeros_like(x)
    for k in range(K):
        y += full[k:k + T] * w[:, k]
    state.x[...] = full[-(K - 1):]
    return y * (0.5 * (cp.tanh(0.5 * y) + 1.0))


def gated_delta_rule(q, k, v, g, beta, state: DeltaState):
    """q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv) -> (T, Hv, Dv). L2-normalises q, k; q scaled Dk^-0.5."""
    rep = v.shape[1] // k.shape[1]
    q, k = _l2(q), _l2(k)
    if rep > 1:  # each k head serves rep consecutive v heads
        q, k = cp.repeat(q, rep, axis=1), cp.repeat(k, rep, axis=1)
    q = q * F32(q.shape[-1] ** -0.5)
    q, k, v = (a.transpose(1, 0, 2).astype(F32) for a in (q, k, v))  # (H, T, D)
    g, beta = g.T.astype(F32), beta.T.astype(F32)
    out = _recurrent(q, k, v, g, beta, state) if q.shape[1] == 1 else _chunked(q, k, v, g, beta, state)
    return out.transpose(1, 0, 2)


def _l2(x, eps=1e-6):
    return x / cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True) + F32(eps))


def _recurrent(q, k, v, g, beta, state: DeltaState):
    s = state.s
    out = cp.empty_like(v)
    for t in range(q.shape[1]):
        s *= cp.exp(g[:, t])[:, None, None]
        kv_mem = cp.matmul(k[:, t, None, :], s)[:, 0]  # (H, Dv)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        s += k[:, t, :, None] * delta[:, None, :]
        out[:, t] = cp.matmul(q[:, t, None, :], s)[:, 0]
    return out


def _chunked(q, k, v, g, beta, state: DeltaState):
    H, T, Dv = v.shape
    pad = (-T) % CHUNK
    if pad:  # zero q/k/v/beta and g = 0 on padded steps leave the state untouched
        q, k, v = (cp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (cp.pad(a, ((0, 0), (0, pad))) for a in (g, beta))
    n = (T + pad) // CHUNK
    q, k, v = (a.reshape(H, n, CHUNK, -1) for a in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK), beta.reshape(H, n, CHUNK)
    k_beta = k * beta[..., None]
    cum = cp.cumsum(g, axis=-1)  # (H, n, C) log-decay from the chunk start
    idx = cp.arange(CHUNK)
    lower = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    decay = cp.exp(cp.where(lower, cum[..., :, None] - cum[..., None, :], F32(-cp.inf)))  # (H, n, C, C)
    # UT transform: with L = I + strict_lower(k_beta k^T ⊙ decay), new_v = L^-1 (v β), k_cum = L^-1 (k β e^cum).
    a = cp.where(strict, cp.matmul(k_beta, k.swapaxes(-1, -2)) * decay, F32(0))
    inv = _unit_lower_inverse(a)
    new_v = cp.matmul(inv, v * beta[..., None])
    k_cum = cp.matmul(inv, k_beta * cp.exp(cum)[..., None])
    intra = cp.matmul(q, k.swapaxes(-1, -2)) * decay  # lower triangular incl. the diagonal
    q_dec = q * cp.exp(cum)[..., None]
    k_dec = (k * cp.exp(cum[..., -1:] - cum)[..., None]).swapaxes(-1, -2)
    chunk_decay = cp.exp(cum[..., -1])[..., None, None]  # (H, n, 1, 1)
    s = state.s
    out = cp.empty((H, n, CHUNK, Dv), F32)
    for i in range(n):
        v_new = new_v[:, i] - cp.matmul(k_cum[:, i], s)
        out[:, i] = cp.matmul(q_dec[:, i], s) + cp.matmul(intra[:, i], v_new)
        s = s * chunk_decay[:, i] + cp.matmul(k_dec[:, i], v_new)
    state.s[...] = s
    return out.reshape(H, n * CHUNK, Dv)[:, :T]


def _unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a (..., C, C), by forward substitution over rows (C launches;
    the chunked kernel of the next step replaces this)."""
    C = a.shape[-1]
    inv = cp.broadcast_to(cp.eye(C, dtype=a.dtype), a.shape).copy()
    for i in range(1, C):
        inv[..., i:i + 1, :i] = -cp.matmul(a[..., i:i + 1, :i], inv[..., :i, :i])
    return inv
