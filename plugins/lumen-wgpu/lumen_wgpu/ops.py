"""The wgpu implementation of the op contract (lumen_core.ops): elementwise ops, norms, rotary embeddings,
concat and gather here; linear/embedding in ``linear``; attention, Gated-DeltaNet and MoE in their own modules.

Every op records dispatches on the tensor's context (device.Context) and returns at once; nothing waits for the
GPU until a value is read back.
"""

from __future__ import annotations

import math

import numpy as np

from lumen_core import rope as _rope

from . import wgsl
from .device import pack
from .tensor import WTensor, elementwise, empty, from_numpy

ERF = """fn erf_f(x: f32) -> f32 {  // Abramowitz & Stegun 7.1.26, |error| < 1.5e-7
  let t = 1.0 / (1.0 + 0.3275911 * abs(x));
  let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
          * exp(-x * x);
  return select(-y, y, x >= 0.0);
}
"""


# -- elementwise ---------------------------------------------------------------------------------------------------
def sigmoid(x):
    return elementwise("sigmoid_f(a)", [x])


def silu(x):
    return elementwise("a * sigmoid_f(a)", [x])


def softplus(x):
    return elementwise("softplus_f(a)", [x])


def exp(x):
    return elementwise("exp(a)", [x])


def silu_mul(gate, up):
    return elementwise("a * sigmoid_f(a) * b", [gate, up])


def gelu_tanh_mul(gate, up):
    return elementwise("gelu_tanh_f(a) * b", [gate, up])


def gelu_tanh(x):
    return elementwise("gelu_tanh_f(a)", [x])


def gelu(x):
    return elementwise("0.5 * a * (1.0 + erf_f(a * 0.7071067811865476))", [x], prelude=ERF)


def softcap(x, cap: float):
    return elementwise("tanh_f(a / s) * s", [x], scalar=float(cap))


def clamp(x, lo: float, hi: float):
    # two scalars: lo through s, hi folded into the expression's text (a kernel per distinct bound is fine: few)
    return elementwise(f"min(max(a, s), {_wgsl_float(hi)})", [x], scalar=float(lo))


def _wgsl_float(v: float) -> str:
    if math.isinf(v):
        return "3.4028234663852886e38" if v > 0 else "-3.4028234663852886e38"
    return repr(float(np.float32(v))) if "e" in repr(float(v)) or "." in repr(float(v)) else f"{float(v)}"


# -- row reductions: norms -------------------------------------------------------------------------------------
WG_ROW = 128

_NORMS = {
    # (statistic over the row, value written); x: the element, g: the gate/bias element, wt: the weight element
    "rms": ("sq", "x * inv * wt"),
    "rms_plain": ("sq", "x * inv"),
    "rms_gated": ("sq", "x * inv * wt * (g * sigmoid_f(g))"),
    "l2": ("sum_sq", "x * inv"),
    "layer": ("mean_var", "(x - mean) * inv * wt + g"),
    "layer_plain": ("mean_var", "(x - mean) * inv"),
}


def _norm_code(kind: str) -> str:
    stat, value = _NORMS[kind]
    binds = [("X", "r", "f32"), ("G", "r", "f32"), ("Wt", "r", "f32"), ("Y", "w", "f32")]
    if stat == "mean_var":
        first = "s1 += x;"
        finish = ("let mean = red[0] / f32(D); workgroupBarrier(); var s2 = 0.0;\n"
                  "  for (var d = lid; d < D; d += WGu) { let e = X[xo + d] - mean; s2 += e * e; }\n"
                  "  red[lid] = s2; workgroupBarrier();\n  reduce(lid);\n"
                  "  let inv = inverseSqrt(red[0] / f32(D) + eps);")
    else:
        first = "s1 += x * x;"
        finish = ("let mean = 0.0;\n  let inv = " +
                  ("inverseSqrt(red[0] * (1.0 / f32(D)) + eps);" if stat == "sq" else "1.0 / sqrt(red[0] + eps);"))
    return (wgsl.header(binds) + f"""
const WGu = {WG_ROW}u;
var<workgroup> red: array<f32, {WG_ROW}>;
fn reduce(lid: u32) {{
  for (var s = WGu / 2u; s > 0u; s >>= 1u) {{
    if (lid < s) {{ red[lid] += red[lid + s]; }}
    workgroupBarrier();
  }}
}}
// words: 0 rows, 1 D, 2 eps, 3 weight offset (added to w), 4 rows per lead block (d1), 5 x stride 0, 6 x stride 1,
// 7 x offset, 8 g stride 0, 9 g stride 1, 10 g offset
@compute @workgroup_size({WG_ROW})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let r = group_id(wid, nw);
  if (r >= w(0u)) {{ return; }}
  let D = w(1u); let eps = wf(2u); let off = wf(3u);
  let r0 = r / w(4u); let r1 = r % w(4u);
  let xo = w(7u) + r0 * w(5u) + r1 * w(6u);
  let go = w(10u) + r0 * w(8u) + r1 * w(9u);
  var s1 = 0.0;
  for (var d = lid; d < D; d += WGu) {{ let x = X[xo + d]; {first} }}
  red[lid] = s1;
  workgroupBarrier();
  reduce(lid);
  {finish}
  for (var d = lid; d < D; d += WGu) {{
    let x = X[xo + d]; let g = G[go + d]; let wt = Wt[d] + off;
    Y[r * D + d] = {value};
  }}
}}
""")


