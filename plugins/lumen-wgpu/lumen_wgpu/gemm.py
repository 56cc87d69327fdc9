"""The prefill GEMM for f32 / f16 / bf16 weights, register-tiled: a workgroup of 256 threads computes 64 tokens x 64
weight rows, each thread a 4 x 4 block of them, over K in steps of 32. Each step stages the input tile (64 x 32,
16-byte loads) and the weight tile (64 x 32, 16-byte loads decoded to f32) in workgroup memory, k-major, so the
inner loop reads one vec4 of inputs and one vec4 of weights for 16 multiply-adds. f32 math, f32 accumulation.

Applies where every row is whole 16-byte words and the input rows start on 16-byte boundaries (``applies``);
``linear`` keeps its general GEMM (every format, any shape) otherwise.
"""

from __future__ import annotations

from . import wgsl
from .device import pack

BT, BN, BK = 64, 64, 32  # tokens, weight rows, K a step
PER_WORD = {"f32": 4, "f16": 8, "bf16": 8}

_UNPACK = {
    # 8 weight values (two vec4<f32>) from one vec4<u32>
    "bf16": "vec4<f32>(bf16_lo(q.x), bf16_hi(q.x), bf16_lo(q.y), bf16_hi(q.y)), "
            "vec4<f32>(bf16_lo(q.z), bf16_hi(q.z), bf16_lo(q.w), bf16_hi(q.w))",
    "f16": "vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)), vec4<f32>(unpack2x16float(q.z), "
           "unpack2x16float(q.w))",
}


def applies(fmt: str, K: int, x_offset: int, x_stride: int, row_in_buffer: int) -> bool:
    per = PER_WORD.get(fmt)
    return per is not None and K % per == 0 and x_offset % 4 == 0 and x_stride % 4 == 0 and \
        (row_in_buffer * K) % per == 0


def _weight_tile(fmt: str) -> str:
    """Stage rows n0.. x columns k0.. of W into ws (k-major: ws[k][row], rows as vec4 groups)."""
    if fmt == "f32":  # 64 rows x 8 vec4 = 512 loads: 2 a thread
        return """
    for (var j = 0u; j < 2u; j++) {
      let e = lid + j * 256u;
      let row = e / 8u; let kq = (e % 8u) * 4u;
      let n = n0 + row; let k = k0 + kq;
      var v = vec4<f32>(0.0);
      if (n < R && k < K) { v = bitcast<vec4<f32>>(W[((w(4u) + n) * K + k) / 4u]); }
      for (var i = 0u; i < 4u; i++) { wsf[(kq + i) * 64u + row] = v[i]; }
    }"""
    return f"""
    {{
      let row = lid / 4u; let kq = (lid % 4u) * 8u;
      let n = n0 + row; let k = k0 + kq;
      var a = vec4<f32>(0.0); var b = vec4<f32>(0.0);
      if (n < R && k < K) {{
        let q = W[((w(4u) + n) * K + k) / 8u];
        let ab = array<vec4<f32>, 2>({_UNPACK[fmt]});
        a = ab[0]; b = ab[1];
      }}
      for (var i = 0u; i < 4u; i++) {{ wsf[(kq + i) * 64u + row] = a[i]; wsf[(kq + 4u + i) * 64u + row] = b[i]; }}
    }}"""


def code(fmt: str) -> str:
    return wgsl.header([("X", "r", "vec4<f32>"), ("W", "r", "vec4<u32>"), ("Y", "w", "f32")]) + f"""
// words: 0 T, 1 K, 2 N (row stride of Y), 3 rows of this piece, 4 first row in W, 5 first column of Y,
// 6 offset of X (in vec4s), 7 row stride of X (in vec4s). Grid: x over 64-row tiles, y over 64-token tiles.
var<workgroup> xsf: array<f32, {BK * BT}>;  // xsf[k * 64 + token]
var<workgroup> wsf: array<f32, {BK * BN}>;  // wsf[k * 64 + row]
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let K = w(1u); let R = w(3u);
  let t0 = wid.y * {BT}u; let n0 = wid.x * {BN}u;
  let ty = lid / 16u; let tx = lid % 16u;
  var acc: array<vec4<f32>, 4>;
  for (var k0 = 0u; k0 < K; k0 += {BK}u) {{
    for (var j = 0u; j < 2u; j++) {{  // 64 tokens x 8 vec4 of inputs: 2 a thread
      let e = lid + j * 256u;
      let tok = e / 8u; let kq = (e % 8u) * 4u;
      let t = t0 + tok; let k = k0 + kq;
      var v = vec4<f32>(0.0);
      if (t < T && k < K) {{ v = X[w(6u) + t * w(7u) + k / 4u]; }}
      for (var i = 0u; i < 4u; i++) {{ xsf[(kq + i) * 64u + tok] = v[i]; }}
    }}
{_weight_tile(fmt)}
    workgroupBarrier();
    for (var kk = 0u; kk < {BK}u; kk++) {{
      let xa = vec4<f32>(xsf[kk * 64u + ty * 4u], xsf[kk * 64u + ty * 4u + 1u], xsf[kk * 64u + ty * 4u + 2u],
                         xsf[kk * 64u + ty * 4u + 3u]);
      let wb = vec4<f32>(wsf[kk * 64u + tx * 4u], wsf[kk * 64u + tx * 4u + 1u], wsf[kk * 64u + tx * 4u + 2u],
                         wsf[kk * 64u + tx * 4u + 3u]);
      acc[0] += xa.x * wb; acc[1] += xa.y * wb; acc[2] += xa.z * wb; acc[3] += xa.w * wb;
    }}
    workgroupBarrier();
  }}
  for (var a = 0u; a < 4u; a++) {{
    let t = t0 + ty * 4u + a;
    if (t < T) {{
      for (var b = 0u; b < 4u; b++) {{
        let n = n0 + tx * 4u + b;
        if (n < R) {{ Y[t * w(2u) + w(5u) + n] = acc[a][b]; }}
      }}
    }}
  }}
}}
"""


def dispatch(ctx, fmt: str, x2, buf, y, T: int, K: int, N: int, rows: int, row: int, col: int) -> None:
    kernel = ctx.kernel(f"gemm_tiled_{fmt}", code(fmt), "rrw")
    params = pack(T, K, N, rows, row, col, x2.offset // 4, x2.strides[0] // 4)
    ctx.dispatch(kernel, [x2.buf.gpu, buf, y.buf.gpu], params, (-(-rows // BN), -(-T // BT), 1))
