/* Lumen's CPU kernels in C: rows of fp8 (E4M3) and NVFP4 (E2M1 + E4M3 block scale) weights dotted with one f32
 * vector, the codes decoded exactly in registers. Built at install time (setup.py; optional: without a compiler
 * the package installs and the numba kernels do this work). No Python API: lumen_cpu/native.py loads the library
 * and numba kernels call these functions by symbol (numba.types.ExternalFunction), on numba's threads.
 *
 * One binary for every x86-64 CPU: each kernel has an AVX-512, an AVX2 and a scalar version, compiled with
 * per-function target attributes, and lumen_native_init picks one from what the running CPU supports (or a lower
 * level asked for). Every version gives the same values as numba's decoders (fp8.decode, nvfp4_fused.e2m1): only
 * the order of the f32 sums differs.
 *
 * fp8: out[i] = sum over column blocks b of S[(r0+i)/br, b] * sum_{k in b} e4m3(w[r0+i, k]) * x[k].
 * NVFP4: out[i] = gs * sum over blocks of 16 columns of e4m3(s[r0+i, b]) * sum_{j<16} e2m1(code) * x[16b+j],
 *        with x given permuted (lumen_nvfp4_permute): per 32 columns the 16 even ones, then the 16 odd ones, the
 *        order of a byte's low and high codes.
 */
#include "_native.h"

int lumen_level = 0;
i64 lumen_prefetch = 16384;

/* -- scalar decoders (the reference: numba's fp8.decode and nvfp4_fused.e2m1; e4m3 in _native.h) ------------- */


static void fp8_rows_scalar(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, const float *x, const float *S,
                            i64 lds, i64 br, i64 bc, float *out) {
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw;
        const float *srow = S + ((r0 + i) / br) * lds;
        float acc = 0.f;
        for (i64 b0 = 0, b = 0; b0 < K; b0 += bc, b++) {
            i64 b1 = b0 + bc < K ? b0 + bc : K;
            float part = 0.f;
            for (i64 k = b0; k < b1; k++) part += e4m3(row[k]) * x[k];
            acc += part * srow[b];
        }
        out[i] = acc;
    }
}

static void nvfp4_rows_scalar(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                              const float *xp, float gs, float *out) {
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        float acc = 0.f;
        for (i64 c = 0; c < K; c += 32) {
            int half = K - c < 32; /* a last block of 16 columns: its 8 bytes, x not permuted there */
            for (int h = 0; h < (half ? 1 : 2); h++) {
                float part = 0.f;
                for (int j = 0; j < 8; j++) {
                    uint32_t byte = row[c / 2 + h * 8 + j];
                    float xe = half ? xp[c + 2 * j] : xp[c + h * 8 + j];
                    float xo = half ? xp[c + 2 * j + 1] : xp[c + 16 + h * 8 + j];
                    part += E2M1[byte & 15] * xe + E2M1[byte >> 4] * xo;
                }
                acc += part * e4m3(srow[c / 16 + h]);
            }
        }
        out[i] = acc * gs;
    }
}

static void nvfp4_decode_scalar(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                                float gs, float *out, i64 ldo) {
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        float *o = out + i * ldo;
        for (i64 c = 0; c < K; c += 2) {
            float sc = e4m3(srow[c / 16]);
            o[c] = (E2M1[row[c / 2] & 15] * sc) * gs;
            o[c + 1] = (E2M1[row[c / 2] >> 4] * sc) * gs;
        }
    }
}

#ifdef LUMEN_X86
/* -- AVX2 -------------------------------------------------------------------------------------------------------- */

T2 static inline __m256 e4m3x8(const uint8_t *p) { /* 8 bytes -> 8 f32, exact (subnormal codes fixed up) */
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i mag = _mm256_add_epi32(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(0x7F << 20)),
                                   _mm256_set1_epi32(0x3C000000));
    __m256 f = _mm256_castsi256_ps(mag);
    __m256 sub = _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x78)), _mm256_setzero_si256()));
    f = _mm256_blendv_ps(f, _mm256_fmsub_ps(f, _mm256_set1_ps(2.f), _mm256_set1_ps(0.015625f)), sub);
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(b, 24), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

