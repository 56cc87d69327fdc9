// Prefill for fp8 / NVFP4 weights on the tensor cores: dequantize a slab of weight rows straight into two bf16
// matrices, W_hi = bf16(W) and W_lo = bf16(W - W_hi) (both rounded to nearest even), where W is the f32 value
// exactly as the f32 dequantization computes it (gemv.dequantize_fp8 / kernels/nvfp4.cu, and the CPU backend).
// gemv.py then runs y = x_hi.W_hi^T + x_lo.W_hi^T + x_hi.W_lo^T as three cuBLAS bf16 GEMMs with f32 accumulation.
//
// Both kernels fill rows row0 .. row0 + rows of the weight into hi / lo (rows, K) uint16 (bf16 bits), C-contiguous;
// the weight arrays are passed whole (row0 indexes them, and the fp8 scale rows). Grid-stride loops, 64-bit
// indices. No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).
//
// The products use __fmul_rn so that the compiler cannot contract W = v * s with the later W - W_hi into an FMA
// (which would split the exact product instead of the f32 value the other paths compute).

// e4m3fn byte -> f32, exact (the same function as kernels/nvfp4.cu; NaN at 0x7f / 0xff as gemv.e4m3_to_f32).
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

// E2M1 code (sign << 3 | index) -> f32, exact (the same function as kernels/nvfp4.cu).
__device__ __forceinline__ float e2m1_value(unsigned int code) {
  const unsigned int i = code & 7u;
  const float mag = i < 4u ? (float)i * 0.5f : (float)((2u + (i & 1u)) << ((i >> 1) - 2u));
  return (code & 8u) ? -mag : mag;
}

// bf16 round to nearest even on the f32 bits: the arithmetic of gemv.bf16_split.
__device__ __forceinline__ unsigned int bf16_rne(unsigned int u) {
  return (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
}

// x -> (hi, lo) bf16 bits with hi = bf16(x) and lo = bf16(x - hi); x - hi is exact in f32. Infinity / NaN (and a
// finite value that rounds up to infinity) give hi = bf16(x) (a quiet NaN for NaN) and lo = 0, never inf - inf.
__device__ __forceinline__ void bf16_split1(float x, unsigned short& hi, unsigned short& lo) {
  const unsigned int u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    hi = (unsigned short)((u >> 16) | ((u & 0x007fffffu) ? 0x0040u : 0u));
    lo = 0;
    return;
  }
  const unsigned int h = bf16_rne(u);
  if ((h & 0x7f80u) == 0x7f80u) {  // rounded up to infinity
    hi = (unsigned short)h;
    lo = 0;
    return;
  }
  const float rest = __fsub_rn(x, __uint_as_float(h << 16));
  hi = (unsigned short)h;
  lo = (unsigned short)bf16_rne(__float_as_uint(rest));
}

// FP8 E4M3: W[n, k] = e4m3(w[n, k]) * S[(n / BR) * SK + k / BC], one f32 multiply (gemv.dequantize_fp8).
// w (N, K) e4m3 bytes; S f32 contiguous: (ceil(N/BR), SK) blocks, per-channel (N,) with BR = 1, SK = 1 and
// BC >= K, per-tensor (1,) with BR = N, SK = 1, BC >= K (gemv.fp8_block). One thread per element.
extern "C" __global__ void dequant_split_fp8(const unsigned char* __restrict__ w,  // (N, K) e4m3
                                             const float* __restrict__ S,          // scales, see above
                                             unsigned short* __restrict__ hi,      // (rows, K) bf16 bits
                                             unsigned short* __restrict__ lo,      // (rows, K) bf16 bits
                                             long long row0, long long rows, int K, int BR, int BC, int SK) {
  const long long n = rows * K;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / K, c = i - r * K, row = row0 + r;
    const float s = S[(row / BR) * SK + c / BC];
    const float v = __fmul_rn(e4m3fn_value(w[row * K + c]), s);
    unsigned short h, l;
    bf16_split1(v, h, l);
    hi[i] = h;
    lo[i] = l;
  }
}

