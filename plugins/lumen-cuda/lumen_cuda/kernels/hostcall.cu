// A captured decode step asking the CPU experts server (lumen_cpu/_native_serve.c) through its mailbox, a block of
// page-locked host memory this GPU reads and writes directly (hostcall.py, NativeCall). Two kernels a crossing:
//
// hostcall_post(x (H,) f32, ids (k,) int64, wts (k,) f32, H, k, mb, job, seq (1,) uint64 device): copies the token
//   into the mailbox, then writes the job number and seq = done + 1 (the server's last answer plus one: crossings
//   of a mailbox are strictly ordered, each post waits behind the previous wait), and keeps seq in device memory.
// hostcall_wait(mb, seq, out (H,) f32, H, timeout_ns): thread 0 polls `done` until it equals seq, then the block
//   copies the server's `out` into the device array. Past timeout_ns (globaltimer) it stops waiting, writes zeros,
//   and sets the mailbox's GPU error word (its current value + 1): the host raises after the step (hostcall.check).
//
// One block of 256 threads each. Offsets: the server's layout (lumen_serve_layout), passed as arguments.
// No headers: compiles under NVRTC and nvcc alike (sm_90, sm_120a).

typedef unsigned long long u64;

__device__ __forceinline__ u64 hostcall_load_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u64 hostcall_clock() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void hostcall_post(const float* x, const long long* ids, const float* wts, int H, int k,
                                         unsigned char* mb, long long off_x, long long off_ids, long long off_w,
                                         long long job, u64* seq) {
  volatile float* mx = (volatile float*)(mb + off_x);
  volatile long long* mi = (volatile long long*)(mb + off_ids);
  volatile float* mw = (volatile float*)(mb + off_w);
  for (int i = threadIdx.x; i < H; i += blockDim.x) mx[i] = x[i];
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    mi[i] = ids[i];
    mw[i] = wts[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const u64 s = hostcall_load_acquire((const u64*)(mb + 64)) + 1;
    *(volatile u64*)(mb + 8) = (u64)job;
    __threadfence_system();
    *(volatile u64*)(mb + 0) = s;
    __threadfence_system();
    seq[0] = s;
  }
}

extern "C" __global__ void hostcall_wait(unsigned char* mb, const u64* seq, float* out, int H, long long off_out,
                                         u64 timeout_ns) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const u64 s = seq[0], t0 = hostcall_clock();
    int good = 1;
    while (hostcall_load_acquire((const u64*)(mb + 64)) != s) {
      __nanosleep(64);
      if (hostcall_clock() - t0 > timeout_ns) {
        good = 0;
        volatile u64* err = (volatile u64*)(mb + 80);
        *err = *err + 1;
        __threadfence_system();
        break;
      }
    }
    ok = good;
  }
  __syncthreads();
  const volatile float* mo = (const volatile float*)(mb + off_out);
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[i] = ok ? mo[i] : 0.f;
}