T2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

T2 static void fp8_rows_avx2(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, const float *x, const float *S,
                             i64 lds, i64 br, i64 bc, float *out, i64 pf) {
    i64 ahead = ahead_rows(pf, K);
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw;
        prefetch_ahead(row, ldw, K, i, n, ahead);
        const float *srow = S + ((r0 + i) / br) * lds;
        __m256 acc = _mm256_setzero_ps();
        float tail = 0.f;
        for (i64 b0 = 0, b = 0; b0 < K; b0 += bc, b++) {
            i64 b1 = b0 + bc < K ? b0 + bc : K, k = b0;
            __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
            for (; k + 16 <= b1; k += 16) {
                p0 = _mm256_fmadd_ps(e4m3x8(row + k), _mm256_loadu_ps(x + k), p0);
                p1 = _mm256_fmadd_ps(e4m3x8(row + k + 8), _mm256_loadu_ps(x + k + 8), p1);
            }
            float part = 0.f;
            for (; k < b1; k++) part += e4m3(row[k]) * x[k];
            __m256 sb = _mm256_set1_ps(srow[b]);
            acc = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), sb, acc);
            tail += part * srow[b];
        }
        out[i] = hsum8(acc) + tail;
    }
}

T2 static inline __m256 e2m1x8(__m256i codes) { /* 8 codes (low 4 bits of each lane) -> f32 */
    const __m256 mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    __m256 v = _mm256_permutevar8x32_ps(mag, codes); /* uses bits 0-2 */
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}

T2 static void nvfp4_rows_avx2(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                               const float *xp, float gs, float *out, i64 pf) {
    i64 K32 = K / 32 * 32;
    i64 ahead = ahead_rows(pf, K / 2);
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        prefetch_ahead(row, ldw, K / 2, i, n, ahead);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (i64 c = 0; c < K32; c += 32) { /* 16 bytes: blocks c/16 (bytes 0-7) and c/16 + 1 (bytes 8-15) */
            for (int h = 0; h < 2; h++) {
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + c / 2 + 8 * h)));
                __m256 lo = e2m1x8(b), hi = e2m1x8(_mm256_srli_epi32(b, 4));
                __m256 p = _mm256_mul_ps(lo, _mm256_loadu_ps(xp + c + 8 * h));
                p = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + c + 16 + 8 * h), p);
                __m256 sc = _mm256_set1_ps(e4m3(srow[c / 16 + h]));
                if (h) acc1 = _mm256_fmadd_ps(p, sc, acc1);
                else acc0 = _mm256_fmadd_ps(p, sc, acc0);
            }
        }
        float tail = 0.f;
        if (K32 < K) nvfp4_rows_scalar(w + K32 / 2, ldw, s + K32 / 16, lds, r0 + i, 1, K - K32, xp + K32, 1.f, &tail);
        out[i] = (hsum8(_mm256_add_ps(acc0, acc1)) + tail) * gs;
    }
}

/* -- AVX-512 ----------------------------------------------------------------------------------------------------- */

