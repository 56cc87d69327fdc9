/* One token's routed experts (decode) in one parallel region, NVFP4 rows dotted with 8-bit activations, and the
 * several-token experts' f32 row x token products (lumen_f32_dots, at the end).
 *
 * lumen_moe_worker is what each of numba's threads runs inside one prange (lumen_cpu.native.moe_token): the workers
 * claim tasks from shared atomic counters instead of each taking a fixed range, so a thread that wakes late or
 * runs slow leaves its work to the others, and the two matrices' phases need no second parallel region (the region's
 * start and end cost more than a layer's experts read at the bandwidth bound on 16 cores). Tasks:
 *
 *   1. (slot j, rows r0 .. r0 + cgu of gate and up): h[j, r] = act(gate_r . x) * (up_r . x); then done[j] += 1.
 *   2. (slot j, rows r0 .. r0 + cd of down): ys[j, r] = down_r . h[j], once done[j] says every task 1 of slot j
 *      has finished (spin; a task is claimed and run by one thread without waiting, so every claimed task ends:
 *      no deadlock whatever the number of threads that actually run, one included).
 *
 * The weighted sum of ys over the slots is taken by the caller in slot order. Formats (fmt):
 *   0 fp8 rows (lumen_fp8_rows: e4m3 codes, f32 block scales), x as given;
 *   1 NVFP4 rows (lumen_nvfp4_rows), x permuted (lumen_nvfp4_permute) and h written permuted (permuted_at);
 *   2 NVFP4 rows with 8-bit activations (lumen_nvfp4_rows_q8): x and h quantized per 16 values (lumen_quant16; the
 *     NVFP4 block), integer products summed per block (cpu.compute-quantization "int8").
 *
 * lumen_nvfp4_rows_q8: out[i] = gs / 2 * sum over blocks b of 16 columns of e4m3(s[r, b]) * xs[b] *
 * sum_{k in b} 2 e2m1(code_k) * xq[k]. 2 e2m1 is an integer of -12 .. 12, so the inner sum is exact in int32 at
 * every level: AVX-512 VNNI (vpdpbusd), AVX-512BW and AVX2 (vpmaddubsw + vpmaddwd), scalar; the levels differ only
 * in the order of the f32 sums over blocks. The codes are split into bytes in column order (a byte's low nibble is
 * column 2i, its high one 2i + 1), the magnitude looked up (vpshufb), the sign moved onto x.
 */
#include <math.h>

#include "_native.h"

static const int8_t MAG2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12}; /* |2 e2m1(code)| */

static inline int32_t block_dot_q8(const uint8_t *codes8, const int8_t *xq) { /* 16 columns: 8 bytes of codes */
    int32_t d = 0;
    for (int j = 0; j < 8; j++) {
        uint32_t b = codes8[j], lo = b & 15, hi = b >> 4;
        d += (lo & 8 ? -MAG2[lo] : MAG2[lo]) * xq[2 * j] + (hi & 8 ? -MAG2[hi] : MAG2[hi]) * xq[2 * j + 1];
    }
    return d;
}

static void nvfp4_rows_q8_scalar(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                                 const int8_t *xq, const float *xs, float gs, float *out) {
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        float acc = 0.f;
        for (i64 b = 0; b < K / 16; b++)
            acc += (float)block_dot_q8(row + 8 * b, xq + 16 * b) * (e4m3(srow[b]) * xs[b]);
        out[i] = acc * (gs * 0.5f);
    }
}

#ifdef LUMEN_X86
T2 static void nvfp4_rows_q8_avx2(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                                  const int8_t *xq, const float *xs, float gs, float *out, i64 pf) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6,
                                                                   -8, -12)); /* 2 e2m1, signed */
    const __m256i m0f = _mm256_set1_epi16(0x0F0F), ones = _mm256_set1_epi16(1);
    const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    i64 K32 = K / 32 * 32, nb = K / 16;
    float sc[nb + 2];
    i64 ahead = ahead_rows(pf, K / 2);
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        prefetch_ahead(row, ldw, K / 2, i, n, ahead);
        for (i64 b = 0; b < nb; b++) sc[b] = e4m3(srow[b]) * xs[b];
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (i64 c = 0; c < K32; c += 32) { /* 16 bytes: 32 columns, blocks c/16 and c/16 + 1 */
            __m256i wv = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + c / 2)));
            __m256i codes = _mm256_and_si256(_mm256_or_si256(wv, _mm256_slli_epi16(wv, 4)), m0f);
            __m256i sw = _mm256_shuffle_epi8(tab, codes);
            __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + c)), sw);
            __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(sw, sw), xv), ones);
            double two;
            memcpy(&two, sc + c / 16, 8);
            __m256 sv = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_set1_pd(two)), pair);
            if (c & 32) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc1);
            else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc0);
        }
        __m256 a = _mm256_add_ps(acc0, acc1);
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        float acc = _mm_cvtss_f32(t);
        for (i64 b = K32 / 16; b < nb; b++) acc += (float)block_dot_q8(row + 8 * b, xq + 16 * b) * sc[b];
        out[i] = acc * (gs * 0.5f);
    }
}

