// Programmatic dependent launch (Hopper and later: sm_90, sm_120). Lumen's graph runner launches the kernels of the
// files named in lumen_cuda.kernels.PDL_FILES with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION while it
// captures a decode step (LUMEN_CUDA_PDL), so that a kernel's blocks may start while the kernel before it finishes.
// Every extern "C" kernel of such a file calls pdl_begin() before its first read or write of anything a kernel
// before it may write (its weights may be read earlier: they are never written during a step):
//   - griddepcontrol.wait: blocks until every grid this one depends on has completed and its memory is visible
//     (a no-op in a launch without the attribute, or with no such dependency);
//   - griddepcontrol.launch_dependents: lets the next kernel's blocks be scheduled once every block of this grid
//     has issued it (they then wait in their own pdl_begin, so no kernel reads before its producer is done).
// Both compile to nothing before sm_90. tests/test_cuda_pdl_sources.py checks that every kernel of those files
// calls it.
#pragma once

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