T5 static void fp8_rows_avx512(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, const float *x, const float *S,
                               i64 lds, i64 br, i64 bc, float *out, i64 pf) {
    i64 ahead = ahead_rows(pf, K);
    for (i64 i = 0; i < n; i++) { /* a row at a time: one sequential stream (two rows a pass measured slower) */
        const uint8_t *row = w + (r0 + i) * ldw;
        prefetch_ahead(row, ldw, K, i, n, ahead);
        const float *srow = S + ((r0 + i) / br) * lds;
        __m512 acc = _mm512_setzero_ps();
        float tail = 0.f;
        for (i64 b0 = 0, b = 0; b0 < K; b0 += bc, b++) {
            i64 b1 = b0 + bc < K ? b0 + bc : K, k = b0;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (; k + 64 <= b1; k += 64) {
                a0 = _mm512_fmadd_ps(e4m3x16(row + k), _mm512_loadu_ps(x + k), a0);
                a1 = _mm512_fmadd_ps(e4m3x16(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
                a2 = _mm512_fmadd_ps(e4m3x16(row + k + 32), _mm512_loadu_ps(x + k + 32), a2);
                a3 = _mm512_fmadd_ps(e4m3x16(row + k + 48), _mm512_loadu_ps(x + k + 48), a3);
            }
            for (; k + 16 <= b1; k += 16) a0 = _mm512_fmadd_ps(e4m3x16(row + k), _mm512_loadu_ps(x + k), a0);
            float part = 0.f;
            for (; k < b1; k++) part += e4m3(row[k]) * x[k];
            acc = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                  _mm512_set1_ps(srow[b]), acc);
            tail += part * srow[b];
        }
        out[i] = _mm512_reduce_add_ps(acc) + tail;
    }
}

T5 static inline __m512 pair_of(const float *p) { /* (p[0], p[1]) repeated over the lanes */
    double d;
    memcpy(&d, p, 8);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
}

T5 static void nvfp4_rows_avx512(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                                 const float *xp, float gs, float *out, i64 pf) {
    const __m512 tab = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                      -4.f, -6.f);
    const __m512i m15 = _mm512_set1_epi32(15);
    /* a pair of block scales spread over the lanes of a 32-column chunk: lanes 0-7 the first, 8-15 the second */
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    i64 K32 = K / 32 * 32, nb = K / 16;
    float sc[nb + 16];
    i64 ahead = ahead_rows(pf, K / 2);
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        prefetch_ahead(row, ldw, K / 2, i, n, ahead);
        i64 b = 0;
        for (; b + 16 <= nb; b += 16) _mm512_storeu_ps(sc + b, e4m3x16(srow + b));
        for (; b < nb; b++) sc[b] = e4m3(srow[b]);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        i64 c = 0;
        for (; c + 64 <= K32; c += 64) { /* two chunks a pass, two sums */
            __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2)));
            __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2 + 16)));
            __m512 p0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b0, m15), tab), _mm512_loadu_ps(xp + c));
            __m512 p1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b1, m15), tab),
                                      _mm512_loadu_ps(xp + c + 32));
            p0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), tab), _mm512_loadu_ps(xp + c + 16), p0);
            p1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), tab), _mm512_loadu_ps(xp + c + 48), p1);
            __m512 s0 = _mm512_permutexvar_ps(pair, pair_of(sc + c / 16));
            __m512 s1 = _mm512_permutexvar_ps(pair, pair_of(sc + c / 16 + 2));
            acc0 = _mm512_fmadd_ps(p0, s0, acc0);
            acc1 = _mm512_fmadd_ps(p1, s1, acc1);
        }
        for (; c < K32; c += 32) {
            __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2)));
            __m512 p0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b0, m15), tab), _mm512_loadu_ps(xp + c));
            p0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), tab), _mm512_loadu_ps(xp + c + 16), p0);
            __m512 s0 = _mm512_permutexvar_ps(pair, pair_of(sc + c / 16));
            acc0 = _mm512_fmadd_ps(p0, s0, acc0);
        }
        float tail = 0.f;
        if (K32 < K) nvfp4_rows_scalar(w + K32 / 2, ldw, s + K32 / 16, lds, r0 + i, 1, K - K32, xp + K32, 1.f, &tail);
        out[i] = (_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail) * gs;
    }
}

