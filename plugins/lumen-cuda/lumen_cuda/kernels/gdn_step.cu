// Gated-DeltaNet decode (one token), fused: the T = 1 case of delta.gated_delta_rule, and the causal conv1d
// update (delta.causal_conv1d at T = 1). Position-independent launches, no host sync: graph-capturable.
//
// gdn_step_r<RPT>(q (Hk, Dk), k (Hk, Dk), v (Hv, Dv), g (Hv,), beta (Hv,), S (Hv, Dk, Dv), out (Hv, Dv),
//                 Hk, Hv, Dk, Dv, qscale), all f32 contiguous, S updated in place.
//   Grid (Hv, ceil(Dv / 32)), GDN_WARPS * 32 threads; Dk <= GDN_WARPS * RPT (RPT = 4, 8, 16, 32: Dk up to 256).
//   Lane = value column j (coalesced rows of S), warp w = key rows w*RPT .. w*RPT+RPT-1, held in registers.
//   v head h reads k head h / (Hv / Hk). Per block: q, k of that head L2-normalised (x / sqrt(sum x^2 + 1e-6)),
//   q times qscale (Dk^-0.5) into shared memory; then with e = exp(g[h]):
//     s = S[h] * e;  kv = k . s  (over Dk, the warps' partials summed in order through shared memory)
//     delta = (v - kv) * beta;  s += k (x) delta;  S[h] = s;  out = q . s
//   Products and sums are rounded separately (no FMA contraction) where the CuPy op rounds them separately.
//
// conv1d_step(x (C,), w (C, K), state (K-1, C), y (C,), C, K): one thread per channel, ceil(C / 128) x 128:
//   y = silu(sum_k full[k] * w[:, k]) with full = state rows then x (summed in k order, products rounded, as the
//   CuPy op), then state = full[1:].
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#include "act.cuh"
#include "pdl.cuh"

#define GDN_WARPS 8

// The step of block (h, column chunk): qk(i, a, b) gives element i < Dk of head hk's raw q and k, vj this lane's
// value v[h, j] (j = blockIdx.y * 32 + lane; 0 past Dv).
template <int RPT, class QK>
__device__ __forceinline__ void gdn_core(QK qk, float vj, float gh, float bh, float* __restrict__ S,
                                         float* __restrict__ out, int Hk, int Hv, int Dk, int Dv, float qscale,
                                         float* __restrict__ snap) {
  __shared__ float qs[GDN_WARPS * RPT], ks[GDN_WARPS * RPT];
  __shared__ float red[GDN_WARPS][32];
  __shared__ float ssq[2][GDN_WARPS];
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int j = blockIdx.y * 32 + lane;
  const bool col = j < Dv;

  // L2-normalised q (times qscale) and k of head hk
  float sq = 0.f, sk = 0.f;
  for (int i = tid; i < Dk; i += GDN_WARPS * 32) {
    float a, b;
    qk(i, a, b);
    qs[i] = a;
    ks[i] = b;
    sq += a * a;
    sk += b * b;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, off);
    sk += __shfl_xor_sync(0xffffffffu, sk, off);
  }
  if (lane == 0) {
    ssq[0][w] = sq;
    ssq[1][w] = sk;
  }
  __syncthreads();
  sq = 0.f;
  sk = 0.f;
#pragma unroll
  for (int i = 0; i < GDN_WARPS; ++i) {
    sq += ssq[0][i];
    sk += ssq[1][i];
  }
  const float nq = sqrtf(sq + 1e-6f), nk = sqrtf(sk + 1e-6f);
  __syncthreads();  // everyone has read the raw q, k sums before they are overwritten below
  for (int i = tid; i < Dk; i += GDN_WARPS * 32) {
    qs[i] = __fmul_rn(qs[i] / nq, qscale);
    ks[i] = ks[i] / nk;
  }
  __syncthreads();

  const float e = expf(gh);
  const long long base = (long long)h * Dk * Dv;
  float s[RPT];
  float kv = 0.f;
#pragma unroll
  for (int m = 0; m < RPT; ++m) {
    const int i = w * RPT + m;
    s[m] = (col && i < Dk) ? __fmul_rn(S[base + (long long)i * Dv + j], e) : 0.f;
    if (i < Dk) kv = fmaf(ks[i], s[m], kv);
  }
  red[w][lane] = kv;
  __syncthreads();
  kv = 0.f;
