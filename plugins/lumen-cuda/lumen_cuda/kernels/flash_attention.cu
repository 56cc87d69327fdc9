// Causal prefill attention, FlashAttention-2 style, f32 SIMT (exact f32 math, no tensor cores): the (T, S) score
// matrix never leaves shared memory. Replaces attention._attend for T > 1 (lumen_cuda/flash.py launches it).
//
// q (T, Hq, D) f32 contiguous; K (Hkv, S, D), V (Hkv, S, Dv) f32 with contiguous rows and a head stride
// (k_hs, v_hs elements: a view sliced along S works); out (T, Hq, Dv) f32. Query t sits at position start + t,
// key j at lo + j. Key j is attended by query t iff lo + j <= start + t and (window <= 0 or
// lo + j > start + t - window). Score = (q . k) * scale, then tanh(score / softcap) * softcap when softcap > 0
// (before masking, as the CuPy op does). GQA: query head hq reads kv head hq / G.
//
// flash_fwd_v<DV>_n<BN> (Dv <= DV): grid (Hkv, ceil(T * G / FA_R)), FA_NT = 256 threads (8 warps). A block owns kv
// head blockIdx.x and FA_R = 32 "rows" of the flattened (t, g) order r = t * G + g (query t of query head h * G + g),
// so each K/V tile it stages serves every query head of the group. Row blocks run heaviest first (the last queries
// see the most keys). Keys are visited in tiles of BN from the first key any row of the block may see (window) to
// the last one (causality); tiles wholly outside are never loaded; the per-element mask is applied on every
// visited tile (O(1) per score against the O(D) dot product).
//   Per tile: K tile -> shared; scores: thread (sr = tid / 16, sc = tid % 16) computes rows 2sr, 2sr+1 against
//   keys sc + 16k (k < BN / 16), float4 over D; online softmax per row across the 16 lanes of a half warp
//   (running max m, sum l, rescale alpha = e^(m_old - m_new)), p and alpha into shared; V tile -> the same
//   buffer; P V: thread (tr = tid / TC, tc = tid % TC), TC = 256 * RT / 32, owns rows tr*RT .. tr*RT+RT-1 and
//   value float4 columns tc + TC*c (c < CV): v128 RT 4 CV 1, v256 RT 8 CV 1, v512 RT 8 CV 2; the accumulators
//   are rescaled by alpha first. At the end out = acc / l.
//
// Dynamic shared memory (floats): Q FA_R * (D + 4) + K/V tile BN * (max(D, Dv) + 4) + P FA_R * BN + FA_R.
// D, Dv multiples of 4 (the launcher checks).
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#define FA_R 32    // rows (query, head-of-group pairs) per block
#define FA_NT 256  // threads per block

__device__ __forceinline__ float fa_neg_inf() { return __uint_as_float(0xff800000u); }

