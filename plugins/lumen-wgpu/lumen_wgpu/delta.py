"""Gated-DeltaNet on wgpu: the causal depthwise conv with its rolling state, the gated delta rule and its gates.

Semantics are lumen_cpu.delta's, step for step. The delta rule runs the token-by-token recurrence for decode and
prefill alike: each V head's state (Dk, Dv) is split by columns over workgroups (a column of the state evolves on
its own given k, q, g, beta), held in registers for the whole prompt, and read and written once a call. A decode
step is two dispatches (q/k norms, then the recurrence); so is a prefill, whose recurrence loops over the tokens
inside the kernel. The CPU's chunked prefill and this recurrence agree to ~1e-7 on random inputs.

States live on the device (``current_context()``) and are updated in place; they are dataclasses of WTensors like
the CPU's of arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import wgsl
from .device import pack
from .tensor import WTensor, current_context, empty, from_numpy

L2_EPS = 1e-6  # lumen_cpu.delta._l2


@dataclass
class ConvState:
    x: WTensor  # (kernel-1, channels): the last inputs seen


@dataclass
class DeltaState:
    s: WTensor  # (v_heads, k_dim, v_dim), f32


def conv_state(channels: int, kernel: int) -> ConvState:
    return ConvState(from_numpy(current_context(), np.zeros((kernel - 1, channels), np.float32)))


def delta_state(v_heads: int, k_dim: int, v_dim: int) -> DeltaState:
    return DeltaState(from_numpy(current_context(), np.zeros((v_heads, k_dim, v_dim), np.float32)))


# -- causal conv -------------------------------------------------------------------------------------------------
CONV_WG = 256
CONV_TB = 16  # tokens a thread convolves; a prompt of more runs its blocks in parallel, then updates the state

_CONV = wgsl.header([("X", "r", "f32"), ("Wc", "r", "f32"), ("S", "w", "f32"), ("Y", "w", "f32")]) + f"""
// One thread per (channel, block of tokens). full = [state (K-1 rows); x (T rows)]; y[t] = silu(sum_k full[t+k] w[k])
// words: 0 T, 1 C, 2 K, 3 x row stride, 4 x column stride, 5 x offset, 6 w offset, 7 state offset,
// 8 tokens a block, 9 mode (0: y only, 1: y then the state, 2: the state only)
fn full_at(src: u32, c: u32) -> f32 {{
  let K1 = w(2u) - 1u;
  if (src < K1) {{ return S[w(7u) + src * w(1u) + c]; }}
  return X[w(5u) + (src - K1) * w(3u) + c * w(4u)];
}}
@compute @workgroup_size({CONV_WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let C = w(1u); let K = w(2u); let mode = w(9u);
  let c = wid.x * {CONV_WG}u + lid;
  if (c >= C) {{ return; }}
  if (mode != 2u) {{
    let t0 = wid.y * w(8u);
    let t1 = min(T, t0 + w(8u));
    for (var t = t0; t < t1; t++) {{
      var acc = 0.0;
      for (var k = 0u; k < K; k++) {{ acc += full_at(t + k, c) * Wc[w(6u) + c * K + k]; }}
      Y[t * C + c] = acc * sigmoid_f(acc);
    }}
  }}
  if (mode != 0u) {{
    // new state[j] = full[T + j]: ascending j never reads a slot already rewritten (T + j > j)
    for (var j = 0u; j + 1u < K; j++) {{ S[w(7u) + j * C + c] = full_at(T + j, c); }}
  }}
}}
"""


def causal_conv1d(x: WTensor, w: WTensor, state: ConvState) -> WTensor:
    """silu(depthwise causal conv): x (T, C), w (C, K) -> (T, C); state keeps the last K-1 inputs."""
    ctx = x.ctx
    T, C = x.shape
    K = w.shape[1]
    if w.shape[0] != C or state.x.shape != (K - 1, C):
        raise ValueError(f"causal_conv1d: x {x.shape}, w {w.shape} and state {state.x.shape} disagree")
    w, st = w.dense(), state.x
    if not st.is_dense:
        raise ValueError("causal_conv1d: the conv state must be a dense tensor")
    y = empty(ctx, (T, C))
    kernel = ctx.kernel("causal_conv1d", _CONV, "rrww")
    bufs = [x.buf.gpu, w.buf.gpu, st.buf.gpu, y.buf.gpu]
    gx = -(-C // CONV_WG)
    words = (T, C, K, x.strides[0], x.strides[1], x.offset, w.offset, st.offset, CONV_TB)
    if T <= CONV_TB:  # decode and short prompts: one dispatch
        ctx.dispatch(kernel, bufs, pack(*words, 1), (gx, 1, 1))
    else:
        ctx.dispatch(kernel, bufs, pack(*words, 0), (gx, -(-T // CONV_TB), 1))
        ctx.dispatch(kernel, bufs, pack(*words, 2), (gx, 1, 1))
    return y


# -- gates -------------------------------------------------------------------------------------------------------

_GATES = wgsl.header([("A", "r", "f32"), ("Bi", "r", "f32"), ("NA", "r", "f32"), ("DT", "r", "f32"),
                      ("G", "w", "f32"), ("Beta", "w", "f32")]) + """
