// Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * (w + offset), one block per row, f32 throughout.
// x (T, D) f32 contiguous; w (D,) f32 or null (no weight); y (T, D) f32. Same semantics as the CPU op
// (offset adds to w; with offset == 0 the weight is used as is). Block: a multiple of 32 threads, <= 1024.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#include "act.cuh"
#include "pdl.cuh"

#define RMS_VPT 8  // values per thread kept in registers (D <= 8 x threads); larger rows re-read x

// The sum of v over the block, the same value in every thread (partial: 32 floats of shared memory).
__device__ __forceinline__ float block_sum(float v, float* partial) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? partial[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) partial[0] = v;
  }
  __syncthreads();
  return partial[0];
}


// One row; gate (T, D) or nullptr: with it, rms_norm_gated's y = rms_norm(x, w) * silu(gate), the norm's value
// rounded to f32 first, as the unfused ops (rms_norm, then mul_silu) round it. res (T, D) or nullptr: with it the
// row normed is x + res (one f32 add, as the unfused add), also written to sum.
__device__ __forceinline__ void rms_row(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ gate, const float* __restrict__ res,
                                        float* __restrict__ sum, float* __restrict__ y, int D, float eps,
                                        float offset) {
  __shared__ float partial[32];
  const long long base = (long long)blockIdx.x * D;
  const float* xr = x + base;
  const float* gr = gate != nullptr ? gate + base : nullptr;
  const float* rr = res != nullptr ? res + base : nullptr;
  float* sr = res != nullptr ? sum + base : nullptr;
  float* yr = y + base;
  const int nt = blockDim.x;
  if (D <= RMS_VPT * nt) {  // block-uniform: x and w held in registers, both loaded before the reduction
    float xv[RMS_VPT], wv[RMS_VPT];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_VPT; ++j) {
      const int i = threadIdx.x + j * nt;
      xv[j] = i < D ? xr[i] : 0.f;
      wv[j] = (w != nullptr && i < D) ? w[i] : 1.f;
      if (rr != nullptr && i < D) {
        xv[j] += rr[i];
        sr[i] = xv[j];
      }
    }
#pragma unroll
    for (int j = 0; j < RMS_VPT; ++j) ss = fmaf(xv[j], xv[j], ss);
    const float r = 1.0f / sqrtf(block_sum(ss, partial) / (float)D + eps);
#pragma unroll
    for (int j = 0; j < RMS_VPT; ++j) {
      const int i = threadIdx.x + j * nt;
      if (i < D) {
        float v = xv[j] * r;
        if (w != nullptr) v *= offset != 0.f ? wv[j] + offset : wv[j];
        yr[i] = gr != nullptr ? mul_silu(v, gr[i]) : v;
      }
    }
    return;
  }
  float ss = 0.f;
  if (rr != nullptr) {  // the sum first, so the loops below read it like x
    for (int i = threadIdx.x; i < D; i += nt) sr[i] = xr[i] + rr[i];
    __syncthreads();
    xr = sr;
  }
  for (int i = threadIdx.x; i < D; i += nt) {
    const float v = xr[i];
    ss = fmaf(v, v, ss);
  }
  const float r = 1.0f / sqrtf(block_sum(ss, partial) / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += nt) {
    float v = xr[i] * r;
    if (w != nullptr) v *= offset != 0.f ? w[i] + offset : w[i];
    yr[i] = gr != nullptr ? mul_silu(v, gr[i]) : v;
  }
}

extern "C" __global__ void rms_norm_f32(const float* __restrict__ x,  // (T, D) f32
                                        const float* __restrict__ w,  // (D,) f32, or nullptr
                                        float* __restrict__ y,        // (T, D) f32
                                        int D, float eps, float offset) {
  pdl_begin();
  rms_row(x, w, nullptr, nullptr, nullptr, y, D, eps, offset);
}

// add_rms_norm_f32(x (T, D), res (T, D), w (D,) or nullptr, sum (T, D), y (T, D), D, eps, offset): sum = x + res and
// y = rms_norm(sum, w) in one launch (a residual add and the next norm).
extern "C" __global__ void add_rms_norm_f32(const float* __restrict__ x, const float* __restrict__ res,
                                            const float* __restrict__ w, float* __restrict__ sum,
                                            float* __restrict__ y, int D, float eps, float offset) {
  pdl_begin();
  rms_row(x, w, nullptr, res, sum, y, D, eps, offset);
}

// rms_norm_gated_f32(x (T, D), gate (T, D), w (D,) or nullptr, y (T, D), D, eps): rms_norm(x, w) * silu(gate) in
// one pass (the Gated-DeltaNet output norm: one launch where rms_norm and mul_silu took two).
extern "C" __global__ void rms_norm_gated_f32(const float* __restrict__ x, const float* __restrict__ gate,
                                              const float* __restrict__ w, float* __restrict__ y, int D, float eps) {
  pdl_begin();
  rms_row(x, w, gate, nullptr, nullptr, y, D, eps, 0.f);
}
