// Mixture-of-experts kernels (launched from moe.py): routing (softmax + top-k) and the routed experts'
// SwiGLU / GeGLU MLP for T tokens, entirely on the device. Expert ids are read from device memory inside the
// kernels and every launch configuration depends only on shapes (E, k, H, I), never on the routing, so a
// decode step that contains them can be captured once as a CUDA graph and replayed with new ids.
//
// moe_route_f32: one block per token row. softmax over E (max-subtracted, expf, IEEE division: the same
//   arithmetic as ops.moe_route), then k rounds of a block-wide arg-max on (p descending, index ascending)
//   (= the stable argsort of -p), then the k weights renormalised (sequential sum in slot order).
//
// Experts, x (T, H) f32; ids (T, k) int32/int64 and weights (T, k) f32 on the device; slot s = t * k + j:
//   small T, per slot: moe_gate_up_*: grid (ceil(I / (ROWS * MOE_WARPS)), min(T k, 65535)). Block y loops over
//     slots s = y, y + gridDim.y, ..., reads e = ids[s] and x row s / k; each warp owns ROWS rows of that
//     expert's gate and up matrices (2*ROWS row streams, 16-byte loads, U steps in flight), shuffle-reduces and
//     writes h[s, i] = act(gate_i . x) * (up_i . x) into the (T k, I) f32 scratch.
//     moe_down_*: grid (ceil(H / (ROWS * MOE_WARPS)), min(T, 65535)). Each warp owns ROWS output rows n of a
//     token t and loops over its k slots in order: out[t, n] = sum_j weights[t, j] * (down_{ids[t, j]}[n, :] .
//     h[t k + j, :]). Deterministic, no atomics.
//   larger T, grouped: moe_bucket sorts the slots by expert; moe_gate_up_g_* / moe_down_g_* run per (row block,
//     expert), MOE_NT slots of that expert per weight load, into h (T k, I) and ys (T k, H); moe_combine sums
//     weights[t, j] * ys[t k + j] over j in order.
//   Weights per expert come from a pointer table (uint64 (.., E): data pointers, and for fp8 the scale
//   pointers) or, for the packed layout (E, 2I, H) / (E, H, I), from the base pointer plus e times the
//   expert's stride. An id outside [0, E) contributes nothing (h row zero, slot skipped).
//
// Formats (template FMT): 0 bf16 bits, 1 f16, 2 f32, 3 fp8 e4m3 with f32 block scales in the HF
// weight_scale_inv layout (S[row / BR, col / BC], SK scale columns; per-channel / per-tensor expressed as
// BR = 1 / N and BC covering every column, as gemv.fp8_block does).
// Alignment (moe.py checks, else the CuPy fallback): every 16-byte load lies inside a row: K % VEC == 0
// (VEC = 8 bf16/f16, 4 f32, 16 fp8; K = H for gate/up, I for down), BC % 16 == 0 for fp8, and all weight
// rows, x and the scratch 16-byte aligned.

#include <cuda_fp8.h>

#ifndef MOE_WARPS
#define MOE_WARPS 4
#endif
#define MOE_U 2
#define ROUTE_THREADS 256
#define ROUTE_MAX_E 1024
#define ROUTE_MAX_K 32

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float f16_to_f32(unsigned int h) {
  float f;
  unsigned short s = (unsigned short)h;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
  return f;
}

// -- routing ----------------------------------------------------------------------------------------------------
__device__ __forceinline__ float block_reduce(float v, bool is_max, float* red /* (ROUTE_THREADS / 32,) */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  __syncthreads();  // red may still be read from the previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < ROUTE_THREADS / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;  // the same value (same order) in every thread
}

