// Small activations shared by several kernel files (no headers: NVRTC and nvcc alike).
#pragma once

// u * silu(g) as the elementwise kernel of lumen_cuda.cupy_ops computes it (the sigmoid through tanh, the CPU's)
__device__ __forceinline__ float mul_silu(float u, float g) { return u * (g * (0.5f * (tanhf(0.5f * g) + 1.0f))); }
