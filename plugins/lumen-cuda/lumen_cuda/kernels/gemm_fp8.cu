// fp8 prefill GEMMs on the tensor cores (issue 21; opt-in LUMEN_CUDA_MMA_PREFILL=exact | e4m3, lumen_cuda/fp8_mma.py;
// docs/cuda.md, "Tensor-core prefill for fp8 and routed experts"). The kernels:
//  - gemm_fp8_x3 ("exact", at the end of this file): bf16 tensor cores, the activations as three bf16 planes, f32-exact
//    products;
//  - gemm_fp8_mma ("e4m3", below): e4m3 tensor cores, the activations quantized to e4m3 too (lossy, like vLLM's
//    block-fp8 linear);
//  - gemm_nvfp4_x3 ("exact"): the same for NVFP4 weights (e2m1 x block scale exact in bf16);
//  - moe_fp8_x3 / moe_bf16_x3 / moe_nvfp4_x3 ("exact", routed experts): the x3 block over one expert's bucketed
//    slots.
// lumen_cuda/fp8_mma_model.py does both kernels' arithmetic in numpy.
//
// e4m3: y (T, N) f32 = x (T, K) . W (N, K)^T where W is e4m3 codes with f32 block scales sw (N/128, K/128) (the
// checkpoints' weight_scale_inv, 128 x 128 blocks) and x is quantized per token and 128 columns: sx[t, kb] = amax /
// 448, xq = e4m3(x / sx) (nearest, ties to even, saturated). For each 128-column block kb the codes' products are
// summed by
//   mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32
// (sm_89 and later: Ada, Hopper, Blackwell including SM120; A = 16 weight rows x 32 k, B = 32 k x 8 tokens) into a
// block accumulator, which the kernel then adds into the output's: acc += blk * (sw[n/128, kb] * sx[t, kb]) (one f32
// multiply of the two scales, one FMA).
//
// Fragments (the PTX ISA's tables for m16n8k32 with 8-bit types; lane = 4 g + t): a0 = row g, k 4t..4t+3; a1 = row
// g+8, same k; a2 = row g, k 16+4t..; a3 = row g+8, k 16+4t..; b0 = token g, k 4t..4t+3; b1 = token g, k 16+4t..;
// c0, c1 = row g, tokens 2t, 2t+1; c2, c3 = row g+8, tokens 2t, 2t+1. The lowest k sits in a register's low byte.
//
// A block computes 128 weight rows (one row block of scales) x 64 tokens with 8 warps (4 x 2, each 32 rows x 32
// tokens: 2 x 4 MMAs per 32 k); shared memory holds 64 columns of each tile per stage, two stages filled by cp.async
// (rows of 64 bytes padded to 80: the fragment reads of a warp hit 32 different banks). Rows past N and tokens past
// T are zero-filled and never written. Requires K % 128 == 0 (the host checks).
//
// No headers: compiles under NVRTC and nvcc alike. Below sm_89 the e4m3 instructions are compiled out and trap (the
// host never launches either GEMM there); the quantizer and the planes are plain CUDA.

#define FP8_BM 128
#define FP8_BN 64
#define FP8_BK 64
#define FP8_LD 80  // bytes a shared row: 64 + 16 of padding

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define LUMEN_FP8_MMA 1
#else
#define LUMEN_FP8_MMA 0
#endif

// 1 where this module was compiled with the e4m3 instructions (sm_89 and later), else 0: the host checks it once.
extern "C" __global__ void fp8_mma_native(int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = LUMEN_FP8_MMA;
}

// ---- the activation quantizer ---------------------------------------------------------------------------------
// f32 a >= 0 (finite) -> the nearest e4m3fn magnitude code, ties to even, saturated to 448 (0x7e); the same bit
// arithmetic as mma_sm120.cu's e4m3_rne and gemm_fp8.model_e4m3.
__device__ __forceinline__ unsigned int fp8_e4m3_rne(float a) {
  if (!(a > 0.0f)) return 0u;
  if (a >= 448.0f) return 0x7eu;
  if (a < 0.015625f) return (unsigned int)__float2int_rn(__fmul_rn(a, 512.0f));  // subnormals: multiples of 2^-9
  const unsigned int u = __float_as_uint(a);
  unsigned int e = (u >> 23) - 120u, m = (u >> 20) & 7u;
  const unsigned int rest = u & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (m & 1u))) {
    if (++m == 8u) { m = 0u; ++e; }
  }
  const unsigned int code = (e << 3) | m;
  return code > 0x7eu ? 0x7eu : code;
}

// x (T, K) f32 -> xq (T, K) e4m3 bytes, sx (T, K/128) f32. Grid (T, K/128), 32 threads: a warp a (token, block),
// four consecutive values a lane.
extern "C" __global__ void fp8_quantize_x(const float* __restrict__ x, unsigned int* __restrict__ xq,
                                          float* __restrict__ sx, int K) {
  const int t = blockIdx.x, kb = blockIdx.y, lane = threadIdx.x;
  const float4 v = reinterpret_cast<const float4*>(x + (size_t)t * K + kb * 128)[lane];
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  const float vals[4] = {v.x, v.y, v.z, v.w};
  unsigned int word = 0u;
  for (int i = 0; i < 4; i++) {
    const unsigned int code = fp8_e4m3_rne(__fdiv_rn(fabsf(vals[i]), s)) | (vals[i] < 0.0f ? 0x80u : 0u);
    word |= code << (8 * i);
  }
  xq[((size_t)t * K + kb * 128) / 4 + lane] = word;
  if (lane == 0) sx[(size_t)t * (K / 128) + kb] = s;
}

