// Batch-1 decode attention over a KV cache, split-K ("flash-decoding"), graph-capturable: the token position is
// read from device memory (pos[0]); nothing about the launch depends on it.
//
// Cache: K (Hkv, ctx, D), V (Hkv, ctx, Dv), C-contiguous, each f32, f16, bf16 bits (the high half of an f32) or
// fp8 E4M3 bytes (no scale; written round-to-nearest-even, saturating at +-448, as lumen_cpu.attention.store).
// q (Hq, D), k_new (Hkv, D), v_new (Hkv, Dv): f32 contiguous. D, Dv multiples of 4, <= 512 (the launcher checks).
//
// attn_split_k<KT>_v<VT>: grid (nsplit, Hkv, ceil(G / ATTN_GM)), ATTN_NT threads, where G = Hq / Hkv and
// nsplit = ceil(ctx / chunk). Block (s, h, z) owns cache positions [s*chunk, (s+1)*chunk) of kv head h and up to
// ATTN_GM query heads h*G + z*ATTN_GM + (0..ATTN_GM) (GQA: K/V are read once for the whole group).
//   1. The block whose range holds slot (= pos, or pos % ctx for a ring cache, where pos = min(pos, ctx - 1) and
//      window = 0 are passed) encodes k_new[h], v_new[h] into that slot (bf16 round-to-nearest-even as
//      attention.encode, f16 cvt.rn) and __syncthreads(); every z-block of that (s, h) writes the same bits.
//      The cache is then read back with ordinary (coherent) loads, so the new key is rounded through the cache
//      type as the CuPy op does.
//   2. Positions outside [lo, pos] (lo = max(0, pos - window + 1), or 0) are skipped; a block with none writes
//      max = -inf, sum = 0 and returns.
//   3. Scores: each warp takes 8 keys at a time with the head dim split over its lanes (4 elements a lane per
//      128), the 8 keys x 8 heads partial dots reduced across the warp together; (q . key) * scale, optionally
//      tanh(s / softcap) * softcap, into shared memory.
//   4. Per head: max m and exp(s - m) (one warp per head), sum l.
//   5. Values, per slab of 128 columns (4 a lane): each warp accumulates its keys (8 rows loaded at a time),
//      the 4 warp partials are summed in warp order through shared memory. o_part[s, hq] = sum_t exp(s_t - m)
//      v_t (not normalised).
// attn_split_multi / kv_store (a speculative verify of T tokens, one full cache): kv_store writes the T rows,
//   then attn_split_multi attends query t up to pos[t] (grid z over t and head groups; nothing written) and
//   attn_combine_batch combines per (head, t): the bits of T attn_split + attn_combine calls in order.
// attn_combine: grid (Hq,), ATTN_NT threads: log-sum-exp over the splits that intersect [lo, pos] (read from
//   pos, so idle splits are never read): out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
//
// Dynamic shared memory (floats): split: gm * (D + chunk + 4 * 128), gm = min(ATTN_GM, G);
// combine: nsplit.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#include "pdl.cuh"

#define ATTN_GM 8    // query heads per block
#define ATTN_NT 128  // threads per block (both kernels)
#define ATTN_NW (ATTN_NT / 32)
#define ATTN_KU 8    // keys per warp step (ATTN_KU * ATTN_GM = 64 partial dots, reduced together)

#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_FP8 3

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float bf2f(unsigned int b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {  // round to nearest even, as attention.encode
  const unsigned int u = __float_as_uint(f);
  return (unsigned short)((u + (((u >> 16) & 1u) + 0x7fffu)) >> 16);
}

// f32 -> E4M3 byte, round to nearest even, saturating at +-448 (NaN stays NaN): integer arithmetic only, so it
// builds for every architecture (the cvt.satfinite.e4m3x2 instruction needs sm_89).
__device__ __forceinline__ unsigned char f2e4m3(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 24) & 0x80u;
  if (f != f) return (unsigned char)(0x7fu | sign);
  const float a = fminf(fabsf(f), 448.f);
  if (a < 0.015625f) return (unsigned char)(__float2int_rn(a * 512.f) | sign);  // subnormals (and 2^-6)
  const unsigned int ua = __float_as_uint(a);
  const unsigned int r = (ua + 0x7ffffu + ((ua >> 20) & 1u)) >> 20;  // f32 exponent and 3 mantissa bits, rounded
  return (unsigned char)((r - (120u << 3)) | sign);
}
// E4M3 byte -> f32, exact: exponent and mantissa moved into an f32 with the exponent rebased, subnormals fixed up.
__device__ __forceinline__ float e4m32f(unsigned int b) {
  if ((b & 0x7fu) == 0x7fu) return __int_as_float(0x7fc00000);  // NaN codes
  float v = __uint_as_float(((b & 0x7fu) << 20) + 0x3c000000u);
  if ((b & 0x78u) == 0) v = (v - 0.0078125f) * 2.f;
  return (b & 0x80u) ? -v : v;
}

