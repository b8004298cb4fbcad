/* Weight-only int8 linear layer for the CPU path: y[M, N] = x[M, K] @ (q[N, K] * scale).T (+ bias),
 * float32 activations and output, int8 weights with one float32 scale per group of G input columns
 * (G = K: one scale per output channel; G = 32: GGUF's Q8_0).
 *
 * The weight is read in its plain row-major layout (the layer's ``qweight`` buffer, which the CPU
 * decode stack reads too), so the layer holds it once. Output columns are handled in panels of 16;
 * threads split the panels (OpenMP, num_threads from torch), rows go in blocks of 64.
 *
 * - A block of up to 12 rows (decode) takes the weight straight from memory, in tiles of up to 6
 *   rows: per step, 8 input columns of J weight rows are widened in registers (vpmovsxbd +
 *   vcvtdq2ps; times the group's scale when G < K) and FMA'd into 8-lane partial dot products with
 *   the tile's x rows (1 row x 8 weight rows, 2-3 x 4, 4-6 x 2: every widened vector serves the
 *   whole tile, 8-12 independent accumulators), summed across lanes at the end; per channel the
 *   scale multiplies the finished sum. The J rows are read as J interleaved streams, which the
 *   hardware prefetchers follow poorly from DRAM, so each step also prefetches a line of the next
 *   J rows (2-3x faster on a weight larger than the caches). At one row this streams the int8
 *   weight once: a quarter of the bytes of a float32 weight.
 * - A larger block widens the panel once into per-thread scratch, transposed to K x 16 floats with
 *   the scales applied (an 8x8 byte transpose per 8 columns and 8 weight rows), and runs a 6x16
 *   float micro-kernel over it (per input column: two 8-wide weight vectors, a broadcast x value
 *   per row, 12 FMAs), so each weight is converted once per 64 rows. Built for AVX-512, a 12x16
 *   micro-kernel replaces it (a panel row is one zmm vector: one load and up to 12 FMAs per input
 *   column); same order of operations, so the same results to the bit.
 * - With bf16 dot products (int8_linear_bf16dot, AVX512-BF16 builds; dtype="bfloat16" on int8 weights), a call of
 *   more than 12 rows rounds its rows to bf16 pairs once, and each widened panel (q * scale, as above) to bf16
 *   pairs too; a 12x32 micro-kernel over two panels then does two vdpbf16ps per row and pair of input columns
 *   (each one twice the multiply-adds of an FMA). The weights stay int8 in memory; the products are those of
 *   bf16-rounded weights and activations, summed in float32 (the bf16 path's tolerance, not the float32 bits).
 * The micro-kernels are kept out of line (noinline): inlined into the OpenMP body, GCC spilled the
 * 6x16 kernel's accumulators (30-40% slower).
 *
 * The AVX2/FMA code needs K and G to be multiples of 8; other shapes, and machines without AVX2,
 * use the portable scalar loops of the same structure. Built and loaded like lora.c (cpu_build.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scratch.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT8_LINEAR_AVX2 1
#if defined(__AVX512F__)
#define INT8_LINEAR_AVX512 1
#endif
#endif

#define NR 16     /* output columns per panel */
#define MR 6      /* most rows per float micro-kernel tile */
#ifdef INT8_LINEAR_AVX512
#define MR_FLOAT 12 /* ... of the AVX-512 one */
#else
#define MR_FLOAT MR
#endif
#define MB 64     /* rows per block */
#define DOT_ROWS 12 /* blocks up to this many rows take the weight straight from memory (measured) */

/* ---- portable pieces (also the AVX2 build's path for K or G not a multiple of 8) -------------------- */

/* This panel's scales as [groups][16] (columns past N get 0, so padded outputs stay 0). */
static void panel_scales(const float *scales, int64_t n0, int64_t N, int64_t groups, float *out) {
    for (int j = 0; j < NR; j++) {
        const float *src = scales + (n0 + j) * groups;
        if (n0 + j < N)
            for (int64_t g = 0; g < groups; g++) out[g * NR + j] = src[g];
        else
            for (int64_t g = 0; g < groups; g++) out[g * NR + j] = 0.0f;
    }
}

