/* Row-wise float32 and bfloat16 ops of a decoder layer, one pass each
 * (tandem.kernels.pointwise).
 *
 * torch runs each of these as several ops (RMSNorm: pow, mean, add, rsqrt, mul, mul, and the
 * residual add before it; the MLP's activation: chunk, silu, mul; rotary: mul, roll, mul,
 * add), each a dispatch, an allocation
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
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_MIN 32768 /* elements */
#define PARALLEL_MIN_BYTES (1 << 20)
#define MAX_HEAD_DIM 1024

/* Each op is written once and defined for both dtypes: T the element type, LOAD widens one
 * element to float32, ROUND rounds an intermediate where torch's op in that dtype would
 * (nothing in float32), STORE narrows the result. */
#define LOAD_F32(x) (x)
#define KEEP_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))
#define STORE_BF16(x) f32_to_bf16(x)

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; x rows `x_stride` apart, out contiguous. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, ROUND, STORE)                                          \
    void NAME(const T *x, int64_t x_stride, const T *w, T *out, int64_t rows, int64_t dim,    \
              float eps, int threads) {                                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_MIN)") \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *xr = x + r * x_stride;                                                   \
            T *o = out + r * dim;                                                             \
            float ss = 0.0f;                                                                  \
            for (int64_t i = 0; i < dim; i++) ss += LOAD(xr[i]) * LOAD(xr[i]);                \
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                            \
            for (int64_t i = 0; i < dim; i++) o[i] = STORE(ROUND(LOAD(xr[i]) * inv) * LOAD(w[i])); \
        }                                                                                     \
    }

/* A residual add and the RMSNorm after it, one pass: h[r] = x[r] + res[r] (rounded as torch's
 * add in T rounds), out[r] = rms_norm(h[r]) * w as DEFINE_RMS_NORM; x and res rows `x_stride`
 * and `res_stride` apart, h and out contiguous. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, ROUND, STORE)                                      \
    void NAME(const T *x, int64_t x_stride, const T *res, int64_t res_stride, const T *w,     \
              T *h, T *out, int64_t rows, int64_t dim, float eps, int threads) {              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_MIN)") \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *xr = x + r * x_stride, *rr = res + r * res_stride;                       \
            T *hr = h + r * dim, *o = out + r * dim;                                          \
            float ss = 0.0f;                                                                  \
            for (int64_t i = 0; i < dim; i++) {                                               \
                const float s = ROUND(LOAD(xr[i]) + LOAD(rr[i]));                             \
                hr[i] = STORE(s);                                                             \
                ss += s * s;                                                                  \
            }                                                                                 \
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                            \
            for (int64_t i = 0; i < dim; i++) o[i] = STORE(ROUND(LOAD(hr[i]) * inv) * LOAD(w[i])); \
        }                                                                                     \
    }

/* out[r] = silu(gu[r, :n]) * gu[r, n:2n]; gu rows `gu_stride` apart, out contiguous [rows, n]. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, ROUND, STORE)                                          \
    void NAME(const T *gu, int64_t gu_stride, T *out, int64_t rows, int64_t n, int threads) { \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)") \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *g = gu + r * gu_stride, *u = g + n;                                      \
            T *o = out + r * n;                                                               \
            for (int64_t i = 0; i < n; i++) {                                                 \
                const float gi = LOAD(g[i]);                                                  \
                o[i] = STORE(ROUND(gi / (1.0f + expf(-gi))) * LOAD(u[i]));                    \
            }                                                                                 \
        }                                                                                     \
    }

/* In place: x[t, h] = x[t, h] * cos[t] + roll(x[t, h], dim / 2) * sin[t] for every token t
 * and head h; x's tokens `t_stride` apart, heads `h_stride` apart, each head contiguous;
 * cos / sin contiguous [tokens, dim] (sin already signed: -sin on the first half). */
