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

/* The lane sums of eight vectors, in order, as one 8-lane vector: a transposing tree (pairs, then quads,
 * then the 128-bit lanes) costs 3 instructions per pair of inputs, where a horizontal sum of each vector
 * would cost 8 in a chain of dependent shuffles. */
static inline __attribute__((always_inline)) __m256 sum8_lanes(const __m512 *a) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)); /* per 128-bit lane: sums of 4i..4i+3 */
    }
    /* 128-bit lanes [c0.0 + c0.1, c0.2 + c0.3, c1.0 + c1.1, c1.2 + c1.3], then the halves of each input */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 e = _mm512_add_ps(d, _mm512_shuffle_f32x4(d, d, 0xb1)); /* lanes 0 and 2 hold the totals */
    return _mm512_castps512_ps256(_mm512_shuffle_f32x4(e, e, 0x08));
}

#else
#define VEC_DOT(a, b, n) dot((a), (b), (n))
#endif

/* Prefetch one cache row of `width` elements (the 64-byte lines it spans) for reading, into L1. */
#define PREFETCH_ROW(p, width)                                                                                 \
    do {                                                                                                       \
        for (int64_t c_ = 0; c_ < (width); c_ += 64 / (int64_t)sizeof(*(p))) __builtin_prefetch((p) + c_, 0, 3); \
    } while (0)

/* A bfloat16 KV cache (kv_cache_dtype="bfloat16"): values are the upper halves of float32s, so widening is a
 * shift; stores round to nearest even, as torch's conversion does (NaN stays NaN). */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* one cache row written: float32 as it is, or rounded to bf16 */
static inline void store_kv_row(void *cache, int kv_bf16, int64_t offset, const float *src, int64_t n) {
    if (kv_bf16) {
        uint16_t *dst = (uint16_t *)cache + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + offset, src, (size_t)n * sizeof(float));
    }
}

static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * bf16_to_f32(b[i]);
    return acc;
}

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline float dot16_bf16(const float *a, const uint16_t *b, int64_t n) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), load16_bf16(b));
    for (int64_t i = 16; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16_bf16(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}
#define VEC_DOT_BF16(a, b, n) ((n) % 16 == 0 ? dot16_bf16((a), (b), (n)) : dot_bf16((a), (b), (n)))
#else
#define VEC_DOT_BF16(a, b, n) dot_bf16((a), (b), (n))
#endif

/* Tokens of the block starting at token `start` of a `len`-token sequence (0 past its end). */
static inline int64_t block_tokens(int64_t start, int64_t len, int64_t block_size) {
    return start >= len ? 0 : (len - start < block_size ? len - start : block_size);
}

#define ITEM_NAME decode_item
#define KV_T float
#define KV_DOT(a, b, n) VEC_DOT((a), (b), (n))
#define KV_AT(p, i) ((p)[i])
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#include "paged_attention_item.h"
#undef ITEM_NAME
#undef KV_T
#undef KV_DOT
#undef KV_AT
#undef KV_LOAD16

/* the same over a bfloat16 cache: values widened as they are read (half the bytes from DRAM) */
#define ITEM_NAME decode_item_bf16
#define KV_T uint16_t
#define KV_DOT(a, b, n) VEC_DOT_BF16((a), (b), (n))
#define KV_AT(p, i) bf16_to_f32((p)[i])
#define KV_LOAD16(p) load16_bf16(p)
#include "paged_attention_item.h"
#undef ITEM_NAME
#undef KV_T
#undef KV_DOT
#undef KV_AT
#undef KV_LOAD16

#endif