// ---- the GEMM -----------------------------------------------------------------------------------------------------
__device__ __forceinline__ void fp8_cp16(void* smem, const void* gmem, bool full) {
  unsigned int dst;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(dst) : "l"(smem));
  const int bytes = full ? 16 : 0;  // 0: zero-fill (rows past N, tokens past T; gmem is then any valid address)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void fp8_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void fp8_cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void fp8_cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One stage: columns k0 .. k0 + 63 of the block's 128 weight rows (512 16-byte pieces) and 64 tokens (256 pieces).
__device__ __forceinline__ void fp8_load_stage(unsigned char* sw, unsigned char* sx, const unsigned char* W,
                                               const unsigned char* X, int N, int T, int K, int row0, int tok0,
                                               int k0) {
  const int tid = threadIdx.x;
  for (int p = tid; p < FP8_BM * 4; p += 256) {
    const int r = p >> 2, c = (p & 3) * 16, row = row0 + r;
    const bool ok = row < N;
    fp8_cp16(sw + r * FP8_LD + c, W + (size_t)(ok ? row : 0) * K + k0 + c, ok);
  }
  {
    const int r = tid >> 2, c = (tid & 3) * 16, tok = tok0 + r;
    const bool ok = tok < T;
    fp8_cp16(sx + r * FP8_LD + c, X + (size_t)(ok ? tok : 0) * K + k0 + c, ok);
  }
}

__device__ __forceinline__ void fp8_mma(float* c, const unsigned int* a, const unsigned int* b) {
#if LUMEN_FP8_MMA
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

// A warp's 32 x 8 JN accumulators into y (rows of N): weight row r = row0 + wm * 32 + 16 i + g (+ 8), the block's
// token c = wn * 8 JN + 8 j + 2 t (+ 1) to output row dst[c] (-1: none).
template <int JN = 4>
__device__ __forceinline__ void frag_store(const float (&acc)[2][JN][4], float* __restrict__ y, int N, int row0,
                                           int wm, int wn, int g, int t, const int* dst) {
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < JN; j++) {
      const int r = row0 + wm * 32 + 16 * i + g, c = wn * 8 * JN + 8 * j + 2 * t;
      const int d0 = dst[c], d1 = dst[c + 1];
      if (r < N && d0 >= 0) y[(size_t)d0 * N + r] = acc[i][j][0];
      if (r < N && d1 >= 0) y[(size_t)d1 * N + r] = acc[i][j][1];
      if (r + 8 < N && d0 >= 0) y[(size_t)d0 * N + r + 8] = acc[i][j][2];
      if (r + 8 < N && d1 >= 0) y[(size_t)d1 * N + r + 8] = acc[i][j][3];
    }
}

// y (T, N) f32 = dequant(xq, sx) . dequant(W, sw)^T. W (N, K) e4m3 bytes, sw (ceil(N/128), K/128) f32; xq (T, K)
// e4m3 bytes, sx (T, K/128) f32. Grid (ceil(T/64), ceil(N/128)), 256 threads.
extern "C" __global__ void __launch_bounds__(256) gemm_fp8_mma(const unsigned char* __restrict__ W,
                                                               const float* __restrict__ sw,
                                                               const unsigned char* __restrict__ X,
                                                               const float* __restrict__ sx, float* __restrict__ y,
                                                               int N, int K, int T) {
  __shared__ __align__(16) unsigned char s_w[2][FP8_BM * FP8_LD];
  __shared__ __align__(16) unsigned char s_x[2][FP8_BN * FP8_LD];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wm = warp >> 1, wn = warp & 1;  // warp tile: rows wm * 32 .., tokens wn * 32 ..
  const int row0 = blockIdx.y * FP8_BM, tok0 = blockIdx.x * FP8_BN, KB = K / 128, steps = K / FP8_BK;
  float acc[2][4][4], blk[2][4][4];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++)
      for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f, blk[i][j][q] = 0.0f;

  fp8_load_stage(s_w[0], s_x[0], W, X, N, T, K, row0, tok0, 0);
  fp8_cp_commit();
  for (int s = 0; s < steps; s++) {
    if (s + 1 < steps) {
      fp8_load_stage(s_w[(s + 1) & 1], s_x[(s + 1) & 1], W, X, N, T, K, row0, tok0, (s + 1) * FP8_BK);
      fp8_cp_commit();
      fp8_cp_wait1();
    } else {
      fp8_cp_wait0();
    }
    __syncthreads();
    const unsigned char* cw = s_w[s & 1];
    const unsigned char* cx = s_x[s & 1];
    for (int kk = 0; kk < FP8_BK; kk += 32) {
      unsigned int a[2][4], b[4][2];
      for (int i = 0; i < 2; i++) {
        const unsigned char* r = cw + (wm * 32 + 16 * i + g) * FP8_LD + kk + 4 * t;
        a[i][0] = *reinterpret_cast<const unsigned int*>(r);
        a[i][1] = *reinterpret_cast<const unsigned int*>(r + 8 * FP8_LD);
        a[i][2] = *reinterpret_cast<const unsigned int*>(r + 16);
        a[i][3] = *reinterpret_cast<const unsigned int*>(r + 8 * FP8_LD + 16);
      }
      for (int j = 0; j < 4; j++) {
        const unsigned char* r = cx + (wn * 32 + 8 * j + g) * FP8_LD + kk + 4 * t;
        b[j][0] = *reinterpret_cast<const unsigned int*>(r);
        b[j][1] = *reinterpret_cast<const unsigned int*>(r + 16);
      }
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) fp8_mma(blk[i][j], a[i], b[j]);
    }
    __syncthreads();  // the stage is refilled next step
    if ((s & 1) == 1) {  // a 128-column block done: scale it into the output's accumulators
      const int kb = s >> 1;
      const float w_s = sw[(size_t)blockIdx.y * KB + kb];
      for (int j = 0; j < 4; j++) {
        const int ta = tok0 + wn * 32 + 8 * j + 2 * t;
        const float x0 = ta < T ? sx[(size_t)ta * KB + kb] : 0.0f;
        const float x1 = ta + 1 < T ? sx[(size_t)(ta + 1) * KB + kb] : 0.0f;
        const float s0 = w_s * x0, s1 = w_s * x1;
        for (int i = 0; i < 2; i++) {
          acc[i][j][0] = fmaf(blk[i][j][0], s0, acc[i][j][0]);
          acc[i][j][1] = fmaf(blk[i][j][1], s1, acc[i][j][1]);
          acc[i][j][2] = fmaf(blk[i][j][2], s0, acc[i][j][2]);
          acc[i][j][3] = fmaf(blk[i][j][3], s1, acc[i][j][3]);
          for (int q = 0; q < 4; q++) blk[i][j][q] = 0.0f;
        }
      }
    }
  }
  __shared__ int dst[FP8_BN];
  if (threadIdx.x < FP8_BN) dst[threadIdx.x] = tok0 + (int)threadIdx.x < T ? tok0 + (int)threadIdx.x : -1;
  __syncthreads();
  frag_store(acc, y, N, row0, wm, wn, g, t, dst);
}

