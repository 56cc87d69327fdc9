// Greedy decoding inside the device's stream (launched from graph.py): the argmax of a step's logits becomes the
// next step's input id, and the position advances, with no host round trip between steps.
//
// greedy_next(logits (n,) f32, n, part_v (GREEDY_BLOCKS,) f32, part_i (GREEDY_BLOCKS,) int32, counter (1,) uint32,
//             ids (1,) int64, pos (1,) int32, raw (1,) int64, remap (2 * nremap,) int64, nremap);
// grid GREEDY_BLOCKS, GREEDY_THREADS threads. Each block reduces a strided share of the logits to its best
// (value, index); the last block to finish (a ticket counter, reset to 0 for the next launch) reduces the block
// results, writes the token to raw[0], the id the embedding reads (remap pairs (token, id): a model's
// input_id remapping) to ids[0], and adds one to pos[0]. Order: larger value first, then the lower index; NaN
// counts as larger than any number (numpy's argmax: the first NaN wins).
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

#define GREEDY_BLOCKS 128
#define GREEDY_THREADS 256

__device__ __forceinline__ bool greedy_better(float v, int i, float bv, int bi) {
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return vn && (!bn || i < bi);
  return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index); the result is valid in thread 0.
__device__ __forceinline__ void greedy_block_best(float& bv, int& bi, float* sv, int* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (greedy_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < GREEDY_THREADS / 32; ++w)
      if (greedy_better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
  }
}

extern "C" __global__ void __launch_bounds__(GREEDY_THREADS)
    greedy_next(const float* __restrict__ logits, int n, float* __restrict__ part_v, int* __restrict__ part_i,
                unsigned int* __restrict__ counter, long long* __restrict__ ids, int* __restrict__ pos,
                long long* __restrict__ raw, const long long* __restrict__ remap, int nremap) {
  __shared__ float sv[GREEDY_THREADS / 32];
  __shared__ int si[GREEDY_THREADS / 32];
  __shared__ bool last;
  const float ninf = __uint_as_float(0xff800000u);
  float bv = ninf;
  int bi = 0x7fffffff;
  const int stride = GREEDY_BLOCKS * GREEDY_THREADS;
#pragma unroll 4
  for (int i = blockIdx.x * GREEDY_THREADS + threadIdx.x; i < n; i += stride) {
    const float v = logits[i];
    if (greedy_better(v, i, bv, bi)) { bv = v; bi = i; }
  }
  greedy_block_best(bv, bi, sv, si);
  if (threadIdx.x == 0) {
    part_v[blockIdx.x] = bv;
    part_i[blockIdx.x] = bi;
    __threadfence();
    last = atomicAdd(counter, 1u) == GREEDY_BLOCKS - 1;
  }
  __syncthreads();
  if (!last) return;  // block-uniform
  __threadfence();
  bv = ninf;
  bi = 0x7fffffff;
  for (int b = threadIdx.x; b < GREEDY_BLOCKS; b += GREEDY_THREADS) {
    const float v = ((volatile float*)part_v)[b];
    const int i = ((volatile int*)part_i)[b];
    if (greedy_better(v, i, bv, bi)) { bv = v; bi = i; }
  }
  __syncthreads();  // sv / si are reused
  greedy_block_best(bv, bi, sv, si);
  if (threadIdx.x == 0) {
    const long long tok = bi < n ? bi : 0;  // n == 0 cannot happen (the launcher checks)
    long long id = tok;
    for (int r = 0; r < nremap; ++r)
      if (remap[2 * r] == tok) id = remap[2 * r + 1];
    raw[0] = tok;
    ids[0] = id;
    pos[0] += 1;
    counter[0] = 0u;
  }
}
