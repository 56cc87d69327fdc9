"""Mixture of experts on wgpu: the router's softmax top-k and the routed experts' MLPs, with the expert ids and
weights kept on the device (a decode step stays one command buffer: nothing here reads back to the host).

Every expert kernel finds its expert's weights from the device ids, so one dispatch must reach every expert's
matrix: the experts of a layer live in one buffer per projection, laid out as ``moe_experts_packed``'s tensors —
gate_up (E, 2I, H) (each expert's gate rows, then its up rows) and down (E, H, I). A packed Weight already is that
(a ``linear.Matrix`` with rows = E); per-expert Weights are copied into it on the device at first use, the result
cached on the first expert's gate Weight, and each expert's own Matrices then read their rows from the packed
buffers (their own buffers are released: the experts are not held twice). When a layer's experts exceed the
adapter's largest storage binding they are split into groups of whole experts, one buffer each, and every group is
a dispatch of its own (kernels skip the (token, slot) pairs routed outside their group).

Expert weights are read through the format's decoder (lumen_wgpu.quant: what ``linear`` reads, the same f32
values as the CPU's dequantization): f32, f16, bf16 and the GGUF block formats kept as stored (q8_0, q4_0, q5_0,
q4_k, q5_k, q6_k). fp8 and nvfp4 experts are refused: their per-matrix scales would need packing too.

Two shapes of work: up to ``GEMV_MAX_T`` tokens, a GEMV per (pair, row) (decode: each routed row is read once);
beyond, each workgroup owns one expert and a tile of rows, collects the pairs routed to it from the ids, and
multiplies them as a tiled GEMM (an expert's weights are read once per 32 of its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import quant, wgsl
from .device import pack, wgpu_module
from .tensor import WTensor, empty

MAX_E = 2048  # experts a router row: its probabilities sit in workgroup memory
MAX_K = 64
GEMV_MAX_T = 8
WG_GEMV = 64
TILE = 32
LMAX = 512  # pairs a tiled workgroup scans in one go (the pair list sits in workgroup memory)
EXPERT_FORMATS = ("f32", "f16", "bf16", *quant.GGUF_BLOCKS)  # unscaled: one weight buffer a matrix
ACTS = {"silu": "a * sigmoid_f(a) * b", "gelu_tanh": "gelu_tanh_f(a) * b"}


# -- router ------------------------------------------------------------------------------------------------------
_ROUTE = wgsl.header([("L", "r", "f32"), ("Wo", "w", "f32"), ("Io", "w", "i32")]) + f"""
// One workgroup a token: softmax over E, then k rounds of argmax (ties: the lower expert, as a stable argsort of
// -p), then the chosen probabilities renormalised (summed in numpy's order: in turn below 8, else 8 accumulators).
// words: 0 T, 1 E, 2 k, 3 normalize, 4 row stride, 5 column stride, 6 offset
var<workgroup> p: array<f32, {MAX_E}>;
var<workgroup> rv: array<f32, 256>;
var<workgroup> ri: array<u32, 256>;
var<workgroup> top: array<f32, {MAX_K}>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let t = group_id(wid, nw);
  if (t >= w(0u)) {{ return; }}
  let E = w(1u); let k = w(2u);
  let lb = w(6u) + t * w(4u);
  var m = -3.4e38;
  for (var e = lid; e < E; e += 256u) {{ m = max(m, L[lb + e * w(5u)]); }}
  rv[lid] = m;
  workgroupBarrier();
  for (var s = 128u; s > 0u; s >>= 1u) {{
    if (lid < s) {{ rv[lid] = max(rv[lid], rv[lid + s]); }}
    workgroupBarrier();
  }}
  let mx = rv[0];
  workgroupBarrier();
  var sum = 0.0;
  for (var e = lid; e < E; e += 256u) {{ let z = exp(L[lb + e * w(5u)] - mx); p[e] = z; sum += z; }}
  rv[lid] = sum;
  workgroupBarrier();
  for (var s = 128u; s > 0u; s >>= 1u) {{
    if (lid < s) {{ rv[lid] += rv[lid + s]; }}
    workgroupBarrier();
  }}
  let tot = rv[0];
  for (var e = lid; e < E; e += 256u) {{ p[e] = p[e] / tot; }}
  for (var r = 0u; r < k; r++) {{
    workgroupBarrier();
    var bv = -1.0;  // probabilities are >= 0; a chosen expert is marked -2
    var bi = 0xffffffffu;
    for (var e = lid; e < E; e += 256u) {{ if (p[e] > bv) {{ bv = p[e]; bi = e; }} }}
    rv[lid] = bv; ri[lid] = bi;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {{
      if (lid < s) {{
        let v2 = rv[lid + s]; let i2 = ri[lid + s];
        if (v2 > rv[lid] || (v2 == rv[lid] && i2 < ri[lid])) {{ rv[lid] = v2; ri[lid] = i2; }}
      }}
      workgroupBarrier();
    }}
    if (lid == 0u) {{
      let best = min(ri[0], E - 1u);  // NaN logits choose nothing: an id in range all the same
      top[r] = rv[0];
      Io[t * k + r] = i32(best);
      p[best] = -2.0;
    }}
  }}
  if (lid == 0u) {{
    var z = 1.0;
    if (w(3u) == 1u) {{
      if (k < 8u) {{
        z = 0.0;
        for (var r = 0u; r < k; r++) {{ z += top[r]; }}
      }} else {{
        var acc: array<f32, 8>;
        for (var j = 0u; j < 8u; j++) {{ acc[j] = top[j]; }}
        var r = 8u;
        for (; r + 8u <= k; r += 8u) {{
          for (var j = 0u; j < 8u; j++) {{ acc[j] += top[r + j]; }}
        }}
        z = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; r < k; r++) {{ z += top[r]; }}
      }}
    }}
    for (var r = 0u; r < k; r++) {{ Wo[t * k + r] = top[r] / z; }}
  }}
}}
"""


def moe_route(logits: WTensor, k: int, normalize: bool = True):
    """logits (T, E) -> weights f32 (T, k), ids i32 (T, k): softmax, top k, optionally renormalised."""
    ctx = logits.ctx
    T, E = logits.shape
    if not 0 < k <= min(E, MAX_K) or E > MAX_E:
        raise ValueError(f"moe_route: top-{k} of {E} experts (wgpu takes at most {MAX_E} experts, top-{MAX_K})")
    weights, ids = empty(ctx, (T, k)), empty(ctx, (T, k), "i32")
    ctx.dispatch(ctx.kernel("moe_route", _ROUTE, "rww"), [logits.buf.gpu, weights.buf.gpu, ids.buf.gpu],
                 pack(T, E, k, int(bool(normalize)), *logits.strides, logits.offset), wgsl.grid(T, ctx.max_groups))
    return weights, ids


# -- expert weights on the device --------------------------------------------------------------------------------
@dataclass
class Group:
    """Experts [lo, lo + n) of one projection, in ``buf`` from expert slot ``base`` on."""

    buf: object
    lo: int
    n: int
    base: int


@dataclass
class Experts:
    fmt: str
    E: int
    I: int  # noqa: E741 (the intermediate size, as the checkpoints name it)
    H: int
    gate_up: list  # [Group] of (E, 2I, H): buffer row (slot * 2I + i) is gate row i, (slot * 2I + I + i) up row i
    down: list  # [Group] of (E, H, I): buffer row (slot * H + j)


def _check_format(fmt: str) -> None:
    # fp8 and nvfp4 carry a scale buffer a matrix (nvfp4 also a global scale) that packing would have to merge
    if fmt not in EXPERT_FORMATS:
        raise NotImplementedError(f"wgpu experts read {', '.join(EXPERT_FORMATS)}, not {fmt!r}")


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one stored row of ``cols`` values (GGUF: whole blocks)."""
    if fmt in quant.ELEMENT:
        return cols * quant.ELEMENT[fmt]
    values, nbytes = quant.gguf_block(fmt)
    return cols // values * nbytes