// ==== the exact variant (LUMEN_CUDA_MMA_PREFILL=exact): bf16 tensor cores, f32-exact products ========================
// An e4m3 weight value is exact in bf16 (4 significant bits); each activation goes in as three bf16 planes whose sum
// is its f32 value exactly (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid: 24 significant bits in three 8s;
// fp8_x_planes). So every product W x is exact in f32 and
//   y[t, n] = sum over 128-column blocks kb of sw[n/128, kb] * (sum over the block of W[n, k] (hi + mid + lo)[t, k])
// differs from the f32 product of the dequantized weight only in rounding order (the block sums in f32 by
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, three MMAs a fragment pair, then one FMA a block), not in
// the activations' precision: no opt-in needed once measured. The weight bytes are read as stored (no dequantized
// copy): e4m3 pairs become bf16 pairs in registers (cvt.rn.f16x2.e4m3x2, exact, then f32 and bf16x2).
//
// m16n8k16 bf16 fragments (PTX ISA tables; lane = 4 g + t): a0 = row g, k 2t, 2t+1; a1 = row g+8, same k; a2 = row
// g, k 2t+8, 2t+9; a3 = row g+8, k 2t+8..; b0 = token g, k 2t, 2t+1; b1 = token g, k 2t+8, 2t+9; c as above; the
// lower k in the lower half of a register. Block: 128 weight rows x 64 tokens, 8 warps of 32 x 32; stages of BK
// columns (weight rows and plane rows padded by 16 bytes: conflict-free fragment reads) in dynamic shared memory,
// X3_STAGES of them, cp.async keeping X3_STAGES - 1 in flight (X3 below; 2 x 32 columns before). Narrow blocks for
// routed experts' small buckets (X3's WN = 1): 256 weight rows x 32 tokens (warps 32 x 32, one column of 8) or x 16
// tokens (TN = 16: warps 32 x 16), so a bucket of ~16 slots (35B-A3B at 512 tokens) does not pay 64 slots' MMAs.