// (v, i) beats (bv, bi): larger probability, then the lower expert index.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// moe_route_f32(logits (T, E) f32, weights (T, k) f32, ids (T, k) int64, E, k, normalize); grid T, block 256.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route_f32(const float* __restrict__ logits, float* __restrict__ w_out, long long* __restrict__ ids_out,
                  int E, int k, int normalize) {
  __shared__ float p[ROUTE_MAX_E];
  __shared__ float red[ROUTE_THREADS / 32];
  __shared__ float red_v[ROUTE_THREADS / 32];
  __shared__ int red_i[ROUTE_THREADS / 32];
  __shared__ float sel[ROUTE_MAX_K];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row = logits + (long long)blockIdx.x * E;

  float m = __uint_as_float(0xff800000u);  // -inf (no INFINITY macro under NVRTC without <cmath>)
  for (int i = tid; i < E; i += ROUTE_THREADS) m = fmaxf(m, row[i]);
  m = block_reduce(m, true, red);
  float s = 0.f;
  for (int i = tid; i < E; i += ROUTE_THREADS) {
    const float ex = expf(row[i] - m);
    p[i] = ex;
    s += ex;
  }
  s = block_reduce(s, false, red);
  for (int i = tid; i < E; i += ROUTE_THREADS) p[i] = p[i] / s;  // each thread rewrites only its own entries
  __syncthreads();

  for (int j = 0; j < k; ++j) {
    float bv = -1.f;  // probabilities are >= 0; taken entries are set to -1
    int bi = 0x7fffffff;
    for (int i = tid; i < E; i += ROUTE_THREADS)
      if (p[i] > bv) { bv = p[i]; bi = i; }  // i ascends: the first of equal values stays
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { red_v[warp] = bv; red_i[warp] = bi; }
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < ROUTE_THREADS / 32; ++w)
        if (beats(red_v[w], red_i[w], bv, bi)) { bv = red_v[w]; bi = red_i[w]; }
      const bool found = bi < E;  // always, unless the row holds NaN
      sel[j] = found ? bv : 0.f;
      ids_out[(long long)blockIdx.x * k + j] = found ? bi : -1;  // -1: an id the expert kernels skip
      if (found) p[bi] = -1.f;
    }
    __syncthreads();
  }
  if (tid == 0) {
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += sel[j];
    for (int j = 0; j < k; ++j) w_out[(long long)blockIdx.x * k + j] = normalize ? sel[j] / sum : sel[j];
  }
}

// -- expert GEMVs -----------------------------------------------------------------------------------------------
template <int FMT> struct Fmt;
template <> struct Fmt<0> { static constexpr int VEC = 8, ES = 2; };   // bf16 bits
template <> struct Fmt<1> { static constexpr int VEC = 8, ES = 2; };   // f16
template <> struct Fmt<2> { static constexpr int VEC = 4, ES = 4; };   // f32
template <> struct Fmt<3> { static constexpr int VEC = 16, ES = 1; };  // fp8 e4m3

// One 16-byte load -> VEC floats.
template <int FMT>
__device__ __forceinline__ void unpack(const uint4 v, float* w) {
  const unsigned int u[4] = {v.x, v.y, v.z, v.w};
  if (FMT == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = __uint_as_float(u[i] << 16);
      w[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
  } else if (FMT == 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = f16_to_f32(u[i] & 0xffffu);
      w[2 * i + 1] = f16_to_f32(u[i] >> 16);
    }
  } else if (FMT == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __uint_as_float(u[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)((u[i] >> (16 * h)) & 0xffffu);
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
        const float2 f = __half22float2(__half2(raw));
        w[4 * i + 2 * h] = f.x;
        w[4 * i + 2 * h + 1] = f.y;
      }
    }
  }
}

