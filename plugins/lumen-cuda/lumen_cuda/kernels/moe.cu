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
//     moe_down_*: grid (ceil(H / (ROWS * MOE_WARPS)), min(T, 65535)) (moe.py: ROWS = 1 at T = 1). Each warp owns
//     ROWS output rows n of a token t: out[t, n] = sum_j weights[t, j] * (down_{ids[t, j]}[n, :] . h[t k + j, :]),
//     j in order. The slots go in chunks of KC (down_chunk: 8 / ROWS, 4 / ROWS for f32 and nvfp4): the chunk's
//     ids, then all its table entries, then all KC x ROWS weight (and scale) loads of a column step before any
//     FMA, so a warp waits ~3 memory latencies per chunk instead of ~3 per slot; the per-slot partial sums still
//     enter the accumulator one slot at a time in j order. Deterministic, no atomics.
//   larger T, grouped: moe_bucket sorts the slots by expert; moe_gate_up_g_* / moe_down_g_* run per (row block,
//     expert), MOE_NT slots of that expert per weight load, into h (T k, I) and ys (T k, H); moe_combine sums
//     weights[t, j] * ys[t k + j] over j in order.
//   Weights per expert come from a pointer table (uint64 (.., E): data pointers, then for fp8 the scale
//   pointers, for nvfp4 the block-scale pointers and then the f32 global scales as bits in the low 32 bits of
//   an entry; see expert_gate_up) or, for the packed layout (E, 2I, H) / (E, H, I), from the base pointer plus
//   e times the expert's stride. An id outside [0, E) contributes nothing (h row zero, slot skipped).
//
// Formats (template FMT): 0 bf16 bits, 1 f16, 2 f32, 3 fp8 e4m3 with f32 block scales in the HF
// weight_scale_inv layout (S[row / BR, col / BC], SK scale columns; per-channel / per-tensor expressed as
// BR = 1 / N and BC covering every column, as gemv.fp8_block does), 4 nvfp4: packed e2m1 codes (N, K/2) bytes
// (value 2j in the low nibble of byte j), e4m3 block scales (N, K/16) bytes, an f32 global scale per matrix;
// value = (e2m1 x block scale) x global scale with gemv_nvfp4.cu's arithmetic (per 16 values p = sum w x,
// acc = fmaf(p, block scale, acc); the global scale times the warp's row sum, for down times each slot's
// per-lane partial sum). The e2m1 table lives in registers (e2m1x8: byte permutes), no shared memory.
// Alignment (moe.py checks, else the CuPy fallback): every 16-byte load lies inside a row: K % VEC == 0
// (VEC = 8 bf16/f16, 4 f32, 16 fp8, 32 nvfp4; K = H for gate/up, I for down), BC % 16 == 0 for fp8, all weight
// rows, x and the scratch 16-byte aligned, nvfp4 block scales 2-byte aligned.

#include "pdl.cuh"

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

// One token row of routing: softmax over the E logits, the top k (ties: the lower index) into columns 0..k-1 of
// a row of `stride` weights / ids. With `shared` (the shared expert's gate logit per token), column k is the shared
// expert, run as expert E: id E, weight sigmoid(shared[t]) (the routed weights alone are normalised).
__device__ __forceinline__ void route_row(const float* __restrict__ logits, float* __restrict__ w_out,
                                          long long* __restrict__ ids_out, int E, int k, int normalize, int stride,
                                          const float* __restrict__ shared) {
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
      ids_out[(long long)blockIdx.x * stride + j] = found ? bi : -1;  // -1: an id the expert kernels skip
      if (found) p[bi] = -1.f;
    }
    __syncthreads();
  }
  if (tid == 0) {
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += sel[j];
    for (int j = 0; j < k; ++j) w_out[(long long)blockIdx.x * stride + j] = normalize ? sel[j] / sum : sel[j];
    if (shared != nullptr) {  // as the CPU's sigmoid: 0.5 (tanh(x / 2) + 1)
      ids_out[(long long)blockIdx.x * stride + k] = E;
      w_out[(long long)blockIdx.x * stride + k] = 0.5f * (tanhf(0.5f * shared[blockIdx.x]) + 1.f);
    }
  }
}

// moe_route_f32(logits (T, E) f32, weights (T, k) f32, ids (T, k) int64, E, k, normalize); grid T, block 256.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route_f32(const float* __restrict__ logits, float* __restrict__ w_out, long long* __restrict__ ids_out,
                  int E, int k, int normalize) {
  pdl_begin();
  route_row(logits, w_out, ids_out, E, k, normalize, k, nullptr);
}

// moe_route_shared_f32(logits (T, E), shared (T,) f32, weights (T, k + 1), ids (T, k + 1), E, k, normalize):
// moe_route_f32's k columns, then the shared expert's (route_row).
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route_shared_f32(const float* __restrict__ logits, const float* __restrict__ shared,
                         float* __restrict__ w_out, long long* __restrict__ ids_out, int E, int k, int normalize) {
  pdl_begin();
  route_row(logits, w_out, ids_out, E, k, normalize, k + 1, shared);
}

// -- expert GEMVs -----------------------------------------------------------------------------------------------
// VEC values per 16-byte load; ES bytes per value (nvfp4: half a byte, see nbytes); SES bytes per scale entry.
template <int FMT> struct Fmt;
template <> struct Fmt<0> { static constexpr int VEC = 8, ES = 2, SES = 0; };   // bf16 bits
template <> struct Fmt<1> { static constexpr int VEC = 8, ES = 2, SES = 0; };   // f16
template <> struct Fmt<2> { static constexpr int VEC = 4, ES = 4, SES = 0; };   // f32
template <> struct Fmt<3> { static constexpr int VEC = 16, ES = 1, SES = 4; };  // fp8 e4m3, f32 block scales
template <> struct Fmt<4> { static constexpr int VEC = 32, ES = 1, SES = 1; };  // nvfp4: e2m1 pairs, e4m3 scales

