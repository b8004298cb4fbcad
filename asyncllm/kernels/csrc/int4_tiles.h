/* The inner loops of the 4-bit (and 8-bit) group-quantized linear kernel (int4_linear.c; its doc comment
 * describes them), shared with the CPU decode stack (decode_stack.c), which runs them on the packed
 * weights of every layer inside its own parallel region. Everything here is static; q4_panel is one
 * panel of NR output columns for a block of up to MB rows, the unit both callers split over threads.
 */
#ifndef ASYNCLLM_INT4_TILES_H
#define ASYNCLLM_INT4_TILES_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q4_AVX2 1
#if defined(__AVX512F__)
#define Q4_AVX512 1
#endif
#endif

#define NR 16       /* output columns per panel */
#define MR 6        /* most rows per decode tile and per AVX2 float micro-kernel tile */
#ifdef Q4_AVX512
#define MR_FLOAT 12 /* ... of the AVX-512 float micro-kernel */
#else
#define MR_FLOAT MR
#endif
#define MB 64       /* rows per block */
#define DOT_ROWS 12 /* blocks up to this many rows stream the packed weight (measured) */

/* Per-thread scratch, 64-byte aligned (malloc's 16-byte alignment made every other zmm load of x or of
 * a panel straddle two cache lines, and the timings flip between two speeds from run to run): the
 * calling thread's reordered copy of x (shared with the OpenMP workers for one call), and each thread's
 * widened panel. Grown on demand, kept for the thread's next call. */
typedef struct { float *p; size_t len; } Scratch;
__attribute__((unused)) static __thread Scratch xbuf = {NULL, 0};
__attribute__((unused)) static __thread Scratch panelbuf = {NULL, 0};

__attribute__((unused)) static float *aligned_scratch(Scratch *s, size_t n) {
    if (n > s->len) {
        free(s->p);
        s->p = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        s->len = s->p ? n : 0;
    }
    return s->p;
}

/* ---- portable pieces (column order; also the vector builds' path for K or G not a multiple of 32) --- */

/* q[n][k] of a packed row: a byte (8 bits) or a nibble (4 bits, low nibble first) */
static inline float qvalue(int B8, const uint8_t *row, int64_t k) {
    if (B8) return (float)row[k];
    const uint8_t b = row[k >> 1];
    return (float)((k & 1) ? b >> 4 : b & 15);
}

/* This panel's scales and zeros as [groups][16] (columns past N: scale 0 and zero 0, so they widen to 0). */
static void panel_params(const float *scales, const float *zeros, int64_t n0, int64_t N, int64_t groups,
                         float *ps, float *pz) {
    for (int j = 0; j < NR; j++) {
        const int64_t n = n0 + j;
        for (int64_t g = 0; g < groups; g++) {
            ps[g * NR + j] = n < N ? scales[n * groups + g] : 0.0f;
            pz[g * NR + j] = n < N ? zeros[n * groups + g] : 0.0f;
        }
    }
}

/* wf[k][j] = (q[n0 + j][k] - zero) * scale (0 for columns past N), column order */
static void widen_panel_scalar(int B8, const uint8_t *packed, int64_t N, int64_t n0, const float *ps,
                               const float *pz, int64_t K, int64_t G, float *wf) {
    for (int j = 0; j < NR; j++) {
        const uint8_t *row = packed + (n0 + j < N ? n0 + j : N - 1) * (B8 ? K : K / 2);
        for (int64_t k = 0; k < K; k++) {
            const int64_t g = k / G;
            wf[k * NR + j] = (qvalue(B8, row, k) - pz[g * NR + j]) * ps[g * NR + j];
        }
    }
}

/* out[m][j] = sum_k x[m][k] * wf[k][j] */
__attribute__((unused)) static void tile_float_scalar(int rows, const float *x, int64_t xs, const float *wf,
                                                      int64_t K, float *out) {
    for (int m = 0; m < rows; m++) {
        float acc[NR];
        memset(acc, 0, sizeof(acc));
        const float *xr = x + m * xs;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) acc[j] += xr[k] * wf[k * NR + j];
        memcpy(out + m * NR, acc, sizeof(acc));
    }
}

