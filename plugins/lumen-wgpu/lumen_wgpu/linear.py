"""Weight matrices on the device and the ops that read them: ``linear`` (a GEMV for decode, a tiled GEMM for
prefill) and ``embedding``, for every storage format in ``quant.FORMATS`` (f32, f16, bf16, fp8, nvfp4 and the GGUF
block formats q8_0, q4_0, q5_0, q4_k, q5_k, q6_k). One shader template per op: the format only supplies ``ld8`` /
``ld1`` (``quant.decoder``), which decode 8 values / one value to f32, so every format shares every line of the
math and accumulates in f32.
"""

from __future__ import annotations

import numpy as np

from . import gemm as tiled_gemm
from . import gemv as fast_gemv
from . import quant, wgsl
from .device import pack
from .tensor import WTensor, elementwise, empty, from_numpy

ELEM_BYTES = dict(quant.ELEMENT)  # formats of one value an element, and its bytes
GEMV_MAX_T = 8  # up to this many rows: each workgroup reads its weight rows once for all of them
GEMV_ROWS, GEMV_LANES = 8, 32  # a GEMV workgroup: 8 weight rows, 32 threads a row
TILE_N, TILE_T, TILE_K = 64, 32, 32  # GEMM: 64 weight rows x 32 tokens a workgroup, K in steps of 32
U = quant.UNIT


class Matrix:
    """A (rows, cols) weight on the device, split by rows into chunks that each fit one storage binding.

    ``chunks``: [(gpu buffer, first row, rows)]: a chunk holds its rows' bytes (GGUF: whole blocks, as stored);
    ``scale_bufs``: {first row of a chunk: the buffer of the scales its rows read} (fp8, nvfp4). ``row0``/``rows``:
    this view's rows (``m[a:b]`` is a view, no copy: Gemma's per-expert gate/up halves). ``layout``: the format's
    params (``quant.Layout.words``).
    """

    def __init__(self, ctx, fmt: str, cols: int, chunks, row0: int, rows: int, nbytes: int, layout=None,
                 total: int | None = None, scale_bufs=None, keep=None):
        self.ctx, self.format, self.cols, self.chunks = ctx, fmt, cols, chunks
        self._keep = keep  # the pooled buffer a Matrix over a tensor reads (``of``): alive while the Matrix is
        self.row0, self.rows, self._nbytes = row0, rows, nbytes
        self.layout = layout if layout is not None else quant.Layout(np.zeros((0, 0)))
        self._total = rows if total is None else total
        self.scale_bufs = {} if scale_bufs is None else scale_bufs

    @classmethod
    def upload(cls, ctx, host, fmt: str, shape, scale=None) -> Matrix:
        """``host`` in checkpoint form (GGUF: (rows, bytes a row) uint8; nvfp4: packed pairs with ``scale`` =
        (block scales, global scale); fp8: e4m3 with an optional f32 ``scale``)."""
        lay = quant.layout(host, fmt, shape, scale)
        data = lay.data
        rows, cols = data.shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = data.shape[1] * data.itemsize
        scale_row_bytes = 0 if lay.scale is None else lay.scale.shape[1] * lay.scale.itemsize
        per_chunk = max(1, (ctx.max_binding - 16) // max(1, row_bytes, scale_row_bytes))
        chunks, scale_bufs = [], {}
        for first in range(0, rows, per_chunk):
            n = min(per_chunk, rows - first)
            chunks.append((ctx.weight_buffer(data[first:first + n]), first, n))
            if lay.scale is not None:
                a, b = lay.scale_rows(first, n)
                scale_bufs[first] = ctx.weight_buffer(lay.scale[a:b])
        if not chunks:
            chunks.append((ctx.weight_buffer(data), 0, 0))
        nbytes = data.nbytes
        # the host arrays are on the device now: keep only the layout's numbers, not a host copy of every weight
        lay.data = lay.data[:0]
        lay.scale = None if lay.scale is None else lay.scale[:0]
        return cls(ctx, fmt, cols, chunks, 0, rows, nbytes, lay, rows, scale_bufs)

    @classmethod
    def of(cls, data) -> Matrix:
        """``data`` itself, or a Matrix over an f32 WTensor (a Weight an architecture builds by hand around one of
        this backend's tensors, as Qwen's vision tower does for its patch embedding): its buffer, no copy, unless
        it is a strided view or starts inside its buffer (then one dense copy)."""
        if isinstance(data, Matrix):
            return data
        if not isinstance(data, WTensor) or data.dtype != "f32":
            raise TypeError(f"a wgpu weight holds a Matrix or an f32 tensor, not {type(data).__name__}")
        t = data.reshape(data.shape[0], -1) if data.ndim != 2 else data
        if not t.is_dense or t.offset:
            t = t.dense() if t.offset == 0 else elementwise("a", [t])
        rows, cols = t.shape
        return cls(t.ctx, "f32", cols, [(t.buf.gpu, 0, rows)], 0, rows, 4 * rows * cols, keep=t.buf)

    @property
    def shape(self):
        return (self.rows, self.cols)

    def to_host(self) -> np.ndarray:
        """This view's values back on the host, as uploaded: f32, f16, or bf16 as uint16 bits (what ``weight``
        takes back); other formats are refused (an architecture that transposes a weight on load reads one back)."""
        dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}.get(self.format)
        if dtype is None:
            raise NotImplementedError(f"reading a {self.format} weight back from wgpu is not supported")
        item = np.dtype(dtype).itemsize
        rows = []
        for buf, row, n, _ in self.pieces():
            raw = self.ctx.read(buf, row * self.cols * item, n * self.cols * item)
            rows.append(np.frombuffer(raw, dtype=dtype).reshape(n, self.cols))
        return np.concatenate(rows) if rows else np.zeros((0, self.cols), dtype)

    def reshape(self, rows: int, cols: int) -> Matrix:
        """The same matrix as (rows, cols): a Matrix already holds a weight of more dims as (first dim, the rest),
        which is the only reshape architectures ask for (Gemma 3's patch kernel as a linear map)."""
        if (rows, cols) != (self.rows, self.cols):
            raise ValueError(f"a ({self.rows}, {self.cols}) weight matrix on wgpu cannot be viewed as ({rows}, {cols})")
        return self

    @property
    def nbytes(self) -> int:
        """The stored bytes of this view's rows (scales not included: ``Weight.scale`` counts them)."""
        return self._nbytes * self.rows // max(1, self._total)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise IndexError("a weight matrix on wgpu takes a row slice")
        start, stop, step = key.indices(self.rows)
        if step != 1:
            raise IndexError("a weight matrix on wgpu takes a row slice of step 1")
        return Matrix(self.ctx, self.format, self.cols, self.chunks, self.row0 + start, max(0, stop - start),
                      self._nbytes, self.layout, self._total, self.scale_bufs)

    def pieces(self):
        """(gpu buffer, row within the buffer where this view's piece starts, its rows, first output row) for
        each chunk this view overlaps."""
        for buf, row, n, col, _, _ in self.parts():
            yield buf, row, n, col

    def parts(self):
        """``pieces`` with what a kernel also binds: (buffer, row in it, rows, first output row, [weight
        buffers to bind: W, then S where the format has scales], params words 8..12 (``quant.Layout.words``))."""
        lo, hi = self.row0, self.row0 + self.rows
        for buf, first, n in self.chunks:
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                sbuf = self.scale_bufs.get(first)
                yield buf, a - first, b - a, a - lo, [buf] if sbuf is None else [buf, sbuf], self.layout.words(first)


