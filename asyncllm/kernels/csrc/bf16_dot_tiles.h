/* bf16 dot-product pieces of int8_linear.c (dtype="bfloat16" on int8 weights; kept apart for the next quantized kernel): rows
 * and widened 16-column panels rounded to bf16 pairs, and a 12 x 32 register tile over two paired panels (two
 * vdpbf16ps per row and pair of input columns into float32 sums). The including file defines NR (16) and includes
 * <immintrin.h> with AVX512-BF16 enabled. */
#ifndef ASYNCLLM_BF16_DOT_TILES_H
#define ASYNCLLM_BF16_DOT_TILES_H
#include <stdint.h>

#define MR_DP 12 /* most rows per bf16 dot-product tile: 24 accumulators, two weight vectors, one broadcast */

/* rows x[m] (stride xs, K even) as bf16 pairs xp[m][K / 2] (round to nearest even) */
static void pair_rows(const float *x, int64_t xs, int64_t M, int64_t K, uint32_t *xp, int num_threads) {
    const int64_t pairs = K / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * xs;
        uint16_t *dst = (uint16_t *)(xp + m * pairs);
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t left = K - k;
            const __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const __m512 v0 = _mm512_maskz_loadu_ps(lo, src + k), v1 = _mm512_maskz_loadu_ps(hi, src + k + 16);
            const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(v1, v0); /* v0's 16 values first */
            const __mmask32 keep = left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
            _mm512_mask_storeu_epi16(dst + k, keep, packed);
        }
    }
}

/* wp[kk][j] = (bf16(wf[2kk][j]), bf16(wf[2kk + 1][j])) as one 32-bit lane, the low half first: the weights'
 * side of vdpbf16ps for a widened panel's 16 columns */
static void pair_panel(const float *wf, int64_t K, uint32_t *wp) {
    for (int64_t kk = 0; kk < K / 2; kk++) {
        const __m256bh lo = _mm512_cvtneps_pbh(_mm512_loadu_ps(wf + 2 * kk * NR));
        const __m256bh hi = _mm512_cvtneps_pbh(_mm512_loadu_ps(wf + (2 * kk + 1) * NR));
        const __m512i l = _mm512_cvtepu16_epi32((__m256i)lo);
        const __m512i h = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16);
        _mm512_storeu_si512(wp + kk * NR, _mm512_or_si512(l, h));
    }
}

#define DPACC(m) __m512 a##m = _mm512_setzero_ps(), b##m = _mm512_setzero_ps();
#define DPFMA(m)                                                                   \
    if (R > m) {                                                                   \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m * pairs + kk]);  \
        a##m = _mm512_dpbf16_ps(a##m, xv, w0);                                     \
        b##m = _mm512_dpbf16_ps(b##m, xv, w1);                                     \
    }
#define DPSTORE(m)                                       \
    if (R > m) {                                         \
        _mm512_storeu_ps(out + m * 2 * NR, a##m);        \
        _mm512_storeu_ps(out + m * 2 * NR + NR, b##m);   \
    }

/* out[m][0..32) for R rows of bf16 pairs against two paired panels (wp0: columns 0-15, wp1: 16-31) */
static inline __attribute__((always_inline)) void tile_dp(const int R, const uint32_t *xp, int64_t pairs,
                                                          const uint32_t *wp0, const uint32_t *wp1, float *out) {
    DPACC(0) DPACC(1) DPACC(2) DPACC(3) DPACC(4) DPACC(5) DPACC(6) DPACC(7) DPACC(8) DPACC(9) DPACC(10) DPACC(11)
    for (int64_t kk = 0; kk < pairs; kk++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp0 + kk * NR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp1 + kk * NR);
        DPFMA(0) DPFMA(1) DPFMA(2) DPFMA(3) DPFMA(4) DPFMA(5) DPFMA(6) DPFMA(7) DPFMA(8) DPFMA(9) DPFMA(10) DPFMA(11)
    }
    DPSTORE(0) DPSTORE(1) DPSTORE(2) DPSTORE(3) DPSTORE(4) DPSTORE(5)
    DPSTORE(6) DPSTORE(7) DPSTORE(8) DPSTORE(9) DPSTORE(10) DPSTORE(11)
}

#define DP_TILE(r) case r: tile_dp(r, xp, pairs, wp0, wp1, out); break;

__attribute__((noinline)) static void tile_from_pairs(int rows, const uint32_t *xp, int64_t pairs,
                                                      const uint32_t *wp0, const uint32_t *wp1, float *out) {
    switch (rows) {
        DP_TILE(1) DP_TILE(2) DP_TILE(3) DP_TILE(4) DP_TILE(5) DP_TILE(6)
        DP_TILE(7) DP_TILE(8) DP_TILE(9) DP_TILE(10) DP_TILE(11) DP_TILE(12)
        default: break;
    }
}

#endif /* ASYNCLLM_BF16_DOT_TILES_H */
