// MoE routing, one warp per token row (launched from moe.py): softmax over E <= 1024 router logits, then the top
// k (k <= 32) by (probability descending, expert index ascending) -- the stable argsort of -p, as ops.moe_route --
// and the k weights renormalised (a sequential sum in slot order) when asked.
//
// moe_route_warp(logits (T, E) f32, weights (T, k) f32, ids (T, k) int64, T, E, k, normalize);
// grid ceil(T / ROUTEW_WARPS), ROUTEW_WARPS * 32 threads. Lane l holds logits l, l + 32, ... in registers; no shared
// memory and no block barrier, so a decode step's routing costs one short kernel (the block-wide version in
// moe.cu needs two barriers per selected expert).
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#define ROUTEW_WARPS 4
#define ROUTEW_PER_LANE 32  // E <= 32 * 32

__device__ __forceinline__ bool route_beats(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

extern "C" __global__ void __launch_bounds__(ROUTEW_WARPS * 32)
    moe_route_warp(const float* __restrict__ logits, float* __restrict__ w_out, long long* __restrict__ ids_out,
                   int T, int E, int k, int normalize) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * ROUTEW_WARPS + (threadIdx.x >> 5);
  if (row >= T) return;  // warp-uniform
  const float* lg = logits + (long long)row * E;
  const float ninf = __uint_as_float(0xff800000u);

  float p[ROUTEW_PER_LANE];
  float m = ninf;
#pragma unroll
  for (int j = 0; j < ROUTEW_PER_LANE; ++j) {
    const int i = lane + 32 * j;
    p[j] = i < E ? lg[i] : ninf;
    m = fmaxf(m, p[j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < ROUTEW_PER_LANE; ++j) {
    if (lane + 32 * j < E) {
      p[j] = expf(p[j] - m);
      s += p[j];
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
#pragma unroll
  for (int j = 0; j < ROUTEW_PER_LANE; ++j) p[j] = lane + 32 * j < E ? p[j] / s : -1.f;  // -1: never chosen

  float sum = 0.f, mine = 0.f;  // lane j < k keeps slot j's probability
  for (int r = 0; r < k; ++r) {
    float bv = -1.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < ROUTEW_PER_LANE; ++j)
      if (p[j] > bv) { bv = p[j]; bi = lane + 32 * j; }  // j ascends: the first of equal values stays
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (route_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const bool found = bi < E;  // always, unless the row holds NaN
#pragma unroll
    for (int j = 0; j < ROUTEW_PER_LANE; ++j)
      if (found && lane + 32 * j == bi) p[j] = -1.f;
    const float v = found ? bv : 0.f;
    sum += v;  // the same sequential order in every lane
    if (lane == r) mine = v;
    if (lane == 0) ids_out[(long long)row * k + r] = found ? bi : -1;  // -1: an id the expert kernels skip
  }
  if (lane < k) w_out[(long long)row * k + lane] = normalize ? mine / sum : mine;
}
