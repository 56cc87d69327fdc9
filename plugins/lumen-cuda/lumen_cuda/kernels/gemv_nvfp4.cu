// Decode GEMV for NVFP4 weights (ModelOpt layout): y (T, N) f32 = x (T, K) f32 . W^T, T = 1..4, dequantizing in
// registers (sm_90 has no FP4 MMA; at batch 1 the GEMV is bandwidth-bound either way).
//
// W: packed E2M1 codes (N, K/2) bytes, element 2j in the low nibble and 2j+1 in the high one (code = sign << 3 |
// magnitude index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}); S: e4m3 block scales (N, K/16) bytes; G: the f32 global
// scale. Value = e2m1 x S[n, k/16] x G. Alignment: K % 32 == 0, W 16-byte aligned (gemv.py checks).
//
// One warp owns ROWS consecutive rows; per step each lane reads 16 bytes (32 values, two scale blocks) of each
// row, decodes the nibbles through a 16-entry table in shared memory (distinct entries sit in distinct banks),
// dots each 16-value block with x in f32 and adds it times the block scale; the global scale multiplies the
// row sum at the end. Grid: ceil(N / (ROWS * GEMV_WARPS)) blocks of GEMV_WARPS * 32 threads.

#include "pdl.cuh"

#include <cuda_fp8.h>

#ifndef GEMV_WARPS
#define GEMV_WARPS 4
#endif
#define GEMV_U 2

__device__ __forceinline__ uint4 ld_stream16_fp4(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float e4m3_to_f32(unsigned char b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
  return __half2float(__half(h));
}

template <int T, int ROWS>
__device__ __forceinline__ void gemv_e2m1(const unsigned char* __restrict__ W,  // (N, K/2) packed
                                          const unsigned char* __restrict__ S,  // (N, K/16) e4m3
                                          const float* __restrict__ x,          // (T, K) f32
                                          float* __restrict__ y,                // (T, N) f32
                                          int N, int K, float G) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) {
    const int m = threadIdx.x & 7;
    const float mag = m < 2 ? 0.5f * m : (1.0f + 0.5f * (m & 1)) * (float)(1 << ((m >> 1) - 1));
    lut[threadIdx.x] = threadIdx.x & 8 ? -mag : mag;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= N) return;  // warp-uniform (after the only __syncthreads)
  float acc[T][ROWS];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;

  const unsigned char* wrow[ROWS];
  const unsigned char* srow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {  // the ragged last warp re-reads row N-1 for its missing rows, never writes them
    const int row = min(row0 + r, N - 1);
    wrow[r] = W + (long long)row * (K / 2);
    srow[r] = S + (long long)row * (K / 16);
  }

  constexpr int STEP = 32 * 32;  // values per warp step (16 bytes = 32 values per lane)
  for (int k0 = lane * 32; k0 < K; k0 += STEP * GEMV_U) {
    uint4 wv[GEMV_U][ROWS];
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u) {
      const int k = k0 + u * STEP;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) wv[u][r] = k < K ? ld_stream16_fp4(wrow[r] + k / 2) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u) {
      const int k = k0 + u * STEP;
      if (k < K) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // two 16-value scale blocks per load
          float xv[T][16];
#pragma unroll
          for (int t = 0; t < T; ++t) {
            const float4* p = reinterpret_cast<const float4*>(x + (long long)t * K + k + 16 * half);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float4 a = __ldg(p + i);
              xv[t][4 * i] = a.x; xv[t][4 * i + 1] = a.y; xv[t][4 * i + 2] = a.z; xv[t][4 * i + 3] = a.w;
            }
          }
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const unsigned int words[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
            const float s = e4m3_to_f32(srow[r][k / 16 + half]);
            float w[16];
#pragma unroll
            for (int i = 0; i < 2; ++i) {  // 2 words = 8 bytes = 16 values
              const unsigned int word = words[2 * half + i];
#pragma unroll
              for (int b = 0; b < 8; ++b) w[8 * i + b] = lut[(word >> (4 * b)) & 15u];
            }
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
        if (row0 + r < N) y[(long long)t * N + row0 + r] = acc[t][r] * G;
  }
}

// gemv_nvfp4_t<T>_r<ROWS>(W (N, K/2), S (N, K/16), x (T, K) f32, y (T, N) f32, N, K, G)
#define GEMV4(T, ROWS)                                                                                        \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                               \
      gemv_nvfp4_t##T##_r##ROWS(const unsigned char* __restrict__ W, const unsigned char* __restrict__ S,      \
                                const float* __restrict__ x, float* __restrict__ y, int N, int K, float G) {   \
    pdl_prefetch_rows(W, K / 2, (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * ROWS, ROWS, N);               \
    pdl_begin();                                                                                               \
    gemv_e2m1<T, ROWS>(W, S, x, y, N, K, G);                                                                   \
  }

#define GEMV4_T(ROWS) GEMV4(1, ROWS) GEMV4(2, ROWS) GEMV4(3, ROWS) GEMV4(4, ROWS)

GEMV4_T(1)
GEMV4_T(2)
GEMV4_T(4)
GEMV4(5, 2) GEMV4(6, 2) GEMV4(7, 2) GEMV4(8, 2)  // 5..8 tokens (a speculative verify)
GEMV4(5, 4) GEMV4(6, 4) GEMV4(7, 4) GEMV4(8, 4)
