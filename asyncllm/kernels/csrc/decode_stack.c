/* The whole decoder stack for a decode-only batch (one new token per sequence) in one call.
 *
 * Why: at batch 1 a step of a small model is ~30 layers x ~15 torch operations, each a Python call
 * and a kernel launch; together they cost more than streaming the weights once. Here one call runs
 * every layer inside one OpenMP parallel region: RMSNorm, the fused qkv projection (+ bias), rotary
 * embedding, the KV-cache write, paged attention, the output projection, the residual add, the
 * fused gate/up projection, SiLU-and-multiply and the down projection. Every weight is read once per
 * step for all the batch's rows. Float32 weights come in panels of 32 output columns on AVX-512
 * builds (project_panels: register-blocked tiles of up to 12 rows, for batches up to 64 rows),
 * otherwise row-major, as int8 weights with float32 scales (per output channel or per group of input
 * columns) always are (dot products per row, for batches up to 4 rows). At one row the step streams
 * the weights once, which is what bounds it; at 32 rows the tiles' FMAs are.
 * 4-bit group-quantized weights (GPTQ / AWQ / compressed-tensors as kernels/quant_linear.py holds them:
 * nibbles [N][Ks / 2], float32 scales and zeros [N][Ks / G]) are read packed by int4_linear.c's loops
 * (int4_tiles.h: dequantized in registers up to 12 rows, through a per-thread widened panel above; batches
 * up to 64 rows); Ks is the input width rounded up to whole groups (a padded partial last group: the
 * input is padded with zeros, as GroupQuantLinear pads it). Unsigned 8-bit codes with zero points (GPTQ's
 * asymmetric 8 bits: bytes [N][Ks]) take the same loops on bytes. Act-order layers (columns stored sorted by
 * group, GPTQ desc_act) gather each input row by the layer's perm first.
 * Attention is paged_attention.h's loop, shared with paged_decode.c.
 *
 * Numerics follow transformers' Llama: RMSNorm in float32 as x * rsqrt(mean(x^2) + eps) * w,
 * rotate-half rope with the engine's cos/sin tables, softmax(q k^T * scale) v. Summation order
 * differs from torch's (float32 rounding only). Built like the other kernels (cpu_build.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

/* also declares libmvec's vector expf: the SiLU and softmax loops vectorise with it, where the scalar
 * expf of every intermediate column of every layer cost ~0.4 ms per token */
#include "paged_attention.h"
#include "int4_tiles.h"

typedef struct {
    const float *input_norm, *post_norm;      /* [H] */
    const void *qkv, *o, *gate_up, *down;     /* row-major [N][K]: float or int8 */
    const float *qkv_scales, *o_scales, *gate_up_scales, *down_scales; /* [N][K / G] (int8 only) */
    const float *qkv_bias;                    /* [Q + 2 KV] or NULL */
    void *k_cache, *v_cache;                  /* [blocks][block_size][kv_heads][D]: float, or bf16 (kv_bf16) */
    const float *qkv_zeros, *o_zeros, *gate_up_zeros, *down_zeros; /* [N][Ks / G] (4 bits only) */
    /* act-order (4 bits only): stored column k reads input column perm[k] ([K] or NULL) */
    const int64_t *qkv_perm, *o_perm, *gate_up_perm, *down_perm;
} layer_t;

#ifdef __AVX2__
static inline __m256 load_w8(const void *W, int int8, int64_t offset) {
    if (int8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)W + offset))));
    return _mm256_loadu_ps((const float *)W + offset);
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
#endif

#ifdef __AVX2__
/* y[r][n] = x[r] . W[n] for the MR rows of x at once (MR a compile-time constant, so the accumulators
 * stay in registers): each weight load feeds MR independent FMA chains. */
#define GEMV_BLOCK(MR)                                                                                          \
    static inline void gemv_block_##MR(const float *x, int64_t K, const void *W, const float *S, int64_t G,    \
                                       int int8, const float *bias, float *y, int64_t ldy, int64_t n) {       \
        const int64_t groups = int8 ? K / G : 1;                                                               \
        __m256 acc[MR];                                                                                        \
        for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                             \
        for (int64_t g = 0; g < groups; g++) {                                                                 \
            const int64_t kb = int8 ? g * G : 0, ke = int8 ? kb + G : K;                                       \
            __m256 part[MR];                                                                                   \
            for (int r = 0; r < MR; r++) part[r] = _mm256_setzero_ps();                                        \
            for (int64_t k = kb; k < ke; k += 8) {                                                             \
                const __m256 w = load_w8(W, int8, n * K + k);                                                  \
                for (int r = 0; r < MR; r++) part[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * K + k), part[r]); \
            }                                                                                                  \
            if (int8) {                                                                                        \
                const __m256 s = _mm256_set1_ps(S[n * groups + g]);                                            \
                for (int r = 0; r < MR; r++) acc[r] = _mm256_fmadd_ps(part[r], s, acc[r]);                     \
            } else {                                                                                           \
                for (int r = 0; r < MR; r++) acc[r] = part[r];                                                 \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++) y[r * ldy + n] = hsum8(acc[r]) + (bias ? bias[n] : 0.0f);                 \
    }
GEMV_BLOCK(1)
GEMV_BLOCK(2)
GEMV_BLOCK(3)
GEMV_BLOCK(4)
GEMV_BLOCK(5)
GEMV_BLOCK(6)
GEMV_BLOCK(7)
GEMV_BLOCK(8)
#endif