/* AVX-512: 64 columns (32 bytes, 4 blocks) a step; DOT sums each 4 bytes' products into a 32-bit lane */
#define NVFP4_ROWS_Q8_AVX512(NAME, TARGET, DOT)                                                                       \
    TARGET static void NAME(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,               \
                            const int8_t *xq, const float *xs, float gs, float *out, i64 pf) {                        \
        const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12)); \
        const __m512i m0f = _mm512_set1_epi16(0x0F0F), eight = _mm512_set1_epi8(8);                                  \
        const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);                       \
        i64 K64 = K / 64 * 64, nb = K / 16;                                                                           \
        float sc[nb + 16];                                                                                            \
        i64 ahead = ahead_rows(pf, K / 2);                                                                            \
        for (i64 i = 0; i < n; i++) {                                                                                 \
            const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;                                      \
            prefetch_ahead(row, ldw, K / 2, i, n, ahead);                                                             \
            i64 b = 0;                                                                                                \
            for (; b + 16 <= nb; b += 16)                                                                             \
                _mm512_storeu_ps(sc + b, _mm512_mul_ps(e4m3x16(srow + b), _mm512_loadu_ps(xs + b)));                  \
            for (; b < nb; b++) sc[b] = e4m3(srow[b]) * xs[b];                                                        \
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                                            \
            for (i64 c = 0; c < K64; c += 64) {                                                                       \
                __m512i wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + c / 2)));                \
                /* (wv | wv << 4) & 0x0F0F: each 16-bit lane's low byte the low code, its high byte the high one */   \
                __m512i codes = _mm512_ternarylogic_epi32(wv, _mm512_slli_epi16(wv, 4), m0f, 0xA8);                   \
                __m512i xv = _mm512_loadu_si512((const void *)(xq + c));                                              \
                xv = _mm512_mask_sub_epi8(xv, _mm512_test_epi8_mask(codes, eight), _mm512_setzero_si512(), xv);       \
                __m512i d = DOT(_mm512_shuffle_epi8(tab, codes), xv);                                                 \
                __m512 sv = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(sc + c / 16)));           \
                if (c & 64) acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc1);                                  \
                else acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc0);                                         \
            }                                                                                                         \
            float acc = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));                                              \
            for (b = K64 / 16; b < nb; b++) acc += (float)block_dot_q8(row + 8 * b, xq + 16 * b) * sc[b];             \
            out[i] = acc * (gs * 0.5f);                                                                               \
        }                                                                                                             \
    }

#define DOT_BW(a, b) _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1))
#define DOT_VNNI(a, b) _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b)
NVFP4_ROWS_Q8_AVX512(nvfp4_rows_q8_avx512, T5, DOT_BW)
NVFP4_ROWS_Q8_AVX512(nvfp4_rows_q8_vnni, T5V, DOT_VNNI)
#endif

void lumen_nvfp4_rows_q8(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                         const int8_t *xq, const float *xs, float gs, float *out, i64 pf) { /* pf: _native.h */
#ifdef LUMEN_X86
    if (lumen_level >= 3) {
        nvfp4_rows_q8_vnni(w, ldw, s, lds, r0, n, K, xq, xs, gs, out, pf);
        return;
    }
    if (lumen_level == 2) {
        nvfp4_rows_q8_avx512(w, ldw, s, lds, r0, n, K, xq, xs, gs, out, pf);
        return;
    }
    if (lumen_level == 1) {
        nvfp4_rows_q8_avx2(w, ldw, s, lds, r0, n, K, xq, xs, gs, out, pf);
        return;
    }
#endif
    nvfp4_rows_q8_scalar(w, ldw, s, lds, r0, n, K, xq, xs, gs, out);
}

