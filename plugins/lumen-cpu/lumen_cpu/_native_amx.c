/* Several tokens' NVFP4, fp8 and bf16 expert products (prefill) in AMX bf16 tiles, on CPUs with AMX-BF16.
 *
 * The weights are exact in bf16: a value of an NVFP4 row without its global scale, e2m1(code) x e4m3(block scale),
 * has at most 6 significant bits (lumen_nvfp4_decode_rows_bf16), an e4m3 value 4 (lumen_fp8_decode_rows_bf16; the fp8
 * block scales multiply each column block's f32 sums in lumen_amx_dots, a 64-row chunk lying in one row block), and
 * bf16 experts' rows are read as they are. The tokens are laid out once an expert the way TDPBF16PS reads its second
 * operand (lumen_f32_pairs: per pair of columns, each token's two values side by side, in f32), then converted to bf16
 * planes (lumen_bf16_from_pairs):
 *  - 3 planes (the default, "exact"): hi + mid + lo = the f32 token exactly, so every product is exact in f32 and the
 *    sums differ from the f32 path's only in their order;
 *  - 1 plane (cpu.compute-quantization "bf16"): the token rounded to bf16 (a relative 2^-9 a value), a third of the
 *    tile work.
 * lumen_amx_dots computes 64 rows x 16 tokens at a time in four f32 accumulator tiles, and the caller's NVFP4 global
 * scale multiplies the f32 results. Only where the CPU has AMX-BF16 and the OS lets this process use the tile
 * registers (lumen_native_init asks once, arch_prctl ARCH_REQ_XCOMP_PERM); otherwise the callers keep the f32 path.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stdlib.h>

#include "_native.h"

/* The AMX and AVX512-BF16 intrinsics need GCC 11 / clang 12: an older compiler (or -DLUMEN_NO_AMX) builds this file
 * without them (the level stays below amx), so the rest of the library still builds. */
#if defined(LUMEN_X86) && !defined(LUMEN_NO_AMX) && ((defined(__clang__) && __clang_major__ >= 12) || \
                                                    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define LUMEN_AMX 1
#endif

#ifdef LUMEN_AMX
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TA __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define TB __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

int lumen_amx_usable(void) { /* AMX-TILE, AMX-BF16, AVX512-BF16, and the tile data granted to this process */
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return 0; /* AVX512-BF16 (the conversions) */
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* the four row tiles' products over columns k0 .. k1 (step 32) into accumulators 0-3: A (16 weight rows, ldw bytes
 * apart) in tile 4, the token planes in 5-7 (one weight tile load for all three: hi, mid, lo) */
TA static inline void tile_products(const uint8_t *w, i64 ldw, const uint8_t *p, i64 plane, i64 parts, i64 k0, i64 k1) {
    if (parts == 1) {
        for (i64 k = k0; k < k1; k += 32) {
            _tile_loadd(5, p + (k / 2) * 64, 64);
            _tile_loadd(4, w + k * 2, ldw); /* the tile macros are statements (asm): one a line */
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(4, w + 16 * ldw + k * 2, ldw);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(4, w + 32 * ldw + k * 2, ldw);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(4, w + 48 * ldw + k * 2, ldw);
            _tile_dpbf16ps(3, 4, 5);
        }
        return;
    }
    for (i64 k = k0; k < k1; k += 32) {
        _tile_loadd(5, p + (k / 2) * 64, 64);
        _tile_loadd(6, p + plane + (k / 2) * 64, 64);
        _tile_loadd(7, p + 2 * plane + (k / 2) * 64, 64);
        _tile_loadd(4, w + k * 2, ldw);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 4, 7);
        _tile_loadd(4, w + 16 * ldw + k * 2, ldw);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(4, w + 32 * ldw + k * 2, ldw);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(4, w + 48 * ldw + k * 2, ldw);
        _tile_dpbf16ps(3, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
    }
}

TA static inline void store_tiles(float *o) { /* accumulators 0-3 to o, 256 floats each */
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 256, 64);
    _tile_stored(2, o + 512, 64);
    _tile_stored(3, o + 768, 64);
}

