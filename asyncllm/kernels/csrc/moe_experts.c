/* The routed experts of a mixture-of-experts layer for the CPU path, a whole step in one call (float32):
 *
 *     out[t] (+)= sum over t's chosen local experts e, ascending:  w[t, e] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])
 *
 * w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] are the PyTorch Linear layouts of
 * model/moe.py's ExpertStack, read as they are. ids/weights [T, k] are the router's choices; ids outside
 * first_expert .. first_expert + E (another expert-parallel rank's experts) are skipped. The torch path
 * (grouped_experts) pays ~50 us of per-op overhead per active expert; here one call does:
 *
 * - the (token, expert) pairs counting-sorted by expert, tokens ascending within an expert (the order of
 *   grouped_experts' stable argsort);
 * - phase 1: per active expert and block of 16 or 32 gate rows (with the matching up rows), the dot products of
 *   those weight rows with every one of the expert's tokens, then the gated activation, into a pair buffer
 *   [P, 2I] (gate half overwritten by the activation). Work items (expert, row block) are shared out
 *   dynamically over the OpenMP threads, so each weight row is read from memory once per step;
 * - phase 2: out[token, n] += w * (h . w2[e, n] + b2[e, n]); a work item is a range of 16-256 output
 *   columns (no two threads write one element, no atomics) over every expert in ascending order, so a
 *   token's sum runs expert by expert as transformers' loop and grouped_experts' index_add_ do.
 *
 * Micro-kernel (tile_dots): R weight rows x C token rows of partial dot products, one vector accumulator
 * each (R * C <= NACC: 8 with AVX2, 16 with AVX-512), every weight vector loaded once for the C tokens and
 * every token vector once for the R rows; the NACC accumulators are summed across lanes together by a
 * transpose-and-add tree (reduce8: 3 shuffle levels for 8 sums, instead of 8 separate horizontal sums).
 * C is 4 for full chunks of an expert's tokens (loads: R + 4 per 4R FMAs), and the remainder (1-3 tokens)
 * takes more rows per tile. The AVX-512 build folds each 16-lane accumulator to 8 lanes and uses the same
 * reduce8. Without AVX2/FMA the same code runs on scalars (VL = 1).
 *
 * H and I must be multiples of 16 (the wrapper falls back to torch otherwise). Results differ from
 * the torch path only by the order of the float32 sums inside each dot product. Built and loaded like
 * int8_linear.c (cpu_build.py: -O3 -march=native -fopenmp -ffp-contract=off).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>



__attribute__((simd("notinbranch"))) float expf(float);

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#if defined(__AVX512F__)
#define MOE_AVX512 1
typedef __m512 vf;
#define VL 16
#define NACC 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#else
#define MOE_AVX2 1
typedef __m256 vf;
#define VL 8
#define NACC 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#endif
#else
typedef float vf;
#define VL 1
#define NACC 8
#define vzero() 0.0f
#define vload(p) (*(p))
#define vfma(a, b, c) ((a) * (b) + (c))
#endif

#ifndef MOE_PREFETCH
#define MOE_PREFETCH 1 /* software prefetch of the next tile's rows */
#endif
/* Work items are as large as the thread count allows (up to 32 gate rows, 256 output columns): each is a
 * few contiguous runs of weight memory, and every run's start costs the prefetchers a ramp-up (measured
 * ~10% at one token against 16 rows / 64 columns). */
#define RB_MIN 16 /* gate rows (and as many up rows) per phase-1 work item: 16, or 32 where I allows */
#define RB_MAX 32
#define CMAX 4  /* tokens per tile in an expert's full chunks */
#define DOWN_COLS_MAX 256 /* output columns per phase-2 work item: a multiple of 16, about H / (2 threads) */
#define PAIR_BUFFER_BYTES ((int64_t)32 << 20) /* the pair buffer's cap: longer steps go in blocks of tokens */
#define MIN_BLOCK_TOKENS 16
#define MOE_SILU 0
#define MOE_CLAMPED 1