// Store one f32 as element i of a cache row of type T.
template <int T>
__device__ __forceinline__ void store_enc(void* base, long long i, float f) {
  if (T == KV_F32) static_cast<float*>(base)[i] = f;
  else if (T == KV_F16) static_cast<unsigned short*>(base)[i] = f2h(f);
  else if (T == KV_FP8) static_cast<unsigned char*>(base)[i] = f2e4m3(f);
  else static_cast<unsigned short*>(base)[i] = f2bf(f);
}

// Elements i..i+3 (i % 4 == 0) of a cache of type T as floats. Plain loads: the block may have just written them.
template <int T>
__device__ __forceinline__ void load4(const void* base, long long i, float* o) {
  if (T == KV_F32) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  } else if (T == KV_FP8) {
    const unsigned int v = *reinterpret_cast<const unsigned int*>(static_cast<const unsigned char*>(base) + i);
    o[0] = e4m32f(v & 0xffu); o[1] = e4m32f((v >> 8) & 0xffu);
    o[2] = e4m32f((v >> 16) & 0xffu); o[3] = e4m32f(v >> 24);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(base) + i);
    if (T == KV_F16) {
      o[0] = h2f((unsigned short)(v.x & 0xffffu)); o[1] = h2f((unsigned short)(v.x >> 16));
      o[2] = h2f((unsigned short)(v.y & 0xffffu)); o[3] = h2f((unsigned short)(v.y >> 16));
    } else {
      o[0] = bf2f(v.x & 0xffffu); o[1] = __uint_as_float(v.x & 0xffff0000u);
      o[2] = bf2f(v.y & 0xffffu); o[3] = __uint_as_float(v.y & 0xffff0000u);
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One step of a warp-wide reduction of 2 HALF values per lane: lanes with bit OFF set keep the upper half, the
// others the lower, each adding its partner's copy of the half it keeps.
template <int HALF, int OFF>
__device__ __forceinline__ void exchange_half(float* part, int lane) {
  const bool upper = (lane & OFF) != 0;
#pragma unroll
  for (int j = 0; j < HALF; ++j) {
    const float send = upper ? part[j] : part[j + HALF];
    const float keep = upper ? part[j + HALF] : part[j];
    part[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
  }
}

template <int KT, int VT>
__device__ __forceinline__ void attn_split(const float* __restrict__ q,     // (Hq, D)
                                           const float* __restrict__ kn,    // (Hkv, D) the new key
                                           const float* __restrict__ vn,    // (Hkv, Dv) the new value
                                           void* kc,                        // (Hkv, ctx, D) cache
                                           void* vc,                        // (Hkv, ctx, Dv) cache
                                           const int* __restrict__ pos_p,   // (1,) the last position attended
                                           const int* __restrict__ slot_p,  // (1,) the slot the new k, v go to
                                           float* __restrict__ o_part,      // (nsplit, Hq, Dv)
                                           float* __restrict__ ml_part,     // (nsplit, Hq, 2): max, sum
                                           int ctx, int D, int Dv, int Hq, int G, int chunk, float scale,
                                           float softcap, int window, int zb, float* smem) {
  const int s = blockIdx.x, h = blockIdx.y, g0 = zb * ATTN_GM;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ng = min(ATTN_GM, G - g0);
  const int hq0 = h * G + g0;
  const int pos = *pos_p;
  const int lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int t0 = s * chunk, t1 = min(t0 + chunk, ctx);

  // 1. write the new key / value into its slot (pos for a full cache, pos % ctx for a ring; kn null: no write,
  //    a layer reading another layer's cache)
  const int slot = *slot_p;
  if (kn != nullptr && slot >= t0 && slot < t1) {
    const long long kb = ((long long)h * ctx + slot) * D, vb = ((long long)h * ctx + slot) * Dv;
    for (int i = tid; i < D; i += ATTN_NT) store_enc<KT>(kc, kb + i, kn[(long long)h * D + i]);
    for (int i = tid; i < Dv; i += ATTN_NT) store_enc<VT>(vc, vb + i, vn[(long long)h * Dv + i]);
  }
  __syncthreads();

  // 2. the positions of this split to attend over
  const int a = max(t0, lo), b = min(t1, pos + 1);
  if (a >= b) {
    if (tid < ng) {
      ml_part[((long long)s * Hq + hq0 + tid) * 2] = neg_inf();
      ml_part[((long long)s * Hq + hq0 + tid) * 2 + 1] = 0.f;
    }
    return;  // block-uniform
  }
  const int n = b - a;
  const int gm = min(ATTN_GM, G);  // heads per block as sized by the launcher
  float* qs = smem;                // (gm, D) queries
  float* sc = smem + gm * D;       // (gm, chunk) scores, then probabilities
  float* red = sc + gm * chunk;    // (ATTN_NW, gm, 128) value partials of one column slab

  for (int i = tid; i < ng * D; i += ATTN_NT) qs[i] = q[(long long)hq0 * D + i];
  __syncthreads();

  // 3. scores: each warp takes ATTN_KU keys at a time, lanes split the head dim (lane owns d = 4 lane + 128 i),
  //    all ATTN_KU rows loaded before any FMA; the ATTN_KU x ATTN_GM partial dots are reduced across the warp by
  //    a halving exchange (62 shuffles for 64 values), after which lane L holds values 2L and 2L + 1, i.e. key
  //    u = L / 4 and heads 2 (L % 4) + {0, 1}.
  for (int base = warp * ATTN_KU; base < n; base += ATTN_NW * ATTN_KU) {
    float part[ATTN_KU * ATTN_GM];
#pragma unroll
    for (int j = 0; j < ATTN_KU * ATTN_GM; ++j) part[j] = 0.f;
    for (int d = 4 * lane; d < D; d += 128) {
      float kv[ATTN_KU][4];
#pragma unroll
      for (int u = 0; u < ATTN_KU; ++u) {
        if (base + u < n) load4<KT>(kc, ((long long)h * ctx + a + base + u) * D + d, kv[u]);
        else kv[u][0] = kv[u][1] = kv[u][2] = kv[u][3] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < ATTN_GM; ++g) {
        if (g < ng) {
          const float4 qv = *reinterpret_cast<const float4*>(qs + g * D + d);
#pragma unroll
          for (int u = 0; u < ATTN_KU; ++u) {
            float v = part[u * ATTN_GM + g];
            v = fmaf(qv.x, kv[u][0], v);
            v = fmaf(qv.y, kv[u][1], v);
            v = fmaf(qv.z, kv[u][2], v);
            v = fmaf(qv.w, kv[u][3], v);
            part[u * ATTN_GM + g] = v;
          }
        }
      }
    }
    exchange_half<32, 16>(part, lane);
    exchange_half<16, 8>(part, lane);
    exchange_half<8, 4>(part, lane);
    exchange_half<4, 2>(part, lane);
    exchange_half<2, 1>(part, lane);
    const int u = lane >> 2, t = base + u;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int g = 2 * (lane & 3) + j;
      if (g < ng && t < n) {
        float v = part[j] * scale;
        if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
        sc[g * chunk + t] = v;
      }
    }
  }
  __syncthreads();

  // 4. softmax pieces, one warp per head
  for (int g = warp; g < ng; g += ATTN_NW) {
    float* row = sc + g * chunk;
    float m = neg_inf();
    for (int t = lane; t < n; t += 32) m = fmaxf(m, row[t]);
    m = warp_max(m);
    float l = 0.f;
    for (int t = lane; t < n; t += 32) {
      const float p = expf(row[t] - m);
      row[t] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) {
      ml_part[((long long)s * Hq + hq0 + g) * 2] = m;
      ml_part[((long long)s * Hq + hq0 + g) * 2 + 1] = l;
    }
  }
  __syncthreads();

  // 5. values, per slab of 128 columns (lane owns 4 of them): each warp sums its keys (ATTN_KU rows loaded
  //    before the FMAs), then the ATTN_NW warp partials are added in warp order through shared memory.
  for (int c0 = 0; c0 < Dv; c0 += 128) {
    const int c = c0 + 4 * lane;
    float acc[ATTN_GM][4];
#pragma unroll
    for (int g = 0; g < ATTN_GM; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
    if (c < Dv) {
      for (int base = warp * ATTN_KU; base < n; base += ATTN_NW * ATTN_KU) {
        float vv[ATTN_KU][4];
#pragma unroll
        for (int u = 0; u < ATTN_KU; ++u) {
          if (base + u < n) load4<VT>(vc, ((long long)h * ctx + a + base + u) * Dv + c, vv[u]);
          else vv[u][0] = vv[u][1] = vv[u][2] = vv[u][3] = 0.f;
        }
#pragma unroll
        for (int u = 0; u < ATTN_KU; ++u) {
          if (base + u < n) {
#pragma unroll
            for (int g = 0; g < ATTN_GM; ++g) {
              if (g < ng) {
                const float p = sc[g * chunk + base + u];
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[g][i] = fmaf(p, vv[u][i], acc[g][i]);
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < ATTN_GM; ++g)
      if (g < ng)
        *reinterpret_cast<float4*>(red + (warp * gm + g) * 128 + 4 * lane) =
            make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    __syncthreads();
    const int width = min(128, Dv - c0);
    for (int i = tid; i < ng * 128; i += ATTN_NT) {
      const int g = i >> 7, j = i & 127;
      if (j < width) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_NW; ++w) v += red[(w * gm + g) * 128 + j];
        o_part[((long long)s * Hq + hq0 + g) * Dv + c0 + j] = v;
      }
    }
    __syncthreads();  // red is rewritten by the next slab
  }
}

// attn_split_k<K>_v<V>(q, k_new, v_new, K cache, V cache, pos, slot, o_part, ml_part, ctx, D, Dv, Hq, G, chunk,
//                      scale, softcap (0: none), window (0: none)); k_new = v_new = null: nothing written
#define ATTN_SPLIT(KNAME, KT, VNAME, VT)                                                                         \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) attn_split_k##KNAME##_v##VNAME(                        \
      const float* __restrict__ q, const float* __restrict__ kn, const float* __restrict__ vn, void* kc,        \
      void* vc, const int* __restrict__ pos_p, const int* __restrict__ slot_p, float* __restrict__ o_part,       \
      float* __restrict__ ml_part, int ctx, int D, int Dv, int Hq, int G, int chunk, float scale, float softcap,  \
      int window) {                                                                                              \
    pdl_begin();                                                                                                 \
    extern __shared__ float4 attn_smem4[];                                                                       \
    attn_split<KT, VT>(q, kn, vn, kc, vc, pos_p, slot_p, o_part, ml_part, ctx, D, Dv, Hq, G, chunk, scale, softcap,    \
                       window, blockIdx.z, reinterpret_cast<float*>(attn_smem4));                               \
  }                                                                                                              \
  /* B sequences at once (continuous batching): grid (nsplit, Hkv, zg * B), block z = b * zg + (head group); */  \
  /* sequence b's q, k_new, v_new rows b, caches kcs[b], vcs[b] (same ctx, types), pos_p[b], slot_p[b], and */    \
  /* partials (B, nsplit, Hq, ...) */                                                                            \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) attn_split_batch_k##KNAME##_v##VNAME(                  \
      const float* __restrict__ q, const float* __restrict__ kn, const float* __restrict__ vn,                  \
      void* const* __restrict__ kcs, void* const* __restrict__ vcs, const int* __restrict__ pos_p,               \
      const int* __restrict__ slot_p, float* __restrict__ o_part, float* __restrict__ ml_part, int ctx, int D,   \
      int Dv, int Hq, int G, int chunk, float scale, float softcap, int window, int zg) {                        \
    pdl_begin();                                                                                                 \
    extern __shared__ float4 attn_smem4[];                                                                       \
    const int b = blockIdx.z / zg, Hkv = Hq / G;                                                                 \
    const long long nsplit = gridDim.x;                                                                          \
    attn_split<KT, VT>(q + (long long)b * Hq * D, kn + (long long)b * Hkv * D, vn + (long long)b * Hkv * Dv,    \
                       kcs[b], vcs[b], pos_p + b, slot_p + b, o_part + b * nsplit * Hq * Dv,                     \
                       ml_part + b * nsplit * Hq * 2, ctx, D, Dv, Hq, G, chunk, scale, softcap, window,          \
                       blockIdx.z % zg, reinterpret_cast<float*>(attn_smem4));                                  \
  }                                                                                                              \
  /* T queries of one sequence (a speculative verify) over one full cache whose T new rows kv_store wrote */     \
  /* first: grid (nsplit, Hkv, zg * T), block z = t * zg + (head group); query t attends up to pos_p[t]; */       \
  /* nothing is written; partials (T, nsplit, Hq, ...) for attn_combine_batch */                                 \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) attn_split_multi_k##KNAME##_v##VNAME(                  \
      const float* __restrict__ q, void* kc, void* vc, const int* __restrict__ pos_p,                             \
      float* __restrict__ o_part, float* __restrict__ ml_part, int ctx, int D, int Dv, int Hq, int G, int chunk,  \
      float scale, float softcap, int window, int zg) {                                                          \
    pdl_begin();                                                                                                 \
    extern __shared__ float4 attn_smem4[];                                                                       \
    const int t = blockIdx.z / zg;                                                                               \
    const long long nsplit = gridDim.x;                                                                          \
    attn_split<KT, VT>(q + (long long)t * Hq * D, nullptr, nullptr, kc, vc, pos_p + t, pos_p + t,                \
                       o_part + t * nsplit * Hq * Dv, ml_part + t * nsplit * Hq * 2, ctx, D, Dv, Hq, G, chunk,    \
                       scale, softcap, window, blockIdx.z % zg, reinterpret_cast<float*>(attn_smem4));            \
  }                                                                                                              \
  /* kv_store_k<K>_v<V>(k (T, Hkv, D), v (T, Hkv, Dv) f32, K cache, V cache, pos (T,), ctx, Hkv, D, Dv): */       \
  /* row t goes to slot pos[t] of a full cache, encoded as attn_split encodes it; grid (T, Hkv) */                \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) kv_store_k##KNAME##_v##VNAME(                          \
      const float* __restrict__ kn, const float* __restrict__ vn, void* kc, void* vc,                            \
      const int* __restrict__ pos_p, int ctx, int Hkv, int D, int Dv) {                                          \
    pdl_begin();                                                                                                 \
    const int t = blockIdx.x, h = blockIdx.y, slot = pos_p[t];                                                   \
    const long long kb = ((long long)h * ctx + slot) * D, vb = ((long long)h * ctx + slot) * Dv;                 \
    const long long ks = ((long long)t * Hkv + h) * D, vs = ((long long)t * Hkv + h) * Dv;                       \
    for (int i = threadIdx.x; i < D; i += ATTN_NT) store_enc<KT>(kc, kb + i, kn[ks + i]);                         \
    for (int i = threadIdx.x; i < Dv; i += ATTN_NT) store_enc<VT>(vc, vb + i, vn[vs + i]);                        \
  }

