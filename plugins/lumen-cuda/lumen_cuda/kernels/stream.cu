// Streamed routed experts (stream.py): routing counts, read by the host between decode steps to choose which
// experts the VRAM expert cache keeps.

// counts[e] += number of times expert e occurs among the n ids (int64 if ids64, else int32); ids outside
// [0, E) (masked slots) are not counted. One thread per id.
extern "C" __global__ void moe_count(const void* ids, int ids64, int n, int E, int* counts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long e = ids64 ? static_cast<const long long*>(ids)[i] : static_cast<const int*>(ids)[i];
  if (e >= 0 && e < E) atomicAdd(counts + e, 1);
}