def _rows(x: WTensor):
    """(rows, rows per lead block, stride 0, stride 1, offset) addressing the rows of ``x`` (..., D) with at most
    two leading axes of arbitrary stride; others are made dense first."""
    if x.strides[-1] != 1 or x.ndim > 3:
        x = x.dense()
    if x.ndim == 1:
        return x, (1, 1, 0, 0, x.offset)
    if x.ndim == 2:
        return x, (x.shape[0], 1, x.strides[0], 0, x.offset)
    return x, (x.shape[0] * x.shape[1], x.shape[1], x.strides[0], x.strides[1], x.offset)


def _norm(kind: str, x: WTensor, gate=None, weight=None, eps: float = 0.0, offset: float = 0.0):
    ctx, D = x.ctx, x.shape[-1]
    x, (rows, d1, s0, s1, xo) = _rows(x)
    gw = (1, 1, 0, 0, 0)
    if gate is not None:
        gate, (_, _, g0, g1, go) = _rows(gate.broadcast_to(x.shape) if gate.shape != x.shape else gate)
        gw = (0, 0, g0, g1, go)
    y = empty(ctx, x.shape)
    wt = _dense_vec(weight).buf.gpu if weight is not None else x.buf.gpu  # unread when the kind has no weight
    g = gate if gate is not None else x
    kernel = ctx.kernel(f"norm_{kind}", _norm_code(kind), "rrrw")
    ctx.dispatch(kernel, [x.buf.gpu, g.buf.gpu, wt, y.buf.gpu],
                 pack(rows, D, float(eps), float(offset), d1, s0, s1, xo, gw[2], gw[3], gw[4]),
                 wgsl.grid(rows, ctx.max_groups))
    return y


def _dense_vec(w: WTensor) -> WTensor:
    w = w.dense()
    if w.offset:  # the kernel reads Wt[d]: bring a view at an offset to its own buffer
        w = elementwise("a", [w])
    return w


def rms_norm(x, w, eps: float, offset: float = 0.0):
    if w is None:
        return _norm("rms_plain", x, eps=eps)
    return _norm("rms", x, weight=w, eps=eps, offset=offset)


def rms_norm_gated(x, gate, w, eps: float):
    return _norm("rms_gated", x, gate=gate, weight=w, eps=eps)


def l2norm(x, eps: float = 1e-6):
    return _norm("l2", x, eps=eps)


def layer_norm(x, w, b, eps: float):
    if w is None and b is None:
        return _norm("layer_plain", x, eps=eps)
    ctx, D = x.ctx, x.shape[-1]
    w = w if w is not None else from_numpy(ctx, np.ones(D, np.float32))
    b = b if b is not None else from_numpy(ctx, np.zeros(D, np.float32))
    return _norm("layer", x, gate=b.reshape(D), weight=w, eps=eps)


# -- rotary embeddings ---------------------------------------------------------------------------------------------
def rope_tables(positions, inv_freq, mrope_section=None, interleaved=False):
    """Host math (lumen_core.rope), uploaded: cos, sin (T, rot) on the device."""
    from .tensor import current_context

    cos, sin = _rope.rope_tables(positions, inv_freq, mrope_section, interleaved)
    ctx = current_context()
    pos = np.asarray(positions, dtype=np.int64)

    def later(which):  # a captured decode step: the tables of the same positions moved by inputs["delta"]
        return lambda inputs: np.ascontiguousarray(
            _rope.rope_tables(pos + inputs["delta"], inv_freq, mrope_section, interleaved)[which]).tobytes()

    return (from_numpy(ctx, cos, dynamic=later(0)), from_numpy(ctx, sin, dynamic=later(1)))