TA static void amx_dots(const uint16_t *W, i64 ldW, i64 R, i64 K, const uint16_t *P, i64 m, i64 parts,
                        const float *srow, i64 bc, float *C, i64 ldc, i64 tm, float gs) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* 0-3: 16 x 16 f32; 4: A; 5-7: B's parts */
    _tile_loadconfig(&cfg);
    float o[4 * 256], acc[4 * 256];
    i64 ldw = ldW * 2, nt = (m + 15) / 16, plane = nt * (K / 2) * 64; /* bytes a part of P */
    i64 kb = srow ? bc : K;                                             /* columns a scale (srow) */
    for (i64 r = 0; r < R; r += 64) { /* rows past R within the 64 (the caller's buffer has them): not stored */
        const uint8_t *w = (const uint8_t *)(W + r * ldW);
        for (i64 n = 0; n < nt; n++) {
            const uint8_t *p = (const uint8_t *)(P + n * (K / 2) * 32);
            if (srow) memset(acc, 0, sizeof acc);
            for (i64 k0 = 0; k0 < K; k0 += kb) { /* a column block: its products, then times its scale */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                tile_products(w, ldw, p, plane, parts, k0, k0 + kb < K ? k0 + kb : K);
                if (srow) {
                    store_tiles(o);
                    __m512 sc = _mm512_set1_ps(srow[k0 / bc]);
                    for (int q = 0; q < 4 * 256; q += 16) {
                        __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(o + q), sc, _mm512_loadu_ps(acc + q));
                        _mm512_storeu_ps(acc + q, v);
                    }
                }
            }
            const float *res = acc;
            if (!srow) store_tiles(o), res = o;
            for (int b = 0; b < 4; b++) {
                const float *ob = res + 256 * b;
                i64 ni = R - r - 16 * b < 16 ? R - r - 16 * b : 16, nj = m - 16 * n < 16 ? m - 16 * n : 16;
                if (tm) /* token-major: a token's 16 rows side by side */
                    for (i64 j = 0; j < nj; j++)
                        for (i64 i = 0; i < ni; i++) C[(16 * n + j) * ldc + r + 16 * b + i] = ob[16 * i + j] * gs;
                else
                    for (i64 i = 0; i < ni; i++)
                        for (i64 j = 0; j < nj; j++) C[(r + 16 * b + i) * ldc + 16 * n + j] = ob[16 * i + j] * gs;
            }
        }
    }
    _tile_release();
}
#else
int lumen_amx_usable(void) { return 0; }
#endif

/* C[r * ldc + t] (tm 0) or C[t * ldc + r] (tm 1: token-major) = gs * (row r of W, bf16, ldW apart) . (token t of P,
 * lumen_bf16_from_pairs' layout, summed over its `parts` (1 or 3) planes), r < R, t < m; with srow, the products of
 * each block of bc columns (a multiple of 32) summed apart and times srow[block] (an fp8 row block's scales: the
 * tokens' planes are then made once an expert, not once a row block). W must hold rows up to R rounded up to 64 (the
 * extra rows are read, not stored); K a multiple of 32. A tile's 16 rows ldW * 2 bytes apart fall in one L1 set when
 * that is a multiple of 4 KB (K = 2048, unpadded): the callers pad ldW by 32 values. Returns 0 where this CPU or
 * process cannot run AMX, or bc does not suit (the caller keeps its f32 path). */
i64 lumen_amx_dots(const uint16_t *W, i64 ldW, i64 R, i64 K, const uint16_t *P, i64 m, i64 parts, const float *srow,
                   i64 bc, float *C, i64 ldc, i64 tm, float gs) {
#ifdef LUMEN_AMX
    if (lumen_level >= 4 && K % 32 == 0 && (parts == 1 || parts == 3) && (!srow || (bc > 0 && bc % 32 == 0))) {
        if (R > 0 && m > 0) amx_dots(W, ldW, R, K, P, m, parts, srow, bc, C, ldc, tm, gs);
        return 1;
    }
#endif
    (void)W, (void)ldW, (void)R, (void)K, (void)P, (void)m, (void)parts, (void)srow, (void)bc, (void)C, (void)ldc;
    (void)tm, (void)gs;
    return 0;
}

