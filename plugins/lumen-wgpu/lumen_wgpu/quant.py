"""Weight storage formats on wgpu: how each one's bytes sit in a buffer and the WGSL that decodes them.

Every format defines the same two WGSL functions over the weight binding ``W`` (and, for scaled formats, ``S``),
so one shader template per op (linear's GEMV and GEMM, embedding) serves them all (DESIGN principle 7):

- ``ld8(r, k) -> V8``: the 8 values at columns k..k+7 (k a multiple of 8) of row r of the buffer, as f32. The
  hot path: whole 32-bit words are read and a block's scales once per 8 values, not once per value.
- ``ld1(r, k) -> f32``: one value; used only where a row's length is not a multiple of 8 (f32/f16/bf16/fp8 tails).

f32, f16, bf16 and fp8 have a second, ``wide`` decoder for matrices whose every row starts on a vector boundary
(``wide``): W is bound as vec4 (vec2 for fp8) and ld8 is one 16-byte (8-byte) load.

``K`` (values a row) is params word 1 of every kernel that reads a weight; words 8..12 are the format's (``words``):
8 the matrix row of buffer row 0 (scales are indexed by matrix row), 9/10 log2 of the scale block's rows/columns,
11 scale columns a scale row, 12 a global f32 scale (nvfp4).

Values are decoded with the operations and rounding of the CPU reference (``lumen_cpu.ops.dequantize``,
``lumen_cpu.nvfp4``, ``gguf.quants.dequantize``), so a matrix holds the same f32 numbers on both backends. The
one freedom left to a driver is fusing ``ds * q - dm`` (Q4_K / Q5_K) into one FMA: at most one rounding apart.

GGUF blocks stay as stored: raw bytes, rows back to back. Q8_0 (34 bytes), Q4_0 (18), Q5_0 (22) and Q6_K (210)
blocks are only 2-byte aligned, so their fields are read out of the u32 words (``wd2``); Q4_K and Q5_K (144, 176)
are word aligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lumen_core.checkpoint.gguf import GGML_TYPES, TYPE_IDS
from lumen_core.quantize import NVFP4_GROUP

UNIT = 8  # values ld8 returns
GGUF_BLOCKS = ("q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k")  # GGUF types decoded in the shader
ELEMENT = {"f32": 4, "f16": 2, "bf16": 2, "fp8": 1}  # one value per element: bytes a value


def gguf_block(fmt: str) -> tuple[int, int]:
    """(values, bytes) of one block of a GGUF block format (lumen_core's table: the layout is the core's)."""
    _, values, nbytes = GGML_TYPES[TYPE_IDS[fmt.upper()]]
    return values, nbytes


# -- WGSL ------------------------------------------------------------------------------------------------------
COMMON = """
struct V8 { a: vec4<f32>, b: vec4<f32> }
fn pick8(v: V8, i: u32) -> f32 { return select(v.a[i & 3u], v.b[i & 3u], i >= 4u); }
fn f16_f(h: u32) -> f32 {  // exact, subnormals included (some drivers flush them in unpack2x16float)
  let e = (h >> 10u) & 31u; let m = h & 1023u; let s = (h & 0x8000u) << 16u;
  if (e == 0u) { let v = f32(m) * 5.960464477539063e-8; return select(v, -v, s != 0u); }
  if (e == 31u) { return bitcast<f32>(s | 0x7f800000u | (m << 13u)); }
  return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}
fn e4m3(b: u32) -> f32 {  // exponent and mantissa moved into an f32 (+120 bias); subnormals fixed up; NaN codes finite
  let f = bitcast<f32>(((b & 0x7fu) << 20u) + 0x3c000000u);
  let v = select(f, (f - 0.0078125) * 2.0, (b & 0x78u) == 0u);
  return select(v, -v, (b & 0x80u) != 0u);
}
fn e4m3v(u: u32) -> vec4<f32> { return vec4<f32>(e4m3(u & 255u), e4m3((u >> 8u) & 255u), e4m3((u >> 16u) & 255u),
                                                  e4m3(u >> 24u)); }
