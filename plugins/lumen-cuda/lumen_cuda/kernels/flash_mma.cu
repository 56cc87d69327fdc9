// Causal prefill attention on the tensor cores (mma.sync m16n8k16 bf16 -> f32), FlashAttention-2 style, for keys
// and values that are bf16 values (a bf16 KV cache's bits, or an fp8 cache's e4m3 values, which bf16 holds exactly).
// lumen_cuda/flash.py launches it (``attend_mma``); the f32 kernel (flash_attention.cu) keeps f32 and f16 caches.
//
// Exactness: each f32 query q and each f32 probability p is split into three bf16 planes that sum to it exactly
// (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid, 8 + 8 + 8 significant bits). Every product of a plane and
// a bf16 key or value is exact in f32, so S = Q K^T and O += P V are the exact products summed in f32 by the MMA's
// accumulator (three MMAs where one would drop 16 bits of the queries / probabilities). Softmax is the f32 kernel's
// (row max m, p = e^(s - m), l the f32 sum of p, the accumulators rescaled by e^(m_old - m_new)).
//
// q (T, Hq, D) f32 contiguous; K (Hkv, S, D), V (Hkv, S, Dv) bf16 bits with contiguous rows and a head stride (k_hs,
// v_hs elements, multiples of 8); out (T, Hq, Dv) f32. Positions, masks, softcap and GQA as flash_attention.cu:
// key j (position lo + j) is seen by query t (position start + t) iff lo + j <= start + t and (window <= 0 or
// lo + j > start + t - window). D % 16 == 0, Dv % 8 == 0 (the launcher checks).
//
// flash_mma_w<W>_n<BN>_c<DVC>: grid (Hkv, ceil(T G / 16W), ceil(Dv / DVC)), 32W threads. A block owns kv head
// blockIdx.x, 16W rows of the flattened (t, g) order r = t G + g (16 a warp) and value columns blockIdx.z DVC ..
// (a 512-wide head computes its scores once a chunk). Row blocks run heaviest first. Per tile of BN keys:
//   K tile (cp.async) -> S (16 x BN a warp) = 3 x (D / 16) x (BN / 8) MMAs, A = the query planes by ldmatrix, B = the
//   K rows by ldmatrix; online softmax in registers (a row's values sit in the 4 lanes of a quad); P's C fragments
//   are the A fragments of P V as they stand (no shared memory), split into 3 planes; V tile (cp.async, issued
//   before S) -> O (16 x DVC a warp) += 3 x (BN / 16) x (DVC / 8) MMAs, B = V by ldmatrix.trans. The next K tile
//   loads during P V. A warp skips the MMAs of a tile that none of its rows sees.
// Shared memory (bf16): 3 query planes 16W x (D + 8), K tile BN x (D + 8), V tile BN x (DVC + 8); the 8-element pad
// puts the 8 rows of an ldmatrix in distinct banks.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

__device__ __forceinline__ float fm_neg_inf() { return __uint_as_float(0xff800000u); }

__device__ __forceinline__ unsigned int fm_smem(const void* p) {
  unsigned int a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void fm_cp16(void* smem, const void* gmem, bool full) {
  const int bytes = full ? 16 : 0;  // 0: zero-fill (rows past the tile; gmem is then any valid address)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fm_smem(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void fm_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void fm_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void fm_ldsm4(unsigned int (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fm_smem(p)));
}
__device__ __forceinline__ void fm_ldsm4_t(unsigned int (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fm_smem(p)));
}