static inline uint16_t bf16_rne(float f) { /* f32 -> bf16, rounded to nearest even (no NaN among activations) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef LUMEN_AMX
TB static void decode_bf16_avx512(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K,
                                  i64 N, uint16_t *out, i64 ldo) {
    i64 ahead = rows_ahead(ldw);
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        prefetch_ahead(row, ldw, ldw, r0 + i, N, ahead);
        prefetch_ahead(srow, lds, lds, r0 + i, N, ahead);
        uint16_t *o = out + i * ldo;
        for (i64 c = 0; c < K; c += 32) { /* K a multiple of 32 */
            __m512 a, b;
            nvfp4_cols32(row, srow, c, &a, &b); /* exact values: the bf16 conversion's rounding never applies */
            _mm512_storeu_si512((void *)(o + c), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}
#endif

/* out[i * ldo + k] = bf16 of e2m1(code) * e4m3(block scale) for rows r0 .. r0 + n (exact: no global scale) of a
 * matrix of N rows, read (codes and scales) lumen_prefetch bytes ahead within those N rows, as the fp8 decoder below:
 * without, one layer's NVFP4 experts of 512 tokens on one core of the 2-core Xeon VM took 1.2x as long */
void lumen_nvfp4_decode_rows_bf16(const uint8_t *w, i64 ldw, const uint8_t *s, i64 lds, i64 r0, i64 n, i64 K, i64 N,
                                  uint16_t *out, i64 ldo) {
#ifdef LUMEN_AMX
    if (lumen_level >= 4 && K % 32 == 0) {
        decode_bf16_avx512(w, ldw, s, lds, r0, n, K, N, out, ldo);
        return;
    }
#endif
    (void)N;
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw, *srow = s + (r0 + i) * lds;
        uint16_t *o = out + i * ldo;
        for (i64 b = 0; b < K / 16; b++) {
            float sc = e4m3(srow[b]);
            for (int j = 0; j < 8; j++) {
                uint32_t byte = row[8 * b + j], u;
                float lo = E2M1[byte & 15] * sc, hi = E2M1[byte >> 4] * sc;
                memcpy(&u, &lo, 4), o[16 * b + 2 * j] = (uint16_t)(u >> 16);
                memcpy(&u, &hi, 4), o[16 * b + 2 * j + 1] = (uint16_t)(u >> 16);
            }
        }
    }
}

#ifdef LUMEN_AMX
/* 32 e4m3 bytes -> 32 bf16, exact, in 16-bit lanes: a normal value's exponent and mantissa move into place and the
 * bias difference (127 - 7) is added; the subnormals (exponent 0: m x 2^-9, m < 8) come from an 8-entry table; the
 * sign moves to bit 15. Half the work of widening to f32 and narrowing back (the prompt's products of 512 tokens of a
 * 35B-A3B layer on 2 cores: this conversion was 41% of the time). The NaN codes (0x7F, 0xFF) give +-480, as e4m3x16. */
TB static inline __m512i e4m3x32_bf16(const uint8_t *p) {
    const __m128i m9 = _mm_setr_epi16(0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60); /* m 2^-9, bf16 */
    const __m512i sub = _mm512_inserti32x4(_mm512_setzero_si512(), m9, 0);
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i mag = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 4),
                                   _mm512_set1_epi16(0x3C00));
    mag = _mm512_mask_permutexvar_epi16(mag, _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78)), b, sub);
    /* mag | (b << 8 & 0x8000): A | (B & C) */
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

TB static void fp8_bf16_avx512(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, i64 N, uint16_t *out, i64 ldo) {
    i64 ahead = rows_ahead(K);
    for (i64 i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * ldw;
        prefetch_ahead(row, ldw, K, r0 + i, N, ahead);
        uint16_t *o = out + i * ldo;
        for (i64 c = 0; c < K; c += 32) _mm512_storeu_si512((void *)(o + c), e4m3x32_bf16(row + c));
    }
}
#endif

/* out[i * ldo + k] = bf16 of the e4m3 byte w[(r0 + i) * ldw + k], i < n, k < K: exact (an e4m3 value has at most 4
 * significant bits and an exponent within bf16's), the block scales left to lumen_amx_dots (srow). Rows
 * are read lumen_prefetch bytes ahead, up to the matrix's N rows: without, the rows arrive at a third of the host's
 * bandwidth between the tiles' bursts (2-core Xeon VM, 512 tokens of a 35B-A3B layer: 354 -> 230-260 ms). */
void lumen_fp8_decode_rows_bf16(const uint8_t *w, i64 ldw, i64 r0, i64 n, i64 K, i64 N, uint16_t *out, i64 ldo) {
#ifdef LUMEN_AMX
    if (lumen_level >= 4 && K % 32 == 0) {
        fp8_bf16_avx512(w, ldw, r0, n, K, N, out, ldo);
        return;
    }
#endif
    (void)N;
    for (i64 i = 0; i < n; i++)
        for (i64 k = 0; k < K; k++) {
            float v = e4m3(w[(r0 + i) * ldw + k]);
            uint32_t u;
            memcpy(&u, &v, 4);
            out[i * ldo + k] = (uint16_t)(u >> 16);
        }
}

