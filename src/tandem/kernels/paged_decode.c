/* Decode attention straight from the paged KV cache (tandem.kernels.paged).
 *
 * One query token per sequence. Sequence i's query is row rows[i] of q ([T, H, D]); its
 * context is its first lens[i] cached tokens, token t in slot tables[i][t / bs] * bs + t % bs
 * of k_cache / v_cache ([slots, KV, D]). Its output goes to row rows[i] of out ([T, H, D]).
 * Query head h reads key/value head h / (H / KV) (grouped-query attention). Nothing is
 * gathered or padded: every cached key and value is read in place, once per (sequence, kv
 * head), and the G = H / KV query heads of a kv head share each read.
 *
 * Softmax in float32 (scores, max, sum), values accumulated in float32; bfloat16 inputs are
 * widened on load and the output rounded to nearest even. Built with -ffast-math so that the
 * exponentials vectorize (glibc's libmvec); nothing here relies on infinities or NaNs.
 * Sequences are split over OpenMP threads in contiguous runs (the caller sorts sequences that
 * share cached blocks next to each other, so a shared prompt is read from memory once per
 * thread); the library links the libgomp torch has loaded, so it runs on torch's threads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64 /* query heads per kv head (tandem.kernels.paged.MAX_GROUP) */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even (values are finite) */
    return (uint16_t)(bits >> 16);
}

static inline void store_f32(float *o, const float *acc, int D) { memcpy(o, acc, sizeof(float) * D); }

static inline void store_bf16(uint16_t *o, const float *acc, int D) {
    for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[d]);
}

/* One (sequence, kv head): G query heads of dimension DIM over n context tokens. `scores`
 * holds G * n floats, `qf` and `acc` G * DIM. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, DIM)                                              \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,    \
                     int n, int bs, int KV, int G, int kvh, int Dr, float scale,               \
                     float *scores, float *qf, float *acc, T *out) {                           \
        const int D = DIM > 0 ? DIM : Dr;                                                     \
        for (int g = 0; g < G; g++)                                                           \
            for (int d = 0; d < D; d++) qf[g * D + d] = LOAD(q[(kvh * G + g) * D + d]) * scale; \
        const int blocks = (n + bs - 1) / bs;                                                 \
        for (int b = 0; b < blocks; b++) {                                                    \
            const int64_t first = (int64_t)table[b] * bs;                                     \
            const int m = n - b * bs < bs ? n - b * bs : bs;                                  \
            for (int j = 0; j < m; j++) {                                                     \
                const T *k = k_cache + ((first + j) * KV + kvh) * D;                          \
                for (int g = 0; g < G; g++) {                                                 \
                    const float *qg = qf + g * D;                                             \
                    float s = 0.f;                                                            \
                    _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < D; d++) s +=     \
                        qg[d] * LOAD(k[d]);                                                   \
                    scores[g * n + b * bs + j] = s;                                           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            float *sg = scores + g * n;                                                       \
            float mx = -FLT_MAX;                                                              \
            for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;                         \
            float sum = 0.f;                                                                  \
            _Pragma("omp simd reduction(+ : sum)") for (int t = 0; t < n; t++) {              \
                sg[t] = expf(sg[t] - mx);                                                     \
                sum += sg[t];                                                                 \
            }                                                                                 \
            const float inv = 1.f / sum;                                                      \
            _Pragma("omp simd") for (int t = 0; t < n; t++) sg[t] *= inv;                     \
        }                                                                                     \
        memset(acc, 0, sizeof(float) * G * D);                                                \
        for (int b = 0; b < blocks; b++) {                                                    \
            const int64_t first = (int64_t)table[b] * bs;                                     \
            const int m = n - b * bs < bs ? n - b * bs : bs;                                  \
            for (int j = 0; j < m; j++) {                                                     \
                const T *v = v_cache + ((first + j) * KV + kvh) * D;                          \
                for (int g = 0; g < G; g++) {                                                 \
                    const float p = scores[g * n + b * bs + j];                               \
                    float *ag = acc + g * D;                                                  \
                    _Pragma("omp simd") for (int d = 0; d < D; d++) ag[d] += p * LOAD(v[d]);  \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < G; g++) STORE(out + (kvh * G + g) * D, acc + g * D, D);           \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_DECODE(f32_64, float, LOAD_F32, store_f32, 64)
DEFINE_DECODE(f32_128, float, LOAD_F32, store_f32, 128)
DEFINE_DECODE(f32_any, float, LOAD_F32, store_f32, 0)
DEFINE_DECODE(bf16_64, uint16_t, LOAD_BF16, store_bf16, 64)
DEFINE_DECODE(bf16_128, uint16_t, LOAD_BF16, store_bf16, 128)
DEFINE_DECODE(bf16_any, uint16_t, LOAD_BF16, store_bf16, 0)

typedef void (*decode_f32_fn)(const float *, const float *, const float *, const int32_t *, int,
                              int, int, int, int, int, float, float *, float *, float *, float *);
typedef void (*decode_bf16_fn)(const uint16_t *, const uint16_t *, const uint16_t *,
                               const int32_t *, int, int, int, int, int, int, float, float *,
                               float *, float *, uint16_t *);

/* Returns 0, or -1 when the arguments cannot be served (the caller raises). */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out,
                 const int64_t *rows, const int32_t *tables, const int32_t *lens, int B,
                 int max_blocks, int bs, int H, int KV, int D, float scale, int bf16,
                 int nthreads) {
    if (KV <= 0 || H % KV || H / KV > MAX_GROUP || D <= 0 || bs <= 0) return -1;
    int longest = 1;
    for (int i = 0; i < B; i++) longest = lens[i] > longest ? lens[i] : longest;
    const int G = H / KV;
    decode_f32_fn f32 = D == 64 ? f32_64 : D == 128 ? f32_128 : f32_any;
    decode_bf16_fn b16 = D == 64 ? bf16_64 : D == 128 ? bf16_128 : bf16_any;
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)G * longest);
        float *qf = malloc(sizeof(float) * (size_t)G * D);
        float *acc = malloc(sizeof(float) * (size_t)G * D);
        const int ok = scores && qf && acc;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (int i = 0; i < B; i++) {
            for (int kvh = 0; kvh < KV; kvh++) {
                if (!ok || lens[i] <= 0) continue;
                const int32_t *table = tables + (int64_t)i * max_blocks;
                const int64_t row = rows[i] * H * D;
                if (bf16)
                    b16((const uint16_t *)q + row, k_cache, v_cache, table, lens[i], bs, KV, G,
                        kvh, D, scale, scores, qf, acc, (uint16_t *)out + row);
                else
                    f32((const float *)q + row, k_cache, v_cache, table, lens[i], bs, KV, G, kvh,
                        D, scale, scores, qf, acc, (float *)out + row);
            }
        }
        free(scores);
        free(qf);
        free(acc);
    }
    return failed ? -1 : 0;
}