// Bytes taken by n values of a row (n even for nvfp4: every offset here is a multiple of 32 values or a row).
template <int FMT>
__device__ __forceinline__ long long nbytes(long long n) { return FMT == 4 ? n >> 1 : n * Fmt<FMT>::ES; }

__device__ __forceinline__ float e4m3_to_f32(unsigned int b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(b & 0xffu), __NV_E4M3);
  return __half2float(__half(h));
}

// 8 e2m1 codes (one 32-bit word, value i in bits 4i..4i+3: the low nibble of a byte first) -> 8 floats, exactly
// the table {0, 0.5, 1, 1.5, 2, 3, 4, 6} x sign (sign = bit 3; code 8 is -0) that gemv_nvfp4.cu reads from shared
// memory, here in registers: the f16 encodings of the 8 magnitudes have a zero low byte, so one byte permutation
// (prmt) looks up the high bytes of 4 codes at once; a second one pairs values i and i + 4 into a half2 and the
// sign bits are or-ed in; the half2 -> float2 conversion is exact.
__device__ __forceinline__ void e2m1x8(unsigned int w, float* v) {
  const unsigned int lo = 0x3E3C3800u, hi = 0x46444240u;  // f16 high bytes of magnitudes 0..3 and 4..7
  const unsigned int ta = __byte_perm(lo, hi, w & 0x7777u);          // values 0..3
  const unsigned int tb = __byte_perm(lo, hi, (w >> 16) & 0x7777u);  // values 4..7
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned int sel = ((4u + i) << 12) | ((4u + i) << 8) | ((unsigned)i << 4) | (unsigned)i;
    const unsigned int h2 = (__byte_perm(ta, tb, sel) & 0xff00ff00u) | ((w << (12 - 4 * i)) & 0x80008000u);
    __half2_raw raw;
    raw.x = (unsigned short)(h2 & 0xffffu);
    raw.y = (unsigned short)(h2 >> 16);
    const float2 f = __half22float2(__half2(raw));
    v[i] = f.x;
    v[i + 4] = f.y;
  }
}

// One 16-byte load -> VEC floats (formats 0-3; nvfp4 decodes 16 values at a time in dot_load).
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
  } else if (FMT == 3) {
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

// The block scale(s) of the 16-byte load at column k of a row whose scales start at srow (bytes): fp8 one f32
// S[k / BC] (.x); nvfp4 the two e4m3 bytes of the load's two 16-value blocks (k % 32 == 0: one aligned u16 load).
template <int FMT>
__device__ __forceinline__ float2 load_scale(const unsigned char* srow, int k, int BC) {
  if (FMT == 3) return make_float2(__ldg(reinterpret_cast<const float*>(srow) + k / BC), 0.f);
  if (FMT == 4) {
    const unsigned int b = __ldg(reinterpret_cast<const unsigned short*>(srow + k / 16));
    return make_float2(e4m3_to_f32(b), e4m3_to_f32(b >> 8));
  }
  return make_float2(1.f, 0.f);
}

// x[0 .. VEC) (16-byte aligned) -> xv.
template <int VEC>
__device__ __forceinline__ void load_x(const float* __restrict__ x, float* xv) {
  const float4* xp = reinterpret_cast<const float4*>(x);
#pragma unroll
  for (int i = 0; i < VEC / 4; ++i) {
    const float4 a = __ldg(xp + i);
    xv[4 * i] = a.x; xv[4 * i + 1] = a.y; xv[4 * i + 2] = a.z; xv[4 * i + 3] = a.w;
  }
}

// acc += (one 16-byte load of a row) . xv: p = sum_i w_i x_i (fmaf, i ascending), then acc += p (bf16 / f16 /
// f32), acc = fmaf(p, scale, acc) (fp8), or per 16-value block acc = fmaf(p_block, block scale, acc) (nvfp4, the
// arithmetic of gemv_nvfp4.cu; the global scale multiplies the row's lane sum later).
template <int FMT>
__device__ __forceinline__ float dot_load(const uint4 v, const float* xv, const float2 sc, float acc) {
  constexpr int VEC = Fmt<FMT>::VEC;
  if (FMT == 4) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float w[16];
      e2m1x8(u[2 * half], w);
      e2m1x8(u[2 * half + 1], w + 8);
      float p = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) p = fmaf(w[i], xv[16 * half + i], p);
      acc = fmaf(p, half ? sc.y : sc.x, acc);
    }
    return acc;
  } else {
    float w[VEC];
    unpack<FMT>(v, w);
    float p = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) p = fmaf(w[i], xv[i], p);
    return FMT == 3 ? fmaf(p, sc.x, acc) : acc + p;
  }
}

// Per lane: acc[r] += sum over this lane's columns of row_r[c] * x[c] (with the block scales); K % VEC == 0.
// rows / srow: byte pointers to each row's data and (fp8 / nvfp4) its first scale.
template <int FMT, int NR>
__device__ __forceinline__ void warp_dot(const unsigned char* const* rows, const unsigned char* const* srow,
                                         const float* __restrict__ x, int K, int BC, float* acc) {
  constexpr int VEC = Fmt<FMT>::VEC, STEP = 32 * VEC;
  const int lane = threadIdx.x & 31;
  for (int k0 = lane * VEC; k0 < K; k0 += STEP * MOE_U) {
    uint4 wv[MOE_U][NR];
    float2 sc[MOE_U][NR];
#pragma unroll
    for (int u = 0; u < MOE_U; ++u) {  // every load of the step (weights and their scales) before any FMA
      const int k = k0 + u * STEP;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        wv[u][r] = k < K ? ld_stream16(rows[r] + nbytes<FMT>(k)) : make_uint4(0, 0, 0, 0);
        sc[u][r] = k < K ? load_scale<FMT>(srow[r], k, BC) : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < MOE_U; ++u) {
      const int k = k0 + u * STEP;
      if (k < K) {
        float xv[VEC];
        load_x<VEC>(x + k, xv);
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[r] = dot_load<FMT>(wv[u][r], xv, sc[u][r], acc[r]);
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
__device__ __forceinline__ void warp_dot_nt(const unsigned char* const* rows, const unsigned char* const* srow,
                                            const float* const* xs, int nt, int K, int BC, float (*acc)[NR]) {
  constexpr int VEC = Fmt<FMT>::VEC, STEP = 32 * VEC, UN = FMT == 4 ? 1 : MOE_U;  // nvfp4: 32-float x per token
  const int lane = threadIdx.x & 31;
  for (int k0 = lane * VEC; k0 < K; k0 += STEP * UN) {
    uint4 wv[UN][NR];
    float2 sc[UN][NR];
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int k = k0 + u * STEP;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        wv[u][r] = k < K ? ld_stream16(rows[r] + nbytes<FMT>(k)) : make_uint4(0, 0, 0, 0);
        sc[u][r] = k < K ? load_scale<FMT>(srow[r], k, BC) : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int k = k0 + u * STEP;
      if (k < K) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t < nt) {
            float xv[VEC];
            load_x<VEC>(xs[t] + k, xv);
#pragma unroll
            for (int r = 0; r < NR; ++r) acc[t][r] = dot_load<FMT>(wv[u][r], xv, sc[u][r], acc[t][r]);
          }
        }
      }
    }
  }
}

