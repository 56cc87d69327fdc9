// Gated-DeltaNet prefill, chunked (C = 64 steps per chunk), f32: delta.gated_delta_rule / delta._chunked in two
// launches per call (lumen_cuda.gdn_prefill drives them).
//
// gdn_chunk_prep: grid (nch, Hv), 256 threads, dynamic shared memory 4 * (2 * C * (Dk | 1) + C * C + 3 * C) bytes.
//   One chunk of one v head (h reads k head h / (Hv / Hk)); steps t >= T are padding (q = k = v = beta = g = 0).
//   q, k rows L2-normalised (x / sqrt(sum x^2 + 1e-6)), q times qscale; cum = inclusive cumsum of g in the chunk.
//   Writes, per (h, chunk) = hn (scratch laid out (Hv, nch, ...)):
//     QT (Dk, C):  (q_t e^{cum_t})^T                        KD (C, Dk): k_t e^{cum_last - cum_t}
//     IT (C, C):   IT[j][i] = (q_i . k_j) e^{cum_i - cum_j} for j <= i, else 0 (the intra matrix, transposed)
//     WT (Dk, C):  (L^-1 (k beta e^cum))^T                  U (C, Dv):  L^-1 (v beta)
//     GL:          e^{cum_last}
//   with L = I + A, A[i][j] = beta_i (k_i . k_j) e^{cum_i - cum_j} for j < i (strictly lower). L^-1 X is solved by
//   forward substitution, one thread per column of X (the column kept in registers, no block syncs).
//
// gdn_chunk_scan<NG>: grid (Hv, ceil(Dv / 32)), 256 threads (8 warps), NG = ceil(round4(Dk) / 32) (1, 2, 4, 8),
//   dynamic shared memory 4 * (Dk * 32 + 2 * max(round4(Dk), C) * C + C * 32) bytes.
//   Lane = value column c0 + lane of the state tile S (Dk x 32, in shared memory), sequential over the chunks:
//     v_new = U - W S;  o = (q e^cum) S + intra v_new;  S = S e^{cum_last} + KD^T v_new
//   Warp w owns chunk rows w*8 .. w*8+7 of v_new and o, and state rows d0 .. d0+3 for d0 = w*4 + 32*g (g < NG).
//   out (T, Hv, Dv) rows t < T written; S (Hv, Dk, Dv) read at the start and written at the end.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#define GDN_C 64
#define GDN_NT 256