#define DEFINE_ROTARY(NAME, T, LOAD, ROUND, STORE)                                            \
    int NAME(T *x, int64_t t_stride, int64_t h_stride, const T *cos_t, const T *sin_t,        \
             int64_t tokens, int64_t heads, int64_t dim, int threads) {                        \
        if (dim > MAX_HEAD_DIM || dim % 2) return 1;                                          \
        const int64_t half = dim / 2;                                                         \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < tokens; t++) {                                                \
            const T *c = cos_t + t * dim, *s = sin_t + t * dim;                               \
            float buf[MAX_HEAD_DIM];                                                          \
            for (int64_t h = 0; h < heads; h++) {                                             \
                T *v = x + t * t_stride + h * h_stride;                                       \
                for (int64_t i = 0; i < dim; i++) buf[i] = LOAD(v[i]);                        \
                for (int64_t i = 0; i < half; i++)                                            \
                    v[i] = STORE(ROUND(buf[i] * LOAD(c[i])) + ROUND(buf[i + half] * LOAD(s[i]))); \
                for (int64_t i = half; i < dim; i++)                                          \
                    v[i] = STORE(ROUND(buf[i] * LOAD(c[i])) + ROUND(buf[i - half] * LOAD(s[i]))); \
            }                                                                                 \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, LOAD_F32, KEEP_F32, KEEP_F32)
DEFINE_RMS_NORM(rms_norm_bf16, bf16, LOAD_BF16, ROUND_BF16, STORE_BF16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, LOAD_F32, KEEP_F32, KEEP_F32)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, bf16, LOAD_BF16, ROUND_BF16, STORE_BF16)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, KEEP_F32, KEEP_F32)
DEFINE_SILU_MUL(silu_mul_bf16, bf16, LOAD_BF16, ROUND_BF16, STORE_BF16)
DEFINE_ROTARY(rotary_f32, float, LOAD_F32, KEEP_F32, KEEP_F32)
DEFINE_ROTARY(rotary_bf16, bf16, LOAD_BF16, ROUND_BF16, STORE_BF16)

/* dst row index[i] = src row i, for i < rows: rows of row_bytes, src rows src_stride bytes
 * apart, dst (dst_rows rows) dst_stride bytes apart: a step's keys or values into their cache
 * slots, one call where torch's index_copy_ on the strided view of the fused qkv output cost
 * ~30 us. Returns 1, copying nothing, if an index is outside dst. */
int scatter_rows(const char *src, int64_t src_stride, const int64_t *index, char *dst,
                 int64_t dst_stride, int64_t dst_rows, int64_t rows, int64_t row_bytes,
                 int threads) {
    for (int64_t r = 0; r < rows; r++)
        if (index[r] < 0 || index[r] >= dst_rows) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * row_bytes >= PARALLEL_MIN_BYTES)
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + index[r] * dst_stride, src + r * src_stride, (size_t)row_bytes);
    return 0;
}

/* Greedy picks over float32 logits (rows `stride` apart): token[r] = the first index of the
 * row's maximum (as torch.argmax), logprob[r] = log_softmax(row)[token] = -log(sum(exp(x -
 * max))) (torch's x - max - log(sum), whose first term is 0 at the maximum). Two passes over
 * the row and no [rows, vocab] output, where torch ran log_softmax, argmax and a gather. */
static inline float row_max(const float *xr, int64_t vocab) {
    float mx = -FLT_MAX;
    for (int64_t i = 0; i < vocab; i++) mx = xr[i] > mx ? xr[i] : mx;
    return mx;
}

/* One row's greedy pick given its maximum: the first index of it, and -log(sum(exp(x - mx))). */
static inline void greedy_row(const float *xr, int64_t vocab, float mx, int64_t *token,
                              float *logprob) {
    int64_t best = 0;
    while (best < vocab - 1 && xr[best] != mx) best++;
    float sum = 0.0f;
    for (int64_t i = 0; i < vocab; i++) sum += expf(xr[i] - mx);
    *token = best;
    *logprob = -logf(sum);
}

void greedy_f32(const float *x, int64_t stride, int64_t rows, int64_t vocab, int64_t *token,
                float *logprob, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * vocab >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        greedy_row(xr, vocab, row_max(xr, vocab), token + r, logprob + r);
    }
}