/* out[m][j] = sum_k x[m][k] * W[n0 + j][k], for the panel's columns < N */
static void dot_scalar(int B8, int rows, const float *x, int64_t xs, const uint8_t *packed, const float *scales,
                       const float *zeros, int64_t N, int64_t n0, int64_t K, int64_t G, float *out) {
    const int64_t groups = K / G;
    for (int j = 0; j < NR && n0 + j < N; j++) {
        const uint8_t *row = packed + (n0 + j) * (B8 ? K : K / 2);
        const float *s = scales + (n0 + j) * groups, *z = zeros + (n0 + j) * groups;
        for (int m = 0; m < rows; m++) {
            const float *xr = x + m * xs;
            float total = 0.0f;
            for (int64_t k = 0; k < K; k++) total += xr[k] * ((qvalue(B8, row, k) - z[k / G]) * s[k / G]);
            out[m * NR + j] = total;
        }
    }
}

#ifdef Q4_AVX2

/* xd[m][32b + i] = x[m][32b + 2i], xd[m][32b + 16 + i] = x[m][32b + 2i + 1] (i < 16): the order in which
 * the vector code sees the packed columns. K % 32 == 0. */
static void deinterleave_x(const float *x, int64_t xs, int64_t rows, int64_t K, float *xd) {
    for (int64_t m = 0; m < rows; m++) {
        const float *src = x + m * xs;
        float *dst = xd + m * K;
        for (int64_t k = 0; k < K; k += 32) {
#ifdef Q4_AVX512
            const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            const __m512 a = _mm512_loadu_ps(src + k), b = _mm512_loadu_ps(src + k + 16);
            _mm512_storeu_ps(dst + k, _mm512_permutex2var_ps(a, even, b));
            _mm512_storeu_ps(dst + k + 16, _mm512_permutex2var_ps(a, odd, b));
#else
            for (int h = 0; h < 2; h++) { /* columns 16h .. 16h + 15 -> dst[8h ..] (even), dst[16 + 8h ..] (odd) */
                const __m256 a = _mm256_loadu_ps(src + k + 16 * h), b = _mm256_loadu_ps(src + k + 16 * h + 8);
                const __m256 e = _mm256_shuffle_ps(a, b, 0x88), o = _mm256_shuffle_ps(a, b, 0xDD);
                _mm256_storeu_ps(dst + k + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)));
                _mm256_storeu_ps(dst + k + 16 + 8 * h,
                                 _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8)));
            }
#endif
        }
    }
}

static inline float q4_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- straight from the packed rows: R (<= 6) x rows against J weight rows -----------------------------
 * Accumulators d<row><weight row> are named variables (an array would live on the stack); the ones past
 * R or J are dropped by the compiler, R and J being literal constants. x is the reordered copy (stride
 * xs), so the even columns of a 32-column step are x[k .. k + 15] and the odd ones x[k + 16 .. k + 31]. */
#define DROW(j)                                                                  \
    const int64_t wn##j = n0 + j0 + j < N ? n0 + j0 + j : N - 1;                 \
    const uint8_t *r##j = packed + wn##j * KB;                                   \
    const float *s##j = scales + wn##j * groups, *z##j = zeros + wn##j * groups;
#define DOUT(m, j) if (R > m && J > j) out[m * NR + j0 + j] = DHSUM(d##m##j, e##m##j);
#define DOUT_ROW(m) DOUT(m, 0) DOUT(m, 1) DOUT(m, 2) DOUT(m, 3) DOUT(m, 4) DOUT(m, 5) DOUT(m, 6) DOUT(m, 7)