# -- kernels ---------------------------------------------------------------------------------------------------
def _x_loaders(vec: bool) -> str:
    """``xl4(i)``: X[i..i+3] (i a multiple of 4), ``xl1(i)``: X[i]. ``vec``: X bound as vec4s (16-byte loads),
    when the input's offset and row stride are multiples of 4."""
    if vec:
        return ("fn xl4(i: u32) -> vec4<f32> { return X[i >> 2u]; }\n"
                "fn xl1(i: u32) -> f32 { return X[i >> 2u][i & 3u]; }\n")
    return ("fn xl4(i: u32) -> vec4<f32> { return vec4<f32>(X[i], X[i + 1u], X[i + 2u], X[i + 3u]); }\n"
            "fn xl1(i: u32) -> f32 { return X[i]; }\n")


def _binds(first, fmt: str, wide: bool):
    return [first] + quant.bindings(fmt, wide) + [("Y", "w", "f32")]


def _kernel(ctx, name: str, fmt: str, wide: bool, code: str):
    return ctx.kernel(f"{name}_{fmt}{'_wide' if wide else ''}", code, "r" * (len(quant.bindings(fmt)) + 1) + "w")


_WORDS = """// words: 0 T, 1 K, 2 N (row stride of Y), 3 rows of this piece, 4 first row in W, 5 first column of Y,
// 6 offset of X, 7 row stride of X, 8..12 the format's (quant)
"""


