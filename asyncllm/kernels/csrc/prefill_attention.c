/* Causal attention of prefill chunks that have no cached prefix (each sequence attends to its own new rows), for
 * dtype="bfloat16" on CPUs with AVX512-BF16 but no AMX tiles, where torch's flash SDPA multiplies in float32
 * (5-8 ms per layer for 16 x 128 tokens and 9 heads on two Zen 4 cores, 10-13% of a prefill step).
 *
 * Numbers: keys and values are the bf16 values the cache holds (float32 inputs are rounded to nearest even, as
 * the cache write rounds them); the query stays float32. Scores are float32 FMAs of the query against the keys
 * (exact products: a bf16 key times a float32 query fits an FMA's product), the softmax is float32, and so is the
 * weighted sum of the values: the outputs equal float32 SDPA over the bf16 cache to about 1e-6, summation order.
 * (A bf16 query, as in vdpbf16ps dot products, moved outputs by 1e-3; split into two bf16 parts, by 1e-4.)
 *
 * Work items are (sequence, KV head, block of QB query rows): each lays out the keys its rows can see
 * transposed (kt[dim][key], so that one vector holds 16 keys' values of one dimension) and the values in
 * float32, then runs the query heads that share the KV head, R rows and 32 keys at a time. OpenMP hands items
 * out dynamically (later blocks see more keys). The bf16 rounding uses AVX512-BF16's conversion, hence the guard.
 *
 * Built by asyncllm/kernels/cpu_build.py, called through ctypes (asyncllm/kernels/cpu_prefill_attention.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

__attribute__((simd("notinbranch"))) float expf(float);

#define QB 64 /* query rows per work item */
#define R 4   /* query rows per register tile */

static inline __m512 load_row16(const void *base, int bf16, int64_t offset) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}

/* 16 values as bf16 (round to nearest even), widened back to float32 */
static inline __m512 round16(__m512 x) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One row's causal softmax numerators in place: exp(s - max) over its first n scores, zeros from n up to end;
 * returns their float32 total (the caller divides by it at the end). */
static inline float softmax_row(float *sr, int64_t n, int64_t end) {
    float m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; j++) m = sr[j] > m ? sr[j] : m;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) sr[j] = expf(sr[j] - m);
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) sum += sr[j];
    for (int64_t j = n; j < end; j++) sr[j] = 0.0f;
    return sum;
}

/* The work items' table: item i -> (sequence, first row), QB rows each, without a search per item; the longest
 * sequence too. Returns 1 if the table could not be allocated (*item_seq stays NULL when there is nothing to do). */
