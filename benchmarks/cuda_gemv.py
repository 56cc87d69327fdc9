"""Decode GEMV on the GPU: Lumen's hand-written kernels (bf16 / f16 / fp8-e4m3 with 128x128 block scales) against
cuBLAS (cupy.matmul, f16 weights: the same bytes as bf16; CuPy has no bfloat16) at Qwen3.5-9B shapes, with the
measured device-to-device copy bandwidth as the ceiling. One process, CUDA events, one CUDA graph of REPS
launches per measurement (so Python's launch cost stays out; where a call cannot be captured, as CuPy's matmul,
the calls are queued behind a 10 ms spin kernel instead, so the GPU runs them back to back all the same), weights
rotated over enough copies to defeat the L2.

    python benchmarks/cuda_gemv.py [--json PATH] [--tokens 1,4] [--reps 20]
    python benchmarks/cuda_gemv.py --fp8-sweep     # fp8 at T = 1: unroll 2 / 4 x rows per warp
    python benchmarks/cuda_gemv.py --wide-sweep --tokens 5,7   # bf16 at a verify's T: rows x warps x unroll

Bytes counted per call: the weight (+ fp8 scales) + x + y. "% copy" = GB/s over the device-to-device copy's GB/s
(read + write); "% read" = over a read-only streaming kernel's GB/s (the ceiling a GEMV can reach).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys

import cupy as cp
import numpy as np
from lumen_cuda import gemv, ops

from lumen_core.backend import Weight

SHAPES = [  # (name, N, K): Qwen3.5-9B (hidden 4096, intermediate 12288, vocab 248320)
    ("attn 4096x4096", 4096, 4096),
    ("mlp up 12288x4096", 12288, 4096),
    ("mlp down 4096x12288", 4096, 12288),
    ("lm_head 248320x4096", 248320, 4096),
]
ROTATE_BYTES = 512 << 20  # weights rotated over at least this many bytes (the H200's L2 is 50 MB)


_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}"""
_READ = r"""extern "C" __global__ void read_bw(const uint4* __restrict__ p, long long n, unsigned int* out) {
  unsigned int acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
#pragma unroll 4
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads alive
}"""
SPIN_MS = 10
_KERNELS: dict[str, cp.RawKernel] = {}


def raw(src: str, name: str) -> cp.RawKernel:
    if name not in _KERNELS:
        _KERNELS[name] = cp.RawKernel(src, name)
    return _KERNELS[name]


def spin(ms: float = SPIN_MS):
    """Keep the GPU busy ~ms (at <= 2 GHz) so that what Python enqueues next runs back to back after it."""
    raw(_SPIN, "spin")((1,), (1,), (np.int64(ms * 2_000_000),))


def timed(fn, nsets: int, reps: int, iters: int = 7) -> tuple[float, str]:
    """Median seconds per fn(i) call, i rotating over nsets: a CUDA graph of reps calls, or (where capture
    fails) reps eager calls queued behind a spin kernel, timed by events around the calls alone."""
    stream = cp.cuda.Stream(non_blocking=True)
    mode = "graph"
    with stream:
        for i in range(min(nsets, 2)):
            fn(i)  # warm-up: NVRTC compile, cuBLAS handle
        stream.synchronize()
        try:
            stream.begin_capture()
            try:
                for i in range(reps):
                    fn(i % nsets)
            finally:
                graph = stream.end_capture()

            def run():
                graph.launch(stream)
        except Exception as exc:  # capture unsupported by this call
            mode = f"queued ({type(exc).__name__} in capture)"
            graph = None
            stream = cp.cuda.Stream(non_blocking=True)

            def run():
                with stream:
                    for i in range(reps):
                        fn(i % nsets)
        with stream:
            run()
            stream.synchronize()
            times = []
            for _ in range(iters):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                if graph is None:
                    spin()
                e0.record(stream)
                run()
                e1.record(stream)
                e1.synchronize()
                times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps)
    return statistics.median(times), mode


