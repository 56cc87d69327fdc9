// SM120 (Blackwell consumer / workstation: RTX 50-series) native block-scaled FP4 MMA for the prefill GEMM of NVFP4
// weights (issue 21; docs/cuda.md, "SM120 native MMA (issue 21): compiled, not run"). COMPILED ONLY: no SM120 GPU
// has run this file. The host side (lumen_cuda/sm120.py) compiles it with NVRTC for -arch=sm_120a (never through
// kernels.module, whose CuPy call appends the plain device arch) and launches it only on a 12.x device with
// LUMEN_CUDA_SM120_MMA set.
//
// y (T, N) f32 = x (T, K) . W (N, K)^T where W is NVFP4 (e2m1 codes x e4m3 block scale per 16 x f32 global scale gw)
// and x is quantized here to `terms` NVFP4 planes: x ~ q_1 + q_2 + ..., q_j = NVFP4(x - q_1 - ... - q_{j-1}) with
// its own per-token f32 scale gx_j (1 term = the usual W4A4; each further term quantizes the previous residual and
// costs one more MMA per weight tile). Each plane runs through
//   mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3
// (A = 16 weight rows x 64 k, B = 64 k x 8 tokens, one ue4m3 scale per row / column and 16 k), into its own f32
// accumulators; the epilogue writes y = (sum_j acc_j * gx_j[token]) * gw.
//
// Layouts (lumen_cuda/sm120_layout.py packs them and models them on the CPU; the PTX ISA's fragment tables for
// m16n8k64 with 4-bit types: lane = 4 * g + t, g = lane >> 2, t = lane & 3, eight e2m1 per 32-bit register, the
// lowest k in the low nibble):
//   wq: (N/16, K/64, 32 lanes, 16 bytes): lane's a0..a3 = row g, k 8t..8t+7 | row g+8, same k | row g, k 32+8t.. |
//       row g+8, k 32+8t..; one 16-byte load per lane and tile.
//   ws: (N/16, K/64, 16 slots, 4 bytes): slot 2 g + h holds row g + 8 h's four ue4m3 scales (k blocks 0..3 of the
//       tile, byte i = k 16i..16i+15); lane reads slot 2 (lane >> 2) + (lane & 1) (thread-id-a 0 reads the lanes with
//       lane % 4 < 2; lanes 2 and 3 of a quad hold copies).
//   xq: (terms, T/8, K/64, 32 lanes, 8 bytes): b0 = token g, k 8t..8t+7; b1 = token g, k 32+8t..
//   xs: (terms, T/8, K/64, 8 tokens, 4 bytes): lane reads token lane >> 2's four scales (thread-id-b 0).
//   gx: (terms, Tp) f32, Tp = T rounded up to 8.
// N, K, T are padded (zero codes, zero scales) to 16, 64 and 8 by the host; y is written only inside (T, N).
//
// No headers: compiles under NVRTC and nvcc alike. On any arch other than sm_120a/f, sm_121a/f the GEMM's body is
// compiled out and traps (the host never launches it there); the quantizer is plain CUDA and compiles everywhere.

// nvcc 13 / NVRTC define __CUDA_ARCH_FEAT_SM120_ALL for sm_120a and __CUDA_ARCH_FAMILY_SPECIFIC__ (1200 for sm_120a
// and sm_120f, 1210 for sm_121a / sm_121f); plain sm_120 defines neither (checked with nvcc 13.0).
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && \
    (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1200 || __CUDA_ARCH_FAMILY_SPECIFIC__ == 1210))
#define LUMEN_SM120_MMA 1
#else
#define LUMEN_SM120_MMA 0
#endif

// 1 where this module was compiled with the block-scaled MMA (sm_120a / sm_120f), else 0: the host checks it once
// before the first launch, so a module built for the wrong arch is refused instead of trapping.
extern "C" __global__ void sm120_native(int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = LUMEN_SM120_MMA;
}

// ---- the activation quantizer (any arch) ----------------------------------------------------------------------
// e4m3fn byte -> f32 (positive codes only are produced here).
__device__ __forceinline__ float e4m3_value(unsigned int b) {
  const unsigned int e = (b >> 3) & 15u, m = b & 7u;
  if (e == 0u) return (float)m * 0.001953125f;       // m / 8 * 2^-6
  return __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e - 7)
}

// f32 x >= 0 (finite) -> the nearest e4m3fn code, ties to even, saturated to 448 (0x7e). The bit arithmetic of
// sm120_layout.e4m3_rne.
__device__ __forceinline__ unsigned int e4m3_rne(float x) {
  if (!(x > 0.0f)) return 0u;
  if (x >= 448.0f) return 0x7eu;
  if (x < 0.015625f) {  // below 2^-6: multiples of 2^-9 (code = m, 8 -> 0x08 = 2^-6)
    return (unsigned int)__float2int_rn(__fmul_rn(x, 512.0f));
  }
  const unsigned int u = __float_as_uint(x);
  unsigned int e = (u >> 23) - 120u;  // biased e4m3 exponent, 1..15
  unsigned int m = (u >> 20) & 7u;
  const unsigned int rest = u & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (m & 1u))) {
    if (++m == 8u) { m = 0u; ++e; }
  }
  const unsigned int code = (e << 3) | m;
  return code > 0x7eu ? 0x7eu : code;
}