/* x (K,) -> xq (K,) int8, xs (K / 16,): per 16 values the scale max|x| / 127 and x / scale rounded (ties to even) */
void lumen_quant16(const float *x, i64 K, int8_t *xq, float *xs) {
    for (i64 b = 0; b < K / 16; b++) {
        float m = 0.f;
        for (int j = 0; j < 16; j++) m = fmaxf(m, fabsf(x[16 * b + j]));
        float inv = m > 0.f ? 127.f / m : 0.f;
        xs[b] = m / 127.f;
        for (int j = 0; j < 16; j++) xq[16 * b + j] = (int8_t)lrintf(x[16 * b + j] * inv);
    }
}

static inline float act_of(float a, i64 kind) { /* moe_fused.ACTS: 0 silu, 1 gelu_tanh (activations.moe_act) */
    if (kind == 0) return a / (1.f + expf(-a));
    return 0.5f * a * (1.f + tanhf(0.7978845608028654f * (a + 0.044715f * (a * a * a))));
}

static inline i64 permuted_at(i64 c, i64 K) { /* where lumen_nvfp4_permute puts column c */
    i64 base = c - c % 32, q = c % 32;
    if (base + 32 > K) return c;
    return q % 2 == 0 ? base + q / 2 : base + 16 + q / 2;
}


/* A: 6 rows of E addresses (gate, up, down codes; their scales); gs: 3 rows of E global scales (NVFP4);
 * blk (fp8): gate/up scales a row, down scales a row, gate/up scale block (rows, columns), down's; x (T, H) f32,
 * xq / xs (T, H) int8 and (T, H / 16) (fmt 2); h (n, I) f32, hq / hs (fmt 2); ys (n, H); pf: bytes the row
 * kernels prefetch ahead (_native.h); ctr: 2 + n zeros. */
void lumen_moe_worker(i64 fmt, i64 n, const i64 *ex, const i64 *tok, i64 H, i64 I, const i64 *A, i64 E,
                      const float *gs, const i64 *blk, const float *x, const int8_t *xq, const float *xs, float *h,
                      int8_t *hq, float *hs, float *ys, i64 act, i64 cgu, i64 cd, i64 pf, i64 *ctr) {
    i64 ngu = (I + cgu - 1) / cgu, nd = (H + cd - 1) / cd;
    float g[cgu], u[cgu];
    for (;;) {
        i64 t = __atomic_fetch_add(&ctr[0], 1, __ATOMIC_RELAXED);
        if (t >= n * ngu) break;
        i64 j = t / ngu, r0 = (t % ngu) * cgu, m = I - r0 < cgu ? I - r0 : cgu, e = ex[j];
        const uint8_t *G = (const uint8_t *)A[e], *U = (const uint8_t *)A[E + e];
        const void *SG = (const void *)A[3 * E + e], *SU = (const void *)A[4 * E + e];
        if (fmt == 0) {
            const float *xt = x + tok[j] * H;
            lumen_fp8_rows_pf(G, H, r0, m, H, xt, SG, blk[0], blk[2], blk[3], g, pf);
            lumen_fp8_rows_pf(U, H, r0, m, H, xt, SU, blk[0], blk[2], blk[3], u, pf);
            for (i64 r = 0; r < m; r++) h[j * I + r0 + r] = act_of(g[r], act) * u[r];
        } else if (fmt == 1) {
            const float *xt = x + tok[j] * H;
            lumen_nvfp4_rows_pf(G, H / 2, SG, H / 16, r0, m, H, xt, gs[e], g, pf);
            lumen_nvfp4_rows_pf(U, H / 2, SU, H / 16, r0, m, H, xt, gs[E + e], u, pf);
            for (i64 r = 0; r < m; r++) h[j * I + permuted_at(r0 + r, I)] = act_of(g[r], act) * u[r];
        } else { /* r0 and m are multiples of 16: this task's rows are whole blocks of h */
            const int8_t *xt = xq + tok[j] * H;
            const float *st = xs + tok[j] * (H / 16);
            lumen_nvfp4_rows_q8(G, H / 2, SG, H / 16, r0, m, H, xt, st, gs[e], g, pf);
            lumen_nvfp4_rows_q8(U, H / 2, SU, H / 16, r0, m, H, xt, st, gs[E + e], u, pf);
            for (i64 r = 0; r < m; r++) g[r] = act_of(g[r], act) * u[r];
            lumen_quant16(g, m, hq + j * I + r0, hs + j * (I / 16) + r0 / 16);
        }
        __atomic_fetch_add(&ctr[2 + j], 1, __ATOMIC_RELEASE);
    }
    for (;;) {
        i64 t = __atomic_fetch_add(&ctr[1], 1, __ATOMIC_RELAXED);
        if (t >= n * nd) break;
        i64 j = t / nd, r0 = (t % nd) * cd, m = H - r0 < cd ? H - r0 : cd, e = ex[j];
        while (__atomic_load_n(&ctr[2 + j], __ATOMIC_ACQUIRE) < ngu) spin();
        const uint8_t *D = (const uint8_t *)A[2 * E + e];
        const void *SD = (const void *)A[5 * E + e];
        if (fmt == 0)
            lumen_fp8_rows_pf(D, I, r0, m, I, h + j * I, SD, blk[1], blk[4], blk[5], ys + j * H + r0, pf);
        else if (fmt == 1)
            lumen_nvfp4_rows_pf(D, I / 2, SD, I / 16, r0, m, I, h + j * I, gs[2 * E + e], ys + j * H + r0, pf);
        else
            lumen_nvfp4_rows_q8(D, I / 2, SD, I / 16, r0, m, I, hq + j * I, hs + j * (I / 16), gs[2 * E + e],
                                ys + j * H + r0, pf);
    }
}

