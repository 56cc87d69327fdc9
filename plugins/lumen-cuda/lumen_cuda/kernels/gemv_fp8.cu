// Decode GEMV for FP8 E4M3 weights with block scales: y (T, N) f32 = x (T, K) . (W * S)^T, T = 1..4.
//
// W (N, K) e4m3 bytes, row-major; S (ceil(N/BR), ceil(K/BC)) f32, the HF `weight_scale_inv` layout (the value
// a weight stands for is W[n, k] * S[n / BR, k / BC]; HF FP8 checkpoints use BR = BC = 128).
// Alignment: K % 16 == 0, BC % 16 == 0, W and x 16-byte aligned; gemv.py checks and falls back otherwise.
//
// One warp owns ROWS consecutive rows; per step each lane reads 16 bytes (16 weights) of each row, all inside
// one scale block (16 | BC), converts pairs with the e4m3x2 -> f16x2 conversion (exact), dots them against
// x in f32, and adds the partial times its block scale. Shuffle reduction at the end.
// Grid: ceil(N / (ROWS * GEMV_WARPS)) blocks of GEMV_WARPS * 32 threads.

#include "pdl.cuh"

#include <cuda_fp8.h>

#ifndef GEMV_WARPS
#define GEMV_WARPS 4
#endif
#ifndef GEMV_U
#define GEMV_U 2  // 16-byte loads per row in flight per lane (gemv.py may compile with -DGEMV_U=4)
#endif

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// x[off .. off+16) as floats; x f32 (four 16-byte loads) or bf16 bits (two).
template <bool XBF16>
__device__ __forceinline__ void load_x16(const void* __restrict__ x, long long off, float* xv /* (16,) */) {
  if (XBF16) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(x) + off);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = __ldg(p + h);
      const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xv[8 * h + 2 * i] = __uint_as_float(u[i] << 16);
        xv[8 * h + 2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
    }
  } else {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + off);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 a = __ldg(p + i);
      xv[4 * i] = a.x; xv[4 * i + 1] = a.y; xv[4 * i + 2] = a.z; xv[4 * i + 3] = a.w;
    }
  }
}

// Four e4m3 bytes of a 32-bit word -> floats (e4m3x2 -> f16x2, exact, then f16 -> f32). An integer bit-placement
// variant was measured no faster (the GEMV is bound by memory latency, not conversions) and dropped.
__device__ __forceinline__ void e4m3x4(unsigned int u, float* w) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)((u >> (16 * h)) & 0xffffu);
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    const float2 f = __half22float2(__half2(raw));
    w[2 * h] = f.x;
    w[2 * h + 1] = f.y;
  }
}

template <bool XBF16, int T, int ROWS>
__device__ __forceinline__ void gemv_e4m3(const unsigned char* __restrict__ W,  // (N, K) e4m3
                                          const float* __restrict__ S,          // (ceil(N/BR), SK) f32
                                          const void* __restrict__ x,           // (T, K) f32 or bf16 bits
                                          float* __restrict__ y,                // (T, N) f32
                                          int N, int K, int BR, int BC, int SK) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= N) return;  // warp-uniform
  float acc[T][ROWS];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;

  const unsigned char* wrow[ROWS];
  const float* srow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {  // the ragged last warp re-reads row N-1 for its missing rows, never writes them
    const int row = min(row0 + r, N - 1);
    wrow[r] = W + (long long)row * K;
    srow[r] = S + (long long)(row / BR) * SK;
  }

  constexpr int STEP = 32 * 16;
  const bool bc_pow2 = (BC & (BC - 1)) == 0;
  const int bc_shift = __ffs(BC) - 1;
  for (int k0 = lane * 16; k0 < K; k0 += STEP * GEMV_U) {
    uint4 wv[GEMV_U][ROWS];
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u) {
      const int k = k0 + u * STEP;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) wv[u][r] = k < K ? ld_stream16(wrow[r] + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u) {
      const int k = k0 + u * STEP;
      if (k < K) {
        float xv[T][16];
#pragma unroll
        for (int t = 0; t < T; ++t) load_x16<XBF16>(x, (long long)t * K + k, xv[t]);
        const int kb = bc_pow2 ? k >> bc_shift : k / BC;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const unsigned int wu[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
          float w[16];
#pragma unroll
          for (int i = 0; i < 4; ++i) e4m3x4(wu[i], w + 4 * i);
          const float s = __ldg(srow[r] + kb);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            float p = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) p = fmaf(w[j], xv[t][j], p);
            acc[t][r] = fmaf(p, s, acc[t][r]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[t][r] += __shfl_xor_sync(0xffffffffu, acc[t][r], off);
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        if (row0 + r < N) y[(long long)t * N + row0 + r] = acc[t][r];
  }
}

// gemv_fp8_x<x>_t<T>_r<ROWS>(W (N, K) e4m3, S (ceil(N/BR), SK) f32, x (T, K), y (T, N) f32, N, K, BR, BC, SK)
#define GEMV8(XNAME, XBF16, T, ROWS)                                                                          \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                               \
      gemv_fp8_x##XNAME##_t##T##_r##ROWS(const unsigned char* __restrict__ W, /* (N, K) e4m3 */                \
                                         const float* __restrict__ S,         /* (ceil(N/BR), SK) f32 */       \
                                         const void* __restrict__ x,          /* (T, K) */                     \
                                         float* __restrict__ y,               /* (T, N) f32 */                 \
                                         int N, int K, int BR, int BC, int SK) {                               \
    pdl_prefetch_rows(W, K, (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS, ROWS, N);                   \
    pdl_begin();                                                                                               \
    gemv_e4m3<XBF16, T, ROWS>(W, S, x, y, N, K, BR, BC, SK);                                                   \
  }

#define GEMV8_T(XNAME, XBF16, ROWS) \
  GEMV8(XNAME, XBF16, 1, ROWS)      \
  GEMV8(XNAME, XBF16, 2, ROWS)      \
  GEMV8(XNAME, XBF16, 3, ROWS)      \
  GEMV8(XNAME, XBF16, 4, ROWS)

#define GEMV8_R(XNAME, XBF16) \
  GEMV8_T(XNAME, XBF16, 1)    \
  GEMV8_T(XNAME, XBF16, 2)    \
  GEMV8_T(XNAME, XBF16, 4)

GEMV8_R(f32, false)
GEMV8_R(bf16, true)
// 5..8 tokens (a speculative verify): 2 rows per warp
GEMV8(f32, false, 5, 2) GEMV8(f32, false, 6, 2) GEMV8(f32, false, 7, 2) GEMV8(f32, false, 8, 2)
GEMV8(bf16, true, 5, 2) GEMV8(bf16, true, 6, 2) GEMV8(bf16, true, 7, 2) GEMV8(bf16, true, 8, 2)
GEMV8(f32, false, 5, 4) GEMV8(f32, false, 6, 4) GEMV8(f32, false, 7, 4) GEMV8(f32, false, 8, 4)
GEMV8(bf16, true, 5, 4) GEMV8(bf16, true, 6, 4) GEMV8(bf16, true, 7, 4) GEMV8(bf16, true, 8, 4)