extern "C" __global__ void __launch_bounds__(GDN_NT, 2)
    gdn_chunk_prep(const float* __restrict__ q,     // (T, Hk, Dk)
                   const float* __restrict__ k,     // (T, Hk, Dk)
                   const float* __restrict__ v,     // (T, Hv, Dv)
                   const float* __restrict__ g,     // (T, Hv)
                   const float* __restrict__ beta,  // (T, Hv)
                   float* __restrict__ QT, float* __restrict__ KD, float* __restrict__ IT,
                   float* __restrict__ WT, float* __restrict__ U, float* __restrict__ GL,
                   int T, int Hk, int Hv, int Dk, int Dv, int nch, float qscale) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int ld = Dk | 1;  // odd row stride: column walks over rows hit distinct banks
  float* Ks = sm;                 // (C, ld) normalised k
  float* Xs = Ks + GDN_C * ld;    // (C, ld) normalised, scaled q
  float* As = Xs + GDN_C * ld;    // (C, C)  strictly lower A
  float* cum = As + GDN_C * GDN_C;
  float* bet = cum + GDN_C;
  float* ksc = bet + GDN_C;       // beta_t e^{cum_t}

  const int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int hk = h / (Hv / Hk);
  const int t0 = chunk * GDN_C;
  const long long hn = (long long)h * nch + chunk;

  if (tid < GDN_C) {
    const int t = t0 + tid;
    cum[tid] = t < T ? g[(long long)t * Hv + h] : 0.f;
    bet[tid] = t < T ? beta[(long long)t * Hv + h] : 0.f;
  }
  __syncthreads();
  if (tid == 0) {
    float c = 0.f;
    for (int t = 0; t < GDN_C; ++t) {
      c += cum[t];
      cum[t] = c;
    }
  }
  // normalised rows of q and k: warp w takes rows w, w + 8, ...
  for (int r = w; r < GDN_C; r += GDN_NT / 32) {
    const int t = t0 + r;
    const bool ok = t < T;
    const float* qr = q + ((long long)t * Hk + hk) * Dk;
    const float* kr = k + ((long long)t * Hk + hk) * Dk;
    float sq = 0.f, sk = 0.f;
    for (int d = lane; d < Dk; d += 32) {
      const float a = ok ? qr[d] : 0.f, b = ok ? kr[d] : 0.f;
      Xs[r * ld + d] = a;
      Ks[r * ld + d] = b;
      sq += a * a;
      sk += b * b;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, off);
      sk += __shfl_xor_sync(0xffffffffu, sk, off);
    }
    const float nq = sqrtf(sq + 1e-6f), nk = sqrtf(sk + 1e-6f);
    for (int d = lane; d < Dk; d += 32) {  // the same lane wrote these elements above
      Xs[r * ld + d] = (Xs[r * ld + d] / nq) * qscale;
      Ks[r * ld + d] = Ks[r * ld + d] / nk;
    }
  }
  __syncthreads();
  const float clast = cum[GDN_C - 1];
  if (tid < GDN_C) ksc[tid] = bet[tid] * expf(cum[tid]);
  if (tid == 0) GL[hn] = expf(clast);

  // QT (Dk, C) and KD (C, Dk)
  {
    float* qt = QT + hn * Dk * GDN_C;
    float* kd = KD + hn * GDN_C * Dk;
    for (int idx = tid; idx < Dk * GDN_C; idx += GDN_NT) {
      const int d = idx / GDN_C, t = idx % GDN_C;
      qt[idx] = Xs[t * ld + d] * expf(cum[t]);
      const int t2 = idx / Dk, d2 = idx % Dk;
      kd[idx] = Ks[t2 * ld + d2] * expf(clast - cum[t2]);
    }
  }

  // A and the intra matrix: thread tile rows i = it*4 + m (m < 4), columns j = jt + 16n (n < 4)
  {
    const int it = tid >> 4, jt = tid & 15;
    float ak[4][4], aq[4][4];
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int n = 0; n < 4; ++n) ak[m][n] = aq[m][n] = 0.f;
    if (jt <= it * 4 + 3) {  // some j of this tile is <= some i (else the tile lies above the diagonal)
      for (int d = 0; d < Dk; ++d) {
        float kj[4], ki[4], qi[4];
#pragma unroll
        for (int n = 0; n < 4; ++n) kj[n] = Ks[(jt + 16 * n) * ld + d];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          ki[m] = Ks[(it * 4 + m) * ld + d];
          qi[m] = Xs[(it * 4 + m) * ld + d];
        }
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            ak[m][n] = fmaf(ki[m], kj[n], ak[m][n]);
            aq[m][n] = fmaf(qi[m], kj[n], aq[m][n]);
          }
      }
    }
    float* itp = IT + hn * GDN_C * GDN_C;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int j = jt + 16 * n;
      float o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = it * 4 + m;
        const float dec = j <= i ? expf(cum[i] - cum[j]) : 0.f;
        As[i * GDN_C + j] = j < i ? bet[i] * ak[m][n] * dec : 0.f;
        o[m] = j <= i ? aq[m][n] * dec : 0.f;
      }
      *reinterpret_cast<float4*>(itp + j * GDN_C + it * 4) = make_float4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();

  // forward substitution (I + A) X = B, one column of B per thread: B = k beta e^cum (-> WT) or v beta (-> U)
  for (int col = tid; col < Dk + Dv; col += GDN_NT) {
    float x[GDN_C];
    const bool isw = col < Dk;
    if (isw) {
#pragma unroll
      for (int t = 0; t < GDN_C; ++t) x[t] = Ks[t * ld + col] * ksc[t];
    } else {
      const int c = col - Dk;
#pragma unroll
      for (int t = 0; t < GDN_C; ++t)
        x[t] = (t0 + t < T) ? v[((long long)(t0 + t) * Hv + h) * Dv + c] * bet[t] : 0.f;
    }
#pragma unroll
    for (int i = 1; i < GDN_C; ++i) {
      float a0 = x[i], a1 = 0.f;
#pragma unroll
      for (int j = 0; j < i; j += 2) {
        a0 = fmaf(-As[i * GDN_C + j], x[j], a0);
        if (j + 1 < i) a1 = fmaf(-As[i * GDN_C + j + 1], x[j + 1], a1);
      }
      x[i] = a0 + a1;
    }
    if (isw) {
      float4* wt = reinterpret_cast<float4*>(WT + (hn * Dk + col) * GDN_C);
#pragma unroll
      for (int t = 0; t < GDN_C; t += 4) wt[t / 4] = make_float4(x[t], x[t + 1], x[t + 2], x[t + 3]);
    } else {
      float* u = U + hn * GDN_C * Dv + (col - Dk);
#pragma unroll
      for (int t = 0; t < GDN_C; ++t) u[(long long)t * Dv] = x[t];
    }
  }
}