// f32 -> e2m1 code (sign << 3 | index of 0, .5, 1, 1.5, 2, 3, 4, 6), nearest, ties to the even index, saturated.
__device__ __forceinline__ unsigned int e2m1_rne(float v) {
  const float a = fabsf(v);
  unsigned int i;
  if (a <= 0.25f) i = 0u;
  else if (a < 0.75f) i = 1u;
  else if (a <= 1.25f) i = 2u;
  else if (a < 1.75f) i = 3u;
  else if (a <= 2.5f) i = 4u;
  else if (a < 3.5f) i = 5u;
  else if (a <= 5.0f) i = 6u;
  else i = 7u;
  return (v < 0.0f ? 8u : 0u) | i;
}

__device__ __forceinline__ float e2m1_value(unsigned int code) {
  const unsigned int i = code & 7u;
  const float mag = i < 4u ? (float)i * 0.5f : (float)((2u + (i & 1u)) << ((i >> 1) - 2u));
  return (code & 8u) ? -mag : mag;
}

// One group of 16 residual values r -> e2m1 codes (8 bytes, element 2i in the low nibble of byte i) and the e4m3
// block scale code, for the plane's per-token scale gx; r is replaced by r - dequant (the next plane's residual).
// Order of operations (f32, round to nearest, no contraction) as sm120_layout.quantize_group:
//   s = e4m3(amax16 / (gx * 6)), d = s * gx, code = e2m1(r / d), r -= (e2m1 * s) * gx.
__device__ __forceinline__ void quant_group(float (&r)[16], float gx, unsigned int (&codes)[2], unsigned int& sc) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(r[i]));
  sc = gx > 0.0f ? e4m3_rne(__fdiv_rn(amax, __fmul_rn(gx, 6.0f))) : 0u;
  const float s = e4m3_value(sc);
  const float d = __fmul_rn(s, gx);
  codes[0] = codes[1] = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const unsigned int c = d > 0.0f ? e2m1_rne(__fdiv_rn(r[i], d)) : 0u;
    codes[i >> 3] |= c << (4 * (i & 7));
    r[i] = __fsub_rn(r[i], __fmul_rn(__fmul_rn(e2m1_value(c), s), gx));
  }
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();  // red may still be read from the previous call
  if (l == 0) red[w] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
  if (w == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (l == 0) red[0] = v;
  }
  __syncthreads();
  return red[0];
}

// x (T, K) f32 -> `terms` NVFP4 planes in the B-fragment layout above. One block per token (grid T, 256 threads),
// K % 16 == 0; xq / xs zeroed by the host beforehand (padding stays zero). gx_j = amax_j / (6 * 448), amax_j over the
// token's residual of plane j; a token with a non-finite value gets gx = NaN in every plane (so its outputs are NaN,
// as the generic path's would be), an all-zero residual gx = 0 (zero codes and scales).
extern "C" __global__ void sm120_quantize_x(const float* __restrict__ x, unsigned int* __restrict__ xq,
                                            unsigned char* __restrict__ xs, float* __restrict__ gx, int T, int K,
                                            int Tp, int KT, int terms) {
  __shared__ float red[32];
  __shared__ float gxs[4];
  const int t = blockIdx.x;
  if (t >= T) return;
  const float* row = x + (long long)t * K;
  const int groups = K / 16;
  float bad = 0.0f;
  for (int j = 0; j < terms; ++j) {  // gx of plane j: the residual after planes 0..j-1, recomputed per group
    float amax = 0.0f;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      float r[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) r[i] = row[g * 16 + i];
      if (j == 0) {
#pragma unroll
        for (int i = 0; i < 16; ++i) bad = fabsf(r[i]) <= 3.402823466e38f ? bad : 1.0f;
      }
      for (int p = 0; p < j; ++p) {
        unsigned int c[2], s;
        quant_group(r, gxs[p], c, s);
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(r[i]));
    }
    amax = block_max(amax, red);
    if (threadIdx.x == 0) gxs[j] = __fdiv_rn(amax, 2688.0f);
    if (j == 0) bad = block_max(bad, red);
    __syncthreads();
  }
  const int tt = t >> 3, col = t & 7;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    float r[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) r[i] = row[g * 16 + i];
    const int kt = g >> 2, kk = (g & 3) * 16;  // 16 k values kk..kk+15 of the tile: two lanes, one register each
    const int half = kk >> 5, t4 = (kk & 31) >> 3;
    for (int j = 0; j < terms; ++j) {
      unsigned int c[2], s;
      quant_group(r, gxs[j], c, s);
      const long long tile = ((long long)j * (Tp >> 3) + tt) * KT + kt;
      xq[tile * 64 + (col * 4 + t4) * 2 + half] = c[0];
      xq[tile * 64 + (col * 4 + t4 + 1) * 2 + half] = c[1];
      xs[tile * 32 + col * 4 + (g & 3)] = (unsigned char)s;
    }
  }
  if (threadIdx.x < terms) gx[threadIdx.x * Tp + t] = bad > 0.0f ? __uint_as_float(0x7fc00000u) : gxs[threadIdx.x];
}

