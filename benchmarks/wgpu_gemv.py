"""The wgpu backend's decode GEMV against the memory-bandwidth bound, on one adapter.

For each (rows, cols, format) it times ``linear`` on one token (a decode step's projection), many recorded into one
command buffer, and reports GB/s of weight read and the fraction of a measured read bandwidth (a WGSL kernel that
reads a large buffer in 16-byte loads, 4 in flight a thread: the practical bound on this adapter). The named
baseline is that read kernel.

    python benchmarks/wgpu_gemv.py [--device wgpu:0] [--shapes 4096x4096,12288x4096,4096x12288] [--formats bf16]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from lumen_core.plugins import get_registry

_BINDINGS = """
@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<u32>>;
struct Params { v: array<vec4<u32>, 16> }
@group(0) @binding(2) var<uniform> params: Params;
"""

READ = _BINDINGS + """@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
  let n = params.v[0].x;
  let stride = nw.x * 256u;
  var acc = vec4<u32>(0u);
  for (var i = g.x; i < n; i += 4u * stride) {
    let a = src[i]; let b = src[min(i + stride, n - 1u)];
    let c = src[min(i + 2u * stride, n - 1u)]; let d = src[min(i + 3u * stride, n - 1u)];
    acc ^= a ^ b ^ c ^ d;
  }
  if (acc.x == 0x12345678u && acc.y == 0x9abcdef0u) { dst[0] = acc; }  // never: keeps the loads
}
"""

COPY = _BINDINGS + """@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
  let i = g.y * nw.x * 256u + g.x;
  if (i < params.v[0].x) { dst[i] = src[i]; }
}
"""


def timed(ctx, record, reps: int) -> float:
    """Seconds a call on the device: ``reps`` calls recorded first, then submitted in one command buffer and waited
    for (the host's recording cost is reported apart: ``recording``)."""
    record()  # compile + warm
    ctx.finish()
    for _ in range(reps):
        record()
    t0 = time.perf_counter()
    ctx.finish()
    return (time.perf_counter() - t0) / reps


def recording(ctx, record, reps: int) -> float:
    """Seconds of host time to record one call (Python + wgpu-py), nothing submitted meanwhile."""
    t0 = time.perf_counter()
    for _ in range(reps):
        record()
    t = (time.perf_counter() - t0) / reps
    ctx.finish()
    return t


def _wide(ctx, x, w, lanes):
    from lumen_wgpu import gemv
    from lumen_wgpu.tensor import empty

    T, K = x.shape
    y = empty(ctx, (T, w.shape[0]))
    for buf, row, n, col in w.data.pieces():
        gemv.dispatch(ctx, w.format, x, buf, y, T, K, w.shape[0], n, row, col, lanes)
    return y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="wgpu:0")
    ap.add_argument("--shapes", default="4096x4096,12288x4096,4096x12288")
    ap.add_argument("--formats", default="bf16,f16,f32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--wide", action="store_true", help="also time lumen_wgpu.gemv's kernel alone, 32 and 64 "
                    "threads a row")
    ap.add_argument("--tokens", type=int, default=0, help="also time linear on this many tokens (the prefill GEMM): "
                    "TFLOP/s")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reg = get_registry()
    backend = reg.backend_class("wgpu")(args.device, reg)
    ctx = backend.ctx
    print(backend.device_info(args.device).description)
    from lumen_wgpu import wgsl
    from lumen_wgpu.device import pack

    n_bytes = min(256 << 20, ctx.max_binding // 2)
    src, dst = ctx.alloc(n_bytes), ctx.alloc(n_bytes)
    k = ctx.kernel("copy", COPY, "rw")
    words = n_bytes // 16
    t_copy = timed(ctx, lambda: ctx.dispatch(k, [src.gpu, dst.gpu], pack(words), wgsl.grid(-(-words // 256))),
                   args.reps)
    print(f"copy {n_bytes >> 20} MiB: {t_copy * 1e3:.3f} ms = {2 * n_bytes / t_copy / 1e9:.1f} GB/s (read + write)")
    big = ctx.device.create_buffer(size=min(1 << 30, ctx.max_binding // 16 * 16), usage=ctx._usage)
    kr = ctx.kernel("read", READ, "rw")
    words = big.size // 16
    groups = min(ctx.max_groups, 132 * 16)
    t_read = timed(ctx, lambda: ctx.dispatch(kr, [big, dst.gpu], pack(words), (groups, 1, 1)), args.reps)
    bound = big.size / t_read
    print(f"read {big.size >> 20} MiB: {t_read * 1e3:.3f} ms = {bound / 1e9:.1f} GB/s: the bound")
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, kdim = (int(v) for v in shape.split("x"))
        w32 = rng.standard_normal((n, kdim), dtype=np.float32)
        x = backend.tensor(rng.standard_normal((1, kdim), dtype=np.float32))
        for fmt in args.formats.split(","):
            host = {"f32": w32, "f16": w32.astype(np.float16),
                    "bf16": (w32.view(np.uint32) >> 16).astype(np.uint16)}[fmt]
            w = backend.weight(host, fmt, "vram", shape=(n, kdim))
            kernels = {"linear": lambda w=w, x=x: backend.ops.linear(x, w)}
            if args.wide:
                kernels["wide.l32"] = lambda w=w, x=x: _wide(ctx, x, w, 32)
                kernels["wide.l64"] = lambda w=w, x=x: _wide(ctx, x, w, 64)
            for name, fn in kernels.items():
                t = timed(ctx, fn, args.reps)
                host_s = recording(ctx, fn, args.reps)
                gbs = host.nbytes / t / 1e9
                rows.append({"shape": shape, "format": fmt, "kernel": name, "ms": t * 1e3, "GB/s": gbs,
                             "fraction": gbs * 1e9 / bound, "record_us": host_s * 1e6})
                print(f"{shape:>12} {fmt:>5} {name:>9}: {t * 1e3:8.3f} ms  {gbs:8.1f} GB/s  "
                      f"{100 * gbs * 1e9 / bound:5.1f}% of the bound; recording it: {host_s * 1e6:.0f} us")
    if args.tokens:
        for shape in args.shapes.split(","):
            n, kdim = (int(v) for v in shape.split("x"))
            x = backend.tensor(rng.standard_normal((args.tokens, kdim), dtype=np.float32))
            host = (rng.standard_normal((n, kdim), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
            w = backend.weight(host, "bf16", "vram", shape=(n, kdim))
            t = timed(ctx, lambda w=w, x=x: backend.ops.linear(x, w), max(3, args.reps // 10))
            flops = 2 * args.tokens * n * kdim / t
            rows.append({"shape": shape, "format": "bf16", "tokens": args.tokens, "ms": t * 1e3,
                         "TFLOP/s": flops / 1e12})
            print(f"{shape:>12}  bf16 x {args.tokens} tokens: {t * 1e3:8.3f} ms  {flops / 1e12:6.2f} TFLOP/s "
                  "(f32 math)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bound_GBs": bound / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
