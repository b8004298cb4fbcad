/* Weight-only 4-bit (and 8-bit) group-quantized linear layers for the CPU path (GPTQ / AWQ /
 * compressed-tensors after kernels/quant_linear.py brings them to one layout):
 *     y[M, N] = x[M, K] @ W.T (+ bias),   W[n][k] = (q[n][k] - zeros[n][k / G]) * scales[n][k / G]
 * float32 activations and output; q are unsigned nibbles packed two per byte, row-major [N][K / 2]
 * (low nibble: column 2j, high nibble: column 2j + 1), or bytes [N][K] with 8 bits (uint8_linear_f32);
 * scales and zeros are float32 [N][K / G].
 *
 * The weight is read in that packed layout (the layer's ``packed`` buffer) and never widened to a
 * full-size float copy: each weight is dequantized as (float(q) - zero) * scale, rounded exactly as
 * the torch reference (dequantize_groups) rounds it, in registers or in a per-thread panel scratch,
 * so the results differ from the reference's only by the order of the float32 sums.
 * Output columns are handled in panels of 16; threads split the panels (OpenMP, num_threads from
 * torch), rows go in blocks of 64.
 *
 * Column order (4 bits). 16 packed bytes hold 32 columns; widened to 16 lanes they give the 16 even
 * columns (low nibbles) and the 16 odd ones (high nibbles). Rather than shuffle every weight back into
 * column order, the vector code reorders x once per call: per block of 32 columns the even ones
 * first, then the odd ones (``deinterleave_x``), and sums in that order. 8 bits keep column order.
 *
 * - A block of up to DOT_ROWS rows (decode) streams the packed weight: per step, 32 columns of J weight
 *   rows. With AVX-512 each nibble is looked up in a 16-entry table of its row and group,
 *   (i - zero) * scale for i = 0..15 (one vpermps per 16 weights, which only reads the index's low 4
 *   bits: the low nibbles need no mask, the high ones one shift); with AVX2, and for bytes, it is
 *   masked, converted and dequantized (sub, mul). The widened vectors are FMA'd into partial dot
 *   products with the tile's x rows (1 row x 8 weight rows, 2-3 x 4, 4-6 x 2), summed across lanes at
 *   the end. Each step prefetches the matching bytes of the next J rows, as int8_linear.c does. At one
 *   row this reads half a byte per weight plus the group's scale and zero: an eighth of a float32
 *   weight. (Converting the nibbles, sub and mul, instead of the table measured ~25% slower at one
 *   row; broadcasting the 16 bytes and shifting per lane instead of widening them was no faster:
 *   vpermps, one per 16 weights, seems to bound it.)
 * - A larger block widens the panel once into per-thread scratch, transposed to K x 16 floats (16x16
 *   byte transposes of the packed rows, so that a vector holds one column of 16 weight rows, then
 *   (q - zero) * scale with the panel's per-group zero and scale vectors), and runs the float
 *   micro-kernel of int8_linear.c over it (6x16 with AVX2, 12x16 with AVX-512), so each weight is
 *   dequantized once per 64 rows. The scratch is 64 * K bytes per thread (128 KiB at K = 2048).
 *
 * The vector code needs K and G to be multiples of 32 (the wrapper checks and falls back to torch
 * otherwise); other shapes, and machines without AVX2/FMA, use portable scalar loops in column order.
 * Built and loaded like int8_linear.c (cpu_build.py).
 */
#include "int4_tiles.h"


/* Which code this build runs: 2 AVX-512, 1 AVX2/FMA, 0 portable loops (for the tests and benchmarks). */
int int4_linear_isa(void) {
#if defined(Q4_AVX512)
    return 2;
#elif defined(Q4_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y[m][n] = sum_k x[m][k] * (q[n][k] - zeros[n][k / G]) * scales[n][k / G] (+ bias[n]) for m < M, n < N, with
 * q of B8 ? 8 : 4 bits. x: rows of x_stride floats; packed: [N][K / 2] bytes (4 bits, low nibble first) or
 * [N][K] (8 bits); scales, zeros: [N][K / G]; bias: N floats or NULL; y: rows of y_stride floats.
 * Returns 0, 1 if scratch memory ran out, 2 for bad shapes (K odd with 4 bits, G not dividing K). */
static int group_linear(const int B8, const float *x, int64_t x_stride, int64_t M, const uint8_t *packed,
                        const float *scales, const float *zeros, const float *bias, int64_t N, int64_t K, int64_t G,
                        float *y, int64_t y_stride, int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || (!B8 && K % 2) || G <= 0 || K % G) return 2;
    const int64_t panels = (N + NR - 1) / NR, groups = K / G, blocks = (M + MB - 1) / MB;
    const int64_t work = blocks * panels;
    const float *xv = x; /* the x the kernels read: the reordered copy for the 4-bit vector code */
    int64_t xvs = x_stride;
#ifdef Q4_AVX2
    const int vec = K % 32 == 0 && G % 32 == 0;
#else
    const int vec = 0;
#endif
#ifdef Q4_AVX2
    if (vec && !B8) {
        float *xd = aligned_scratch(&xbuf, (size_t)(M * K));
        if (!xd) return 1;
        deinterleave_x(x, x_stride, M, K, xd);
        xv = xd;
        xvs = K;
    }
#endif
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= (1 << 17) && work > 1) \
    reduction(| : failed)
    for (int64_t t = 0; t < work; t++) {
        const int64_t b = t / panels, p = t % panels, n0 = p * NR;
        const int64_t m_begin = b * MB, m_end = m_begin + MB < M ? m_begin + MB : M, rows = m_end - m_begin;
        float *ps = NULL;
        if (rows > DOT_ROWS) {
            ps = aligned_scratch(&panelbuf, (size_t)(2 * groups * NR + K * NR));
            if (!ps) { failed = 1; continue; }
        }
        q4_panel(B8, vec, xv + m_begin * xvs, xvs, rows, packed, scales, zeros, bias, N, n0, K, G,
                 y + m_begin * y_stride, y_stride, ps);
    }
    return failed;
}

int int4_linear_f32(const float *x, int64_t x_stride, int64_t M, const uint8_t *packed, const float *scales,
                    const float *zeros, const float *bias, int64_t N, int64_t K, int64_t G, float *y,
                    int64_t y_stride, int num_threads) {
    return group_linear(0, x, x_stride, M, packed, scales, zeros, bias, N, K, G, y, y_stride, num_threads);
}

int uint8_linear_f32(const float *x, int64_t x_stride, int64_t M, const uint8_t *packed, const float *scales,
                     const float *zeros, const float *bias, int64_t N, int64_t K, int64_t G, float *y,
                     int64_t y_stride, int num_threads) {
    return group_linear(1, x, x_stride, M, packed, scales, zeros, bias, N, K, G, y, y_stride, num_threads);
}
