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

#include "paged_attention.h"
#include "scratch.h"

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 if a sequence is longer than
 * its block table row covers (table_width * block_size tokens). `window` > 0: each query sees only
 * the last `window` positions (a sliding-window layer), and only the blocks holding them are read;
 * `softcap` > 0: tanh soft-capping of the scores; `sinks` (NULL: none): [num_heads] logits that join each
 * head's softmax denominator (gpt-oss); `kv_bf16`: the caches hold bfloat16 values (else float32). */
int paged_decode_f32(const float *q, int64_t q_tok_stride, int64_t q_head_stride,
                     float *out, int64_t out_tok_stride, int64_t out_head_stride,
                     const void *k_cache, const void *v_cache, int64_t block_size,
                     int64_t num_kv_heads, int64_t head_dim, int64_t num_heads,
                     const int64_t *block_tables, int64_t table_stride, int64_t table_width, const int64_t *seq_lens,
                     const int64_t *rows, const int64_t *seqs, int64_t num_decodes,
                     float scale, int num_threads, int64_t window, float softcap, const float *sinks,
                     int kv_bf16) {
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
        const int64_t row = rows[d], seq = seqs[d], full_len = seq_lens[seq];
        /* a window: start at the block holding its first key, and hide that block's earlier keys */
        const int64_t first = window > 0 && full_len > window ? full_len - window : 0;
        const int64_t skipped = first - first % block_size, hidden = first - skipped, len = full_len - skipped;
        float *scores = scratch_floats((size_t)(nkv * group * (len + head_dim)));
        if (!scores) { failed = 1; continue; }
        const float *qh = q + row * q_tok_stride + kv0 * group * q_head_stride;
        float *oh = out + row * out_tok_stride + kv0 * group * out_head_stride;
        const int64_t *table = block_tables + seq * table_stride + skipped / block_size;
        const float *item_sinks = sinks ? sinks + kv0 * group : NULL;
#define DECODE_ITEM(FN, T, D) FN(qh, q_head_stride, oh, out_head_stride, (const T *)k_cache + kv0 * head_dim,     \
                                 (const T *)v_cache + kv0 * head_dim, table, len, block_size, token_stride, D, group, \
                                 nkv, scale, scores, hidden, softcap, item_sinks)
#define DECODE_ITEMS(FN, T)                                                    \
        switch (head_dim) {  /* the common head sizes get unrolled copies */ \
            case 64: DECODE_ITEM(FN, T, 64); break;                             \
            case 128: DECODE_ITEM(FN, T, 128); break;                           \
            default: DECODE_ITEM(FN, T, head_dim); break;                       \
        }
        if (kv_bf16) {
            DECODE_ITEMS(decode_item_bf16, uint16_t)
        } else {
            DECODE_ITEMS(decode_item, float)
        }
#undef DECODE_ITEMS
#undef DECODE_ITEM
    }
    return failed;
}