// Expert e's matrices: from the pointer table tab (rows, E) uint64 (PACKED false), or at base + e * stride.
// Table rows, gate/up: gate data, up data, then for fp8 / nvfp4 the gate and up scale pointers (f32 blocks /
// e4m3 bytes), then for nvfp4 the gate and up global scales (the f32's bits in the low 32 bits of the entry).
// Down: data, scale pointer, global scale. Formats without a global scale get 1 (never multiplied in).
template <int FMT, bool PACKED>
__device__ __forceinline__ void expert_gate_up(const void* __restrict__ wsrc, int e, int E, int I, int H,
                                               const unsigned char*& G, const unsigned char*& U,
                                               const unsigned char*& SG, const unsigned char*& SU, float& GG,
                                               float& GU) {
  SG = SU = nullptr;
  GG = GU = 1.f;
  if (PACKED) {
    G = static_cast<const unsigned char*>(wsrc) + nbytes<FMT>((long long)e * 2 * I * H);
    U = G + nbytes<FMT>((long long)I * H);
  } else {
    const unsigned long long* tab = static_cast<const unsigned long long*>(wsrc);
    G = reinterpret_cast<const unsigned char*>(__ldg(tab + e));
    U = reinterpret_cast<const unsigned char*>(__ldg(tab + E + e));
    if (FMT >= 3) {
      SG = reinterpret_cast<const unsigned char*>(__ldg(tab + 2 * E + e));
      SU = reinterpret_cast<const unsigned char*>(__ldg(tab + 3 * E + e));
    }
    if (FMT == 4) {
      GG = __uint_as_float((unsigned int)__ldg(tab + 4 * E + e));
      GU = __uint_as_float((unsigned int)__ldg(tab + 5 * E + e));
    }
  }
}

template <int FMT, bool PACKED>
__device__ __forceinline__ void expert_down(const void* __restrict__ wsrc, int e, int E, int H, int I,
                                            const unsigned char*& D, const unsigned char*& S, float& GS) {
  S = nullptr;
  GS = 1.f;
  if (PACKED) {
    D = static_cast<const unsigned char*>(wsrc) + nbytes<FMT>((long long)e * H * I);
  } else {
    const unsigned long long* tab = static_cast<const unsigned long long*>(wsrc);
    D = reinterpret_cast<const unsigned char*>(__ldg(tab + e));
    if (FMT >= 3) S = reinterpret_cast<const unsigned char*>(__ldg(tab + E + e));
    if (FMT == 4) GS = __uint_as_float((unsigned int)__ldg(tab + 2 * E + e));
  }
}

// Byte offset of the scales of row `row` (fp8: block row row / BR of SK f32; nvfp4: BR = 1, SK = K / 16 bytes).
template <int FMT>
__device__ __forceinline__ long long scale_off(int row, int BR, int SK) {
  return FMT >= 3 ? (long long)(row / BR) * SK * Fmt<FMT>::SES : 0;
}

// -- per-slot kernels (any T; used for small T) -----------------------------------------------------------------
// gate_up: block (x, y) handles slots y, y + gridDim.y, ... (one slot per block whenever T k <= 65535); slot
// s = t * k + j reads x row t = s / k. The chain per slot is id -> table entries (all of them in one go: data,
// scales, global scales) -> every weight and scale load of a step; the next slot's id is read before the current
// slot's GEMV so that a block looping over several slots does not wait for it.
// One slot of gate_up: this warp's ROWS rows of expert e's gate and up against x row xt into h row hrow (zeros
// for an id outside [0, E)).
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void gate_up_slot(const void* __restrict__ wsrc, int e, const float* __restrict__ xt,
                                             float* __restrict__ hrow, int row0, int E, int I, int H, int BR,
                                             int BC, int SK, int act) {
  const int lane = threadIdx.x & 31;
  if (e < 0 || e >= E) {
    if (lane < ROWS && row0 + lane < I) hrow[row0 + lane] = 0.f;
    return;
  }
  const unsigned char *G, *U, *SG, *SU;
  float GG, GU;
  expert_gate_up<FMT, PACKED>(wsrc, e, E, I, H, G, U, SG, SU, GG, GU);
  const unsigned char* rows[2 * ROWS];
  const unsigned char* srow[2 * ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {  // a ragged last warp re-reads row I-1, never writes it
    const int row = min(row0 + r, I - 1);
    rows[r] = G + nbytes<FMT>((long long)row * H);
    rows[ROWS + r] = U + nbytes<FMT>((long long)row * H);
    srow[r] = SG + scale_off<FMT>(row, BR, SK);
    srow[ROWS + r] = SU + scale_off<FMT>(row, BR, SK);
  }
  float acc[2 * ROWS];
#pragma unroll
  for (int r = 0; r < 2 * ROWS; ++r) acc[r] = 0.f;
  warp_dot<FMT, 2 * ROWS>(rows, srow, xt, H, BC, acc);
  warp_sum<2 * ROWS>(acc);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float g = FMT == 4 ? acc[r] * GG : acc[r], u = FMT == 4 ? acc[ROWS + r] * GU : acc[ROWS + r];
      if (row0 + r < I) hrow[row0 + r] = act_mul(g, u, act);
    }
  }
}

