// Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * (w + offset), one block per row, f32 throughout.
// x (T, D) f32 contiguous; w (D,) f32 or null (no weight); y (T, D) f32. Same semantics as the CPU op
// (offset adds to w; with offset == 0 the weight is used as is). Block: a multiple of 32 threads, <= 1024.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

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

extern "C" __global__ void rms_norm_f32(const float* __restrict__ x,  // (T, D) f32
                                        const float* __restrict__ w,  // (D,) f32, or nullptr
                                        float* __restrict__ y,        // (T, D) f32
                                        int D, float eps, float offset) {
  __shared__ float partial[32];
  const long long base = (long long)blockIdx.x * D;
  const float* xr = x + base;
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
        yr[i] = v;
      }
    }
    return;
  }
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += nt) {
    const float v = xr[i];
    ss = fmaf(v, v, ss);
  }
  const float r = 1.0f / sqrtf(block_sum(ss, partial) / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += nt) {
    float v = xr[i] * r;
    if (w != nullptr) v *= offset != 0.f ? w[i] + offset : w[i];
    yr[i] = v;
  }
}