/* y[m][n] (+)= x[m] . W[n] for rows n in [n0, n1), m < M; W float (int8 = 0) or int8 with scales. */
static void gemv_rows(const float *x, int64_t M, int64_t K, const void *W, const float *S, int64_t G, int int8,
                      const float *bias, float *y, int64_t ldy, int64_t n0, int64_t n1) {
#ifdef __AVX2__
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const float *xm = x + m0 * K;
            float *ym = y + m0 * ldy;
            switch (M - m0 < 8 ? M - m0 : 8) {
                case 1: gemv_block_1(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                case 2: gemv_block_2(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                case 3: gemv_block_3(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                case 4: gemv_block_4(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                case 5: gemv_block_5(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                case 6: gemv_block_6(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                case 7: gemv_block_7(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
                default: gemv_block_8(xm, K, W, S, G, int8, bias, ym, ldy, n); break;
            }
        }
    }
#else
    const int64_t groups = int8 ? K / G : 1;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) {
            float out = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t kb = int8 ? g * G : 0, ke = int8 ? kb + G : K;
                float part = 0.0f;
                for (int64_t k = kb; k < ke; k++) {
                    const float w = int8 ? (float)((const int8_t *)W)[n * K + k] : ((const float *)W)[n * K + k];
                    part += w * x[m * K + k];
                }
                out += int8 ? part * S[n * groups + g] : part;
            }
            y[m * ldy + n] = out + (bias ? bias[n] : 0.0f);
        }
    }
#endif
}

#ifdef __AVX2__
/* One row of x (batch 1): four weight rows at a time, four independent FMA chains sharing each x load. */
static void gemv1_rows4(const float *x, int64_t K, const void *W, const float *S, int64_t G, int int8,
                        const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t groups = int8 ? K / G : 1, step = int8 ? G : K;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        for (int64_t g = 0; g < groups; g++) {
            __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
            for (int64_t k = g * step; k < (g + 1) * step; k += 8) {
                const __m256 xk = _mm256_loadu_ps(x + k);
                p0 = _mm256_fmadd_ps(load_w8(W, int8, n * K + k), xk, p0);
                p1 = _mm256_fmadd_ps(load_w8(W, int8, (n + 1) * K + k), xk, p1);
                p2 = _mm256_fmadd_ps(load_w8(W, int8, (n + 2) * K + k), xk, p2);
                p3 = _mm256_fmadd_ps(load_w8(W, int8, (n + 3) * K + k), xk, p3);
            }
            if (int8) {
                acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(S[n * groups + g]), acc0);
                acc1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(S[(n + 1) * groups + g]), acc1);
                acc2 = _mm256_fmadd_ps(p2, _mm256_set1_ps(S[(n + 2) * groups + g]), acc2);
                acc3 = _mm256_fmadd_ps(p3, _mm256_set1_ps(S[(n + 3) * groups + g]), acc3);
            } else {
                acc0 = p0, acc1 = p1, acc2 = p2, acc3 = p3;
            }
        }
        y[n] = hsum8(acc0) + (bias ? bias[n] : 0.0f);
        y[n + 1] = hsum8(acc1) + (bias ? bias[n + 1] : 0.0f);
        y[n + 2] = hsum8(acc2) + (bias ? bias[n + 2] : 0.0f);
        y[n + 3] = hsum8(acc3) + (bias ? bias[n + 3] : 0.0f);
    }
    if (n < n1) gemv_rows(x, 1, K, W, S, G, int8, bias, y, 0, n, n1);
}
#endif

#ifdef __AVX2__
/* Float32 weights, one row of x: eight weight rows at a time (eight independent FMA chains, eight
 * streams from memory in flight), each x load shared by all eight. */
static void gemv1_f32_rows8(const float *x, int64_t K, const float *W, const float *bias, float *y, int64_t n0,
                            int64_t n1) {
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
        const float *w = W + n * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 xk = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), xk, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + K + k), xk, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * K + k), xk, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * K + k), xk, a3);
            a4 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 4 * K + k), xk, a4);
            a5 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 5 * K + k), xk, a5);
            a6 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 6 * K + k), xk, a6);
            a7 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 7 * K + k), xk, a7);
        }
        const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (int r = 0; r < 8; r++) y[n + r] = hsum8(acc[r]) + (bias ? bias[n + r] : 0.0f);
    }
    if (n < n1) gemv1_rows4(x, K, W, NULL, K, 0, bias, y, n, n1);
}
#endif


#ifdef __AVX2__
#define XGROUP 32  /* activation values per int16 scale in gemv1_i8_madd */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8  /* how far ahead gemv1_i8_madd prefetches weight rows */
#endif

/* x rounded to int16 per group of 32 values (scale = group absmax / 32767): the int8 x int16 products
 * can then use vpmaddwd (16 multiply-adds per instruction, exact in int32) instead of widening every
 * weight to float. The rounding error is below 1/65534 of each group's largest value, about 250 times
 * finer than bfloat16's. */
static void quantize_x16(const float *x, int64_t K, int16_t *xq, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t a = 0; a < K / XGROUP; a++) {
        const float *g = x + a * XGROUP;
        const __m256 v0 = _mm256_loadu_ps(g), v1 = _mm256_loadu_ps(g + 8), v2 = _mm256_loadu_ps(g + 16),
                     v3 = _mm256_loadu_ps(g + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float top = _mm_cvtss_f32(h);
        xs[a] = top / 32767.0f;
        const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
        /* round to nearest (the default rounding mode), then pack to int16 in order */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
        const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
        _mm256_storeu_si256((__m256i *)(xq + a * XGROUP), p01);
        _mm256_storeu_si256((__m256i *)(xq + a * XGROUP + 16), p23);
    }
}

/* Int8 weights, one row of x as int16 (quantize_x16): eight weight rows at a time; per group of 32
 * input columns, two vpmaddwd per row give exact int32 sums, widened to float once and scaled by the
 * activation group's scale (times the weight group's when the weights are grouped by 32). */
static void gemv1_i8_madd(const int16_t *xq, const float *xs, int64_t K, const int8_t *W, const float *S, int64_t G,
                          const float *bias, float *y, int64_t n0, int64_t n1, int64_t N) {
    const int64_t xgroups = K / XGROUP, wgroups = K / G;
    const int per_channel = wgroups == 1;
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
        const int8_t *w = W + n * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t a = 0; a < xgroups; a++) {
            const int64_t k = a * XGROUP;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + k));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + k + 16));
            const float sx = xs[a];
            const int64_t wg = per_channel ? 0 : (a * XGROUP) / G;  /* the weights' group of these columns */
            if (!(a & 1) && n + 8 + PREFETCH_ROWS <= N) {
                /* rows of 1-2 KB are too short for the hardware prefetcher to ramp up: fetch the next
                   eight rows' lines while this block computes */
                for (int r = 0; r < 8; r++)
                    _mm_prefetch((const char *)(w + (PREFETCH_ROWS + r) * K + k), _MM_HINT_T0);
            }
#define MADD_ROW(r, acc)                                                                               \
            {                                                                                          \
                const int8_t *wr = w + (r) * K + k;                                                    \
                const __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wr)), x0); \
                const __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + 16))), x1); \
                const float sc = per_channel ? sx : sx * S[(n + (r)) * wgroups + wg];                  \
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(sc), acc); \
            }
            MADD_ROW(0, a0) MADD_ROW(1, a1) MADD_ROW(2, a2) MADD_ROW(3, a3)
            MADD_ROW(4, a4) MADD_ROW(5, a5) MADD_ROW(6, a6) MADD_ROW(7, a7)
#undef MADD_ROW
        }
        const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (int r = 0; r < 8; r++)
            y[n + r] = hsum8(acc[r]) * (per_channel ? S[n + r] : 1.0f) + (bias ? bias[n + r] : 0.0f);
    }
    for (; n < n1; n++) {  /* leftover rows: the same sums, one row at a time */
        float total = 0.0f;
        for (int64_t a = 0; a < xgroups; a++) {
            int32_t dot = 0;
            for (int i = 0; i < XGROUP; i++) dot += (int32_t)W[n * K + a * XGROUP + i] * xq[a * XGROUP + i];
            total += (float)dot * xs[a] * (per_channel ? 1.0f : S[n * wgroups + a * XGROUP / G]);
        }
        y[n] = total * (per_channel ? S[n] : 1.0f) + (bias ? bias[n] : 0.0f);
    }
}