#ifdef Q4_AVX512
#define DVEC __m512
#define DZERO _mm512_setzero_ps()
#define DHSUM(v, w) _mm512_reduce_add_ps(_mm512_add_ps(v, w))
/* per group and weight row: the table (i - zero) * scale, i = 0..15 */
#define DTABLE(j)                                                                \
    if (J > j) {                                                                 \
        zz##j = _mm512_set1_ps(z##j[g]), ss##j = _mm512_set1_ps(s##j[g]);        \
        if (!B8) t##j = _mm512_mul_ps(_mm512_sub_ps(iota, zz##j), ss##j);        \
    }
#define DX(m)                                                                    \
    const __m512 xe##m = R > m ? _mm512_loadu_ps(x + m * xs + k) : _mm512_setzero_ps(); \
    const __m512 xo##m = R > m ? _mm512_loadu_ps(x + m * xs + k + 16) : _mm512_setzero_ps();
#define DQ16(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define DFMA(j)                                                                  \
    if (J > j) {                                                                 \
        __m512 we, wo;                                                           \
        if (B8) { /* columns k .. k + 15 and k + 16 .. k + 31, dequantized as torch does */ \
            we = _mm512_mul_ps(_mm512_sub_ps(DQ16(r##j + k), zz##j), ss##j);     \
            wo = _mm512_mul_ps(_mm512_sub_ps(DQ16(r##j + k + 16), zz##j), ss##j); \
        } else {                                                                 \
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r##j + k / 2))); \
            we = _mm512_permutexvar_ps(b, t##j);                                 \
            wo = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t##j);           \
        }                                                                        \
        DFMA_ROWS(j)                                                             \
    }
#else
#define DVEC __m256
#define DZERO _mm256_setzero_ps()
#define DHSUM(v, w) q4_hsum8(v)
#define DTABLE(j)                                                                \
    if (J > j) { zz##j = _mm256_set1_ps(z##j[g]); ss##j = _mm256_set1_ps(s##j[g]); }
#define DX(m)                                                                    \
    const __m256 xe##m = R > m ? _mm256_loadu_ps(x + m * xs + k) : _mm256_setzero_ps(); \
    const __m256 xo##m = R > m ? _mm256_loadu_ps(x + m * xs + k + 16) : _mm256_setzero_ps(); \
    const __m256 xf##m = R > m ? _mm256_loadu_ps(x + m * xs + k + 8) : _mm256_setzero_ps(); \
    const __m256 xg##m = R > m ? _mm256_loadu_ps(x + m * xs + k + 24) : _mm256_setzero_ps();
/* 8 bytes -> 8 even (low nibbles) and 8 odd (high nibbles) weights, dequantized as torch does */
#define DQ8(p, j, lo, hi)                                                        \
    const __m256i lo##_i = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))); \
    const __m256 lo = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo##_i, mask)), zz##j), ss##j); \
    const __m256 hi = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo##_i, 4)), zz##j), ss##j);
/* 8 bytes -> 8 weights of consecutive columns (8 bits) */
#define DB8(p, j)                                                                \
    _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))), \
                                zz##j), ss##j)
#define DFMA(j)                                                                  \
    if (J > j) {                                                                 \
        if (B8) {                                                                \
            const __m256 we = DB8(r##j + k, j), wf = DB8(r##j + k + 8, j);        \
            const __m256 wo = DB8(r##j + k + 16, j), wg = DB8(r##j + k + 24, j);  \
            DFMA_ROWS(j)                                                         \
        } else {                                                                 \
            DQ8(r##j + k / 2, j, we, wo) DQ8(r##j + k / 2 + 8, j, wf, wg)        \
            DFMA_ROWS(j)                                                         \
        }                                                                        \
    }
#endif

#ifdef Q4_AVX512
#define DFMA1(m, j)                                                              \
    if (R > m) {                                                                 \
        d##m##j = _mm512_fmadd_ps(xe##m, we, d##m##j);                           \
        e##m##j = _mm512_fmadd_ps(xo##m, wo, e##m##j);                           \
    }
#else
#define DFMA1(m, j)                                                              \
    if (R > m) {                                                                 \
        d##m##j = _mm256_fmadd_ps(xe##m, we, d##m##j);                           \
        d##m##j = _mm256_fmadd_ps(xo##m, wo, d##m##j);                           \
        d##m##j = _mm256_fmadd_ps(xf##m, wf, d##m##j);                           \
        d##m##j = _mm256_fmadd_ps(xg##m, wg, d##m##j);                           \
    }
#endif
#define DFMA_ROWS(j) DFMA1(0, j) DFMA1(1, j) DFMA1(2, j) DFMA1(3, j) DFMA1(4, j) DFMA1(5, j)
#define DACC(m, j) DVEC d##m##j = DZERO, e##m##j = DZERO; (void)e##m##j;
#define DACC_ROW(m) DACC(m, 0) DACC(m, 1) DACC(m, 2) DACC(m, 3) DACC(m, 4) DACC(m, 5) DACC(m, 6) DACC(m, 7)

static inline __attribute__((always_inline)) void dot_tile(
        const int R, const int J, const int B8, const float *x, int64_t xs, const uint8_t *packed,
        const float *scales, const float *zeros, int64_t N, int64_t n0, int64_t K, int64_t G, float *out) {
    const int64_t groups = K / G, KB = B8 ? K : K / 2, step_bytes = B8 ? 32 : 16; /* per row, 32 columns */
#ifdef Q4_AVX512
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const __m256i mask = _mm256_set1_epi32(15);
#endif
    for (int j0 = 0; j0 < NR; j0 += J) {
        /* weight rows past N repeat the last one (their outputs are not stored) */
        DROW(0) DROW(1) DROW(2) DROW(3) DROW(4) DROW(5) DROW(6) DROW(7)
        const char *next = (const char *)(packed + (n0 + j0 + J) * KB); /* prefetches never fault */
        DACC_ROW(0) DACC_ROW(1) DACC_ROW(2) DACC_ROW(3) DACC_ROW(4) DACC_ROW(5)
        for (int64_t g = 0; g < groups; g++) {
#ifdef Q4_AVX512
            __m512 t0, t1, t2, t3, t4, t5, t6, t7, zz0, zz1, zz2, zz3, zz4, zz5, zz6, zz7;
            __m512 ss0, ss1, ss2, ss3, ss4, ss5, ss6, ss7;
            (void)t0, (void)t1, (void)t2, (void)t3, (void)t4, (void)t5, (void)t6, (void)t7;
            (void)zz1, (void)zz2, (void)zz3, (void)zz4, (void)zz5, (void)zz6, (void)zz7;
            (void)ss1, (void)ss2, (void)ss3, (void)ss4, (void)ss5, (void)ss6, (void)ss7;
#else
            __m256 zz0, zz1, zz2, zz3, zz4, zz5, zz6, zz7, ss0, ss1, ss2, ss3, ss4, ss5, ss6, ss7;
            (void)zz1, (void)zz2, (void)zz3, (void)zz4, (void)zz5, (void)zz6, (void)zz7;
            (void)ss1, (void)ss2, (void)ss3, (void)ss4, (void)ss5, (void)ss6, (void)ss7;
#endif
            DTABLE(0) DTABLE(1) DTABLE(2) DTABLE(3) DTABLE(4) DTABLE(5) DTABLE(6) DTABLE(7)
            for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
                /* the J rows consume step_bytes * J bytes a step: as many ahead in the next J rows */
                const char *ahead = next + (k / 32) * step_bytes * J;
                for (int l = 0; l < (J * step_bytes + 63) / 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
                DX(0) DX(1) DX(2) DX(3) DX(4) DX(5)
                DFMA(0) DFMA(1) DFMA(2) DFMA(3) DFMA(4) DFMA(5) DFMA(6) DFMA(7)
            }
        }
        DOUT_ROW(0) DOUT_ROW(1) DOUT_ROW(2) DOUT_ROW(3) DOUT_ROW(4) DOUT_ROW(5)
    }
}

#define DOT_CASE(r, j)                                                                       \
    case r:                                                                                  \
        if (B8) dot_tile(r, j, 1, x, xs, packed, scales, zeros, N, n0, K, G, out);           \
        else dot_tile(r, j, 0, x, xs, packed, scales, zeros, N, n0, K, G, out);              \
        break;

__attribute__((noinline)) static void dot_rows(int B8, int rows, const float *x, int64_t xs, const uint8_t *packed,
                                               const float *scales, const float *zeros, int64_t N, int64_t n0,
                                               int64_t K, int64_t G, float *out) {
    switch (rows) {
        DOT_CASE(1, 8)
        DOT_CASE(2, 4)
        DOT_CASE(3, 4)
        DOT_CASE(4, 2)
        DOT_CASE(5, 2)
        DOT_CASE(6, 2)
        default: break;
    }
}

/* ---- widened panel: wf[k'][j] in the reordered column order ------------------------------------------
 * Per 32 columns: the 16 bytes of each of the panel's 16 weight rows, transposed (four rounds of byte
 * unpacks) so that t[c] holds byte c of every row, i.e. columns 2c (low nibbles) and 2c + 1 (high) of
 * the 16 rows; those become panel rows k' = 32b + c and 32b + 16 + c. Weight rows past N repeat the
 * last one; their scales and zeros in ps / pz are 0, so they widen to 0. Needs K, G % 32 == 0. */
static inline void transpose16x16(const __m128i a[16], __m128i t[16]) {
    __m128i u[16], v[16];
    for (int p = 0; p < 8; p++) {
        u[p] = _mm_unpacklo_epi8(a[2 * p], a[2 * p + 1]);     /* 16-bit unit c (0..7): rows 2p, 2p + 1 */
        u[8 + p] = _mm_unpackhi_epi8(a[2 * p], a[2 * p + 1]); /* c 8..15 */
    }
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 4; q++) {
            v[8 * h + 2 * q] = _mm_unpacklo_epi16(u[8 * h + 2 * q], u[8 * h + 2 * q + 1]); /* rows 4q..4q+3 */
            v[8 * h + 2 * q + 1] = _mm_unpackhi_epi16(u[8 * h + 2 * q], u[8 * h + 2 * q + 1]);
        }
    /* v[8h + 2q + e]: 32-bit unit i holds column 8h + 4e + i of rows 4q .. 4q + 3 */
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 2; e++)
            for (int r = 0; r < 2; r++) {
                const __m128i lo = v[8 * h + 2 * (2 * r) + e], hi = v[8 * h + 2 * (2 * r + 1) + e];
                u[8 * h + 4 * e + 2 * r] = _mm_unpacklo_epi32(lo, hi);     /* columns +0, +1: rows 8r .. 8r+7 */
                u[8 * h + 4 * e + 2 * r + 1] = _mm_unpackhi_epi32(lo, hi); /* columns +2, +3 */
            }
    /* u[8h + 4e + 2r + s]: 64-bit unit i holds column 8h + 4e + 2s + i of rows 8r .. 8r + 7 */
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 2; e++)
            for (int s = 0; s < 2; s++) {
                const __m128i r0 = u[8 * h + 4 * e + s], r1 = u[8 * h + 4 * e + 2 + s];
                t[8 * h + 4 * e + 2 * s] = _mm_unpacklo_epi64(r0, r1);
                t[8 * h + 4 * e + 2 * s + 1] = _mm_unpackhi_epi64(r0, r1);
            }
}

/* Panel rows from t (see transpose16x16) with the group's scales s and zeros z of the 16 weight rows:
 * 4 bits: byte c holds columns 2c and 2c + 1, panel rows lo + c and hi + c; 8 bits: column c, row lo + c. Rows of ws floats. */
static inline __attribute__((always_inline)) void widen_block(const int B8, const __m128i t[16], const float *s,
                                                              const float *z, float *lo, float *hi,
                                                              const int64_t ws) {
#ifdef Q4_AVX512
    const __m512 sv = _mm512_loadu_ps(s), zv = _mm512_loadu_ps(z);
    const __m512i mask = _mm512_set1_epi32(15);
    for (int c = 0; c < 16; c++) {
        const __m512i b = _mm512_cvtepu8_epi32(t[c]);
        if (B8) {
            _mm512_storeu_ps(lo + c * ws, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(b), zv), sv));
        } else {
            const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(b, mask));
            const __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
            _mm512_storeu_ps(lo + c * ws, _mm512_mul_ps(_mm512_sub_ps(ql, zv), sv));
            _mm512_storeu_ps(hi + c * ws, _mm512_mul_ps(_mm512_sub_ps(qh, zv), sv));
        }
    }
#else
    const __m256i mask = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) { /* weight rows 8h .. 8h + 7 */
        const __m256 sv = _mm256_loadu_ps(s + 8 * h), zv = _mm256_loadu_ps(z + 8 * h);
        for (int c = 0; c < 16; c++) {
            const __m256i b = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(t[c], t[c]) : t[c]);
            if (B8) {
                _mm256_storeu_ps(lo + c * ws + 8 * h, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(b), zv), sv));
            } else {
                const __m256 ql = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
                const __m256 qh = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                _mm256_storeu_ps(lo + c * ws + 8 * h, _mm256_mul_ps(_mm256_sub_ps(ql, zv), sv));
                _mm256_storeu_ps(hi + c * ws + 8 * h, _mm256_mul_ps(_mm256_sub_ps(qh, zv), sv));
            }
        }
    }