__device__ __forceinline__ void fm_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int fm_bf16(float v) {  // f32 -> bf16 bits, nearest even (finite v)
  const unsigned int u = __float_as_uint(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x -> bf16 planes hi, mid, lo (bits) with hi + mid + lo == x exactly
__device__ __forceinline__ void fm_planes(float x, unsigned int& h, unsigned int& m, unsigned int& l) {
  h = fm_bf16(x);
  const float r = x - __uint_as_float(h << 16);
  m = fm_bf16(r);
  l = fm_bf16(r - __uint_as_float(m << 16));
}

// two values (the lower k first) as three bf16x2 plane registers
__device__ __forceinline__ void fm_pair(float x0, float x1, unsigned int& h, unsigned int& m, unsigned int& l) {
  unsigned int h0, m0, l0, h1, m1, l1;
  fm_planes(x0, h0, m0, l0);
  fm_planes(x1, h1, m1, l1);
  h = h0 | (h1 << 16);
  m = m0 | (m1 << 16);
  l = l0 | (l1 << 16);
}

// Rows [0, nrows) of a tile of `rows` x `cols` bytes (cols % 16 == 0) at src (row stride src_stride bytes) into
// shared dst (row stride dst_stride), by cp.async; rows nrows.. and columns past `valid` zero-filled.
template <int NT>
__device__ __forceinline__ void fm_stage_bytes(unsigned char* dst, int dst_stride,
                                               const unsigned char* __restrict__ src, long long src_stride, int rows,
                                               int nrows, int cols, int valid) {
  const int c16 = cols >> 4, n = rows * c16;
  for (int i = threadIdx.x; i < n; i += NT) {
    const int r = i / c16, c = (i - r * c16) * 16;
    const bool ok = r < nrows && c < valid;
    fm_cp16(dst + r * dst_stride + c, ok ? src + r * src_stride + c : src, ok);
  }
}

// the same for bf16 elements (strides, cols and valid in elements; cols % 8 == 0)
template <int NT>
__device__ __forceinline__ void fm_stage(unsigned short* dst, int dst_stride, const unsigned short* __restrict__ src,
                                         long long src_stride, int rows, int nrows, int cols, int valid) {
  fm_stage_bytes<NT>(reinterpret_cast<unsigned char*>(dst), 2 * dst_stride,
                     reinterpret_cast<const unsigned char*>(src), 2 * src_stride, rows, nrows, 2 * cols, 2 * valid);
}

// A warp's rows: this thread's two (wr + g, wr + g + 8) at their query positions (an absent row sees no key), and
// the warp's first and last query positions (active: the warp has a row of the block at all).
struct FmRows {
  int qp[2];
  int wq_min, wq_max;
  bool active;
};

__device__ __forceinline__ FmRows fm_rows(int wr, int g, int nr, int r0, int G, int start) {
  FmRows w;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rr = wr + g + 8 * i;
    w.qp[i] = rr < nr ? start + (r0 + rr) / G : -(1 << 30);
  }
  w.active = wr < nr;
  w.wq_min = w.active ? start + (r0 + wr) / G : 0;
  w.wq_max = w.active ? start + (r0 + min(nr, wr + 16) - 1) / G : 0;
  return w;
}

// whether any row of the warp sees a key of the tile [j0, j0 + nj): the first key is not after its last query, and
// (a window) the last key is inside the window of its first query
__device__ __forceinline__ bool fm_visible(const FmRows& w, int lo, int j0, int nj, int window) {
  return w.active && lo + j0 <= w.wq_max && (window <= 0 || lo + j0 + nj - 1 > w.wq_min - window);
}

// The online softmax of one tile, shared by both kernels: s[nb][2i + e] holds the score accumulator of row g + 8i
// and key j0 + nb * 8 + 2 t4 + e; x = s * pre[i] * scale (pre: 1, or the FP8 kernel's query row scale), the softcap,
// the mask; then m (row max), l (f32 sum of p), acc rescaled by e^(m_old - m_new), and s replaced by p * pmul (1, or
// 448 for FP8's e4m3 P). The 4 lanes of a quad hold a row between them.
template <int NB, int VB>
__device__ __forceinline__ void fm_softmax(float (&s)[NB][4], float (&acc)[VB][4], float (&m)[2], float (&l)[2],
                                           const int (&qp)[2], const float (&pre)[2], float scale, float softcap,
                                           int window, int lo, int j0, int nj, int t4, float pmul) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = fm_neg_inf();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int jj = nb * 8 + 2 * t4 + e, kp = lo + j0 + jj;
        float x = s[nb][2 * i + e] * pre[i] * scale;
        if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
        const bool ok = jj < nj && kp <= qp[i] && (window <= 0 || kp > qp[i] - window);
        s[nb][2 * i + e] = ok ? x : fm_neg_inf();
        mx = fmaxf(mx, s[nb][2 * i + e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m[i], mx);
    const float mu = mn == fm_neg_inf() ? 0.f : mn;  // nothing seen yet: every p and alpha is 0
    const float alpha = expf(m[i] - mu);
    float sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = expf(s[nb][2 * i + e] - mu);
        s[nb][2 * i + e] = p * pmul;
        sum += p;
      }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l[i] = l[i] * alpha + sum;
    m[i] = mn;
#pragma unroll
    for (int vb = 0; vb < VB; ++vb) {
      acc[vb][2 * i] *= alpha;
      acc[vb][2 * i + 1] *= alpha;
    }
  }
}