__device__ __forceinline__ float fa_max16(float v) {  // over the 16 lanes of a half warp
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float fa_sum16(float v) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float fa_get(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Rows [0, nrows) of a (rows, width4 float4) global matrix at src (row stride src_stride floats) into shared dst
// (row stride dst_stride floats), rows nrows..rows-1 zero.
__device__ __forceinline__ void fa_stage(float* dst, int dst_stride, const float* __restrict__ src,
                                         long long src_stride, int rows, int nrows, int width4) {
  const int n = rows * width4;
  for (int i = threadIdx.x; i < n; i += FA_NT) {
    const int r = i / width4, c = i - r * width4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < nrows) x = reinterpret_cast<const float4*>(src + r * src_stride)[c];
    reinterpret_cast<float4*>(dst + r * dst_stride)[c] = x;
  }
}

template <int RT, int CV, int BN>
__device__ __forceinline__ void flash_fwd(const float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, float* __restrict__ out, int T, int Hq,
                                          int G, int S, int D, int Dv, long long k_hs, long long v_hs, int start,
                                          int lo, float scale, float softcap, int window, float* smem) {
  constexpr int NK = BN / 16;       // keys per thread in the score phase
  constexpr int TC = FA_NT * RT / FA_R;  // P V: threads per row group (32 at RT = 4, 64 at RT = 8)
  const int tid = threadIdx.x;
  const int tr = tid / TC, tc = tid - tr * TC;  // P V: rows tr*RT.., value float4 columns tc + TC*cv
  const int sr = tid >> 4, sc = tid & 15;
  const int h = blockIdx.x;
  const int rb = gridDim.y - 1 - blockIdx.y;  // heaviest row block first
  const int rows = T * G, r0 = rb * FA_R;
  const int nr = min(FA_R, rows - r0);
  const int D4 = D >> 2, Dv4 = Dv >> 2;
  const int qs = D + 4;            // padded: the two rows a warp reads at one d fall in distinct banks
  const int kvs = max(D, Dv) + 4;  // padded: the 16 keys a half warp reads at one d fall in distinct banks
  float* Qs = smem;                // (FA_R, qs)
  float* KV = Qs + FA_R * qs;      // (BN, kvs): the K tile, then the V tile
  float* Ps = KV + BN * kvs;       // (FA_R, BN) probabilities of the tile
  float* Al = Ps + FA_R * BN;      // (FA_R) rescale factors, at the end the sums l

  // the queries: row r = t * G + g -> q[t, h * G + g]
  for (int i = tid; i < FA_R * D4; i += FA_NT) {
    const int rr = i / D4, c = i - rr * D4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rr < nr) {
      const int r = r0 + rr, t = r / G, g = r - t * G;
      x = reinterpret_cast<const float4*>(q + ((long long)t * Hq + h * G + g) * D)[c];
    }
    reinterpret_cast<float4*>(Qs + rr * qs)[c] = x;
  }

  // positions of this thread's two score rows (an absent row masks every key) and the block's key range
  int qp[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rr = 2 * sr + i;
    qp[i] = rr < nr ? start + (r0 + rr) / G : -(1 << 30);
  }
  const int qmin = start + r0 / G, qmax = start + (r0 + nr - 1) / G;
  const int j_begin = window > 0 ? max(0, qmin - window + 1 - lo) : 0;
  const int j_end = min(S, qmax - lo + 1);
  const float* kh = k + h * k_hs;
  const float* vh = v + h * v_hs;

  float m[2] = {fa_neg_inf(), fa_neg_inf()}, l[2] = {0.f, 0.f};
  float acc[RT][CV][4];
#pragma unroll
  for (int rr = 0; rr < RT; ++rr)
#pragma unroll
    for (int cv = 0; cv < CV; ++cv) acc[rr][cv][0] = acc[rr][cv][1] = acc[rr][cv][2] = acc[rr][cv][3] = 0.f;

  for (int j0 = j_begin; j0 < j_end; j0 += BN) {
    const int nj = min(BN, j_end - j0);
    fa_stage(KV, kvs, kh + (long long)j0 * D, D, BN, nj, D4);
    __syncthreads();  // (the first time also the queries)

    // scores of rows 2sr, 2sr+1 against keys sc + 16 kk
    float s[2][NK];
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) s[0][kk] = s[1][kk] = 0.f;
    const float4* q0 = reinterpret_cast<const float4*>(Qs + 2 * sr * qs);
    const float4* q1 = reinterpret_cast<const float4*>(Qs + (2 * sr + 1) * qs);
#pragma unroll 4
    for (int c = 0; c < D4; ++c) {
      const float4 a0 = q0[c], a1 = q1[c];
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        const float4 b = reinterpret_cast<const float4*>(KV + (sc + 16 * kk) * kvs)[c];
        s[0][kk] = fmaf(a0.x, b.x, s[0][kk]);
        s[0][kk] = fmaf(a0.y, b.y, s[0][kk]);
        s[0][kk] = fmaf(a0.z, b.z, s[0][kk]);
        s[0][kk] = fmaf(a0.w, b.w, s[0][kk]);
        s[1][kk] = fmaf(a1.x, b.x, s[1][kk]);
        s[1][kk] = fmaf(a1.y, b.y, s[1][kk]);
        s[1][kk] = fmaf(a1.z, b.z, s[1][kk]);
        s[1][kk] = fmaf(a1.w, b.w, s[1][kk]);
      }
    }

    // online softmax of the two rows (the 16 lanes of this half warp hold all BN keys of them)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = fa_neg_inf();
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        const int jj = sc + 16 * kk, kp = lo + j0 + jj;
        float x = s[i][kk] * scale;
        if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
        const bool ok = jj < nj && kp <= qp[i] && (window <= 0 || kp > qp[i] - window);
        s[i][kk] = ok ? x : fa_neg_inf();
        mx = fmaxf(mx, s[i][kk]);
      }
      const float mn = fmaxf(m[i], fa_max16(mx));
      const float mu = mn == fa_neg_inf() ? 0.f : mn;  // nothing seen yet: every p and alpha is 0
      const float alpha = expf(m[i] - mu);
      float sum = 0.f;
      const int row = 2 * sr + i;
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        const float p = expf(s[i][kk] - mu);
        Ps[row * BN + sc + 16 * kk] = p;
        sum += p;
      }
      l[i] = l[i] * alpha + fa_sum16(sum);
      m[i] = mn;
      if (sc == 0) Al[row] = alpha;
    }
    __syncthreads();  // every thread is done with the K tile

    fa_stage(KV, kvs, vh + (long long)j0 * Dv, Dv, BN, nj, Dv4);
    __syncthreads();

    // acc (rows tr*RT.., columns tc + TC*cv) = alpha acc + P V