// Per lane: acc[r] += sum over this lane's columns of row_r[c] * x[c] (times the fp8 block scale); K % VEC == 0.
template <int FMT, int NR>
__device__ __forceinline__ void warp_dot(const unsigned char* const* rows, const float* const* srow,
                                         const float* __restrict__ x, int K, int BC, float* acc) {
  constexpr int VEC = Fmt<FMT>::VEC, ES = Fmt<FMT>::ES, STEP = 32 * VEC;
  const int lane = threadIdx.x & 31;
  for (int k0 = lane * VEC; k0 < K; k0 += STEP * MOE_U) {
    uint4 wv[MOE_U][NR];
#pragma unroll
    for (int u = 0; u < MOE_U; ++u) {
      const int k = k0 + u * STEP;
#pragma unroll
      for (int r = 0; r < NR; ++r)
        wv[u][r] = k < K ? ld_stream16(rows[r] + (long long)k * ES) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < MOE_U; ++u) {
      const int k = k0 + u * STEP;
      if (k < K) {
        float xv[VEC];
        const float4* xp = reinterpret_cast<const float4*>(x + k);
#pragma unroll
        for (int i = 0; i < VEC / 4; ++i) {
          const float4 a = __ldg(xp + i);
          xv[4 * i] = a.x; xv[4 * i + 1] = a.y; xv[4 * i + 2] = a.z; xv[4 * i + 3] = a.w;
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          float w[VEC];
          unpack<FMT>(wv[u][r], w);
          float p = 0.f;
#pragma unroll
          for (int i = 0; i < VEC; ++i) p = fmaf(w[i], xv[i], p);
          if (FMT == 3) acc[r] = fmaf(p, __ldg(srow[r] + k / BC), acc[r]);
          else acc[r] += p;
        }
      }
    }
  }
}

template <int NR>
__device__ __forceinline__ void warp_sum(float* acc) {
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
}

__device__ __forceinline__ int load_id(const void* ids, int ids64, int j) {
  if (ids64) {
    const long long v = static_cast<const long long*>(ids)[j];
    return (v < 0 || v > 0x7fffffffLL) ? -1 : (int)v;
  }
  return static_cast<const int*>(ids)[j];
}

// act 0: silu(g) * u (silu as ops.silu: g * 0.5 * (tanh(g / 2) + 1)); act 1: gelu_tanh(g) * u.
__device__ __forceinline__ float act_mul(float g, float u, int act) {
  if (act == 1) return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * (g * g * g)))) * u;
  return g * (0.5f * (tanhf(0.5f * g) + 1.f)) * u;
}

// Several tokens against the same NR weight rows: acc[t][r] += row_r . xs[t] for t < nt (warp-uniform), each
// 16-byte weight load shared by the nt tokens (the grouped kernels).
template <int FMT, int NR, int NT>
__device__ __forceinline__ void warp_dot_nt(const unsigned char* const* rows, const float* const* srow,
                                            const float* const* xs, int nt, int K, int BC, float (*acc)[NR]) {
  constexpr int VEC = Fmt<FMT>::VEC, ES = Fmt<FMT>::ES, STEP = 32 * VEC;
  const int lane = threadIdx.x & 31;
  for (int k0 = lane * VEC; k0 < K; k0 += STEP * MOE_U) {
    uint4 wv[MOE_U][NR];
#pragma unroll
    for (int u = 0; u < MOE_U; ++u) {
      const int k = k0 + u * STEP;
#pragma unroll
      for (int r = 0; r < NR; ++r)
        wv[u][r] = k < K ? ld_stream16(rows[r] + (long long)k * ES) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < MOE_U; ++u) {
      const int k = k0 + u * STEP;
      if (k < K) {
        float sc[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) sc[r] = FMT == 3 ? __ldg(srow[r] + k / BC) : 1.f;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t < nt) {
            float xv[VEC];
            const float4* xp = reinterpret_cast<const float4*>(xs[t] + k);
#pragma unroll
            for (int i = 0; i < VEC / 4; ++i) {
              const float4 a = __ldg(xp + i);
              xv[4 * i] = a.x; xv[4 * i + 1] = a.y; xv[4 * i + 2] = a.z; xv[4 * i + 3] = a.w;
            }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
              float w[VEC];
              unpack<FMT>(wv[u][r], w);
              float p = 0.f;
#pragma unroll
              for (int i = 0; i < VEC; ++i) p = fmaf(w[i], xv[i], p);
              if (FMT == 3) acc[t][r] = fmaf(p, sc[r], acc[t][r]);
              else acc[t][r] += p;
            }
          }
        }
      }
    }
  }
}