def _gemv_code(fmt: str, wide: bool, vec: bool) -> str:
    wg = GEMV_ROWS * GEMV_LANES
    x = ("X", "r", "vec4<f32>" if vec else "f32")
    tail = "" if quant.tail_free(fmt) else f"""
    for (var k = KU * {U}u + lane; k < K; k += {GEMV_LANES}u) {{  // a row length that is not a multiple of 8
      let wv = ld1(rr, k);
      for (var t = 0u; t < {GEMV_MAX_T}u; t++) {{ if (t < T) {{ acc[t] += wv * xl1(xo + t * xs + k); }} }}
    }}"""
    return wgsl.header(_binds(x, fmt, wide)) + quant.decoder(fmt, wide) + _x_loaders(vec) + _WORDS + f"""
// a workgroup: {GEMV_ROWS} rows, {GEMV_LANES} threads a row; a thread takes 8 values of the row at a time (ld8) and
// the matching inputs of every token, so each weight byte is read once whatever T. Loops over tokens run to the
// constant {GEMV_MAX_T} (guarded by T) so that compilers unroll them and keep acc in registers.
var<workgroup> part: array<f32, {wg * GEMV_MAX_T}>;
@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let K = w(1u);
  let lane = lid % {GEMV_LANES}u; let sub = lid / {GEMV_LANES}u;
  let r = group_id(wid, nw) * {GEMV_ROWS}u + sub;
  let live = r < w(3u);
  var acc: array<f32, {GEMV_MAX_T}>;
  for (var t = 0u; t < {GEMV_MAX_T}u; t++) {{ acc[t] = 0.0; }}
  if (live) {{
    let rr = w(4u) + r; let xo = w(6u); let xs = w(7u);
    let KU = K / {U}u;
    for (var u = lane; u < KU; u += {GEMV_LANES}u) {{
      let v = ld8(rr, u * {U}u);
      for (var t = 0u; t < {GEMV_MAX_T}u; t++) {{
        if (t < T) {{
          let i = xo + t * xs + u * {U}u;
          acc[t] += dot(v.a, xl4(i)) + dot(v.b, xl4(i + 4u));
        }}
      }}
    }}{tail}
  }}
  for (var t = 0u; t < {GEMV_MAX_T}u; t++) {{ if (t < T) {{ part[t * {wg}u + lid] = acc[t]; }} }}
  workgroupBarrier();
  for (var s = {GEMV_LANES // 2}u; s > 0u; s >>= 1u) {{
    if (lane < s) {{
      for (var t = 0u; t < T; t++) {{ part[t * {wg}u + lid] += part[t * {wg}u + lid + s]; }}
    }}
    workgroupBarrier();
  }}
  if (live && lane < T) {{ Y[lane * w(2u) + w(5u) + r] = part[lane * {wg}u + sub * {GEMV_LANES}u]; }}
}}
"""


