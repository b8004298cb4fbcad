/* Greedy picks for the CPU path: per row of logits, the first index of the maximum (torch.argmax's
 * choice) and its log-probability under the row's softmax, -log(sum(exp(x - max))). Three passes over
 * a row that stays in L2, instead of torch's argmax + logsumexp + gather over the whole batch.
 * Built and loaded like paged_decode.c (asyncllm/kernels/cpu_build.py).
 */
#include <math.h>
#include <stdint.h>

__attribute__((simd("notinbranch"))) float expf(float);

/* Returns nonzero when a row holds NaN (whose argmax torch defines differently): callers fall back. */
int greedy_pick_f32(const float *logits, int64_t row_stride, int64_t rows, int64_t vocab, int64_t *ids,
                    float *logprobs, int num_threads) {
    int nan_rows = 0;
#pragma omp parallel for num_threads(num_threads) if (rows * vocab >= (1 << 18)) reduction(+ : nan_rows)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * row_stride;
        float max = x[0];
#pragma omp simd reduction(max : max)
        for (int64_t i = 1; i < vocab; i++) max = x[i] > max ? x[i] : max;
        int64_t best = 0;
        while (best < vocab - 1 && x[best] != max) best++;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < vocab; i++) sum += expf(x[i] - max);
        ids[r] = best;
        logprobs[r] = -logf(sum);
        nan_rows += isnan(sum) ? 1 : 0;  /* a NaN anywhere in the row makes the sum NaN */
    }
    return nan_rows;
}