// Expert e's matrices: from the pointer table tab (NT, E) uint64 (PACKED false), or at base + e * stride.
// Gate/up table rows: gate data, up data, gate scale, up scale. Down table rows: data, scale.
template <int FMT, bool PACKED>
__device__ __forceinline__ void expert_gate_up(const void* __restrict__ wsrc, int e, int E, int I, int H,
                                               const unsigned char*& G, const unsigned char*& U, const float*& SG,
                                               const float*& SU) {
  constexpr int ES = Fmt<FMT>::ES;
  SG = SU = nullptr;
  if (PACKED) {
    G = static_cast<const unsigned char*>(wsrc) + (long long)e * 2 * I * H * ES;
    U = G + (long long)I * H * ES;
  } else {
    const unsigned long long* tab = static_cast<const unsigned long long*>(wsrc);
    G = reinterpret_cast<const unsigned char*>(tab[e]);
    U = reinterpret_cast<const unsigned char*>(tab[E + e]);
    if (FMT == 3) {
      SG = reinterpret_cast<const float*>(tab[2 * E + e]);
      SU = reinterpret_cast<const float*>(tab[3 * E + e]);
    }
  }
}

template <int FMT, bool PACKED>
__device__ __forceinline__ void expert_down(const void* __restrict__ wsrc, int e, int E, int H, int I,
                                            const unsigned char*& D, const float*& S) {
  constexpr int ES = Fmt<FMT>::ES;
  S = nullptr;
  if (PACKED) {
    D = static_cast<const unsigned char*>(wsrc) + (long long)e * H * I * ES;
  } else {
    const unsigned long long* tab = static_cast<const unsigned long long*>(wsrc);
    D = reinterpret_cast<const unsigned char*>(tab[e]);
    if (FMT == 3) S = reinterpret_cast<const float*>(tab[E + e]);
  }
}

// -- per-slot kernels (any T; used for small T) -----------------------------------------------------------------
// gate_up: block (x, y) handles slots y, y + gridDim.y, ...; slot s = t * k + j reads x row t = s / k.
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void gate_up(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,
                                        const float* __restrict__ x, float* __restrict__ h, int S, int k, int E,
                                        int I, int H, int BR, int BC, int SK, int act) {
  constexpr int ES = Fmt<FMT>::ES;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= I) return;  // warp-uniform
  for (int s = blockIdx.y; s < S; s += gridDim.y) {
    float* hrow = h + (long long)s * I;
    const float* xt = x + (long long)(s / k) * H;
    const int e = load_id(ids, ids64, s);
    if (e < 0 || e >= E) {
      if (lane < ROWS && row0 + lane < I) hrow[row0 + lane] = 0.f;
      continue;
    }
    const unsigned char *G, *U;
    const float *SG, *SU;
    expert_gate_up<FMT, PACKED>(wsrc, e, E, I, H, G, U, SG, SU);
    const unsigned char* rows[2 * ROWS];
    const float* srow[2 * ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // a ragged last warp re-reads row I-1, never writes it
      const int row = min(row0 + r, I - 1);
      rows[r] = G + (long long)row * H * ES;
      rows[ROWS + r] = U + (long long)row * H * ES;
      srow[r] = FMT == 3 ? SG + (long long)(row / BR) * SK : nullptr;
      srow[ROWS + r] = FMT == 3 ? SU + (long long)(row / BR) * SK : nullptr;
    }
    float acc[2 * ROWS];
#pragma unroll
    for (int r = 0; r < 2 * ROWS; ++r) acc[r] = 0.f;
    warp_dot<FMT, 2 * ROWS>(rows, srow, xt, H, BC, acc);
    warp_sum<2 * ROWS>(acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        if (row0 + r < I) hrow[row0 + r] = act_mul(acc[r], acc[ROWS + r], act);
    }
  }
}