// ---- the GEMM (sm_120a / sm_120f only) ------------------------------------------------------------------------
__device__ __forceinline__ void mma_nvf4(float (&d)[4], const uint4& a, unsigned int b0, unsigned int b1,
                                         unsigned int sfa, unsigned int sfb) {
#if LUMEN_SM120_MMA
  asm volatile(
      "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, %10, {%11, %12}, %13, {%14, %15};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1), "r"(sfa), "h"((unsigned short)0),
        "h"((unsigned short)0), "r"(sfb), "h"((unsigned short)0), "h"((unsigned short)0));
#endif
}

#ifndef SM120_WARPS
#define SM120_WARPS 4  // warps per block, one 16-row weight tile each
#endif
#define SM120_TOKEN_TILES 4  // 8-token tiles per block

// One block: SM120_WARPS x 16 weight rows x 32 tokens; grid (ceil(N16 / 16 / SM120_WARPS), ceil(Tp / 32)).
// Each warp walks K in 64-column tiles: one 16-byte weight fragment and its scales, then per token tile and plane
// one 8-byte activation fragment, its scales and one MMA. No shared memory: the block's warps read the same
// activation fragments, from L1. A first version, untuned and never run.
template <int TERMS>
__device__ __forceinline__ void gemm_nvfp4(const uint4* __restrict__ wq, const unsigned int* __restrict__ ws,
                                           const uint2* __restrict__ xq, const unsigned int* __restrict__ xs,
                                           const float* __restrict__ gx, float* __restrict__ y, int N, int T,
                                           int NT, int KT, int Tp, float gw) {
#if LUMEN_SM120_MMA
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nt = blockIdx.x * SM120_WARPS + warp;
  if (nt >= NT) return;  // whole warps only: mma.sync needs all 32 lanes
  const int TT = Tp >> 3, tt0 = blockIdx.y * SM120_TOKEN_TILES;
  float acc[TERMS][SM120_TOKEN_TILES][4];
#pragma unroll
  for (int j = 0; j < TERMS; ++j)
#pragma unroll
    for (int i = 0; i < SM120_TOKEN_TILES; ++i) acc[j][i][0] = acc[j][i][1] = acc[j][i][2] = acc[j][i][3] = 0.0f;
  const int slot = (lane >> 2) * 2 + (lane & 1);
  for (int kt = 0; kt < KT; ++kt) {
    const long long wt = (long long)nt * KT + kt;
    const uint4 a = wq[wt * 32 + lane];
    const unsigned int sfa = ws[wt * 16 + slot];
#pragma unroll
    for (int i = 0; i < SM120_TOKEN_TILES; ++i) {
      const int tt = tt0 + i;
      if (tt < TT) {  // uniform over the warp
#pragma unroll
        for (int j = 0; j < TERMS; ++j) {
          const long long xt = ((long long)j * TT + tt) * KT + kt;
          const uint2 b = xq[xt * 32 + lane];
          const unsigned int sfb = xs[xt * 8 + (lane >> 2)];
          mma_nvf4(acc[j][i], a, b.x, b.y, sfa, sfb);
        }
      }
    }
  }
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < SM120_TOKEN_TILES; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // d0: (row g, token 2t), d1: (g, 2t+1), d2: (g+8, 2t), d3: (g+8, 2t+1)
      const int row = nt * 16 + g + 8 * (c >> 1), tok = (tt0 + i) * 8 + 2 * t4 + (c & 1);
      if (row < N && tok < T) {
        float v = __fmul_rn(acc[0][i][c], gx[tok]);
#pragma unroll
        for (int j = 1; j < TERMS; ++j) v = __fadd_rn(v, __fmul_rn(acc[j][i][c], gx[j * Tp + tok]));
        y[(long long)tok * N + row] = __fmul_rn(v, gw);
      }
    }
  }
#else
  __trap();  // compiled for another arch: never launched there (sm120.available)
#endif
}

#define SM120_GEMM(TERMS)                                                                                       \
  extern "C" __global__ void __launch_bounds__(SM120_WARPS * 32) sm120_gemm_nvfp4_t##TERMS(                     \
      const uint4* __restrict__ wq, const unsigned int* __restrict__ ws, const uint2* __restrict__ xq,          \
      const unsigned int* __restrict__ xs, const float* __restrict__ gx, float* __restrict__ y, int N, int T,   \
      int NT, int KT, int Tp, float gw) {                                                                       \
    gemm_nvfp4<TERMS>(wq, ws, xq, xs, gx, y, N, T, NT, KT, Tp, gw);                                             \
  }
SM120_GEMM(1)
SM120_GEMM(2)
SM120_GEMM(3)