#define ATTN_SPLIT_V(KNAME, KT)          \
  ATTN_SPLIT(KNAME, KT, f32, KV_F32)     \
  ATTN_SPLIT(KNAME, KT, f16, KV_F16)     \
  ATTN_SPLIT(KNAME, KT, bf16, KV_BF16)   \
  ATTN_SPLIT(KNAME, KT, fp8, KV_FP8)

ATTN_SPLIT_V(f32, KV_F32)
ATTN_SPLIT_V(f16, KV_F16)
ATTN_SPLIT_V(bf16, KV_BF16)
ATTN_SPLIT_V(fp8, KV_FP8)

// fp8 caches outside the decode step (prefill writes, reads for the prefill attention): n elements each way.
extern "C" __global__ void kv_fp8_encode(const float* __restrict__ x, unsigned char* __restrict__ y, long long n) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = f2e4m3(x[i]);
}
extern "C" __global__ void kv_fp8_decode(const unsigned char* __restrict__ x, float* __restrict__ y, long long n) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = e4m32f(x[i]);
}

// e4m3 bytes -> bf16 bits, exactly (an e4m3 value has 4 significant bits and an exponent bf16 covers): the keys and
// values of an fp8 cache for the tensor-core flash kernel (flash_mma.cu)
extern "C" __global__ void kv_fp8_bf16(const unsigned char* __restrict__ x, unsigned short* __restrict__ y,
                                       long long n) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = (unsigned short)(__float_as_uint(e4m32f(x[i])) >> 16);
}

