"""WGSL building blocks shared by every kernel: the params block, grid indexing, f16/bf16/fp8 decoding.

Every kernel reads its params as 32-bit words from one uniform block (``w(i)``: u32, ``wf(i)``: f32, ``wi(i)``:
i32), written by ``device.pack`` in the same order. Workgroups are laid out on a 2-D grid (WebGPU allows 65535 a
dimension): ``group_id(wid, nw)`` is the linear workgroup index.
"""

from __future__ import annotations


def header(bindings: list[tuple[str, str, str]]) -> str:
    """Storage bindings [(name, 'r' | 'w', element type)], then the params block after them."""
    lines = []
    for i, (name, access, ty) in enumerate(bindings):
        mode = "read" if access == "r" else "read_write"
        lines.append(f"@group(0) @binding({i}) var<storage, {mode}> {name}: array<{ty}>;")
    lines.append(f"@group(0) @binding({len(bindings)}) var<uniform> params: Params;")
    return PRELUDE + "\n".join(lines) + "\n"


def access(bindings) -> str:
    return "".join(a for _, a, _ in bindings)


PRELUDE = """
struct Params { v: array<vec4<u32>, 16> }
fn w(i: u32) -> u32 { return params.v[i / 4u][i % 4u]; }
fn wf(i: u32) -> f32 { return bitcast<f32>(w(i)); }
fn wi(i: u32) -> i32 { return bitcast<i32>(w(i)); }
fn group_id(wid: vec3<u32>, nw: vec3<u32>) -> u32 { return wid.y * nw.x + wid.x; }
fn tanh_f(x: f32) -> f32 { return tanh(clamp(x, -20.0, 20.0)); }  // some drivers give NaN past ~44
fn sigmoid_f(x: f32) -> f32 { return 0.5 * (tanh_f(0.5 * x) + 1.0); }
// log1p(e) for e in [0, 1] as 2 atanh(e / (2 + e)): a series in s^2 <= 1/9, accurate to a few ulps whatever the
// driver's log (WGSL only promises log to 2^-21 absolute near 1, which loses softplus of very negative inputs)
fn log1p01(e: f32) -> f32 {
  let s = e / (2.0 + e); let s2 = s * s;
  var p = 1.0 / 19.0;
  for (var n = 17; n >= 1; n -= 2) { p = p * s2 + 1.0 / f32(n); }
  return 2.0 * s * p;
}
fn softplus_f(x: f32) -> f32 { return max(x, 0.0) + log1p01(exp(-abs(x))); }
fn gelu_tanh_f(x: f32) -> f32 { return 0.5 * x * (1.0 + tanh_f(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
fn bf16_lo(u: u32) -> f32 { return bitcast<f32>(u << 16u); }
fn bf16_hi(u: u32) -> f32 { return bitcast<f32>(u & 0xffff0000u); }
"""

# Element k of a packed 16-bit array (f16 / bf16) held as array<u32>.
HALF_LOADERS = {
    "f16": "fn ld(buf_i: u32) -> f32 { let u = W[buf_i >> 1u]; return unpack2x16float(u)[buf_i & 1u]; }",
    "bf16": "fn ld(buf_i: u32) -> f32 { let u = W[buf_i >> 1u]; "
            "return select(bf16_lo(u), bf16_hi(u), (buf_i & 1u) == 1u); }",
    "f32": "fn ld(buf_i: u32) -> f32 { return W[buf_i]; }",
}


def grid(n_groups: int, max_groups: int = 65535) -> tuple[int, int, int]:
    """A (x, y, 1) grid of at least ``n_groups`` workgroups (extra ones return early)."""
    if n_groups <= max_groups:
        return (n_groups, 1, 1)
    y = -(-n_groups // max_groups)
    return (-(-n_groups // y), y, 1)
