/* Rows of the int8 layout (lumen_cpu/int8.py: GGUF blocks repacked at load into one signed code a value, a scale a
 * block of 16 or 32 values, f32 or the file's f16 bits, and for Q4_K / Q5_K an f32 minimum a block of 32) dotted
 * with a few f32 vectors:
 *
 *   out[t * ldo + i] = sum over blocks b of bs columns of  S[r, b] * (codes of row r in b) . x_t
 *                    - sum over blocks c of 32 columns of  M[r, c] * xs[t, c]          (r = r0 + i; M only if given)
 *
 * where xs[t, c] is the sum of x_t over block c (the caller's, once a call). Every dequantized value is the one
 * int8.dequantize_rows gives (scale x code - min); the sums are grouped by block (the codes' products first, then
 * the scale), so their rounding differs from a dot with the dequantized row by f32 reassociation only.
 *
 * K is a multiple of 32 (every GGUF block format's row is). AVX-512 / AVX2 / scalar versions as in _native.c.
 */
#include "_native.h"

static inline float scale_of(const void *s, i64 s16, i64 j) {
    return s16 ? f16_f32(((const uint16_t *)s)[j]) : ((const float *)s)[j];
}

static void i8_rows_scalar(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm,
                           i64 r0, i64 n, i64 K, const float *x, i64 ldx, const float *xs, i64 T, float *out, i64 ldo) {
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i;
        const int8_t *row = q + r * ldq;
        for (i64 t = 0; t < T; t++) {
            const float *xt = x + t * ldx;
            float acc = 0.f;
            for (i64 b = 0; b * bs < K; b++) {
                float part = 0.f;
                for (i64 k = b * bs; k < (b + 1) * bs; k++) part += (float)row[k] * xt[k];
                acc += part * scale_of(s, s16, r * lds + b);
            }
            if (m)
                for (i64 c = 0; c < K / 32; c++) acc -= m[r * ldm + c] * xs[t * (K / 32) + c];
            out[t * ldo + i] = acc;
        }
    }
}

#ifdef LUMEN_X86
/* -- AVX2 -------------------------------------------------------------------------------------------------------- */
T2 static inline __m256 i8x8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

T2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

T2 static void i8_rows_avx2(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm,
                            i64 r0, i64 n, i64 K, const float *x, i64 ldx, const float *xs, i64 T, float *out, i64 ldo) {
    i64 nb = K / bs, nc = K / 32;
    float sc[nb + 8];
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i, b = 0;
        const int8_t *row = q + r * ldq;
        if (s16) {
            const uint16_t *sr = (const uint16_t *)s + r * lds;
            for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(sc + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sr + b))));
            for (; b < nb; b++) sc[b] = f16_f32(sr[b]);
        } else {
            memcpy(sc, (const float *)s + r * lds, (size_t)nb * 4);
        }
        for (i64 t = 0; t < T; t++) {
            const float *xt = x + t * ldx;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (b = 0; b < nb; b++) { /* a block: bs / 8 products, then its scale */
                const int8_t *p = row + b * bs;
                const float *xp = xt + b * bs;
                __m256 p0 = _mm256_mul_ps(i8x8(p), _mm256_loadu_ps(xp));
                __m256 p1 = _mm256_mul_ps(i8x8(p + 8), _mm256_loadu_ps(xp + 8));
                if (bs == 32) {
                    p0 = _mm256_fmadd_ps(i8x8(p + 16), _mm256_loadu_ps(xp + 16), p0);
                    p1 = _mm256_fmadd_ps(i8x8(p + 24), _mm256_loadu_ps(xp + 24), p1);
                }
                __m256 sb = _mm256_set1_ps(sc[b]);
                a0 = _mm256_fmadd_ps(p0, sb, a0);
                a1 = _mm256_fmadd_ps(p1, sb, a1);
            }
            float acc = hsum8(_mm256_add_ps(a0, a1));
            if (m) {
                const float *mr = m + r * ldm, *xst = xs + t * nc;
                __m256 am = _mm256_setzero_ps();
                i64 c = 0;
                for (; c + 8 <= nc; c += 8) am = _mm256_fmadd_ps(_mm256_loadu_ps(mr + c), _mm256_loadu_ps(xst + c), am);
                float tail = 0.f;
                for (; c < nc; c++) tail += mr[c] * xst[c];
                acc -= hsum8(am) + tail;
            }
            out[t * ldo + i] = acc;
        }
    }
}