static int work_items(const int64_t *seq_lens, int64_t num_seqs, int64_t *max_len, int64_t *items, int64_t **item_seq) {
    for (int64_t s = 0; s < num_seqs; s++) {
        if (seq_lens[s] > *max_len) *max_len = seq_lens[s];
        *items += (seq_lens[s] + QB - 1) / QB;
    }
    if (*max_len == 0) return 0;
    int64_t *table = malloc(sizeof(int64_t) * 2 * (size_t)*items);
    if (!table) return 1;
    for (int64_t s = 0, i = 0; s < num_seqs; s++)
        for (int64_t r = 0; r < seq_lens[s]; r += QB, i++) {
            table[2 * i] = s;
            table[2 * i + 1] = r;
        }
    *item_seq = table;
    return 0;
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 for a shape it does not take (head_dim not
 * a multiple of 32, or heads not a multiple of kv_heads). q/out: float32 [tokens, heads, head_dim] with the given
 * token and head strides (elements); k/v: [tokens, kv_heads, head_dim], float32 or bf16 (kv_bf16); sequence s
 * spans rows seq_starts[s] .. seq_starts[s] + seq_lens[s] - 1 of all four. */
int prefill_attention(const float *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok, int64_t k_head,
                      const void *v, int64_t v_tok, int64_t v_head, int kv_bf16, float *out, int64_t o_tok,
                      int64_t o_head, const int64_t *seq_starts, const int64_t *seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      int64_t dim, float scale, int num_threads) {
    if (dim % 32 || dim <= 0 || kv_heads <= 0 || heads % kv_heads) return 2;
    const int64_t group = heads / kv_heads;
    int64_t max_len = 0, items = 0;
    int64_t *item_seq = NULL;
    if (work_items(seq_lens, num_seqs, &max_len, &items, &item_seq)) return 1;
    if (max_len == 0) return 0;
    const int64_t padded = (max_len + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        float *kt = aligned_alloc(64, sizeof(float) * (size_t)(dim * padded));
        float *vf = aligned_alloc(64, sizeof(float) * (size_t)(padded * dim));
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(R * padded));
        if (!kt || !vf || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items * kv_heads; it++) {
            if (failed) continue;
            const int64_t item = it / kv_heads, g = it % kv_heads;
            const int64_t s = item_seq[2 * item], row0 = item_seq[2 * item + 1];
            const int64_t base = seq_starts[s], len = seq_lens[s];
            const int64_t rows = len - row0 < QB ? len - row0 : QB;
            const int64_t keys = row0 + rows, kpad = (keys + 15) / 16 * 16; /* causal: the last row sees `keys` */
            /* keys transposed, rounded to bf16 and widened back: kt[d * kpad + j]; padding keys are zero (masked below) */
            for (int64_t j = 0; j < kpad; j++) {
                if (j >= keys) {
                    for (int64_t d = 0; d < dim; d++) kt[d * kpad + j] = 0.0f;
                    continue;
                }
                const int64_t off = (base + j) * k_tok + g * k_head;
                for (int64_t d = 0; d < dim; d += 16) {
                    float lanes[16];
                    const __m512 x = load_row16(k, kv_bf16, off + d);
                    _mm512_storeu_ps(lanes, kv_bf16 ? x : round16(x));
                    for (int64_t l = 0; l < 16; l++) kt[(d + l) * kpad + j] = lanes[l];
                }
            }
            for (int64_t j = 0; j < keys; j++) {
                const int64_t off = (base + j) * v_tok + g * v_head;
                for (int64_t d = 0; d < dim; d += 16) {
                    const __m512 x = load_row16(v, kv_bf16, off + d);
                    _mm512_store_ps(vf + j * dim + d, kv_bf16 ? x : round16(x));
                }
            }
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                for (int64_t i0 = row0; i0 < row0 + rows; i0 += R) {
                    const int64_t nr = row0 + rows - i0 < R ? row0 + rows - i0 : R;
                    const int64_t seen = i0 + nr, spad = (seen + 15) / 16 * 16; /* keys the tile's last row sees */
                    /* two blocks of 16 keys per pass: eight independent sums hide the FMAs' latency */
                    const __m512 sc = _mm512_set1_ps(scale);
                    const float *q0 = q + (base + i0) * q_tok + h * q_head;
                    const float *q1 = q0 + (nr > 1 ? q_tok : 0), *q2 = q0 + (nr > 2 ? 2 * q_tok : 0),
                                *q3 = q0 + (nr > 3 ? 3 * q_tok : 0);
                    for (int64_t jb = 0; jb < spad; jb += 32) {
                        const int two = jb + 16 < spad;
                        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                               a3 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(),
                               b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
                        for (int64_t d = 0; d < dim; d++) {
                            const __m512 k0 = _mm512_load_ps(kt + d * kpad + jb);
                            const __m512 k1 = two ? _mm512_load_ps(kt + d * kpad + jb + 16) : k0;
                            const __m512 x0 = _mm512_set1_ps(q0[d]), x1 = _mm512_set1_ps(q1[d]),
                                         x2 = _mm512_set1_ps(q2[d]), x3 = _mm512_set1_ps(q3[d]);
                            a0 = _mm512_fmadd_ps(x0, k0, a0);
                            b0 = _mm512_fmadd_ps(x0, k1, b0);
                            a1 = _mm512_fmadd_ps(x1, k0, a1);
                            b1 = _mm512_fmadd_ps(x1, k1, b1);
                            a2 = _mm512_fmadd_ps(x2, k0, a2);
                            b2 = _mm512_fmadd_ps(x2, k1, b2);
                            a3 = _mm512_fmadd_ps(x3, k0, a3);
                            b3 = _mm512_fmadd_ps(x3, k1, b3);
                        }
                        _mm512_store_ps(scores + jb, _mm512_mul_ps(a0, sc));
                        _mm512_store_ps(scores + padded + jb, _mm512_mul_ps(a1, sc));
                        _mm512_store_ps(scores + 2 * padded + jb, _mm512_mul_ps(a2, sc));
                        _mm512_store_ps(scores + 3 * padded + jb, _mm512_mul_ps(a3, sc));
                        if (two) {
                            _mm512_store_ps(scores + jb + 16, _mm512_mul_ps(b0, sc));
                            _mm512_store_ps(scores + padded + jb + 16, _mm512_mul_ps(b1, sc));
                            _mm512_store_ps(scores + 2 * padded + jb + 16, _mm512_mul_ps(b2, sc));
                            _mm512_store_ps(scores + 3 * padded + jb + 16, _mm512_mul_ps(b3, sc));
                        }
                    }
                    float inv[R];
                    for (int64_t r = 0; r < nr; r++) {
                        float *sr = scores + r * padded;
                        const int64_t n = i0 + r + 1; /* causal: keys 0 .. i0 + r */
                        inv[r] = 1.0f / softmax_row(sr, n, seen);
                    }
                    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
                        __m512 o00 = _mm512_setzero_ps(), o01 = _mm512_setzero_ps(), o10 = _mm512_setzero_ps(),
                               o11 = _mm512_setzero_ps(), o20 = _mm512_setzero_ps(), o21 = _mm512_setzero_ps(),
                               o30 = _mm512_setzero_ps(), o31 = _mm512_setzero_ps();
                        for (int64_t j = 0; j < seen; j++) {
                            const __m512 v0 = _mm512_load_ps(vf + j * dim + d0), v1 = _mm512_load_ps(vf + j * dim + d0 + 16);
                            const __m512 p0 = _mm512_set1_ps(scores[j]);
                            o00 = _mm512_fmadd_ps(p0, v0, o00);
                            o01 = _mm512_fmadd_ps(p0, v1, o01);
                            if (nr > 1) {
                                const __m512 p1 = _mm512_set1_ps(scores[padded + j]);
                                o10 = _mm512_fmadd_ps(p1, v0, o10);
                                o11 = _mm512_fmadd_ps(p1, v1, o11);
                            }
                            if (nr > 2) {
                                const __m512 p2 = _mm512_set1_ps(scores[2 * padded + j]);
                                o20 = _mm512_fmadd_ps(p2, v0, o20);
                                o21 = _mm512_fmadd_ps(p2, v1, o21);
                            }
                            if (nr > 3) {
                                const __m512 p3 = _mm512_set1_ps(scores[3 * padded + j]);
                                o30 = _mm512_fmadd_ps(p3, v0, o30);
                                o31 = _mm512_fmadd_ps(p3, v1, o31);
                            }
                        }
                        const __m512 acc[R][2] = {{o00, o01}, {o10, o11}, {o20, o21}, {o30, o31}};
                        for (int64_t r = 0; r < nr; r++) {
                            float *orow = out + (base + i0 + r) * o_tok + h * o_head + d0;
                            const __m512 w = _mm512_set1_ps(inv[r]);
                            _mm512_storeu_ps(orow, _mm512_mul_ps(acc[r][0], w));
                            _mm512_storeu_ps(orow + 16, _mm512_mul_ps(acc[r][1], w));
                        }
                    }
                }
            }
        }
        free(kt);
        free(vf);
        free(scores);
    }
    free(item_seq);
    return failed;
}