// words: 0 T, 1 H, 2..4 a (row stride, column stride, offset), 5..7 b, 8..9 neg_a (stride, offset), 10..11 dt_bias
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  let H = w(1u);
  if (i >= w(0u) * H) { return; }
  let t = i / H; let h = i % H;
  let a = A[w(4u) + t * w(2u) + h * w(3u)] + DT[w(11u) + h * w(10u)];
  G[i] = NA[w(9u) + h * w(8u)] * softplus_f(a);
  Beta[i] = sigmoid_f(Bi[w(7u) + t * w(5u) + h * w(6u)]);
}
"""


def gdn_gates(a: WTensor, b: WTensor, neg_a: WTensor, dt_bias: WTensor):
    """(a (T, Hv), b (T, Hv), neg_a (Hv,), dt_bias (Hv,)) -> (g, beta): g = neg_a * softplus(a + dt_bias),
    beta = sigmoid(b), in one kernel."""
    ctx = a.ctx
    T, H = a.shape
    if b.shape != (T, H) or neg_a.shape != (H,) or dt_bias.shape != (H,):
        raise ValueError(f"gdn_gates: a {a.shape}, b {b.shape}, neg_a {neg_a.shape}, dt_bias {dt_bias.shape}")
    g, beta = empty(ctx, (T, H)), empty(ctx, (T, H))
    words = (T, H, *a.strides, a.offset, *b.strides, b.offset, neg_a.strides[0], neg_a.offset,
             dt_bias.strides[0], dt_bias.offset)
    ctx.dispatch(ctx.kernel("gdn_gates", _GATES, "rrrrww"),
                 [a.buf.gpu, b.buf.gpu, neg_a.buf.gpu, dt_bias.buf.gpu, g.buf.gpu, beta.buf.gpu], pack(*words),
                 wgsl.grid(-(-T * H // 256), ctx.max_groups))
    return g, beta


# -- gated delta rule --------------------------------------------------------------------------------------------
NORM_WG = 64
COLS = 32  # state columns a workgroup owns
SLICES = 8  # threads sharing a column: each holds every SLICES-th row of it

_QK_NORM = wgsl.header([("Q", "r", "f32"), ("Kx", "r", "f32"), ("N", "w", "f32")]) + f"""
// sqrt(sum x^2 + eps) of every q and k row: N[(t * Hk + h) * 2] for q, + 1 for k
// words: 0 T, 1 Hk, 2 Dk, 3 eps, 4..7 q (t, head, d strides, offset), 8..11 k
var<workgroup> rq: array<f32, {NORM_WG}>;
var<workgroup> rk: array<f32, {NORM_WG}>;
@compute @workgroup_size({NORM_WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let r = group_id(wid, nw);
  if (r >= w(0u) * w(1u)) {{ return; }}
  let t = r / w(1u); let h = r % w(1u);
  let qb = w(7u) + t * w(4u) + h * w(5u); let kb = w(11u) + t * w(8u) + h * w(9u);
  var sq = 0.0; var sk = 0.0;
  for (var d = lid; d < w(2u); d += {NORM_WG}u) {{
    let a = Q[qb + d * w(6u)]; let b = Kx[kb + d * w(10u)];
    sq += a * a; sk += b * b;
  }}
  rq[lid] = sq; rk[lid] = sk;
  workgroupBarrier();
  for (var s = {NORM_WG // 2}u; s > 0u; s >>= 1u) {{
    if (lid < s) {{ rq[lid] += rq[lid + s]; rk[lid] += rk[lid + s]; }}
    workgroupBarrier();
  }}
  if (lid == 0u) {{ N[r * 2u] = sqrt(rq[0] + wf(3u)); N[r * 2u + 1u] = sqrt(rk[0] + wf(3u)); }}
}}
"""


def _delta_code(dk: int) -> str:
    rows = -(-dk // SLICES)
    guard = "" if dk % SLICES == 0 else f"if (i >= {dk}u) {{ continue; }}"
    return wgsl.header([("Q", "r", "f32"), ("Kx", "r", "f32"), ("V", "r", "f32"), ("Gt", "r", "f32"),
                        ("Bt", "r", "f32"), ("N", "r", "f32"), ("S", "w", "f32"), ("O", "w", "f32")]) + f"""