/* Which code this build runs: 2 AVX-512, 1 AVX2/FMA, 0 portable loops (for the tests and benchmarks). */
int moe_experts_isa(void) {
#if defined(MOE_AVX512)
    return 2;
#elif defined(MOE_AVX2)
    return 1;
#else
    return 0;
#endif
}

#if defined(MOE_AVX2) || defined(MOE_AVX512)
static inline __m256 fold128(__m256 x, __m256 y) { /* [x.lo + x.hi | y.lo + y.hi] */
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

/* Lane i = the sum of a[i]'s 8 lanes. Fed as a0 a4 | a1 a5 | a2 a6 | a3 a7, the two hadd levels leave
 * a0..a3 in the low half and a4..a7 in the high one. */
static inline __m256 reduce8(const __m256 *a) {
    const __m256 b0 = fold128(a[0], a[4]), b1 = fold128(a[1], a[5]), b2 = fold128(a[2], a[6]),
                 b3 = fold128(a[3], a[7]);
    return _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
}
#endif

/* res[i] = the lane sum of acc[i], i < NACC. */
static inline __attribute__((always_inline)) void reduce_store(const vf *acc, float *res) {
#if defined(MOE_AVX512)
    __m256 half[NACC];
    for (int i = 0; i < NACC; i++)
        half[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
    _mm256_storeu_ps(res, reduce8(half));
    _mm256_storeu_ps(res + 8, reduce8(half + 8));
#elif defined(MOE_AVX2)
    _mm256_storeu_ps(res, reduce8(acc));
#else
    for (int i = 0; i < NACC; i++) res[i] = acc[i];
#endif
}

/* res[c * R + r] = rows[r] . xs[c] over K floats (K a multiple of VL), r < R, c < C, R * C <= NACC.
 * next: the rows the caller reads after these (prefetched a line per step, as int8_linear.c does: the
 * hardware prefetchers follow R interleaved streams from DRAM poorly), or NULL. */
static inline __attribute__((always_inline)) void tile_dots(const int R, const int C, const float *const *rows,
                                                            const float *const *xs, int64_t K, float *res,
                                                            const float *const *next) {
    vf acc[NACC];
#pragma GCC unroll 16
    for (int i = 0; i < NACC; i++) acc[i] = vzero();
    for (int64_t k = 0; k < K; k += VL) {
        vf xv[CMAX];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) xv[c] = vload(xs[c] + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const vf w = vload(rows[r] + k);
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[c * R + r] = vfma(w, xv[c], acc[c * R + r]);
        }
#if VL > 1
        if (MOE_PREFETCH && next && (k * 4) % 64 == 0) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) __builtin_prefetch(next[r] + k, 0, 1);
        }
#endif
    }
    reduce_store(acc, res);
}

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
/* How many rows (of K floats) ahead a tile of R rows prefetches: the next tile's at least, and far enough
 * (PREFETCH_BYTES per stream) to cover DRAM latency when a tile's rows are short (I = 128: 512 bytes). */
static inline int64_t prefetch_rows(int R, int64_t K) {
    const int64_t far = (PREFETCH_BYTES + K * 4 - 1) / (K * 4);
    return far > R ? far : R;
}

typedef struct {
    const float *x;
    int64_t x_stride, H, I;
    const float *w13, *w2, *b13, *b2;
    int activation;
    float alpha, limit;
    int weights_on_input;
    int64_t rb; /* gate rows per phase-1 work item */
    float *out;
    /* the sorted pairs: local expert e's are offsets[e] .. offsets[e + 1] */
    const int64_t *offsets;
    const int32_t *tok;
    const float *pw;
    float *buf; /* [P, 2I]: gate | up sums, then the activation in the gate half */
} Step;

/* Phase-1 tiles of Rg gate rows + Rg up rows x C tokens over gate rows j0 .. j0 + rb, pairs pa .. pb (a
 * multiple of C apart): the raw dot products (times the routing weight with weights_on_input) into buf. */