// down: block (x, y) handles tokens y, y + gridDim.y, ...: out[t, n] = sum_j weights[t, j] * down_{ids[t, j]}[n]
// . h[t * k + j] over j in order.
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void down(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,
                                     const float* __restrict__ weights, const float* __restrict__ h,
                                     float* __restrict__ out, int T, int k, int E, int H, int I, int BR, int BC,
                                     int SK) {
  constexpr int ES = Fmt<FMT>::ES;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= H) return;  // warp-uniform
  for (int t = blockIdx.y; t < T; t += gridDim.y) {
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    for (int j = t * k; j < (t + 1) * k; ++j) {
      const int e = load_id(ids, ids64, j);
      if (e < 0 || e >= E) continue;  // uniform over the block
      const float wj = weights[j];
      const unsigned char* D;
      const float* S;
      expert_down<FMT, PACKED>(wsrc, e, E, H, I, D, S);
      const unsigned char* rows[ROWS];
      const float* srow[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int row = min(row0 + r, H - 1);
        rows[r] = D + (long long)row * I * ES;
        srow[r] = FMT == 3 ? S + (long long)(row / BR) * SK : nullptr;
      }
      float part[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) part[r] = 0.f;
      warp_dot<FMT, ROWS>(rows, srow, h + (long long)j * I, I, BC, part);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(wj, part[r], acc[r]);
    }
    warp_sum<ROWS>(acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        if (row0 + r < H) out[(long long)t * H + row0 + r] = acc[r];
    }
  }
}

// -- grouped kernels (larger T): slots bucketed by expert on the device ------------------------------------------
// moe_bucket(ids (S,), ids64, S, E, off (E + 1,) int32, order (S,) int32); grid 1, block BUCKET_THREADS:
//   order[off[e] .. off[e + 1]) = the slots routed to expert e (any order within a bucket: every slot is computed
//   alone, so the results do not depend on it). Slots with an id outside [0, E) are in no bucket.
#define BUCKET_THREADS 1024
#define BUCKET_MAX_E 4096
#define MOE_NT 4  // tokens sharing each weight load in the grouped kernels

extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
    moe_bucket(const void* __restrict__ ids, int ids64, int S, int E, int* __restrict__ off,
               int* __restrict__ order) {
  __shared__ int cnt[BUCKET_MAX_E];
  __shared__ int wsum[BUCKET_THREADS / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < E; i += BUCKET_THREADS) cnt[i] = 0;
  __syncthreads();
  for (int s = tid; s < S; s += BUCKET_THREADS) {
    const int e = load_id(ids, ids64, s);
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  const int per = (E + BUCKET_THREADS - 1) / BUCKET_THREADS;  // each thread scans a contiguous run of experts
  const int lo = min(tid * per, E), hi = min(lo + per, E);
  int local = 0;
  for (int i = lo; i < hi; ++i) local += cnt[i];
  int v = local;  // inclusive scan of local over the block
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  if (lane == 31) wsum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = wsum[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    wsum[lane] = w;
  }
  __syncthreads();
  int run = v - local + (warp ? wsum[warp - 1] : 0);  // exclusive prefix of this thread's run
  for (int i = lo; i < hi; ++i) {
    const int c = cnt[i];
    off[i] = run;
    cnt[i] = run;  // becomes the fill cursor
    run += c;
  }
  if (tid == BUCKET_THREADS - 1) off[E] = run;  // the last thread's run ends at the total
  __syncthreads();
  for (int s = tid; s < S; s += BUCKET_THREADS) {
    const int e = load_id(ids, ids64, s);
    if (e >= 0 && e < E) order[atomicAdd(&cnt[e], 1)] = s;
  }
}

// gate_up_g: grid (ceil(I / (ROWS * MOE_WARPS)), E); block y = expert e runs its bucket MOE_NT slots at a time,
// each weight load shared by those slots: h[s, i] = act(gate_i . x[s / k]) * (up_i . x[s / k]).
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void gate_up_grouped(const void* __restrict__ wsrc, const int* __restrict__ off,
                                                const int* __restrict__ order, const float* __restrict__ x,
                                                float* __restrict__ h, int k, int E, int I, int H, int BR, int BC,
                                                int SK, int act) {
  constexpr int ES = Fmt<FMT>::ES, NR = 2 * ROWS;
  const int e = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= I) return;  // warp-uniform
  const int beg = off[e], n = off[e + 1] - beg;
  if (n <= 0) return;  // block-uniform
  const unsigned char *G, *U;
  const float *SG, *SU;
  expert_gate_up<FMT, PACKED>(wsrc, e, E, I, H, G, U, SG, SU);
  const unsigned char* rows[NR];
  const float* srow[NR];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = min(row0 + r, I - 1);
    rows[r] = G + (long long)row * H * ES;
    rows[ROWS + r] = U + (long long)row * H * ES;
    srow[r] = FMT == 3 ? SG + (long long)(row / BR) * SK : nullptr;
    srow[ROWS + r] = FMT == 3 ? SU + (long long)(row / BR) * SK : nullptr;
  }
  for (int c0 = 0; c0 < n; c0 += MOE_NT) {
    const int nt = min(MOE_NT, n - c0);
    int slot[MOE_NT];
    const float* xs[MOE_NT];
    float acc[MOE_NT][NR];
#pragma unroll
    for (int t = 0; t < MOE_NT; ++t) {
      slot[t] = order[beg + c0 + min(t, nt - 1)];
      xs[t] = x + (long long)(slot[t] / k) * H;
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[t][r] = 0.f;
    }
    warp_dot_nt<FMT, NR, MOE_NT>(rows, srow, xs, nt, H, BC, acc);
#pragma unroll
    for (int t = 0; t < MOE_NT; ++t) {
      warp_sum<NR>(acc[t]);
      if (lane == 0 && t < nt) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
          if (row0 + r < I) h[(long long)slot[t] * I + row0 + r] = act_mul(acc[t][r], acc[t][ROWS + r], act);
      }
    }
  }
}

