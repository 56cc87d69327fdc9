"""The decode GEMV for f32 / f16 / bf16 weights, written for bandwidth: each workgroup of 256 threads computes 8
output rows, 32 threads a row; a thread reads 16 bytes of its row per step (one ``vec4<u32>``: 8 half-precision
values, or 4 f32) and the matching 8 (4) inputs of each of up to 8 tokens, so the weight is read once, in wide
coalesced loads, whatever the number of tokens. The 32 partial sums of a row meet in workgroup memory.

Applies when the row length is a multiple of 8 (f32: 4) and the input rows start on a 16-byte boundary
(``applies``); ``linear`` falls back to its plain GEMV otherwise.
"""

from __future__ import annotations

from . import wgsl
from .device import pack

WG = 256  # threads a workgroup: LANES a row, WG // LANES rows
MAX_T = 8
PER_WORD = {"f32": 4, "f16": 8, "bf16": 8}  # weight values in one vec4<u32>

_DECODE = {
    # (the 8 (or 4) weight values of word q as two vec4<f32> lo / hi)
    "bf16": "let lo = vec4<f32>(bf16_lo(q.x), bf16_hi(q.x), bf16_lo(q.y), bf16_hi(q.y));\n"
            "    let hi = vec4<f32>(bf16_lo(q.z), bf16_hi(q.z), bf16_lo(q.w), bf16_hi(q.w));",
    "f16": "let lo = vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y));\n"
           "    let hi = vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w));",
    "f32": "let lo = bitcast<vec4<f32>>(q);",
}


def applies(fmt: str, K: int, x_offset: int, x_stride: int, T: int, row_in_buffer: int) -> bool:
    per = PER_WORD.get(fmt)
    return (per is not None and T <= MAX_T and K % per == 0 and x_offset % 4 == 0 and x_stride % 4 == 0
            and (row_in_buffer * K) % per == 0)


UNROLL = 4  # words in flight per thread: enough outstanding loads to cover the memory latency


def lanes_for(K: int) -> int:
    """Threads a row: 64 for long rows (more workgroups in flight when the rows are few and long), else 32."""
    return 64 if K >= 8192 else 32