static inline __attribute__((always_inline)) void gate_up_tiles(const int Rg, const int C, const Step *s,
                                                                const float *W, int64_t j0, int64_t pa,
                                                                int64_t pb) {
    const int64_t H = s->H, I = s->I, ahead = prefetch_rows(Rg, H);
    float res[NACC];
    for (int64_t j = j0; j < j0 + s->rb; j += Rg) {
        const float *rows[NACC], *next[NACC];
        for (int r = 0; r < Rg; r++) {
            rows[r] = W + (j + r) * H;
            rows[Rg + r] = W + (I + j + r) * H;
            /* the next rows this item reads; past the block they are the next item's (harmless) */
            next[r] = rows[r] + ahead * H;
            next[Rg + r] = rows[Rg + r] + ahead * H;
        }
        for (int64_t p = pa; p < pb; p += C) {
            const float *xs[CMAX];
            for (int c = 0; c < C; c++) xs[c] = s->x + (int64_t)s->tok[p + c] * s->x_stride;
            tile_dots(2 * Rg, C, rows, xs, H, res, p == pa ? next : NULL);
            for (int c = 0; c < C; c++) {
                float *g = s->buf + (p + c) * 2 * I;
                const float scale = s->weights_on_input ? s->pw[p + c] : 1.0f;
                for (int r = 0; r < Rg; r++) {
                    g[j + r] = res[c * 2 * Rg + r] * scale;
                    g[I + j + r] = res[c * 2 * Rg + Rg + r] * scale;
                }
            }
        }
    }
}

