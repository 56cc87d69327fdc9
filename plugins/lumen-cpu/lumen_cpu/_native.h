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
