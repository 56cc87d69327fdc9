// Decode GEMV for 2-byte weights: y (T, N) f32 = x (T, K) . W (N, K)^T, for T = 1..4 tokens.
//
// W is row-major (N, K) in bf16 or f16 bits (unsigned short); x is f32 or bf16 bits; y is f32.
// Alignment: K % 8 == 0 and W, x 16-byte aligned (then every row starts 16-byte aligned); the launcher in
// gemv.py checks this and falls back to cuBLAS otherwise.
//
// One warp owns ROWS consecutive rows. Per step each lane reads 16 bytes (8 weights) of each of its rows,
// U steps are loaded before the first use (U*ROWS 16-byte loads in flight per lane), f32 FMAs against the
// activations (read through L1: every warp of the block reads the same x), then a shuffle reduction.
// Weights are read once, so their loads skip L1 (ld.global.nc.L1::no_allocate).
// Grid: ceil(N / (ROWS * GEMV_WARPS)) blocks of GEMV_WARPS * 32 threads.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#include "pdl.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 4
#endif
#ifndef GEMV_U
#define GEMV_U 2  // 16-byte loads in flight per row and lane (-DGEMV_U=1 for the wide-T sweep)
#endif

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_lo(unsigned int u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float f16_to_f32(unsigned int h) {
  float f;
  unsigned short s = (unsigned short)h;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
  return f;
}

// 8 packed 2-byte values (one 16-byte load) -> 8 floats.
template <bool F16>
__device__ __forceinline__ void unpack8(const uint4 v, float* w /* (8,) */) {
  const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (F16) {
      w[2 * i] = f16_to_f32(u[i] & 0xffffu);
      w[2 * i + 1] = f16_to_f32(u[i] >> 16);
    } else {
      w[2 * i] = bf16_lo(u[i]);
      w[2 * i + 1] = bf16_hi(u[i]);
    }
  }
}

// x[off .. off+8) as floats; x f32 (two 16-byte loads) or bf16 bits (one).
template <bool XBF16>
__device__ __forceinline__ void load_x8(const void* __restrict__ x, long long off, float* xv /* (8,) */) {
  if (XBF16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(x) + off));
    unpack8<false>(v, xv);
  } else {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + off);
    const float4 a = __ldg(p), b = __ldg(p + 1);
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
  }
}