#endif
}

static inline __attribute__((always_inline)) void widen_panel_bits(
        const int B8, const uint8_t *packed, int64_t N, int64_t n0, const float *ps, const float *pz, int64_t K,
        int64_t G, float *wf, const int64_t ws) {
    const int64_t KB = B8 ? K : K / 2, step_bytes = B8 ? 32 : 16; /* per row, 32 columns */
    const uint8_t *r[NR];
    for (int i = 0; i < NR; i++) r[i] = packed + (n0 + i < N ? n0 + i : N - 1) * KB;
    const char *next = (const char *)(packed + (n0 + NR) * KB); /* the next panel's rows */
    for (int64_t k = 0; k < K; k += 32) {
        __m128i a[16], t[16];
        for (int l = 0; l < step_bytes * NR / 64; l++)
            _mm_prefetch(next + (k / 32) * step_bytes * NR + 64 * l, _MM_HINT_T0);
        const int64_t g = k / G;
        for (int h = 0; h < (B8 ? 2 : 1); h++) { /* 8 bits: columns k + 16h .. k + 16h + 15 */
            for (int i = 0; i < 16; i++) a[i] = _mm_loadu_si128((const __m128i *)(r[i] + (B8 ? k + 16 * h : k / 2)));
            transpose16x16(a, t);
            if (B8) widen_block(1, t, ps + g * NR, pz + g * NR, wf + (k + 16 * h) * ws, NULL, ws);
            else widen_block(0, t, ps + g * NR, pz + g * NR, wf + k * ws, wf + (k + 16) * ws, ws);
        }
    }
}

