"""Gated-DeltaNet pieces: the causal depthwise conv with its rolling state, and the gated delta rule.

Prefill runs the chunked form (chunks of 64: a unit-triangular inverse per chunk, then a scan over chunks);
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
    H, T, Dv = v.shape
    pad = (-T) % CHUNK
    if pad:  # zero q/k/v/beta and g = 0 on padded steps leave the state untouched
        q, k, v = (np.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (np.pad(a, ((0, 0), (0, pad))) for a in (g, beta))
    n = (T + pad) // CHUNK
    q, k, v = (a.reshape(H, n, CHUNK, -1) for a in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK), beta.reshape(H, n, CHUNK)
    k_beta = k * beta[..., None]
    cum = np.cumsum(g, axis=-1)  # (H, n, C) log-decay from the chunk start
    lower = np.tril(np.ones((CHUNK, CHUNK), bool))
    decay = np.exp(np.where(lower, cum[..., :, None] - cum[..., None, :], -np.inf))  # (H, n, C, C)
    # UT transform: with L = I + strict_lower(k_beta k^T ⊙ decay), new_v = L^-1 (v β), k_cum = L^-1 (k β e^cum).
    inv = _unit_lower_inverse(np.tril((k_beta @ k.swapaxes(-1, -2)) * decay, -1))
    new_v = inv @ (v * beta[..., None])
    k_cum = inv @ (k_beta * np.exp(cum)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay  # (H, n, C, C), lower triangular incl. diagonal
    q_dec = q * np.exp(cum)[..., None]
    k_dec = (k * np.exp(cum[..., -1:] - cum)[..., None]).swapaxes(-1, -2)
    chunk_decay = np.exp(cum[..., -1])[..., None, None]  # (H, n, 1, 1)
    s = state.s
    out = np.empty((H, n, CHUNK, Dv), F32)
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_dec[:, i] @ v_new
    state.s[...] = s
    return out.reshape(H, n * CHUNK, Dv)[:, :T]


def _unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a (..., C, C), by forward substitution over rows.

    numpy has no batched triangular solve; a general LU solve costs ~5x this on 64x64 blocks.
    """
    C = a.shape[-1]
    inv = np.zeros_like(a)
    idx = np.arange(C)
    inv[..., idx, idx] = 1.0
    for i in range(1, C):
        inv[..., i:i + 1, :i] = -(a[..., i:i + 1, :i] @ inv[..., :i, :i])
    return inv