"""

BYTES = """
fn wb(o: u32) -> u32 { return (W[o >> 2u] >> ((o & 3u) * 8u)) & 255u; }  // byte o of W
fn wh(o: u32) -> u32 { return (W[o >> 2u] >> ((o & 2u) * 8u)) & 65535u; }  // the 16 bits at even byte o
fn wd2(o: u32) -> u32 {  // the 32 bits at even byte o
  let i = o >> 2u;
  if ((o & 2u) == 0u) { return W[i]; }
  return (W[i] >> 16u) | (W[i + 1u] << 16u);
}
fn nib(u: u32, sh: u32) -> vec4<u32> {  // four nibbles: bits sh..sh+3 of each byte
  return (vec4<u32>(u) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(15u);
}
fn i8v(u: u32) -> vec4<f32> {  // four signed bytes
  let s = bitcast<i32>(u);
  return vec4<f32>(f32((s << 24u) >> 24u), f32((s << 16u) >> 24u), f32((s << 8u) >> 24u), f32(s >> 24u));
}
"""

# ld1 of the block formats: decode the 8 values around k and pick one (only ever reached for odd shapes' tails)
_PICK = "fn ld1(r: u32, k: u32) -> f32 { return pick8(ld8(r, k & ~7u), k & 7u); }\n"

_ELEMENT_CODE = {
    "f32": """
fn ld1(r: u32, k: u32) -> f32 { return W[r * w(1u) + k]; }
fn ld8(r: u32, k: u32) -> V8 {
  let e = r * w(1u) + k;
  return V8(vec4<f32>(W[e], W[e + 1u], W[e + 2u], W[e + 3u]), vec4<f32>(W[e + 4u], W[e + 5u], W[e + 6u], W[e + 7u]));
}
""",
    "f16": """
fn ld1(r: u32, k: u32) -> f32 { let e = r * w(1u) + k; return unpack2x16float(W[e >> 1u])[e & 1u]; }
fn ld8(r: u32, k: u32) -> V8 {
  let e = r * w(1u) + k;
  if ((e & 1u) != 0u) {  // a row of odd length: elements straddle words
    return V8(vec4<f32>(ld1(r, k), ld1(r, k + 1u), ld1(r, k + 2u), ld1(r, k + 3u)),
              vec4<f32>(ld1(r, k + 4u), ld1(r, k + 5u), ld1(r, k + 6u), ld1(r, k + 7u)));
  }
  let i = e >> 1u;
  return V8(vec4<f32>(unpack2x16float(W[i]), unpack2x16float(W[i + 1u])),
            vec4<f32>(unpack2x16float(W[i + 2u]), unpack2x16float(W[i + 3u])));
}
""",
    "bf16": """
fn ld1(r: u32, k: u32) -> f32 {
  let e = r * w(1u) + k; let u = W[e >> 1u];
  return select(bf16_lo(u), bf16_hi(u), (e & 1u) == 1u);
}
fn bf2(u: u32) -> vec2<f32> { return vec2<f32>(bf16_lo(u), bf16_hi(u)); }
fn ld8(r: u32, k: u32) -> V8 {
  let e = r * w(1u) + k;
  if ((e & 1u) != 0u) {
    return V8(vec4<f32>(ld1(r, k), ld1(r, k + 1u), ld1(r, k + 2u), ld1(r, k + 3u)),
              vec4<f32>(ld1(r, k + 4u), ld1(r, k + 5u), ld1(r, k + 6u), ld1(r, k + 7u)));
  }
  let i = e >> 1u;
  return V8(vec4<f32>(bf2(W[i]), bf2(W[i + 1u])), vec4<f32>(bf2(W[i + 2u]), bf2(W[i + 3u])));
}
""",
    # e4m3 bytes x an f32 scale per (block of) rows and columns: S[(row >> w9) - (row0 >> w9), col >> w10]
    "fp8": BYTES + """
fn ld1(r: u32, k: u32) -> f32 { return e4m3(wb(r * w(1u) + k)) * sc(r, k); }
fn ld8(r: u32, k: u32) -> V8 {
  let e = r * w(1u) + k;
  if ((e & 3u) == 0u) { return scaled(r, k, e4m3v(W[e >> 2u]), e4m3v(W[(e >> 2u) + 1u])); }
  return scaled(r, k, vec4<f32>(e4m3(wb(e)), e4m3(wb(e + 1u)), e4m3(wb(e + 2u)), e4m3(wb(e + 3u))),
                vec4<f32>(e4m3(wb(e + 4u)), e4m3(wb(e + 5u)), e4m3(wb(e + 6u)), e4m3(wb(e + 7u))));
}
""",
}

FP8_SCALE = """
fn sc(r: u32, k: u32) -> f32 {
  let g0 = w(8u);
  return S[(((g0 + r) >> w(9u)) - (g0 >> w(9u))) * w(11u) + (k >> w(10u))];
}
fn scaled(r: u32, k: u32, a: vec4<f32>, b: vec4<f32>) -> V8 {
  if (w(10u) >= 3u) { let s = sc(r, k); return V8(a * s, b * s); }  // the 8 share a scale column
  return V8(a * vec4<f32>(sc(r, k), sc(r, k + 1u), sc(r, k + 2u), sc(r, k + 3u)),
            b * vec4<f32>(sc(r, k + 4u), sc(r, k + 5u), sc(r, k + 6u), sc(r, k + 7u)));
}
"""

# Rows whose length makes every row start on a 16-byte boundary (8 bytes for fp8): W bound as vectors, so the 8
# values of ld8 are one 16-byte load (f16, bf16; two for f32, one 8-byte load for fp8).
_WIDE_CODE = {
    "f32": """
fn ld1(r: u32, k: u32) -> f32 { let e = r * w(1u) + k; return W[e >> 2u][e & 3u]; }
fn ld8(r: u32, k: u32) -> V8 { let i = (r * w(1u) + k) >> 2u; return V8(W[i], W[i + 1u]); }
""",
    "f16": """
fn ld1(r: u32, k: u32) -> f32 { let e = r * w(1u) + k; return unpack2x16float(W[e >> 3u][(e >> 1u) & 3u])[e & 1u]; }
fn ld8(r: u32, k: u32) -> V8 {
  let q = W[(r * w(1u) + k) >> 3u];
  return V8(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)), vec4<f32>(unpack2x16float(q.z),
            unpack2x16float(q.w)));
}
""",
    "bf16": """