/* Phase-1 work item: expert e's gate/up rows j0 .. j0 + rb for all its tokens, then the activation. */
__attribute__((noinline)) static void gate_up_item(const Step *s, int64_t e, int64_t j0) {
    const int64_t H = s->H, I = s->I, pa = s->offsets[e], n = s->offsets[e + 1] - pa;
    const float *W = s->w13 + e * 2 * I * H;
    const int64_t full = n - n % CMAX;
    if (full) gate_up_tiles(NACC / (2 * CMAX), CMAX, s, W, j0, pa, pa + full);
    switch (n % CMAX) {
        case 1: gate_up_tiles(NACC / 2, 1, s, W, j0, pa + full, pa + n); break;
        case 2: gate_up_tiles(NACC / 4, 2, s, W, j0, pa + full, pa + n); break;
        case 3: gate_up_tiles(NACC / 8 > 0 ? NACC / 8 : 1, 3, s, W, j0, pa + full, pa + n); break;
        default: break;
    }
    const float *bias = s->b13 ? s->b13 + e * 2 * I : NULL;
    for (int64_t p = pa; p < pa + n; p++) {
        for (int64_t j1 = j0; j1 < j0 + s->rb; j1 += RB_MIN) {
            float *g = s->buf + p * 2 * I + j1, *u = g + I;
            float gate[RB_MIN], up[RB_MIN];
            for (int j = 0; j < RB_MIN; j++) {
                gate[j] = bias ? g[j] + bias[j1 + j] : g[j];
                up[j] = bias ? u[j] + bias[I + j1 + j] : u[j];
            }
            if (s->activation == MOE_SILU) {
#pragma omp simd
                for (int j = 0; j < RB_MIN; j++) g[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
            } else { /* gpt-oss: gate clamped above, up both ways, (up + 1) * gate * sigmoid(alpha * gate) */
                const float alpha = s->alpha, limit = s->limit;
#pragma omp simd
                for (int j = 0; j < RB_MIN; j++) {
                    const float a = gate[j] < limit ? gate[j] : limit;
                    const float b = up[j] < -limit ? -limit : (up[j] > limit ? limit : up[j]);
                    g[j] = (b + 1.0f) * (a * (1.0f / (1.0f + expf(-(a * alpha)))));
                }
            }
        }
    }
}

/* Phase-2 tiles of R output columns x C tokens over columns n0 .. n1 (a multiple of R apart), pairs pa .. pb. */
static inline __attribute__((always_inline)) void down_tiles(const int R, const int C, const Step *s, int64_t e,
                                                             int64_t n0, int64_t n1, int64_t pa, int64_t pb) {
    const int64_t H = s->H, I = s->I;
    const float *W = s->w2 + e * H * I, *bias = s->b2 ? s->b2 + e * H : NULL;
    const int64_t ahead = prefetch_rows(R, I);
    float res[NACC];
    for (int64_t n = n0; n < n1; n += R) {
        const float *rows[NACC], *next[NACC];
        for (int r = 0; r < R; r++) {
            rows[r] = W + (n + r) * I;
            next[r] = rows[r] + ahead * I;
        }
        for (int64_t p = pa; p < pb; p += C) {
            const float *xs[CMAX];
            for (int c = 0; c < C; c++) xs[c] = s->buf + (p + c) * 2 * I;
            tile_dots(R, C, rows, xs, I, res, p == pa && n + R < n1 ? next : NULL);
            for (int c = 0; c < C; c++) {
                float *o = s->out + (int64_t)s->tok[p + c] * H + n;
                const float *y = res + c * R;
                if (s->weights_on_input) {
                    for (int r = 0; r < R; r++) o[r] += bias ? y[r] + bias[n + r] : y[r];
                } else {
                    const float w = s->pw[p + c];
                    for (int r = 0; r < R; r++) o[r] += (bias ? y[r] + bias[n + r] : y[r]) * w;
                }
            }
        }
    }
}

/* Phase 2 for output columns n0 .. n1 (multiples of 16): every local expert, ascending. */
__attribute__((noinline)) static void down_columns(const Step *s, int64_t E, int64_t n0, int64_t n1) {
    for (int64_t e = 0; e < E; e++) {
        const int64_t pa = s->offsets[e], n = s->offsets[e + 1] - pa, full = n - n % CMAX;
        if (!n) continue;
        if (full) down_tiles(NACC / CMAX, CMAX, s, e, n0, n1, pa, pa + full);
        switch (n % CMAX) {
            case 1: down_tiles(NACC, 1, s, e, n0, n1, pa + full, pa + n); break;
            case 2: down_tiles(NACC / 2, 2, s, e, n0, n1, pa + full, pa + n); break;
            case 3: down_tiles(NACC / 4, 3, s, e, n0, n1, pa + full, pa + n); break;
            default: break;
        }
    }
}

/* The calling thread's scratch (kept for its next call): the sorted pairs, the work list, the pair buffer. */
static __thread void *moe_scratch = NULL;
static __thread size_t moe_scratch_len = 0;

static void *scratch_bytes(size_t n) {
    if (n > moe_scratch_len) {
        free(moe_scratch);
        moe_scratch = aligned_alloc(64, (n + 63) / 64 * 64);
        moe_scratch_len = moe_scratch ? n : 0;
    }
    return moe_scratch;
}

/* One block of tokens (all of the step's, or as many as the pair buffer's cap allows): see moe_experts_f32. */
static int moe_block(const float *x, int64_t T, int64_t H, int64_t x_stride, const int64_t *ids, const float *weights,
                     int64_t k, const float *w13, const float *w2, const float *b13, const float *b2, int64_t E,
                     int64_t first_expert, int64_t I, int activation, float alpha, float limit, int weights_on_input,
                     float *out, int accumulate, int num_threads) {
    const int64_t pairs = T * k;
    /* scratch: offsets [E + 1], work list [E], tok [pairs], pw [pairs], then buf [P, 2I] at a 64-byte boundary */
    size_t head = (size_t)(E + 1) * 8 + (size_t)E * 8 + (size_t)pairs * 4 + (size_t)pairs * 4;
    head = (head + 63) / 64 * 64;
    char *mem = (char *)scratch_bytes(head + (size_t)pairs * 2 * I * sizeof(float));
    if (!mem) return 1;
    int64_t *offsets = (int64_t *)mem, *active = offsets + E + 1;
    int32_t *tok = (int32_t *)(active + E);
    float *pw = (float *)(tok + pairs);

    /* counting sort by local expert; within one, pairs keep their (token, slot) order */
    memset(offsets, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t f = 0; f < pairs; f++) {
        const int64_t e = ids[f] - first_expert;
        if (e >= 0 && e < E) offsets[e + 1]++;
    }
    int64_t n_active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (offsets[e + 1]) active[n_active++] = e;
        offsets[e + 1] += offsets[e];
    }
    const int64_t P = offsets[E];
    for (int64_t f = 0; f < pairs; f++) {
        const int64_t e = ids[f] - first_expert;
        if (e < 0 || e >= E) continue;
        /* offsets[e] serves as expert e's cursor (it ends at offsets[e + 1]; shifted back below) */
        const int64_t q = offsets[e]++;
        tok[q] = (int32_t)(f / k);
        pw[q] = weights[f];
    }
    for (int64_t e = E; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;

    int threads = num_threads > 0 ? num_threads : 1;
    /* 32 gate rows per item where I allows and that still leaves two items per thread */
    const int64_t rb = I % RB_MAX == 0 && n_active * (I / RB_MAX) >= 2 * (int64_t)threads ? RB_MAX : RB_MIN;
    Step s = {x, x_stride, H, I, w13, w2, b13, b2, activation, alpha, limit, weights_on_input, rb, out,
              offsets, tok, pw, (float *)(mem + head)};
    const int64_t blocks = I / rb, items = n_active * blocks;
    /* phase 2 in column chunks of about H / (2 threads), taken dynamically: a thread the OS preempts (the
     * cores are often shared) delays a chunk, not a fixed share of the work */
    int64_t cols = (H / (2 * (int64_t)threads) + 15) / 16 * 16;
    cols = cols < 16 ? 16 : (cols > DOWN_COLS_MAX ? DOWN_COLS_MAX : cols);
    const int64_t chunks = (H + cols - 1) / cols;
    if (threads > items + chunks) threads = (int)(items + chunks);

#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) gate_up_item(&s, active[it / blocks], (it % blocks) * rb);
        /* the implicit barrier: every h row is done before phase 2 reads it */
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t c0 = c * cols, c1 = c0 + cols < H ? c0 + cols : H;
            if (!accumulate)
                for (int64_t t = 0; t < T; t++) memset(out + t * H + c0, 0, (size_t)(c1 - c0) * sizeof(float));
            if (P) down_columns(&s, E, c0, c1);
        }
    }
    return 0;
}