/* wf[k][j] = q[n0 + j][k] * scale (0 for columns past N) */
static void widen_panel_scalar(const int8_t *q, int64_t N, int64_t n0, const float *ps, int64_t K, int64_t G,
                               float *wf) {
    for (int j = 0; j < NR; j++) {
        const int8_t *row = q + (n0 + j) * K;
        for (int64_t k = 0; k < K; k++) wf[k * NR + j] = n0 + j < N ? (float)row[k] * ps[(k / G) * NR + j] : 0.0f;
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

/* out[m][j] = sum_g scale[n0 + j][g] * sum_{k in g} x[m][k] * q[n0 + j][k], for the panel's columns < N */
static void dot_scalar(int rows, const float *x, int64_t xs, const int8_t *q, const float *scales, int64_t N,
                       int64_t n0, int64_t K, int64_t G, float *out) {
    const int64_t groups = K / G;
    for (int j = 0; j < NR && n0 + j < N; j++) {
        const int8_t *row = q + (n0 + j) * K;
        const float *s = scales + (n0 + j) * groups;
        for (int m = 0; m < rows; m++) {
            const float *xr = x + m * xs;
            float total = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                float part = 0.0f;
                for (int64_t k = g * G; k < (g + 1) * G; k++) part += xr[k] * (float)row[k];
                total += part * s[g];
            }
            out[m * NR + j] = total;
        }
    }
}

#ifdef INT8_LINEAR_AVX2

#define WIDEN(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- straight from the int8 rows: R (<= 6) x rows against J weight rows -------------------------------
 * Accumulators d<row><weight row> are named variables (an array would live on the stack); the ones
 * past R or J are dropped by the compiler, R, J and PC (per channel) being literal constants. */
#define DACC(m, j) __m256 d##m##j = _mm256_setzero_ps();
#define DACC_ROW(m) DACC(m, 0) DACC(m, 1) DACC(m, 2) DACC(m, 3) DACC(m, 4) DACC(m, 5) DACC(m, 6) DACC(m, 7)
#define DX(m) const __m256 x##m = R > m ? _mm256_loadu_ps(x + m * xs + k) : _mm256_setzero_ps();
#define DFMA(j)                                                              \
    if (J > j) {                                                             \
        __m256 w = WIDEN(r##j + k);                                          \
        if (!PC) w = _mm256_mul_ps(w, _mm256_broadcast_ss(s##j + g));        \
        d0##j = _mm256_fmadd_ps(x0, w, d0##j);                               \
        if (R > 1) d1##j = _mm256_fmadd_ps(x1, w, d1##j);                    \
        if (R > 2) d2##j = _mm256_fmadd_ps(x2, w, d2##j);                    \
        if (R > 3) d3##j = _mm256_fmadd_ps(x3, w, d3##j);                    \
        if (R > 4) d4##j = _mm256_fmadd_ps(x4, w, d4##j);                    \
        if (R > 5) d5##j = _mm256_fmadd_ps(x5, w, d5##j);                    \
    }
#define DOUT(m, j)                                                           \
    if (R > m && J > j) out[m * NR + j0 + j] = PC ? hsum8(d##m##j) * s##j[0] : hsum8(d##m##j);
#define DOUT_ROW(m) DOUT(m, 0) DOUT(m, 1) DOUT(m, 2) DOUT(m, 3) DOUT(m, 4) DOUT(m, 5) DOUT(m, 6) DOUT(m, 7)
#define DROW(j)                                                              \
    const int8_t *r##j = q + (n0 + j0 + j < N ? n0 + j0 + j : N - 1) * K;   \
    const float *s##j = scales + (n0 + j0 + j < N ? n0 + j0 + j : N - 1) * groups;

/* out[m][j] for the panel's 16 columns, J weight rows at a time. The J rows are contiguous in memory;
 * every step prefetches one cache line of the next J rows, so they arrive as these finish. */
static inline __attribute__((always_inline)) void dot_tile(
        const int R, const int J, const int PC, const float *x, int64_t xs, const int8_t *q, const float *scales,
        int64_t N, int64_t n0, int64_t K, int64_t G, float *out) {
    const int64_t groups = K / G;
    for (int j0 = 0; j0 < NR; j0 += J) {
        /* weight rows past N repeat the last one (their outputs are not stored) */
        DROW(0) DROW(1) DROW(2) DROW(3) DROW(4) DROW(5) DROW(6) DROW(7)
        const char *next = (const char *)(q + (n0 + j0 + J) * K); /* prefetches never fault */
        DACC_ROW(0) DACC_ROW(1) DACC_ROW(2) DACC_ROW(3) DACC_ROW(4) DACC_ROW(5)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                _mm_prefetch(next + k * J, _MM_HINT_T0);
                DX(0) DX(1) DX(2) DX(3) DX(4) DX(5)
                DFMA(0) DFMA(1) DFMA(2) DFMA(3) DFMA(4) DFMA(5) DFMA(6) DFMA(7)
            }
        }
        DOUT_ROW(0) DOUT_ROW(1) DOUT_ROW(2) DOUT_ROW(3) DOUT_ROW(4) DOUT_ROW(5)
    }
}

#define DOT_CASE(r, j)                                                          \
    case r:                                                                     \
        if (G == K) dot_tile(r, j, 1, x, xs, q, scales, N, n0, K, G, out);      \
        else dot_tile(r, j, 0, x, xs, q, scales, N, n0, K, G, out);             \
        break;

__attribute__((noinline)) static void dot_rows(int rows, const float *x, int64_t xs, const int8_t *q,
                                               const float *scales, int64_t N, int64_t n0, int64_t K, int64_t G,
                                               float *out) {
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

/* ---- widened panel: 6x16 float micro-kernel -------------------------------------------------------- */
#include "float_tiles_avx2.h"

/* wf[k][j] = q[n0 + j][k] * scale, 8 columns x 8 weight rows at a time: the 8x8 bytes transposed with
 * three rounds of unpacks, then widened and scaled 8 weight rows per vector. Needs K, G % 8 == 0.
 * Weight rows past N repeat the last one; their scales in ps are 0, so they widen to 0. */
__attribute__((noinline)) static void widen_panel(const int8_t *q, int64_t N, int64_t n0, const float *ps, int64_t K,
                                                  int64_t G, float *wf) {
    for (int h = 0; h < 2; h++) {
        const int8_t *r[8];
        for (int i = 0; i < 8; i++) {
            const int64_t n = n0 + 8 * h + i;
            r[i] = q + (n < N ? n : N - 1) * K;
        }
        const char *next = (const char *)(q + (n0 + NR + 8 * h) * K); /* the next panel's rows, as in dot_tile */
        for (int64_t k = 0; k < K; k += 8) {
            _mm_prefetch(next + k * 8, _MM_HINT_T0);
#define LOAD8(i) _mm_loadl_epi64((const __m128i *)(r[i] + k))
            const __m128i t0 = _mm_unpacklo_epi8(LOAD8(0), LOAD8(1)), t1 = _mm_unpacklo_epi8(LOAD8(2), LOAD8(3));
            const __m128i t2 = _mm_unpacklo_epi8(LOAD8(4), LOAD8(5)), t3 = _mm_unpacklo_epi8(LOAD8(6), LOAD8(7));
#undef LOAD8
            const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
            const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
            /* v[i]: the 8 weight rows at columns k + 2i (low half) and k + 2i + 1 (high half) */
            const __m128i v[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2),
                                  _mm_unpacklo_epi32(u1, u3), _mm_unpackhi_epi32(u1, u3)};
            const __m256 s = _mm256_loadu_ps(ps + (k / G) * NR + 8 * h);
            float *o = wf + k * NR + 8 * h;
            for (int i = 0; i < 4; i++) {
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v[i]));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v[i], v[i])));
                _mm256_storeu_ps(o + (2 * i) * NR, _mm256_mul_ps(lo, s));
                _mm256_storeu_ps(o + (2 * i + 1) * NR, _mm256_mul_ps(hi, s));
            }
        }
    }
}