fn ld1(r: u32, k: u32) -> f32 {
  let e = r * w(1u) + k; let u = W[e >> 3u][(e >> 1u) & 3u];
  return select(bf16_lo(u), bf16_hi(u), (e & 1u) == 1u);
}
fn ld8(r: u32, k: u32) -> V8 {
  let q = W[(r * w(1u) + k) >> 3u];
  return V8(vec4<f32>(bf16_lo(q.x), bf16_hi(q.x), bf16_lo(q.y), bf16_hi(q.y)),
            vec4<f32>(bf16_lo(q.z), bf16_hi(q.z), bf16_lo(q.w), bf16_hi(q.w)));
}
""",
    "fp8": """
fn ld1(r: u32, k: u32) -> f32 {
  let e = r * w(1u) + k;
  return e4m3((W[e >> 3u][(e >> 2u) & 1u] >> ((e & 3u) * 8u)) & 255u) * sc(r, k);
}
fn ld8(r: u32, k: u32) -> V8 { let q = W[(r * w(1u) + k) >> 3u]; return scaled(r, k, e4m3v(q.x), e4m3v(q.y)); }
""",
}
_WIDE_TYPE = {"f32": "vec4<f32>", "f16": "vec4<u32>", "bf16": "vec4<u32>", "fp8": "vec2<u32>"}
_WIDE_VALUES = {"f32": 4, "f16": 8, "bf16": 8, "fp8": 8}  # values one vector holds

# Q4_K / Q5_K: sub-block j's 6-bit scale and min, from the 12 bytes at o
_SCALE_MIN = """fn scale_min(o: u32, j: u32) -> vec2<f32> {
  if (j < 4u) { return vec2<f32>(f32(wb(o + j) & 63u), f32(wb(o + j + 4u) & 63u)); }
  return vec2<f32>(f32((wb(o + j + 4u) & 15u) | ((wb(o + j - 4u) >> 2u) & 48u)),
                   f32((wb(o + j + 4u) >> 4u) | ((wb(o + j) >> 2u) & 48u)));
}
"""

_BLOCK_CODE = {
    # ModelOpt NVFP4: E2M1 pairs (low nibble first), an e4m3 scale per 16 values (S: bytes, a row of K/16 per
    # matrix row), the global f32 scale in word 12. (e2m1 x block scale) is exact; x global rounds once.
    "nvfp4": f"""
fn e2m1(c: u32) -> f32 {{
  let m = c & 7u;
  let v = select(bitcast<f32>((m << 22u) + (126u << 23u)), f32(m) * 0.5, m < 2u);
  return select(v, -v, (c & 8u) != 0u);
}}
fn e2m1v(u: u32) -> vec4<f32> {{ return vec4<f32>(e2m1(u & 15u), e2m1((u >> 4u) & 15u), e2m1((u >> 8u) & 15u),
                                                  e2m1((u >> 12u) & 15u)); }}