/* Several tokens (prefill): C[r * ldc + t] = B[r] . X[idx[t]] for r < R, t < m, B's rows K f32 apart (an expert's
 * rows decoded to f32, moe_fused), X's rows ldx apart. 4 rows x 4 tokens a block in 16 zmm sums (each loaded vector
 * used 4 times), reduced together at the end (sum4). Returns 0 where it has no kernel (below AVX-512, or K not a
 * multiple of 16): moe_fused's numba kernel does the work then. On a 2-core Xeon: 78 GFLOP/s a core at 64 rows x
 * 16 tokens x 2048 (slicing K to keep x in L1 measured no faster); a layer of 512 tokens' NVFP4 experts ~15% faster
 * than numba's kernel. */
#ifdef LUMEN_X86
T5 static void f32_dots_avx512(const float *B, i64 R, i64 K, const float *X, i64 ldx, const i64 *idx, i64 m,
                               float *C, i64 ldc) {
    for (i64 r = 0; r < R; r += 4) {
        const float *w[4];
        for (int j = 0; j < 4; j++) w[j] = B + (r + j < R ? r + j : R - 1) * K; /* past R: repeat, not stored */
        for (i64 t = 0; t < m; t += 4) {
            const float *x[4];
            for (int j = 0; j < 4; j++) x[j] = X + idx[t + j < m ? t + j : m - 1] * ldx; /* past m: the same */
            __m512 s[16];
            for (int j = 0; j < 16; j++) s[j] = _mm512_setzero_ps();
            for (i64 k = 0; k < K; k += 16) {
                __m512 u0 = _mm512_loadu_ps(w[0] + k), u1 = _mm512_loadu_ps(w[1] + k);
                __m512 u2 = _mm512_loadu_ps(w[2] + k), u3 = _mm512_loadu_ps(w[3] + k);
                for (int j = 0; j < 4; j++) {
                    __m512 y = _mm512_loadu_ps(x[j] + k);
                    s[4 * j] = _mm512_fmadd_ps(u0, y, s[4 * j]), s[4 * j + 1] = _mm512_fmadd_ps(u1, y, s[4 * j + 1]);
                    s[4 * j + 2] = _mm512_fmadd_ps(u2, y, s[4 * j + 2]);
                    s[4 * j + 3] = _mm512_fmadd_ps(u3, y, s[4 * j + 3]);
                }
            }
            float o[16]; /* token t + j's four rows at 4 j */
            for (int j = 0; j < 4; j++)
                _mm_storeu_ps(o + 4 * j, sum4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]));
            for (i64 j = 0; j < 4 && t + j < m; j++)
                for (i64 i = 0; i < 4 && r + i < R; i++) C[(r + i) * ldc + t + j] = o[4 * j + i];
        }
    }
}
#endif

i64 lumen_f32_dots(const float *B, i64 R, i64 K, const float *X, i64 ldx, const i64 *idx, i64 m, float *C, i64 ldc) {
#ifdef LUMEN_X86
    if (lumen_level >= 2 && K % 16 == 0) {
        if (R > 0 && m > 0) f32_dots_avx512(B, R, K, X, ldx, idx, m, C, ldc);
        return 1;
    }
#endif
    (void)B, (void)R, (void)K, (void)X, (void)ldx, (void)idx, (void)m, (void)C, (void)ldc;
    return 0;
}