template <bool F16, bool XBF16, int T, int ROWS>
__device__ __forceinline__ void gemv16(const unsigned short* __restrict__ W,  // (N, K) bf16/f16 bits
                                       const void* __restrict__ x,            // (T, K) f32 or bf16 bits
                                       float* __restrict__ y,                 // (T, N) f32
                                       int N, int K) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= N) return;  // warp-uniform
  float acc[T][ROWS];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;

  const unsigned short* wrow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)  // the ragged last warp re-reads row N-1 for its missing rows, never writes them
    wrow[r] = W + (long long)min(row0 + r, N - 1) * K;

  constexpr int STEP = 32 * 8;
  for (int k0 = lane * 8; k0 < K; k0 += STEP * GEMV_U) {
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
        float xv[T][8];
#pragma unroll
        for (int t = 0; t < T; ++t) load_x8<XBF16>(x, (long long)t * K + k, xv[t]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          float w[8];
          unpack8<F16>(wv[u][r], w);
#pragma unroll
          for (int t = 0; t < T; ++t)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[t][r] = fmaf(w[j], xv[t][j], acc[t][r]);
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

// gemv_<w>_x<x>_t<T>_r<ROWS>(W (N, K) w-bits, x (T, K), y (T, N) f32, N, K)
#define GEMV16(WNAME, F16, XNAME, XBF16, T, ROWS)                                                              \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                               \
      gemv_##WNAME##_x##XNAME##_t##T##_r##ROWS(const unsigned short* __restrict__ W, /* (N, K) */              \
                                               const void* __restrict__ x,           /* (T, K) */              \
                                               float* __restrict__ y,                /* (T, N) f32 */          \
                                               int N, int K) {                                                 \
    pdl_prefetch_rows(W, 2LL * K, (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS, ROWS, N);             \
    pdl_begin();                                                                                               \
    gemv16<F16, XBF16, T, ROWS>(W, x, y, N, K);                                                                \
  }

#define GEMV16_T(WNAME, F16, XNAME, XBF16, ROWS)  \
  GEMV16(WNAME, F16, XNAME, XBF16, 1, ROWS)       \
  GEMV16(WNAME, F16, XNAME, XBF16, 2, ROWS)       \
  GEMV16(WNAME, F16, XNAME, XBF16, 3, ROWS)       \
  GEMV16(WNAME, F16, XNAME, XBF16, 4, ROWS)

#define GEMV16_R(WNAME, F16, XNAME, XBF16) \
  GEMV16_T(WNAME, F16, XNAME, XBF16, 1)    \
  GEMV16_T(WNAME, F16, XNAME, XBF16, 2)    \
  GEMV16_T(WNAME, F16, XNAME, XBF16, 4)

GEMV16_R(bf16, false, f32, false)
GEMV16_R(bf16, false, bf16, true)
GEMV16_R(f16, true, f32, false)
GEMV16_R(f16, true, bf16, true)

// 5..8 tokens (a speculative verify of up to 7 drafts): 2, 4 or 8 rows per warp (T x ROWS accumulators; 8 rows
// read each activation load into 8 rows' FMAs, half the activation loads per weight byte of 4 rows)
#define GEMV16_WIDE_R(WNAME, F16, XNAME, XBF16, ROWS) \
  GEMV16(WNAME, F16, XNAME, XBF16, 5, ROWS)          \
  GEMV16(WNAME, F16, XNAME, XBF16, 6, ROWS)          \
  GEMV16(WNAME, F16, XNAME, XBF16, 7, ROWS)          \
  GEMV16(WNAME, F16, XNAME, XBF16, 8, ROWS)
#define GEMV16_WIDE(WNAME, F16, XNAME, XBF16) \
  GEMV16_WIDE_R(WNAME, F16, XNAME, XBF16, 2)  \
  GEMV16_WIDE_R(WNAME, F16, XNAME, XBF16, 4)  \
  GEMV16_WIDE_R(WNAME, F16, XNAME, XBF16, 8)
GEMV16_WIDE(bf16, false, f32, false)
GEMV16_WIDE(bf16, false, bf16, true)
GEMV16_WIDE(f16, true, f32, false)
GEMV16_WIDE(f16, true, bf16, true)

// f32 weights: the same layout with 4 weights per 16-byte load (K % 4 == 0), x f32. Used so that f32 checkpoints
// decode without cuBLAS (which cannot be captured in a CUDA graph) at the same bandwidth.
template <int T, int ROWS>
__device__ __forceinline__ void gemv32(const float* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= N) return;  // warp-uniform
  float acc[T][ROWS];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;
  const float* wrow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) wrow[r] = W + (long long)min(row0 + r, N - 1) * K;
  constexpr int STEP = 32 * 4;
  for (int k0 = lane * 4; k0 < K; k0 += STEP * GEMV_U) {
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
        float4 xv[T];
#pragma unroll
        for (int t = 0; t < T; ++t) xv[t] = __ldg(reinterpret_cast<const float4*>(x + (long long)t * K + k));
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const float w0 = __uint_as_float(wv[u][r].x), w1 = __uint_as_float(wv[u][r].y);
          const float w2 = __uint_as_float(wv[u][r].z), w3 = __uint_as_float(wv[u][r].w);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            acc[t][r] = fmaf(w0, xv[t].x, acc[t][r]);
            acc[t][r] = fmaf(w1, xv[t].y, acc[t][r]);
            acc[t][r] = fmaf(w2, xv[t].z, acc[t][r]);
            acc[t][r] = fmaf(w3, xv[t].w, acc[t][r]);
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

#define GEMV32(T, ROWS)                                                                                       \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                               \
      gemv_f32_xf32_t##T##_r##ROWS(const float* __restrict__ W, const void* __restrict__ x,                    \
                                   float* __restrict__ y, int N, int K) {                                      \
    pdl_prefetch_rows(W, 4LL * K, (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS, ROWS, N);             \
    pdl_begin();                                                                                               \
    gemv32<T, ROWS>(W, static_cast<const float*>(x), y, N, K);                                                 \
  }
#define GEMV32_T(ROWS) GEMV32(1, ROWS) GEMV32(2, ROWS) GEMV32(3, ROWS) GEMV32(4, ROWS)
GEMV32_T(1)
GEMV32_T(2)
GEMV32_T(4)
GEMV32(5, 2) GEMV32(6, 2) GEMV32(7, 2) GEMV32(8, 2)
GEMV32(5, 4) GEMV32(6, 4) GEMV32(7, 4) GEMV32(8, 4)