fn ld8(r: u32, k: u32) -> V8 {{
  let K = w(1u);
  let u = W[(r * (K / 2u) + k / 2u) >> 2u];
  let si = r * (K / {NVFP4_GROUP}u) + k / {NVFP4_GROUP}u;
  let bs = e4m3((S[si >> 2u] >> ((si & 3u) * 8u)) & 255u);
  let gs = wf(12u);
  return V8((e2m1v(u) * bs) * gs, (e2m1v(u >> 16u) * bs) * gs);
}}
""" + _PICK,
    # f16 d, 32 int8
    "q8_0": """
fn ld8(r: u32, k: u32) -> V8 {
  let o = (r * (w(1u) / 32u) + k / 32u) * 34u;
  let d = f16_f(wh(o));
  let p = o + 2u + (k & 31u);
  return V8(i8v(wd2(p)) * d, i8v(wd2(p + 4u)) * d);
}
""" + _PICK,
    # f16 d, 16 bytes: value j in the low nibble of byte j, value j + 16 in its high nibble; value = d * (q - 8)
    "q4_0": """
fn ld8(r: u32, k: u32) -> V8 {
  let o = (r * (w(1u) / 32u) + k / 32u) * 18u;
  let d = f16_f(wh(o));
  let j = k & 31u; let p = o + 2u + (j & 15u); let sh = select(0u, 4u, j >= 16u);
  return V8(d * (vec4<f32>(nib(wd2(p), sh)) - 8.0), d * (vec4<f32>(nib(wd2(p + 4u), sh)) - 8.0));
}
""" + _PICK,
    # f16 d, u32 of fifth bits (bit j for value j), 16 nibble bytes as Q4_0; value = d * (q - 16)
    "q5_0": """
fn ld8(r: u32, k: u32) -> V8 {
  let o = (r * (w(1u) / 32u) + k / 32u) * 22u;
  let d = f16_f(wh(o)); let qh = wd2(o + 2u);
  let j = k & 31u; let p = o + 6u + (j & 15u); let sh = select(0u, 4u, j >= 16u);
  let h0 = ((vec4<u32>(qh) >> vec4<u32>(j, j + 1u, j + 2u, j + 3u)) & vec4<u32>(1u)) << vec4<u32>(4u);
  let h1 = ((vec4<u32>(qh) >> vec4<u32>(j + 4u, j + 5u, j + 6u, j + 7u)) & vec4<u32>(1u)) << vec4<u32>(4u);
  return V8(d * (vec4<f32>(nib(wd2(p), sh) | h0) - 16.0), d * (vec4<f32>(nib(wd2(p + 4u), sh) | h1) - 16.0));
}
""" + _PICK,
    # super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 nibble
    # bytes (sub-blocks 2i and 2i+1 in the low / high nibbles of bytes 32i..32i+31); value = d*sc * q - dmin*m
    "q4_k": """
""" + _SCALE_MIN + """fn ld8(r: u32, k: u32) -> V8 {
  let o = (r * (w(1u) / 256u) + k / 256u) * 144u;
  let dd = W[o >> 2u];
  let j = (k & 255u) / 32u;
  let sm = scale_min(o + 4u, j);
  let ds = f16_f(dd & 65535u) * sm.x; let dm = f16_f(dd >> 16u) * sm.y;
  let i = (o + 16u + (j / 2u) * 32u + (k & 31u)) >> 2u; let sh = 4u * (j & 1u);
  return V8(ds * vec4<f32>(nib(W[i], sh)) - dm, ds * vec4<f32>(nib(W[i + 1u], sh)) - dm);
}
""" + _PICK,
    # as Q4_K, with 32 bytes of fifth bits after the scales (bit j of byte i: value i of sub-block j)
    "q5_k": """