// Stage geometry per weight format (X3_FP8: e4m3 bytes, X3_BF16: bf16, X3_NVFP4: packed e2m1 codes, low nibble
// first, with e4m3 scales per 16 values and a global scale): BK columns a stage, WB weight bytes a row (padded by 16
// in shared memory: 12 or 20 words a row, conflict-free fragment reads), plane rows of BK bf16 padded by 16 bytes.
#define X3_FP8 0
#define X3_BF16 1
#define X3_NVFP4 2
// Block geometry: WN warps across the tokens (2 or 1), TN tokens a warp (32 or 16: JN = TN / 8 fragments); the
// block is BM = 256 / WN weight rows x BN = WN TN tokens. The pipeline: X3_STAGES stages of BK columns each (X3_KMUL
// times the format's base of 16 bf16 / 32 fp8 or NVFP4 columns) in dynamic shared memory, filled by cp.async
// X3_STAGES - 1 stages ahead; fp8_mma.py sizes the launches' shared memory by the same formula (x3_smem).
#ifndef X3_STAGES
#define X3_STAGES 3
#endif
#ifndef X3_KMUL
#define X3_KMUL 2
#endif
// The activations' bf16 planes a product reads: 3 (hi + mid + lo = x: f32-exact products) or 1 (x rounded to bf16:
// cuda.compute-quantization bf16, a third of the MMAs and of the planes' shared memory).
#ifndef X3_PLANES
#define X3_PLANES 3
#endif
template <int FMT, int WN = 2, int TN = 32>
struct X3 {
  static constexpr int BK = (FMT == X3_BF16 ? 16 : 32) * X3_KMUL;
  static constexpr int WB = FMT == X3_NVFP4 ? BK / 2 : FMT == X3_BF16 ? BK * 2 : BK;  // weight bytes a row a stage
  static constexpr int LDW = WB + 16;                    // bytes a shared weight row (padded: conflict-free reads)
  static constexpr int LDX = BK * 2 + 16;                // bytes a shared plane row
  static constexpr int XP = BK / 8;                      // 16-byte pieces a plane row
  static constexpr int KP = FMT == X3_NVFP4 ? 32 : FMT == X3_BF16 ? 8 : 16;  // columns a 16-byte weight piece
  static constexpr int BM = 256 / WN, BN = WN * TN, JN = TN / 8;
  static constexpr int SW = BM * LDW, SX = X3_PLANES * BN * LDX;  // bytes a stage: weights, planes
  // NVFP4: a stage's block scales as bf16 pairs (BM rows x BK / 16 words, converted once by the thread that loads
  // them: x3_scale_load / x3_scale_store); SP 16-bit loads of two scales each a stage, SPT a thread at most
  static constexpr int SS = FMT == X3_NVFP4 ? BM * (BK / 16) * 4 : 0;
  static constexpr int SP = FMT == X3_NVFP4 ? BM * (BK / 32) : 0, SPT = SP > 256 ? (SP + 255) / 256 : 1;
};

// byte offset of value k of row `row` in a weight of K columns
template <int FMT>
__device__ __forceinline__ size_t x3_offset(size_t row, int K, int k) {
  const size_t at = row * (size_t)K + (size_t)k;
  return FMT == X3_BF16 ? at * 2 : FMT == X3_NVFP4 ? at / 2 : at;
}

__device__ __forceinline__ unsigned short fp8_bf16_rne(float v) {  // f32 -> bf16 bits, nearest even (finite v)
  const unsigned int u = __float_as_uint(v);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x (T, K) f32 -> xp (3, T, K) bf16 bits: hi, mid, lo with hi + mid + lo = x exactly (n = T K values a plane).
extern "C" __global__ void fp8_x_planes(const float* __restrict__ x, unsigned short* __restrict__ xp, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float v = x[i];
    const unsigned short h = fp8_bf16_rne(v);
    const float r = v - __uint_as_float((unsigned int)h << 16);
    const unsigned short m = fp8_bf16_rne(r);
    xp[i] = h;
    xp[n + i] = m;
    xp[2 * n + i] = fp8_bf16_rne(r - __uint_as_float((unsigned int)m << 16));
  }
}

// two e4m3 bytes (the lower k in the low byte) -> two bf16 in one register, exactly
__device__ __forceinline__ unsigned int fp8_pair_bf16(unsigned short two) {
#if LUMEN_FP8_MMA
  unsigned int h2, out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(two));
  float lo, hi;
  asm("{ .reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }\n"
      : "=f"(lo), "=f"(hi) : "r"(h2));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));  // first operand -> upper half
  return out;
#else
  __trap();
  return 0u;
#endif
}

__device__ __forceinline__ void x3_mma(float* c, const unsigned int* a, const unsigned int* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One stage: columns k0 .. k0 + BK - 1 of the block's BM weight rows (BM x WB / 16 pieces of 16 bytes) and of the
// three planes' BN tokens; columns from K on (the last stage where K % BK != 0) are zero-filled. src[r]: the plane
// row of the block's token r (-1: none, zero-filled).
template <int FMT, int WN, int TN>
__device__ __forceinline__ void x3_load_stage(unsigned char* sw, unsigned char* sx, const unsigned char* W,
                                              const unsigned short* XP, int N, int K, long long plane,
                                              const int* src, int row0, int k0) {
  using G = X3<FMT, WN, TN>;
  const int tid = threadIdx.x;
  for (int p = tid; p < G::BM * (G::WB / 16); p += 256) {
    const int r = p / (G::WB / 16), c = (p % (G::WB / 16)) * 16, row = row0 + r;
    const bool ok = row < N && k0 + (c / 16) * G::KP < K;
    fp8_cp16(sw + r * G::LDW + c, W + (ok ? x3_offset<FMT>(row, K, k0) + c : 0), ok);
  }
  for (int p = tid; p < X3_PLANES * G::BN * G::XP; p += 256) {
    const int pl = p / (G::BN * G::XP), q = p % (G::BN * G::XP), r = q / G::XP, c = (q % G::XP) * 8;
    const int tok = src[r];
    const bool ok = tok >= 0 && k0 + c < K;
    fp8_cp16(sx + (pl * G::BN + r) * G::LDX + c * 2, XP + (ok ? pl * plane + (size_t)tok * K + k0 + c : 0), ok);
  }
}

// NVFP4: four e2m1 codes (w's low 16 bits, code q in bits 4q .. 4q + 3: sign << 3 | index of 0, .5, 1, 1.5, 2, 3,
// 4, 6) times their e4m3 block scale s2 (a bf16 pair, exact: 4 significant bits) -> bf16 pairs lo (codes 0, 1) and
// hi (codes 2, 3), the lower code in the lower half, exactly (a code's value has 2 significant bits). The magnitudes'
// bf16 bytes come from two 8-byte tables by byte permutes (the index nibbles as the selector), the sign bits are
// moved in, and one bf16x2 FMA (+ -0, so a -0 product stays -0) scales a pair.
__device__ __forceinline__ void x3_nvfp4_quad(unsigned int w, unsigned int s2, unsigned int& lo, unsigned int& hi) {
  const unsigned int sel = w & 0x7777u;
  unsigned int pl, ph, v01, v23;
  // low bytes of 0, .5, 1, 1.5 | 2, 3, 4, 6 in bf16: 00 00 80 c0 | 00 40 80 c0; high bytes: 00 3f 3f 3f | 40 40 40 40
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(pl) : "r"(0xc0800000u), "r"(0xc0804000u), "r"(sel));
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(ph) : "r"(0x3f3f3f00u), "r"(0x40404040u), "r"(sel));
  asm("prmt.b32 %0, %1, %2, 0x5140;\n" : "=r"(v01) : "r"(pl), "r"(ph));  // codes 0, 1: low, high byte each
  asm("prmt.b32 %0, %1, %2, 0x7362;\n" : "=r"(v23) : "r"(pl), "r"(ph));  // codes 2, 3
  v01 |= ((w & 0x8u) << 12) | ((w & 0x80u) << 24);
  v23 |= ((w & 0x800u) << 4) | ((w & 0x8000u) << 16);
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(lo) : "r"(v01), "r"(s2), "r"(0x80008000u));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(hi) : "r"(v23), "r"(s2), "r"(0x80008000u));
}