def copy_bandwidth(nbytes: int = 2 << 30) -> tuple[float, float, float]:
    """Bytes per second: device-to-device memcpy and CuPy's elementwise copy (read + written), and a read-only
    streaming kernel (16-byte loads, bytes read)."""
    src = cp.random.random(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    t_memcpy, _ = timed(lambda i: dst.data.copy_from_device_async(src.data, src.nbytes,
                                                                  cp.cuda.get_current_stream()), 1, 10)
    t_kernel, _ = timed(lambda i: cp.copyto(dst, src), 1, 10)
    read = raw(_READ, "read_bw")
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    sink = cp.zeros(1, cp.uint32)
    t_read, _ = timed(lambda i: read((sms * 8,), (256,), (src, np.int64(nbytes // 16), sink)), 1, 10)
    return 2 * nbytes / t_memcpy, 2 * nbytes / t_kernel, nbytes / t_read


def bf16_bits(w32):
    """f32 -> bf16 bits (uint16), round to nearest even."""
    u = w32.view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def random_fp8(N, K):
    """Random e4m3 bytes, NaN codes (0x7f, 0xff) replaced, magnitudes below ~2."""
    b = cp.random.randint(0, 0x40, size=(N, K), dtype=cp.int32).astype(cp.uint8)  # exponent < 8: |v| < 2
    return b | (cp.random.randint(0, 2, size=(N, K), dtype=cp.int32).astype(cp.uint8) << 7)


def rel_err(got, want) -> float:
    return float(cp.linalg.norm(got.astype(cp.float64) - want) / cp.linalg.norm(want))


def bench_shape(name, N, K, tokens, reps, record):
    """Every implementation at one (N, K), for each T in tokens."""
    cp.random.seed(0)
    nsets16 = max(2, math.ceil(ROTATE_BYTES / (2 * N * K)))
    nsets8 = max(2, math.ceil(ROTATE_BYTES / (N * K)))
    wb = [bf16_bits(cp.random.standard_normal((N, K), dtype=cp.float32) * 0.02) for _ in range(nsets16)]
    wh = [b.view(cp.uint16) for b in wb]  # f16 kernel: the same bytes read as f16 (random bf16 bits: finite)
    w8 = [random_fp8(N, K) for _ in range(nsets8)]
    s8 = [cp.random.uniform(1e-3, 2e-3, size=(-(-N // 128), -(-K // 128))).astype(cp.float32)
          for _ in range(nsets8)]
    w16h = [ops.bf16_to_f32(b).astype(cp.float16) for b in wb]  # cuBLAS f16 weights
    for T in tokens:
        bench_tokens(name, N, K, T, (wb, wh, w8, s8, w16h), (nsets16, nsets8), reps, record)


def bench_tokens(name, N, K, T, sets, nsets, reps, record):
    """Every implementation at one (N, K) and T tokens; sets: rotated weights, nsets: how many of each."""
    wb, wh, w8, s8, w16h = sets
    nsets16, nsets8 = nsets
    x = cp.random.standard_normal((T, K), dtype=cp.float32)
    x16 = x.astype(cp.float16)
    y = cp.empty((T, N), cp.float32)
    y16 = cp.empty((T, N), cp.float16)
    b16 = 2 * N * K + 4 * T * K + 4 * T * N
    b8 = N * K + 4 * s8[0].size + 4 * T * K + 4 * T * N
    # correctness at this shape (set 0): the kernels against an f64 product
    ref = x.astype(cp.float64) @ ops.bf16_to_f32(wb[0]).astype(cp.float64).T
    err16 = rel_err(gemv.gemv16(x, wb[0], "bf16"), ref)
    ref = x.astype(cp.float64) @ gemv.dequantize_fp8(
        Weight(w8[0], "fp8", (N, K), s8[0], (128, 128))).astype(cp.float64).T
    err8 = rel_err(gemv.gemv_fp8(x, w8[0], s8[0], (128, 128)), ref)
    ref = None
    for rows in (1, 2, 4):
        t, mode = timed(lambda i, r=rows: gemv.gemv16(x, wb[i], "bf16", out=y, rows=r), nsets16, reps)
        record(name, T, "lumen bf16", rows, t, b16, mode, err16)
    t, mode = timed(lambda i: gemv.gemv16(x, wh[i], "f16", out=y), nsets16, reps)
    record(name, T, "lumen f16", gemv.ROWS["f16"][T - 1], t, b16, mode)
    for rows in (1, 2, 4):
        t, mode = timed(lambda i, r=rows: gemv.gemv_fp8(x, w8[i], s8[i], (128, 128), out=y, rows=r),
                        nsets8, reps)
        record(name, T, "lumen fp8", rows, t, b8, mode, err8)
    t, mode = timed(lambda i: cp.matmul(x16, w16h[i].T, out=y16), nsets16, reps)
    record(name, T, "cuBLAS f16", "-", t, 2 * N * K + 2 * T * K + 2 * T * N, mode)
    if T == 1:  # what lumen-cuda did before these kernels: widen bf16 to f32, then SGEMM
        t, mode = timed(lambda i: ops.linear(x, Weight(wb[i], "bf16", (N, K))), nsets16, max(2, reps // 4))
        record(name, T, "cupy bf16 (before)", "-", t, b16, mode)


FP8_SWEEP_SHAPES = [  # decode matrices of the Qwen3.5-9B and 35B-A3B shapes (fp8 checkpoints)
    ("9b mlp up 24576x4096", 24576, 4096), ("9b mlp down 4096x12288", 4096, 12288),
    ("9b gdn in 12352x4096", 12352, 4096), ("9b out 4096x4096", 4096, 4096),
    ("35b gdn in 12352x2048", 12352, 2048), ("35b out 2048x4096", 2048, 4096),
    ("35b shared up 1024x2048", 1024, 2048), ("35b shared down 2048x512", 2048, 512),
]


def fp8_sweep(reps: int, read_bw: float) -> None:
    """The fp8 GEMV at T = 1 for each unroll (gemv.FP8_UNROLL: loads in flight per row) and rows per warp: time,
    bandwidth, and the largest difference from unroll 2 (relative to max |y|)."""
    print("\n| shape | unroll | rows | us | GB/s | % of read BW | max diff vs unroll 2 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, N, K in FP8_SWEEP_SHAPES:
        cp.random.seed(0)
        nsets = max(2, math.ceil(ROTATE_BYTES / (N * K)))
        w8 = [random_fp8(N, K) for _ in range(nsets)]
        s8 = [cp.random.uniform(1e-3, 2e-3, size=(-(-N // 128), -(-K // 128))).astype(cp.float32)
              for _ in range(nsets)]
        x = cp.random.standard_normal((1, K), dtype=cp.float32)
        y = cp.empty((1, N), cp.float32)
        nbytes = N * K + 4 * s8[0].size + 4 * K + 4 * N
        base = gemv.gemv_fp8(x, w8[0], s8[0], (128, 128), unroll=2)
        for conv in (2, 4):
            diff = float(cp.abs(gemv.gemv_fp8(x, w8[0], s8[0], (128, 128), unroll=conv) - base).max()
                         / cp.abs(base).max())
            for rows in (1, 2, 4):
                def call(i, r=rows, c=conv, x=x, y=y, w8=w8, s8=s8):
                    gemv.gemv_fp8(x, w8[i], s8[i], (128, 128), out=y, rows=r, unroll=c)

                t, _ = timed(call, nsets, reps)
                gbs = nbytes / t / 1e9
                print(f"| {name} | {conv} | {rows} | {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / read_bw:.0f}% | "
                      f"{diff:.1e} |", flush=True)
        cp.get_default_memory_pool().free_all_blocks()


WIDE_SHAPES = [  # the 9B shape's decode matrices (bf16): a verify of T = k + 1 tokens reads each once
    ("9b gdn in 12352x4096", 12352, 4096), ("9b mlp up 24576x4096", 24576, 4096),
    ("9b mlp down 4096x12288", 4096, 12288), ("9b out 4096x4096", 4096, 4096),
    ("lm_head 248320x4096", 248320, 4096),
]


def wide_sweep(reps: int, read_bw: float, tokens: list[int]) -> None:
    """The bf16 GEMV at T = 1 (the defaults) and at each T of ``tokens`` (a speculative verify) for rows per warp
    x warps per block x unroll: time, % of the read bandwidth, time over T = 1's, and whether y equals T = 1's
    rows bit for bit (each row's sum runs in the same order whatever T, rows, warps: it must)."""
    print("\n| shape | T | rows | warps | unroll | us | % of read BW | time / T=1 | same bits as T=1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, N, K in WIDE_SHAPES:
        wide_shape(name, N, K, reps, read_bw, tokens)
        cp.get_default_memory_pool().free_all_blocks()


def wide_shape(name: str, N: int, K: int, reps: int, read_bw: float, tokens: list[int]) -> None:
    cp.random.seed(0)
    nsets = max(2, math.ceil(ROTATE_BYTES / (2 * N * K)))
    wb = [bf16_bits(cp.random.standard_normal((N, K), dtype=cp.float32) * 0.02) for _ in range(nsets)]
    x = cp.random.standard_normal((max(tokens), K), dtype=cp.float32)
    cp.cuda.Device().synchronize()  # timed() runs on its own non-blocking stream: let the weights' kernels finish
    nbytes = 2 * N * K
    y1 = cp.empty((1, N), cp.float32)
    t1, _ = timed(lambda i: gemv.gemv16(x[:1], wb[i], "bf16", out=y1), nsets, reps)
    print(f"| {name} | 1 | {gemv.ROWS['bf16'][0]} | {gemv.WARPS} | 2 | {t1 * 1e6:.1f} | "
          f"{100 * nbytes / t1 / read_bw:.0f}% | 1.00 | - |", flush=True)
    ones = cp.concatenate([gemv.gemv16(x[t:t + 1], wb[0], "bf16") for t in range(max(tokens))])
    for T, rows, warps, unroll in itertools.product(tokens, (2, 4, 8), (4, 8), (1, 2)):
        y = cp.empty((T, N), cp.float32)

        def call(i, r=rows, w=warps, u=unroll, T=T, y=y):
            gemv.gemv16(x[:T], wb[i], "bf16", out=y, rows=r, warps=w, unroll=u)

        got = gemv.gemv16(x[:T], wb[0], "bf16", rows=rows, warps=warps, unroll=unroll)
        same = "yes" if bool((got == ones[:T]).all()) else f"no ({float(cp.abs(got - ones[:T]).max()):.1e})"
        t, _ = timed(call, nsets, reps)
        print(f"| {name} | {T} | {rows} | {warps} | {unroll} | {t * 1e6:.1f} | {100 * nbytes / t / read_bw:.0f}% | "
              f"{t / t1:.2f} | {same} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fp8-sweep", action="store_true", help="only the fp8 unroll x rows sweep at T = 1")
    ap.add_argument("--wide-sweep", action="store_true",
                    help="only the bf16 GEMV at the --tokens T (5..8: a speculative verify) for rows x warps x unroll, "
                         "against T = 1")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--tokens", default="1,4", help="token counts T (1..8)")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N shapes")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    print(f"device: {props['name'].decode()} sm_{dev.compute_capability}, cupy {cp.__version__}, "
          f"CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}", flush=True)
    bw_memcpy, bw_kernel, read_bw = copy_bandwidth()
    copy_bw = max(bw_memcpy, bw_kernel)
    print(f"copy bandwidth (read + write): memcpy {bw_memcpy / 1e9:.0f} GB/s, elementwise {bw_kernel / 1e9:.0f} GB/s; "
          f"read-only stream {read_bw / 1e9:.0f} GB/s", flush=True)
    rows_out = []
    if args.fp8_sweep:
        fp8_sweep(args.reps, read_bw)
        return 0
    if args.wide_sweep:
        wide_sweep(args.reps, read_bw, tokens)
        return 0

    def record(shape, T, impl, rows, t, nbytes, mode, err=None):
        gbs = nbytes / t / 1e9
        rows_out.append({"shape": shape, "T": T, "impl": impl, "rows": rows, "us": t * 1e6, "GBps": gbs,
                         "copy_frac": gbs * 1e9 / copy_bw, "read_frac": gbs * 1e9 / read_bw, "mode": mode,
                         "rel_err": err})
        print(f"  {shape:22s} T={T} {impl:18s} rows={rows!s:4s} {t * 1e6:9.1f} us {gbs:7.0f} GB/s "
              f"{100 * gbs * 1e9 / copy_bw:5.1f}% {mode}" + (f" rel_err {err:.1e}" if err is not None else ""),
              flush=True)

    for name, N, K in SHAPES[: args.shapes]:
        bench_shape(name, N, K, tokens, args.reps, record)
        cp.get_default_memory_pool().free_all_blocks()

    # Summary: the best rows setting of each kernel per shape and T, against cuBLAS.
    print("\n| shape (N x K) | T | impl | rows | us | GB/s | % of copy BW | % of read BW | vs cuBLAS f16 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, _, _ in SHAPES[: args.shapes]:
        for T in tokens:
            rs = [r for r in rows_out if r["shape"] == name and r["T"] == T]
            blas = next(r for r in rs if r["impl"] == "cuBLAS f16")
            for impl in ("lumen bf16", "lumen f16", "lumen fp8", "cuBLAS f16", "cupy bf16 (before)"):
                cand = [r for r in rs if r["impl"] == impl]
                if not cand:
                    continue
                best = min(cand, key=lambda r: r["us"])
                print(f"| {name} | {T} | {impl} | {best['rows']} | {best['us']:.1f} | {best['GBps']:.0f} | "
                      f"{100 * best['copy_frac']:.0f}% | {100 * best['read_frac']:.0f}% | "
                      f"{blas['us'] / best['us']:.2f}x |")
    print(f"\ncopy bandwidth (read + write, 2 GiB): {copy_bw / 1e9:.0f} GB/s; read-only: {read_bw / 1e9:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_Bps": {"memcpy": bw_memcpy, "elementwise": bw_kernel}, "read_Bps": read_bw,
                       "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