__attribute__((noinline)) static void widen_panel(int B8, const uint8_t *packed, int64_t N, int64_t n0,
                                                  const float *ps, const float *pz, int64_t K, int64_t G, float *wf) {
    if (B8) widen_panel_bits(1, packed, N, n0, ps, pz, K, G, wf, NR);
    else widen_panel_bits(0, packed, N, n0, ps, pz, K, G, wf, NR);
}

/* The same for 4 bits into rows of ws floats (the decode stack's 32-column panels: two of these side by side). */
__attribute__((noinline, unused)) static void widen_panel4_strided(const uint8_t *packed, int64_t N, int64_t n0,
                                                                   const float *ps, const float *pz, int64_t K,
                                                                   int64_t G, float *wf, int64_t ws) {
    widen_panel_bits(0, packed, N, n0, ps, pz, K, G, wf, ws);
}

/* ---- the float micro-kernels (shared with int8_linear.c) --------------------------------------------- */
#include "float_tiles_avx2.h"

#endif /* Q4_AVX2 */

#ifdef Q4_AVX512
#include "float_tiles_avx512.h"
#endif /* Q4_AVX512 */

/* y[m][n0 + j] = x[m] . W[n0 + j] (+ bias) for m < rows (<= MB) and the panel's columns < N. x: the reordered
 * copy (deinterleave_x) when vec, else column order, rows of xs floats. ps: 64-byte aligned scratch of
 * 2 * (K / G) * NR + K * NR floats, used (and needed) only for blocks of more than DOT_ROWS rows. */
