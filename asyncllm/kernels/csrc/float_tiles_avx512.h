/* The 12x16 float micro-kernel over a widened panel (AVX-512), shared by int8_linear.c and int4_tiles.h:
 * a panel row (16 columns) is one zmm vector, so a tile of up to 12 rows keeps 12 accumulators.
 * The including file defines NR and includes <immintrin.h> with AVX-512 enabled. */
#ifndef ASYNCLLM_FLOAT_TILES_AVX512_H
#define ASYNCLLM_FLOAT_TILES_AVX512_H

#define ACC512(m) __m512 c##m = _mm512_setzero_ps();
#define FMA512(m)                                                             \
    if (R > m) c##m = _mm512_fmadd_ps(_mm512_set1_ps(x[m * xs + k]), w, c##m);
#define STORE512(m) if (R > m) _mm512_storeu_ps(out + m * NR, c##m);

static inline __attribute__((always_inline)) void tile_float512(
        const int R, const float *x, int64_t xs, const float *wf, int64_t K, float *out) {
    ACC512(0) ACC512(1) ACC512(2) ACC512(3) ACC512(4) ACC512(5)
    ACC512(6) ACC512(7) ACC512(8) ACC512(9) ACC512(10) ACC512(11)
    for (int64_t k = 0; k < K; k++) {
        const __m512 w = _mm512_loadu_ps(wf + k * NR);
        FMA512(0) FMA512(1) FMA512(2) FMA512(3) FMA512(4) FMA512(5)
        FMA512(6) FMA512(7) FMA512(8) FMA512(9) FMA512(10) FMA512(11)
    }
    STORE512(0) STORE512(1) STORE512(2) STORE512(3) STORE512(4) STORE512(5)
    STORE512(6) STORE512(7) STORE512(8) STORE512(9) STORE512(10) STORE512(11)
}

#define FLOAT_TILE512(r) case r: tile_float512(r, x, xs, wf, K, out); break;

__attribute__((noinline)) static void tile_from_float512(int rows, const float *x, int64_t xs, const float *wf,
                                                         int64_t K, float *out) {
    switch (rows) {
        FLOAT_TILE512(1) FLOAT_TILE512(2) FLOAT_TILE512(3) FLOAT_TILE512(4) FLOAT_TILE512(5) FLOAT_TILE512(6)
        FLOAT_TILE512(7) FLOAT_TILE512(8) FLOAT_TILE512(9) FLOAT_TILE512(10) FLOAT_TILE512(11) FLOAT_TILE512(12)
        default: break;
    }
}

#endif /* ASYNCLLM_FLOAT_TILES_AVX512_H */