def code(fmt: str, T: int, LANES: int = 32, G: int = 1) -> str:
    """The kernel for ``T`` tokens (a compile-time constant, so the token loops unroll), ``LANES`` threads a row.
    ``G`` > 1: one dispatch over G matrices (``linear_group``), their rows one after the other; matrix j's outputs
    go to Y at their own offset, (T, rows_j) each."""
    ROWS = WG // LANES
    per = PER_WORD[fmt]
    two = per == 8
    load = "W[{}]" if G == 1 else "ldw(m, {})"
    loads = "\n".join(f"      let q{u} = {load.format(f'base + min(j + {u * LANES}u, last)')};" for u in range(UNROLL))
    body = []
    for u in range(UNROLL):
        dec = _DECODE[fmt].replace("q.", f"q{u}.").replace("let lo", f"let lo{u}").replace("let hi", f"let hi{u}")
        dec = dec.replace("bitcast<vec4<f32>>(q)", f"bitcast<vec4<f32>>(q{u})")
        xb = f"w(6u) + (j + {u * LANES}u) * {2 if two else 1}u"
        terms = []
        for t in range(T):
            x0 = f"X[{xb} + {t}u * xs]"
            term = f"dot(lo{u}, {x0})" + (f" + dot(hi{u}, X[{xb} + {t}u * xs + 1u])" if two else "")
            terms.append(f"acc[{t}] += select(0.0, {term}, j + {u * LANES}u < words);")
        body.append(f"      {{\n      {dec}\n      " + "\n      ".join(terms) + "\n      }")
    if G == 1:
        binds = [("X", "r", "vec4<f32>"), ("W", "r", "vec4<u32>"), ("Y", "w", "f32")]
        where = """  let live = r < w(3u);
  let m = 0u; let rr = r; let wrow = w(4u) + r;"""
        store = "Y[lane * w(2u) + w(5u) + r]"
        extra = ""
    else:
        binds = [("X", "r", "vec4<f32>")] + [(f"W{j}", "r", "vec4<u32>") for j in range(G)] + [("Y", "w", "f32")]
        # words 8 + 3j: matrix j's first row in the concatenation, its first row in its buffer, its output offset;
        # 8 + 3G: the rows of all of them
        picks = " ".join(f"if (r >= w({8 + 3 * j}u)) {{ m = {j}u; }}" for j in range(1, G))
        where = f"""  let live = r < w({8 + 3 * G}u);
  var m = 0u; {picks}
  let rr = r - w(8u + 3u * m); let wrow = w(9u + 3u * m) + rr;
  let rows_m = select(w({8 + 3 * G}u), w(11u + 3u * m), m + 1u < {G}u) - w(8u + 3u * m);"""
        store = "Y[w(10u + 3u * m) + lane * rows_m + rr]"
        cases = " ".join(f"case {j}u: {{ return W{j}[i]; }}" for j in range(G - 1))
        extra = f"fn ldw(m: u32, i: u32) -> vec4<u32> {{ switch m {{ {cases} default: {{ return W{G - 1}[i]; }} }} }}\n"
    return wgsl.header(binds) + extra + f"""
// words: 0 T, 1 K, 2 N (row stride of Y), 3 rows of this piece, 4 first row in W, 5 first column of Y,
// 6 offset of X (in vec4s), 7 row stride of X (in vec4s); G > 1: see code()
var<workgroup> part: array<f32, {ROWS * LANES * T}>;
@compute @workgroup_size({ROWS * LANES})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let K = w(1u);
  let lane = lid % {LANES}u; let sub = lid / {LANES}u;
  let r = group_id(wid, nw) * {ROWS}u + sub;
{where}
  var acc: array<f32, {T}>;
  for (var t = 0u; t < {T}u; t++) {{ acc[t] = 0.0; }}
  if (live) {{
    let words = K / {per}u;
    let base = wrow * words;
    let last = words - 1u;
    let xs = w(7u);
    for (var j = lane; j < words; j += {LANES * UNROLL}u) {{
{loads}
{chr(10).join(body)}
    }}
  }}
  for (var t = 0u; t < {T}u; t++) {{ part[t * {ROWS * LANES}u + lid] = acc[t]; }}
  workgroupBarrier();
  for (var s = {LANES // 2}u; s > 0u; s >>= 1u) {{
    if (lane < s) {{
      for (var t = 0u; t < {T}u; t++) {{ part[t * {ROWS * LANES}u + lid] += part[t * {ROWS * LANES}u + lid + s]; }}
    }}
    workgroupBarrier();
  }}
  if (live && lane < {T}u) {{ {store} = part[lane * {ROWS * LANES}u + sub * {LANES}u]; }}
}}
"""


def dispatch(ctx, fmt: str, x2, buf, y, T: int, K: int, N: int, rows: int, row: int, col: int,
             lanes: int | None = None) -> None:
    lanes = lanes or lanes_for(K)
    kernel = ctx.kernel(f"gemv_wide_{fmt}_t{T}_l{lanes}", code(fmt, T, lanes), "rrw")
    params = pack(T, K, N, rows, row, col, x2.offset // 4, x2.strides[0] // 4 if T > 1 else 0)
    ctx.dispatch(kernel, [x2.buf.gpu, buf, y.buf.gpu], params, wgsl.grid(-(-rows // (WG // lanes)), ctx.max_groups))


MAX_GROUP = 4  # matrices one dispatch reads (storage bindings: X, 4 weights, Y)


def dispatch_group(ctx, fmt: str, x2, pieces, y, T: int, K: int) -> list[int]:
    """One dispatch over several matrices: ``pieces`` [(buffer, first row in it, rows)], 2 to MAX_GROUP of them;
    their outputs go to ``y`` (a buffer of at least T x their rows) one after the other, (T, rows) each. Returns
    each output's element offset in ``y``."""
    G = len(pieces)
    lanes = lanes_for(K)
    kernel = ctx.kernel(f"gemv_group{G}_{fmt}_t{T}_l{lanes}", code(fmt, T, lanes, G), "r" * (G + 1) + "w")
    words, offsets, first, out = [], [], 0, y.offset
    for _, row, rows in pieces:
        words += [first, row, out]
        offsets.append(out)
        first += rows
        out += T * rows
    params = pack(T, K, 0, 0, 0, 0, x2.offset // 4, x2.strides[0] // 4 if T > 1 else 0, *words, first)
    ctx.dispatch(kernel, [x2.buf.gpu] + [p[0] for p in pieces] + [y.buf.gpu], params,
                 wgsl.grid(-(-first // (WG // lanes)), ctx.max_groups))
    return offsets