/* out[T, H] = (accumulate ? out : 0) + the routed experts' weighted sum (see the top of this file).
 * x: T rows of x_stride floats (H used); ids (int64) and weights (float32): [T, k] contiguous; w13 [E, 2I, H],
 * w2 [E, H, I], b13 [E, 2I] or NULL, b2 [E, H] or NULL, all contiguous; activation 0 SiLU-gated, 1 gpt-oss
 * clamped (alpha, limit); out: [T, H] contiguous. A long prefill goes in blocks of tokens whose pair buffer
 * stays under PAIR_BUFFER_BYTES (each block reads the active experts' weights again; a block's tokens are
 * its own rows of out). Returns 0, 1 if scratch memory ran out, 2 for bad shapes. */
int moe_experts_f32(const float *x, int64_t T, int64_t H, int64_t x_stride, const int64_t *ids, const float *weights,
                    int64_t k, const float *w13, const float *w2, const float *b13, const float *b2, int64_t E,
                    int64_t first_expert, int64_t I, int activation, float alpha, float limit, int weights_on_input,
                    float *out, int accumulate, int num_threads) {
    if (T < 0 || k < 0 || E < 0 || H <= 0 || I <= 0 || H % 16 || I % 16 || x_stride < H) return 2;
    if (activation != MOE_SILU && activation != MOE_CLAMPED) return 2;
    if (T > INT32_MAX) return 2;
    const int64_t pair_bytes = 2 * I * (int64_t)sizeof(float), per_token = (k > 0 ? k : 1) * pair_bytes;
    int64_t block = PAIR_BUFFER_BYTES / per_token;
    if (block < MIN_BLOCK_TOKENS) block = MIN_BLOCK_TOKENS;
    for (int64_t t0 = 0; t0 < T; t0 += block) {
        const int64_t n = T - t0 < block ? T - t0 : block;
        const int rc = moe_block(x + t0 * x_stride, n, H, x_stride, ids + t0 * k, weights + t0 * k, k, w13, w2, b13,
                                 b2, E, first_expert, I, activation, alpha, limit, weights_on_input, out + t0 * H,
                                 accumulate, num_threads);
        if (rc) return rc;
    }
    return 0;
}