template <int NG>
__device__ __forceinline__ void gdn_chunk_scan(const float* __restrict__ QT, const float* __restrict__ KD,
                                               const float* __restrict__ IT, const float* __restrict__ WT,
                                               const float* __restrict__ U, const float* __restrict__ GL,
                                               float* __restrict__ S, float* __restrict__ out, int T, int Hv,
                                               int Dk, int Dv, int nch) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int DkP = (Dk + 3) & ~3;
  const int rows = DkP > GDN_C ? DkP : GDN_C;
  float* Ss = sm;                  // (Dk, 32) state tile
  float* Ba = Ss + Dk * 32;        // (Dk, C) WT, then (C, C) IT
  float* Bb = Ba + rows * GDN_C;   // (Dk, C) QT, then (C, DkP) KD
  float* Vn = Bb + rows * GDN_C;   // (C, 32) v_new

  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int col = blockIdx.y * 32 + lane;
  const bool cok = col < Dv;
  float* Sh = S + (long long)h * Dk * Dv;

  for (int idx = tid; idx < Dk * 32; idx += GDN_NT) {
    const int d = idx >> 5, c = blockIdx.y * 32 + (idx & 31);
    Ss[idx] = c < Dv ? Sh[(long long)d * Dv + c] : 0.f;
  }

  for (int n = 0; n < nch; ++n) {
    const long long hn = (long long)h * nch + n;
    {
      const float4* wt = reinterpret_cast<const float4*>(WT + hn * Dk * GDN_C);
      const float4* qt = reinterpret_cast<const float4*>(QT + hn * Dk * GDN_C);
      float4* ba = reinterpret_cast<float4*>(Ba);
      float4* bb = reinterpret_cast<float4*>(Bb);
      for (int idx = tid; idx < Dk * GDN_C / 4; idx += GDN_NT) {
        ba[idx] = wt[idx];
        bb[idx] = qt[idx];
      }
    }
    float u[8];
    const float* uh = U + hn * GDN_C * Dv;
#pragma unroll
    for (int m = 0; m < 8; ++m) u[m] = cok ? uh[(long long)(w * 8 + m) * Dv + col] : 0.f;
    __syncthreads();

    // v_new = U - W S and o = (q e^cum) S, rows w*8 .. w*8+7
    float av[8], ao[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) av[m] = ao[m] = 0.f;
    for (int d = 0; d < Dk; ++d) {
      const float s = Ss[d * 32 + lane];
      const float4 w0 = *reinterpret_cast<const float4*>(Ba + d * GDN_C + w * 8);
      const float4 w1 = *reinterpret_cast<const float4*>(Ba + d * GDN_C + w * 8 + 4);
      const float4 q0 = *reinterpret_cast<const float4*>(Bb + d * GDN_C + w * 8);
      const float4 q1 = *reinterpret_cast<const float4*>(Bb + d * GDN_C + w * 8 + 4);
      av[0] = fmaf(w0.x, s, av[0]); av[1] = fmaf(w0.y, s, av[1]);
      av[2] = fmaf(w0.z, s, av[2]); av[3] = fmaf(w0.w, s, av[3]);
      av[4] = fmaf(w1.x, s, av[4]); av[5] = fmaf(w1.y, s, av[5]);
      av[6] = fmaf(w1.z, s, av[6]); av[7] = fmaf(w1.w, s, av[7]);
      ao[0] = fmaf(q0.x, s, ao[0]); ao[1] = fmaf(q0.y, s, ao[1]);
      ao[2] = fmaf(q0.z, s, ao[2]); ao[3] = fmaf(q0.w, s, ao[3]);
      ao[4] = fmaf(q1.x, s, ao[4]); ao[5] = fmaf(q1.y, s, ao[5]);
      ao[6] = fmaf(q1.z, s, ao[6]); ao[7] = fmaf(q1.w, s, ao[7]);
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) Vn[(w * 8 + m) * 32 + lane] = cok ? u[m] - av[m] : 0.f;
    __syncthreads();  // Ba, Bb read; Vn complete

    {
      const float4* it = reinterpret_cast<const float4*>(IT + hn * GDN_C * GDN_C);
      float4* ba = reinterpret_cast<float4*>(Ba);
      for (int idx = tid; idx < GDN_C * GDN_C / 4; idx += GDN_NT) ba[idx] = it[idx];
      const float* kd = KD + hn * GDN_C * Dk;
      for (int idx = tid; idx < GDN_C * DkP; idx += GDN_NT) {
        const int t = idx / DkP, d = idx % DkP;
        Bb[idx] = d < Dk ? kd[(long long)t * Dk + d] : 0.f;
      }
    }
    const float e = GL[hn];
    __syncthreads();

    // o += intra v_new (IT[j][i] = intra[i][j], zero above the diagonal)
    for (int j = 0; j < w * 8 + 8; ++j) {
      const float vn = Vn[j * 32 + lane];
      const float4 i0 = *reinterpret_cast<const float4*>(Ba + j * GDN_C + w * 8);
      const float4 i1 = *reinterpret_cast<const float4*>(Ba + j * GDN_C + w * 8 + 4);
      ao[0] = fmaf(i0.x, vn, ao[0]); ao[1] = fmaf(i0.y, vn, ao[1]);
      ao[2] = fmaf(i0.z, vn, ao[2]); ao[3] = fmaf(i0.w, vn, ao[3]);
      ao[4] = fmaf(i1.x, vn, ao[4]); ao[5] = fmaf(i1.y, vn, ao[5]);
      ao[6] = fmaf(i1.z, vn, ao[6]); ao[7] = fmaf(i1.w, vn, ao[7]);
    }
    if (cok) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const int t = n * GDN_C + w * 8 + m;
        if (t < T) out[((long long)t * Hv + h) * Dv + col] = ao[m];
      }
    }

    // S = S e + KD^T v_new, state rows d0 .. d0+3, d0 = w*4 + 32*gi
    float sa[NG][4];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      const int d0 = w * 4 + 32 * gi;