/* The tokens in two steps, once an expert: lumen_f32_pairs lays its tokens out in f32 (F: per 16 tokens K / 2 rows of
 * 16 (even, odd) f32 pairs; tokens past m zero), gathering each token's row once; lumen_bf16_from_pairs then makes the
 * bf16 planes from F in contiguous vectors. */
void lumen_f32_pairs(const float *X, i64 ldx, const i64 *idx, i64 m, i64 K, float *F) {
    i64 nt = (m + 15) / 16;
    memset(F, 0, (size_t)(nt * (K / 2) * 32) * 4);
    for (i64 t = 0; t < m; t++) {
        const float *x = X + idx[t] * ldx;
        float *f = F + (t / 16) * (K / 2) * 32 + (t % 16) * 2;
        for (i64 k = 0; k < K; k += 2) memcpy(f + (k / 2) * 32, x + k, 8);
    }
}

#ifdef LUMEN_AMX
TB static inline __m512 bf16_f32(__m256bh h) { /* exact widening */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

TB static inline void put32(uint16_t *P, __m256bh a, __m256bh b) { /* 16 + 16 bf16 -> 32 consecutive */
    _mm512_storeu_si512((void *)P, _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)a), (__m256i)b, 1));
}

TB static void from_pairs_avx512(const float *F, i64 rows, i64 parts, i64 plane, uint16_t *P) {
    for (i64 r = 0; r < rows; r++) { /* a row: one column pair k = 2 (r % (K / 2)) of 16 tokens */
        __m512 a = _mm512_loadu_ps(F + 32 * r), b = _mm512_loadu_ps(F + 32 * r + 16);
        __m256bh ha = _mm512_cvtneps_pbh(a), hb = _mm512_cvtneps_pbh(b);
        put32(P + 32 * r, ha, hb);
        if (parts == 3) { /* a = hi + mid + lo exactly: each rest has 8 fewer significant bits */
            a = _mm512_sub_ps(a, bf16_f32(ha)), b = _mm512_sub_ps(b, bf16_f32(hb));
            __m256bh ma = _mm512_cvtneps_pbh(a), mb = _mm512_cvtneps_pbh(b);
            put32(P + plane + 32 * r, ma, mb);
            a = _mm512_sub_ps(a, bf16_f32(ma)), b = _mm512_sub_ps(b, bf16_f32(mb));
            put32(P + 2 * plane + 32 * r, _mm512_cvtneps_pbh(a), _mm512_cvtneps_pbh(b));
        }
    }
}
#endif

static inline float bf16_back(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* P = `parts` (1 or 3) planes of lumen_f32_pairs' layout in bf16 (each nt * (K / 2) * 32 values, nt = tokens / 16
 * rounded up): 1: bf16 (rounded to nearest even) of F, what cpu.compute-quantization bf16 multiplies; 3: hi, mid, lo
 * with hi + mid + lo = F's f32 value exactly (hi = bf16(v), mid = bf16(v - hi), lo = v - hi - mid: 24 significant
 * bits in three 8s), so the AMX sums equal an f32 product's up to the order of the additions (and bf16's flush of
 * values below 2^-126): the exact prefill. */
void lumen_bf16_from_pairs(const float *F, i64 m, i64 K, i64 parts, uint16_t *P) {
    i64 nt = (m + 15) / 16, plane = nt * (K / 2) * 32;
#ifdef LUMEN_AMX
    if (lumen_level >= 4) {
        for (i64 n = 0; n < nt; n++)
            from_pairs_avx512(F + n * (K / 2) * 32, K / 2, parts, plane, P + n * (K / 2) * 32);
        return;
    }
#endif
    for (i64 n = 0; n < nt; n++)
        for (i64 r = 0; r < K / 2; r++) {
            for (int q = 0; q < 32; q++) {
                i64 at = (n * (K / 2) + r) * 32 + q;
                float v = F[at];
                uint16_t h = bf16_rne(v);
                P[at] = h;
                if (parts == 3) {
                    v -= bf16_back(h);
                    h = bf16_rne(v);
                    P[plane + at] = h;
                    P[2 * plane + at] = bf16_rne(v - bf16_back(h));
                }
            }
        }
}