#ifdef __AVX512BW__
/* gemv1_i8_madd with 512-bit vectors: a group of 32 input columns is one zmm of int16 activations, and each
 * weight row's 32 int8 values one sign-extending load, so a row takes one vpmaddwd, one conversion and one FMA
 * per group (the 256-bit loop: two, plus the add): the same exact int32 pair sums, summed in float32 in
 * another order. */
static void gemv1_i8_madd512(const int16_t *xq, const float *xs, int64_t K, const int8_t *W, const float *S,
                             int64_t G, const float *bias, float *y, int64_t n0, int64_t n1, int64_t N) {
    const int64_t xgroups = K / XGROUP, wgroups = K / G;
    const int per_channel = wgroups == 1;
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
        const int8_t *w = W + n * K;
        __m512 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t a = 0; a < xgroups; a++) {
            const int64_t k = a * XGROUP;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + k));
            const float sx = xs[a];
            const int64_t wg = per_channel ? 0 : k / G;
            if (!(a & 1) && n + 8 + PREFETCH_ROWS <= N)
                for (int r = 0; r < 8; r++)
                    _mm_prefetch((const char *)(w + (PREFETCH_ROWS + r) * K + k), _MM_HINT_T0);
            for (int r = 0; r < 8; r++) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + r * K + k)));
                const float sc = per_channel ? sx : sx * S[(n + r) * wgroups + wg];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wv, xv)), _mm512_set1_ps(sc), acc[r]);
            }
        }
        for (int r = 0; r < 8; r++)
            y[n + r] = _mm512_reduce_add_ps(acc[r]) * (per_channel ? S[n + r] : 1.0f) + (bias ? bias[n + r] : 0.0f);
    }
    if (n < n1) gemv1_i8_madd(xq, xs, K, W, S, G, bias, y, n, n1, N);  /* leftover rows */
}
#endif
#endif

#ifdef __AVX512F__
/* Float32 weights in panels of 32 output columns, [ceil(N / 32)][K][32] (zero columns past N): a
 * row of a panel is two zmm vectors, so a tile of R rows of x times a panel is R broadcasts and 2R
 * FMAs per input column into 2R accumulators held in registers, without the horizontal sums of a
 * dot product. One layout serves every batch size: at one row it streams the weight once (as the
 * row-major loops do), at 32 rows it is the register-blocked GEMM that the per-row dot products
 * are not. Prefetching: a lone tile streams its panel PANEL_PREFETCH floats ahead (a thread's panels
 * follow each other, so that runs into its next panel); with several tiles each fetches every
 * tiles-th row of the next panel, so the DRAM traffic spreads over the tiles while they find the
 * current panel in L1/L2. (Past the last panel these prefetches point beyond the weight: prefetch
 * instructions do not fault.) */
#define PANEL 32
#define PANEL_ROWS 12      /* most rows per tile: 24 accumulators + 2 weight vectors of 32 zmm */
#define PANEL_PREFETCH 512 /* floats ahead in a panel streamed by a single tile: 2 KiB, 16 input columns */
/* One register tile of R rows over one float32 panel (WT float, LOAD _mm512_loadu_ps): a panel row is 32
 * weights, two zmm vectors. */
#define PANEL_TILE_T(R, SUFFIX, WT, LOAD)                                                                     \
    static __attribute__((noinline)) void panel_tile##SUFFIX##_##R(const float *x, int64_t K, const WT *P,    \
                                                                   float *out, const WT *next,                \
                                                                   int64_t phase, int64_t tiles) {            \
        __m512 a[R], b[R];                                                                                    \
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();                                        \
        for (int64_t k = 0, turn = phase; k < K; k++) {                                                       \
            const WT *w = P + PANEL * k;                                                                      \
            /* one tile: stream this panel, PANEL_PREFETCH floats' worth of bytes ahead (into the next panel \
               at the end); several: each tile fetches its share of the next panel's rows (every tiles-th), \
               so the DRAM traffic spreads over all of them instead of stalling the first */                \
            const WT *ahead = tiles == 1 ? w + PANEL_PREFETCH * 4 / sizeof(WT) : turn == 0 ? next + PANEL * k \
                                                                                          : NULL;             \
            if (ahead) {                                                                                      \
                __builtin_prefetch(ahead, 0, 3);                                                              \
                __builtin_prefetch(ahead + 16, 0, 3);                                                         \
            }                                                                                                 \
            turn = turn + 1 == tiles ? 0 : turn + 1;                                                          \
            const __m512 w0 = LOAD(w), w1 = LOAD(w + 16);                                                     \
            for (int r = 0; r < R; r++) {                                                                     \
                const __m512 xr = _mm512_set1_ps(x[r * K + k]);                                               \
                a[r] = _mm512_fmadd_ps(xr, w0, a[r]);                                                         \
                b[r] = _mm512_fmadd_ps(xr, w1, b[r]);                                                         \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++) {                                                                         \
            _mm512_storeu_ps(out + PANEL * r, a[r]);                                                          \
            _mm512_storeu_ps(out + PANEL * r + 16, b[r]);                                                     \
        }                                                                                                     \
    }
#define PANEL_TILE(R) PANEL_TILE_T(R, , float, _mm512_loadu_ps)
PANEL_TILE(1)
PANEL_TILE(2)
PANEL_TILE(3)
PANEL_TILE(4)
PANEL_TILE(5)
PANEL_TILE(6)
PANEL_TILE(7)
PANEL_TILE(8)
PANEL_TILE(9)
PANEL_TILE(10)
PANEL_TILE(11)
PANEL_TILE(12)

typedef void (*panel_tile_fn)(const float *, int64_t, const float *, float *, const float *, int64_t, int64_t);
static const panel_tile_fn panel_tiles[PANEL_ROWS + 1] = {
    NULL, panel_tile_1, panel_tile_2, panel_tile_3, panel_tile_4, panel_tile_5, panel_tile_6,
    panel_tile_7, panel_tile_8, panel_tile_9, panel_tile_10, panel_tile_11, panel_tile_12};

/* bfloat16 weights in paired panels, [ceil(N / 32)][ceil(K / 2)][32][2] of 16-bit values: for each pair of input
 * columns (k, k + 1) a panel holds, per output column, its two weights side by side in one 32-bit lane, so a
 * panel's pair row is two zmm vectors of 16 columns each (pair_panels_bf16 in kernels/cpu_decode_stack.py makes
 * them; zero weights past N and, for odd K, past K). Two ways to multiply them:
 *  - widened (panel_tile_bf16): a lane's low half shifted up is the k weight as a float32, its high half masked
 *    is the k + 1 weight (a bf16 value is the top half of a float32: exact), and the tile runs float32 FMAs on
 *    the float32 activations in the same order as the float32 panels: the result is float32 arithmetic on
 *    bf16-rounded weights, reading half the bytes;
 *  - bf16 dot products (panel_tile_dp, AVX512-BF16 builds): the activations rounded to bf16 pairs once per
 *    call (pair_rows_bf16), and one vdpbf16ps per 16 columns multiplies both columns of a pair into float32
 *    sums, half the instructions of the widened tile. Used for steps of at least DP_MIN_ROWS rows, where the
 *    FMAs, not the weight bytes, bound the step; smaller steps keep float32 activations, which cost nothing
 *    there. */
#ifndef DP_MIN_ROWS
#define DP_MIN_ROWS 8
#endif
#define PAIR_PREFETCH 1024 /* 16-bit values ahead in a paired panel streamed by a single tile: 2 KiB */
#define PAIR_TILE_PREFETCH                                                                                    \
    const uint16_t *ahead = tiles == 1 ? w + PAIR_PREFETCH : turn == 0 ? next + 2 * PANEL * kk : NULL;         \
    if (ahead) {                                                                                              \
        __builtin_prefetch(ahead, 0, 3);                                                                      \
        __builtin_prefetch(ahead + 32, 0, 3);                                                                 \
    }                                                                                                         \
    turn = turn + 1 == tiles ? 0 : turn + 1;
#define PANEL_TILE_BF16(R)                                                                                    \
    static __attribute__((noinline)) void panel_tile_bf16_##R(const float *x, int64_t K, const uint16_t *P,  \
                                                              float *out, const uint16_t *next, int64_t phase, \
                                                              int64_t tiles) {                                \
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                             \
        __m512 a[R], b[R];                                                                                    \
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();                                        \
        const int64_t pairs = (K + 1) / 2;                                                                    \
        for (int64_t kk = 0, turn = phase; kk < pairs; kk++) {                                                \
            const uint16_t *w = P + 2 * PANEL * kk;                                                           \
            PAIR_TILE_PREFETCH                                                                                \
            const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 32);                       \
            const __m512 l0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));                                 \
            const __m512 l1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));                                 \
            for (int r = 0; r < R; r++) {                                                                     \
                const __m512 xr = _mm512_set1_ps(x[r * K + 2 * kk]);                                          \
                a[r] = _mm512_fmadd_ps(xr, l0, a[r]);                                                         \
                b[r] = _mm512_fmadd_ps(xr, l1, b[r]);                                                         \
            }                                                                                                 \
            if (2 * kk + 1 < K) {                                                                             \
                const __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));                            \
                const __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));                            \
                for (int r = 0; r < R; r++) {                                                                 \
                    const __m512 xr = _mm512_set1_ps(x[r * K + 2 * kk + 1]);                                  \
                    a[r] = _mm512_fmadd_ps(xr, h0, a[r]);                                                     \
                    b[r] = _mm512_fmadd_ps(xr, h1, b[r]);                                                     \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++) {                                                                         \
            _mm512_storeu_ps(out + PANEL * r, a[r]);                                                          \
            _mm512_storeu_ps(out + PANEL * r + 16, b[r]);                                                     \
        }                                                                                                     \
    }