// down_g: grid (ceil(H / (ROWS * MOE_WARPS)), E): ys[s, n] = down_e[n] . h[s] for the slots s of expert e.
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void down_grouped(const void* __restrict__ wsrc, const int* __restrict__ off,
                                             const int* __restrict__ order, const float* __restrict__ h,
                                             float* __restrict__ ys, int E, int H, int I, int BR, int BC, int SK) {
  constexpr int ES = Fmt<FMT>::ES;
  const int e = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= H) return;  // warp-uniform
  const int beg = off[e], n = off[e + 1] - beg;
  if (n <= 0) return;
  const unsigned char* D;
  const float* S;
  expert_down<FMT, PACKED>(wsrc, e, E, H, I, D, S);
  const unsigned char* rows[ROWS];
  const float* srow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = min(row0 + r, H - 1);
    rows[r] = D + (long long)row * I * ES;
    srow[r] = FMT == 3 ? S + (long long)(row / BR) * SK : nullptr;
  }
  for (int c0 = 0; c0 < n; c0 += MOE_NT) {
    const int nt = min(MOE_NT, n - c0);
    int slot[MOE_NT];
    const float* xs[MOE_NT];
    float acc[MOE_NT][ROWS];
#pragma unroll
    for (int t = 0; t < MOE_NT; ++t) {
      slot[t] = order[beg + c0 + min(t, nt - 1)];
      xs[t] = h + (long long)slot[t] * I;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;
    }
    warp_dot_nt<FMT, ROWS, MOE_NT>(rows, srow, xs, nt, I, BC, acc);
#pragma unroll
    for (int t = 0; t < MOE_NT; ++t) {
      warp_sum<ROWS>(acc[t]);
      if (lane == 0 && t < nt) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
          if (row0 + r < H) ys[(long long)slot[t] * H + row0 + r] = acc[t][r];
      }
    }
  }
}

// moe_combine(ids (T*k,), ids64, weights (T*k,) f32, ys (T*k, H) f32, out (T, H) f32, T, k, E, H); grid
// ceil(T * H / 256), block 256: out[t, n] = sum_j weights[t, j] * ys[t * k + j, n] over valid ids, j in order.
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const void* __restrict__ ids, int ids64, const float* __restrict__ weights,
                const float* __restrict__ ys, float* __restrict__ out, int T, int k, int E, int H) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i >= (long long)T * H) return;
  const int t = (int)(i / H), n = (int)(i - (long long)t * H);
  float acc = 0.f;
  for (int j = t * k; j < (t + 1) * k; ++j) {
    const int e = load_id(ids, ids64, j);
    if (e >= 0 && e < E) acc = fmaf(weights[j], ys[(long long)j * H + n], acc);
  }
  out[i] = acc;
}