/* The same attention with bf16 activations (dtype="bfloat16" prefill layers on CPUs without AMX, whose q, k and v
 * stay bf16 from the qkv projection to the o projection): the numbers of torch's bf16 flash SDPA, i.e. what the AMX
 * path computes. Scores are vdpbf16ps dot products of the bf16 query and keys accumulated in float32 (each product
 * exact), the softmax is float32, the probabilities are rounded to bf16 for the weighted sum (vdpbf16ps again,
 * float32 sums) while their float32 total normalises, and the output is rounded to bf16.
 *
 * Layouts for vdpbf16ps, whose lanes each take a pair of bf16: keys as kp[d / 2][key] (one 32-bit lane holds dims
 * d, d + 1 of one key: a vector is 16 keys), values as vp[key / 2][d] (one lane holds keys j, j + 1 of one dim: a
 * vector is 16 dims), probabilities as pairs of consecutive keys. Twice the float32 kernel's multiply-adds per
 * instruction; the work items and their scheduling are the float32 kernel's. */
int prefill_attention_bf16(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k, int64_t k_tok,
                           int64_t k_head, const uint16_t *v, int64_t v_tok, int64_t v_head, uint16_t *out,
                           int64_t o_tok, int64_t o_head, const int64_t *seq_starts, const int64_t *seq_lens,
                           int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                           int num_threads) {
    if (dim % 32 || dim <= 0 || kv_heads <= 0 || heads % kv_heads) return 2;
    const int64_t group = heads / kv_heads, pairs = dim / 2;
    int64_t max_len = 0, items = 0;
    int64_t *item_seq = NULL;
    if (work_items(seq_lens, num_seqs, &max_len, &items, &item_seq)) return 1;
    if (max_len == 0) return 0;
    const int64_t padded = (max_len + 31) / 32 * 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        uint32_t *kp = aligned_alloc(64, sizeof(uint32_t) * (size_t)(pairs * padded));
        uint32_t *vp = aligned_alloc(64, sizeof(uint32_t) * (size_t)(padded / 2 * dim));
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(R * padded));
        uint16_t *probs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(R * padded));
        if (!kp || !vp || !scores || !probs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items * kv_heads; it++) {
            if (failed) continue;
            const int64_t item = it / kv_heads, g = it % kv_heads;
            const int64_t s = item_seq[2 * item], row0 = item_seq[2 * item + 1];
            const int64_t base = seq_starts[s], len = seq_lens[s];
            const int64_t rows = len - row0 < QB ? len - row0 : QB;
            const int64_t keys = row0 + rows, kpad = (keys + 31) / 32 * 32; /* causal: the last row sees `keys` */
            /* kp[p * kpad + j]: dims 2p, 2p + 1 of key j; padding keys are zero (masked below) */
            for (int64_t j = 0; j < kpad; j++) {
                if (j >= keys) {
                    for (int64_t p = 0; p < pairs; p++) kp[p * kpad + j] = 0;
                    continue;
                }
                const uint32_t *src = (const uint32_t *)(k + (base + j) * k_tok + g * k_head);
                for (int64_t p = 0; p < pairs; p++) kp[p * kpad + j] = src[p];
            }
            /* vp[(j / 2) * dim + d]: dim d of keys j (low half) and j + 1 (high half); a missing key j + 1 is zero */
            for (int64_t j = 0; j < kpad; j += 2) {
                for (int64_t d = 0; d < dim; d += 16) {
                    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                    if (j < keys)
                        lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + (base + j) * v_tok + g * v_head + d)));
                    if (j + 1 < keys)
                        hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + (base + j + 1) * v_tok + g * v_head + d)));
                    _mm512_store_si512((__m512i *)(vp + (j / 2) * dim + d), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                for (int64_t i0 = row0; i0 < row0 + rows; i0 += R) {
                    const int64_t nr = row0 + rows - i0 < R ? row0 + rows - i0 : R;
                    const int64_t seen = i0 + nr, spad = (seen + 15) / 16 * 16; /* keys the tile's last row sees */
                    const __m512 sc = _mm512_set1_ps(scale);
                    const uint32_t *q0 = (const uint32_t *)(q + (base + i0) * q_tok + h * q_head);
                    const uint32_t *q1 = (const uint32_t *)((const uint16_t *)q0 + (nr > 1 ? q_tok : 0)),
                                   *q2 = (const uint32_t *)((const uint16_t *)q0 + (nr > 2 ? 2 * q_tok : 0)),
                                   *q3 = (const uint32_t *)((const uint16_t *)q0 + (nr > 3 ? 3 * q_tok : 0));
                    for (int64_t jb = 0; jb < spad; jb += 32) {
                        const int two = jb + 16 < spad;
                        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                               a3 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(),
                               b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
                        for (int64_t p = 0; p < pairs; p++) {
                            const __m512bh k0 = (__m512bh)_mm512_load_si512((const __m512i *)(kp + p * kpad + jb));
                            const __m512bh k1 = (__m512bh)_mm512_load_si512((const __m512i *)(kp + p * kpad + jb + 16));
                            const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)q0[p]), x1 = (__m512bh)_mm512_set1_epi32((int)q1[p]),
                                           x2 = (__m512bh)_mm512_set1_epi32((int)q2[p]), x3 = (__m512bh)_mm512_set1_epi32((int)q3[p]);
                            a0 = _mm512_dpbf16_ps(a0, x0, k0);
                            a1 = _mm512_dpbf16_ps(a1, x1, k0);
                            a2 = _mm512_dpbf16_ps(a2, x2, k0);
                            a3 = _mm512_dpbf16_ps(a3, x3, k0);
                            if (two) {
                                b0 = _mm512_dpbf16_ps(b0, x0, k1);
                                b1 = _mm512_dpbf16_ps(b1, x1, k1);
                                b2 = _mm512_dpbf16_ps(b2, x2, k1);
                                b3 = _mm512_dpbf16_ps(b3, x3, k1);
                            }
                        }
                        _mm512_store_ps(scores + jb, _mm512_mul_ps(a0, sc));
                        _mm512_store_ps(scores + padded + jb, _mm512_mul_ps(a1, sc));
                        _mm512_store_ps(scores + 2 * padded + jb, _mm512_mul_ps(a2, sc));
                        _mm512_store_ps(scores + 3 * padded + jb, _mm512_mul_ps(a3, sc));
                        if (two) {
                            _mm512_store_ps(scores + jb + 16, _mm512_mul_ps(b0, sc));
                            _mm512_store_ps(scores + padded + jb + 16, _mm512_mul_ps(b1, sc));
                            _mm512_store_ps(scores + 2 * padded + jb + 16, _mm512_mul_ps(b2, sc));
                            _mm512_store_ps(scores + 3 * padded + jb + 16, _mm512_mul_ps(b3, sc));
                        }
                    }
                    const int64_t ppad = (seen + 1) / 2 * 2; /* probabilities in whole pairs */
                    float inv[R];
                    for (int64_t r = 0; r < nr; r++) {
                        float *sr = scores + r * padded;
                        uint16_t *pr = probs + r * padded;
                        const int64_t n = i0 + r + 1; /* causal: keys 0 .. i0 + r */
                        const float sum = softmax_row(sr, n, spad);
                        for (int64_t j = 0; j < spad; j += 16)
                            _mm256_store_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sr + j)));
                        inv[r] = 1.0f / sum;
                    }
                    const uint32_t *p0 = (const uint32_t *)probs, *p1 = (const uint32_t *)(probs + padded),
                                   *p2 = (const uint32_t *)(probs + 2 * padded), *p3 = (const uint32_t *)(probs + 3 * padded);
                    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
                        __m512 o00 = _mm512_setzero_ps(), o01 = _mm512_setzero_ps(), o10 = _mm512_setzero_ps(),
                               o11 = _mm512_setzero_ps(), o20 = _mm512_setzero_ps(), o21 = _mm512_setzero_ps(),
                               o30 = _mm512_setzero_ps(), o31 = _mm512_setzero_ps();
                        for (int64_t jp = 0; jp < ppad / 2; jp++) {
                            const __m512bh v0 = (__m512bh)_mm512_load_si512((const __m512i *)(vp + jp * dim + d0)),
                                           v1 = (__m512bh)_mm512_load_si512((const __m512i *)(vp + jp * dim + d0 + 16));
                            const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)p0[jp]);
                            o00 = _mm512_dpbf16_ps(o00, x0, v0);
                            o01 = _mm512_dpbf16_ps(o01, x0, v1);
                            if (nr > 1) {
                                const __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)p1[jp]);
                                o10 = _mm512_dpbf16_ps(o10, x1, v0);
                                o11 = _mm512_dpbf16_ps(o11, x1, v1);
                            }
                            if (nr > 2) {
                                const __m512bh x2 = (__m512bh)_mm512_set1_epi32((int)p2[jp]);
                                o20 = _mm512_dpbf16_ps(o20, x2, v0);
                                o21 = _mm512_dpbf16_ps(o21, x2, v1);
                            }
                            if (nr > 3) {
                                const __m512bh x3 = (__m512bh)_mm512_set1_epi32((int)p3[jp]);
                                o30 = _mm512_dpbf16_ps(o30, x3, v0);
                                o31 = _mm512_dpbf16_ps(o31, x3, v1);
                            }
                        }
                        const __m512 acc[R][2] = {{o00, o01}, {o10, o11}, {o20, o21}, {o30, o31}};
                        for (int64_t r = 0; r < nr; r++) {
                            uint16_t *orow = out + (base + i0 + r) * o_tok + h * o_head + d0;
                            const __m512 w = _mm512_set1_ps(inv[r]);
                            _mm256_storeu_si256((__m256i *)orow, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][0], w)));
                            _mm256_storeu_si256((__m256i *)(orow + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][1], w)));
                        }
                    }
                }
            }
        }
        free(kp);
        free(vp);
        free(scores);
        free(probs);
    }
    free(item_seq);
    return failed;
}

int prefill_attention_supported(void) { return 1; }

#else /* no AVX512-BF16: the caller keeps SDPA */

int prefill_attention(const float *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok, int64_t k_head,
                      const void *v, int64_t v_tok, int64_t v_head, int kv_bf16, float *out, int64_t o_tok,
                      int64_t o_head, const int64_t *seq_starts, const int64_t *seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      int64_t dim, float scale, int num_threads) {
    return 3;
}

int prefill_attention_bf16(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k, int64_t k_tok,
                           int64_t k_head, const uint16_t *v, int64_t v_tok, int64_t v_head, uint16_t *out,
                           int64_t o_tok, int64_t o_head, const int64_t *seq_starts, const int64_t *seq_lens,
                           int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                           int num_threads) {
    return 3;
}

int prefill_attention_supported(void) { return 0; }

#endif