#pragma unroll
  for (int i = 0; i < GDN_WARPS; ++i) kv += red[i][lane];
  const float delta = col ? __fmul_rn(vj - kv, bh) : 0.f;
  __syncthreads();  // red is reused below

  float o = 0.f;
#pragma unroll
  for (int m = 0; m < RPT; ++m) {
    const int i = w * RPT + m;
    if (i < Dk) {
      s[m] = __fadd_rn(s[m], __fmul_rn(ks[i], delta));
      if (col) {
        S[base + (long long)i * Dv + j] = s[m];
        if (snap) snap[base + (long long)i * Dv + j] = s[m];
      }
      o = fmaf(qs[i], s[m], o);
    }
  }
  red[w][lane] = o;
  __syncthreads();
  if (w == 0 && col) {
    o = 0.f;
#pragma unroll
    for (int i = 0; i < GDN_WARPS; ++i) o += red[i][lane];
    out[(long long)h * Dv + j] = o;
  }
}

template <int RPT>
__device__ __forceinline__ void gdn_step(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float gh, float bh, float* __restrict__ S,
                                         float* __restrict__ out, int Hk, int Hv, int Dk, int Dv, float qscale,
                                         float* __restrict__ snap = nullptr) {
  const long long off = (long long)(blockIdx.x / (Hv / Hk)) * Dk;  // head hk's q and k
  const int j = blockIdx.y * 32 + (threadIdx.x & 31);
  const float vj = j < Dv ? v[(long long)blockIdx.x * Dv + j] : 0.f;
  gdn_core<RPT>([&](int i, float& a, float& b) { a = q[off + i]; b = k[off + i]; }, vj, gh, bh, S, out, Hk, Hv, Dk,
                Dv, qscale, snap);
}

// The Gated-DeltaNet gates from the raw projections (cupy_ops.gdn_gates' expressions): g = neg_a softplus(a + dt_bias)
// and beta = sigmoid(b) of head h.
__device__ __forceinline__ void gdn_gate_values(const float* __restrict__ a, const float* __restrict__ b,
                                                const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                                int h, float& gh, float& bh) {
  const float t = a[h] + dt_bias[h];
  gh = neg_a[h] * (fmaxf(t, 0.0f) + log1pf(expf(-fabsf(t))));
  bh = 0.5f * (tanhf(0.5f * b[h]) + 1.0f);
}

#define GDN_STEP(RPT)                                                                                          \
  extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gdn_step_r##RPT(                               \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                   \
      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ S,                      \
      float* __restrict__ out, int Hk, int Hv, int Dk, int Dv, float qscale) {                                 \
    pdl_begin();                                                                                               \
    gdn_step<RPT>(q, k, v, g[blockIdx.x], beta[blockIdx.x], S, out, Hk, Hv, Dk, Dv, qscale);                   \
  }

// gdn_step_gates_r<RPT>(q, k, v, a (Hv,), b (Hv,), neg_a (Hv,), dt_bias (Hv,), S, out, ...): gdn_step_r with the
// gates computed in the block from the raw projections (g = neg_a softplus(a + dt_bias), beta = sigmoid(b), the
// expressions of cupy_ops.gdn_gates): one launch where gdn_gates and the step took two.
#define GDN_STEP_GATES(RPT)                                                                                    \
  extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gdn_step_gates_r##RPT(                         \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                   \
      const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ neg_a,               \
      const float* __restrict__ dt_bias, float* __restrict__ S, float* __restrict__ out, int Hk, int Hv,       \
      int Dk, int Dv, float qscale) {                                                                          \
    pdl_begin();                                                                                               \
    float gh, bh;                                                                                              \
    gdn_gate_values(a, b, neg_a, dt_bias, blockIdx.x, gh, bh);                                                 \
    gdn_step<RPT>(q, k, v, gh, bh, S, out, Hk, Hv, Dk, Dv, qscale);                                            \
  }