_ROPE = wgsl.header([("X", "r", "f32"), ("C", "r", "f32"), ("S", "r", "f32"), ("Y", "w", "f32")]) + """
// words: 0 n, 1 heads, 2 D, 3 rot, 4..6 x strides (t, head, d), 7 x offset, 8 c/s row stride, 9 c offset, 10 s offset
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  if (i >= w(0u)) { return; }
  let D = w(2u); let heads = w(1u); let rot = w(3u);
  let d = i % D; let h = (i / D) % heads; let t = i / (D * heads);
  let xb = w(7u) + t * w(4u) + h * w(5u);
  let x = X[xb + d * w(6u)];
  if (d >= rot) { Y[i] = x; return; }
  let half = rot / 2u;
  let other = select(X[xb + (d - half) * w(6u)], -X[xb + (d + half) * w(6u)], d < half);
  Y[i] = x * C[w(9u) + t * w(8u) + d] + other * S[w(10u) + t * w(8u) + d];
}
"""


def apply_rope(x, cos, sin):
    ctx = x.ctx
    T, heads, D = x.shape
    rot = cos.shape[-1]
    cos, sin = cos.dense(), sin.dense()
    y = empty(ctx, x.shape)
    n = T * heads * D
    kernel = ctx.kernel("apply_rope", _ROPE, "rrrw")
    ctx.dispatch(kernel, [x.buf.gpu, cos.buf.gpu, sin.buf.gpu, y.buf.gpu],
                 pack(n, heads, D, rot, *x.strides, x.offset, rot, cos.offset, sin.offset),
                 wgsl.grid(-(-n // 256), ctx.max_groups))
    return y


# -- layout ------------------------------------------------------------------------------------------------------
def concat(xs):
    xs = list(xs)
    first = xs[0]
    rest = first.shape[1:]
    if any(x.shape[1:] != rest for x in xs):
        raise ValueError(f"concat: shapes {[x.shape for x in xs]} differ past the first axis")
    total = sum(x.shape[0] for x in xs)
    out = empty(first.ctx, (total, *rest), first.dtype)
    row = 0
    for x in xs:
        n = x.shape[0]
        if n:
            elementwise("a", [x], dtype=x.dtype, out=out[row:row + n])
        row += n
    return out


_GATHER = wgsl.header([("Tb", "r", "u32"), ("ids", "r", "i32"), ("Y", "w", "u32")]) + """
// words: 0 n, 1 inner (elements a row), 2 table offset, 3 ids offset, 4 table rows
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  if (i >= w(0u)) { return; }
  let inner = w(1u);
  let row = u32(ids[w(3u) + i / inner]);
  Y[i] = Tb[w(2u) + min(row, w(4u) - 1u) * inner + i % inner];
}
"""


def gather(table, ids):
    ctx = table.ctx if isinstance(table, WTensor) else ids.ctx
    if not isinstance(ids, WTensor):
        ids = from_numpy(ctx, np.asarray(ids, dtype=np.int32))
    table, ids = table.dense(), ids.dense()
    inner = math.prod(table.shape[1:])
    out = empty(ctx, ids.shape + table.shape[1:], table.dtype)
    n = out.size
    ctx.dispatch(ctx.kernel("gather", _GATHER, "rrw"), [table.buf.gpu, ids.buf.gpu, out.buf.gpu],
                 pack(n, inner, table.offset, ids.offset, table.shape[0]), wgsl.grid(-(-n // 256), ctx.max_groups))
    return out


def table():
    from . import attention, delta, linear, moe

    plain = [sigmoid, silu, softplus, exp, silu_mul, gelu_tanh_mul, gelu_tanh, gelu, softcap, clamp, rms_norm,
             rms_norm_gated, l2norm, layer_norm, rope_tables, apply_rope, concat, gather]
    rows = [(f.__name__, f, None) for f in plain]
    rows += linear.table()  # linear and embedding, a variant per weight format
    for mod in (attention, delta, moe):
        rows += mod.table()
    return rows
