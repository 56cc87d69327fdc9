// Programmatic dependent launch (Hopper and later: sm_90, sm_120). With LUMEN_CUDA_PDL=1, lumen_cuda.kernels compiles
// the files named in PDL_FILES with -DLUMEN_PDL and launches their kernels with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION while it captures a decode step, so that a kernel's blocks may
// start while the kernel before it finishes. Without LUMEN_PDL (the default build) both helpers are empty.
// Every extern "C" kernel of such a file calls pdl_begin() before its first read or write of anything a kernel
// before it may write (its weights may be read earlier: they are never written during a step):
//   - griddepcontrol.wait: blocks until every grid this one depends on has completed and its memory is visible
//     (a no-op in a launch without the attribute, or with no such dependency);
//   - griddepcontrol.launch_dependents: lets the next kernel's blocks be scheduled once every block of this grid
//     has issued it (they then wait in their own pdl_begin, so no kernel reads before its producer is done).
// Both compile to nothing before sm_90 or without LUMEN_PDL. tests/test_cuda_pdl_sources.py checks that every
// kernel of those files calls it.
#pragma once

#if defined(LUMEN_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LUMEN_PDL_ON 1
#endif

// LUMEN_PDL_NO_TRIGGER (LUMEN_CUDA_PDL=late): the wait alone; the next kernel is then scheduled as this one's blocks
// exit (the implicit trigger), so its blocks never hold an SM that this kernel's later blocks could use.
__device__ __forceinline__ void pdl_begin() {
#ifdef LUMEN_PDL_ON
  asm volatile("griddepcontrol.wait;" ::: "memory");
#ifndef LUMEN_PDL_NO_TRIGGER
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
}

// Before pdl_begin() in a GEMV: L2 prefetches of this warp's rows [row0, row0 + rows) (clipped to N) of a row-major
// weight matrix, row_bytes each, up to PDL_PREFETCH_BYTES a warp, one prefetch per 128-byte line over the lanes.
// Weights are never written during a step, so their reads may start while the kernel before still runs; the
// prefetch only warms L2 (no register, no fault), the kernel's own loads follow after the wait.
#define PDL_PREFETCH_BYTES 16384
// LUMEN_PDL_NO_PREFETCH (LUMEN_CUDA_PDL=noprefetch or late): none.
__device__ __forceinline__ void pdl_prefetch_rows(const void* base, long long row_bytes, int row0, int rows, int N) {
#if defined(LUMEN_PDL_ON) && !defined(LUMEN_PDL_NO_PREFETCH)
  if (row0 >= N) return;
  const int n = rows < N - row0 ? rows : N - row0;
  long long bytes = (long long)n * row_bytes;
  if (bytes > PDL_PREFETCH_BYTES) bytes = PDL_PREFETCH_BYTES;
  const char* p = static_cast<const char*>(base) + (long long)row0 * row_bytes;
  for (long long off = (long long)(threadIdx.x & 31) * 128; off < bytes; off += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
#endif
}