__device__ __forceinline__ unsigned int x3_bf16_pair(float v) {  // v in both halves of a bf16 pair
  unsigned int out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;\n" : "=r"(out) : "f"(v));
  return out;
}

__device__ __forceinline__ float x3_e4m3(unsigned int b) {  // e4m3fn byte -> f32, exactly (a NaN code: 480)
  const unsigned int e = (b >> 3) & 15u, m = b & 7u;
  const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return (b & 0x80u) ? -v : v;
}

// NVFP4 block scales, a stage ahead through registers: this thread's SPT pairs of e4m3 scales (16-bit loads: a
// row's scales are 2-byte aligned for any K % 32 == 0, not always 4) of the stage from column k0, rows clamped to N
// (stored nowhere past N), pairs from K on zero (their codes are zero-filled).
template <int FMT, int WN, int TN>
__device__ __forceinline__ void x3_scale_load(unsigned short (&raw)[X3<FMT, WN, TN>::SPT],
                                              const unsigned char* __restrict__ bs, int N, int K, int row0, int k0) {
  using G = X3<FMT, WN, TN>;
  for (int i = 0; i < G::SPT; i++) {
    const int p = threadIdx.x + 256 * i, r = p / (G::BK / 32), c = k0 + (p % (G::BK / 32)) * 32;
    raw[i] = p < G::SP && c < K
                 ? *reinterpret_cast<const unsigned short*>(bs + (size_t)min(row0 + r, N - 1) * (K / 16) + c / 16)
                 : (unsigned short)0;
  }
}

// ... and into the stage's scale words: bf16 pairs (x3_nvfp4_quad's s2), word r (BK / 16) + j = row r, 16 columns j.
template <int FMT, int WN, int TN>
__device__ __forceinline__ void x3_scale_store(const unsigned short (&raw)[X3<FMT, WN, TN>::SPT], unsigned int* ss) {
  using G = X3<FMT, WN, TN>;
  for (int i = 0; i < G::SPT; i++) {
    const int p = threadIdx.x + 256 * i;
    if (p < G::SP) {
      ss[2 * p] = x3_bf16_pair(x3_e4m3(raw[i] & 0xffu));
      ss[2 * p + 1] = x3_bf16_pair(x3_e4m3(raw[i] >> 8));
    }
  }
}