template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void gate_up(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,
                                        const float* __restrict__ x, float* __restrict__ h, int S, int k, int E,
                                        int I, int H, int BR, int BC, int SK, int act) {
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= I) return;  // warp-uniform
  int e_next = blockIdx.y < S ? load_id(ids, ids64, blockIdx.y) : -1;
  for (int s = blockIdx.y; s < S; s += gridDim.y) {
    const int e = e_next;
    if (s + gridDim.y < S) e_next = load_id(ids, ids64, s + gridDim.y);
    gate_up_slot<FMT, ROWS, PACKED>(wsrc, e, x + (long long)(s / k) * H, h + (long long)s * I, row0, E, I, H, BR,
                                    BC, SK, act);
  }
}

// -- routing inside the gate/up kernel (one token) --------------------------------------------------------------
// warp_route: one warp routes the row lg (E <= ROUTED_MAX_E logits) with route_row's arithmetic, bit for bit: lane
// l holds logits l + 32 j; route_row's thread t (block of ROUTE_THREADS) holds logits t and t + ROUTE_THREADS, so
// its warp w's lane l holds this warp's columns j = w and w + 8 of lane l. The exp-sum therefore adds the pair
// (j, j + 8) per lane, butterfly-reduces each j < 8 over the lanes (route_row's per-warp reduction) and sums the
// eight results in j order (route_row's sum over warps). The top k: k rounds of (local best in ascending j, so the
// lower index among equals; warp arg-max with `beats`); the k weights are summed in slot order for normalising.
// Lane r < k gets slot r's id (-1 where none: a NaN row) and weight.
#define ROUTED_PER_LANE 16
#define ROUTED_MAX_E (32 * ROUTED_PER_LANE)

__device__ __forceinline__ void warp_route(const float* __restrict__ lg, int E, int k, int normalize, int& my_id,
                                           float& my_w) {
  static_assert(ROUTE_THREADS == 256 && ROUTED_PER_LANE == 16, "warp_route mirrors route_row's 256 threads");
  const int lane = threadIdx.x & 31;
  const float ninf = __uint_as_float(0xff800000u);
  float p[ROUTED_PER_LANE];
  float m = ninf;
#pragma unroll
  for (int j = 0; j < ROUTED_PER_LANE; ++j) {
    const int i = lane + 32 * j;
    p[j] = i < E ? lg[i] : ninf;
    m = fmaxf(m, p[j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
#pragma unroll
  for (int j = 0; j < ROUTED_PER_LANE; ++j) p[j] = lane + 32 * j < E ? expf(p[j] - m) : 0.f;
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < ROUTED_PER_LANE / 2; ++w) {
    float v = 0.f;
    if (lane + 32 * w < E) v = v + p[w];
    if (lane + 32 * (w + 8) < E) v = v + p[w + 8];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, off);
    s = w == 0 ? v : s + v;
  }
#pragma unroll
  for (int j = 0; j < ROUTED_PER_LANE; ++j) p[j] = lane + 32 * j < E ? p[j] / s : -1.f;  // -1: never chosen

  float sum = 0.f, mine = 0.f;
  int id = -1;
  for (int r = 0; r < k; ++r) {
    float bv = -1.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < ROUTED_PER_LANE; ++j)
      if (p[j] > bv) { bv = p[j]; bi = lane + 32 * j; }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const bool found = bi < E;
#pragma unroll
    for (int j = 0; j < ROUTED_PER_LANE; ++j)
      if (found && lane + 32 * j == bi) p[j] = -1.f;
    const float v = found ? bv : 0.f;
    sum += v;
    if (lane == r) { mine = v; id = found ? bi : -1; }
  }
  my_id = id;
  my_w = normalize ? mine / sum : mine;
}

// gate_up_routed: the T = 1 gate/up kernel that routes for itself (no routing launch before it). Block (x, y) runs
// slot y: for y < k the y-th pick of the Er logits, for y == k (with `shared`) expert Er, the shared expert of a
// table of Er + 1 experts. Every warp routes (the same arithmetic, the same answer; no barrier); block (0, 0)'s
// first warp writes the k (+ 1) ids and weights for the down kernel, exactly as moe_route(_shared)_f32 would.
template <int FMT, int ROWS>
__device__ __forceinline__ void gate_up_routed(const void* __restrict__ wsrc, const float* __restrict__ logits,
                                               const float* __restrict__ shared, long long* __restrict__ ids_out,
                                               float* __restrict__ w_out, const float* __restrict__ x,
                                               float* __restrict__ h, int k, int Er, int E, int I, int H, int BR,
                                               int BC, int SK, int act, int normalize) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= I) return;  // warp-uniform (block (0, 0)'s first warp always has row 0)
  int my_id;
  float my_w;
  warp_route(logits, Er, k, normalize, my_id, my_w);
  const int s = blockIdx.y;
  if (blockIdx.x == 0 && s == 0 && threadIdx.x < 32) {
    if (lane < k) {
      ids_out[lane] = my_id;
      w_out[lane] = my_w;
    }
    if (lane == 0 && shared != nullptr) {  // as route_row
      ids_out[k] = Er;
      w_out[k] = 0.5f * (tanhf(0.5f * shared[0]) + 1.f);
    }
  }
  const int e = __shfl_sync(0xffffffffu, my_id, s < k ? s : 0);
  gate_up_slot<FMT, ROWS, false>(wsrc, s < k ? e : Er, x, h + (long long)s * I, row0, E, I, H, BR, BC, SK, act);
}