// Workgroup (column block, V head h): 256 threads = {COLS} columns x {SLICES} slices; thread (jj, ii) holds rows
// i = r * {SLICES} + ii of column j of head h's state in registers for every token:
//   s *= exp(g); delta = (v - s^T k) * beta; s += k delta^T; out = s^T q   (k, q L2-normalised, q scaled)
// words: 0 T, 1 Hv, 2 V heads a K head, 3 q scale, 4 Dv, 5..8 q (t, head, d strides, offset), 9..12 k,
// 13..16 v, 17..19 g (t, head strides, offset), 20..22 beta, 23 state offset, 24 Hk
const DK = {dk}u;
const R = {rows}u;
var<workgroup> kq: array<f32, {2 * dk}>;
var<workgroup> red: array<f32, {COLS * SLICES}>;
var<workgroup> dl: array<f32, {COLS}>;
@compute @workgroup_size({COLS * SLICES})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let Hv = w(1u); let Dv = w(4u); let Hk = w(24u);
  let h = wid.y; let hk = h / w(2u);
  let jj = lid % {COLS}u; let ii = lid / {COLS}u;
  let j = wid.x * {COLS}u + jj;
  let live = j < Dv;
  let sb = w(23u) + h * DK * Dv + j;
  var s: array<f32, R>;
  for (var r = 0u; r < R; r++) {{
    let i = r * {SLICES}u + ii;
    s[r] = 0.0;
    if (live && i < DK) {{ s[r] = S[sb + i * Dv]; }}
  }}
  for (var t = 0u; t < T; t++) {{
    workgroupBarrier();  // the previous token's kq, red and dl are read
    let nq = N[(t * Hk + hk) * 2u]; let nk = N[(t * Hk + hk) * 2u + 1u];
    for (var d = lid; d < DK; d += {COLS * SLICES}u) {{
      kq[d] = Kx[w(12u) + t * w(9u) + hk * w(10u) + d * w(11u)] / nk;
      kq[DK + d] = (Q[w(8u) + t * w(5u) + hk * w(6u) + d * w(7u)] / nq) * wf(3u);
    }}
    workgroupBarrier();
    let decay = exp(Gt[w(19u) + t * w(17u) + h * w(18u)]);
    let bt = Bt[w(22u) + t * w(20u) + h * w(21u)];
    var part = 0.0;
    for (var r = 0u; r < R; r++) {{
      let i = r * {SLICES}u + ii;
      {guard}
      s[r] *= decay;
      part += s[r] * kq[i];
    }}
    red[lid] = part;
    workgroupBarrier();
    if (ii == 0u) {{
      var kv = 0.0;
      for (var q = 0u; q < {SLICES}u; q++) {{ kv += red[q * {COLS}u + jj]; }}
      var vv = 0.0;
      if (live) {{ vv = V[w(16u) + t * w(13u) + h * w(14u) + j * w(15u)]; }}
      dl[jj] = (vv - kv) * bt;
    }}
    workgroupBarrier();  // also: every read of red above is done before it is written again below
    let dd = dl[jj];
    part = 0.0;
    for (var r = 0u; r < R; r++) {{
      let i = r * {SLICES}u + ii;
      {guard}
      s[r] += kq[i] * dd;
      part += s[r] * kq[DK + i];
    }}
    red[lid] = part;
    workgroupBarrier();
    if (ii == 0u && live) {{
      var o = 0.0;
      for (var q = 0u; q < {SLICES}u; q++) {{ o += red[q * {COLS}u + jj]; }}
      O[(t * Hv + h) * Dv + j] = o;
    }}
  }}
  for (var r = 0u; r < R; r++) {{
    let i = r * {SLICES}u + ii;
    if (live && i < DK) {{ S[sb + i * Dv] = s[r]; }}
  }}
}}
"""


def gated_delta_rule(q: WTensor, k: WTensor, v: WTensor, g: WTensor, beta: WTensor, state: DeltaState) -> WTensor:
    """q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv) -> out (T, Hv, Dv); the state (Hv, Dk, Dv) in place.

    q and k are L2-normalised and q scaled by Dk^-0.5 here. Each k head serves Hv/Hk consecutive v heads. Inputs
    may be strided views (slices of one projection's output): the kernels read them through their strides."""
    ctx = v.ctx
    T, Hk, Dk = k.shape
    _, Hv, Dv = v.shape
    s = state.s
    if q.shape != k.shape or v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv) or Hv % Hk:
        raise ValueError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}")
    if s.shape != (Hv, Dk, Dv) or not s.is_dense:
        raise ValueError(f"gated_delta_rule: the state {s.shape} is not a dense ({Hv}, {Dk}, {Dv}) tensor")
    out = empty(ctx, (T, Hv, Dv))
    if T == 0:
        return out
    norms = empty(ctx, (T, Hk, 2))
    qw, kw = (*q.strides, q.offset), (*k.strides, k.offset)
    ctx.dispatch(ctx.kernel("gdn_qk_norm", _QK_NORM, "rrw"), [q.buf.gpu, k.buf.gpu, norms.buf.gpu],
                 pack(T, Hk, Dk, L2_EPS, *qw, *kw), wgsl.grid(T * Hk, ctx.max_groups))
    scale = float(np.float32(Dk ** -0.5))
    words = (T, Hv, Hv // Hk, scale, Dv, *qw, *kw, *v.strides, v.offset, *g.strides, g.offset,
             *beta.strides, beta.offset, s.offset, Hk)
    kernel = ctx.kernel(f"gated_delta_rule_dk{Dk}", _delta_code(Dk), "rrrrrrww")
    ctx.dispatch(kernel, [q.buf.gpu, k.buf.gpu, v.buf.gpu, g.buf.gpu, beta.buf.gpu, norms.buf.gpu, s.buf.gpu,
                          out.buf.gpu], pack(*words), (-(-Dv // COLS), Hv, 1))
    return out


def table():
    return [(f.__name__, f, None) for f in (conv_state, causal_conv1d, delta_state, gated_delta_rule, gdn_gates)]
