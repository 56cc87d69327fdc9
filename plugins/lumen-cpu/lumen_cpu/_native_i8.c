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
 *
 * lumen_i8_rows_q8 is the same product with x quantized to 8 bits (cpu.compute-quantization "int8", opt-in and
 * inexact): x_t ~ dx[t, c] * xq[t, k] per 32 columns (int8.quantize_x), and each block's codes . xq is an exact
 * integer sum (AVX-512 VNNI vpdpbusd, AVX2 vpmaddwd, or scalar: the same integers at every level):
 *
 *   out[t * ldo + i] = sum over blocks b of  S[r, b] * dx[t, b * bs / 32] * (codes of row r in b) . xq_t
 *                    - sum over blocks c of 32 columns of  M[r, c] * xs[t, c]
 *
 * xsq[t, b] is the sum of xq_t over block b (bs columns, as f32: the VNNI version adds 128 to every code to make it
 * unsigned and takes 128 * that sum back).
 */
#include <stdlib.h>

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
T2 static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

T2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

T2 static inline void load_scales(const void *s, i64 lds, i64 s16, i64 r, i64 nb, float *sc) { /* row r's, as f32 */
    if (!s16) {
        memcpy(sc, (const float *)s + r * lds, (size_t)nb * 4);
        return;
    }
    const uint16_t *sr = (const uint16_t *)s + r * lds;
    i64 b = 0;
    for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(sc + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sr + b))));
    for (; b < nb; b++) sc[b] = f16_f32(sr[b]);
}

T2 static void i8_rows_avx2(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm,
                            i64 r0, i64 n, i64 K, const float *x, i64 ldx, const float *xs, i64 T, float *out,
                            i64 ldo) {
    i64 nb = K / bs, nc = K / 32, pf = rows_ahead(K);
    float sc[nb + 8];
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i, b;
        const int8_t *row = q + r * ldq;
        prefetch_ahead((const uint8_t *)row, ldq, K, i, n, pf);
        load_scales(s, lds, s16, r, nb, sc);
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

T5 static inline __m512 min_sub(__m512 acc, const float *mr, const float *xst, i64 nc) { /* acc - mr[c] * xst[c] */
    i64 c = 0;
    for (; c + 16 <= nc; c += 16) acc = _mm512_fnmadd_ps(_mm512_loadu_ps(mr + c), _mm512_loadu_ps(xst + c), acc);
    __mmask16 k = (__mmask16)((1u << (nc - c)) - 1u);
    return _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(k, mr + c), _mm512_maskz_loadu_ps(k, xst + c), acc);
}

T5 static void i8_rows_avx512(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m,
                              i64 ldm, i64 r0, i64 n, i64 K, const float *x, i64 ldx, const float *xs, i64 T,
                              float *out, i64 ldo) {
    i64 nb = K / bs, nc = K / 32, pf = rows_ahead(K);
    float sc[nb + 16];
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i, b;
        const int8_t *row = q + r * ldq;
        prefetch_ahead((const uint8_t *)row, ldq, K, i, n, pf);
        load_scales(s, lds, s16, r, nb, sc);
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
            __m512 acc = _mm512_add_ps(a0, a1);
            if (m) acc = min_sub(acc, m + r * ldm, xs + t * nc, nc);
            out[t * ldo + i] = _mm512_reduce_add_ps(acc);
        }
    }
}
#endif

/* -- many tokens (prefill): out[t * ldo + i] for t0 <= t < t1, rows r0 .. r0 + n ---------------------------------- *
 * Four rows at a time are dequantized into f32 (scale x code - min, the exact values of int8.dequantize_rows: a
 * rounded product, then the minimum) and multiplied by four tokens at a time: 16 accumulators of 16 lanes, 8 loads
 * for 16 FMAs, the 16 sums reduced together at the end. Returns 0 where it has no kernel for this CPU (below
 * AVX-512): the caller's numba kernel does the work then. */