// B sequences at once (continuous batching): grid (Hv, ceil(Dv / 32), B); sequence b = blockIdx.z reads rows b of
// q, k, v, g, beta, updates the state Ss[b] and writes row b of out.
#define GDN_STEP_BATCH(RPT)                                                                                    \
  extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gdn_step_batch_r##RPT(                         \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                   \
      const float* __restrict__ g, const float* __restrict__ beta, float* const* __restrict__ Ss,               \
      float* __restrict__ out, int Hk, int Hv, int Dk, int Dv, float qscale) {                                 \
    pdl_begin();                                                                                               \
    const long long b = blockIdx.z;                                                                            \
    gdn_step<RPT>(q + b * Hk * Dk, k + b * Hk * Dk, v + b * Hv * Dv, g[b * Hv + blockIdx.x],                   \
                  beta[b * Hv + blockIdx.x], Ss[b],                                                            \
                  out + b * Hv * Dv, Hk, Hv, Dk, Dv, qscale);                                                  \
  }

// T tokens of one sequence in order (a speculative verify): token t reads rows t of q, k (T, Hk, Dk), v (T, Hv, Dv),
// g, beta (T, Hv), writes row t of out (T, Hv, Dv) and the state after it to snaps[t] (T, Hv, Dk, Dv); S ends as the
// state after the last token. Each thread rereads the state rows it wrote itself: no other block touches them.
#define GDN_STEPS(RPT)                                                                                         \
  extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gdn_steps_r##RPT(                              \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                   \
      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ S,                      \
      float* __restrict__ out, float* __restrict__ snaps, int T, int Hk, int Hv, int Dk, int Dv,               \
      float qscale) {                                                                                          \
    pdl_begin();                                                                                               \
    for (int t = 0; t < T; ++t) {                                                                              \
      gdn_step<RPT>(q + (long long)t * Hk * Dk, k + (long long)t * Hk * Dk, v + (long long)t * Hv * Dv,        \
                    g[(long long)t * Hv + blockIdx.x], beta[(long long)t * Hv + blockIdx.x], S,                \
                    out + (long long)t * Hv * Dv, Hk, Hv,                                                      \
                    Dk, Dv, qscale, snaps + (long long)t * Hv * Dk * Dv);                                      \
      __syncthreads();                                                                                         \
    }                                                                                                          \
  }

GDN_STEPS(4)
GDN_STEPS(8)
GDN_STEPS(16)
GDN_STEPS(32)
GDN_STEP(4)
GDN_STEP(8)
GDN_STEP(16)
GDN_STEP(32)
GDN_STEP_GATES(4)
GDN_STEP_GATES(8)
GDN_STEP_GATES(16)
GDN_STEP_GATES(32)
GDN_STEP_BATCH(4)
GDN_STEP_BATCH(8)
GDN_STEP_BATCH(16)
GDN_STEP_BATCH(32)

// Channel c of the one-token conv: silu(sum_k full[k] * w[c, k]), full = the state's rows then x (read only).
__device__ __forceinline__ float conv_value(const float* __restrict__ x, const float* __restrict__ w,
                                            const float* __restrict__ state, int c, int C, int K) {
  const float* wc = w + (long long)c * K;
  float acc = 0.f;
  for (int t = 0; t < K - 1; ++t) acc = __fadd_rn(acc, __fmul_rn(state[(long long)t * C + c], wc[t]));
  acc = __fadd_rn(acc, __fmul_rn(x[c], wc[K - 1]));
  const float th = tanhf(__fmul_rn(0.5f, acc));
  return __fmul_rn(acc, __fmul_rn(0.5f, __fadd_rn(th, 1.0f)));
}

// Channel c of the state moved on by one token: full[1:].
__device__ __forceinline__ void conv_shift(const float* __restrict__ x, float* __restrict__ state, int c, int C,
                                           int K) {
  for (int t = 0; t < K - 2; ++t) state[(long long)t * C + c] = state[(long long)(t + 1) * C + c];
  if (K >= 2) state[(long long)(K - 2) * C + c] = x[c];
}

__device__ __forceinline__ void conv1d_one(const float* __restrict__ x, const float* __restrict__ w,
                                           float* __restrict__ state, float* __restrict__ y, int C, int K) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float v = conv_value(x, w, state, c, C, K);
  conv_shift(x, state, c, C, K);
  y[c] = v;
}

extern "C" __global__ void __launch_bounds__(128) conv1d_step(const float* __restrict__ x,  // (C,)
                                                               const float* __restrict__ w,  // (C, K)
                                                               float* __restrict__ state,    // (K-1, C)
                                                               float* __restrict__ y,        // (C,)
                                                               int C, int K) {
  pdl_begin();
  conv1d_one(x, w, state, y, C, K);
}