def _gemm_code(fmt: str, wide: bool) -> str:
    S = TILE_K + 1  # a tile row's stride in workgroup memory: padded, so the 16 rows read together hit 16 banks
    return wgsl.header(_binds(("X", "r", "f32"), fmt, wide)) + quant.decoder(fmt, wide) + _WORDS + f"""
// grid: x over tiles of {TILE_N} weight rows, y over tiles of {TILE_T} tokens; K in steps of {TILE_K}. Each of the 256
// threads decodes 8 values of the weight tile into workgroup memory (ld8: {TILE_N} rows x {TILE_K} columns), loads 4
// inputs, then computes 2 tokens x 4 rows (token ty + 16a, row tx + 16i: neighbouring threads write neighbouring
// outputs).
var<workgroup> xs: array<f32, {TILE_T * S}>;
var<workgroup> ws: array<f32, {TILE_N * S}>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let K = w(1u); let R = w(3u);
  let t0 = wid.y * {TILE_T}u; let n0 = wid.x * {TILE_N}u;
  let ty = lid / 16u; let tx = lid % 16u;
  var acc: array<array<f32, 4>, 2>;
  for (var k0 = 0u; k0 < K; k0 += {TILE_K}u) {{
    for (var j = 0u; j < {TILE_T * TILE_K // 256}u; j++) {{
      let e = lid + j * 256u;
      let t = t0 + e / {TILE_K}u; let k = k0 + e % {TILE_K}u;
      xs[(e / {TILE_K}u) * {S}u + e % {TILE_K}u] = select(0.0, X[w(6u) + t * w(7u) + k], t < T && k < K);
    }}
    {{
      let rr = lid / {TILE_K // U}u; let c = (lid % {TILE_K // U}u) * {U}u;
      let n = n0 + rr; let k = k0 + c;
      var v = V8(vec4<f32>(0.0), vec4<f32>(0.0));
      if (n < R && k + {U}u <= K) {{
        v = ld8(w(4u) + n, k);
      }} else if (n < R) {{  // the row's last, partial unit
        var e = array<f32, {U}>();
        for (var i = 0u; i < {U}u; i++) {{ if (k + i < K) {{ e[i] = ld1(w(4u) + n, k + i); }} }}
        v = V8(vec4<f32>(e[0], e[1], e[2], e[3]), vec4<f32>(e[4], e[5], e[6], e[7]));
      }}
      let o = rr * {S}u + c;
      ws[o] = v.a.x; ws[o + 1u] = v.a.y; ws[o + 2u] = v.a.z; ws[o + 3u] = v.a.w;
      ws[o + 4u] = v.b.x; ws[o + 5u] = v.b.y; ws[o + 6u] = v.b.z; ws[o + 7u] = v.b.w;
    }}
    workgroupBarrier();
    for (var kk = 0u; kk < {TILE_K}u; kk++) {{
      let x0 = xs[ty * {S}u + kk]; let x1 = xs[(ty + 16u) * {S}u + kk];
      for (var i = 0u; i < 4u; i++) {{
        let wv = ws[(tx + 16u * i) * {S}u + kk];
        acc[0][i] += x0 * wv; acc[1][i] += x1 * wv;
      }}
    }}
    workgroupBarrier();
  }}
  for (var a = 0u; a < 2u; a++) {{
    for (var i = 0u; i < 4u; i++) {{
      let t = t0 + ty + 16u * a; let n = n0 + tx + 16u * i;
      if (t < T && n < R) {{ Y[t * w(2u) + w(5u) + n] = acc[a][i]; }}
    }}
  }}
}}
"""