#pragma unroll
    for (int rr = 0; rr < RT; ++rr) {
      const float a = Al[tr * RT + rr];
#pragma unroll
      for (int cv = 0; cv < CV; ++cv)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[rr][cv][e] *= a;
    }
    for (int jj = 0; jj < BN; jj += 4) {
      float4 p[RT];
#pragma unroll
      for (int rr = 0; rr < RT; ++rr) p[rr] = reinterpret_cast<const float4*>(Ps + (tr * RT + rr) * BN + jj)[0];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float4* vr = reinterpret_cast<const float4*>(KV + (jj + u) * kvs);
#pragma unroll
        for (int cv = 0; cv < CV; ++cv) {
          const int c4 = tc + TC * cv;
          if (c4 < Dv4) {
            const float4 b = vr[c4];
#pragma unroll
            for (int rr = 0; rr < RT; ++rr) {
              const float pp = fa_get(p[rr], u);
              acc[rr][cv][0] = fmaf(pp, b.x, acc[rr][cv][0]);
              acc[rr][cv][1] = fmaf(pp, b.y, acc[rr][cv][1]);
              acc[rr][cv][2] = fmaf(pp, b.z, acc[rr][cv][2]);
              acc[rr][cv][3] = fmaf(pp, b.w, acc[rr][cv][3]);
            }
          }
        }
      }
    }
    __syncthreads();  // before the next K tile overwrites KV, Ps and Al
  }

  // out = acc / l
  if (sc == 0) {
    Al[2 * sr] = l[0];
    Al[2 * sr + 1] = l[1];
  }
  __syncthreads();
#pragma unroll
  for (int rr = 0; rr < RT; ++rr) {
    const int row = tr * RT + rr;
    if (row < nr) {
      const int r = r0 + row, t = r / G, g = r - t * G;
      const float L = Al[row];
      float4* o = reinterpret_cast<float4*>(out + ((long long)t * Hq + h * G + g) * Dv);
#pragma unroll
      for (int cv = 0; cv < CV; ++cv) {
        const int c4 = tc + TC * cv;
        if (c4 < Dv4)
          o[c4] = make_float4(acc[rr][cv][0] / L, acc[rr][cv][1] / L, acc[rr][cv][2] / L, acc[rr][cv][3] / L);
      }
    }
  }
}

// flash_fwd_v<DV>_n<BN>(q, K, V, out, T, Hq, G, S, D, Dv, k_hs, v_hs, start, lo, scale, softcap (0: none),
//                       window (0: none)); Dv <= DV. P V thread tiles: v128 4 rows x 1 float4 column (RT 4, CV 1),
// v256 8 x 1 (RT 8, CV 1), v512 8 x 2 (RT 8, CV 2).
#define FLASH_FWD(DV, RT, CV, BN, MINB)                                                                             \
  extern "C" __global__ void __launch_bounds__(FA_NT, MINB) flash_fwd_v##DV##_n##BN(                                \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                        \
      float* __restrict__ out, int T, int Hq, int G, int S, int D, int Dv, long long k_hs, long long v_hs,          \
      int start, int lo, float scale, float softcap, int window) {                                                  \
    extern __shared__ float4 fa_smem4[];                                                                            \
    flash_fwd<RT, CV, BN>(q, k, v, out, T, Hq, G, S, D, Dv, k_hs, v_hs, start, lo, scale, softcap, window,          \
                          reinterpret_cast<float*>(fa_smem4));                                                      \
  }

#define FLASH_FWD_N(DV, RT, CV, MINB)                                                                               \
  FLASH_FWD(DV, RT, CV, 16, MINB)                                                                                   \
  FLASH_FWD(DV, RT, CV, 32, MINB)                                                                                   \
  FLASH_FWD(DV, RT, CV, 64, MINB)

// Dv <= 256: two blocks per SM (<= 128 registers) on sm_90, where 2 x 108 KB of shared memory fit at D = 256;
// Dv <= 512, and sm_120 (~100 KB of shared memory per SM: one block at D >= 128 anyway): one, with the registers
// the accumulators want.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define FA_MINB 1
#else
#define FA_MINB 2
#endif
FLASH_FWD_N(128, 4, 1, FA_MINB)
FLASH_FWD_N(256, 8, 1, FA_MINB)
FLASH_FWD_N(512, 8, 2, 1)