#ifdef LUMEN_X86
T5 static inline void dequant_row(const int8_t *row, const float *sc, const float *mr, i64 bs, i64 K, float *w) {
    for (i64 k = 0; k < K; k += 16) {
        __m512 v = _mm512_mul_ps(i8x16(row + k), _mm512_set1_ps(sc[k / bs]));
        if (mr) v = _mm512_sub_ps(v, _mm512_set1_ps(mr[k / 32]));
        _mm512_storeu_ps(w + k, v);
    }
}

T5 static void i8_gemm_avx512(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m,
                              i64 ldm, i64 r0, i64 n, i64 K, const float *x, i64 ldx, i64 t0, i64 t1, float *out,
                              i64 ldo, float *w) {
    i64 nb = K / bs;
    float sc[nb];
    for (i64 i = 0; i < n; i += 4) {
        for (i64 j = 0; j < 4; j++) { /* rows past the range: zeros (their sums are not stored) */
            i64 r = r0 + i + j;
            if (i + j >= n) {
                memset(w + j * K, 0, (size_t)K * 4);
                continue;
            }
            load_scales(s, lds, s16, r, nb, sc);
            dequant_row(q + r * ldq, sc, m ? m + r * ldm : NULL, bs, K, w + j * K);
        }
        const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
        for (i64 t = t0; t < t1; t += 4) { /* tokens past t1 repeat the last one (their sums are not stored) */
            const float *x0 = x + t * ldx, *x1 = x + (t + 1 < t1 ? t + 1 : t1 - 1) * ldx;
            const float *x2 = x + (t + 2 < t1 ? t + 2 : t1 - 1) * ldx, *x3 = x + (t + 3 < t1 ? t + 3 : t1 - 1) * ldx;
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (i64 k = 0; k < K; k += 16) {
                __m512 u0 = _mm512_loadu_ps(w0 + k), u1 = _mm512_loadu_ps(w1 + k);
                __m512 u2 = _mm512_loadu_ps(w2 + k), u3 = _mm512_loadu_ps(w3 + k);
                __m512 y = _mm512_loadu_ps(x0 + k);
                a[0] = _mm512_fmadd_ps(u0, y, a[0]), a[1] = _mm512_fmadd_ps(u1, y, a[1]);
                a[2] = _mm512_fmadd_ps(u2, y, a[2]), a[3] = _mm512_fmadd_ps(u3, y, a[3]);
                y = _mm512_loadu_ps(x1 + k);
                a[4] = _mm512_fmadd_ps(u0, y, a[4]), a[5] = _mm512_fmadd_ps(u1, y, a[5]);
                a[6] = _mm512_fmadd_ps(u2, y, a[6]), a[7] = _mm512_fmadd_ps(u3, y, a[7]);
                y = _mm512_loadu_ps(x2 + k);
                a[8] = _mm512_fmadd_ps(u0, y, a[8]), a[9] = _mm512_fmadd_ps(u1, y, a[9]);
                a[10] = _mm512_fmadd_ps(u2, y, a[10]), a[11] = _mm512_fmadd_ps(u3, y, a[11]);
                y = _mm512_loadu_ps(x3 + k);
                a[12] = _mm512_fmadd_ps(u0, y, a[12]), a[13] = _mm512_fmadd_ps(u1, y, a[13]);
                a[14] = _mm512_fmadd_ps(u2, y, a[14]), a[15] = _mm512_fmadd_ps(u3, y, a[15]);
            }
            float o[16]; /* token tt's four rows at 4 tt (the sums first: a[] stays in registers) */
            _mm_storeu_ps(o, sum4(a[0], a[1], a[2], a[3]));
            _mm_storeu_ps(o + 4, sum4(a[4], a[5], a[6], a[7]));
            _mm_storeu_ps(o + 8, sum4(a[8], a[9], a[10], a[11]));
            _mm_storeu_ps(o + 12, sum4(a[12], a[13], a[14], a[15]));
            for (i64 tt = 0; tt < 4 && t + tt < t1; tt++)
                for (i64 j = 0; j < 4 && i + j < n; j++) out[(t + tt) * ldo + i + j] = o[4 * tt + j];
        }
    }
}
#endif

