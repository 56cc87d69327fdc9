// Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * (w + offset), one block per row, f32 throughout.
// x (T, D) f32 contiguous; w (D,) f32 or null (no weight); y (T, D) f32. Same semantics as the CPU op
// (offset adds to w; with offset == 0 the weight is used as is). Block: a multiple of 32 threads, <= 1024.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

extern "C" __global__ void rms_norm_f32(const float* __restrict__ x,  // (T, D) f32
                                        const float* __restrict__ w,  // (D,) f32, or nullptr
                                        float* __restrict__ y,        // (T, D) f32
                                        int D, float eps, float offset) {
  __shared__ float partial[32];
  const long long base = (long long)blockIdx.x * D;
  const float* xr = x + base;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = xr[i];
    ss = fmaf(v, v, ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    ss = lane < nwarps ? partial[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) partial[0] = ss;
  }
  __syncthreads();
  const float r = 1.0f / sqrtf(partial[0] / (float)D + eps);
  float* yr = y + base;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float v = xr[i] * r;
    if (w != nullptr) v *= offset != 0.f ? w[i] + offset : w[i];
    yr[i] = v;
  }
}
