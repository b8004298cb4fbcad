/* paged_attention.h's work item, included once per KV-cache element type: the includer defines ITEM_NAME (the
 * function), KV_T (the cache's element type), KV_DOT(q, k, n) (a float query row against n cache values),
 * KV_AT(p, i) (one value as float) and, on AVX-512 builds, KV_LOAD16(p) (16 values as a __m512). */
/* One work item: a decode's query heads that share KV heads [kv0, kv0 + nkv). Always inlined into
 * call sites with a constant head_dim, so the compiler unrolls the dot products.
 * Rows of query head qh = (kv0 + j) * group + g go to scores[(j * group + g) * len + t]; the
 * heads' outputs are accumulated in acc[(j * group + g) * head_dim + i].
 * `hidden`: the first keys the query may not see (a sliding window that starts inside the first
 * block; the caller starts `table` at the window's first block); `softcap` > 0: scores become
 * softcap * tanh(score / softcap) (Gemma 2). Both 0 for plain attention. `sinks` (NULL: none): one
 * logit per output row (gpt-oss's attention sinks) that joins the softmax's denominator, attending to
 * nothing. */
#if defined(__AVX512F__)
#define ITEM_CAT2(a, b) a##b
#define ITEM_CAT(a, b) ITEM_CAT2(a, b)
/* Scores of HG query heads (rows q, q + qs, ...) against 8 consecutive keys (k, k + ts, ...), scaled, to
 * s[h * len + t]: each key's 16-value pieces are widened once for all the heads, one accumulator per (head,
 * key) sums over the head size, and sum8_lanes folds a head's 8 accumulators at once. HG <= 3: 24 accumulators. */
static inline __attribute__((always_inline)) void ITEM_CAT(ITEM_NAME, _scores8)(
        const float *q, int64_t qs, const KV_T *k, int64_t ts, const int64_t head_dim, const int HG, float scale,
        float *s, int64_t len) {
    __m512 acc[3][8];
    for (int h = 0; h < HG; h++)
        for (int t = 0; t < 8; t++) acc[h][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 16) {
        __m512 qv[3];
        for (int h = 0; h < HG; h++) qv[h] = _mm512_loadu_ps(q + h * qs + c);
        for (int t = 0; t < 8; t++) {
            const __m512 kv = KV_LOAD16(k + t * ts + c);
            for (int h = 0; h < HG; h++) acc[h][t] = _mm512_fmadd_ps(qv[h], kv, acc[h][t]);
        }
    }
    for (int h = 0; h < HG; h++) _mm256_storeu_ps(s + h * len, _mm256_mul_ps(sum8_lanes(acc[h]), _mm256_set1_ps(scale)));
}

/* out rows h < HG (stride os) = the probabilities p[h * len + t] times the values of one kv head, each value
 * row widened once for all HG heads (HG * head_dim / 16 <= 24 accumulators). The first pass over a kv head
 * reads its values from DRAM: `prefetch` asks for the next block's rows ahead. */
static inline __attribute__((always_inline)) void ITEM_CAT(ITEM_NAME, _values)(
        const float *p, int64_t len, const KV_T *v_base, const int64_t *table, int64_t block_size,
        int64_t token_stride, const int64_t head_dim, const int HG, int prefetch, float *out, int64_t os) {
    __m512 a[3][16];
    for (int h = 0; h < HG; h++)
        for (int64_t c = 0; c < head_dim / 16; c++) a[h][c] = _mm512_setzero_ps();
    for (int64_t start = 0; start < len; start += block_size) {
        const KV_T *v = v_base + table[start / block_size] * block_size * token_stride;
        const int64_t n = block_tokens(start, len, block_size);
        const int64_t next_n = prefetch ? block_tokens(start + block_size, len, block_size) : 0;
        const KV_T *v_next = next_n ? v_base + table[start / block_size + 1] * block_size * token_stride : v;
        for (int64_t o = 0; o < n; o++, v += token_stride) {
            if (o < next_n) PREFETCH_ROW(v_next + o * token_stride, head_dim);
            __m512 w[3];
            for (int h = 0; h < HG; h++) w[h] = _mm512_set1_ps(p[h * len + start + o]);
            for (int64_t c = 0; c < head_dim / 16; c++) {
                const __m512 x = KV_LOAD16(v + 16 * c);
                for (int h = 0; h < HG; h++) a[h][c] = _mm512_fmadd_ps(w[h], x, a[h][c]);
            }
        }
    }
    for (int h = 0; h < HG; h++)
        for (int64_t c = 0; c < head_dim / 16; c++) _mm512_storeu_ps(out + h * os + 16 * c, a[h][c]);
}
#endif