i64 lumen_i8_gemm(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm, i64 r0,
                  i64 n, i64 K, const float *x, i64 ldx, i64 t0, i64 t1, float *out, i64 ldo) {
#ifdef LUMEN_X86
    if (lumen_level >= 2) {
        if (n <= 0) return 1; /* int8.gemm's question: is there a kernel here (no scratch for it) */
        float *w = aligned_alloc(64, (size_t)(4 * K * 4 + 64) / 64 * 64);
        if (!w) return 0;
        i8_gemm_avx512(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, t0, t1, out, ldo, w);
        free(w);
        return 1;
    }
#endif
    (void)q, (void)ldq, (void)s, (void)lds, (void)s16, (void)bs, (void)m, (void)ldm, (void)r0, (void)n, (void)K;
    (void)x, (void)ldx, (void)t0, (void)t1, (void)out, (void)ldo;
    return 0;
}

/* -- 8-bit activations ------------------------------------------------------------------------------------------ */
static void row_scales(const void *s, i64 lds, i64 s16, i64 r, i64 nb, float *sc) { /* row r's scales as f32 */
    for (i64 b = 0; b < nb; b++) sc[b] = scale_of(s, s16, r * lds + b);
}

static void i8q_rows_scalar(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm,
                            i64 r0, i64 n, i64 K, const int8_t *xq, const float *dx, const float *xsq, const float *xs,
                            i64 T, float *out, i64 ldo) {
    i64 nb = K / bs, nc = K / 32;
    float sc[nb];
    (void)xsq;
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i;
        const int8_t *row = q + r * ldq;
        row_scales(s, lds, s16, r, nb, sc);
        for (i64 t = 0; t < T; t++) {
            const int8_t *xt = xq + t * K;
            float acc = 0.f;
            for (i64 b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (i64 k = b * bs; k < (b + 1) * bs; k++) dot += (int32_t)row[k] * xt[k];
                acc += (float)dot * (sc[b] * dx[t * nc + b * bs / 32]);
            }
            if (m)
                for (i64 c = 0; c < nc; c++) acc -= m[r * ldm + c] * xs[t * nc + c];
            out[t * ldo + i] = acc;
        }
    }
}

#ifdef LUMEN_X86
T2 static void i8q_rows_avx2(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm,
                             i64 r0, i64 n, i64 K, const int8_t *xq, const float *dx, const float *xsq, const float *xs,
                             i64 T, float *out, i64 ldo) { /* codes and xq widened to 16 bits, vpmaddwd: exact */
    i64 nb = K / bs, nc = K / 32, pf = rows_ahead(K);
    float sc[nb];
    (void)xsq;
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i;
        const int8_t *row = q + r * ldq;
        prefetch_ahead((const uint8_t *)row, ldq, K, i, n, pf);
        load_scales(s, lds, s16, r, nb, sc);
        for (i64 t = 0; t < T; t++) {
            const int8_t *xt = xq + t * K;
            const float *dxt = dx + t * nc;
            __m256 acc = _mm256_setzero_ps();
            for (i64 k = 0; k < K; k += 16) { /* 16 codes: 8 lanes of pair sums, one block of 16 or half of 32 */
                __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + k)));
                __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xt + k)));
                __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(w, xv));
                acc = _mm256_fmadd_ps(d, _mm256_set1_ps(sc[k / bs] * dxt[k / 32]), acc);
            }
            float a = hsum8(acc);
            if (m)
                for (i64 c = 0; c < nc; c++) a -= m[r * ldm + c] * xs[t * nc + c];
            out[t * ldo + i] = a;
        }
    }
}