#endif /* INT8_LINEAR_AVX2 */

#ifdef INT8_LINEAR_AVX512
/* ---- widened panel on AVX-512: 12x16 float micro-kernel --------------------------------------------
 * A panel row (16 columns) is one zmm vector, so a tile of up to 12 rows keeps 12 accumulators (enough
 * to cover the FMA latency on two pipes) and per input column does one weight load and 12 FMAs with a
 * broadcast x value: twice the arithmetic per instruction of the 6x16 AVX2 kernel. */
#include "float_tiles_avx512.h"
#endif /* INT8_LINEAR_AVX512 */

#if defined(INT8_LINEAR_AVX512) && defined(__AVX512BF16__)
#define INT8_LINEAR_BF16DOT 1
#include "bf16_dot_tiles.h"

/* int8_linear_f32's arithmetic in bf16 dot products (K and G multiples of 8): threads split (block of MB rows,
 * pair of panels) items; each widens its two panels (scales applied), pairs them, and runs the rows through
 * them in tiles of at most MR_DP. */
static int int8_linear_dp(const float *x, int64_t x_stride, int64_t M, const int8_t *q, const float *scales,
                          const float *bias, int64_t N, int64_t K, int64_t G, float *y, int64_t y_stride,
                          int num_threads) {
    const int64_t pairs = K / 2, groups = K / G, panels = (N + NR - 1) / NR, duos = (panels + 1) / 2;
    const int64_t blocks = (M + MB - 1) / MB, work = blocks * duos;
    uint32_t *xp = (uint32_t *)malloc((size_t)(M * pairs) * sizeof(uint32_t));
    if (!xp) return 1;
    pair_rows(x, x_stride, M, K, xp, num_threads);
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (work > 1) reduction(| : failed)
    for (int64_t t = 0; t < work; t++) {
        const int64_t b = t / duos, n0 = (t % duos) * 2 * NR;
        const int64_t m_begin = b * MB, m_end = m_begin + MB < M ? m_begin + MB : M, rows = m_end - m_begin;
        const int cols = (int)(N - n0 < 2 * NR ? N - n0 : 2 * NR);
        /* per thread: one panel's scales and float32 widening, then both panels' pairs */
        float *ps = scratch_floats((size_t)(groups * NR + K * NR + K * NR));
        if (!ps) { failed = 1; continue; }
        float *wf = ps + groups * NR;
        uint32_t *wp = (uint32_t *)(wf + K * NR);
        for (int h = 0; h < 2; h++) {
            const int64_t p0 = n0 + h * NR;
            if (p0 < N) {
                panel_scales(scales, p0, N, groups, ps);
                widen_panel(q, N, p0, ps, K, G, wf);
                pair_panel(wf, K, wp + h * pairs * NR);
            } else {
                memset(wp + h * pairs * NR, 0, (size_t)(pairs * NR) * sizeof(uint32_t));
            }
        }
        float out[MB * 2 * NR];
        const int64_t tiles = (rows + MR_DP - 1) / MR_DP;
        int64_t m0 = 0;
        for (int64_t i = 0; i < tiles; i++) {
            const int r = (int)(rows / tiles + (i < rows % tiles));
            tile_from_pairs(r, xp + (m_begin + m0) * pairs, pairs, wp, wp + pairs * NR, out + m0 * 2 * NR);
            m0 += r;
        }
        for (int64_t m = 0; m < rows; m++) {
            float *yr = y + (m_begin + m) * y_stride + n0;
            const float *o = out + m * 2 * NR;
            for (int j = 0; j < cols; j++) yr[j] = o[j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
    free(xp);
    return failed;
}
#endif /* INT8_LINEAR_BF16DOT */

/* y[m][n] = sum_k x[m][k] * q[n][k] * scales[n][k / G] (+ bias[n]) for m < M, n < N.
 * x: rows of x_stride floats; q: [N][K] int8 row-major; scales: [N][K / G]; bias: N floats or NULL;
 * y: rows of y_stride floats. Returns 0, 1 if scratch memory ran out, 2 for bad shapes. */
int int8_linear_f32(const float *x, int64_t x_stride, int64_t M, const int8_t *q, const float *scales,
                    const float *bias, int64_t N, int64_t K, int64_t G, float *y, int64_t y_stride,
                    int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || G <= 0 || K % G) return 2;
#ifdef INT8_LINEAR_AVX2
    const int vec = K % 8 == 0 && G % 8 == 0;
#endif
    const int64_t panels = (N + NR - 1) / NR, groups = K / G, blocks = (M + MB - 1) / MB;
    const int64_t work = blocks * panels;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= (1 << 17) && work > 1) \
    reduction(| : failed)
    for (int64_t t = 0; t < work; t++) {
        const int64_t b = t / panels, p = t % panels, n0 = p * NR;
        const int64_t m_begin = b * MB, m_end = m_begin + MB < M ? m_begin + MB : M, rows = m_end - m_begin;
        const int cols = (int)(N - n0 < NR ? N - n0 : NR);
        float out[MB * NR];
        if (rows <= DOT_ROWS) {
            /* near-equal tiles of at most MR rows (8 rows: 4 + 4) */
            const int64_t tiles = (rows + MR - 1) / MR;
            int64_t m0 = 0;
            for (int64_t i = 0; i < tiles; i++) {
                const int r = (int)(rows / tiles + (i < rows % tiles));
                const float *xt = x + (m_begin + m0) * x_stride;
#ifdef INT8_LINEAR_AVX2
                if (vec) dot_rows(r, xt, x_stride, q, scales, N, n0, K, G, out + m0 * NR);
                else
#endif
                dot_scalar(r, xt, x_stride, q, scales, N, n0, K, G, out + m0 * NR);
                m0 += r;
            }
        } else {
            float *ps = scratch_floats((size_t)(groups * NR + K * NR));
            if (!ps) { failed = 1; continue; }
            float *wf = ps + groups * NR;
            panel_scales(scales, n0, N, groups, ps);
#ifdef INT8_LINEAR_AVX2
            if (vec) widen_panel(q, N, n0, ps, K, G, wf);
            else
#endif
            widen_panel_scalar(q, N, n0, ps, K, G, wf);
            /* the block's rows in near-equal tiles of at most MR_FLOAT rows (8 rows: 4 + 4, not 6 + 2) */
            const int64_t tiles = (rows + MR_FLOAT - 1) / MR_FLOAT;
            int64_t m0 = 0;
            for (int64_t i = 0; i < tiles; i++) {
                const int r = (int)(rows / tiles + (i < rows % tiles));
#if defined(INT8_LINEAR_AVX512)
                tile_from_float512(r, x + (m_begin + m0) * x_stride, x_stride, wf, K, out + m0 * NR);
#elif defined(INT8_LINEAR_AVX2)
                tile_from_float(r, x + (m_begin + m0) * x_stride, x_stride, wf, K, out + m0 * NR);
#else
                tile_float_scalar(r, x + (m_begin + m0) * x_stride, x_stride, wf, K, out + m0 * NR);
#endif
                m0 += r;
            }
        }
        for (int64_t m = 0; m < rows; m++) {
            float *yr = y + (m_begin + m) * y_stride + n0;
            const float *o = out + m * NR;
            if (bias) {
                for (int j = 0; j < cols; j++) yr[j] = o[j] + bias[n0 + j];
            } else {
                for (int j = 0; j < cols; j++) yr[j] = o[j];
            }
        }
    }
    return failed;
}

/* int8_linear_f32, except that calls of more than DOT_ROWS rows multiply bf16-rounded weights and activations
 * with vdpbf16ps (int8_linear_dp; AVX512-BF16 builds, K and G multiples of 8; otherwise the float32 kernel). */
int int8_linear_bf16dot(const float *x, int64_t x_stride, int64_t M, const int8_t *q, const float *scales,
                        const float *bias, int64_t N, int64_t K, int64_t G, float *y, int64_t y_stride,
                        int num_threads) {
#ifdef INT8_LINEAR_BF16DOT
    if (M > DOT_ROWS && N > 0 && K > 0 && G > 0 && K % G == 0 && K % 8 == 0 && G % 8 == 0)
        return int8_linear_dp(x, x_stride, M, q, scales, bias, N, K, G, y, y_stride, num_threads);
#endif
    return int8_linear_f32(x, x_stride, M, q, scales, bias, N, K, G, y, y_stride, num_threads);
}

/* Whether int8_linear_bf16dot multiplies with bf16 dot products in this build (1) or is the float32 kernel (0). */
int int8_linear_has_bf16dot(void) {
#ifdef INT8_LINEAR_BF16DOT
    return 1;
#else
    return 0;
#endif
}
