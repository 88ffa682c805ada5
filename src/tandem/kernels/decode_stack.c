/* One decode step through a stack of Llama decoder layers in one call
 * (tandem.kernels.decode_stack).
 *
 * A decode step of one to a few rows is a pass over the layers' weights (memory-bound) plus,
 * per layer, a dozen small ops. Driven from Python, each op is a module call, its checks, an
 * allocation and a ctypes call: 0.15-0.26 ms a layer, a quarter of a batch-1 step of a
 * 30-layer model on 2 cores (bfloat16, float32). This loop runs the same ops in the same
 * order, calling the same kernels (their entry points handed over by address: the GEMV
 * kernel, the pointwise kernels, the paged decode kernel) with the same arguments and thread
 * count, so its results are the Python path's bit for bit. What it adds of its own is the
 * residual add after the MLP (rounded as torch's add in the dtype rounds).
 *
 * Per layer: RMSNorm; the fused q/k/v GEMV (its bias where it has one); rotary on q and k in
 * place; keys and values into their cache slots; paged decode attention; the output GEMV; the
 * residual add and the second RMSNorm in one pass; the fused gate/up GEMV; silu-and-multiply;
 * the down GEMV; the residual add. Buffers are the caller's (one scratch tensor).
 */
#include <stdint.h>

#include "bf16.h"

typedef void (*rms_norm_fn)(const void *x, int64_t x_stride, const void *w, void *out,
                            int64_t rows, int64_t dim, float eps, int threads);
typedef void (*add_rms_norm_fn)(const void *x, int64_t x_stride, const void *res,
                                int64_t res_stride, const void *w, void *h, void *out,
                                int64_t rows, int64_t dim, float eps, int threads);
typedef void (*gemv_fn)(const void *x, int64_t x_stride, int64_t rows, const void *w,
                        int64_t in, int64_t out, const void *bias, void *y, int64_t y_stride,
                        int threads);
typedef int (*rotary_fn)(void *x, int64_t t_stride, int64_t h_stride, const void *cos_t,
                         const void *sin_t, int64_t tokens, int64_t heads, int64_t dim,
                         int threads);
typedef int (*scatter_rows_fn)(const char *src, int64_t src_stride, const int64_t *index,
                               char *dst, int64_t dst_stride, int64_t dst_rows, int64_t rows,
                               int64_t row_bytes, int threads);
typedef int (*paged_decode_fn)(const void *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, void *out, const int64_t *rows,
                               const int32_t *tables, const int32_t *lens, int B,
                               int max_blocks, int bs, int H, int KV, int D, float scale,
                               int bf16, int nthreads);
typedef void (*silu_mul_fn)(const void *gu, int64_t gu_stride, void *out, int64_t rows,
                            int64_t n, int threads);

/* The kernels' entry points, in this order (decode_stack.py's `_entry_points`). */
enum { K_RMS_NORM, K_ADD_RMS_NORM, K_GEMV, K_ROTARY, K_SCATTER, K_PAGED, K_SILU_MUL, K_COUNT };

/* One layer's tensors, in this order (decode_stack.py's LAYER): a row of `layers`. */
enum { L_IN_NORM, L_QKV, L_QKV_BIAS, L_O, L_POST_NORM, L_GATE_UP, L_DOWN, L_K_CACHE, L_V_CACHE,
       L_COUNT };

/* Shapes and settings, in this order (`DecodeStack.run`'s `dims`). */
enum { D_ROWS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_CACHE_ROWS, D_MAX_BLOCKS,
       D_BLOCK_SIZE, D_BF16, D_THREADS, D_COUNT };

/* out = a + b, [rows, n] contiguous; bfloat16 rounds the float32 sum to nearest even. */
static void add_rows(const void *a, const void *b, void *out, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *x = a, *y = b;
        uint16_t *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    } else {
        const float *x = a, *y = b;
        float *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
    }
}

/* x: the stack's input rows [rows, hidden] (row stride x_stride); out: its output [rows,
 * hidden], contiguous; scratch: rows * (4 * hidden + q + 2 kv + q + 3 * inter) elements.
 * slots: each row's cache slot; paged_rows / tables / lens: paged decode's batch (every row).
 * Returns 0; or 1 + 4 * layer + which op refused (1 rotary, 2 scatter, 3 attention). */