#pragma unroll
      for (int r = 0; r < 4; ++r) sa[gi][r] = d0 + r < Dk ? Ss[(d0 + r) * 32 + lane] * e : 0.f;
    }
    for (int t = 0; t < GDN_C; ++t) {
      const float vn = Vn[t * 32 + lane];
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) {
        const int d0 = w * 4 + 32 * gi;
        if (d0 < DkP) {
          const float4 kk = *reinterpret_cast<const float4*>(Bb + t * DkP + d0);
          sa[gi][0] = fmaf(kk.x, vn, sa[gi][0]);
          sa[gi][1] = fmaf(kk.y, vn, sa[gi][1]);
          sa[gi][2] = fmaf(kk.z, vn, sa[gi][2]);
          sa[gi][3] = fmaf(kk.w, vn, sa[gi][3]);
        }
      }
    }
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      const int d0 = w * 4 + 32 * gi;
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (d0 + r < Dk) Ss[(d0 + r) * 32 + lane] = sa[gi][r];
    }
    __syncthreads();  // Ba, Bb, Vn free for the next chunk; Ss complete
  }

  if (cok) {
    for (int d = w; d < Dk; d += GDN_NT / 32) Sh[(long long)d * Dv + col] = Ss[d * 32 + lane];
  }
}

#define GDN_SCAN(NG)                                                                                           \
  extern "C" __global__ void __launch_bounds__(GDN_NT) gdn_chunk_scan_g##NG(                                  \
      const float* __restrict__ QT, const float* __restrict__ KD, const float* __restrict__ IT,                \
      const float* __restrict__ WT, const float* __restrict__ U, const float* __restrict__ GL,                 \
      float* __restrict__ S, float* __restrict__ out, int T, int Hv, int Dk, int Dv, int nch) {                \
    gdn_chunk_scan<NG>(QT, KD, IT, WT, U, GL, S, out, T, Hv, Dk, Dv, nch);                                     \
  }

GDN_SCAN(1)
GDN_SCAN(2)
GDN_SCAN(4)
GDN_SCAN(8)
