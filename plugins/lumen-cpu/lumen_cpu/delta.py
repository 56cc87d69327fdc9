"""Gated-DeltaNet pieces: the causal depthwise conv with its rolling state, and the gated delta rule.

Prefill runs the chunked form (chunks of 64: a triangular solve per chunk, then a scan over chunks);
decode runs the one-token recurrence. Both update the recurrent state in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32
CHUNK = 64


@dataclass
class ConvState:
    x: np.ndarray  # (kernel-1, channels): the last inputs seen


@dataclass
class DeltaState:
    s: np.ndarray  # (v_heads, k_dim, v_dim)


def conv_state(channels: int, kernel: int):
    return ConvState(np.zeros((kernel - 1, channels), F32))


def delta_state(v_heads: int, k_dim: int, v_dim: int):
    return DeltaState(np.zeros((v_heads, k_dim, v_dim), F32))


def causal_conv1d(x, w, state: ConvState):
    """silu(depthwise causal conv): x (T, C), w (C, K) -> (T, C); state keeps the last K-1 inputs."""
    K = w.shape[1]
    full = np.concatenate([state.x, x], axis=0)  # (K-1+T, C)
    T = x.shape[0]
    y = np.zeros_like(x)
    for k in range(K):
        y += full[k:k + T] * w[:, k]
    state.x[...] = full[-(K - 1):]
    return y * (0.5 * (np.tanh(0.5 * y) + 1.0))


def gated_delta_rule(q, k, v, g, beta, state: DeltaState):
    """q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv) -> out (T, Hv, Dv).

    q and k are L2-normalised and q scaled by Dk^-0.5 here. Each k head serves Hv/Hk consecutive v heads.
    """
    rep = v.shape[1] // k.shape[1]
    q, k = _l2(q), _l2(k)
    if rep > 1:
        q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    q = q * F32(q.shape[-1] ** -0.5)
    # to (H, T, D)
    q, k, v = (a.transpose(1, 0, 2).astype(F32) for a in (q, k, v))
    g, beta = g.T.astype(F32), beta.T.astype(F32)
    if q.shape[1] == 1:
        out = _recurrent(q, k, v, g, beta, state)
    else:
        out = _chunked(q, k, v, g, beta, state)
    return out.transpose(1, 0, 2)


def _l2(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(eps))


def _recurrent(q, k, v, g, beta, state: DeltaState):
    s = state.s
    out = np.empty_like(v)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", s, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        s += k[:, t, :, None] * delta[:, None, :]
        out[:, t] = np.einsum("hkv,hk->hv", s, q[:, t])
    return out


def _chunked(q, k, v, g, beta, state: DeltaState):
    # float64 inside: the triangular solve and the chunk scan amplify f32 rounding (seen: 1.4e-4 logit drift
    # between chunk splittings of one 150-token prompt in f32, ~1e-6 in f64).
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    H, T, _ = q.shape
    pad = (-T) % CHUNK
    q, k, v = (np.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v))
    g, beta = (np.pad(a, ((0, 0), (0, pad))) for a in (g, beta))
    n = (T + pad) // CHUNK
    q, k, v = (a.reshape(H, n, CHUNK, -1) for a in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK), beta.reshape(H, n, CHUNK)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = np.cumsum(g, axis=-1)  # (H, n, C) log-decay from chunk start
    lower = np.tril(np.ones((CHUNK, CHUNK), bool))
    decay = np.exp(np.where(lower, cum[..., :, None] - cum[..., None, :], -np.inf))  # (H, n, C, C)
    strict = np.tril(np.ones((CHUNK, CHUNK), bool), -1)
    # Unit lower-triangular system L X = B, L = I + strict_lower(k_beta k^T ⊙ decay): the UT transform.
    system = np.where(strict, (k_beta @ k.swapaxes(-1, -2)) * decay, 0) + np.eye(CHUNK)
    rhs = np.concatenate([v_beta, k_beta * np.exp(cum)[..., None]], axis=-1)
    sol = np.linalg.solve(system, rhs)
    new_v, k_cum = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]
    intra = (q @ k.swapaxes(-1, -2)) * decay  # (H, n, C, C), lower triangular incl. diagonal
    q_dec = q * np.exp(cum)[..., None]
    k_dec = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])  # (H, n)
    s = state.s.astype(np.float64)
    out = np.empty_like(new_v)
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_dec[:, i].swapaxes(-1, -2) @ v_new
    state.s[...] = s
    return out.reshape(H, n * CHUNK, -1)[:, :T].astype(F32)