// The block's BM weight rows from row0 x its BN tokens: y[dst[r] * N + row] for token r with dst[r] >= 0. fp8: sw
// the weight's block scales (a warp's row block: its 32 rows' / 128), K % 128 == 0; bf16: K % 16 == 0; NVFP4: bs its
// e4m3 block scales (N, K / 16), gs its global scale (times the result), K % 32 == 0.
template <int FMT, int WN = 2, int TN = 32>
__device__ __forceinline__ void x3_block(const unsigned char* __restrict__ W, const float* __restrict__ sw,
                                         const unsigned char* __restrict__ bs, float gs,
                                         const unsigned short* __restrict__ XP, long long plane,
                                         float* __restrict__ y, int N, int K, int row0, const int* src,
                                         const int* dst) {
  using G = X3<FMT, WN, TN>;
  constexpr int JN = G::JN, NS = X3_STAGES;
  extern __shared__ __align__(16) unsigned char x3_smem[];  // NS weight stages, then NS plane stages
  unsigned char* const s_w = x3_smem;
  unsigned char* const s_x = x3_smem + NS * G::SW;
  unsigned int* const s_s = reinterpret_cast<unsigned int*>(x3_smem + NS * (G::SW + G::SX));  // NVFP4: NS x SS
  unsigned short raw[G::SPT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wm = WN == 2 ? warp >> 1 : warp, wn = WN == 2 ? warp & 1 : 0;
  // the warp's fp8 scale row block (clamped: a warp wholly past N reads a real one and stores nothing)
  const int KB = K / 128, steps = (K + G::BK - 1) / G::BK, rb = min(row0 + wm * 32, N - 1) / 128;
  constexpr int per_block = 128 / G::BK;
  float acc[2][JN][4], blk[2][JN][4];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < JN; j++)
      for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f, blk[i][j][q] = 0.0f;

  for (int st = 0; st < NS - 1; st++) {  // the first NS - 1 stages in flight (a group each, empty past the last)
    if (st < steps) {
      x3_load_stage<FMT, WN, TN>(s_w + st * G::SW, s_x + st * G::SX, W, XP, N, K, plane, src, row0, st * G::BK);
      if (FMT == X3_NVFP4) {
        x3_scale_load<FMT, WN, TN>(raw, bs, N, K, row0, st * G::BK);
        x3_scale_store<FMT, WN, TN>(raw, s_s + st * (G::SS / 4));
      }
    }
    fp8_cp_commit();
  }
  for (int s = 0; s < steps; s++) {
    cp_wait<NS - 2>();  // this thread's copies of stage s are in
    __syncthreads();    // everyone's are, and every warp is done with stage s - 1, whose buffer is refilled next
    const bool ahead = s + NS - 1 < steps;
    if (ahead) {
      const int n = (s + NS - 1) % NS;
      x3_load_stage<FMT, WN, TN>(s_w + n * G::SW, s_x + n * G::SX, W, XP, N, K, plane, src, row0,
                                 (s + NS - 1) * G::BK);
      if (FMT == X3_NVFP4) x3_scale_load<FMT, WN, TN>(raw, bs, N, K, row0, (s + NS - 1) * G::BK);
    }
    fp8_cp_commit();
    const unsigned int* cs = s_s + (s % NS) * (G::SS / 4);
    const unsigned char* cw = s_w + (s % NS) * G::SW;
    const unsigned char* cx = s_x + (s % NS) * G::SX;
    for (int kk = 0; kk < G::BK; kk += 16) {
      unsigned int a[2][4], b[X3_PLANES][JN][2];
      for (int i = 0; i < 2; i++) {
        const int rl = wm * 32 + 16 * i + g;  // the fragment's rows rl, rl + 8 of the block
        if (FMT == X3_NVFP4) {  // codes a byte a pair; the pair's block scale (16 columns: kk .. kk + 15)
          const unsigned char* r = cw + rl * G::LDW + kk / 2 + t;
          const unsigned int s0 = cs[rl * (G::BK / 16) + kk / 16], s8 = cs[(rl + 8) * (G::BK / 16) + kk / 16];
          x3_nvfp4_quad(r[0] | (unsigned int)r[4] << 8, s0, a[i][0], a[i][2]);  // row g: k 2t, 2t + 1 | 2t + 8, 2t + 9
          x3_nvfp4_quad(r[8 * G::LDW] | (unsigned int)r[8 * G::LDW + 4] << 8, s8, a[i][1], a[i][3]);  // row g + 8
          continue;
        }
        const unsigned char* r = cw + rl * G::LDW + (kk + 2 * t) * (FMT == X3_BF16 ? 2 : 1);
        if (FMT == X3_BF16) {  // the weights' own bf16 pairs
          a[i][0] = *reinterpret_cast<const unsigned int*>(r);
          a[i][1] = *reinterpret_cast<const unsigned int*>(r + 8 * G::LDW);
          a[i][2] = *reinterpret_cast<const unsigned int*>(r + 16);
          a[i][3] = *reinterpret_cast<const unsigned int*>(r + 8 * G::LDW + 16);
        } else {  // e4m3 pairs made bf16 pairs, exactly
          a[i][0] = fp8_pair_bf16(*reinterpret_cast<const unsigned short*>(r));
          a[i][1] = fp8_pair_bf16(*reinterpret_cast<const unsigned short*>(r + 8 * G::LDW));
          a[i][2] = fp8_pair_bf16(*reinterpret_cast<const unsigned short*>(r + 8));
          a[i][3] = fp8_pair_bf16(*reinterpret_cast<const unsigned short*>(r + 8 * G::LDW + 8));
        }
      }
      for (int pl = 0; pl < X3_PLANES; pl++)
        for (int j = 0; j < JN; j++) {
          const unsigned char* r = cx + (pl * G::BN + wn * TN + 8 * j + g) * G::LDX + (kk + 2 * t) * 2;
          b[pl][j][0] = *reinterpret_cast<const unsigned int*>(r);
          b[pl][j][1] = *reinterpret_cast<const unsigned int*>(r + 16);
        }
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < JN; j++) {
          for (int pl = 0; pl < X3_PLANES; pl++) x3_mma(blk[i][j], a[i], b[pl][j]);
        }
    }
    if (FMT == X3_NVFP4 && ahead) x3_scale_store<FMT, WN, TN>(raw, s_s + ((s + NS - 1) % NS) * (G::SS / 4));
    if ((s + 1) % per_block == 0 || s + 1 == steps) {  // 128 columns done (or the last): into the accumulators,
      const float w_s = FMT == X3_FP8 ? sw[(size_t)rb * KB + s / per_block] : 1.0f;  // times fp8's block scale
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < JN; j++)
          for (int q = 0; q < 4; q++) {
            acc[i][j][q] = fmaf(blk[i][j][q], w_s, acc[i][j][q]);
            blk[i][j][q] = 0.0f;
          }
    }
  }
  if (FMT == X3_NVFP4)
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < JN; j++)
        for (int q = 0; q < 4; q++) acc[i][j][q] *= gs;
  frag_store<JN>(acc, y, N, row0, wm, wn, g, t, dst);
}

