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

/* 0 scalar, 1 AVX2 + FMA + F16C, 2 AVX-512 (F, BW, VL, DQ), 3 AVX-512 with VNNI, 4 that and AMX-BF16 (the tile
 * state granted to the process, _native_amx.c); set by lumen_native_init */
extern int lumen_level;

/* The int8 layout's row kernels (_native_i8.c) read their rows lumen_prefetch bytes ahead of use (software
 * prefetch to all cache levels; 0: none; lumen_native_prefetch sets it, LUMEN_CPU_PREFETCH through lumen_cpu.native):
 * the hardware prefetchers restart at every 4 KB page and at every call, and a decode step's matrices are small
 * (0.5-3 MB) and cold. Measured on a 2-core Xeon VM (Gemma 3 270M's int8 matrices cycled through 400 MB, so each is
 * read from memory): 14-15 GB/s without, 17-19 GB/s with 4-32 KB ahead; its decode 44 -> 58 tok/s with 16 KB. The
 * fp8 / NVFP4 rows (_native.c, _native_moe.c) take their distance as an argument: 0 from the GEMVs (lumen_fp8_rows,
 * lumen_nvfp4_rows), moe_fused.PREFETCH (4 KB) from one token's expert tasks (lumen_moe_worker), measured there with
 * benchmarks/cpu_moe.py-style cold calls (2026-12-02): one layer's experts, 64 / 128-row tasks, no prefetch -> 4 KB:
 * H200 host 16 threads NVFP4 0.297 -> 0.253 ms, fp8 0.549 -> 0.448 ms; 2-core Xeon NVFP4 2.05 -> 1.21, fp8 3.86 ->
 * 2.22 ms. (The previous row kernels' 16 KB with 64-row tasks had measured no gain on the H200 host.) The AMX prefill's
 * fp8 and NVFP4 row decoders (_native_amx.c) read lumen_prefetch ahead too. */
extern i64 lumen_prefetch;

/* rows ahead of row i (of rows of `bytes`), and the prefetch of the row that many ahead when there is one */
static inline i64 ahead_rows(i64 pf, i64 bytes) { return pf > 0 ? (pf + bytes - 1) / bytes : 0; }
static inline i64 rows_ahead(i64 bytes) { return ahead_rows(lumen_prefetch, bytes); }

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

/* E2M1 codes' values (sign << 3 | index; numba's nvfp4_fused.e2m1) */
static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* an e4m3 byte as f32, exactly (numba's fp8.decode) */
static inline float e4m3(uint32_t b) {
    float f = bits_f32(((b & 0x7Fu) << 20) + 0x3C000000u);
    float v = (b & 0x78u) == 0 ? (f - 0.0078125f) * 2.0f : f;
    return (b & 0x80u) ? -v : v;
}

#ifdef LUMEN_X86
T5 static inline __m512 e4m3x16(const uint8_t *p) { /* 16 bytes -> 16 f32, exact */
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i mag = _mm512_add_epi32(_mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(0x7F << 20)),
                                   _mm512_set1_epi32(0x3C000000));
    __mmask16 sub = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x78));
    __m512 f = _mm512_mask_fmsub_ps(_mm512_castsi512_ps(mag), sub, _mm512_set1_ps(2.f), _mm512_set1_ps(0.015625f));
    /* f | (b << 24 & sign bit): A | (B & C) */
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(f), _mm512_slli_epi32(b, 24),
                                                         _mm512_set1_epi32((int)0x80000000u), 0xF8));
}

/* 32 columns of an NVFP4 row from column c: e2m1(code) x e4m3(block scale), exact in f32, in column order (a byte's
 * low code is column 2i, its high code 2i + 1): columns c .. c + 15 in *a, c + 16 .. c + 31 in *b */
T5 static inline void nvfp4_cols32(const uint8_t *row, const uint8_t *srow, i64 c, __m512 *a, __m512 *b) {
    const __m512 tab = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                      -4.f, -6.f);
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2)));
    __m512 sc = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_setr_ps(e4m3(srow[c / 16]),
                                                                             e4m3(srow[c / 16 + 1]), 0.f, 0.f)));
    __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)), tab), sc);
    __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab), sc);
    *a = _mm512_permutex2var_ps(lo, even, hi);
    *b = _mm512_permutex2var_ps(lo, odd, hi);
}

T5 static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) { /* (sum a, sum b, sum c, sum d) */
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E)); /* each 128-bit lane: one vector's 4 partial sums */
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0), x));
}
#endif

int lumen_amx_usable(void); /* _native_amx.c: AMX-BF16 here and granted to this process (asks the OS once) */

/* _native.c's row kernels with a prefetch distance (bytes; lumen_fp8_rows / lumen_nvfp4_rows: 0), which
 * _native_moe.c's worker calls */
void lumen_fp8_rows_pf(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, const float *x, const float *S, i64 lds,
                       i64 br, i64 bc, float *out, i64 pf);
void lumen_nvfp4_rows_pf(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K, const float *xp,
                         float gs, float *out, i64 pf);

static inline void spin(void) { /* a busy wait's pause (_native_moe.c's workers, _native_serve.c) */
#ifdef LUMEN_X86
    _mm_pause();
#endif
}

/* what _native_serve.c's server runs (_native.c, _native_moe.c) */
void lumen_nvfp4_permute(const float *x, i64 K, float *xp);
void lumen_quant16(const float *x, i64 K, int8_t *xq, float *xs);
void lumen_moe_worker(i64 fmt, i64 n, const i64 *ex, const i64 *tok, i64 H, i64 I, const i64 *A, i64 E,
                      const float *gs, const i64 *blk, const float *x, const int8_t *xq, const float *xs, float *h,
                      int8_t *hq, float *hs, float *ys, i64 act, i64 cgu, i64 cd, i64 pf, i64 *ctr);

#endif