int decode_stack(const void *const *kernels, const int64_t *layers, int n_layers,
                 const int64_t *dims, float eps, float scale, const void *x, int64_t x_stride,
                 void *out, void *scratch, const void *cos_t, const void *sin_t,
                 const int64_t *slots, const int64_t *paged_rows, const int32_t *tables,
                 const int32_t *lens) {
    const rms_norm_fn rms_norm = (rms_norm_fn)kernels[K_RMS_NORM];
    const add_rms_norm_fn add_rms_norm = (add_rms_norm_fn)kernels[K_ADD_RMS_NORM];
    const gemv_fn gemv = (gemv_fn)kernels[K_GEMV];
    const rotary_fn rotary = (rotary_fn)kernels[K_ROTARY];
    const scatter_rows_fn scatter = (scatter_rows_fn)kernels[K_SCATTER];
    const paged_decode_fn paged = (paged_decode_fn)kernels[K_PAGED];
    const silu_mul_fn silu_mul = (silu_mul_fn)kernels[K_SILU_MUL];

    const int64_t R = dims[D_ROWS], hid = dims[D_HIDDEN], I = dims[D_INTER];
    const int H = (int)dims[D_HEADS], KV = (int)dims[D_KV_HEADS], D = (int)dims[D_HEAD_DIM];
    const int bf16 = (int)dims[D_BF16], threads = (int)dims[D_THREADS];
    const int64_t es = bf16 ? 2 : 4, q_size = (int64_t)H * D, kv_size = (int64_t)KV * D;
    const int64_t qkv_n = q_size + 2 * kv_size;

    char *s = scratch; /* the buffers, each [R, width] contiguous */
    char *normed = s;
    char *qkv = normed + R * hid * es;
    char *attn = qkv + R * qkv_n * es;
    char *o = attn + R * q_size * es;
    char *h = o + R * hid * es;
    char *gu = h + R * hid * es;
    char *act = gu + R * 2 * I * es;
    char *mlp = act + R * I * es;

    for (int l = 0; l < n_layers; l++) {
        const int64_t *t = layers + (int64_t)l * L_COUNT;
        const void *in = l == 0 ? x : out;
        const int64_t in_stride = l == 0 ? x_stride : hid;
        char *k_cache = (char *)t[L_K_CACHE], *v_cache = (char *)t[L_V_CACHE];

        rms_norm(in, in_stride, (const void *)t[L_IN_NORM], normed, R, hid, eps, threads);
        gemv(normed, hid, R, (const void *)t[L_QKV], hid, qkv_n, (const void *)t[L_QKV_BIAS], qkv,
             qkv_n, threads);
        if (rotary(qkv, qkv_n, D, cos_t, sin_t, R, H + KV, D, threads)) return 1 + 4 * l + 1;
        if (scatter(qkv + q_size * es, qkv_n * es, slots, k_cache, kv_size * es,
                    dims[D_CACHE_ROWS], R, kv_size * es, threads) ||
            scatter(qkv + (q_size + kv_size) * es, qkv_n * es, slots, v_cache, kv_size * es,
                    dims[D_CACHE_ROWS], R, kv_size * es, threads))
            return 1 + 4 * l + 2;
        if (paged(qkv, qkv_n, k_cache, v_cache, attn, paged_rows, tables, lens, (int)R,
                  (int)dims[D_MAX_BLOCKS], (int)dims[D_BLOCK_SIZE], H, KV, D, scale, bf16,
                  threads))
            return 1 + 4 * l + 3;
        gemv(attn, q_size, R, (const void *)t[L_O], q_size, hid, 0, o, hid, threads);
        add_rms_norm(o, hid, in, in_stride, (const void *)t[L_POST_NORM], h, normed, R, hid, eps,
                     threads);
        gemv(normed, hid, R, (const void *)t[L_GATE_UP], hid, 2 * I, 0, gu, 2 * I, threads);
        silu_mul(gu, 2 * I, act, R, I, threads);
        gemv(act, I, R, (const void *)t[L_DOWN], I, hid, 0, mlp, hid, threads);
        add_rows(h, mlp, out, R * hid, bf16);
    }
    return 0;
}
