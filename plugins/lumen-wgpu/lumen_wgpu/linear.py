"""Weight matrices on the device and the ops that read them: ``linear`` (a GEMV for decode, a tiled GEMM for
prefill) and ``embedding``. One shader template per op; the storage format only changes ``ld`` (wgsl.HALF_LOADERS),
which decodes one element to f32, so f32, f16 and bf16 share every line of the math.
"""

from __future__ import annotations

import math

import numpy as np

from . import wgsl
from .device import pack
from .tensor import WTensor, empty, from_numpy

ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
GEMV_MAX_T = 8  # up to this many rows: each workgroup reads a weight row once for all of them
WG_GEMV = 64
TILE = 32  # GEMM: 32x32 outputs a workgroup, K in steps of 32


class Matrix:
    """A (rows, cols) weight on the device, split by rows into chunks that each fit one storage binding.

    ``chunks``: [(gpu buffer, first row, rows)]; ``row0``/``rows``: this view's rows (``m[a:b]`` is a view, no
    copy: Gemma's per-expert gate/up halves)."""

    def __init__(self, ctx, fmt: str, cols: int, chunks, row0: int, rows: int, nbytes: int):
        self.ctx, self.format, self.cols, self.chunks = ctx, fmt, cols, chunks
        self.row0, self.rows, self._nbytes = row0, rows, nbytes

    @classmethod
    def upload(cls, ctx, host: np.ndarray, fmt: str, shape) -> Matrix:
        rows = int(shape[0]) if len(shape) else 1
        cols = int(math.prod(shape[1:])) if len(shape) > 1 else 1
        flat = np.ascontiguousarray(host).reshape(rows, -1)
        row_bytes = flat.shape[1] * flat.itemsize
        per_chunk = max(1, (ctx.max_binding - 16) // max(1, row_bytes))
        chunks = []
        for first in range(0, rows, per_chunk):
            n = min(per_chunk, rows - first)
            chunks.append((ctx.weight_buffer(flat[first:first + n]), first, n))
        if not chunks:
            chunks.append((ctx.weight_buffer(flat), 0, 0))
        return cls(ctx, fmt, cols, chunks, 0, rows, flat.nbytes)

    @property
    def shape(self):
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self._nbytes * self.rows // max(1, self.row0 + self.rows) if self.row0 else self._nbytes

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise IndexError("a weight matrix on wgpu takes a row slice")
        start, stop, step = key.indices(self.rows)
        if step != 1:
            raise IndexError("a weight matrix on wgpu takes a row slice of step 1")
        return Matrix(self.ctx, self.format, self.cols, self.chunks, self.row0 + start, max(0, stop - start),
                      self._nbytes)

    def pieces(self):
        """(gpu buffer, row within the buffer where this view's piece starts, its rows, first output row) for
        each chunk this view overlaps."""
        lo, hi = self.row0, self.row0 + self.rows
        for buf, first, n in self.chunks:
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                yield buf, a - first, b - a, a - lo


def _gemv_code(fmt: str) -> str:
    return wgsl.header([("X", "r", "f32"), ("W", "r", "f32" if fmt == "f32" else "u32"), ("Y", "w", "f32")]) + \
        wgsl.HALF_LOADERS[fmt] + f"""
// words: 0 T, 1 K, 2 N (row stride of Y), 3 rows of this piece, 4 first row in W, 5 first column of Y,
// 6 offset of X, 7 row stride of X
var<workgroup> part: array<f32, {WG_GEMV * GEMV_MAX_T}>;
@compute @workgroup_size({WG_GEMV})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let r = group_id(wid, nw);
  let T = w(0u); let K = w(1u);
  if (r >= w(3u)) {{ return; }}
  var acc: array<f32, {GEMV_MAX_T}>;
  for (var t = 0u; t < {GEMV_MAX_T}u; t++) {{ acc[t] = 0.0; }}
  let base = (w(4u) + r) * K;
  for (var k = lid; k < K; k += {WG_GEMV}u) {{
    let wv = ld(base + k);
    for (var t = 0u; t < T; t++) {{ acc[t] += wv * X[w(6u) + t * w(7u) + k]; }}
  }}
  for (var t = 0u; t < T; t++) {{ part[t * {WG_GEMV}u + lid] = acc[t]; }}
  workgroupBarrier();
  for (var s = {WG_GEMV // 2}u; s > 0u; s >>= 1u) {{
    if (lid < s) {{
      for (var t = 0u; t < T; t++) {{ part[t * {WG_GEMV}u + lid] += part[t * {WG_GEMV}u + lid + s]; }}
    }}
    workgroupBarrier();
  }}
  if (lid < T) {{ Y[lid * w(2u) + w(5u) + r] = part[lid * {WG_GEMV}u]; }}
}}
"""


def _gemm_code(fmt: str) -> str:
    return wgsl.header([("X", "r", "f32"), ("W", "r", "f32" if fmt == "f32" else "u32"), ("Y", "w", "f32")]) + \
        wgsl.HALF_LOADERS[fmt] + f"""
// words as the GEMV's; grid: x over column tiles, y over row (token) tiles
var<workgroup> xs: array<f32, {TILE * TILE}>;
var<workgroup> ws: array<f32, {TILE * TILE}>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let K = w(1u); let R = w(3u);
  let t0 = wid.y * {TILE}u; let n0 = wid.x * {TILE}u;
  let ty = lid / 16u; let tx = lid % 16u;
  var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
  for (var k0 = 0u; k0 < K; k0 += {TILE}u) {{
    for (var j = 0u; j < 4u; j++) {{
      let e = lid + j * 256u;
      let rr = e / {TILE}u; let kk = e % {TILE}u;
      let t = t0 + rr; let n = n0 + rr; let k = k0 + kk;
      xs[e] = select(0.0, X[w(6u) + t * w(7u) + k], t < T && k < K);
      ws[e] = select(0.0, ld((w(4u) + n) * K + k), n < R && k < K);
    }}
    workgroupBarrier();
    for (var kk = 0u; kk < {TILE}u; kk++) {{
      let x0 = xs[(ty * 2u) * {TILE}u + kk]; let x1 = xs[(ty * 2u + 1u) * {TILE}u + kk];
      let w0 = ws[(tx * 2u) * {TILE}u + kk]; let w1 = ws[(tx * 2u + 1u) * {TILE}u + kk];
      acc[0] += x0 * w0; acc[1] += x0 * w1; acc[2] += x1 * w0; acc[3] += x1 * w1;
    }}
    workgroupBarrier();
  }}
  for (var j = 0u; j < 4u; j++) {{
    let t = t0 + ty * 2u + j / 2u; let n = n0 + tx * 2u + j % 2u;
    if (t < T && n < R) {{ Y[t * w(2u) + w(5u) + n] = acc[j]; }}
  }}
}}
"""


def linear(x: WTensor, w) -> WTensor:
    """(T, in) @ (out, in)^T -> (T, out), f32 accumulation whatever the weight's storage."""
    m = w.data
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    if x2.strides[-1] != 1:
        x2 = x2.dense()
    T, K = x2.shape
    if K != m.cols:
        raise ValueError(f"linear: input has {K} features, the weight {w.shape} expects {m.cols}")
    ctx = x.ctx
    N = m.rows
    y = empty(ctx, (T, N))
    gemv = T <= GEMV_MAX_T
    code = _gemv_code(m.format) if gemv else _gemm_code(m.format)
    kernel = ctx.kernel(("gemv" if gemv else "gemm") + "_" + m.format, code, "rrw")
    for buf, row, n, col in m.pieces():
        params = pack(T, K, N, n, row, col, x2.offset, x2.strides[0])
        groups = wgsl.grid(n, ctx.max_groups) if gemv else (-(-n // TILE), -(-T // TILE), 1)
        ctx.dispatch(kernel, [x2.buf.gpu, buf, y.buf.gpu], params, groups)
    return y.reshape(*lead, N) if x.ndim != 2 else y


def _embedding_code(fmt: str) -> str:
    return wgsl.header([("ids", "r", "u32"), ("W", "r", "f32" if fmt == "f32" else "u32"), ("Y", "w", "f32")]) + \
        wgsl.HALF_LOADERS[fmt] + """
// words: 0 T, 1 H, 2 first row of this piece (in the matrix view), 3 its rows, 4 its first row in W
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  let H = w(1u);
  if (i >= w(0u) * H) { return; }
  let t = i / H; let h = i % H;
  let id = ids[t];
  if (id < w(2u) || id >= w(2u) + w(3u)) { return; }
  Y[i] = ld((id - w(2u) + w(4u)) * H + h);
}
"""


def embedding(ids, w) -> WTensor:
    """Rows ``ids`` of a (vocab, H) table, as f32."""
    m = w.data
    ctx = m.ctx
    idx = np.asarray(ids, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= m.rows):
        raise ValueError(f"embedding: token id {int(idx.max() if idx.max() >= m.rows else idx.min())} is outside "
                         f"the table's {m.rows} rows")
    T, H = idx.size, m.cols
    y = empty(ctx, (T, H))
    ids_t = from_numpy(ctx, idx.astype(np.int32))
    kernel = ctx.kernel("embedding_" + m.format, _embedding_code(m.format), "rrw")
    for buf, row, n, first in m.pieces():
        ctx.dispatch(kernel, [ids_t.buf.gpu, buf, y.buf.gpu], pack(T, H, first, n, row),
                     wgsl.grid(-(-T * H // 256), ctx.max_groups))
    return y