T5 static void nvfp4_decode_avx512(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                                   float gs, float *out, i64 ldo) {
    const __m512 g = _mm512_set1_ps(gs);
    i64 K32 = K / 32 * 32;
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        float *o = out + i * ldo;
        for (i64 c = 0; c < K32; c += 32) {
            __m512 a, b;
            nvfp4_cols32(row, srow, c, &a, &b);
            _mm512_storeu_ps(o + c, _mm512_mul_ps(a, g));
            _mm512_storeu_ps(o + c + 16, _mm512_mul_ps(b, g));
        }
        if (K32 < K) nvfp4_decode_scalar(w + K32 / 2, ldw, s + K32 / 16, lds, r0 + i, 1, K - K32, gs, o + K32, ldo);
    }
}
#endif

/* -- entry points ------------------------------------------------------------------------------------------------ */
int lumen_native_init(int most) { /* the highest level <= most that this CPU runs; returns it */
    int best = 0;
#ifdef LUMEN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1; /* (every such CPU has F16C) */
    if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        best = 2;
    if (best == 2 && __builtin_cpu_supports("avx512vnni")) best = 3;
    static int amx = -1; /* asked once: the OS grant is per process */
    if (best == 3 && most >= 4 && amx < 0) amx = lumen_amx_usable();
    if (best == 3 && amx == 1) best = 4;
#endif
    lumen_level = most < best ? most : best;
    return lumen_level;
}

void lumen_native_prefetch(i64 bytes) { lumen_prefetch = bytes; }

void lumen_fp8_rows_pf(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, const float *x, const float *S, i64 lds,
                       i64 br, i64 bc, float *out, i64 pf) { /* pf: bytes to prefetch ahead (_native.h) */
#ifdef LUMEN_X86
    if (lumen_level >= 2) {
        fp8_rows_avx512(w, ldw, r0, n, K, x, S, lds, br, bc, out, pf);
        return;
    }
    if (lumen_level == 1) {
        fp8_rows_avx2(w, ldw, r0, n, K, x, S, lds, br, bc, out, pf);
        return;
    }
#endif
    fp8_rows_scalar(w, ldw, r0, n, K, x, S, lds, br, bc, out);
}

void lumen_fp8_rows(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, const float *x, const float *S, i64 lds,
                    i64 br, i64 bc, float *out) {
    lumen_fp8_rows_pf(w, ldw, r0, n, K, x, S, lds, br, bc, out, 0);
}

void lumen_nvfp4_rows_pf(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K, const float *xp,
                         float gs, float *out, i64 pf) {
#ifdef LUMEN_X86
    if (lumen_level >= 2) {
        nvfp4_rows_avx512(w, ldw, s, lds, r0, n, K, xp, gs, out, pf);
        return;
    }
    if (lumen_level == 1) {
        nvfp4_rows_avx2(w, ldw, s, lds, r0, n, K, xp, gs, out, pf);
        return;
    }
#endif
    nvfp4_rows_scalar(w, ldw, s, lds, r0, n, K, xp, gs, out);
}

void lumen_nvfp4_rows(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K, const float *xp,
                      float gs, float *out) {
    lumen_nvfp4_rows_pf(w, ldw, s, lds, r0, n, K, xp, gs, out, 0);
}

void lumen_nvfp4_permute(const float *x, i64 K, float *xp) { /* per 32 columns: the even ones, then the odd */
    i64 c = 0;
    for (; c + 32 <= K; c += 32)
        for (int j = 0; j < 16; j++) {
            xp[c + j] = x[c + 2 * j];
            xp[c + 16 + j] = x[c + 2 * j + 1];
        }
    for (; c < K; c++) xp[c] = x[c]; /* a last block of 16: as it is */
}

void lumen_nvfp4_decode_rows(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K, float gs,
                             float *out, i64 ldo) { /* out[i * ldo + k]: the f32 value nvfp4.dequantize gives */
#ifdef LUMEN_X86
    if (lumen_level >= 2) {
        nvfp4_decode_avx512(w, ldw, s, lds, r0, n, K, gs, out, ldo);
        return;
    }
#endif
    nvfp4_decode_scalar(w, ldw, s, lds, r0, n, K, gs, out, ldo);
}
