/* Causal prefill attention straight from the paged KV cache, float32 or bfloat16, on the
 * CPU's vector units (tandem.kernels.paged_prefill, where AMX does not serve).
 *
 * The arguments are paged_prefill.c's: span s has counts[s] query tokens, rows starts[s] ..
 * starts[s] + counts[s] - 1 of q ([T, H, D]); its context is its first lens[s] cached tokens
 * (a cached prefix, then the span's own tokens, already written to the cache by the caller),
 * token t in slot tables[s][t / bs] * bs + t % bs of k_cache / v_cache ([slots, KV, D]). The
 * span's i-th query token sits at position lens[s] - counts[s] + i and attends the tokens up
 * to it. Query head h reads key/value head h / (H / KV). Output rows go to the same rows of out.
 *
 * Prompts in RL rollouts are short (tens to hundreds of tokens), where torch's flash attention
 * spends more on its blocking than on the products (24-34 GFLOP/s at 132 tokens on an AVX-512
 * EPYC). Here a work item is a span and a kv head; it goes down the span in blocks of QB
 * query tokens, each block's R = QB * G query rows (a token's G heads, then the next token's)
 * against the keys up to its last token, in two passes with every score of the block in a
 * float32 buffer (no online rescaling):
 *   1. the keys are laid out in LANES-key tiles, transposed ([d][key]), as the blocks reach
 *      them (each key once per item), and the scores of 8 query rows x one tile are 8 vector
 *      accumulators fed by broadcast-FMAs over d (the outer-product form of a GEMM
 *      micro-kernel); the query is scaled on the way in;
 *   2. softmax per row in float32 over the keys the row sees (exponentials vectorized by
 *      glibc's libmvec: built with -ffast-math), the rest of the row zeroed, and the values
 *      (widened once into a float32 buffer) summed with the row's weights, a few rows at a
 *      time with all D outputs in registers; divided by the row's sum as it is stored.
 * bfloat16 is widened on load (exact) and the output rounded to nearest even once. Vectors are
 * GCC's vector extensions at the build's width (16 floats with AVX-512, 8 with AVX2), so one
 * source serves both. Items run over torch's OpenMP threads (the library links its libgomp),
 * dynamically scheduled, each thread with its own buffers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define QB 8 /* query tokens per work item */
#define RS 8 /* query rows per score micro-kernel */
#define REGS (LANES == 16 ? 16 : 8) /* vector accumulators of the value pass (of 32 / 16) */
#define UNROLL _Pragma("GCC unroll 16")

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));

static inline vf ld(const float *p) { return *(const vf *)p; }
static inline void st(float *p, vf v) { *(vf *)p = v; }

static inline void widen_f32(const float *src, float *dst, int D) { memcpy(dst, src, 4 * D); }
static inline void widen_bf16(const bf16 *src, float *dst, int D) {
    for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
}
static inline void store_f32(float *dst, const float *src, float mul, int D) {
    for (int d = 0; d < D; d++) dst[d] = src[d] * mul;
}
static inline void store_bf16(bf16 *dst, const float *src, float mul, int D) {
    for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d] * mul);
}

/* Per-thread buffers, sized for the longest context of the call. */
typedef struct {
    float *kt; /* [tiles][D][LANES]: keys, transposed per tile */
    float *vf; /* [keys][D]: values */
    float *s;  /* [R][width]: scores, then weights */
    float *q;  /* [R][D]: scaled query rows */
    float *inv; /* [R]: 1 / each row's sum of weights */
} buffers;

/* Keys [from, to) of kv head g into the item's buffers: keys transposed per tile (the rest of
 * the last tile zeroed, overwritten when later keys arrive), values widened. */