def _groups(m) -> list:
    """The Groups of a packed Matrix (rows = experts): one per chunk of whole experts."""
    return [Group(buf, first, n, row) for buf, row, n, first in m.pieces()]


def _packed(gate_up, down) -> Experts:
    gm, dm = gate_up.data, down.data
    if gate_up.scale is not None or down.scale is not None or gm.format != dm.format:
        raise NotImplementedError(f"packed experts in {gate_up.format}/{down.format} with scales are not supported "
                                  "on wgpu")
    _check_format(gm.format)
    E, two_i, H = gate_up.shape
    if down.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"moe_experts_packed: gate_up {gate_up.shape} and down {down.shape} disagree")
    return Experts(gm.format, E, two_i // 2, H, _groups(gm), _groups(dm))


_PACK = {
    # a word for a word (offsets and lengths in words)
    "words": wgsl.header([("Src", "r", "u32"), ("Dst", "w", "u32")]) + """
// words: 0 n, 1 source offset, 2 destination offset
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  if (i < w(0u)) { Dst[w(2u) + i] = Src[w(1u) + i]; }
}
""",
    # bytes at any offsets (16-bit rows of odd length, GGUF rows of 2-byte aligned blocks): each thread writes one
    # destination word, keeping the bytes that belong to a neighbouring copy (dispatches touching one buffer run
    # one after another)
    "bytes": wgsl.header([("Src", "r", "u32"), ("Dst", "w", "u32")]) + """
// words: 0 n, 1 source offset, 2 destination offset (bytes)
fn src_byte(b: u32) -> u32 { return (Src[b >> 2u] >> ((b & 3u) * 8u)) & 255u; }
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let n = w(0u); let so = w(1u); let d0 = w(2u);
  let word = d0 / 4u + group_id(wid, nw) * 256u + lid;
  if (word * 4u >= d0 + n) { return; }
  var out = Dst[word];
  for (var h = 0u; h < 4u; h++) {
    let b = word * 4u + h;
    if (b >= d0 && b < d0 + n) { out = (out & ~(255u << (h * 8u))) | (src_byte(so + b - d0) << (h * 8u)); }
  }
  Dst[word] = out;
}
""",
}


def _copy_rows(ctx, m, dst, at: int) -> None:
    """Record copies of Matrix view ``m``'s stored rows into gpu buffer ``dst`` from byte ``at`` on."""
    rb = row_bytes(m.format, m.cols)
    for buf, row, n, first in m.pieces():
        src, to, count = row * rb, at + first * rb, n * rb
        if src % 4 == 0 and to % 4 == 0 and count % 4 == 0:
            kind, words, params = "words", count // 4, pack(count // 4, src // 4, to // 4)
        else:
            kind, words, params = "bytes", (to + count + 3) // 4 - to // 4, pack(count, src, to)
        ctx.dispatch(ctx.kernel(f"moe_pack_{kind}", _PACK[kind], "rw"), [buf, dst], params,
                     wgsl.grid(-(-words // 256), ctx.max_groups))


def _pack_projection(ctx, mats, per_expert: int) -> list:
    """Per-expert lists of Matrix views [[m, ...] per expert] (stacked by rows into the expert's block of
    ``per_expert`` bytes) -> Groups of new buffers, as few as the adapter's largest binding allows."""
    per_group = max(1, ctx.max_binding // max(1, per_expert))
    wgpu = wgpu_module()
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    groups = []
    for lo in range(0, len(mats), per_group):
        n = min(per_group, len(mats) - lo)
        buf = ctx.device.create_buffer(size=max(4, (n * per_expert + 3) // 4 * 4), usage=usage,
                                       label=f"lumen experts {lo}..{lo + n}")
        for j in range(n):
            at = j * per_expert
            for m in mats[lo + j]:
                _copy_rows(ctx, m, buf, at)
                at += m.rows * row_bytes(m.format, m.cols)
        groups.append(Group(buf, lo, n, 0))
    return groups


def _per_expert(gate_up, down) -> Experts:
    """The packed layout of per-expert (gate, up) and down Weights, built on the device at first use and cached on
    the first gate Weight (checked against every expert's matrices, so another list never reuses it)."""
    first = gate_up[0][0]
    key = tuple(w.data for pair in gate_up for w in pair) + tuple(w.data for w in down)
    cached = getattr(first, "_wgpu_experts", None)
    if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key,
                                                                                          strict=True)):
        return cached[1]
    every = [w for pair in gate_up for w in pair] + list(down)
    fmt = first.format
    if any(w.scale is not None or w.format != fmt or w.data.format != fmt for w in every):
        raise NotImplementedError("wgpu experts must share one format and have no scales; got "
                                  f"{sorted({w.format for w in every})}")
    _check_format(fmt)
    I, H = gate_up[0][0].data.rows, gate_up[0][0].data.cols  # noqa: E741
    for (g, u), d in zip(gate_up, down, strict=True):
        if (g.data.rows, g.data.cols, u.data.rows, u.data.cols, d.data.rows, d.data.cols) != (I, H, I, H, H, I):
            raise ValueError(f"moe_experts: expert shapes {g.shape}, {u.shape}, {d.shape} are not (I, H), (I, H), "
                             f"(H, I) with I={I}, H={H}")
    ctx = first.data.ctx
    ex = Experts(fmt, len(down), I, H,
                 _pack_projection(ctx, [[g.data, u.data] for g, u in gate_up], 2 * I * row_bytes(fmt, H)),
                 _pack_projection(ctx, [[d.data] for d in down], H * row_bytes(fmt, I)))
    _share_packed(gate_up, down, ex)
    first._wgpu_experts = (key, ex)
    return ex


def _slot(groups, e: int):
    g = next(g for g in groups if g.lo <= e < g.lo + g.n)
    return g.buf, g.base + e - g.lo


def _whole(chunks) -> int:
    """Rows of a chunk list that covers rows [0, n) in order with nothing beside its weight buffers (a chunk is
    (buffer, first row, rows, ...): later fields, such as a scale buffer, must be None), else -1."""
    n = 0
    for c in chunks:
        if c[1] != n or any(f is not None for f in c[3:]):
            return -1
        n += c[2]
    return n


def _rebase(views, buf, row: int) -> bool:
    """Point Matrix views that share one chunk list covering rows [0, n) at rows [row, row + n) of ``buf`` (a
    chunk whose first row is -row: ``Matrix.pieces`` then reads matrix row r at buffer row row + r). The views'
    own buffers are dropped with their last reference (wgpu keeps them alive while a recorded copy still reads
    them). Checked through ``pieces``; put back as it was on any disagreement."""
    chunks = views[0].chunks
    n = _whole(chunks)
    if n < 0 or any(getattr(v, "scale_bufs", None) for v in views):  # scales are found by a chunk's first row
        return False
    old = list(chunks)
    chunks[:] = [(buf, -row, row + n) + (None,) * (len(old[0]) - 3)]
    if all(list(v.pieces()) == [(buf, row + v.row0, v.rows, 0)] for v in views):
        return True
    chunks[:] = old
    return False


def _share_packed(gate_up, down, ex: Experts) -> None:
    """Let each expert's own Matrices read their rows from the packed buffers, so a layer's experts are not held
    twice in VRAM. Done where a gate/up pair is two whole matrices or the two halves of one (Gemma's GGUF row
    views), and down a whole matrix; other layouts keep their own buffers (both copies stay)."""
    I, H = ex.I, ex.H  # noqa: E741
    for e, ((g, u), d) in enumerate(zip(gate_up, down, strict=True)):
        buf, slot = _slot(ex.gate_up, e)
        gm, um = g.data, u.data
        if gm.chunks is um.chunks:
            if gm.row0 == 0 and um.row0 == I and _whole(gm.chunks) == 2 * I:
                _rebase([gm, um], buf, slot * 2 * I)
        elif gm.row0 == 0 and um.row0 == 0 and _whole(gm.chunks) == I and _whole(um.chunks) == I:
            _rebase([gm], buf, slot * 2 * I)
            _rebase([um], buf, slot * 2 * I + I)
        buf, slot = _slot(ex.down, e)
        if d.data.row0 == 0 and _whole(d.data.chunks) == H:
            _rebase([d.data], buf, slot * H)


# -- expert kernels ----------------------------------------------------------------------------------------------
# Weights are read through the format's decoder (lumen_wgpu.quant): ld8(r, k) = values k..k+7 of buffer row r,
# ld1(r, k) one value, both with params word 1 = K (values a row); words 8..12 are the decoder's (unused by the
# unscaled formats experts take, left zero).
_X8 = "vec4<f32>({0}[{1}], {0}[{1} + 1u], {0}[{1} + 2u], {0}[{1} + 3u])"


def _dot8(v: str, src: str, at: str) -> str:
    return f"dot({v}.a, {_X8.format(src, at)}) + dot({v}.b, {_X8.format(src, at + ' + 4u')})"


def _gate_up_gemv_code(fmt: str, act: str) -> str:
    tail = "" if quant.tail_free(fmt) else f"""
    for (var kk = (H / 8u) * 8u + lid; kk < H; kk += {WG_GEMV}u) {{
      let xv = X[xb + kk];
      g += ld1(rg, kk) * xv; u += ld1(ru, kk) * xv;
    }}"""
    return wgsl.header([("X", "r", "f32"), ("Ids", "r", "i32"), *quant.bindings(fmt), ("Hh", "w", "f32")]) + \
        quant.decoder(fmt) + f"""
fn act(a: f32, b: f32) -> f32 {{ return {ACTS[act]}; }}
// Workgroup (pair p = token * k + slot, row i): Hh[p, i] = act(gate_i . x) * (up_i . x) for expert ids[p], if
// that expert is in this group. words: 0 pairs, 1 K (= H), 2 k, 3 I, 4 group's first expert, 5 its experts,
// 6 its first slot in W, 7 x offset, 8..12 the decoder's, 13 x row stride, 14 ids offset
var<workgroup> rg_: array<f32, {WG_GEMV}>;
var<workgroup> ru_: array<f32, {WG_GEMV}>;
@compute @workgroup_size({WG_GEMV})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let r = group_id(wid, nw);
  let H = w(1u); let I = w(3u);
  if (r >= w(0u) * I) {{ return; }}
  let p = r / I; let i = r % I;
  let e = Ids[w(14u) + p] - i32(w(4u));
  let ok = e >= 0 && e < i32(w(5u));
  var g = 0.0; var u = 0.0;
  if (ok) {{
    let rg = (w(6u) + u32(e)) * 2u * I + i;
    let ru = rg + I;
    let xb = w(7u) + (p / w(2u)) * w(13u);
    for (var q = lid; q < H / 8u; q += {WG_GEMV}u) {{
      let kk = q * 8u;
      let gv = ld8(rg, kk); let uv = ld8(ru, kk);
      g += {_dot8("gv", "X", "xb + kk")};
      u += {_dot8("uv", "X", "xb + kk")};
    }}{tail}
  }}
  rg_[lid] = g; ru_[lid] = u;
  workgroupBarrier();
  for (var s = {WG_GEMV // 2}u; s > 0u; s >>= 1u) {{
    if (lid < s) {{ rg_[lid] += rg_[lid + s]; ru_[lid] += ru_[lid + s]; }}
    workgroupBarrier();
  }}
  if (lid == 0u && ok) {{ Hh[p * I + i] = act(rg_[0], ru_[0]); }}
}}
"""


def _down_gemv_code(fmt: str) -> str:
    tail = "" if quant.tail_free(fmt) else f"""
      for (var c = (I / 8u) * 8u + lid; c < I; c += {WG_GEMV}u) {{ part += ld1(rd, c) * Hh[hb + c]; }}"""
    return wgsl.header([("Hh", "r", "f32"), ("Ids", "r", "i32"), ("Wt", "r", "f32"), *quant.bindings(fmt),
                        ("Y", "w", "f32")]) + quant.decoder(fmt) + f"""
// Workgroup (token t, output j): Y[t, j] (+)= sum over t's slots routed into this group of weight * down_j . Hh[p]
// words: 0 T, 1 K (= I), 2 k, 3 H, 4 group's first expert, 5 its experts, 6 its first slot in W, 7 accumulate,
// 8..12 the decoder's, 13 ids offset, 14 weights offset
var<workgroup> red: array<f32, {WG_GEMV}>;
@compute @workgroup_size({WG_GEMV})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let r = group_id(wid, nw);
  let I = w(1u); let k = w(2u); let H = w(3u);
  if (r >= w(0u) * H) {{ return; }}
  let t = r / H; let j = r % H;
  var acc = 0.0;
  for (var s = 0u; s < k; s++) {{
    let p = t * k + s;
    let e = Ids[w(13u) + p] - i32(w(4u));
    if (e >= 0 && e < i32(w(5u))) {{
      let rd = (w(6u) + u32(e)) * H + j;
      let hb = p * I;
      var part = 0.0;
      for (var q = lid; q < I / 8u; q += {WG_GEMV}u) {{
        let kk = q * 8u;
        let dv = ld8(rd, kk);
        part += {_dot8("dv", "Hh", "hb + kk")};
      }}{tail}
      acc += Wt[w(14u) + p] * part;
    }}
  }}
  red[lid] = acc;
  workgroupBarrier();
  for (var s = {WG_GEMV // 2}u; s > 0u; s >>= 1u) {{
    if (lid < s) {{ red[lid] += red[lid + s]; }}
    workgroupBarrier();
  }}
  if (lid == 0u) {{
    var before = 0.0;
    if (w(7u) == 1u) {{ before = Y[r]; }}
    Y[r] = before + red[0];
  }}
}}
"""


def _tiled_code(fmt: str, act: str | None) -> str:
    """Workgroup (row tile, expert e of the group, block of LMAX pairs): the pairs routed to e, by tiles of 32,
    times e's rows. act given: gate and up rows from X by token, Hh[p] = act(gate) * up; act None: down rows from
    Hh by pair, Yp[p] = down . Hh[p]."""
    dual = act is not None
    nm = 2 if dual else 1  # weight tiles (gate, up)
    src = ("X", "r", "f32") if dual else ("Hh", "r", "f32")
    dst = ("Hh", "w", "f32") if dual else ("Yp", "w", "f32")
    t2 = TILE * TILE
    x_load = "X[w(6u) + (p / w(2u)) * w(7u) + kx]" if dual else "Hh[p * K + kx]"
    up_tile = f"var<workgroup> wu: array<f32, {t2}>;" if dual else ""
    up_store = "if (m == 1u) { for (var j = 0u; j < 8u; j++) { wu[o + j] = pick8(v, j); } }" if dual else ""
    up_acc = ("let u0 = wu[(tx * 2u) * TL + kk]; let u1 = wu[(tx * 2u + 1u) * TL + kk];\n"
              "        au[0] += x0 * u0; au[1] += x0 * u1; au[2] += x1 * u0; au[3] += x1 * u1;" if dual else "")
    out = "act(ag[j], au[j])" if dual else "ag[j]"
    tail = "v = V8(vec4<f32>(0.0), vec4<f32>(0.0));" if quant.tail_free(fmt) else """
          var a = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
          for (var j = 0u; j < 8u; j++) { if (kk + j < K) { a[j] = ld1(row, kk + j); } }
          v = V8(vec4<f32>(a[0], a[1], a[2], a[3]), vec4<f32>(a[4], a[5], a[6], a[7]));"""
    return wgsl.header([src, ("Ids", "r", "i32"), *quant.bindings(fmt), dst]) + quant.decoder(fmt) + \
        (f"fn act(a: f32, b: f32) -> f32 {{ return {ACTS[act]}; }}\n" if dual else "") + f"""
// words: 0 pairs, 1 K (the dot's length), 2 k, 3 R (rows an expert), 4 group's first expert, 5 its first slot in
// W, 6 x offset, 7 x row stride, 8..12 the decoder's, 13 ids offset
const TL = {TILE}u;
var<workgroup> lst: array<u32, {LMAX}>;
var<workgroup> cnt: atomic<u32>;
var<workgroup> ncnt: u32;
var<workgroup> xs: array<f32, {t2}>;
var<workgroup> wg: array<f32, {t2}>;
{up_tile}
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let P = w(0u); let K = w(1u); let R = w(3u);
  let e = i32(w(4u) + wid.y);
  let r0 = wid.x * TL;
  let p0 = wid.z * {LMAX}u; let p1 = min(P, p0 + {LMAX}u);
  if (lid == 0u) {{ atomicStore(&cnt, 0u); }}
  workgroupBarrier();
  for (var p = p0 + lid; p < p1; p += 256u) {{
    if (Ids[w(13u) + p] == e) {{ lst[atomicAdd(&cnt, 1u)] = p; }}
  }}
  workgroupBarrier();
  if (lid == 0u) {{ ncnt = atomicLoad(&cnt); }}
  let n = workgroupUniformLoad(&ncnt);  // the order of the list varies; each pair's sums do not
  if (n == 0u) {{ return; }}
  let eb = (w(5u) + wid.y) * {nm}u * R;  // the expert's first buffer row
  let ty = lid / 16u; let tx = lid % 16u;
  for (var b0 = 0u; b0 < n; b0 += TL) {{
    var ag = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    var au = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var k0 = 0u; k0 < K; k0 += TL) {{
      for (var q = 0u; q < 4u; q++) {{  // the x tile: 32 pairs x 32 values
        let el = lid + q * 256u;
        let pi = b0 + el / TL; let kx = k0 + el % TL;
        var xv = 0.0;
        if (pi < n && kx < K) {{ let p = lst[pi]; xv = {x_load}; }}
        xs[el] = xv;
      }}
      if (lid < {128 * nm}u) {{  // the weight tiles: 32 rows x 4 runs of 8 values each
        let m = lid / 128u; let rr = (lid % 128u) / 4u; let kk = k0 + (lid % 4u) * 8u;
        let ir = r0 + rr;
        var v = V8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (ir < R) {{
          let row = eb + m * R + ir;
          if (kk + 8u <= K) {{ v = ld8(row, kk); }} else {{ {tail} }}
        }}
        let o = rr * TL + (lid % 4u) * 8u;
        if (m == 0u) {{ for (var j = 0u; j < 8u; j++) {{ wg[o + j] = pick8(v, j); }} }}
        {up_store}
      }}
      workgroupBarrier();
      for (var kk = 0u; kk < TL; kk++) {{
        let x0 = xs[(ty * 2u) * TL + kk]; let x1 = xs[(ty * 2u + 1u) * TL + kk];
        let g0 = wg[(tx * 2u) * TL + kk]; let g1 = wg[(tx * 2u + 1u) * TL + kk];
        ag[0] += x0 * g0; ag[1] += x0 * g1; ag[2] += x1 * g0; ag[3] += x1 * g1;
        {up_acc}
      }}
      workgroupBarrier();
    }}
    for (var j = 0u; j < 4u; j++) {{
      let pi = b0 + ty * 2u + j / 2u; let ir = r0 + tx * 2u + j % 2u;
      if (pi < n && ir < R) {{ {dst[0]}[lst[pi] * R + ir] = {out}; }}
    }}
  }}
}}
"""


_COMBINE = wgsl.header([("Yp", "r", "f32"), ("Ids", "r", "i32"), ("Wt", "r", "f32"), ("Y", "w", "f32")]) + """
// Y[t, j] = sum over slots of weight * Yp[t * k + slot, j], slots in order, unrouted (out of range) ids skipped
// words: 0 T, 1 k, 2 H, 3 E, 4 ids offset, 5 weights offset
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  let k = w(1u); let H = w(2u);
  if (i >= w(0u) * H) { return; }
  let t = i / H; let j = i % H;
  var acc = 0.0;
  for (var s = 0u; s < k; s++) {
    let p = t * k + s;
    let e = Ids[w(4u) + p];
    if (e >= 0 && e < i32(w(3u))) { acc += Yp[p * H + j] * Wt[w(5u) + p]; }
  }
  Y[i] = acc;
}
"""

_NO_SCALE = (0, 0, 0, 0, 0)  # params words 8..12: the decoder's, unused by unscaled formats


def _run(x: WTensor, ids: WTensor, weights: WTensor, ex: Experts, act: str) -> WTensor:
    if act not in ACTS:
        raise ValueError(f"moe experts: activation {act!r} is not one of {sorted(ACTS)}")
    ctx = x.ctx
    T, H = x.shape
    if H != ex.H or ids.shape != weights.shape or ids.shape[0] != T or ids.dtype != "i32":
        raise ValueError(f"moe experts: x {x.shape}, ids {ids.shape} ({ids.dtype}), weights {weights.shape} and "
                         f"experts of H={ex.H}")
    if x.strides[-1] != 1:
        x = x.dense()
    ids, weights = ids.dense(), weights.dense()
    k, I, fmt = ids.shape[1], ex.I, ex.fmt  # noqa: E741
    P = T * k
    hh = empty(ctx, (P, I))
    out = empty(ctx, (T, H))
    if T == 0:
        return out
    xb, ib, wb = x.buf.gpu, ids.buf.gpu, weights.buf.gpu
    if T <= GEMV_MAX_T:
        kernel = ctx.kernel(f"moe_gate_up_gemv_{fmt}_{act}", _gate_up_gemv_code(fmt, act), "rrrw")
        for g in ex.gate_up:
            ctx.dispatch(kernel, [xb, ib, g.buf, hh.buf.gpu],
                         pack(P, H, k, I, g.lo, g.n, g.base, x.offset, *_NO_SCALE, x.strides[0], ids.offset),
                         wgsl.grid(P * I, ctx.max_groups))
        kernel = ctx.kernel(f"moe_down_gemv_{fmt}", _down_gemv_code(fmt), "rrrrw")
        for n, g in enumerate(ex.down):
            ctx.dispatch(kernel, [hh.buf.gpu, ib, wb, g.buf, out.buf.gpu],
                         pack(T, I, k, H, g.lo, g.n, g.base, int(n > 0), *_NO_SCALE, ids.offset, weights.offset),
                         wgsl.grid(T * H, ctx.max_groups))
        return out
    blocks = -(-P // LMAX)
    kernel = ctx.kernel(f"moe_gate_up_tiled_{fmt}_{act}", _tiled_code(fmt, act), "rrrw")
    for g in ex.gate_up:
        ctx.dispatch(kernel, [xb, ib, g.buf, hh.buf.gpu],
                     pack(P, H, k, I, g.lo, g.base, x.offset, x.strides[0], *_NO_SCALE, ids.offset),
                     (-(-I // TILE), g.n, blocks))
    yp = empty(ctx, (P, H))
    kernel = ctx.kernel(f"moe_down_tiled_{fmt}", _tiled_code(fmt, None), "rrrw")
    for g in ex.down:
        ctx.dispatch(kernel, [hh.buf.gpu, ib, g.buf, yp.buf.gpu],
                     pack(P, I, k, H, g.lo, g.base, 0, 0, *_NO_SCALE, ids.offset), (-(-H // TILE), g.n, blocks))
    ctx.dispatch(ctx.kernel("moe_combine", _COMBINE, "rrrw"), [yp.buf.gpu, ib, wb, out.buf.gpu],
                 pack(T, k, H, ex.E, ids.offset, weights.offset), wgsl.grid(-(-T * H // 256), ctx.max_groups))
    return out


def moe_experts(x, ids, weights, gate_up, down, act: str = "silu"):
    """Sum over each token's routed experts of weight x down(act(gate) x up). x (T, H); ids, weights (T, k) on the
    device; gate_up: per expert a (gate, up) pair of Weights (I, H); down: per expert a Weight (H, I)."""
    return _run(x, ids, weights, _per_expert(gate_up, down), act)


def moe_experts_packed(x, ids, weights, gate_up, down, act: str = "gelu_tanh"):
    """``moe_experts`` over packed tensors: gate_up (E, 2I, H), each expert's gate rows then up rows; down
    (E, H, I)."""
    return _run(x, ids, weights, _packed(gate_up, down), act)


def table():
    return [(f.__name__, f, None) for f in (moe_route, moe_experts, moe_experts_packed)]