// down: block (x, y) handles tokens y, y + gridDim.y, ...: out[t, n] = sum_j weights[t, j] * down_{ids[t, j]}[n]
// . h[t * k + j] over j in order. The k slots go in chunks of KC = MOE_KC / ROWS: a warp reads the chunk's ids
// and routing weights, then all its table entries, then issues every weight (and scale) load of the chunk's
// experts for one column step (KC x ROWS 16-byte loads per lane) before any FMA; part[c][r] (this lane's columns
// of row r of slot c's expert, in ascending column order, as warp_dot sums them) then enters acc[r] =
// fmaf(w_j, part_j, acc[r]) for j ascending (nvfp4: part_j times the expert's global scale first), and acc is
// reduced across the warp at the end: the same arithmetic whatever KC is.
#define MOE_KC 8
// Slots per chunk: MOE_KC / ROWS (f32 and nvfp4, whose x vectors per load are larger than their weights: half).
__device__ constexpr int down_chunk(int fmt, int rows) {
  const int kc = ((fmt == 2 || fmt == 4) ? MOE_KC / 2 : MOE_KC) / rows;
  return kc > 1 ? kc : 1;
}
#ifndef MOE_DOWN_MIN_BLOCKS
#define MOE_DOWN_MIN_BLOCKS 4  // <= 128 registers: 16 warps per SM resident
#endif

// Steps 1-3 of the down kernels for KC slots j = j0 + c * jstep (c < KC; those at or past jend are skipped): their
// ids and routing weights, then their table entries (an id outside [0, E): ok false, the slot skipped), then per
// column step every weight and scale load of all the slots and rows before any FMA; part[c][r] = this lane's sum
// for row r of slot c (dot_load over its columns in ascending order), wj / ok / GS (nvfp4 global scale) per slot.
template <int FMT, bool PACKED, int KC, int ROWS>
__device__ __forceinline__ void down_parts(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,
                                           const float* __restrict__ weights, const float* __restrict__ h, int j0,
                                           int jstep, int jend, int E, int H, int I, int BC, const long long* roff,
                                           const long long* soff, float* wj, bool* ok, float* GS,
                                           float (*part)[ROWS]) {
  constexpr int VEC = Fmt<FMT>::VEC, STEP = 32 * VEC;
  const int lane = threadIdx.x & 31;
  int e[KC];
#pragma unroll
  for (int c = 0; c < KC; ++c) {  // 1: the slots' ids and routing weights
    const int j = j0 + c * jstep;
    e[c] = j < jend ? load_id(ids, ids64, j) : -1;
    wj[c] = j < jend ? weights[j] : 0.f;
  }
  const unsigned char* D[KC];
  const unsigned char* S[KC];
#pragma unroll
  for (int c = 0; c < KC; ++c) {  // 2: their table entries
    ok[c] = e[c] >= 0 && e[c] < E;
    D[c] = S[c] = nullptr;
    GS[c] = 1.f;
    if (ok[c]) expert_down<FMT, PACKED>(wsrc, e[c], E, H, I, D[c], S[c], GS[c]);
  }
#pragma unroll
  for (int c = 0; c < KC; ++c)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) part[c][r] = 0.f;
#pragma unroll 1  // KC x ROWS loads in flight per step already; unrolling would only add registers
  for (int k0 = lane * VEC; k0 < I; k0 += STEP) {
    uint4 wv[KC][ROWS];
    float2 sc[KC][ROWS];
#pragma unroll
    for (int c = 0; c < KC; ++c)  // 3: every weight and scale load of the step, all slots, before any FMA
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        wv[c][r] = ok[c] ? ld_stream16(D[c] + roff[r] + nbytes<FMT>(k0)) : make_uint4(0, 0, 0, 0);
        sc[c][r] = ok[c] ? load_scale<FMT>(S[c] + soff[r], k0, BC) : make_float2(0.f, 0.f);
      }
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      if (ok[c]) {
        float xv[VEC];
        load_x<VEC>(h + (long long)(j0 + c * jstep) * I + k0, xv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) part[c][r] = dot_load<FMT>(wv[c][r], xv, sc[c][r], part[c][r]);
      }
    }
  }
}

template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void down(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,
                                     const float* __restrict__ weights, const float* __restrict__ h,
                                     float* __restrict__ out, int T, int k, int E, int H, int I, int BR, int BC,
                                     int SK) {
  constexpr int KC = down_chunk(FMT, ROWS);
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= H) return;  // warp-uniform
  long long roff[ROWS], soff[ROWS];  // byte offsets of this warp's rows in an expert's data and scales
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {  // a ragged last warp re-reads row H-1, never writes it
    const int row = min(row0 + r, H - 1);
    roff[r] = nbytes<FMT>((long long)row * I);
    soff[r] = scale_off<FMT>(row, BR, SK);
  }
  for (int t = blockIdx.y; t < T; t += gridDim.y) {
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    const int jend = (t + 1) * k;
    for (int j0 = t * k; j0 < jend; j0 += KC) {
      float wj[KC], GS[KC], part[KC][ROWS];
      bool ok[KC];
      down_parts<FMT, PACKED, KC, ROWS>(wsrc, ids, ids64, weights, h, j0, 1, jend, E, H, I, BC, roff, soff, wj, ok, GS,
                                        part);
#pragma unroll
      for (int c = 0; c < KC; ++c)  // 4: the slots in order
        if (ok[c]) {
#pragma unroll
          for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(wj[c], FMT == 4 ? part[c][r] * GS[c] : part[c][r], acc[r]);
        }
    }
    warp_sum<ROWS>(acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        if (row0 + r < H) out[(long long)t * H + row0 + r] = acc[r];
    }
  }
}