T5V static void i8q_rows_vnni(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m,
                              i64 ldm, i64 r0, i64 n, i64 K, const int8_t *xq, const float *dx, const float *xsq,
                              const float *xs, i64 T, float *out, i64 ldo) {
    /* vpdpbusd multiplies unsigned by signed bytes: the codes + 128 (a flipped sign bit) times xq, less 128 x the
     * block's xq sum. 64 codes a step: 16 lanes of 4-code sums; bs 32: lanes 0-7 one block, 8-15 the next; bs 16:
     * four lanes a block. */
    i64 nb = K / bs, nc = K / 32, per = 64 / bs, pf = rows_ahead(K); /* per: blocks a step */
    float v[nb + 32], dxe[T * (nb + 16)];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i spread = bs == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                    : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (i64 t = 0; t < T; t++) /* x's scale for each weight block, zero past the last */
        for (i64 b = 0; b < nb + 16; b++) dxe[t * (nb + 16) + b] = b < nb ? dx[t * nc + b * bs / 32] : 0.f;
    for (i64 i = 0; i < n; i++) {
        i64 r = r0 + i, b;
        const int8_t *row = q + r * ldq;
        const uint16_t *sr16 = (const uint16_t *)s + r * lds;
        const float *sr32 = (const float *)s + r * lds;
        prefetch_ahead((const uint8_t *)row, ldq, K, i, n, pf);
        for (i64 t = 0; t < T; t++) {
            const int8_t *xt = xq + t * K;
            const float *xsqt = xsq + t * nb, *dxt = dxe + t * (nb + 16);
            __m512 corr = _mm512_setzero_ps();
            for (b = 0; b < nb; b += 16) { /* v = weight scale x x's scale, a block each; corr: their xq sums */
                __mmask16 k = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1u);
                __m512 sv = s16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sr16 + b))
                                : _mm512_maskz_loadu_ps(k, sr32 + b);
                __m512 vv = _mm512_mul_ps(sv, _mm512_loadu_ps(dxt + b));
                _mm512_storeu_ps(v + b, vv);
                corr = _mm512_fmadd_ps(vv, _mm512_maskz_loadu_ps(k, xsqt + b), corr);
            }
            _mm512_storeu_ps(v + b, _mm512_setzero_ps()); /* the steps below read up to 4 past nb */
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            i64 k = 0;
            for (; k + 128 <= K; k += 128) {
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                 _mm512_xor_si512(_mm512_loadu_si512(row + k), flip),
                                                 _mm512_loadu_si512(xt + k));
                __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                 _mm512_xor_si512(_mm512_loadu_si512(row + k + 64), flip),
                                                 _mm512_loadu_si512(xt + k + 64));
                __m512 s0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(v + k / bs)));
                __m512 s1 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(v + k / bs + per)));
                a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s0, a0);
                a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s1, a1);
            }
            for (; k < K; k += 64) { /* 64 or, last, 32 codes (the rest of the register zero: 0 x 0) */
                __mmask64 km = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
                __m512i w = _mm512_maskz_xor_epi32((__mmask16)(K - k >= 64 ? 0xFFFF : 0x00FF),
                                                   _mm512_maskz_loadu_epi8(km, row + k), flip);
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_maskz_loadu_epi8(km, xt + k));
                __m512 s0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(v + k / bs)));
                a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s0, a0);
            }
            __m512 acc = _mm512_fnmadd_ps(corr, _mm512_set1_ps(128.f), _mm512_add_ps(a0, a1));
            if (m) acc = min_sub(acc, m + r * ldm, xs + t * nc, nc);
            out[t * ldo + i] = _mm512_reduce_add_ps(acc);
        }
    }
}
#endif

void lumen_i8_rows_q8(const int8_t *q, i64 ldq, const void *s, i64 lds, i64 s16, i64 bs, const float *m, i64 ldm,
                      i64 r0, i64 n, i64 K, const int8_t *xq, const float *dx, const float *xsq, const float *xs, i64 T,
                      float *out, i64 ldo) {
#ifdef LUMEN_X86
    if (lumen_level >= 3) {
        i8q_rows_vnni(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, xq, dx, xsq, xs, T, out, ldo);
        return;
    }
    if (lumen_level >= 1) {
        i8q_rows_avx2(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, xq, dx, xsq, xs, T, out, ldo);
        return;
    }
#endif
    i8q_rows_scalar(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, xq, dx, xsq, xs, T, out, ldo);
}

/* -- f32 activations: entry point ------------------------------------------------------------------------------- */
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