// -- the whole token mixer between its projections, one token (ops.gated_delta_net) ----------------------------------
// gdn_decode_r<RPT>(qkv (C,), cw (C, K), cs (K-1, C), a, b, neg_a, dt_bias (Hv,), S (Hv, Dk, Dv), z (Hv, Dv),
//                   nw (Dv,), o (Hv, Dv) scratch, y (Hv, Dv), cnt (Hk + Hv,) int, Hk, Hv, Dk, Dv, K, qscale, eps)
// with C = 2 Hk Dk + Hv Dv (q, k, v channels); grid (Hv, ceil(Dv / 32)), GDN_WARPS * 32 threads; Dv <= 128 (one warp
// norms a head, as rms_norm_gated_f32 with 32 threads does). The launches conv1d_step, gdn_step_gates_r and
// rms_norm_gated_f32 did, bit for bit, in one:
//   - the conv: block (h, y) computes the q, k channels of head hk (read only; every block of hk does) and its own
//     32 v channels of head h (only it reads them: it moves their state on itself, after the step);
//   - the step (gdn_core) writes head h's columns to o;
//   - then two counters (zero at rest; the last to arrive puts its counter back to zero): cnt[hk] counts the blocks
//     that have read hk's q, k conv state, and the last of them moves those channels on; cnt[Hk + h] counts head
//     h's column blocks, and the last of them reads o's row h (written by the others; __threadfence before the
//     count) and writes y[h] = rms_norm(o[h], nw) * silu(z[h]) with rms_row's arithmetic for a 32-thread block.
template <int RPT>
__device__ __forceinline__ void gdn_decode(const float* __restrict__ qkv, const float* __restrict__ cw,
                                           float* __restrict__ cs, const float* __restrict__ a,
                                           const float* __restrict__ b, const float* __restrict__ neg_a,
                                           const float* __restrict__ dt_bias, float* __restrict__ S,
                                           const float* __restrict__ z, const float* __restrict__ nw,
                                           float* __restrict__ o, float* __restrict__ y, int* __restrict__ cnt,
                                           int Hk, int Hv, int Dk, int Dv, int K, float qscale, float eps) {
  __shared__ int last[2];
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int hk = h / (Hv / Hk), kd = Hk * Dk, C = 2 * kd + Hv * Dv;
  const int j = blockIdx.y * 32 + lane;
  const bool col = j < Dv;
  const int cv = 2 * kd + h * Dv + j;  // this lane's v channel
  const float vj = col ? conv_value(qkv, cw, cs, cv, C, K) : 0.f;
  float gh, bh;
  gdn_gate_values(a, b, neg_a, dt_bias, h, gh, bh);
  const int cq = hk * Dk, ck = kd + hk * Dk;
  gdn_core<RPT>([&](int i, float& qa, float& kb) {
    qa = conv_value(qkv, cw, cs, cq + i, C, K);
    kb = conv_value(qkv, cw, cs, ck + i, C, K);
  }, vj, gh, bh, S, o, Hk, Hv, Dk, Dv, qscale, nullptr);
  __syncthreads();  // every warp has read the v channels' state (gdn_core's barriers already order q and k's)
  if (w == 0 && col) conv_shift(qkv, cs, cv, C, K);
  __threadfence();  // o's row and the moved state visible before the counts below
  __syncthreads();
  if (tid == 0) {
    const int share = (Hv / Hk) * gridDim.y;
    last[0] = atomicAdd(cnt + hk, 1) == share - 1;
    if (last[0]) cnt[hk] = 0;
    last[1] = atomicAdd(cnt + Hk + h, 1) == (int)gridDim.y - 1;
    if (last[1]) cnt[Hk + h] = 0;
  }
  __syncthreads();
  if (last[0]) {  // every block of head hk has read its q, k channels: move them on
    for (int i = tid; i < 2 * Dk; i += GDN_WARPS * 32) conv_shift(qkv, cs, i < Dk ? cq + i : ck + i - Dk, C, K);
  }
  if (last[1] && w == 0) {  // head h's row of o is complete: its gated norm (rms_row with 32 threads, RMS_VPT 8)
    __threadfence();
    float xv[8], wv[8];
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int i = lane + 32 * m;
      xv[m] = i < Dv ? __ldcg(o + (long long)h * Dv + i) : 0.f;
      wv[m] = i < Dv ? nw[i] : 1.f;
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) ss = fmaf(xv[m], xv[m], ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = 1.0f / sqrtf(ss / (float)Dv + eps);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int i = lane + 32 * m;
      if (i < Dv) {
        float v = xv[m] * r;
        v *= wv[m];
        y[(long long)h * Dv + i] = mul_silu(v, z[(long long)h * Dv + i]);
      }
    }
  }
}