""" + _SCALE_MIN + """fn hi1(u: u32, j: u32) -> vec4<u32> {
  return ((vec4<u32>(u) >> vec4<u32>(j, j + 8u, j + 16u, j + 24u)) & vec4<u32>(1u)) << vec4<u32>(4u);
}
fn ld8(r: u32, k: u32) -> V8 {
  let o = (r * (w(1u) / 256u) + k / 256u) * 176u;
  let dd = W[o >> 2u];
  let j = (k & 255u) / 32u;
  let sm = scale_min(o + 4u, j);
  let ds = f16_f(dd & 65535u) * sm.x; let dm = f16_f(dd >> 16u) * sm.y;
  let h = (o + 16u + (k & 31u)) >> 2u;
  let i = (o + 48u + (j / 2u) * 32u + (k & 31u)) >> 2u; let sh = 4u * (j & 1u);
  return V8(ds * vec4<f32>(nib(W[i], sh) | hi1(W[h], j)) - dm,
            ds * vec4<f32>(nib(W[i + 1u], sh) | hi1(W[h + 1u], j)) - dm);
}
""" + _PICK,
    # super-blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values),
    # f16 d. Value v = 128h + q: low nibble of byte 64h + q % 64 (shift 4 (q / 64)), high bits of byte
    # 128 + 32h + q % 32 (shift 2 (q / 32)); value = (d * scale) * (q6 - 32)
    "q6_k": """
