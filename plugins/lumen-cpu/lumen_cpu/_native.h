/* What the C kernels of lumen_cpu share (_native.c: fp8 and NVFP4 rows; _native_i8.c: the int8 layout's rows). */
#ifndef LUMEN_NATIVE_H
#define LUMEN_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define LUMEN_X86 1
#include <immintrin.h>
#endif

typedef int64_t i64;

/* 0 scalar, 1 AVX2 + FMA + F16C, 2 AVX-512 (F, BW, VL, DQ), 3 AVX-512 with VNNI; set by lumen_native_init */
extern int lumen_level;

/* The int8 layout's row kernels (_native_i8.c) read their rows lumen_prefetch bytes ahead of use (software
 * prefetch to all cache levels; 0: none; lumen_native_prefetch sets it, LUMEN_CPU_PREFETCH through lumen_cpu.native):
 * the hardware prefetchers restart at every 4 KB page and at every call, and a decode step's matrices are small
 * (0.5-3 MB) and cold. Measured on a 2-core Xeon VM (Gemma 3 270M's int8 matrices cycled through 400 MB, so each is
 * read from memory): 14-15 GB/s without, 17-19 GB/s with 4-32 KB ahead; its decode 44 -> 58 tok/s with 16 KB. The
 * fp8 / NVFP4 rows (_native.c) do not: one MoE layer's experts on the H200 host's 16 threads (64-row tasks) were no
 * faster with it (fp8 0.70 -> 0.74 ms, NVFP4 0.42 -> 0.51 ms cold, benchmarks/cpu_moe.py, 2026-12-02). */
extern i64 lumen_prefetch;

/* rows ahead of row i (of rows of `bytes`), and the prefetch of the row that many ahead when there is one */
static inline i64 rows_ahead(i64 bytes) { return lumen_prefetch > 0 ? (lumen_prefetch + bytes - 1) / bytes : 0; }

/* always_inline: GCC's -O2 otherwise finds the function free of side effects (ipa-pure-const) and drops its calls */
__attribute__((always_inline)) static inline void prefetch_ahead(const uint8_t *row, i64 ld, i64 bytes, i64 i, i64 n,
                                                                 i64 ahead) {
    if (ahead && i + ahead < n)
        for (i64 k = 0; k < bytes; k += 64) __builtin_prefetch(row + ahead * ld + k, 0, 3);
}

#define T2 __attribute__((target("avx2,fma,f16c")))
#define T5 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define T5V __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* an f16's bits as f32, exactly (subnormals and zero too; not infinities or NaN, which GGUF scales never hold):
 * the 15 magnitude bits moved into an f32 and rescaled by 2^112, the sign put back (lumen_cpu.int8.scale_at) */
static inline float f16_f32(uint32_t h) {
    return bits_f32(((h & 0x7FFFu) << 13) | ((h & 0x8000u) << 16)) * 5.192296858534828e33f;
}

#endif
