/* Decode attention straight from the paged KV cache (tandem.kernels.paged).
 *
 * One query token per sequence. Sequence i's query is row rows[i] of q ([T, H, D], rows
 * q_stride elements apart, each row's heads contiguous: a view of the fused qkv output); its
 * context is its first lens[i] cached tokens, token t in slot tables[i][t / bs] * bs + t % bs
 * of k_cache / v_cache ([slots, KV, D]). Its output goes to row rows[i] of out ([T, H, D]).
 * Query head h reads key/value head h / (H / KV) (grouped-query attention). Nothing is
 * gathered or padded: every cached key and value is read in place, once per (sequence, kv
 * head), and the G = H / KV query heads of a kv head share each read.
 *
 * Softmax in float32 (scores, max, sum), values accumulated in float32; bfloat16 inputs are
 * widened on load and the output rounded to nearest even. Built with -ffast-math so that the
 * exponentials vectorize (glibc's libmvec); nothing here relies on infinities or NaNs.
 * Sequences are split over OpenMP threads in contiguous runs of about equal context tokens
 * (the caller sorts sequences that share cached blocks next to each other, so a shared prompt
 * is read from memory once per thread); the library links the libgomp torch has loaded, so
 * it runs on torch's threads.
 * Head sizes 64 and 128 take the AVX-512 bodies of paged_decode_avx512.h where the compiler
 * targets AVX-512 (16-token tiles, scores summed in registers, bf16 dot products where the CPU
 * has AVX512-BF16); the portable bodies below serve every other case.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 64 /* query heads per kv head (tandem.kernels.paged.MAX_GROUP) */
#define MAX_DIM 1024 /* head size (tandem.kernels.paged.MAX_HEAD_DIM) */

static inline void store_f32(float *o, const float *acc, int D) { memcpy(o, acc, sizeof(float) * D); }

static inline void store_bf16(uint16_t *o, const float *acc, int D) {
    for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[d]);
}

/* In place: s[0..n) -> softmax(s) (float32, max subtracted first). */
static inline void softmax_(float *s, int n) {
    float mx = -FLT_MAX;
    for (int t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int t = 0; t < n; t++) s[t] *= inv;
}

/* A cached row as float32: bfloat16 widened into `buf` (D floats), float32 read in place. */
#define WIDEN_F32(src, buf, D) (src)