// y (T, N) f32 = planes (3, T, K) . dequant(W, sw)^T, W (N, K) e4m3 bytes, sw (ceil(N/128), K/128) f32. Grid
// (ceil(T/64), ceil(N/128)), 256 threads. K % 128 == 0.
extern "C" __global__ void __launch_bounds__(256, 2) gemm_fp8_x3(const unsigned char* __restrict__ W,
                                                              const float* __restrict__ sw,
                                                              const unsigned short* __restrict__ XP,
                                                              float* __restrict__ y, int N, int K, int T) {
  __shared__ int src[FP8_BN];
  const int tok0 = blockIdx.x * FP8_BN;
  if (threadIdx.x < FP8_BN) src[threadIdx.x] = tok0 + (int)threadIdx.x < T ? tok0 + (int)threadIdx.x : -1;
  __syncthreads();
  x3_block<X3_FP8>(W, sw, nullptr, 1.0f, XP, (long long)T * K, y, N, K, blockIdx.y * FP8_BM, src, src);
}

// Routed experts (moe.py's grouped path; the default, off with LUMEN_CUDA_MMA_PREFILL=0): `roles` matrix roles (1:
// down; 2: gate and up, one launch) of every expert, the slots bucketed by moe_bucket (order[off[e] .. off[e + 1]) =
// expert e's slots). Block (x, y) = (the run of BN slots of one expert's bucket that the work list `blocks` names at
// x: c << 16 | e for slots c BN .. of expert e, -1 for none; moe.cu's moe_slot_blocks), BM rows of role y / ny's
// matrix, ny = gridDim.y / roles): 64 x 128 (moe_*_x3), 32 x 256 (*_x3_s32, the default) or 16 x 256 (*_x3_s16),
// the launch's choice (fp8_mma_model.slot_block). Role r's matrix is the table's rows data_row + r (scale_row + r,
// gs_row + r; packed: rows row_off + r N), its output y + r y_role. A slot's plane row is slot / div (div = k for
// x's planes (3, T, K): the token; 1 for h's (3, S, K)), its output row the slot: y (S, N). Grid (the list's
// length, roles ceil(N / BM)).
// The block's BN slot rows and its expert, or false where the list has no run at x.
template <int BN>
__device__ __forceinline__ bool x3_slots(const int* __restrict__ blocks, const int* __restrict__ off,
                                         const int* __restrict__ order, int div, int* src, int* dst, int& e) {
  const int b = blocks[blockIdx.x];
  if (b < 0) return false;  // block-uniform
  e = b & 0xffff;
  const int beg = off[e], n = off[e + 1] - beg, c0 = (b >> 16) * BN;
  if (threadIdx.x < BN) {
    const int c = c0 + (int)threadIdx.x, slot = c < n ? order[beg + c] : -1;
    dst[threadIdx.x] = slot;
    src[threadIdx.x] = slot >= 0 ? slot / div : -1;
  }
  __syncthreads();
  return true;
}

// A family's three kernels, one a block width: NAME (64 slots x 128 rows), NAME_s32 (32 x 256), NAME_s16 (16 x 256).
#define X3_WIDTHS(NAME, PARAMS, ARGS)                                                                           \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME(PARAMS) { NAME##_body<2, 32>(ARGS); }       \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME##_s32(PARAMS) { NAME##_body<1, 32>(ARGS); } \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME##_s16(PARAMS) { NAME##_body<1, 16>(ARGS); }

// fp8 experts: the matrix and its scales are the table's rows data_row / scale_row (uint64 (rows, E) pointers,
// moe.py's table). K % 128 == 0.
#define MOE_FP8_X3_PARAMS                                                                                      \
  const unsigned long long *__restrict__ tab, int data_row, int scale_row, int E,                  \
      const int *__restrict__ blocks, const int *__restrict__ off, const int *__restrict__ order, int div, \
      const unsigned short *__restrict__ XP, long long plane, float *__restrict__ y, int N, int K, int roles,     \
      long long y_role
template <int WN, int TN>
__device__ __forceinline__ void moe_fp8_x3_body(MOE_FP8_X3_PARAMS) {
  using G = X3<X3_FP8, WN, TN>;
  __shared__ int src[G::BN], dst[G::BN];
  int e;
  if (!x3_slots<G::BN>(blocks, off, order, div, src, dst, e)) return;
  const int ny = gridDim.y / roles, r = blockIdx.y / ny;
  const unsigned char* W = reinterpret_cast<const unsigned char*>(tab[(size_t)(data_row + r) * E + e]);
  const float* sw = reinterpret_cast<const float*>(tab[(size_t)(scale_row + r) * E + e]);
  x3_block<X3_FP8, WN, TN>(W, sw, nullptr, 1.0f, XP, plane, y + r * y_role, N, K, (blockIdx.y - r * ny) * G::BM,
                           src, dst);
}
#define MOE_FP8_X3_ARGS tab, data_row, scale_row, E, blocks, off, order, div, XP, plane, y, N, K, roles, y_role
X3_WIDTHS(moe_fp8_x3, MOE_FP8_X3_PARAMS, MOE_FP8_X3_ARGS)