// -- down for one token, the slots split over the block's warps (LUMEN_CUDA_MOE_DOWN_SPLIT=1, moe.py) -----------
// down_split: the same sums as down<FMT, 1, PACKED> at T = 1, bit for bit, with a shorter chain of dependent loads.
// down walks a token's k slots in chunks of KC (id -> table entries -> weights, then the next chunk: at the
// 35B-A3B's 9 slots two rounds of three dependent loads). Here block b owns rows [DS_ROWS b, DS_ROWS b + DS_ROWS)
// and warp w the slots w, w + DS_WARPS, ... of the token, for all of the block's rows: with k <= DS_WARPS * DS_KW
// slots every warp issues its ids, then its table entries, then all its weight loads in one round. Each lane keeps
// part[c][r] exactly as down does (dot_load over its columns in ascending order; nvfp4 times the expert's global
// scale) and leaves it in shared memory; then warp r adds row r's parts into acc in slot order, acc = fmaf(w_j,
// part_j, acc), j ascending (an invalid id: skipped), and reduces acc across the warp with warp_sum: the arithmetic,
// and so the bits, of down. grid ceil(H / DS_ROWS), DS_WARPS * 32 threads; k <= DS_MAX_S. Sizes: at H = 2048 the
// 1024 blocks of 64 threads fit one wave on 132 SMs at <= 128 registers (fp8 and nvfp4 spill with 4 rows and 3
// slots a warp under that cap; nvcc 13, sm_90). Not built for nvfp4 (it spills at these sizes too): down runs.
#define DS_ROWS 2   // rows a block (<= DS_WARPS: warp r sums row r)
#define DS_WARPS 2  // warps a block
#define DS_KW 5     // slots a warp loads in one round: DS_WARPS * DS_KW = 10 slots of a token in one round
#define DS_MAX_S 40  // slots of the token (k, with the shared expert's): shared memory DS_MAX_S x DS_ROWS x 32 floats

template <int FMT, bool PACKED>
__device__ __forceinline__ void down_split(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,
                                           const float* __restrict__ weights, const float* __restrict__ h,
                                           float* __restrict__ out, int k, int E, int H, int I, int BR, int BC,
                                           int SK) {
  __shared__ float sp[DS_MAX_S][DS_ROWS][32];  // each slot's per-lane partial sums, by row
  __shared__ float sw[DS_MAX_S];               // each slot's routing weight
  __shared__ bool sok[DS_MAX_S];               // whether its id is in [0, E)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * DS_ROWS;
  long long roff[DS_ROWS], soff[DS_ROWS];
#pragma unroll
  for (int r = 0; r < DS_ROWS; ++r) {  // a ragged last block re-reads row H-1, never writes it
    const int row = min(row0 + r, H - 1);
    roff[r] = nbytes<FMT>((long long)row * I);
    soff[r] = scale_off<FMT>(row, BR, SK);
  }
  for (int j0 = warp; j0 < k; j0 += DS_WARPS * DS_KW) {
    float wj[DS_KW], GS[DS_KW], part[DS_KW][DS_ROWS];
    bool ok[DS_KW];
    down_parts<FMT, PACKED, DS_KW, DS_ROWS>(wsrc, ids, ids64, weights, h, j0, DS_WARPS, k, E, H, I, BC, roff, soff, wj,
                                            ok, GS, part);
#pragma unroll
    for (int c = 0; c < DS_KW; ++c) {
      const int j = j0 + c * DS_WARPS;
      if (j < k) {
#pragma unroll
        for (int r = 0; r < DS_ROWS; ++r) sp[j][r][lane] = FMT == 4 ? part[c][r] * GS[c] : part[c][r];
        if (lane == 0) {
          sw[j] = wj[c];
          sok[j] = ok[c];
        }
      }
    }
  }
  __syncthreads();
  const int r = warp;  // 4: row r's slots in order, as down's acc
  if (r >= DS_ROWS) return;  // warp-uniform
  float acc = 0.f;
  for (int j = 0; j < k; ++j)
    if (sok[j]) acc = fmaf(sw[j], sp[j][r][lane], acc);
  warp_sum<1>(&acc);
  if (lane == 0 && row0 + r < H) out[row0 + r] = acc;
}

// -- grouped kernels (larger T): slots bucketed by expert on the device ------------------------------------------
// moe_bucket(ids (S,), ids64, S, E, off (E + 1,) int32, order (S,) int32); grid 1, block BUCKET_THREADS:
//   order[off[e] .. off[e + 1]) = the slots routed to expert e (any order within a bucket: every slot is computed
//   alone, so the results do not depend on it). Slots with an id outside [0, E) are in no bucket.
#define BUCKET_THREADS 1024
#define BUCKET_MAX_E 4096
#define MOE_NT 4  // tokens sharing each weight load in the grouped kernels

// The exclusive prefix over a BUCKET_THREADS block of each thread's `local` (threads in order); *total: the sum.
__device__ __forceinline__ int bucket_scan(int local, int* wsum /* (BUCKET_THREADS / 32,) shared */, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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
  *total = wsum[BUCKET_THREADS / 32 - 1];
  return v - local + (warp ? wsum[warp - 1] : 0);
}

extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
    moe_bucket(const void* __restrict__ ids, int ids64, int S, int E, int* __restrict__ off,
               int* __restrict__ order) {
  pdl_begin();
  __shared__ int cnt[BUCKET_MAX_E];
  __shared__ int wsum[BUCKET_THREADS / 32];
  const int tid = threadIdx.x;
  for (int i = tid; i < E; i += BUCKET_THREADS) cnt[i] = 0;
  __syncthreads();
  for (int s = tid; s < S; s += BUCKET_THREADS) {
    const int e = load_id(ids, ids64, s);
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  const int per = (E + BUCKET_THREADS - 1) / BUCKET_THREADS;  // each thread scans a contiguous run of experts
  const int lo = min(tid * per, E), hi = min(lo + per, E);
  int local = 0, total;
  for (int i = lo; i < hi; ++i) local += cnt[i];
  int run = bucket_scan(local, wsum, &total);  // exclusive prefix of this thread's run
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

// moe_slot_blocks(off (E + 1,), E, bn, blocks (n,) int32, n); grid 1, block BUCKET_THREADS: the tensor-core
//   grouped kernels' work list (gemm_fp8.cu, moe_*_x3): every (expert e, c-th run of bn slots of its bucket) as
//   c << 16 | e, experts in order, then -1 up to n (the launch's grid, ceil(S / bn) + E: at least the list's
//   length), so a launch has no block per possible (expert, run) pair that mostly finds no slots. E < 65536 and
//   a bucket under 65536 runs.
extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
    moe_slot_blocks(const int* __restrict__ off, int E, int bn, int* __restrict__ blocks, int n) {
  pdl_begin();
  __shared__ int wsum[BUCKET_THREADS / 32];
  const int tid = threadIdx.x;
  const int per = (E + BUCKET_THREADS - 1) / BUCKET_THREADS;
  const int lo = min(tid * per, E), hi = min(lo + per, E);
  int local = 0, total;
  for (int e = lo; e < hi; ++e) local += (off[e + 1] - off[e] + bn - 1) / bn;
  int at = bucket_scan(local, wsum, &total);
  for (int e = lo; e < hi; ++e) {
    const int runs = (off[e + 1] - off[e] + bn - 1) / bn;
    for (int c = 0; c < runs && at < n; ++c) blocks[at++] = c << 16 | e;
  }
  for (int i = total + tid; i < n; i += BUCKET_THREADS) blocks[i] = -1;
}

// gate_up_g: grid (ceil(I / (ROWS * MOE_WARPS)), E); block y = expert e runs its bucket MOE_NT slots at a time,
// each weight load shared by those slots: h[s, i] = act(gate_i . x[s / k]) * (up_i . x[s / k]).
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void gate_up_grouped(const void* __restrict__ wsrc, const int* __restrict__ off,
                                                const int* __restrict__ order, const float* __restrict__ x,
                                                float* __restrict__ h, int k, int E, int I, int H, int BR, int BC,
                                                int SK, int act) {
  constexpr int NR = 2 * ROWS;
  const int e = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= I) return;  // warp-uniform
  const int beg = off[e], n = off[e + 1] - beg;
  if (n <= 0) return;  // block-uniform
  const unsigned char *G, *U, *SG, *SU;
  float GG, GU;
  expert_gate_up<FMT, PACKED>(wsrc, e, E, I, H, G, U, SG, SU, GG, GU);
  const unsigned char* rows[NR];
  const unsigned char* srow[NR];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = min(row0 + r, I - 1);
    rows[r] = G + nbytes<FMT>((long long)row * H);
    rows[ROWS + r] = U + nbytes<FMT>((long long)row * H);
    srow[r] = SG + scale_off<FMT>(row, BR, SK);
    srow[ROWS + r] = SU + scale_off<FMT>(row, BR, SK);
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
        for (int r = 0; r < ROWS; ++r) {
          const float g = FMT == 4 ? acc[t][r] * GG : acc[t][r];
          const float u = FMT == 4 ? acc[t][ROWS + r] * GU : acc[t][ROWS + r];
          if (row0 + r < I) h[(long long)slot[t] * I + row0 + r] = act_mul(g, u, act);
        }
      }
    }
  }
}

// down_g: grid (ceil(H / (ROWS * MOE_WARPS)), E): ys[s, n] = down_e[n] . h[s] for the slots s of expert e.
template <int FMT, int ROWS, bool PACKED>
__device__ __forceinline__ void down_grouped(const void* __restrict__ wsrc, const int* __restrict__ off,
                                             const int* __restrict__ order, const float* __restrict__ h,
                                             float* __restrict__ ys, int E, int H, int I, int BR, int BC, int SK) {
  const int e = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= H) return;  // warp-uniform
  const int beg = off[e], n = off[e + 1] - beg;
  if (n <= 0) return;
  const unsigned char *D, *S;
  float GS;
  expert_down<FMT, PACKED>(wsrc, e, E, H, I, D, S, GS);
  const unsigned char* rows[ROWS];
  const unsigned char* srow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = min(row0 + r, H - 1);
    rows[r] = D + nbytes<FMT>((long long)row * I);
    srow[r] = S + scale_off<FMT>(row, BR, SK);
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
          if (row0 + r < H) ys[(long long)slot[t] * H + row0 + r] = FMT == 4 ? acc[t][r] * GS : acc[t][r];
      }
    }
  }
}

// moe_combine(ids (T*k,), ids64, weights (T*k,) f32, ys (T*k, H) f32, out (T, H) f32, T, k, E, H); grid
// ceil(T * H / 256), block 256: out[t, n] = sum_j weights[t, j] * ys[t * k + j, n] over valid ids, j in order.
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const void* __restrict__ ids, int ids64, const float* __restrict__ weights,
                const float* __restrict__ ys, float* __restrict__ out, int T, int k, int E, int H) {
  pdl_begin();
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

// <fmt>: bf16, f16, f32, fp8, nvfp4 (table rows: 2 / 4 / 6 for gate_up, 1 / 2 / 3 for down: plain / fp8 / nvfp4);
// nvfp4 passes BR = 1, BC = 16, SK = K / 16.
// moe_gate_up_<fmt>_r<ROWS>(tab (rows, E) u64, ids (S,), ids64, x (T, H) f32, h (S, I) f32, S, k, E, I, H, BR, BC,
//                           SK, act); grid (ceil(I / (ROWS * MOE_WARPS)), min(S, 65535))
// moe_down_<fmt>_r<ROWS>(tab (rows, E) u64, ids, ids64, weights (S,) f32, h (S, I), out (T, H) f32, T, k, E, H, I,
//                        BR, BC, SK); grid (ceil(H / (ROWS * MOE_WARPS)), min(T, 65535))
// moe_gate_up_g_<fmt>_r<ROWS>(tab, off (E + 1,), order (S,), x, h, k, E, I, H, BR, BC, SK, act); grid (.., E)
// moe_down_g_<fmt>_r<ROWS>(tab, off, order, h, ys (S, H) f32, E, H, I, BR, BC, SK); grid (.., E)
// *_packed_*: the same with the base pointer of (E, 2I, H) / (E, H, I) in place of the table.
// Blocks per SM the one-slot-per-block gate/up kernels are compiled to fit (moe.py: LUMEN_CUDA_MOE_GATE_UP_BLOCKS
// builds this file with -DMOE_GATE_UP_MIN_BLOCKS=n); 1 leaves the registers to the compiler. Not applied where it
// would spill (nvfp4, 4 rows a warp).
#ifndef MOE_GATE_UP_MIN_BLOCKS
#define MOE_GATE_UP_MIN_BLOCKS 0
#endif
__host__ __device__ constexpr int gate_up_min_blocks(int fmt, int rows) {
  return (fmt == 4 || rows > 2) ? 0 : MOE_GATE_UP_MIN_BLOCKS;
}

#define MOE_KERNELS(NAME, FMT, ROWS, PACKED)                                                                   \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, gate_up_min_blocks(FMT, ROWS))                 \
      moe_gate_up_##NAME##_r##ROWS(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,     \
                                   const float* __restrict__ x, float* __restrict__ h, int S, int k, int E,    \
                                   int I, int H, int BR, int BC, int SK, int act) {                            \
    pdl_begin();                                                                                               \
    gate_up<FMT, ROWS, PACKED>(wsrc, ids, ids64, x, h, S, k, E, I, H, BR, BC, SK, act);                        \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_DOWN_MIN_BLOCKS)                          \
      moe_down_##NAME##_r##ROWS(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,        \
                                const float* __restrict__ weights, const float* __restrict__ h,                \
                                float* __restrict__ out, int T, int k, int E, int H, int I, int BR, int BC,    \
                                int SK) {                                                                      \
    pdl_begin();                                                                                               \
    down<FMT, ROWS, PACKED>(wsrc, ids, ids64, weights, h, out, T, k, E, H, I, BR, BC, SK);                     \
  }

