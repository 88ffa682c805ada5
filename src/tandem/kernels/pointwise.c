/* Row-wise float32 and bfloat16 ops of a decoder layer, one pass each
 * (tandem.kernels.pointwise).
 *
 * torch runs each of these as several ops (RMSNorm: pow, mean, add, rsqrt, mul, mul; the MLP's
 * activation: chunk, silu, mul; rotary: mul, roll, mul, add), each a dispatch, an allocation
 * and a pass over memory. At a decode step's sizes (a few rows of 512) the dispatches cost
 * more than the arithmetic. Rows go to OpenMP threads in contiguous runs when there are
 * enough of them; below PARALLEL_MIN elements one thread does all (waking threads costs more).
 * Arithmetic follows torch's and Hugging Face's order: RMSNorm is x * (1 / sqrt(mean(x^2) +
 * eps)) * w, silu(g) = g / (1 + exp(-g)), rotary is x * cos + roll(x, D/2) * signed_sin.
 * bfloat16 rounds where torch's bfloat16 ops round (each op's result, to nearest even),
 * computing in float32 between: RMSNorm rounds the normalised row, then its product with w
 * (Hugging Face's `weight * x.to(dtype)`); silu-and-multiply rounds silu(g), then the product;
 * rotary rounds both products and their sum.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_MIN 32768 /* elements */
#define MAX_HEAD_DIM 1024

/* f rounded to bfloat16 and back: where torch's bfloat16 op would round. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; x rows `x_stride` apart, out contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
                  int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* out[r] = silu(gu[r, :n]) * gu[r, n:2n]; gu rows `gu_stride` apart, out contiguous [rows, n]. */
void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t rows, int64_t n,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * gu_stride, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* In place: x[t, h] = x[t, h] * cos[t] + roll(x[t, h], dim / 2) * sin[t] for every token t
 * and head h; x's tokens `t_stride` apart, heads `h_stride` apart, each head contiguous;
 * cos / sin contiguous [tokens, dim] (sin already signed: -sin on the first half). */
int rotary_f32(float *x, int64_t t_stride, int64_t h_stride, const float *cos_t,
               const float *sin_t, int64_t tokens, int64_t heads, int64_t dim, int threads) {
    if (dim > MAX_HEAD_DIM || dim % 2) return 1;
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * dim, *s = sin_t + t * dim;
        float buf[MAX_HEAD_DIM];
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * t_stride + h * h_stride;
            memcpy(buf, v, sizeof(float) * dim);
            for (int64_t i = 0; i < half; i++) v[i] = buf[i] * c[i] + buf[i + half] * s[i];
            for (int64_t i = half; i < dim; i++) v[i] = buf[i] * c[i] + buf[i - half] * s[i];
        }
    }
    return 0;
}

void rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, bf16 *out, int64_t rows,
                   int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * x_stride;
        bf16 *o = out + r * dim;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            o[i] = f32_to_bf16(round_bf16(bf16_to_f32(xr[i]) * inv) * bf16_to_f32(w[i]));
    }
}

void silu_mul_bf16(const bf16 *gu, int64_t gu_stride, bf16 *out, int64_t rows, int64_t n,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = gu + r * gu_stride, *u = g + n;
        bf16 *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float gi = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(gi / (1.0f + expf(-gi))) * bf16_to_f32(u[i]));
        }
    }
}

int rotary_bf16(bf16 *x, int64_t t_stride, int64_t h_stride, const bf16 *cos_t,
                const bf16 *sin_t, int64_t tokens, int64_t heads, int64_t dim, int threads) {
    if (dim > MAX_HEAD_DIM || dim % 2) return 1;
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const bf16 *c = cos_t + t * dim, *s = sin_t + t * dim;
        float buf[MAX_HEAD_DIM];
        for (int64_t h = 0; h < heads; h++) {
            bf16 *v = x + t * t_stride + h * h_stride;
            for (int64_t i = 0; i < dim; i++) buf[i] = bf16_to_f32(v[i]);
            for (int64_t i = 0; i < dim; i++) {
                const float rolled = buf[i < half ? i + half : i - half];
                v[i] = f32_to_bf16(round_bf16(buf[i] * bf16_to_f32(c[i])) +
                                   round_bf16(rolled * bf16_to_f32(s[i])));
            }
        }
    }
    return 0;
}