PANEL_TILE_BF16(1)
PANEL_TILE_BF16(2)
PANEL_TILE_BF16(3)
PANEL_TILE_BF16(4)
PANEL_TILE_BF16(5)
PANEL_TILE_BF16(6)
PANEL_TILE_BF16(7)
PANEL_TILE_BF16(8)
PANEL_TILE_BF16(9)
PANEL_TILE_BF16(10)
PANEL_TILE_BF16(11)
PANEL_TILE_BF16(12)

typedef void (*panel_tile_bf16_fn)(const float *, int64_t, const uint16_t *, float *, const uint16_t *, int64_t,
                                   int64_t);
static const panel_tile_bf16_fn panel_tiles_bf16[PANEL_ROWS + 1] = {
    NULL, panel_tile_bf16_1, panel_tile_bf16_2, panel_tile_bf16_3, panel_tile_bf16_4, panel_tile_bf16_5,
    panel_tile_bf16_6, panel_tile_bf16_7, panel_tile_bf16_8, panel_tile_bf16_9, panel_tile_bf16_10,
    panel_tile_bf16_11, panel_tile_bf16_12};

#ifdef __AVX512BF16__
/* rows x[M][K] as bf16 pairs xp[M][ceil(K / 2)] (round to nearest even; a zero past K for odd K), the
 * activations' side of panel_tile_dp */
static void pair_rows_bf16(const float *x, int64_t M, int64_t K, uint32_t *xp) {
    const int64_t pairs = (K + 1) / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * K;
        uint16_t *dst = (uint16_t *)(xp + m * pairs);
        for (int64_t k = 0; k < 2 * pairs; k += 32) {
            const int64_t left = K - k, room = 2 * pairs - k;
            const __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const __m512 v0 = _mm512_maskz_loadu_ps(lo, src + k), v1 = _mm512_maskz_loadu_ps(hi, src + k + 16);
            const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  /* v0's 16 values first */
            const __mmask32 keep = room >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << room) - 1);
            _mm512_mask_storeu_epi16(dst + k, keep, packed);
        }
    }
}

#define PANEL_TILE_DP(R)                                                                                      \
    static __attribute__((noinline)) void panel_tile_dp_##R(const uint32_t *xp, int64_t pairs, const uint16_t *P, \
                                                            float *out, const uint16_t *next, int64_t phase,  \
                                                            int64_t tiles) {                                  \
        __m512 a[R], b[R];                                                                                    \
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();                                        \
        for (int64_t kk = 0, turn = phase; kk < pairs; kk++) {                                                \
            const uint16_t *w = P + 2 * PANEL * kk;                                                           \
            PAIR_TILE_PREFETCH                                                                                \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);   \
            for (int r = 0; r < R; r++) {                                                                     \
                const __m512bh xr = (__m512bh)_mm512_set1_epi32((int)xp[r * pairs + kk]);                     \
                a[r] = _mm512_dpbf16_ps(a[r], xr, w0);                                                        \
                b[r] = _mm512_dpbf16_ps(b[r], xr, w1);                                                        \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++) {                                                                         \
            _mm512_storeu_ps(out + PANEL * r, a[r]);                                                          \
            _mm512_storeu_ps(out + PANEL * r + 16, b[r]);                                                     \
        }                                                                                                     \
    }
PANEL_TILE_DP(1)
PANEL_TILE_DP(2)
PANEL_TILE_DP(3)
PANEL_TILE_DP(4)
PANEL_TILE_DP(5)
PANEL_TILE_DP(6)
PANEL_TILE_DP(7)
PANEL_TILE_DP(8)
PANEL_TILE_DP(9)
PANEL_TILE_DP(10)
PANEL_TILE_DP(11)
PANEL_TILE_DP(12)

