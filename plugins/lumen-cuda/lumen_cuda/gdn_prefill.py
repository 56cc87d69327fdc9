"""The chunked gated delta rule (Gated-DeltaNet prefill) in two kernel launches per call (``kernels/gdn_chunk.cu``),
f32 throughout: ``gated_delta_chunked`` has the semantics of ``delta.gated_delta_rule`` for any T >= 1 (chunks of
``delta.CHUNK`` = 64 steps from the start of the call) and matches it to 1e-4 relative.

Launch configurations (per segment of at most ``SEGMENT`` tokens; longer inputs run segment after segment so the
scratch stays bounded):
- ``gdn_chunk_prep`` grid (nch, Hv), 256 threads, 4 * (2 * 64 * (Dk | 1) + 64 * 64 + 192) bytes of dynamic shared
  memory (82.5 KB at Dk = 128): per chunk and v head, the UT transform by forward substitution (W, U), the intra-chunk
  matrix and the decayed q / k, written to scratch.
- ``gdn_chunk_scan_g<NG>`` grid (Hv, ceil(Dv / 32)), 256 threads, NG = ceil(round4(Dk) / 32),
  4 * (32 * Dk + 2 * 64 * max(round4(Dk), 64) + 2048) bytes (88 KB at Dk = 128): the sequential pass over the chunks
  with a 32-column tile of the state in shared memory, writing the outputs and the final state.

Raises ValueError for what it does not support (head dims above 256, a state that is not a C-contiguous f32 CuPy
array, shapes that do not agree, more shared memory than the device allows) so that the caller can fall back to
``delta.gated_delta_rule``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from . import kernels
from .delta import CHUNK, DeltaState

F32 = cp.float32
FILE = "gdn_chunk"
THREADS = 256
MAX_DIM = 256  # Dk and Dv
SEGMENT = 64 * CHUNK  # tokens per pair of launches (bounds the scratch: ~4 * Hv * SEGMENT * D floats)
_NG = (1, 2, 4, 8)  # state row groups of 32 per scan thread block: round4(Dk) <= 32 * NG

_ATTR_SMEM_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def _fn(name: str, smem: int) -> cp.RawKernel:
    if CHUNK != 64:
        raise ValueError(f"gdn_chunk kernels are built for chunks of 64 steps, not {CHUNK}")
    return kernels.function(FILE, name, smem=smem)


def _smem_limit() -> int:
    """Dynamic shared memory one block may opt into on the current device (bytes)."""
    return kernels.device_attribute(_ATTR_SMEM_OPTIN, kernels.DEFAULT_SMEM)


def prep_smem(dk: int) -> int:
    return 4 * (2 * CHUNK * (dk | 1) + CHUNK * CHUNK + 3 * CHUNK)


def scan_smem(dk: int) -> int:
    dkp = (dk + 3) & ~3
    return 4 * (32 * dk + 2 * CHUNK * max(dkp, CHUNK) + CHUNK * 32)


def _f32(x, name: str):
    if not isinstance(x, cp.ndarray):
        raise ValueError(f"{name} must be a CuPy array, not {type(x).__name__}")
    return cp.ascontiguousarray(x, dtype=F32)


def gated_delta_chunked(q, k, v, g, beta, state: DeltaState):
    """q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv) -> (T, Hv, Dv) f32, as ``delta.gated_delta_rule``:
    q, k L2-normalised, q scaled Dk^-0.5, v head h reads k head h // (Hv // Hk); ``state.s`` (Hv, Dk, Dv) f32
    updated in place."""
    if q.ndim != 3 or v.ndim != 3:
        raise ValueError(f"shapes: q {q.shape}, v {v.shape} (want (T, H, D))")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    s = state.s
    if (k.shape != q.shape or v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv)
            or s.shape != (Hv, Dk, Dv)):
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                         f"state {s.shape}")
    if T < 1:
        raise ValueError("gated_delta_chunked needs at least one step")
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"v heads {Hv} not a multiple of k heads {Hk}")
    if not (0 < Dk <= MAX_DIM and 0 < Dv <= MAX_DIM):
        raise ValueError(f"head dims Dk {Dk}, Dv {Dv} unsupported (1..{MAX_DIM})")
    if not isinstance(s, cp.ndarray) or s.dtype != F32 or not s.flags.c_contiguous:
        raise ValueError("delta state must be a C-contiguous f32 CuPy array")
    p_smem, s_smem = prep_smem(Dk), scan_smem(Dk)
    limit = _smem_limit()
    if max(p_smem, s_smem) > limit:
        raise ValueError(f"head dim Dk {Dk} needs {max(p_smem, s_smem)} bytes of shared memory (device: {limit})")
    ng = next(n for n in _NG if ((Dk + 3) & ~3) <= 32 * n)
    prep = _fn("gdn_chunk_prep", p_smem)
    scan = _fn(f"gdn_chunk_scan_g{ng}", s_smem)

    qc, kc, vc = _f32(q, "q"), _f32(k, "k"), _f32(v, "v")
    gc, bc = _f32(g, "g"), _f32(beta, "beta")
    out = cp.empty((T, Hv, Dv), dtype=F32)
    nmax = -(-min(T, SEGMENT) // CHUNK)
    qt = cp.empty((Hv, nmax, Dk, CHUNK), dtype=F32)
    kd = cp.empty((Hv, nmax, CHUNK, Dk), dtype=F32)
    it = cp.empty((Hv, nmax, CHUNK, CHUNK), dtype=F32)
    wt = cp.empty((Hv, nmax, Dk, CHUNK), dtype=F32)
    u = cp.empty((Hv, nmax, CHUNK, Dv), dtype=F32)
    gl = cp.empty((Hv, nmax), dtype=F32)
    qscale = np.float32(Dk ** -0.5)
    for t0 in range(0, T, SEGMENT):
        t1 = min(T, t0 + SEGMENT)
        n = -(-(t1 - t0) // CHUNK)  # the scratch is laid out (Hv, n, ...) for this segment's n
        args = (np.int32(t1 - t0), np.int32(Hv), np.int32(Dk), np.int32(Dv), np.int32(n))
        prep((n, Hv), (THREADS,),
             (qc[t0:t1], kc[t0:t1], vc[t0:t1], gc[t0:t1], bc[t0:t1], qt, kd, it, wt, u, gl,
              np.int32(t1 - t0), np.int32(Hk), np.int32(Hv), np.int32(Dk), np.int32(Dv), np.int32(n), qscale),
             shared_mem=p_smem)
        scan((Hv, -(-Dv // 32)), (THREADS,), (qt, kd, it, wt, u, gl, s, out[t0:t1], *args), shared_mem=s_smem)
    return out