/* Sampled picks over float32 logits (rows `stride` apart), by inverting each row's CDF at one
 * uniform, as torch's cumsum and searchsorted did (the same token for the same uniform, up to
 * float32 rounding at a boundary), in two passes over the row and no [rows, vocab] output:
 * where torch ran log_softmax, exp, cumsum, searchsorted and a gather (five [rows, vocab]
 * passes, most of a sampled decode step's sampling time over a 49k vocabulary).
 * Row r: temperature t[r] (0: greedy, as greedy_f32), uniform u[r] in [0, 1); p = softmax(x /
 * t); token[r] = the first index whose cumulative mass exceeds u * total; logprob[r] =
 * log p[token] where processed[r], else log_softmax(x)[token] (raw). Each thread's `scratch`
 * row (`vocab` floats, then one per block of SAMPLE_BLOCK) holds the exponentials and their
 * block sums, so the walk adds the stored sums and scans the exponentials of one block only;
 * the total is the sum of those same sums, so the walk crosses the target in some block (one
 * whose element-by-element sum falls short by rounding gives its last token with mass). */
#define SAMPLE_BLOCK 256 /* tandem.kernels.pointwise.SAMPLE_BLOCK */

static inline float block_sum(const float *e, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += e[i];
    return s;
}

void sample_f32(const float *x, int64_t stride, int64_t rows, int64_t vocab, const float *temp,
                const float *uniform, const uint8_t *processed, int64_t *token, float *logprob,
                float *scratch, int threads) {
#pragma omp parallel num_threads(threads) if (rows * vocab >= PARALLEL_MIN)
    {
        const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
        float *e = scratch + (int64_t)omp_get_thread_num() * (vocab + blocks);
        float *sums = e + vocab;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * stride;
            const float mx = row_max(xr, vocab);
            const float t = temp[r];
            if (t == 0.0f) {
                greedy_row(xr, vocab, mx, token + r, logprob + r);
                continue;
            }
            const float inv = 1.0f / t;
            for (int64_t i = 0; i < vocab; i++) e[i] = expf((xr[i] - mx) * inv);
            float total = 0.0f;
            for (int64_t k = 0; k < blocks; k++) {
                const int64_t b = k * SAMPLE_BLOCK;
                sums[k] = block_sum(e + b, vocab - b < SAMPLE_BLOCK ? vocab - b : SAMPLE_BLOCK);
                total += sums[k];
            }
            float target = uniform[r] * total;
            if (target >= total) target = nextafterf(total, 0.0f);
            int64_t pick = -1;
            float c = 0.0f;
            for (int64_t k = 0; k < blocks && pick < 0; k++) {
                if (c + sums[k] <= target) {
                    c += sums[k];
                    continue;
                }
                const int64_t b = k * SAMPLE_BLOCK;
                const int64_t n = vocab - b < SAMPLE_BLOCK ? vocab - b : SAMPLE_BLOCK;
                int64_t last = b; /* the block's last token with mass, should rounding fall short */
                for (int64_t i = 0; i < n && pick < 0; i++) {
                    if (e[b + i] > 0.0f) last = b + i;
                    c += e[b + i];
                    if (c > target) pick = b + i;
                }
                if (pick < 0) pick = last;
            }
            if (pick < 0) /* not reached: the walk adds the block sums that made the total */
                for (pick = vocab - 1; pick > 0 && e[pick] == 0.0f; pick--) {
                }
            token[r] = pick;
            if (processed[r]) {
                logprob[r] = (xr[pick] - mx) * inv - logf(total);
            } else {
                float sum = total; /* t == 1: the raw distribution is the sampled one */
                if (t != 1.0f) {
                    sum = 0.0f;
                    for (int64_t i = 0; i < vocab; i++) sum += expf(xr[i] - mx);
                }
                logprob[r] = xr[pick] - mx - logf(sum);
            }
        }
    }
}