typedef void (*panel_tile_dp_fn)(const uint32_t *, int64_t, const uint16_t *, float *, const uint16_t *, int64_t,
                                 int64_t);
static const panel_tile_dp_fn panel_tiles_dp[PANEL_ROWS + 1] = {
    NULL, panel_tile_dp_1, panel_tile_dp_2, panel_tile_dp_3, panel_tile_dp_4, panel_tile_dp_5, panel_tile_dp_6,
    panel_tile_dp_7, panel_tile_dp_8, panel_tile_dp_9, panel_tile_dp_10, panel_tile_dp_11, panel_tile_dp_12};
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* AMX tiles (tdpbf16ps) for bf16 panels at steps of at least AMX_MIN_ROWS rows (the steps vdpbf16ps would take).
 * One tile multiply is 16 rows x 16 columns x 32 inputs, 16x the multiply-adds of a vdpbf16ps, so the weights'
 * bytes, not the arithmetic, bound such a step again (SmolLM2-135M, 32 rows: 20 ms a step against 60 with
 * vdpbf16ps; docs/cpu.md). The paired panels are already the layout a B tile wants: a pair row of a panel is
 * 32 columns x 2 values, so 16 pair rows of one half of a panel load as a 16 x 64-byte tile with a stride of
 * 128 bytes; the activations, as bf16 pairs (pair_rows_bf16), are the A tiles, padded with zero rows to whole
 * tiles of 16. Tiles 0-3 accumulate (two row blocks x two column halves), 4-5 hold activations, 6-7 weights.
 * Linux grants the 8 KiB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA);
 * without the grant the first tile instruction raises SIGILL, so the library asks once when loaded and keeps
 * the vdpbf16ps tiles where the answer is no. Inputs whose pairs are not whole tiles (K not a multiple of 32)
 * keep them too. */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8