static inline void q4_panel(const int B8, int vec, const float *xv, int64_t xvs, int64_t rows, const uint8_t *packed,
                            const float *scales, const float *zeros, const float *bias, int64_t N, int64_t n0,
                            int64_t K, int64_t G, float *y, int64_t y_stride, float *ps) {
    const int64_t groups = K / G;
    const int cols = (int)(N - n0 < NR ? N - n0 : NR);
    float out[MB * NR];
    (void)vec;
    if (rows <= DOT_ROWS) {
        /* near-equal tiles of at most MR rows (8 rows: 4 + 4) */
        const int64_t tiles = (rows + MR - 1) / MR;
        int64_t m0 = 0;
        for (int64_t i = 0; i < tiles; i++) {
            const int r = (int)(rows / tiles + (i < rows % tiles));
            const float *xt = xv + m0 * xvs;
#ifdef Q4_AVX2
            if (vec) dot_rows(B8, r, xt, xvs, packed, scales, zeros, N, n0, K, G, out + m0 * NR);
            else
#endif
            dot_scalar(B8, r, xt, xvs, packed, scales, zeros, N, n0, K, G, out + m0 * NR);
            m0 += r;
        }
    } else {
        float *pz = ps + groups * NR, *wf = pz + groups * NR;
        panel_params(scales, zeros, n0, N, groups, ps, pz);
#ifdef Q4_AVX2
        if (vec) widen_panel(B8, packed, N, n0, ps, pz, K, G, wf);
        else
#endif
        widen_panel_scalar(B8, packed, N, n0, ps, pz, K, G, wf);
        /* the block's rows in near-equal tiles of at most MR_FLOAT rows */
        const int64_t tiles = (rows + MR_FLOAT - 1) / MR_FLOAT;
        int64_t m0 = 0;
        for (int64_t i = 0; i < tiles; i++) {
            const int r = (int)(rows / tiles + (i < rows % tiles));
            const float *xt = xv + m0 * xvs;
#if defined(Q4_AVX512)
            if (vec) tile_from_float512(r, xt, xvs, wf, K, out + m0 * NR);
            else tile_float_scalar(r, xt, xvs, wf, K, out + m0 * NR);
#elif defined(Q4_AVX2)
            if (vec) tile_from_float(r, xt, xvs, wf, K, out + m0 * NR);
            else tile_float_scalar(r, xt, xvs, wf, K, out + m0 * NR);
#else
            tile_float_scalar(r, xt, xvs, wf, K, out + m0 * NR);
#endif
            m0 += r;
        }
    }
    for (int64_t m = 0; m < rows; m++) {
        float *yr = y + m * y_stride + n0;
        const float *o = out + m * NR;
        if (bias) {
            for (int j = 0; j < cols; j++) yr[j] = o[j] + bias[n0 + j];
        } else {
            for (int j = 0; j < cols; j++) yr[j] = o[j];
        }
    }
}

#endif /* ASYNCLLM_INT4_TILES_H */