def linear(x: WTensor, w) -> WTensor:
    """(T, in) @ (out, in)^T -> (T, out), f32 accumulation whatever the weight's storage."""
    m = Matrix.of(w.data)
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
    if gemv and m.format in fast_gemv.PER_WORD:
        pieces = list(m.pieces())
        if all(fast_gemv.applies(m.format, K, x2.offset, x2.strides[0] if T > 1 else 0, T, p[1]) for p in pieces):
            for buf, row, n, col in pieces:  # wide loads, 8 rows a workgroup (gemv.py): ~2x this module's GEMV
                fast_gemv.dispatch(ctx, m.format, x2, buf, y, T, K, N, n, row, col)
            return y.reshape(*lead, N) if x.ndim != 2 else y
    if not gemv and m.format in tiled_gemm.PER_WORD:
        pieces = list(m.pieces())
        if all(tiled_gemm.applies(m.format, K, x2.offset, x2.strides[0], p[1]) for p in pieces):
            for buf, row, n, col in pieces:  # register-tiled, 16-byte loads (gemm.py)
                tiled_gemm.dispatch(ctx, m.format, x2, buf, y, T, K, N, n, row, col)
            return y.reshape(*lead, N) if x.ndim != 2 else y
    wide = quant.wide(m.format, K)
    if gemv:
        vec = x2.offset % 4 == 0 and (x2.strides[0] % 4 == 0 or T == 1)
        kernel = _kernel(ctx, "gemv_x4" if vec else "gemv", m.format, wide, _gemv_code(m.format, wide, vec))
    else:
        kernel = _kernel(ctx, "gemm", m.format, wide, _gemm_code(m.format, wide))
    for _, row, n, col, wbufs, words in m.parts():
        params = pack(T, K, N, n, row, col, x2.offset, x2.strides[0] if T > 1 else 0, *words)
        groups = wgsl.grid(-(-n // GEMV_ROWS), ctx.max_groups) if gemv else (-(-n // TILE_N), -(-T // TILE_T), 1)
        ctx.dispatch(kernel, [x2.buf.gpu, *wbufs, y.buf.gpu], params, groups)
    return y.reshape(*lead, N) if x.ndim != 2 else y


def linear_group(x: WTensor, ws) -> list:
    """``[linear(x, w) for w in ws]``; for up to 8 tokens and matrices of one half/full-precision format that the
    wide GEMV reads, 2-4 of them in one dispatch (gemv.dispatch_group): one launch instead of several, and each
    output a dense (T, rows) view on one buffer."""
    ws = list(ws)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    if x2.strides[-1] != 1:
        x2 = x2.dense()
    T, K = x2.shape
    fmt = ws[0].format if ws else None
    pieces = []
    if x.ndim == 2 and T <= GEMV_MAX_T and fmt in fast_gemv.PER_WORD and len(ws) > 1 and \
            all(w.format == fmt and w.data.cols == K for w in ws):
        for w in ws:
            parts = list(w.data.pieces())
            if len(parts) != 1 or not fast_gemv.applies(fmt, K, x2.offset, x2.strides[0] if T > 1 else 0, T,
                                                        parts[0][1]):
                break
            pieces.append((parts[0][0], parts[0][1], parts[0][2]))
    if len(pieces) != len(ws) or len(ws) < 2:
        return [linear(x, w) for w in ws]
    ctx = x.ctx
    out = []
    for i in range(0, len(ws), fast_gemv.MAX_GROUP):
        group = pieces[i:i + fast_gemv.MAX_GROUP]
        if len(group) == 1:
            out.append(linear(x, ws[i]))
            continue
        y = empty(ctx, (T * sum(p[2] for p in group),))
        offsets = fast_gemv.dispatch_group(ctx, fmt, x2, group, y, T, K)
        out += [WTensor(ctx, y.buf, (T, p[2]), "f32", off) for p, off in zip(group, offsets, strict=True)]
    return out


def _embedding_code(fmt: str, wide: bool) -> str:
    return wgsl.header(_binds(("ids", "r", "u32"), fmt, wide)) + quant.decoder(fmt, wide) + f"""
// words: 0 T, 1 H, 2 first row of this piece (in the matrix view), 3 its rows, 4 its first row in W, 8..12 the
// format's (quant). A thread writes 8 values of a row (ld8), one at a time only in a row's last partial unit.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let i = group_id(wid, nw) * 256u + lid;
  let H = w(1u); let HU = (H + {U - 1}u) / {U}u;
  if (i >= w(0u) * HU) {{ return; }}
  let t = i / HU; let k = (i % HU) * {U}u;
  let id = ids[t];
  if (id < w(2u) || id >= w(2u) + w(3u)) {{ return; }}
  let rr = id - w(2u) + w(4u);
  let o = t * H + k;
  if (k + {U}u <= H) {{
    let v = ld8(rr, k);
    Y[o] = v.a.x; Y[o + 1u] = v.a.y; Y[o + 2u] = v.a.z; Y[o + 3u] = v.a.w;
    Y[o + 4u] = v.b.x; Y[o + 5u] = v.b.y; Y[o + 6u] = v.b.z; Y[o + 7u] = v.b.w;
  }} else {{
    for (var j = 0u; k + j < H; j++) {{ Y[o + j] = ld1(rr, k + j); }}
  }}
}}
"""


def embedding(ids, w) -> WTensor:
    """Rows ``ids`` of a (vocab, H) table, as f32."""
    m = Matrix.of(w.data)
    ctx = m.ctx
    idx = np.asarray(ids, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= m.rows):
        raise ValueError(f"embedding: token id {int(idx.max() if idx.max() >= m.rows else idx.min())} is outside "
                         f"the table's {m.rows} rows")
    T, H = idx.size, m.cols
    y = empty(ctx, (T, H))
    # a captured decode step (device.Capture) embeds each later step's token: the one id is that token
    token = (lambda inputs: np.array([inputs["token"]], np.int32).tobytes()) if T == 1 else None
    ids_t = from_numpy(ctx, idx.astype(np.int32), dynamic=token)
    wide = quant.wide(m.format, H)
    kernel = _kernel(ctx, "embedding", m.format, wide, _embedding_code(m.format, wide))
    units = -(-H // U)
    for _, row, n, first, wbufs, words in m.parts():
        ctx.dispatch(kernel, [ids_t.buf.gpu, *wbufs, y.buf.gpu], pack(T, H, first, n, row, 0, 0, 0, *words),
                     wgsl.grid(-(-T * units // 256), ctx.max_groups))
    return y


def table():
    """The (op, fn, format) rows of linear and embedding: every format in ``quant.FORMATS``, and None (any other
    format falls back here and is refused by ``Matrix``: the backend never makes one); the optional linear_group."""
    return [(op, fn, fmt) for op, fn in (("linear", linear), ("embedding", embedding))
            for fmt in (*quant.FORMATS, None)] + [("linear_group", linear_group, None)]