#endif
static int amx_granted = 0, amx_rows = 0; /* amx_rows: the fewest rows that use tiles, 0 = off */
static int64_t amx_calls = 0;            /* projections (per thread) that used tiles: what tests observe */
static void __attribute__((constructor)) amx_ask(void) {
    amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    amx_rows = amx_granted ? AMX_MIN_ROWS : 0;
}
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;
/* every tile 16 rows x 64 bytes; once per projection and thread (the configuration is per thread) */
static void amx_configure(void) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}
static inline int use_amx(int64_t M, int64_t K) { return amx_rows > 0 && M >= amx_rows && ((K + 1) / 2) % 16 == 0; }
/* out[16 or 32][PANEL] = 16 (two = 0) or 32 rows of bf16 pairs xp[.][pairs] times one paired panel P */
static __attribute__((noinline)) void panel_amx(const uint32_t *xp, int64_t pairs, const uint16_t *P, float *out,
                                                int two) {
    const size_t xs = (size_t)pairs * 4, ws = 4 * PANEL;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kp = 0; kp < pairs; kp += 16) {
            const uint16_t *w = P + 2 * PANEL * kp;
            _tile_loadd(6, w, ws);
            _tile_loadd(7, w + 32, ws);
            _tile_loadd(4, xp + kp, xs);
            _tile_loadd(5, xp + 16 * pairs + kp, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, out + 16 * PANEL, 4 * PANEL);
        _tile_stored(3, out + 16 * PANEL + 16, 4 * PANEL);
    } else {
        for (int64_t kp = 0; kp < pairs; kp += 16) {
            const uint16_t *w = P + 2 * PANEL * kp;
            _tile_loadd(6, w, ws);
            _tile_loadd(7, w + 32, ws);
            _tile_loadd(4, xp + kp, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, out, 4 * PANEL);
    _tile_stored(1, out + 16, 4 * PANEL);
}
#endif

/* Rows of bf16-pair scratch a step of M rows needs: whole AMX tiles where tiles may take it. */
static inline int64_t pair_rows_needed(int64_t M) {
#ifdef HAVE_AMX
    if (amx_rows > 0 && M >= amx_rows) return (M + 15) / 16 * 16;
#endif
    return M;
}

/* y[m][n] = x[m] . W[n] (+ bias) with W in float32 panels; the threads split the panels, each panel goes
 * through the rows in tiles of at most PANEL_ROWS, balanced (32 rows: 10 + 11 + 11). */
static void project_panels(const float *x, int64_t M, int64_t K, const float *W, const float *bias, float *y,
                           int64_t N) {
    const int64_t panels = (N + PANEL - 1) / PANEL, tiles = (M + PANEL_ROWS - 1) / PANEL_ROWS;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
            float out[PANEL_ROWS * PANEL];
            panel_tiles[m1 - m0](x + m0 * K, K, W + p * K * PANEL, out, W + (p + 1) * K * PANEL, t, tiles);
            for (int64_t m = m0; m < m1; m++)
                for (int64_t j = 0; j < cols; j++)
                    y[m * N + n0 + j] = out[(m - m0) * PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

/* Whether a step of M rows multiplies bf16 panels with bf16 dot products (panel_tile_dp). */
static inline int use_dp(int64_t M) {
#ifdef __AVX512BF16__
    return M >= DP_MIN_ROWS;
#else
    (void)M;
    return 0;
#endif
}

/* The same with W in paired bf16 panels (widened, or bf16 dot products for steps of at least DP_MIN_ROWS
 * rows, see above). xp: this thread's M * ceil(K / 2) pairs of scratch for the rounded activations (the
 * dot-product path only). */
static void project_panels_bf16(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, float *y,
                                int64_t N, uint32_t *xp) {
    const int64_t panels = (N + PANEL - 1) / PANEL, tiles = (M + PANEL_ROWS - 1) / PANEL_ROWS, pairs = (K + 1) / 2;
    const int64_t stride = 2 * PANEL * pairs; /* 16-bit values per panel */
    const int dp = use_dp(M);
#ifdef HAVE_AMX
    const int amx = use_amx(M, K);
#endif
#ifdef __AVX512BF16__
    if (dp) pair_rows_bf16(x, M, K, xp); /* every thread for itself: M * K values, cheaper than a barrier */
#else
    (void)xp;
#endif
#ifdef HAVE_AMX
    if (amx) {
        memset(xp + M * pairs, 0, (size_t)((pair_rows_needed(M) - M) * pairs) * sizeof(uint32_t));
        amx_configure();
        __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED);
    }
#endif
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
#ifdef HAVE_AMX
        if (amx) {
            float out[32 * PANEL] __attribute__((aligned(64)));
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int64_t m1 = M - m0 < 32 ? M : m0 + 32;
                panel_amx(xp + m0 * pairs, pairs, W + p * stride, out, m1 - m0 > 16);
                for (int64_t m = m0; m < m1; m++)
                    for (int64_t j = 0; j < cols; j++)
                        y[m * N + n0 + j] = out[(m - m0) * PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
            }
            continue;
        }
#endif
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
            float out[PANEL_ROWS * PANEL];
#ifdef __AVX512BF16__
            if (dp)
                panel_tiles_dp[m1 - m0](xp + m0 * pairs, pairs, W + p * stride, out, W + (p + 1) * stride, t, tiles);
            else
#endif
                panel_tiles_bf16[m1 - m0](x + m0 * K, K, W + p * stride, out, W + (p + 1) * stride, t, tiles);
            for (int64_t m = m0; m < m1; m++)
                for (int64_t j = 0; j < cols; j++)
                    y[m * N + n0 + j] = out[(m - m0) * PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
#ifdef HAVE_AMX
    if (amx) _tile_release(); /* after the loop's barrier: a thread's tile state goes back to init */
#endif
}
#endif

/* panel_linear_f32 with paired bfloat16 panels (the LM head of a dtype="bfloat16" model): 0, 1 without AVX-512,
 * 2 when scratch memory runs out. */
int panel_linear_bf16(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, float *y, int64_t N,
                      int num_threads) {
#ifdef __AVX512F__
    if (num_threads < 1) num_threads = 1;
    const size_t per_thread = use_dp(M) ? (size_t)(pair_rows_needed(M) * ((K + 1) / 2) + 16) : 0;
    uint32_t *xp = per_thread ? (uint32_t *)malloc((size_t)num_threads * per_thread * sizeof(uint32_t)) : NULL;
    if (per_thread && !xp) return 2;
#pragma omp parallel num_threads(num_threads)
    {
        int tid = 0;
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        tid = omp_get_thread_num();
#endif
        project_panels_bf16(x, M, K, W, bias, y, N, xp ? xp + (size_t)tid * per_thread : NULL);
    }
    free(xp);
    return 0;
#else
    (void)x, (void)M, (void)K, (void)W, (void)bias, (void)y, (void)N, (void)num_threads;
    return 1;
#endif
}

/* The fewest rows for which bf16 panels multiply in AMX tiles, or 0 where this build or the OS has none, or they
 * are switched off. */
int decode_stack_amx_rows(void) {
#ifdef HAVE_AMX
    return amx_rows;
#else
    return 0;
#endif
}

/* How many projections (counted once per thread) multiplied in AMX tiles since the library was loaded. */
int64_t decode_stack_amx_calls(void) {
#ifdef HAVE_AMX
    return __atomic_load_n(&amx_calls, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* Sets that threshold (0 = off; below DP_MIN_ROWS counts as DP_MIN_ROWS) where tiles were granted; returns it. */
int decode_stack_set_amx_rows(int rows) {
#ifdef HAVE_AMX
    if (amx_granted) amx_rows = rows <= 0 ? 0 : rows < DP_MIN_ROWS ? DP_MIN_ROWS : rows;
    return amx_rows;
#else
    (void)rows;
    return 0;
#endif
}

/* The fewest rows for which bf16 panels use bf16 dot products (vdpbf16ps), or 0 where this build has none. */
int decode_stack_dp_rows(void) {
#ifdef __AVX512BF16__
    return DP_MIN_ROWS;
#else
    return 0;
#endif
}

/* y[M][N] = x[M][K] @ W.T (+ bias) with W in panels, on its own (the LM head): 0, or 1 without AVX-512. */
int panel_linear_f32(const float *x, int64_t M, int64_t K, const float *W, const float *bias, float *y, int64_t N,
                     int num_threads) {
#ifdef __AVX512F__
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    project_panels(x, M, K, W, bias, y, N);
    return 0;
#else
    (void)x, (void)M, (void)K, (void)W, (void)bias, (void)y, (void)N, (void)num_threads;
    return 1;
#endif
}

/* Whether this build reads float32 weights in panels (project_panels): then the caller passes them so. */
int decode_stack_panels(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* A projection inside the parallel region: output columns split over the threads (implicit barrier at the
 * end). */
static void project(const float *x, int64_t M, int64_t K, const void *W, const float *S, int64_t G, int int8,
                    const float *bias, float *y, int64_t N) {
#ifdef __AVX512F__
    if (!int8) {
        project_panels(x, M, K, (const float *)W, bias, y, N);
        return;
    }
#endif
#ifdef __AVX2__
    if (int8 && M == 1 && K % XGROUP == 0 && G % XGROUP == 0) {
        int16_t xq[K];
        float xs[K / XGROUP];
        quantize_x16(x, K, xq, xs);  /* every thread for itself: K values, cheaper than a barrier */
        const int64_t tile = 16, tiles = (N + tile - 1) / tile;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * tile, n1 = n0 + tile < N ? n0 + tile : N;
#ifdef __AVX512BW__
            gemv1_i8_madd512(xq, xs, K, (const int8_t *)W, S, G, bias, y, n0, n1, N);
#else
            gemv1_i8_madd(xq, xs, K, (const int8_t *)W, S, G, bias, y, n0, n1, N);
#endif
        }
        return;
    }
#endif
    const int64_t tile = 16, tiles = (N + tile - 1) / tile;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * tile, n1 = n0 + tile < N ? n0 + tile : N;
#ifdef __AVX2__
        if (M == 1) {
            if (int8) gemv1_rows4(x, K, W, S, G, int8, bias, y, n0, n1);  /* widths not a multiple of 32 */
            else gemv1_f32_rows8(x, K, (const float *)W, bias, y, n0, n1);
            continue;
        }
#endif
        gemv_rows(x, M, K, W, S, G, int8, bias, y, N, n0, n1);
    }
}

/* A 4-bit (B8: 8-bit) projection inside the parallel region: y[m] = x[m][perm] . W[n] (+ bias) with
 * W = (q - zeros) * scales in groups of G input columns, K the input width (x: rows of K floats), Ks = K
 * rounded up to whole groups the stored one, perm the act-order gather (NULL: none). Every thread first
 * copies x for itself into xd (M * Ks floats): gathered by perm, in the order the vector loops read
 * (deinterleave_x, nibbles only), zeros past K; then the threads split the panels of NR output columns
 * (implicit barrier at the end). ps: per-thread panel scratch for blocks of more than DOT_ROWS rows. */
static void project_q4(int B8, const float *x, int64_t M, int64_t K, int64_t G, const uint8_t *packed,
                       const float *S, const float *Z, const int64_t *perm, const float *bias, float *y, int64_t N,
                       float *xd, float *ps) {
    const int64_t Ks = (K + G - 1) / G * G;
#ifdef Q4_AVX2
    const int vec = Ks % 32 == 0 && G % 32 == 0;
#else
    const int vec = 0;
#endif
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * K;
        float *dst = xd + m * Ks;
        if (perm) { /* act-order: the row gathered into the panel scratch first (unused until the panels) */
            for (int64_t k = 0; k < K; k++) ps[k] = src[perm[k]];
            src = ps;
        }
#ifdef Q4_AVX2
        if (vec && !B8) { /* bytes keep column order: only nibbles are read in deinterleave_x's order */
            const int64_t whole = K / 32 * 32;
            if (whole) deinterleave_x(src, K, 1, whole, dst);
            for (int64_t k = whole; k < Ks; k += 32) { /* a partial block of 32, or padding */
                float block[32] = {0};
                if (k < K) memcpy(block, src + k, (size_t)(K - k) * sizeof(float));
                deinterleave_x(block, 32, 1, 32, dst + k);
            }
            continue;
        }
#endif
        memcpy(dst, src, (size_t)K * sizeof(float));
        memset(dst + K, 0, (size_t)(Ks - K) * sizeof(float));
    }
#ifdef __AVX512F__
    if (vec && !B8 && M > DOT_ROWS) {
        /* many rows: two of the kernel's widened 16-column panels side by side make one of PANEL (32) columns,
           which the float32 panels' register tiles (2R accumulators per R rows) run over; the same products
           summed in the same order as the kernel's 16-column tiles */
        const int64_t groups = Ks / G, wide = (N + PANEL - 1) / PANEL, tiles = (M + PANEL_ROWS - 1) / PANEL_ROWS;
        float *wf = ps + 4 * groups * NR;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < wide; p++) {
            const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
            for (int h = 0; h < 2; h++) { /* columns past N: scales and zeros 0, so they widen to 0 */
                float *hs = ps + 2 * h * groups * NR, *hz = hs + groups * NR;
                panel_params(S, Z, n0 + h * NR, N, groups, hs, hz);
                widen_panel4_strided(packed, N, n0 + h * NR, hs, hz, Ks, G, wf + h * NR, PANEL);
            }
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
                float out[PANEL_ROWS * PANEL];
                panel_tiles[m1 - m0](xd + m0 * Ks, Ks, wf, out, wf, t, tiles);
                for (int64_t m = m0; m < m1; m++)
                    for (int64_t j = 0; j < cols; j++)
                        y[m * N + n0 + j] = out[(m - m0) * PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
            }
        }
        return;
    }
#endif
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) q4_panel(B8, vec, xd, Ks, M, packed, S, Z, bias, N, p * NR, Ks, G, y, N, ps);
}

static void rms_norm_row(const float *x, const float *w, float eps, int64_t H, float *out) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) out[i] = w[i] * (x[i] * r);
}