// moe_gate_up_<fmt>_r<ROWS>(tab (4, E) u64, ids (S,), ids64, x (T, H) f32, h (S, I) f32, S, k, E, I, H, BR, BC,
//                           SK, act); grid (ceil(I / (ROWS * MOE_WARPS)), min(S, 65535))
// moe_down_<fmt>_r<ROWS>(tab (2, E) u64, ids, ids64, weights (S,) f32, h (S, I), out (T, H) f32, T, k, E, H, I,
//                        BR, BC, SK); grid (ceil(H / (ROWS * MOE_WARPS)), min(T, 65535))
// moe_gate_up_g_<fmt>_r<ROWS>(tab, off (E + 1,), order (S,), x, h, k, E, I, H, BR, BC, SK, act); grid (.., E)
// moe_down_g_<fmt>_r<ROWS>(tab, off, order, h, ys (S, H) f32, E, H, I, BR, BC, SK); grid (.., E)
// *_packed_*: the same with the base pointer of (E, 2I, H) / (E, H, I) in place of the table.
#define MOE_KERNELS(NAME, FMT, ROWS, PACKED)                                                                   \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                \
      moe_gate_up_##NAME##_r##ROWS(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,     \
                                   const float* __restrict__ x, float* __restrict__ h, int S, int k, int E,    \
                                   int I, int H, int BR, int BC, int SK, int act) {                            \
    gate_up<FMT, ROWS, PACKED>(wsrc, ids, ids64, x, h, S, k, E, I, H, BR, BC, SK, act);                        \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                \
      moe_down_##NAME##_r##ROWS(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,        \
                                const float* __restrict__ weights, const float* __restrict__ h,                \
                                float* __restrict__ out, int T, int k, int E, int H, int I, int BR, int BC,    \
                                int SK) {                                                                      \
    down<FMT, ROWS, PACKED>(wsrc, ids, ids64, weights, h, out, T, k, E, H, I, BR, BC, SK);                     \
  }

#define MOE_GROUPED(NAME, FMT, ROWS, PACKED)                                                                   \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                \
      moe_gate_up_g_##NAME##_r##ROWS(const void* __restrict__ wsrc, const int* __restrict__ off,              \
                                     const int* __restrict__ order, const float* __restrict__ x,               \
                                     float* __restrict__ h, int k, int E, int I, int H, int BR, int BC,        \
                                     int SK, int act) {                                                        \
    gate_up_grouped<FMT, ROWS, PACKED>(wsrc, off, order, x, h, k, E, I, H, BR, BC, SK, act);                   \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                \
      moe_down_g_##NAME##_r##ROWS(const void* __restrict__ wsrc, const int* __restrict__ off,                 \
                                  const int* __restrict__ order, const float* __restrict__ h,                  \
                                  float* __restrict__ ys, int E, int H, int I, int BR, int BC, int SK) {       \
    down_grouped<FMT, ROWS, PACKED>(wsrc, off, order, h, ys, E, H, I, BR, BC, SK);                             \
  }

#define MOE_R(NAME, FMT, PACKED)      \
  MOE_KERNELS(NAME, FMT, 1, PACKED)   \
  MOE_KERNELS(NAME, FMT, 2, PACKED)   \
  MOE_KERNELS(NAME, FMT, 4, PACKED)   \
  MOE_GROUPED(NAME, FMT, 2, PACKED)   \
  MOE_GROUPED(NAME, FMT, 4, PACKED)

MOE_R(bf16, 0, false)
MOE_R(f16, 1, false)
MOE_R(f32, 2, false)
MOE_R(fp8, 3, false)
MOE_R(packed_bf16, 0, true)
MOE_R(packed_f16, 1, true)
MOE_R(packed_f32, 2, true)