// NVFP4: W[n, k] = (e2m1 * block scale) * gs, in that order (kernels/nvfp4.cu: the first product exact, the
// second rounds once). data (N, K/2) packed codes, element 2j in the low nibble; scales (N, K/16) e4m3 bytes;
// K % 16 == 0. One thread per packed byte (two elements, one 4-byte store into hi and one into lo).
// The same for K % 8 == 0 and BC % 8 == 0 (one scale per 8 values), 8 values a thread: one 8-byte load, two
// 16-byte stores, 32-bit index arithmetic. grid (ceil(K / 8 / 128), min(rows, 65535)), 128 threads; row0 + rows
// <= N < 2^31.
extern "C" __global__ void dequant_split_fp8_v8(const unsigned char* __restrict__ w, const float* __restrict__ S,
                                                unsigned short* __restrict__ hi, unsigned short* __restrict__ lo,
                                                int row0, int rows, int K, int BR, int BC, int SK) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= K) return;
  const int cb = c / BC;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const int row = row0 + r;
    const float s = S[(long long)(row / BR) * SK + cb];
    const uint2 b = *reinterpret_cast<const uint2*>(w + (long long)row * K + c);
    const unsigned int u[2] = {b.x, b.y};
    unsigned short h[8], l[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = __fmul_rn(e4m3fn_value((u[j >> 2] >> (8 * (j & 3))) & 0xffu), s);
      bf16_split1(v, h[j], l[j]);
    }
    uint4 ho, lo4;
    ho.x = h[0] | ((unsigned int)h[1] << 16); ho.y = h[2] | ((unsigned int)h[3] << 16);
    ho.z = h[4] | ((unsigned int)h[5] << 16); ho.w = h[6] | ((unsigned int)h[7] << 16);
    lo4.x = l[0] | ((unsigned int)l[1] << 16); lo4.y = l[2] | ((unsigned int)l[3] << 16);
    lo4.z = l[4] | ((unsigned int)l[5] << 16); lo4.w = l[6] | ((unsigned int)l[7] << 16);
    *reinterpret_cast<uint4*>(hi + (long long)r * K + c) = ho;
    *reinterpret_cast<uint4*>(lo + (long long)r * K + c) = lo4;
  }
}

extern "C" __global__ void dequant_split_nvfp4(const unsigned char* __restrict__ data,    // (N, K/2)
                                               const unsigned char* __restrict__ scales,  // (N, K/16) e4m3
                                               unsigned short* __restrict__ hi,           // (rows, K) bf16 bits
                                               unsigned short* __restrict__ lo,           // (rows, K) bf16 bits
                                               long long row0, long long rows, int K, float gs) {
  const long long half = K / 2, n = rows * half;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / half, c = i - r * half, row = row0 + r;
    const float s = e4m3fn_value(scales[row * (K / 16) + c / 8]);
    const unsigned int b = data[row * half + c];
    const float v0 = __fmul_rn(__fmul_rn(e2m1_value(b & 15u), s), gs);
    const float v1 = __fmul_rn(__fmul_rn(e2m1_value(b >> 4), s), gs);
    unsigned short h0, l0, h1, l1;
    bf16_split1(v0, h0, l0);
    bf16_split1(v1, h1, l1);
    reinterpret_cast<unsigned int*>(hi)[i] = (unsigned int)h0 | ((unsigned int)h1 << 16);
    reinterpret_cast<unsigned int*>(lo)[i] = (unsigned int)l0 | ((unsigned int)l1 << 16);
  }
}

// The same, 16 values (8 packed bytes, one block scale) a thread, 32-bit index arithmetic; K % 16 == 0.
// grid (ceil(K / 16 / 128), min(rows, 65535)), 128 threads.
extern "C" __global__ void dequant_split_nvfp4_v16(const unsigned char* __restrict__ data,
                                                   const unsigned char* __restrict__ scales,
                                                   unsigned short* __restrict__ hi, unsigned short* __restrict__ lo,
                                                   int row0, int rows, int K, float gs) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;  // group of 16 values in the row
  if (g * 16 >= K) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const int row = row0 + r;
    const float s = e4m3fn_value(scales[(long long)row * (K / 16) + g]);
    const uint2 b = *reinterpret_cast<const uint2*>(data + (long long)row * (K / 2) + g * 8);
    const unsigned int u[2] = {b.x, b.y};
    unsigned int ho[8], lo8[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // byte j holds values 2j (low nibble) and 2j + 1
      const unsigned int byte = (u[j >> 2] >> (8 * (j & 3))) & 0xffu;
      const float v0 = __fmul_rn(__fmul_rn(e2m1_value(byte & 15u), s), gs);
      const float v1 = __fmul_rn(__fmul_rn(e2m1_value(byte >> 4), s), gs);
      unsigned short h0, l0, h1, l1;
      bf16_split1(v0, h0, l0);
      bf16_split1(v1, h1, l1);
      ho[j] = (unsigned int)h0 | ((unsigned int)h1 << 16);
      lo8[j] = (unsigned int)l0 | ((unsigned int)l1 << 16);
    }
    uint4* hp = reinterpret_cast<uint4*>(hi + (long long)r * K + g * 16);
    uint4* lp = reinterpret_cast<uint4*>(lo + (long long)r * K + g * 16);
    hp[0] = make_uint4(ho[0], ho[1], ho[2], ho[3]);
    hp[1] = make_uint4(ho[4], ho[5], ho[6], ho[7]);
    lp[0] = make_uint4(lo8[0], lo8[1], lo8[2], lo8[3]);
    lp[1] = make_uint4(lo8[4], lo8[5], lo8[6], lo8[7]);
  }
}
