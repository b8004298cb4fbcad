/* Greedy picks for the CPU path: per row of logits, the first index of the maximum (torch.argmax's
 * choice) and its log-probability under the row's softmax, x[best] - max - log(sum(exp(x - max))).
 * Three passes over a row that stays in L2, instead of torch's argmax + logsumexp + gather over the
 * whole batch. A row may carry a grammar's bitmask (bit set: token allowed): the pick is then the
 * first maximum among allowed tokens, read straight from the bits, while the log-probability stays
 * that of the unmasked distribution (what the engine reports); no bool mask, no masked copy.
 * Built and loaded like paged_decode.c (asyncllm/kernels/cpu_build.py).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

__attribute__((simd("notinbranch"))) float expf(float);

/* mask_rows[r] >= 0: row r is constrained by bitmask row mask_rows[r] (mask_words int32 words per row);
 * mask may be NULL when no row is. Returns nonzero when a row holds NaN (whose argmax torch defines
 * differently): callers fall back. */
int greedy_pick_f32(const float *logits, int64_t row_stride, int64_t rows, int64_t vocab, const int32_t *mask,
                    int64_t mask_words, const int64_t *mask_rows, int64_t *ids, float *logprobs, int num_threads) {
    int nan_rows = 0;
#pragma omp parallel for num_threads(num_threads) if (rows * vocab >= (1 << 18)) reduction(+ : nan_rows)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * row_stride;
        float max = x[0];
#pragma omp simd reduction(max : max)
        for (int64_t i = 1; i < vocab; i++) max = x[i] > max ? x[i] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < vocab; i++) sum += expf(x[i] - max);
        int64_t best = 0;
        if (mask != NULL && mask_rows[r] >= 0) {
            /* first maximum among allowed tokens; token 0 when none is allowed (torch: argmax of all -inf) */
            const uint32_t *bits = (const uint32_t *)(mask + mask_rows[r] * mask_words);
            float best_value = 0.0f;
            int found = 0;
            for (int64_t w = 0; w < mask_words; w++) {
                uint32_t word = bits[w];
                while (word) {
                    const int64_t i = w * 32 + __builtin_ctz(word);
                    word &= word - 1;
                    if (i >= vocab) break;
                    if (!found || x[i] > best_value) { best = i; best_value = x[i]; found = 1; }
                }
            }
        } else {
            while (best < vocab - 1 && x[best] != max) best++;
        }
        ids[r] = best;
        logprobs[r] = x[best] - max - logf(sum);
        nan_rows += isnan(sum) ? 1 : 0;  /* a NaN anywhere in the row makes the sum NaN */
    }
    return nan_rows;
}
