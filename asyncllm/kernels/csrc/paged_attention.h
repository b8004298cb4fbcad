/* Attention of one query token over its sequence's paged keys and values, for the CPU kernels
 * (paged_decode.c for the decode steps of the module path, decode_stack.c inside its layer loop).
 *
 * The scores of the query heads that share a KV head (grouped-query attention) against every cached
 * key, a softmax, then the weighted sum of the values: every key and value row is read once per KV
 * head. A decode step's cache is far larger than the last-level cache, so keys and values come from
 * DRAM, block by block, and the blocks lie anywhere in the pool: the hardware prefetchers only catch
 * up inside a block. The loops therefore prefetch the next block's rows, one row per row processed
 * (2x faster on a 32-sequence step of SmolLM2 with scattered blocks, 13.4 -> 8.3 ms for 30 layers;
 * a burst of a whole block's prefetches at once stalled on the miss buffers and lost).
 */
#ifndef ASYNCLLM_PAGED_ATTENTION_H
#define ASYNCLLM_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Vector variants of expf from glibc's libmvec; glibc's header only declares them under
 * -ffast-math, which we avoid because it would change rounding everywhere else. */
__attribute__((simd("notinbranch"))) float expf(float);

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX512F__)
/* AVX-512 path (head_dim a multiple of 16): explicit vector code, because the compiler's version
 * of dot() above reduces each 16-lane partial with a long scalar tail. */
#include <immintrin.h>

static inline float dot16(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}
#define VEC_DOT(a, b, n) ((n) % 16 == 0 ? dot16((a), (b), (n)) : dot((a), (b), (n)))

#else
#define VEC_DOT(a, b, n) dot((a), (b), (n))
#endif

/* Prefetch one cache row of `width` floats (the lines it spans) for reading, into L1. */
#define PREFETCH_ROW(p, width)                                                          \
    do {                                                                                \
        for (int64_t c_ = 0; c_ < (width); c_ += 16) __builtin_prefetch((p) + c_, 0, 3); \
    } while (0)

/* Tokens of the block starting at token `start` of a `len`-token sequence (0 past its end). */
static inline int64_t block_tokens(int64_t start, int64_t len, int64_t block_size) {
    return start >= len ? 0 : (len - start < block_size ? len - start : block_size);
}

/* One work item: a decode's query heads that share KV heads [kv0, kv0 + nkv). Always inlined into
 * call sites with a constant head_dim, so the compiler unrolls the dot products.
 * Rows of query head qh = (kv0 + j) * group + g go to scores[(j * group + g) * len + t]; the
 * heads' outputs are accumulated in acc[(j * group + g) * head_dim + i].
 * `hidden`: the first keys the query may not see (a sliding window that starts inside the first
 * block; the caller starts `table` at the window's first block); `softcap` > 0: scores become
 * softcap * tanh(score / softcap) (Gemma 2). Both 0 for plain attention. `sinks` (NULL: none): one
 * logit per output row (gpt-oss's attention sinks) that joins the softmax's denominator, attending to
 * nothing. */
static inline __attribute__((always_inline)) void decode_item(
        const float *q, int64_t q_head_stride, float *out, int64_t out_head_stride,
        const float *k_base, const float *v_base, const int64_t *table, int64_t len, int64_t block_size,
        int64_t token_stride, const int64_t head_dim, int64_t group, int64_t nkv, float scale, float *scores,
        int64_t hidden, float softcap, const float *sinks) {
    const int64_t rows = nkv * group;
    float *acc = scores + rows * len;
    /* Block by block (no division per token); within a block the tokens' KV heads are contiguous,
     * so the reads stream through memory. */
    for (int64_t start = 0; start < len; start += block_size) {
        const float *k = k_base + table[start / block_size] * block_size * token_stride;
        const int64_t n = block_tokens(start, len, block_size);
        const int64_t next_n = block_tokens(start + block_size, len, block_size);
        const float *k_next = next_n ? k_base + table[start / block_size + 1] * block_size * token_stride : k;
        for (int64_t o = 0; o < n; o++, k += token_stride) {
            if (o < next_n) PREFETCH_ROW(k_next + o * token_stride, nkv * head_dim);
            for (int64_t j = 0; j < nkv; j++)
                for (int64_t g = 0; g < group; g++)
                    scores[(j * group + g) * len + start + o] =
                        VEC_DOT(q + (j * group + g) * q_head_stride, k + j * head_dim, head_dim) * scale;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * len;
        if (softcap > 0.0f)
            for (int64_t t = 0; t < len; t++) s[t] = softcap * tanhf(s[t] / softcap);
        for (int64_t t = 0; t < hidden; t++) s[t] = -INFINITY;  /* exp gives 0: outside the window */
        float max = s[hidden];
#pragma omp simd reduction(max : max)
        for (int64_t t = hidden + 1; t < len; t++) max = s[t] > max ? s[t] : max;
        if (sinks && sinks[r] > max) max = sinks[r];
        float sum = sinks ? expf(sinks[r] - max) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && head_dim <= 256) {
        /* One output row at a time with its accumulator in registers (head_dim / 16 vectors); the
         * group's other rows re-read the same values from L2. */
        for (int64_t j = 0; j < nkv; j++)
            for (int64_t g = 0; g < group; g++) {
                const float *p = scores + (j * group + g) * len;
                __m512 a[16];
                for (int64_t c = 0; c < head_dim / 16; c++) a[c] = _mm512_setzero_ps();
                for (int64_t start = 0; start < len; start += block_size) {
                    const float *v = v_base + table[start / block_size] * block_size * token_stride + j * head_dim;
                    const int64_t n = block_tokens(start, len, block_size);
                    /* the first of the group's passes reads the values from DRAM: prefetch ahead */
                    const int64_t next_n = g == 0 ? block_tokens(start + block_size, len, block_size) : 0;
                    const float *v_next =
                        next_n ? v_base + table[start / block_size + 1] * block_size * token_stride + j * head_dim : v;
                    for (int64_t o = 0; o < n; o++, v += token_stride) {
                        if (o < next_n) PREFETCH_ROW(v_next + o * token_stride, head_dim);
                        const __m512 w = _mm512_set1_ps(p[start + o]);
                        for (int64_t c = 0; c < head_dim / 16; c++)
                            a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), a[c]);
                    }
                }
                float *dst = out + (j * group + g) * out_head_stride;
                for (int64_t c = 0; c < head_dim / 16; c++) _mm512_storeu_ps(dst + 16 * c, a[c]);
            }
        return;
    }
#endif
    memset(acc, 0, (size_t)(rows * head_dim) * sizeof(float));
    for (int64_t start = 0; start < len; start += block_size) {
        const float *v = v_base + table[start / block_size] * block_size * token_stride;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t o = 0; o < n; o++, v += token_stride)
            for (int64_t j = 0; j < nkv; j++)
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[(j * group + g) * len + start + o];
                    float *a = acc + (j * group + g) * head_dim;
                    const float *vj = v + j * head_dim;
#pragma omp simd
                    for (int64_t i = 0; i < head_dim; i++) a[i] += p * vj[i];
                }
    }
    for (int64_t r = 0; r < rows; r++)
        memcpy(out + r * out_head_stride, acc + r * head_dim, (size_t)head_dim * sizeof(float));
}

#endif