// Combine the splits of one query head (hq): only those that intersect [lo, pos].
__device__ __forceinline__ void attn_combine_head(const float* __restrict__ o_part,   // (nsplit, Hq, Dv)
                                                  const float* __restrict__ ml_part,  // (nsplit, Hq, 2)
                                                  const int* __restrict__ pos_p,      // (1,)
                                                  float* __restrict__ out,            // (Hq, Dv)
                                                  int Hq, int Dv, int chunk, int window, int nsplit, int hq,
                                                  float* wts) {                       // (nsplit,) e^(m_s - M) / L
  const int tid = threadIdx.x;
  const int pos = *pos_p;
  const int lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int s0 = lo / chunk, s1 = min(pos / chunk, nsplit - 1);
  float M = neg_inf();
  for (int s = s0; s <= s1; ++s) M = fmaxf(M, ml_part[((long long)s * Hq + hq) * 2]);
  float L = 0.f;
  for (int s = s0; s <= s1; ++s) {
    const float m = ml_part[((long long)s * Hq + hq) * 2];
    if (m != neg_inf()) L += expf(m - M) * ml_part[((long long)s * Hq + hq) * 2 + 1];
  }
  for (int s = s0 + tid; s <= s1; s += ATTN_NT) {
    const float m = ml_part[((long long)s * Hq + hq) * 2];
    wts[s - s0] = m != neg_inf() ? expf(m - M) / L : 0.f;
  }
  __syncthreads();
  for (int j = tid; j < Dv; j += ATTN_NT) {
    float acc = 0.f;
#pragma unroll 8
    for (int s = s0; s <= s1; ++s) {  // loads unconditional (every split in s0..s1 wrote its row): pipelined
      const float w = wts[s - s0], o = o_part[((long long)s * Hq + hq) * Dv + j];
      if (w != 0.f) acc = fmaf(w, o, acc);
    }
    out[(long long)hq * Dv + j] = acc;
  }
}