/* rotate-half rope of one head in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static void rope_head(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        const float x1 = x[i], x2 = x[i + h];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + h] = x2 * cos[i + h] + x1 * sin[i + h];
    }
}

/* The query heads of kv heads kvh .. kvh + nkv - 1 (per_kv each) of one row attend over its n cached keys
 * and values: paged_attention.h's loop, shared with the module path's decode kernel. scores: nkv * per_kv *
 * (n + D) floats of scratch. */
static void attend(const layer_t *L, int kv_bf16, const float *qkv_row, float *out_row, int64_t kvh, int64_t nkv,
                   int64_t per_kv, int64_t n, const int64_t *table, int64_t block_size, int64_t kv_heads, int64_t D,
                   float scale, float *scores) {
    const float *q = qkv_row + kvh * per_kv * D;
    float *out = out_row + kvh * per_kv * D;
#define ATTEND(FN, T, DIM) FN(q, D, out, D, (const T *)L->k_cache + kvh * D, (const T *)L->v_cache + kvh * D, table, n, \
                              block_size, kv_heads * D, DIM, per_kv, nkv, scale, scores, 0, 0.0f, NULL)
#define ATTENDS(FN, T)                                             \
    switch (D) { /* the common head sizes get unrolled copies */ \
        case 64: ATTEND(FN, T, 64); break;                         \
        case 128: ATTEND(FN, T, 128); break;                       \
        default: ATTEND(FN, T, D); break;                          \
    }
    if (kv_bf16) {
        ATTENDS(decode_item_bf16, uint16_t)
    } else {
        ATTENDS(decode_item, float)
    }
#undef ATTENDS
#undef ATTEND
}

static void add_rows(float *x, const float *d, int64_t count) {
#pragma omp simd
    for (int64_t i = 0; i < count; i++) x[i] += d[i];
}

/* kind: 0 float32 weights (panels on AVX-512 builds, else row-major), 1 int8 with scales, 2 4-bit with scales
 * and zeros (project_q4; at most MB rows), 3 bfloat16 panels (AVX-512 builds; project_panels_bf16), 4 unsigned
 * 8-bit codes with scales and zeros (project_q4 on bytes; at most MB rows). group: values per scale, 0 = one
 * group per row. Kinds 2 and 4 take act-order layers: a layer's NAME_perm gathers its input first.
 * kv_bf16: the KV caches hold bfloat16 values (written rounded to nearest even, widened as read), else float32.
 * Returns 0 on success, 1 if scratch memory could not be allocated, 2 for a bad position or length, 3 for
 * too many rows (4 bits) or an unknown kind.
 *
 * Threads: the projections' rows and the attention's (row, kv head) pairs are split over the threads;
 * everything per row that is cheap (norms, residual adds, SiLU) every thread computes for itself on
 * private copies of the hidden state, which saves a barrier each. Five barriers per layer remain
 * (after each projection and after attention): under CPU oversubscription every barrier waits for
 * the slowest thread, so fewer is better. */
