/* Multi-LoRA for the CPU path: adds every token's adapter delta, y[row] += B[slot] (A[slot] x[row]),
 * for one projection (one part of a fused projection: the delta lands at a column offset of y).
 *
 * Tokens come grouped by slot, so consecutive tokens reuse the same A and B from cache. B is stored
 * transposed ([rank, out] per slot), which turns the expand into rank vectorized row updates instead
 * of one reduction per output element. Ranks below the stack's max_rank are zero-padded; each slot's
 * real rank (0 when the adapter does not target this projection) bounds the loops.
 * Built and loaded like paged_decode.c (asyncllm/kernels/cpu_build.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scratch.h"

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int lora_apply_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t y_offset,
                   const float *a_stack, const float *bt_stack, const int64_t *slot_ranks, int64_t max_rank,
                   int64_t in_features, int64_t out_features, const int64_t *rows, const int64_t *slots,
                   int64_t n, int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= 4) reduction(| : failed)
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = slots[i], rank = slot_ranks[slot];
        if (rank == 0) continue;
        float *z = scratch_floats((size_t)(max_rank + out_features));
        if (!z) { failed = 1; continue; }
        float *delta = z + max_rank;
        const float *xr = x + rows[i] * x_stride;
        const float *a = a_stack + slot * max_rank * in_features;
        const float *bt = bt_stack + slot * max_rank * out_features;
        for (int64_t r = 0; r < rank; r++) {
            const float *ar = a + r * in_features;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < in_features; k++) acc += ar[k] * xr[k];
            z[r] = acc;
        }
        memset(delta, 0, (size_t)out_features * sizeof(float));
        for (int64_t r = 0; r < rank; r++) {
            const float *br = bt + r * out_features, zr = z[r];
#pragma omp simd
            for (int64_t o = 0; o < out_features; o++) delta[o] += zr * br[o];
        }
        /* the delta is summed apart, then added once: the rounding of y + (z @ B.T) */
        float *yr = y + rows[i] * y_stride + y_offset;
#pragma omp simd
        for (int64_t o = 0; o < out_features; o++) yr[o] += delta[o];
    }
    return failed;
}