extern "C" __global__ void __launch_bounds__(ATTN_NT)
    attn_combine(const float* __restrict__ o_part,   // (nsplit, Hq, Dv)
                 const float* __restrict__ ml_part,  // (nsplit, Hq, 2)
                 const int* __restrict__ pos_p,      // (1,)
                 float* __restrict__ out,            // (Hq, Dv)
                 int Hq, int Dv, int chunk, int window, int nsplit) {
  pdl_begin();
  extern __shared__ float4 comb_smem4[];
  attn_combine_head(o_part, ml_part, pos_p, out, Hq, Dv, chunk, window, nsplit, blockIdx.x,
                    reinterpret_cast<float*>(comb_smem4));
}

// B sequences: grid (Hq, B); sequence b = blockIdx.y reads partials (B, nsplit, Hq, ...), pos_p[b], writes out[b].
extern "C" __global__ void __launch_bounds__(ATTN_NT)
    attn_combine_batch(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                       const int* __restrict__ pos_p, float* __restrict__ out, int Hq, int Dv, int chunk, int window,
                       int nsplit) {
  pdl_begin();
  extern __shared__ float4 comb_smem4[];
  const long long b = blockIdx.y;
  attn_combine_head(o_part + b * nsplit * Hq * Dv, ml_part + b * nsplit * Hq * 2, pos_p + b, out + b * Hq * Dv, Hq,
                    Dv, chunk, window, nsplit, blockIdx.x, reinterpret_cast<float*>(comb_smem4));
}