// bf16 experts: the matrix is the table's row data_row (tab non-null), or base + (e * stride + row_off * K) values
// (packed experts: (E, 2I, H) with the up rows at row_off I, (E, H, I)). K % 16 == 0.
#define MOE_BF16_X3_PARAMS                                                                                            \
  const unsigned long long *__restrict__ tab, int data_row, const unsigned short *__restrict__ base, long long stride, \
      int row_off, int E, const int *__restrict__ blocks, const int *__restrict__ off, const int *__restrict__ order,  \
      int div, const unsigned short *__restrict__ XP, long long plane, float *__restrict__ y, int N, int K,       \
      int roles, long long y_role
template <int WN, int TN>
__device__ __forceinline__ void moe_bf16_x3_body(MOE_BF16_X3_PARAMS) {
  using G = X3<X3_BF16, WN, TN>;
  __shared__ int src[G::BN], dst[G::BN];
  int e;
  if (!x3_slots<G::BN>(blocks, off, order, div, src, dst, e)) return;
  const int ny = gridDim.y / roles, r = blockIdx.y / ny;
  const unsigned short* W = tab ? reinterpret_cast<const unsigned short*>(tab[(size_t)(data_row + r) * E + e])
                                : base + (size_t)e * stride + (size_t)(row_off + r * N) * K;
  x3_block<X3_BF16, WN, TN>(reinterpret_cast<const unsigned char*>(W), nullptr, nullptr, 1.0f, XP, plane,
                            y + r * y_role, N, K, (blockIdx.y - r * ny) * G::BM, src, dst);
}
#define MOE_BF16_X3_ARGS \
  tab, data_row, base, stride, row_off, E, blocks, off, order, div, XP, plane, y, N, K, roles, y_role
X3_WIDTHS(moe_bf16_x3, MOE_BF16_X3_PARAMS, MOE_BF16_X3_ARGS)

// y (T, N) f32 = planes (3, T, K) . W^T for an NVFP4 weight: codes (N, K/2), e4m3 block scales bs (N, K/16), global
// scale gs. Grid (ceil(T/64), ceil(N/128)), 256 threads. K % 32 == 0.
extern "C" __global__ void __launch_bounds__(256, 2) gemm_nvfp4_x3(const unsigned char* __restrict__ W,
                                                                const unsigned char* __restrict__ bs, float gs,
                                                                const unsigned short* __restrict__ XP,
                                                                float* __restrict__ y, int N, int K, int T) {
  __shared__ int src[FP8_BN];
  const int tok0 = blockIdx.x * FP8_BN;
  if (threadIdx.x < FP8_BN) src[threadIdx.x] = tok0 + (int)threadIdx.x < T ? tok0 + (int)threadIdx.x : -1;
  __syncthreads();
  x3_block<X3_NVFP4>(W, nullptr, bs, gs, XP, (long long)T * K, y, N, K, blockIdx.y * FP8_BM, src, src);
}

// NVFP4 experts (moe.py's nvfp4 table: data rows, then block-scale rows, then global scales as f32 bits in the low
// 32 bits of a uint64): the matrix, its block scales and global scale are the table's rows data_row, scale_row,
// gs_row. K % 32 == 0.
#define MOE_NVFP4_X3_PARAMS                                                                                         \
  const unsigned long long *__restrict__ tab, int data_row, int scale_row, int gs_row, int E,                    \
      const int *__restrict__ blocks, const int *__restrict__ off, const int *__restrict__ order, int div,     \
      const unsigned short *__restrict__ XP, long long plane, float *__restrict__ y, int N, int K, int roles,     \
      long long y_role
template <int WN, int TN>
__device__ __forceinline__ void moe_nvfp4_x3_body(MOE_NVFP4_X3_PARAMS) {
  using G = X3<X3_NVFP4, WN, TN>;
  __shared__ int src[G::BN], dst[G::BN];
  int e;
  if (!x3_slots<G::BN>(blocks, off, order, div, src, dst, e)) return;
  const int ny = gridDim.y / roles, r = blockIdx.y / ny;
  const unsigned char* W = reinterpret_cast<const unsigned char*>(tab[(size_t)(data_row + r) * E + e]);
  const unsigned char* bs = reinterpret_cast<const unsigned char*>(tab[(size_t)(scale_row + r) * E + e]);
  const float gs = __uint_as_float((unsigned int)(tab[(size_t)(gs_row + r) * E + e] & 0xffffffffull));
  x3_block<X3_NVFP4, WN, TN>(W, nullptr, bs, gs, XP, plane, y + r * y_role, N, K, (blockIdx.y - r * ny) * G::BM,
                             src, dst);
}
#define MOE_NVFP4_X3_ARGS \
  tab, data_row, scale_row, gs_row, E, blocks, off, order, div, XP, plane, y, N, K, roles, y_role
X3_WIDTHS(moe_nvfp4_x3, MOE_NVFP4_X3_PARAMS, MOE_NVFP4_X3_ARGS)

// h (S, I) = act(g) * u elementwise (act 0: silu, 1: gelu_tanh, as moe.cu's act_mul).
extern "C" __global__ void moe_x3_act(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ h,
                                      long long n, int act) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float a = g[i], b = u[i];
    h[i] = act == 1 ? 0.5f * a * (1.f + tanhf(0.7978845608028654f * (a + 0.044715f * (a * a * a)))) * b
                    : a * (0.5f * (tanhf(0.5f * a) + 1.f)) * b;
  }
}