#define GDN_DECODE(RPT)                                                                                        \
  extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gdn_decode_r##RPT(                             \
      const float* __restrict__ qkv, const float* __restrict__ cw, float* __restrict__ cs,                     \
      const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ neg_a,               \
      const float* __restrict__ dt_bias, float* __restrict__ S, const float* __restrict__ z,                   \
      const float* __restrict__ nw, float* __restrict__ o, float* __restrict__ y, int* __restrict__ cnt,       \
      int Hk, int Hv, int Dk, int Dv, int K, float qscale, float eps) {                                        \
    pdl_begin();                                                                                               \
    gdn_decode<RPT>(qkv, cw, cs, a, b, neg_a, dt_bias, S, z, nw, o, y, cnt, Hk, Hv, Dk, Dv, K, qscale, eps);    \
  }

GDN_DECODE(4)
GDN_DECODE(8)
GDN_DECODE(16)
GDN_DECODE(32)

// B sequences: grid (ceil(C / 128), B); sequence b = blockIdx.y: row b of x and y, the state states[b].
extern "C" __global__ void __launch_bounds__(128) conv1d_step_batch(const float* __restrict__ x,  // (B, C)
                                                                     const float* __restrict__ w,  // (C, K)
                                                                     float* const* __restrict__ states,
                                                                     float* __restrict__ y,  // (B, C)
                                                                     int C, int K) {
  pdl_begin();
  const long long b = blockIdx.y;
  conv1d_one(x + b * C, w, states[b], y + b * C, C, K);
}

// T tokens of one sequence in order (a speculative verify): row t of x (T, C) -> row t of y (T, C), the state after
// token t to snaps[t] (T, K-1, C). One thread per channel: it alone reads and writes its channel of the state.
extern "C" __global__ void __launch_bounds__(128) conv1d_steps(const float* __restrict__ x,  // (T, C)
                                                                const float* __restrict__ w,  // (C, K)
                                                                float* __restrict__ state,    // (K-1, C)
                                                                float* __restrict__ y,        // (T, C)
                                                                float* __restrict__ snaps,    // (T, K-1, C)
                                                                int T, int C, int K) {
  pdl_begin();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int t = 0; t < T; ++t) {
    conv1d_one(x + (long long)t * C, w, state, y + (long long)t * C, C, K);
    for (int r = 0; r < K - 1; ++r)
      snaps[((long long)t * (K - 1) + r) * C + c] = state[(long long)r * C + c];
  }
}

// The prefill conv (delta.causal_conv1d for any T): y (T, C) from x (T, C) and the state (K-1, C), the state read
// only. Grid (ceil(C / 128), ceil(T / CONV_TOKENS)), 128 threads: thread c of block (bx, by) computes channel c of
// tokens by * CONV_TOKENS ..., each from full = [state; x] rows t .. t + K - 1 (the taps' re-reads hit the cache),
// in the order and rounding of conv1d_one. The caller moves the state on afterwards: other blocks read it here.
#define CONV_TOKENS 16
extern "C" __global__ void __launch_bounds__(128) conv1d_prefill(const float* __restrict__ x,      // (T, C)
                                                                  const float* __restrict__ w,      // (C, K)
                                                                  const float* __restrict__ state,  // (K-1, C)
                                                                  float* __restrict__ y,            // (T, C)
                                                                  int T, int C, int K) {
  pdl_begin();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float* wc = w + (long long)c * K;
  const int t0 = blockIdx.y * CONV_TOKENS, t1 = min(T, t0 + CONV_TOKENS);
  for (int t = t0; t < t1; ++t) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) {
      const int r = t + k;  // row of full: state row r (r < K - 1), else x row r - (K - 1)
      const float v = r < K - 1 ? state[(long long)r * C + c] : x[(long long)(r - (K - 1)) * C + c];
      acc = __fadd_rn(acc, __fmul_rn(v, wc[k]));
    }
    const float th = tanhf(__fmul_rn(0.5f, acc));
    y[(long long)t * C + c] = __fmul_rn(acc, __fmul_rn(0.5f, __fadd_rn(th, 1.0f)));
  }
}
