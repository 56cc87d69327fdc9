// NVFP4 (ModelOpt layout) dequantization: W (R, K) f32 from packed E2M1 codes and e4m3 block scales.
//
// data (R, K/2) uint8, two codes a byte, element 2j in the low nibble and 2j+1 in the high one; a code is
// sign << 3 | index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. scales (R, K/16) e4m3fn bytes, one per 16 consecutive
// values of a row; gs the f32 global scale. A value is (e2m1 * block scale) * gs, in that order: the first
// product is exact in f32, the second rounds once, as on the CPU (lumen_cpu/nvfp4.py): bit-identical results.
// One thread per packed byte (grid-stride); out (R, K) f32 contiguous. K % 16 == 0 (the loader checks).
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

__device__ __forceinline__ float e2m1_value(unsigned int code) {
  // index 0..3 -> i / 2 = {0, 0.5, 1, 1.5}; 4..7 -> (2 + (i & 1)) << (i / 2 - 2) = {2, 3, 4, 6}: exact.
  const unsigned int i = code & 7u;
  const float mag = i < 4u ? (float)i * 0.5f : (float)((2u + (i & 1u)) << ((i >> 1) - 2u));
  return (code & 8u) ? -mag : mag;
}

__device__ __forceinline__ float e4m3fn_value(unsigned int b) {
  const unsigned int e = (b >> 3) & 15u, m = b & 7u;
  float v;
  if (e == 15u && m == 7u) {
    v = __uint_as_float(0x7fc00000u);  // NaN (e4m3fn has no infinities)
  } else if (e == 0u) {
    v = (float)m * 0.001953125f;  // subnormal: m / 8 * 2^-6, exact
  } else {
    v = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e - 7)
  }
  return (b & 0x80u) ? -v : v;
}

extern "C" __global__ void nvfp4_dequantize(const unsigned char* __restrict__ data,    // (R, K/2)
                                            const unsigned char* __restrict__ scales,  // (R, K/16) e4m3
                                            float* __restrict__ out,                   // (R, K) f32
                                            long long rows, int K, float gs) {
  const long long half = K / 2, n = rows * half;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / half, c = i - r * half;
    const float s = e4m3fn_value(scales[r * (K / 16) + c / 8]);
    const unsigned int b = data[i];
    const float lo = e2m1_value(b & 15u) * s, hi = e2m1_value(b >> 4) * s;
    float2 v;
    v.x = lo * gs;
    v.y = hi * gs;
    reinterpret_cast<float2*>(out)[i] = v;
  }
}