/* The router of the softmax-then-top-k schemes (Mixtral, Qwen2/3-MoE) and of top-k-then-softmax (GraniteMoe,
 * gpt-oss), for a step: logits[t, e] = x[t] . wr[e] (+ br[e]) in float32, then per token
 *   scheme 0: p = softmax(logits); the k largest p (ties: the lower expert first), renormalised to sum 1
 *             when renorm (transformers divides even a single weight by itself);
 *   scheme 1: the k largest logits, softmaxed among themselves.
 * ids [T, k] (int64, in descending order of weight) and weights [T, k] (float32) are written. The torch
 * path spends ~150 us a layer on the six operations this replaces (most of it per-op overhead at T = 32).
 * Returns 0, or 2 for bad shapes (k > E, E > 1024). */
int moe_route_f32(const float *x, int64_t T, int64_t H, int64_t x_stride, const float *wr, const float *br,
                  int64_t E, int64_t k, int scheme, int renorm, int64_t *ids, float *weights, int num_threads) {
    if (T < 0 || H <= 0 || E <= 0 || E > 1024 || k <= 0 || k > E || x_stride < H || (scheme != 0 && scheme != 1))
        return 2;
    const int threads = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * E * H > (1 << 18))
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_stride;
        float logits[1024];
        for (int64_t e = 0; e < E; e++) {
            const float *w = wr + e * H;
            vf acc = vzero();
            int64_t h = 0;
            for (; h + VL <= H; h += VL) acc = vfma(vload(w + h), vload(xt + h), acc);
            float sum = 0.0f;
#if VL > 1
            float lanes[VL];
            memcpy(lanes, &acc, sizeof(lanes));
            for (int i = 0; i < VL; i++) sum += lanes[i];
#else
            sum = acc;
#endif
            for (; h < H; h++) sum += w[h] * xt[h];
            logits[e] = br ? sum + br[e] : sum;
        }
        float mx = logits[0];
        for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        /* selection of the k largest logits (softmax is monotonic: the same experts as the k largest p) */
        int64_t *id = ids + t * k;
        float *wt = weights + t * k;
        unsigned char taken[1024];
        memset(taken, 0, (size_t)E);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e;
            taken[best] = 1;
            id[j] = best;
        }
        if (scheme == 0) {
            float denom = 0.0f;
            for (int64_t e = 0; e < E; e++) denom += expf(logits[e] - mx);
            float chosen = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                wt[j] = expf(logits[id[j]] - mx) / denom;
                chosen += wt[j];
            }
            if (renorm)
                for (int64_t j = 0; j < k; j++) wt[j] /= chosen;
        } else {
            const float top = logits[id[0]];
            float denom = 0.0f;
            for (int64_t j = 0; j < k; j++) denom += expf(logits[id[j]] - top);
            for (int64_t j = 0; j < k; j++) wt[j] = expf(logits[id[j]] - top) / denom;
        }
    }
    return 0;
}