/* -- AVX-512 ----------------------------------------------------------------------------------------------------- */
T5 static inline __m512 i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

T5 static inline float min_term(const float *mr, const float *xst, i64 nc) { /* sum of mr[c] * xst[c] */
    __m512 am = _mm512_setzero_ps();
    i64 c = 0;
    for (; c + 16 <= nc; c += 16) am = _mm512_fmadd_ps(_mm512_loadu_ps(mr + c), _mm512_loadu_ps(xst + c), am);
    __mmask16 k = (__mmask16)((1u << (nc - c)) - 1u);
    am = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mr + c), _mm512_maskz_loadu_ps(k, xst + c), am);
    return _mm512_reduce_add_ps(am);
}

T5 static void i8_rows_avx512(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m,
                              i64 ldm, i64 r0, i64 n, i64 K, const float *x, i64 ldx, const float *xs, i64 T, float *out,
                              i64 ldo) {
    i64 nb = K / bs, nc = K / 32;
    float sc[nb + 16];
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i, b = 0;
        const int8_t *row = q + r * ldq;
        if (s16) {
            const uint16_t *sr = (const uint16_t *)s + r * lds;
            for (; b + 16 <= nb; b += 16)
                _mm512_storeu_ps(sc + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sr + b))));
            for (; b < nb; b++) sc[b] = f16_f32(sr[b]);
        } else {
            memcpy(sc, (const float *)s + r * lds, (size_t)nb * 4);
        }
        for (i64 t = 0; t < T; t++) {
            const float *xt = x + t * ldx;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            if (bs == 32) { /* two blocks a pass, two chains: a block's two halves multiplied, then its scale */
                for (b = 0; b + 2 <= nb; b += 2) {
                    const int8_t *p = row + 32 * b;
                    const float *xp = xt + 32 * b;
                    __m512 p0 = _mm512_mul_ps(i8x16(p), _mm512_loadu_ps(xp));
                    __m512 p1 = _mm512_mul_ps(i8x16(p + 32), _mm512_loadu_ps(xp + 32));
                    p0 = _mm512_fmadd_ps(i8x16(p + 16), _mm512_loadu_ps(xp + 16), p0);
                    p1 = _mm512_fmadd_ps(i8x16(p + 48), _mm512_loadu_ps(xp + 48), p1);
                    a0 = _mm512_fmadd_ps(p0, _mm512_set1_ps(sc[b]), a0);
                    a1 = _mm512_fmadd_ps(p1, _mm512_set1_ps(sc[b + 1]), a1);
                }
                if (b < nb) {
                    const int8_t *p = row + 32 * b;
                    const float *xp = xt + 32 * b;
                    __m512 p0 = _mm512_mul_ps(i8x16(p), _mm512_loadu_ps(xp));
                    p0 = _mm512_fmadd_ps(i8x16(p + 16), _mm512_loadu_ps(xp + 16), p0);
                    a0 = _mm512_fmadd_ps(p0, _mm512_set1_ps(sc[b]), a0);
                }
            } else { /* blocks of 16 (Q6_K), two a pass (K is a multiple of 32) */
                for (b = 0; b < nb; b += 2) {
                    const int8_t *p = row + 16 * b;
                    const float *xp = xt + 16 * b;
                    a0 = _mm512_fmadd_ps(_mm512_mul_ps(i8x16(p), _mm512_loadu_ps(xp)), _mm512_set1_ps(sc[b]), a0);
                    a1 = _mm512_fmadd_ps(_mm512_mul_ps(i8x16(p + 16), _mm512_loadu_ps(xp + 16)),
                                         _mm512_set1_ps(sc[b + 1]), a1);
                }
            }
            float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
            if (m) acc -= min_term(m + r * ldm, xs + t * nc, nc);
            out[t * ldo + i] = acc;
        }
    }
}
#endif

/* -- entry point ------------------------------------------------------------------------------------------------- */
void lumen_i8_rows(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm, i64 r0,
                   i64 n, i64 K, const float *x, i64 ldx, const float *xs, i64 T, float *out, i64 ldo) {
#ifdef LUMEN_X86
    if (lumen_level >= 2) {
        i8_rows_avx512(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, xs, T, out, ldo);
        return;
    }
    if (lumen_level == 1) {
        i8_rows_avx2(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, xs, T, out, ldo);
        return;
    }
#endif
    i8_rows_scalar(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, xs, T, out, ldo);
}