static inline const float *widen_bf16(const uint16_t *src, float *buf, int D) {
    for (int d = 0; d < D; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* One sequence, kv heads kv0 <= kvh < kv1 (each with its G query heads) of dimension DIM,
 * over n context tokens. Each cached token's heads are read together, front to back: a
 * block's rows are contiguous, so the loads stream. `scores` holds (kv1 - kv0) * G * n
 * floats, `qf` and `acc` (kv1 - kv0) * G * DIM. */
#define DEFINE_DECODE(NAME, T, LOAD, WIDEN, STORE, DIM)                                       \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,    \
                     int n, int bs, int KV, int G, int kv0, int kv1, int Dr, float scale,     \
                     float *scores, float *qf, float *acc, T *out) {                           \
        const int D = DIM > 0 ? DIM : Dr;                                                     \
        const int heads = (kv1 - kv0) * G; /* query heads served, from head kv0 * G */        \
        float row[DIM > 0 ? DIM : MAX_DIM];                                                   \
        for (int h = 0; h < heads; h++)                                                       \
            for (int d = 0; d < D; d++) qf[h * D + d] = LOAD(q[(kv0 * G + h) * D + d]) * scale; \
        const int blocks = (n + bs - 1) / bs;                                                 \
        for (int b = 0; b < blocks; b++) {                                                    \
            const int64_t first = (int64_t)table[b] * bs;                                     \
            const int m = n - b * bs < bs ? n - b * bs : bs;                                  \
            for (int j = 0; j < m; j++) {                                                     \
                for (int kvh = kv0; kvh < kv1; kvh++) {                                       \
                    const float *k = WIDEN(k_cache + ((first + j) * KV + kvh) * D, row, D);   \
                    for (int h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; h++) {             \
                        const float *qh = qf + h * D;                                         \
                        float s = 0.f;                                                        \
                        _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < D; d++) s += \
                            qh[d] * k[d];                                                     \
                        scores[h * n + b * bs + j] = s;                                       \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < heads; h++) softmax_(scores + h * n, n);                        \
        memset(acc, 0, sizeof(float) * heads * D);                                            \
        for (int b = 0; b < blocks; b++) {                                                    \
            const int64_t first = (int64_t)table[b] * bs;                                     \
            const int m = n - b * bs < bs ? n - b * bs : bs;                                  \
            for (int j = 0; j < m; j++) {                                                     \
                for (int kvh = kv0; kvh < kv1; kvh++) {                                       \
                    const float *v = WIDEN(v_cache + ((first + j) * KV + kvh) * D, row, D);   \
                    for (int h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; h++) {             \
                        const float p = scores[h * n + b * bs + j];                           \
                        float *ah = acc + h * D;                                              \
                        _Pragma("omp simd") for (int d = 0; d < D; d++) ah[d] += p * v[d];    \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < heads; h++) STORE(out + (kv0 * G + h) * D, acc + h * D, D);       \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_DECODE(f32_64, float, LOAD_F32, WIDEN_F32, store_f32, 64)
DEFINE_DECODE(f32_128, float, LOAD_F32, WIDEN_F32, store_f32, 128)
DEFINE_DECODE(f32_any, float, LOAD_F32, WIDEN_F32, store_f32, 0)
DEFINE_DECODE(bf16_64, uint16_t, LOAD_BF16, widen_bf16, store_bf16, 64)
DEFINE_DECODE(bf16_128, uint16_t, LOAD_BF16, widen_bf16, store_bf16, 128)
DEFINE_DECODE(bf16_any, uint16_t, LOAD_BF16, widen_bf16, store_bf16, 0)

#if defined(__AVX512F__)
#include "paged_decode_avx512.h"
DEFINE_DECODE_AVX512(f32_64_v, float, float, 64, prep_scaled_f32, keys_f32, 1.f, load_f32x16,
                     store_out_f32)
DEFINE_DECODE_AVX512(f32_128_v, float, float, 128, prep_scaled_f32, keys_f32, 1.f, load_f32x16,
                     store_out_f32)
#if BF16_DOT
DEFINE_DECODE_AVX512(bf16_64_v, uint16_t, uint16_t, 64, prep_raw_bf16, keys_bf16, scale,
                     load_bf16x16, store_out_bf16)
DEFINE_DECODE_AVX512(bf16_128_v, uint16_t, uint16_t, 128, prep_raw_bf16, keys_bf16, scale,
                     load_bf16x16, store_out_bf16)
#else
DEFINE_DECODE_AVX512(bf16_64_v, uint16_t, float, 64, prep_scaled_bf16, keys_widened, 1.f,
                     load_bf16x16, store_out_bf16)
DEFINE_DECODE_AVX512(bf16_128_v, uint16_t, float, 128, prep_scaled_bf16, keys_widened, 1.f,
                     load_bf16x16, store_out_bf16)
#endif
#define F32_64 f32_64_v
#define F32_128 f32_128_v
#define BF16_64 bf16_64_v
#define BF16_128 bf16_128_v
#else
#define F32_64 f32_64
#define F32_128 f32_128
#define BF16_64 bf16_64
#define BF16_128 bf16_128
#endif

typedef void (*decode_f32_fn)(const float *, const float *, const float *, const int32_t *, int,
                              int, int, int, int, int, int, float, float *, float *, float *,
                              float *);
typedef void (*decode_bf16_fn)(const uint16_t *, const uint16_t *, const uint16_t *,
                               const int32_t *, int, int, int, int, int, int, int, float, float *,
                               float *, float *, uint16_t *);

/* Returns 0, or -1 when the arguments cannot be served (the caller raises). Work items are
 * (sequence, slice of kv heads): every kv head of a sequence together when there are enough
 * sequences to keep the threads busy, else the heads split so that one sequence (batch 1)
 * still runs on every thread. */
int paged_decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                 void *out, const int64_t *rows, const int32_t *tables, const int32_t *lens, int B,
                 int max_blocks, int bs, int H, int KV, int D, float scale, int bf16,
                 int nthreads) {
    if (KV <= 0 || H % KV || H / KV > MAX_GROUP || D <= 0 || D > MAX_DIM || bs <= 0) return -1;
    if (nthreads < 1) nthreads = 1;
    int longest = 1;
    for (int i = 0; i < B; i++) longest = lens[i] > longest ? lens[i] : longest;
    const int G = H / KV;
    int slices = B > 0 ? (2 * nthreads + B - 1) / B : 1; /* kv-head slices per sequence */
    if (slices > KV) slices = KV;
    const int per_slice = (KV + slices - 1) / slices;
    slices = (KV + per_slice - 1) / per_slice;
    decode_f32_fn f32 = D == 64 ? F32_64 : D == 128 ? F32_128 : f32_any;
    decode_bf16_fn b16 = D == 64 ? BF16_64 : D == 128 ? BF16_128 : bf16_any;
    int failed = 0;
    int64_t total = 0;
    for (int i = 0; i < B; i++) total += (int64_t)(lens[i] > 0 ? lens[i] : 0) * slices;
#pragma omp parallel num_threads(nthreads)
    {
        const size_t heads = (size_t)per_slice * G;
        float *scores = malloc(sizeof(float) * heads * longest);
        float *qf = malloc(sizeof(float) * heads * D);
        float *acc = malloc(sizeof(float) * heads * D);
        const int ok = scores && qf && acc;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* this thread's contiguous run of work items (i, s), balanced by the tokens they read:
         * an item belongs to the thread whose share holds its middle */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t share0 = total * me / nt, share1 = total * (me + 1) / nt;
        int64_t before = 0;
        for (int w = 0; w < B * slices && ok; w++) {
            const int i = w / slices, s = w % slices;
            if (lens[i] <= 0) continue;
            const int64_t mid = before + lens[i] / 2;
            before += lens[i];
            if (mid < share0 || mid >= share1) continue;
            const int kv0 = s * per_slice, kv1 = kv0 + per_slice < KV ? kv0 + per_slice : KV;
            const int32_t *table = tables + (int64_t)i * max_blocks;
            const int64_t qrow = rows[i] * q_stride, row = rows[i] * H * D;
            if (bf16)
                b16((const uint16_t *)q + qrow, k_cache, v_cache, table, lens[i], bs, KV, G, kv0,
                    kv1, D, scale, scores, qf, acc, (uint16_t *)out + row);
            else
                f32((const float *)q + qrow, k_cache, v_cache, table, lens[i], bs, KV, G, kv0,
                    kv1, D, scale, scores, qf, acc, (float *)out + row);
        }
        free(scores);
        free(qf);
        free(acc);
    }
    return failed ? -1 : 0;
}
