/* Paged attention for decoding tokens on the CPU: one query token per sequence, keys and values
 * read in place from the paged KV cache (no gather into a contiguous copy first).
 *
 * Work is split over (sequence, KV head) pairs with OpenMP. Each pair computes the scores of the
 * query heads that share its KV head (grouped-query attention) against every cached key, a
 * softmax, then the weighted sum of the values. Every key and value row is therefore read once
 * per KV head, which is what makes this memory-bound loop cheap: the torch reference first copies
 * the blocks (index_select), then reads the copy again in SDPA.
 *
 * Built at run time by asyncllm/kernels/cpu_build.py and called through ctypes: the interface is
 * plain pointers, strides in elements, and int64 index arrays.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scratch.h"

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

/* One work item: a decode's query heads that share KV heads [kv0, kv0 + nkv). Always inlined into
 * call sites with a constant head_dim, so the compiler unrolls the dot products.
 * Rows of query head qh = (kv0 + j) * group + g go to scores[(j * group + g) * len + t]; the
 * heads' outputs are accumulated in acc[(j * group + g) * head_dim + i]. */
static inline __attribute__((always_inline)) void decode_item(
        const float *q, int64_t q_head_stride, float *out, int64_t out_head_stride,
        const float *k_base, const float *v_base, const int64_t *table, int64_t len, int64_t block_size,
        int64_t token_stride, const int64_t head_dim, int64_t group, int64_t nkv, float scale, float *scores) {
    const int64_t rows = nkv * group;
    float *acc = scores + rows * len;
    /* Block by block (no division per token); within a block the tokens' KV heads are contiguous,
     * so the reads stream through memory. */
    for (int64_t start = 0; start < len; start += block_size) {
        const float *k = k_base + table[start / block_size] * block_size * token_stride;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t o = 0; o < n; o++, k += token_stride)
            for (int64_t j = 0; j < nkv; j++)
                for (int64_t g = 0; g < group; g++)
                    scores[(j * group + g) * len + start + o] =
                        VEC_DOT(q + (j * group + g) * q_head_stride, k + j * head_dim, head_dim) * scale;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * len;
        float max = s[0];
#pragma omp simd reduction(max : max)
        for (int64_t t = 1; t < len; t++) max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
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
                    const int64_t n = len - start < block_size ? len - start : block_size;
                    for (int64_t o = 0; o < n; o++, v += token_stride) {
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

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 if a sequence is longer than
 * its block table row covers (table_width * block_size tokens). */
int paged_decode_f32(const float *q, int64_t q_tok_stride, int64_t q_head_stride,
                     float *out, int64_t out_tok_stride, int64_t out_head_stride,
                     const float *k_cache, const float *v_cache, int64_t block_size,
                     int64_t num_kv_heads, int64_t head_dim, int64_t num_heads,
                     const int64_t *block_tables, int64_t table_stride, int64_t table_width, const int64_t *seq_lens,
                     const int64_t *rows, const int64_t *seqs, int64_t num_decodes,
                     float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  /* between consecutive cache slots */
    /* Whole decodes per work item when there are enough of them to keep every thread busy
     * (contiguous reads); otherwise one KV head per item, so a few long sequences still spread. */
    const int64_t nkv = num_decodes >= 4 * (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t per_decode = num_kv_heads / nkv;
    for (int64_t d = 0; d < num_decodes; d++)
        if (seq_lens[seqs[d]] < 1 || seq_lens[seqs[d]] > table_width * block_size) return 2;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t item = 0; item < num_decodes * per_decode; item++) {
        const int64_t d = item / per_decode, kv0 = (item % per_decode) * nkv;
        const int64_t row = rows[d], seq = seqs[d], len = seq_lens[seq];
        float *scores = scratch_floats((size_t)(nkv * group * (len + head_dim)));
        if (!scores) { failed = 1; continue; }
        const float *qh = q + row * q_tok_stride + kv0 * group * q_head_stride;
        float *oh = out + row * out_tok_stride + kv0 * group * out_head_stride;
        const float *k_base = k_cache + kv0 * head_dim, *v_base = v_cache + kv0 * head_dim;
        const int64_t *table = block_tables + seq * table_stride;
#define DECODE_ITEM(D) decode_item(qh, q_head_stride, oh, out_head_stride, k_base, v_base, table, len, \
                                   block_size, token_stride, D, group, nkv, scale, scores)
        switch (head_dim) {  /* the common head sizes get unrolled copies */
            case 64: DECODE_ITEM(64); break;
            case 128: DECODE_ITEM(128); break;
            default: DECODE_ITEM(head_dim); break;
        }
#undef DECODE_ITEM
    }
    return failed;
}