fn hi2(u: u32, sh: u32) -> vec4<u32> {
  return ((vec4<u32>(u) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(3u)) << vec4<u32>(4u);
}
fn ld8(r: u32, k: u32) -> V8 {
  let o = (r * (w(1u) / 256u) + k / 256u) * 210u;
  let v = k & 255u; let h = v / 128u; let q = v & 127u;
  let s = f32((bitcast<i32>(wb(o + 192u + v / 16u)) << 24u) >> 24u);
  let ds = f16_f(wh(o + 208u)) * s;
  let pl = o + h * 64u + (q & 63u); let sl = 4u * (q / 64u);
  let ph = o + 128u + h * 32u + (q & 31u); let shh = 2u * (q / 32u);
  let a = vec4<i32>(nib(wd2(pl), sl) | hi2(wd2(ph), shh)) - vec4<i32>(32);
  let b = vec4<i32>(nib(wd2(pl + 4u), sl) | hi2(wd2(ph + 4u), shh)) - vec4<i32>(32);
  return V8(ds * vec4<f32>(a), ds * vec4<f32>(b));
}
""" + _PICK,
}

FORMATS = (*ELEMENT, *_BLOCK_CODE)  # every format linear and embedding read


def wide(fmt: str, cols: int) -> bool:
    """Whether every row of a (rows, cols) ``fmt`` matrix starts on a vector boundary (``_WIDE_CODE`` applies)."""
    return fmt in _WIDE_VALUES and cols % _WIDE_VALUES[fmt] == 0


def decoder(fmt: str, wide: bool = False) -> str:
    """WGSL defining ``ld8`` and ``ld1`` for ``fmt`` (after ``wgsl.header`` with ``bindings(fmt, wide)``);
    ``wide``: W bound as vectors (only where ``wide(fmt, K)`` holds)."""
    code = COMMON + (FP8_SCALE if fmt == "fp8" else "")
    if wide:
        return code + _WIDE_CODE[fmt]
    if fmt in _ELEMENT_CODE:
        return code + _ELEMENT_CODE[fmt]
    return code + BYTES + _BLOCK_CODE[fmt]


def bindings(fmt: str, wide: bool = False) -> list[tuple[str, str, str]]:
    """The weight's storage bindings: W, then S (the scales) for fp8 and nvfp4."""
    out = [("W", "r", _WIDE_TYPE[fmt] if wide else "f32" if fmt == "f32" else "u32")]
    if fmt == "fp8":
        out.append(("S", "r", "f32"))
    elif fmt == "nvfp4":
        out.append(("S", "r", "u32"))
    return out


def tail_free(fmt: str) -> bool:
    """Whether every row of this format is a whole number of 8-value units (no ``ld1`` tail)."""
    return fmt not in ELEMENT


# -- host side -------------------------------------------------------------------------------------------------
@dataclass
class Scales:
    """A wgpu Weight's ``scale``: what the plan and ``Weight.nbytes`` count. The numbers themselves live with the
    rows they scale, in each chunk of the ``linear.Matrix`` (a chunk's scale rows, next to its weight rows)."""

    format: str
    shape: tuple[int, ...]  # the checkpoint's scale shape (fp8), or the block scales' (nvfp4)
    nbytes: int
    global_scale: float = 1.0  # nvfp4


@dataclass
class Layout:
    """A weight as it goes to the device: ``data`` (rows, bytes or elements a row) and its scales (rows of
    scale blocks, ``cols`` a row), with the shifts mapping a matrix row / column to a scale row / column."""

    data: np.ndarray
    scale: np.ndarray | None = None  # (scale rows, scale cols) f32 (fp8) or uint8 (nvfp4)
    log_rows: int = 31  # matrix row r reads scale row r >> log_rows (31: one scale row for every row)
    log_cols: int = 31
    scale_cols: int = 1
    global_scale: float = 1.0
    scales: Scales | None = None  # the Weight's scale (None: none in the checkpoint)

    def words(self, first_row: int) -> list:
        """Params words 8..12 for a chunk whose buffer row 0 is matrix row ``first_row``."""
        return [first_row, self.log_rows, self.log_cols, self.scale_cols, float(self.global_scale)]

    def scale_rows(self, first: int, n: int) -> tuple[int, int]:
        """The scale rows [a, b) that matrix rows [first, first + n) read."""
        if self.scale is None:
            return 0, 0
        return first >> self.log_rows, ((first + max(n, 1) - 1) >> self.log_rows) + 1


def layout(array, fmt: str, shape, scale=None) -> Layout:
    """Host arrays in the layout the shaders read, checked against the logical ``shape`` (rows, cols)."""
    host = np.asarray(array)
    rows = int(shape[0]) if len(shape) else 1
    cols = int(math.prod(shape[1:])) if len(shape) > 1 else 1
    if fmt == "f32":
        return Layout(np.ascontiguousarray(host, np.float32).reshape(rows, cols))
    if fmt == "f16":
        return Layout(np.ascontiguousarray(host.astype(np.float16, copy=False)).reshape(rows, cols))
    if fmt == "bf16":
        bits = host if host.dtype == np.uint16 else host.view(np.uint16)
        return Layout(np.ascontiguousarray(bits).reshape(rows, cols))
    if fmt == "fp8":
        return _fp8(np.ascontiguousarray(host).view(np.uint8).reshape(rows, cols), scale, rows, cols)
    if fmt == "nvfp4":
        return _nvfp4(host, scale, rows, cols)
    values, nbytes = gguf_block(fmt)
    if cols % values:
        raise ValueError(f"{fmt} rows of {cols} values are not whole blocks of {values}")
    data = np.ascontiguousarray(host).view(np.uint8).reshape(rows, -1)
    if data.shape[1] != cols // values * nbytes:
        raise ValueError(f"{fmt} data {host.shape} does not make a ({rows}, {cols}) matrix")
    return Layout(data)


def _log2_at_least(n: int) -> int:
    return max(0, int(n - 1).bit_length())


def _fp8(data: np.ndarray, scale, rows: int, cols: int) -> Layout:
    from lumen_core.backend import scale_block

    if scale is None:  # unscaled e4m3: a per-tensor scale of 1 on the device, none in the Weight
        return Layout(data, np.ones((1, 1), np.float32))
    s = np.asarray(scale, dtype=np.float32)
    block = scale_block((rows, cols), s.shape)
    scales = Scales("fp8", tuple(s.shape), int(s.size) * 4)
    if block is not None:
        br, bc = block
        sr, scols = -(-rows // br), -(-cols // bc)
        return Layout(data, np.ascontiguousarray(s.reshape(sr, scols)), br.bit_length() - 1, bc.bit_length() - 1,
                      scols, scales=scales)
    if s.size > 1:  # per channel: scale row = matrix row; one column covers the whole row
        return Layout(data, np.ascontiguousarray(s.reshape(rows, 1)), 0, _log2_at_least(cols), 1, scales=scales)
    return Layout(data, s.reshape(1, 1), 31, 31, 1, scales=scales)


def _nvfp4(host, scale, rows: int, cols: int) -> Layout:
    if scale is None:
        raise ValueError("an nvfp4 weight needs its scales: (block scales, global scale)")
    block, global_scale = scale
    block = np.asarray(block)
    data = np.ascontiguousarray(host)
    if data.dtype != np.uint8 or data.shape != (rows, cols // 2) or block.shape != (rows, cols // NVFP4_GROUP) \
            or cols % NVFP4_GROUP:
        raise ValueError(f"nvfp4 weight {data.dtype} {data.shape} with scales {block.shape} does not make "
                         f"{(rows, cols)}")
    gs = float(np.asarray(global_scale, np.float32).reshape(()))
    return Layout(data, np.ascontiguousarray(block).view(np.uint8), 0, 31, cols // NVFP4_GROUP, gs,
                  Scales("nvfp4", tuple(block.shape), int(block.nbytes) + 4, gs))