static inline __attribute__((always_inline)) void ITEM_NAME(
        const float *q, int64_t q_head_stride, float *out, int64_t out_head_stride,
        const KV_T *k_base, const KV_T *v_base, const int64_t *table, int64_t len, int64_t block_size,
        int64_t token_stride, const int64_t head_dim, int64_t group, int64_t nkv, float scale, float *scores,
        int64_t hidden, float softcap, const float *sinks) {
    const int64_t rows = nkv * group;
    float *acc = scores + rows * len;
    /* Block by block (no division per token); within a block the tokens' KV heads are contiguous,
     * so the reads stream through memory. */
    for (int64_t start = 0; start < len; start += block_size) {
        const KV_T *k = k_base + table[start / block_size] * block_size * token_stride;
        const int64_t n = block_tokens(start, len, block_size);
        const int64_t next_n = block_tokens(start + block_size, len, block_size);
        const KV_T *k_next = next_n ? k_base + table[start / block_size + 1] * block_size * token_stride : k;
        int64_t o = 0;
#if defined(__AVX512F__)
        if (head_dim % 16 == 0)
            for (; o + 8 <= n; o += 8, k += 8 * token_stride) {
                for (int64_t i = o; i < o + 8 && i < next_n; i++) PREFETCH_ROW(k_next + i * token_stride, nkv * head_dim);
                for (int64_t j = 0; j < nkv; j++)
                    for (int64_t g = 0; g < group; g += 3) {
                        const int64_t r = j * group + g;
                        const float *qr = q + r * q_head_stride;
                        float *s = scores + r * len + start + o;
                        switch (group - g) { /* heads in threes: constant counts keep the sums in registers */
                            case 1: ITEM_CAT(ITEM_NAME, _scores8)(qr, q_head_stride, k + j * head_dim, token_stride, head_dim, 1, scale, s, len); break;
                            case 2: ITEM_CAT(ITEM_NAME, _scores8)(qr, q_head_stride, k + j * head_dim, token_stride, head_dim, 2, scale, s, len); break;
                            default: ITEM_CAT(ITEM_NAME, _scores8)(qr, q_head_stride, k + j * head_dim, token_stride, head_dim, 3, scale, s, len); break;
                        }
                    }
            }
#endif
        for (; o < n; o++, k += token_stride) {
            if (o < next_n) PREFETCH_ROW(k_next + o * token_stride, nkv * head_dim);
            for (int64_t j = 0; j < nkv; j++)
                for (int64_t g = 0; g < group; g++)
                    scores[(j * group + g) * len + start + o] =
                        KV_DOT(q + (j * group + g) * q_head_stride, k + j * head_dim, head_dim) * scale;
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
        /* The output rows of up to three heads of a group at a time (one for head sizes over 128), their
         * accumulators in registers; each value row is read and widened once per such set of heads. */
        const int64_t per = head_dim <= 128 ? 3 : 1;
        for (int64_t j = 0; j < nkv; j++)
            for (int64_t g = 0; g < group; g += per) {
                const int64_t r = j * group + g, hg = group - g < per ? group - g : per;
                const float *p = scores + r * len;
                const KV_T *v = v_base + j * head_dim;
                float *dst = out + r * out_head_stride;
                if (hg == 3)
                    ITEM_CAT(ITEM_NAME, _values)(p, len, v, table, block_size, token_stride, head_dim, 3, g == 0, dst, out_head_stride);
                else if (hg == 2)
                    ITEM_CAT(ITEM_NAME, _values)(p, len, v, table, block_size, token_stride, head_dim, 2, g == 0, dst, out_head_stride);
                else
                    ITEM_CAT(ITEM_NAME, _values)(p, len, v, table, block_size, token_stride, head_dim, 1, g == 0, dst, out_head_stride);
            }
        return;
    }
#endif
    memset(acc, 0, (size_t)(rows * head_dim) * sizeof(float));
    for (int64_t start = 0; start < len; start += block_size) {
        const KV_T *v = v_base + table[start / block_size] * block_size * token_stride;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t o = 0; o < n; o++, v += token_stride)
            for (int64_t j = 0; j < nkv; j++)
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[(j * group + g) * len + start + o];
                    float *a = acc + (j * group + g) * head_dim;
                    const KV_T *vj = v + j * head_dim;
#pragma omp simd
                    for (int64_t i = 0; i < head_dim; i++) a[i] += p * KV_AT(vj, i);
                }
    }
    for (int64_t r = 0; r < rows; r++)
        memcpy(out + r * out_head_stride, acc + r * head_dim, (size_t)head_dim * sizeof(float));
}
#if defined(__AVX512F__)
#undef ITEM_CAT
#undef ITEM_CAT2
#endif