// out[t, h G + g, c0 + c] = acc / div / l for this thread's two rows (wr + g + 8i, below nr) and columns below dvn
template <int VB>
__device__ __forceinline__ void fm_store(const float (&acc)[VB][4], const float (&l)[2], float* __restrict__ out,
                                         int wr, int g, int t4, int nr, int r0, int G, int Hq, int h, int Dv, int c0,
                                         int dvn, float div) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rr = wr + g + 8 * i;
    if (rr < nr) {
      const int r = r0 + rr, t = r / G, gg = r - t * G;
      const float L = l[i];
      float* o = out + ((long long)t * Hq + h * G + gg) * Dv + c0;
#pragma unroll
      for (int vb = 0; vb < VB; ++vb) {
        const int c = vb * 8 + 2 * t4;
        if (c < dvn)
          *reinterpret_cast<float2*>(o + c) = make_float2(acc[vb][2 * i] / div / L, acc[vb][2 * i + 1] / div / L);
      }
    }
  }
}

template <int W, int BN, int DVC>
__device__ __forceinline__ void flash_mma(const float* __restrict__ q, const unsigned short* __restrict__ k,
                                          const unsigned short* __restrict__ v, float* __restrict__ out, int T,
                                          int Hq, int G, int S, int D, int Dv, long long k_hs, long long v_hs,
                                          int start, int lo, float scale, float softcap, int window,
                                          unsigned short* smem) {
  constexpr int NT = 32 * W, ROWS = 16 * W, NB = BN / 8, VB = DVC / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.x;
  const int rb = gridDim.y - 1 - blockIdx.y;  // heaviest row block first
  const int rows = T * G, r0 = rb * ROWS;
  const int nr = min(ROWS, rows - r0);
  const int c0 = blockIdx.z * DVC, dvn = min(DVC, Dv - c0);  // this block's value columns
  const int qs = D + 8, vs = DVC + 8;
  unsigned short* Qs = smem;              // 3 planes of (ROWS, qs)
  unsigned short* Ks = Qs + 3 * ROWS * qs;  // (BN, qs)
  unsigned short* Vs = Ks + BN * qs;        // (BN, vs)

  const int qmin = start + r0 / G, qmax = start + (r0 + nr - 1) / G;
  const int j_begin = window > 0 ? max(0, qmin - window + 1 - lo) : 0;
  const int j_end = min(S, qmax - lo + 1);
  const unsigned short* kh = k + h * k_hs;
  const unsigned short* vh = v + h * v_hs + c0;
  if (j_begin < j_end) fm_stage<NT>(Ks, qs, kh + (long long)j_begin * D, D, BN, min(BN, j_end - j_begin), D, D);
  fm_commit();

  // the query planes: row r = t G + g -> q[t, h G + g]
  const int D4 = D >> 2;
  for (int i = tid; i < ROWS * D4; i += NT) {
    const int rr = i / D4, c = (i - rr * D4) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rr < nr) {
      const int r = r0 + rr, t = r / G, gg = r - t * G;
      x = *reinterpret_cast<const float4*>(q + ((long long)t * Hq + h * G + gg) * D + c);
    }
    unsigned int h01, m01, l01, h23, m23, l23;
    fm_pair(x.x, x.y, h01, m01, l01);
    fm_pair(x.z, x.w, h23, m23, l23);
    unsigned short* d = Qs + rr * qs + c;
    *reinterpret_cast<uint2*>(d) = make_uint2(h01, h23);
    *reinterpret_cast<uint2*>(d + ROWS * qs) = make_uint2(m01, m23);
    *reinterpret_cast<uint2*>(d + 2 * ROWS * qs) = make_uint2(l01, l23);
  }

  const int wr = warp * 16;
  const FmRows w = fm_rows(wr, g, nr, r0, G, start);
  const int(&qp)[2] = w.qp;

  float m[2] = {fm_neg_inf(), fm_neg_inf()}, l[2] = {0.f, 0.f};
  float acc[VB][4];