// moe_gate_up_routed_<fmt>_r<ROWS>(tab (rows, E) u64, logits (1, Er) f32, shared (1,) f32 or null, ids (k [+ 1],)
//   int64, weights (k [+ 1],) f32, x (1, H) f32, h (k [+ 1], I) f32, k, Er, E, I, H, BR, BC, SK, act, normalize);
//   grid (ceil(I / (ROWS * MOE_WARPS)), k [+ 1]); Er <= ROUTED_MAX_E, k <= 32 (gate_up_routed)
#define MOE_ROUTED(NAME, FMT, ROWS)                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, gate_up_min_blocks(FMT, ROWS))                 \
      moe_gate_up_routed_##NAME##_r##ROWS(const void* __restrict__ wsrc, const float* __restrict__ logits,    \
                                          const float* __restrict__ shared, long long* __restrict__ ids,       \
                                          float* __restrict__ w, const float* __restrict__ x,                  \
                                          float* __restrict__ h, int k, int Er, int E, int I, int H, int BR,   \
                                          int BC, int SK, int act, int normalize) {                            \
    pdl_begin();                                                                                               \
    gate_up_routed<FMT, ROWS>(wsrc, logits, shared, ids, w, x, h, k, Er, E, I, H, BR, BC, SK, act, normalize); \
  }

#define MOE_GROUPED(NAME, FMT, ROWS, PACKED)                                                                   \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                \
      moe_gate_up_g_##NAME##_r##ROWS(const void* __restrict__ wsrc, const int* __restrict__ off,              \
                                     const int* __restrict__ order, const float* __restrict__ x,               \
                                     float* __restrict__ h, int k, int E, int I, int H, int BR, int BC,        \
                                     int SK, int act) {                                                        \
    pdl_begin();                                                                                               \
    gate_up_grouped<FMT, ROWS, PACKED>(wsrc, off, order, x, h, k, E, I, H, BR, BC, SK, act);                   \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                \
      moe_down_g_##NAME##_r##ROWS(const void* __restrict__ wsrc, const int* __restrict__ off,                 \
                                  const int* __restrict__ order, const float* __restrict__ h,                  \
                                  float* __restrict__ ys, int E, int H, int I, int BR, int BC, int SK) {       \
    pdl_begin();                                                                                               \
    down_grouped<FMT, ROWS, PACKED>(wsrc, off, order, h, ys, E, H, I, BR, BC, SK);                             \
  }

// moe_down_split_<fmt>(tab or packed base, ids, ids64, weights (k,) f32, h (k, I), out (1, H) f32, k, E, H, I, BR,
//                      BC, SK); grid ceil(H / DS_ROWS), k <= DS_MAX_S (down_split)
#define MOE_SPLIT(NAME, FMT, PACKED)                                                                           \
  extern "C" __global__ void __launch_bounds__(DS_WARPS * 32, 8)                                            \
      moe_down_split_##NAME(const void* __restrict__ wsrc, const void* __restrict__ ids, int ids64,            \
                            const float* __restrict__ weights, const float* __restrict__ h,                    \
                            float* __restrict__ out, int k, int E, int H, int I, int BR, int BC, int SK) {     \
    pdl_begin();                                                                                               \
    down_split<FMT, PACKED>(wsrc, ids, ids64, weights, h, out, k, E, H, I, BR, BC, SK);                        \
  }

#define MOE_R(NAME, FMT, PACKED)      \
  MOE_KERNELS(NAME, FMT, 1, PACKED)   \
  MOE_KERNELS(NAME, FMT, 2, PACKED)   \
  MOE_KERNELS(NAME, FMT, 4, PACKED)   \
  MOE_GROUPED(NAME, FMT, 2, PACKED)   \
  MOE_GROUPED(NAME, FMT, 4, PACKED)

MOE_SPLIT(bf16, 0, false)
MOE_SPLIT(f16, 1, false)
MOE_SPLIT(f32, 2, false)
MOE_SPLIT(fp8, 3, false)
MOE_SPLIT(packed_bf16, 0, true)
MOE_SPLIT(packed_f16, 1, true)
MOE_SPLIT(packed_f32, 2, true)
MOE_R(bf16, 0, false)
MOE_R(f16, 1, false)
MOE_R(f32, 2, false)
MOE_R(fp8, 3, false)
MOE_R(nvfp4, 4, false)
MOE_ROUTED(bf16, 0, 2)
MOE_ROUTED(f16, 1, 2)
MOE_ROUTED(f32, 2, 2)
MOE_ROUTED(fp8, 3, 2)
MOE_ROUTED(nvfp4, 4, 2)
MOE_R(packed_bf16, 0, true)
MOE_R(packed_f16, 1, true)
MOE_R(packed_f32, 2, true)
