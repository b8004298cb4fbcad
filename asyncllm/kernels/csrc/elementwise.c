/* Fused elementwise ops of the decoder for the CPU path: RMSNorm (optionally after the residual
 * add), SiLU-and-multiply, and rotary embedding in place. One pass over memory each instead of the
 * four to six separate torch ops (and temporaries) that the reference path runs; OpenMP only when
 * the tensor is large enough (a prefill chunk) for threads to pay off.
 *
 * Rows are addressed as base + (r / rows_per_token) * token_stride + (r % rows_per_token) * cols,
 * so per-head rows inside a fused qkv tensor (Qwen3's q/k norms) need no copy.
 * Built and loaded like paged_decode.c (asyncllm/kernels/cpu_build.py).
 */
#include <math.h>
#include <stdint.h>

__attribute__((simd("notinbranch"))) float expf(float);

#define PARALLEL_MIN_ELEMENTS (1 << 16)

static inline const float *row_ptr(const float *base, int64_t r, int64_t rows_per_token, int64_t token_stride,
                                   int64_t cols) {
    return base + (r / rows_per_token) * token_stride + (r % rows_per_token) * cols;
}

/* normed = rms_norm(x (+ residual)) * weight; with a residual, total = x + residual is written too
 * (it may alias residual). normed/total are contiguous [rows, cols]. */
void rms_norm_f32(const float *x, int64_t rows_per_token, int64_t token_stride, const float *residual,
                  float *total, float *normed, const float *weight, int64_t rows, int64_t cols, float eps,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = row_ptr(x, r, rows_per_token, token_stride, cols);
        float *nr = normed + r * cols;
        const float *src = xr;
        if (residual) {
            const float *rr = residual + r * cols;
            float *tr = total + r * cols;
#pragma omp simd
            for (int64_t i = 0; i < cols; i++) tr[i] = xr[i] + rr[i];
            src = tr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < cols; i++) sum += src[i] * src[i];
        const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) nr[i] = weight[i] * (src[i] * inv);
    }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i]; gate and up rows share one stride (halves of gate_up). */
void silu_and_mul_f32(const float *gate, const float *up, int64_t in_stride, float *out, int64_t rows,
                      int64_t cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * in_stride, *u = up + r * in_stride;
        float *o = out + r * cols;
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* bfloat16 <-> float32 by bits: a bf16 value is the top half of a float32 one; narrowing rounds to nearest
 * even (NaN stays NaN: its payload's top bits are kept and the quiet bit set). */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* The bf16 twin of silu_and_mul_f32 (prefill MLPs of dtype="bfloat16"): bf16 halves of gate_up in, float32
 * arithmetic, one rounding to bf16 out, so the down projection reads bf16 without a conversion pass. */
void silu_and_mul_bf16(const uint16_t *gate, const uint16_t *up, int64_t in_stride, uint16_t *out, int64_t rows,
                       int64_t cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * in_stride, *u = up + r * in_stride;
        uint16_t *o = out + r * cols;
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(x / (1.0f + expf(-x)) * bf16_to_f32(u[i]));
        }
    }
}

/* RMSNorm with the bf16 activations of dtype="bfloat16" prefill around it (model/decoder.py's bf16 residual path):
 * x is a projection's output as oneDNN hands it back (bf16, or float32), residual the float32 residual stream.
 * With a residual, total = widen(x) + residual is written (float32) and normed; without one x must be float32
 * and is normed itself. normed is written bf16 (rounded once, to nearest even) or float32. The arithmetic is
 * rms_norm_f32's, loop for loop, so the result is bit for bit widening x, rms_norm_f32, then rounding: what the
 * layers computed with a conversion pass on each side. All tensors are contiguous [rows, cols]. */
void rms_norm_mixed(const void *x, int x_is_bf16, const float *residual, float *total, void *normed,
                    int normed_is_bf16, const float *weight, int64_t rows, int64_t cols, float eps,
                    int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *src;
        if (residual) {
            const float *rr = residual + r * cols;
            float *tr = total + r * cols;
            if (x_is_bf16) {
                const uint16_t *xr = (const uint16_t *)x + r * cols;
#pragma omp simd
                for (int64_t i = 0; i < cols; i++) tr[i] = bf16_to_f32(xr[i]) + rr[i];
            } else {
                const float *xr = (const float *)x + r * cols;
#pragma omp simd
                for (int64_t i = 0; i < cols; i++) tr[i] = xr[i] + rr[i];
            }
            src = tr;
        } else {
            src = (const float *)x + r * cols;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < cols; i++) sum += src[i] * src[i];
        const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
        if (normed_is_bf16) {
            uint16_t *nr = (uint16_t *)normed + r * cols;
#pragma omp simd
            for (int64_t i = 0; i < cols; i++) nr[i] = f32_to_bf16(weight[i] * (src[i] * inv));
        } else {
            float *nr = (float *)normed + r * cols;
#pragma omp simd
            for (int64_t i = 0; i < cols; i++) nr[i] = weight[i] * (src[i] * inv);
        }
    }
}

/* Rotate each head of x ([tokens, heads, head_dim], token stride given, heads contiguous) in place by
 * the angles of its token's position: tables are cat(freqs, freqs) rows of cos/sin per position
 * (positions already checked against the tables' length). */
static void rotate(float *x, int64_t token_stride, int64_t heads, int64_t head_dim, const int64_t *positions,
                   const float *cos_table, const float *sin_table, int64_t tokens, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * token_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* rotate() over bfloat16 values (the bf16 prefill attention of dtype="bfloat16", model/decoder.py): each value
 * widened, the same float32 arithmetic, one rounding to bf16, which is what rounding rotate()'s float32 result
 * for the cache and the bf16 attention gives. */
static void rotate_bf16(uint16_t *x, int64_t token_stride, int64_t heads, int64_t head_dim, const int64_t *positions,
                        const float *cos_table, const float *sin_table, int64_t tokens, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + t * token_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
                v[i] = f32_to_bf16(a * c[i] - b * s[i]);
                v[i + half] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
    }
}

/* rotary_f32 over bfloat16 q and k (strides in elements); the same return values. */
int rotary_bf16(uint16_t *q, int64_t q_token_stride, int64_t q_heads, uint16_t *k, int64_t k_token_stride,
                int64_t k_heads, int64_t head_dim, const int64_t *positions, const float *cos_table,
                const float *sin_table, int64_t table_rows, int64_t tokens, int num_threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return 1;
    rotate_bf16(q, q_token_stride, q_heads, head_dim, positions, cos_table, sin_table, tokens, num_threads);
    rotate_bf16(k, k_token_stride, k_heads, head_dim, positions, cos_table, sin_table, tokens, num_threads);
    return 0;
}

/* Returns 0, or 1 (nothing rotated) when a position is outside [0, table_rows). */
int rotary_f32(float *q, int64_t q_token_stride, int64_t q_heads, float *k, int64_t k_token_stride,
               int64_t k_heads, int64_t head_dim, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t table_rows, int64_t tokens, int num_threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return 1;
    rotate(q, q_token_stride, q_heads, head_dim, positions, cos_table, sin_table, tokens, num_threads);
    rotate(k, k_token_stride, k_heads, head_dim, positions, cos_table, sin_table, tokens, num_threads);
    return 0;
}