#pragma unroll
  for (int vb = 0; vb < VB; ++vb) acc[vb][0] = acc[vb][1] = acc[vb][2] = acc[vb][3] = 0.f;

  // ldmatrix addresses: A (query rows), B (key rows), B^T (value rows); lane -> row / column of its 8x8 matrix
  const int a_row = wr + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  const int b_row = (lane & 7) + 8 * (lane >> 4), b_col = 8 * ((lane >> 3) & 1);
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_col = 8 * (lane >> 4);

  for (int j0 = j_begin; j0 < j_end; j0 += BN) {
    const int nj = min(BN, j_end - j0);
    fm_stage<NT>(Vs, vs, vh + (long long)j0 * Dv, Dv, BN, nj, DVC, dvn);
    fm_commit();
    fm_wait<1>();  // this tile's K (and, the first time, nothing else pending)
    __syncthreads();
    const bool visible = fm_visible(w, lo, j0, nj, window);

    float s[NB][4];
    if (visible) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
      for (int kb = 0; kb < D; kb += 16) {
        unsigned int a[3][4];
#pragma unroll
        for (int p = 0; p < 3; ++p) fm_ldsm4(a[p], Qs + p * ROWS * qs + a_row * qs + kb + a_col);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
          unsigned int b[4];
          fm_ldsm4(b, Ks + (nb * 8 + b_row) * qs + kb + b_col);
#pragma unroll
          for (int p = 0; p < 3; ++p) {
            fm_mma(s[nb], a[p], b[0], b[1]);
            fm_mma(s[nb + 1], a[p], b[2], b[3]);
          }
        }
      }
      const float one[2] = {1.f, 1.f};
      fm_softmax<NB, VB>(s, acc, m, l, qp, one, scale, softcap, window, lo, j0, nj, t4, 1.f);
    }

    fm_wait<0>();  // this tile's V
    __syncthreads();  // every warp is done with the K tile
    if (j0 + BN < j_end) {
      fm_stage<NT>(Ks, qs, kh + (long long)(j0 + BN) * D, D, BN, min(BN, j_end - j0 - BN), D, D);
    }
    fm_commit();

    if (visible) {
#pragma unroll
      for (int kb = 0; kb < NB / 2; ++kb) {
        // P's A fragment over keys 16 kb ..: (row g, keys 2t4..), (row g + 8, ..), (row g, keys 8 + 2t4..), (g + 8, ..)
        unsigned int pa[3][4];
        fm_pair(s[2 * kb][0], s[2 * kb][1], pa[0][0], pa[1][0], pa[2][0]);
        fm_pair(s[2 * kb][2], s[2 * kb][3], pa[0][1], pa[1][1], pa[2][1]);
        fm_pair(s[2 * kb + 1][0], s[2 * kb + 1][1], pa[0][2], pa[1][2], pa[2][2]);
        fm_pair(s[2 * kb + 1][2], s[2 * kb + 1][3], pa[0][3], pa[1][3], pa[2][3]);
#pragma unroll
        for (int vb = 0; vb < VB; vb += 2) {
          if (vb * 8 < dvn) {
            unsigned int b[4];
            fm_ldsm4_t(b, Vs + (kb * 16 + v_row) * vs + vb * 8 + v_col);
#pragma unroll
            for (int p = 0; p < 3; ++p) {
              fm_mma(acc[vb], pa[p], b[0], b[1]);
              fm_mma(acc[vb + 1], pa[p], b[2], b[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // every warp is done with the V tile
  }
  fm_wait<0>();
  fm_store<VB>(acc, l, out, wr, g, t4, nr, r0, G, Hq, h, Dv, c0, dvn, 1.f);
}

// flash_mma_w<W>_n<BN>_c<DVC>(q, K, V, out, T, Hq, G, S, D, Dv, k_hs, v_hs, start, lo, scale, softcap (0: none),
//                            window (0: none))
#define FLASH_MMA(W, BN, DVC)                                                                                       \
  extern "C" __global__ void __launch_bounds__(32 * W, 1) flash_mma_w##W##_n##BN##_c##DVC(                          \
      const float* __restrict__ q, const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,      \
      float* __restrict__ out, int T, int Hq, int G, int S, int D, int Dv, long long k_hs, long long v_hs,          \
      int start, int lo, float scale, float softcap, int window) {                                                  \
    extern __shared__ uint4 fm_smem4[];                                                                             \
    flash_mma<W, BN, DVC>(q, k, v, out, T, Hq, G, S, D, Dv, k_hs, v_hs, start, lo, scale, softcap, window,          \
                          reinterpret_cast<unsigned short*>(fm_smem4));                                             \
  }

FLASH_MMA(4, 64, 256)
FLASH_MMA(4, 64, 128)
FLASH_MMA(4, 32, 256)
FLASH_MMA(4, 32, 128)
FLASH_MMA(2, 64, 256)
FLASH_MMA(2, 64, 128)
FLASH_MMA(2, 32, 256)
FLASH_MMA(2, 32, 128)

// ---- FP8 attention (attention.compute-quantization: fp8 over an fp8 KV cache) -------------------------------------
// The arithmetic of lumen_cuda/fp8_attention_model.py (``attend_tiled``, this kernel's tiles): each (token, head)
// query row scaled into e4m3 (sq = amax / 448, codes e4m3(q / sq), nearest even); S = the code products (exact) summed
// in f32 by mma.sync m16n8k32 e4m3, times sq and the softmax scale; online softmax in f32 per tile; P into e4m3 as
// e4m3(p x 448) with p relative to the running row max; O += P codes . V codes (f32), rescaled as the max moves; out
// = O / 448 / l. K comes from the cache as it is (Hkv, S, D) e4m3 bytes; V as ``fp8_vt`` lays it out: (Hkv, Dv,
// S16) with S16 = S rounded up to 16 and the keys of each 16 in the order (0 1 8 9 2 3 10 11 4 5 12 13 6 7 14 15), so
// that P's accumulator fragments are the A fragments of P V as they stand (a lane holds keys 2t, 2t + 1 of two
// 8-key blocks; the MMA wants four consecutive k) and V's B fragments are plain ldmatrix rows.
// flash_fp8_w4_n64_c<DVC>: grid (Hkv, ceil(T G / 64), ceil(Dv / DVC)), 128 threads; tiles start at a multiple of 16.
// Shared memory (bytes): query codes 64 x (D + 16), K tile 64 x (D + 16), V tile DVC x (64 + 16), 64 row scales.
// D % 32 == 0, Dv % 16 == 0 (the launcher checks). Below sm_89 the e4m3 instructions are compiled out and trap (the
// host never launches these there: ``flash_fp8_native``).

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define FM_FP8 1
#else
#define FM_FP8 0
#endif

// 1 where this module was compiled with the e4m3 instructions (sm_89 and later), else 0: the host checks it once.
extern "C" __global__ void flash_fp8_native(int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = FM_FP8;
}

__device__ __forceinline__ void fm_mma_e4m3(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
#if FM_FP8
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// four f32 (|x| <= 448) -> four e4m3 codes in one register, nearest even, x0 in the low byte
__device__ __forceinline__ unsigned int fm_e4m3x4(float x0, float x1, float x2, float x3) {
#if FM_FP8
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));  // the first source: upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return (unsigned int)lo | ((unsigned int)hi << 16);
#else
  __trap();
  return 0u;
#endif
}

// the key of logical position L (0..15) of a 16-key group in fp8_vt's order
__device__ __forceinline__ int fm_vt_key(int L) { return 2 * (L >> 2) + (L & 1) + 8 * ((L >> 1) & 1); }

// v (Hkv, S, Dv) e4m3 bytes (rows contiguous, head stride v_hs bytes) -> vt (Hkv, Dv, S16), keys permuted within each
// 16 (fm_vt_key), zero past S. Grid (ceil(S16 / 16), Hkv), 256 threads: a block one 16-key group of every column.
extern "C" __global__ void fp8_vt(const unsigned char* __restrict__ v, unsigned char* __restrict__ vt, int S,
                                  int S16, int Dv, long long v_hs) {
  const int g16 = blockIdx.x, h = blockIdx.y;
  const unsigned char* vh = v + h * v_hs;
  unsigned char* out = vt + (long long)h * Dv * S16 + g16 * 16;
  for (int i = threadIdx.x; i < 16 * Dv; i += blockDim.x) {
    const int c = i >> 4, L = i & 15, key = g16 * 16 + fm_vt_key(L);
    out[(long long)c * S16 + L] = key < S ? vh[(long long)key * Dv + c] : (unsigned char)0;
  }
}

template <int DVC>
__device__ __forceinline__ void flash_fp8(const float* __restrict__ q, const unsigned char* __restrict__ k,
                                          const unsigned char* __restrict__ vt, float* __restrict__ out, int T,
                                          int Hq, int G, int S, int S16, int D, int Dv, long long k_hs, int start,
                                          int lo, float scale, float softcap, int window, unsigned char* smem) {
  constexpr int W = 4, BN = 64, NT = 32 * W, ROWS = 16 * W, NB = BN / 8, VB = DVC / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.x;
  const int rb = gridDim.y - 1 - blockIdx.y;  // heaviest row block first
  const int rows = T * G, r0 = rb * ROWS;
  const int nr = min(ROWS, rows - r0);
  const int c0 = blockIdx.z * DVC, dvn = min(DVC, Dv - c0);
  const int qs = D + 16, vs = BN + 16;
  unsigned char* Qc = smem;                                   // (ROWS, qs) query codes
  unsigned char* Ks = Qc + ROWS * qs;                         // (BN, qs)
  unsigned char* Vs = Ks + BN * qs;                           // (DVC, vs) V^T tile
  float* SQ = reinterpret_cast<float*>(Vs + DVC * vs);        // (ROWS) query row scales

  const int qmin = start + r0 / G, qmax = start + (r0 + nr - 1) / G;
  const int j_begin = (window > 0 ? max(0, qmin - window + 1 - lo) : 0) & ~15;
  const int j_end = min(S, qmax - lo + 1);
  const unsigned char* kh = k + h * k_hs;
  const unsigned char* vth = vt + ((long long)h * Dv + c0) * S16;
  if (j_begin < j_end) fm_stage_bytes<NT>(Ks, qs, kh + (long long)j_begin * D, D, BN, min(BN, j_end - j_begin), D, D);
  fm_commit();

  // the query rows' codes and scales: warp w quantizes rows w, w + W, ...
  const int D4 = D >> 2;
#pragma unroll 1
  for (int rr = warp; rr < ROWS; rr += W) {
    const float* qr = nullptr;
    if (rr < nr) {
      const int r = r0 + rr, t = r / G, gg = r - t * G;
      qr = q + ((long long)t * Hq + h * G + gg) * D;
    }
    float amax = 0.f;
    for (int c = lane; c < D4; c += 32) {
      if (qr) {
        const float4 x = *reinterpret_cast<const float4*>(qr + 4 * c);
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))));
      }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sq = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    for (int c = lane; c < D4; c += 32) {
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (qr) x = *reinterpret_cast<const float4*>(qr + 4 * c);
      *reinterpret_cast<unsigned int*>(Qc + rr * qs + 4 * c) =
          fm_e4m3x4(__fdiv_rn(x.x, sq), __fdiv_rn(x.y, sq), __fdiv_rn(x.z, sq), __fdiv_rn(x.w, sq));
    }
    if (lane == 0) SQ[rr] = sq;
  }

  const int wr = warp * 16;
  const FmRows w = fm_rows(wr, g, nr, r0, G, start);
  const int(&qp)[2] = w.qp;

  float m[2] = {fm_neg_inf(), fm_neg_inf()}, l[2] = {0.f, 0.f}, sqr[2] = {1.f, 1.f};
  float acc[VB][4];
#pragma unroll
  for (int vb = 0; vb < VB; ++vb) acc[vb][0] = acc[vb][1] = acc[vb][2] = acc[vb][3] = 0.f;

  const int a_row = wr + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 16 * (lane >> 4);
  const int b_row = (lane & 7) + 8 * (lane >> 4), b_col = 16 * ((lane >> 3) & 1);

  for (int j0 = j_begin; j0 < j_end; j0 += BN) {
    const int nj = min(BN, j_end - j0);
    fm_stage_bytes<NT>(Vs, vs, vth + j0, S16, DVC, dvn, BN, S16 - j0);
    fm_commit();
    fm_wait<1>();
    __syncthreads();
    if (j0 == j_begin) {
      sqr[0] = SQ[wr + g];
      sqr[1] = SQ[wr + g + 8];
    }
    const bool visible = fm_visible(w, lo, j0, nj, window);

    float s[NB][4];
    if (visible) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll 1
      for (int kb = 0; kb < D; kb += 32) {
        unsigned int a[4];
        fm_ldsm4(a, Qc + a_row * qs + kb + a_col);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
          unsigned int b[4];
          fm_ldsm4(b, Ks + (nb * 8 + b_row) * qs + kb + b_col);
          fm_mma_e4m3(s[nb], a, b[0], b[1]);
          fm_mma_e4m3(s[nb + 1], a, b[2], b[3]);
        }
      }
      fm_softmax<NB, VB>(s, acc, m, l, qp, sqr, scale, softcap, window, lo, j0, nj, t4, 448.f);
    }

    fm_wait<0>();
    __syncthreads();
    if (j0 + BN < j_end) {
      fm_stage_bytes<NT>(Ks, qs, kh + (long long)(j0 + BN) * D, D, BN, min(BN, j_end - j0 - BN), D, D);
    }
    fm_commit();

    if (visible) {
#pragma unroll
      for (int kb = 0; kb < NB / 4; ++kb) {
        // P's A fragment over keys 32 kb ..: logical k 4 t4 .. of each 16 = keys 2 t4, 2 t4 + 1 of two 8-key blocks
        const float(&s0)[4] = s[4 * kb];
        const float(&s1)[4] = s[4 * kb + 1];
        const float(&s2)[4] = s[4 * kb + 2];
        const float(&s3)[4] = s[4 * kb + 3];
        const unsigned int pa[4] = {fm_e4m3x4(s0[0], s0[1], s1[0], s1[1]), fm_e4m3x4(s0[2], s0[3], s1[2], s1[3]),
                                    fm_e4m3x4(s2[0], s2[1], s3[0], s3[1]), fm_e4m3x4(s2[2], s2[3], s3[2], s3[3])};
#pragma unroll
        for (int vb = 0; vb < VB; vb += 2) {
          if (vb * 8 < dvn) {
            unsigned int b[4];
            fm_ldsm4(b, Vs + (vb * 8 + b_row) * vs + kb * 32 + b_col);
            fm_mma_e4m3(acc[vb], pa, b[0], b[1]);
            fm_mma_e4m3(acc[vb + 1], pa, b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();
  }
  fm_wait<0>();
  fm_store<VB>(acc, l, out, wr, g, t4, nr, r0, G, Hq, h, Dv, c0, dvn, 448.f);
}

// flash_fp8_w4_n64_c<DVC>(q, K codes, V^T codes (fp8_vt), out, T, Hq, G, S, S16, D, Dv, k_hs (bytes), start, lo,
//                         scale, softcap (0: none), window (0: none))
#define FLASH_FP8(DVC)                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, 1) flash_fp8_w4_n64_c##DVC(                                     \
      const float* __restrict__ q, const unsigned char* __restrict__ k, const unsigned char* __restrict__ vt,       \
      float* __restrict__ out, int T, int Hq, int G, int S, int S16, int D, int Dv, long long k_hs, int start,     \
      int lo, float scale, float softcap, int window) {                                                             \
    extern __shared__ uint4 fm_smem8[];                                                                             \
    flash_fp8<DVC>(q, k, vt, out, T, Hq, G, S, S16, D, Dv, k_hs, start, lo, scale, softcap, window,                 \
                   reinterpret_cast<unsigned char*>(fm_smem8));                                                     \
  }

FLASH_FP8(128)
FLASH_FP8(256)