int decode_stack_f32(const layer_t *layers, int64_t num_layers, int kind, int64_t group, float *hidden, int64_t M,
                     const float *final_norm, float eps, int64_t H, int64_t I, int64_t num_heads, int64_t kv_heads,
                     int64_t D, const int64_t *positions, const float *cos_table, const float *sin_table,
                     int64_t max_positions, const int64_t *slots, const int64_t *block_tables, int64_t table_stride,
                     const int64_t *seq_lens, int64_t block_size, float scale, int num_threads, int chained,
                     int kv_bf16) {
    const int64_t Q = num_heads * D, KV = kv_heads * D, QKV = Q + 2 * KV, per_kv = num_heads / kv_heads;
    int64_t longest = 1;
    for (int64_t m = 0; m < M; m++) {
        if (positions[m] < 0 || positions[m] >= max_positions || seq_lens[m] < 1 || seq_lens[m] > max_positions)
            return 2;
        if (seq_lens[m] > longest) longest = seq_lens[m];
    }
#ifndef __AVX512F__
    if (kind == 3) return 3; /* bfloat16 panels need AVX-512 */
#endif
    if (kind < 0 || kind > 4 || ((kind == 2 || kind == 4) && M > MB)) return 3;
    if (num_threads < 1) num_threads = 1;
    const int int8 = kind == 1, q4 = kind == 2 || kind == 4, b8 = kind == 4, bf16 = kind == 3;
    /* group: 0 = one scale per output channel (the group is the whole input row) */
    const int64_t g_h = group ? group : H, g_q = group ? group : Q, g_i = group ? group : I;
#define ROUND16(n) (((size_t)(n) + 15) / 16 * 16) /* floats: keeps every buffer 64-byte aligned */
    /* 4 bits: each thread's reordered input (M rows of the widest stored input) and panel scratch */
    size_t xd_floats = 0, ps_floats = 0;
    if (q4) {
        const int64_t widths[3] = {H, Q, I}, groups_of[3] = {g_h, g_q, g_i};
        for (int i = 0; i < 3; i++) {
            const int64_t Ks = (widths[i] + groups_of[i] - 1) / groups_of[i] * groups_of[i];
            const size_t xs = ROUND16(M * Ks), ps = ROUND16(4 * (Ks / groups_of[i]) * NR + Ks * 2 * NR);
            if (xs > xd_floats) xd_floats = xs;
            if (ps > ps_floats) ps_floats = ps;
        }
    }
    const size_t shared = ROUND16(M * (QKV + Q + H + 2 * I));
    /* bf16 dot products: each thread's activations as bf16 pairs (M rows of the widest input) */
    const int64_t widest = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    const size_t xp_floats = bf16 && use_dp(M) ? ROUND16(pair_rows_needed(M) * ((widest + 1) / 2)) : 0;
    /* attention's work items: whole rows (all kv heads: each cache block read front to back) when there are
       enough rows to keep every thread busy, else one kv head of a row, so a few rows still spread */
    const int64_t nkv = M >= 4 * (int64_t)num_threads ? kv_heads : 1, items = M * (kv_heads / nkv);
    const size_t private_floats =
        ROUND16(M * (2 * H + I) + nkv * per_kv * (longest + D)) + xd_floats + ps_floats + xp_floats;
    float *scratch = (float *)aligned_alloc(64, (shared + (size_t)num_threads * private_floats) * sizeof(float));
    if (!scratch) return 1;
    float *qkv = scratch, *attn = qkv + M * QKV, *delta = attn + M * Q, *gate_up = delta + M * H;

#pragma omp parallel num_threads(num_threads)
    {
        int tid = 0;
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        tid = omp_get_thread_num();
#endif
        float *mine = scratch + shared + (size_t)tid * private_floats;
        float *x = mine, *normed = x + M * H, *act = normed + M * H, *scores = act + M * I;
        float *xd = mine + (private_floats - xd_floats - ps_floats - xp_floats), *ps = xd + xd_floats;
        uint32_t *xp = (uint32_t *)(ps + ps_floats);
        (void)xd, (void)ps, (void)xp;
        memcpy(x, hidden, (size_t)(M * H) * sizeof(float));
/* projection NAME of layer L: y[M][N] = x[M][K] . W.T (+ bias), by the weights' kind */
#ifdef __AVX512F__
#define PROJECT_BF16(X, K, NAME, BIAS, Y, N) if (bf16) project_panels_bf16(X, M, K, (const uint16_t *)L->NAME, BIAS, Y, N, xp); else
#else
#define PROJECT_BF16(X, K, NAME, BIAS, Y, N)
#endif
#define PROJECT(X, K, NAME, G, BIAS, Y, N)                                                                         \
    PROJECT_BF16(X, K, NAME, BIAS, Y, N)                                                                           \
    if (q4) project_q4(b8, X, M, K, G, (const uint8_t *)L->NAME, L->NAME##_scales, L->NAME##_zeros, L->NAME##_perm, BIAS, \
                      Y, N, xd, ps);                                                                               \
    else project(X, M, K, L->NAME, L->NAME##_scales, G, int8, BIAS, Y, N);
        for (int64_t l = 0; l < num_layers; l++) {
            const layer_t *L = &layers[l];
            for (int64_t m = 0; m < M; m++) rms_norm_row(x + m * H, L->input_norm, eps, H, normed + m * H);
            PROJECT(normed, H, qkv, g_h, L->qkv_bias, qkv, QKV);
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++) {
                /* one row's kv heads kv0 .. kv0 + nkv - 1: rope and cache their keys/values, then their query
                   heads attend (a row reads only its own new keys, written just above by this item) */
                const int64_t m = item / (kv_heads / nkv), kv0 = item % (kv_heads / nkv) * nkv;
                float *row = qkv + m * QKV;
                const float *c = cos_table + positions[m] * D, *s = sin_table + positions[m] * D;
                for (int64_t kvh = kv0; kvh < kv0 + nkv; kvh++) {
                    float *k = row + Q + kvh * D;
                    rope_head(k, c, s, D);
                    for (int64_t h = kvh * per_kv; h < (kvh + 1) * per_kv; h++) rope_head(row + h * D, c, s, D);
                    store_kv_row(L->k_cache, kv_bf16, slots[m] * KV + kvh * D, k, D);
                    store_kv_row(L->v_cache, kv_bf16, slots[m] * KV + kvh * D, row + Q + KV + kvh * D, D);
                }
                if (!chained)
                    attend(L, kv_bf16, row, attn + m * Q, kv0, nkv, per_kv, seq_lens[m], block_tables + m * table_stride,
                           block_size, kv_heads, D, scale, scores);
            }
            if (chained) {
                /* rows are consecutive positions of the same sequences (a speculative verification):
                   a row reads the keys/values its predecessors wrote above, so every row's cache
                   write completes (the barrier ending the loop above) before any row attends */
#pragma omp for schedule(static)
                for (int64_t task = 0; task < M * kv_heads; task++) {
                    const int64_t m = task / kv_heads, kvh = task % kv_heads;
                    attend(L, kv_bf16, qkv + m * QKV, attn + m * Q, kvh, 1, per_kv, seq_lens[m],
                           block_tables + m * table_stride, block_size, kv_heads, D, scale, scores);
                }
            }
            PROJECT(attn, Q, o, g_q, NULL, delta, H);
            for (int64_t m = 0; m < M; m++) {
                add_rows(x + m * H, delta + m * H, H);
                rms_norm_row(x + m * H, L->post_norm, eps, H, normed + m * H);
            }
            PROJECT(normed, H, gate_up, g_h, NULL, gate_up, 2 * I);
            for (int64_t m = 0; m < M; m++) {
                const float *g = gate_up + m * 2 * I, *u = g + I;
                float *a = act + m * I;
#pragma omp simd
                for (int64_t i = 0; i < I; i++) a[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
            }
            /* every thread has read gate_up before anyone overwrites delta: delta was last read
               before the gate_up projection's barrier */
            PROJECT(act, I, down, g_i, NULL, delta, H);
            for (int64_t m = 0; m < M; m++) add_rows(x + m * H, delta + m * H, H);
        }
        if (tid == 0)
            for (int64_t m = 0; m < M; m++) rms_norm_row(x + m * H, final_norm, eps, H, hidden + m * H);
    }
#undef PROJECT
#undef PROJECT_BF16
#undef ROUND16
    free(scratch);
    return 0;
}
