/* The 6x16 float micro-kernel over a widened panel (AVX2 + FMA), shared by int8_linear.c and int4_tiles.h:
 * out[m][0..15] = sum_k x[m][k] * wf[k][0..15], wf a panel of NR (16) columns widened to float32 in cache.
 * The including file defines NR and includes <immintrin.h> with AVX2 enabled. */
#ifndef ASYNCLLM_FLOAT_TILES_AVX2_H
#define ASYNCLLM_FLOAT_TILES_AVX2_H

#define ACC_ROW(m) __m256 a##m##_0 = _mm256_setzero_ps(), a##m##_1 = _mm256_setzero_ps();
#define ROW_FMA(m, kk)                                                        \
    if (R > m) {                                                              \
        const __m256 xv = _mm256_broadcast_ss(x + m * xs + (kk));             \
        a##m##_0 = _mm256_fmadd_ps(xv, w0, a##m##_0);                         \
        a##m##_1 = _mm256_fmadd_ps(xv, w1, a##m##_1);                         \
    }
#define FLOAT_STEP(kk)                                                        \
    {                                                                         \
        __m256 w0 = _mm256_loadu_ps(wf + (kk) * NR), w1 = _mm256_loadu_ps(wf + (kk) * NR + 8); \
        __asm__("" : "+x"(w0), "+x"(w1)); /* load once, not as an operand of every FMA */ \
        ROW_FMA(0, kk) ROW_FMA(1, kk) ROW_FMA(2, kk) ROW_FMA(3, kk) ROW_FMA(4, kk) ROW_FMA(5, kk) \
    }
#define STORE_ROW(m)                                                          \
    if (R > m) {                                                              \
        _mm256_storeu_ps(out + m * NR, a##m##_0);                             \
        _mm256_storeu_ps(out + m * NR + 8, a##m##_1);                         \
    }

/* out[m][0..15] = sum_k x[m][k] * wf[k][0..15] for R (<= MR, a literal constant) rows */
static inline __attribute__((always_inline)) void tile_float(
        const int R, const float *x, int64_t xs, const float *wf, int64_t K, float *out) {
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        FLOAT_STEP(k) FLOAT_STEP(k + 1)
    }
    for (; k < K; k++) FLOAT_STEP(k)
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}

#define FLOAT_TILE(r) case r: tile_float(r, x, xs, wf, K, out); break;

/* (unused where the AVX-512 kernel replaces it) */
__attribute__((noinline, unused)) static void tile_from_float(int rows, const float *x, int64_t xs, const float *wf,
                                                              int64_t K, float *out) {
    switch (rows) {
        FLOAT_TILE(1) FLOAT_TILE(2) FLOAT_TILE(3) FLOAT_TILE(4) FLOAT_TILE(5) FLOAT_TILE(6)
        default: break;
    }
}

#endif /* ASYNCLLM_FLOAT_TILES_AVX2_H */