#define DEFINE_PACK(NAME, T, WIDEN)                                                            \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const T *k_cache, const T *v_cache, const int32_t *table, int from, int to, int bs,   \
        int KV, int g, const int D, buffers *b) {                                             \
        const int end = (to + LANES - 1) / LANES * LANES;                                     \
        for (int t = from; t < end; t++) {                                                    \
            float *kd = b->kt + (t / LANES) * D * LANES + t % LANES;                          \
            if (t < to) {                                                                     \
                const int64_t at = ((int64_t)table[t / bs] * bs + t % bs) * KV + g;           \
                float kr[D];                                                                  \
                WIDEN(k_cache + at * D, kr, D);                                               \
                for (int d = 0; d < D; d++) kd[d * LANES] = kr[d];                            \
                WIDEN(v_cache + at * D, b->vf + (int64_t)t * D, D);                           \
            } else {                                                                          \
                for (int d = 0; d < D; d++) kd[d * LANES] = 0.f;                              \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_PACK(pack_f32, float, widen_f32)
DEFINE_PACK(pack_bf16, bf16, widen_bf16)

/* One block of a span: rows [row0, row0 + n) (n <= QB, positions pos0 ..), kv head g, its
 * keys [0, pos0 + n) already packed. D is a constant where inlined. */
#define DEFINE_BLOCK(NAME, T, WIDEN, STORE)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const T *q, T *out, int row0, int n, int pos0, int H, int KV, int g, const int D,    \
        float scale, buffers *b) {                                                            \
        const int G = H / KV, R = QB * G, nk = pos0 + n;                                      \
        const int tiles = (nk + LANES - 1) / LANES, width = tiles * LANES;                    \
        for (int r = 0; r < R; r++) { /* row r: token r / G, head g * G + r % G */            \
            float *qr = b->q + r * D;                                                         \
            if (r / G < n) {                                                                  \
                WIDEN(q + ((int64_t)(row0 + r / G) * H + g * G + r % G) * D, qr, D);          \
                for (int d = 0; d < D; d++) qr[d] *= scale;                                   \
            } else {                                                                          \
                memset(qr, 0, 4 * D);                                                         \
            }                                                                                 \
        }                                                                                     \
        for (int r0 = 0; r0 < R; r0 += RS) /* pass 1: scores */                              \
            for (int t = 0; t < tiles; t++) {                                                 \
                const float *kd = b->kt + t * D * LANES, *qr = b->q + r0 * D;                 \
                vf acc[RS];                                                                   \
                UNROLL for (int i = 0; i < RS; i++) acc[i] = (vf){0};                         \
                for (int d = 0; d < D; d++) {                                                 \
                    const vf kv = ld(kd + d * LANES);                                         \
                    UNROLL for (int i = 0; i < RS; i++) acc[i] += kv * qr[i * D + d];         \
                }                                                                             \
                UNROLL for (int i = 0; i < RS; i++) st(b->s + (r0 + i) * width + t * LANES,  \
                                                       acc[i]);                               \
            }                                                                                 \
        for (int r = 0; r < R; r++) { /* softmax over the keys row r sees */                 \
            float *s = b->s + r * width;                                                      \
            const int seen = r / G < n ? pos0 + r / G + 1 : 0;                                \
            float mx = -3.0e38f, sum = 0.f;                                                   \
            for (int t = 0; t < seen; t++) mx = s[t] > mx ? s[t] : mx;                        \
            _Pragma("omp simd reduction(+ : sum)") for (int t = 0; t < seen; t++) {           \
                s[t] = expf(s[t] - mx);                                                       \
                sum += s[t];                                                                  \
            }                                                                                 \
            for (int t = seen; t < width; t++) s[t] = 0.f;                                    \
            b->inv[r] = seen ? 1.f / sum : 0.f;                                               \
        }                                                                                     \
        enum { C = 128 / LANES }; /* most vectors per output row (D <= 128) */                \
        const int c = D / LANES, RB = REGS / c < 1 ? 1 : REGS / c;                            \
        for (int r0 = 0; r0 < R; r0 += RB) { /* pass 2: weights x values */                   \
            vf acc[REGS][C];                                                                  \
            UNROLL for (int i = 0; i < RB; i++) UNROLL for (int j = 0; j < c; j++)            \
                acc[i][j] = (vf){0};                                                          \
            for (int t = 0; t < nk; t++) {                                                    \
                const float *vr = b->vf + (int64_t)t * D;                                     \
                UNROLL for (int j = 0; j < c; j++) {                                          \
                    const vf vv = ld(vr + j * LANES);                                         \
                    UNROLL for (int i = 0; i < RB; i++)                                       \
                        acc[i][j] += vv * b->s[(r0 + i) * width + t];                         \
                }                                                                             \
            }                                                                                 \
            UNROLL for (int i = 0; i < RB; i++) {                                             \
                const int r = r0 + i;                                                         \
                if (r / G >= n) continue;                                                     \
                float o[D];                                                                   \
                UNROLL for (int j = 0; j < c; j++) st(o + j * LANES, acc[i][j]);              \
                STORE(out + ((int64_t)(row0 + r / G) * H + g * G + r % G) * D, o, b->inv[r], \
                      D);                                                                     \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_BLOCK(block_f32, float, widen_f32, store_f32)
DEFINE_BLOCK(block_bf16, bf16, widen_bf16, store_bf16)

/* Whether a head size has a compiled body (tandem.kernels.paged_prefill.HEAD_DIMS). */
static inline int fits(int D) { return (D == 64 || D == 128) && D % LANES == 0; }

/* One work item: span s's query blocks in order over kv head g, each key packed once. */
#define DEFINE_SPAN(NAME, T, PACK, BLOCK)                                                      \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, T *out, int start,       \
                     int count, int len, const int32_t *table, int bs, int H, int KV, int g,  \
                     int D, float scale, buffers *b) {                                        \
        int packed = 0;                                                                       \
        for (int first = 0; first < count; first += QB) {                                     \
            const int n = count - first < QB ? count - first : QB;                            \
            const int pos0 = len - count + first;                                             \
            if (D == 64) {                                                                    \
                PACK(k_cache, v_cache, table, packed, pos0 + n, bs, KV, g, 64, b);            \
                BLOCK(q, out, start + first, n, pos0, H, KV, g, 64, scale, b);                \
            } else {                                                                          \
                PACK(k_cache, v_cache, table, packed, pos0 + n, bs, KV, g, 128, b);           \
                BLOCK(q, out, start + first, n, pos0, H, KV, g, 128, scale, b);               \
            }                                                                                 \
            packed = pos0 + n;                                                                \
        }                                                                                     \
    }

DEFINE_SPAN(span_f32, float, pack_f32, block_f32)
DEFINE_SPAN(span_bf16, bf16, pack_bf16, block_bf16)

/* A span's cost (context x queries) and index: items run costliest first, so the dynamic
 * schedule ends balanced. */
typedef struct {
    int64_t cost;
    int span;
} ranked;

static int costlier(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    return x->cost < y->cost ? 1 : x->cost > y->cost ? -1 : x->span - y->span;
}

#define DEFINE_PREFILL(NAME, T, SPAN)                                                          \
    int NAME(const T *q, const T *k_cache, const T *v_cache, T *out, const int32_t *starts,   \
             const int32_t *counts, const int32_t *lens, const int32_t *tables, int spans,    \
             int max_blocks, int bs, int H, int KV, int D, float scale, int threads) {        \
        if (KV <= 0 || H % KV || !fits(D)) return 1;                                          \
        const int G = H / KV, items = spans * KV;                                             \
        int longest = 0;                                                                      \
        ranked *order = malloc(sizeof(ranked) * (spans > 0 ? spans : 1));                     \
        if (!order) return 2;                                                                 \
        for (int s = 0; s < spans; s++) {                                                     \
            longest = lens[s] > longest ? lens[s] : longest;                                  \
            order[s] = (ranked){(int64_t)lens[s] * counts[s], s};                             \
        }                                                                                     \
        qsort(order, spans, sizeof(ranked), costlier);                                        \
        const int64_t width = (longest + LANES - 1) / LANES * LANES;                          \
        int failed = 0;                                                                       \
        _Pragma("omp parallel num_threads(threads)") {                                        \
            buffers b = {malloc(sizeof(float) * width * D), malloc(sizeof(float) * width * D), \
                         malloc(sizeof(float) * QB * G * width),                              \
                         malloc(sizeof(float) * QB * G * D), malloc(sizeof(float) * QB * G)}; \
            const int ok = b.kt && b.vf && b.s && b.q && b.inv;                               \
            if (!ok) {                                                                        \
                _Pragma("omp atomic write") failed = 1;                                       \
            }                                                                                 \
            _Pragma("omp for schedule(dynamic, 1)") for (int it = 0; it < items; it++) {      \
                if (!ok) continue;                                                            \
                const int s = order[it / KV].span, g = it % KV;                               \
                SPAN(q, k_cache, v_cache, out, starts[s], counts[s], lens[s],                 \
                     tables + (int64_t)s * max_blocks, bs, H, KV, g, D, scale, &b);           \
            }                                                                                 \
            free(b.kt), free(b.vf), free(b.s), free(b.q), free(b.inv);                        \
        }                                                                                     \
        free(order);                                                                          \
        return failed ? 2 : 0;                                                                \
    }

DEFINE_PREFILL(paged_prefill_vec_f32, float, span_f32)
DEFINE_PREFILL(paged_prefill_vec_bf16, bf16, span_bf16)
