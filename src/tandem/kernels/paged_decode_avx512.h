/* AVX-512 bodies of the paged decode kernel for head sizes 64 and 128 (included by
 * paged_decode.c where the compiler targets AVX-512; the portable bodies serve elsewhere).
 *
 * The portable bodies compute each score as one reduced dot product (a horizontal sum per key
 * and query head) and keep the value accumulators in memory. Here a key's dot products with a
 * query head stay as 16-lane partial sums until 16 keys have them, and one transpose-and-add
 * tree turns those into 16 scores (`sum16`); the value accumulators of up to 16 registers'
 * worth of query heads stay in registers across the whole context. bfloat16 keys multiply the
 * bfloat16 query directly where the CPU has AVX512-BF16 (`vdpbf16ps`: exact products, float32
 * sums; the scale applied to the score), else they are widened to float32 as values always are.
 * Results match the portable bodies to float32 rounding (the sums run in another order).
 */
#include <immintrin.h>

#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2 /* how far ahead (16-token tiles) the rows are asked for */
#endif

/* Lane j of the result = the sum of a[j]'s 16 lanes. */
static inline __m512 sum16(const __m512 *a) {
    __m512 t[8], u[4], w0, w1;
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: one partial sum of a[4i .. 4i+3] each */
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Ask for the cached rows (kv heads kv0 <= kvh < kv1) of tokens t .. t + 15 of a context of n
 * (none past n): a context's blocks are scattered over the cache, so the hardware prefetchers,
 * which stop at page edges, do not see the next block coming; without this a decode over a
 * cache larger than L3 ran at half the machine's streaming read bandwidth. */
static inline void prefetch_tile(const char *cache, const int32_t *table, int t, int n, int bs,
                                 size_t row_bytes, size_t off_bytes, size_t bytes) {
    const int end = t + 16 < n ? t + 16 : n;
    for (; t < end; t++) {
        const char *p = cache + ((int64_t)table[t / bs] * bs + t % bs) * row_bytes + off_bytes;
        for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
}

static inline __m512 load_f32x16(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* A key's partial dot products with one query head, float32 query (scaled) by float32 key. */
static inline __m512 dot_f32(const float *qh, const float *k, int dim) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(k));
    for (int c = 16; c < dim; c += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c), _mm512_loadu_ps(k + c), acc);
    return acc;
}

#if defined(__AVX512BF16__)
#define BF16_DOT 1 /* the query stays bfloat16; the scale goes on the score */
/* Partial dot products of a bfloat16 query head and key: pairs multiplied exactly, summed
 * in float32. */
static inline __m512 dot_bf16(const uint16_t *qh, const uint16_t *k, int dim) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < dim; c += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + c),
                               (__m512bh)_mm512_loadu_si512(k + c));
    return acc;
}
#else
#define BF16_DOT 0
#endif

static inline __m512 dot_widened(const float *qh, const uint16_t *k, int dim) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), load_bf16x16(k));
    for (int c = 16; c < dim; c += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c), load_bf16x16(k + c), acc);
    return acc;
}

static inline void store_out_f32(float *o, __m512 x) { _mm512_storeu_ps(o, x); }

static inline void store_out_bf16(uint16_t *o, __m512 x) {
    float tmp[16];
    _mm512_storeu_ps(tmp, x);
    for (int i = 0; i < 16; i++) o[i] = f32_to_bf16(tmp[i]);
}

/* One sequence's kv heads kv0 <= kvh < kv1 over n cached tokens, as DEFINE_DECODE's bodies
 * (same arguments and buffers). QPREP fills qf (float32, scaled) for the dot flavour DOT,
 * whose score is multiplied by SCORE_SCALE; VLOAD reads 16 values; OSTORE writes 16 outputs.
 * Query heads of a kv head go through the values HCH at a time (HCH * DIM / 16 <= 16). */
#define DEFINE_DECODE_AVX512(NAME, T, QT, DIM, QPREP, DOT, SCORE_SCALE, VLOAD, OSTORE)       \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,    \
                     int n, int bs, int KV, int G, int kv0, int kv1, int Dr, float scale,     \
                     float *scores, float *qf, float *acc, T *out) {                          \
        (void)Dr;                                                                             \
        enum { C = DIM / 16, HCH = 16 / C, TILE = 16 };                                                  \
        const int heads = (kv1 - kv0) * G;                                                    \
        const QT *qs = QPREP(q + (int64_t)kv0 * G * DIM, qf, heads * DIM, scale);             \
        const __m512 score_scale = _mm512_set1_ps(SCORE_SCALE);                               \
        const size_t row_bytes = (size_t)KV * DIM * sizeof(T);                                \
        const size_t slice_off = (size_t)kv0 * DIM * sizeof(T);                               \
        const size_t slice_bytes = (size_t)(kv1 - kv0) * DIM * sizeof(T);                     \
        for (int t = 0; t < PREFETCH_TILES * TILE; t += TILE)                                 \
            prefetch_tile((const char *)k_cache, table, t, n, bs, row_bytes, slice_off, slice_bytes); \
        int blk = 0, off = 0; /* the next token's block and place in it */                    \
        for (int t0 = 0; t0 < n; t0 += TILE) {                                                \
            const int m = n - t0 < TILE ? n - t0 : TILE;                                      \
            prefetch_tile((const char *)k_cache, table, t0 + PREFETCH_TILES * TILE, n, bs,    \
                          row_bytes, slice_off, slice_bytes);                                 \
            const T *rows[TILE]; /* each token's cached row (all kv heads) */                 \
            for (int j = 0; j < m; j++) {                                                     \
                rows[j] = k_cache + ((int64_t)table[blk] * bs + off) * KV * DIM;              \
                if (++off == bs) off = 0, blk++;                                              \
            }                                                                                 \
            for (int kvh = kv0; kvh < kv1; kvh++) {                                           \
                const int hbase = (kvh - kv0) * G;                                            \
                for (int g = 0; g < G; g++) {                                                 \
                    const QT *qh = qs + (hbase + g) * DIM;                                    \
                    __m512 part[TILE];                                                        \
                    for (int j = 0; j < TILE; j++)                                            \
                        part[j] = j < m ? DOT(qh, rows[j] + kvh * DIM, DIM) : _mm512_setzero_ps(); \
                    const __m512 s = _mm512_mul_ps(sum16(part), score_scale);                 \
                    _mm512_mask_storeu_ps(scores + (hbase + g) * n + t0,                      \
                                          (__mmask16)((1u << m) - 1u), s);                    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < PREFETCH_TILES * TILE; t += TILE)                                 \
            prefetch_tile((const char *)v_cache, table, t, n, bs, row_bytes, slice_off, slice_bytes); \
        for (int h = 0; h < heads; h++) softmax_(scores + h * n, n);                        \
        for (int i = 0; i < heads * DIM; i++) acc[i] = 0.f;                                  \
        blk = 0, off = 0;                                                                     \
        for (int t0 = 0; t0 < n; t0 += TILE) {                                                \
            const int m = n - t0 < TILE ? n - t0 : TILE;                                      \
            prefetch_tile((const char *)v_cache, table, t0 + PREFETCH_TILES * TILE, n, bs,    \
                          row_bytes, slice_off, slice_bytes);                                 \
            const T *rows[TILE];                                                              \
            for (int j = 0; j < m; j++) {                                                     \
                rows[j] = v_cache + ((int64_t)table[blk] * bs + off) * KV * DIM;              \
                if (++off == bs) off = 0, blk++;                                              \
            }                                                                                 \
            for (int kvh = kv0; kvh < kv1; kvh++) {                                           \
                const int hbase = (kvh - kv0) * G;                                            \
                for (int g0 = 0; g0 < G; g0 += HCH) {                                         \
                    const int hc = G - g0 < HCH ? G - g0 : HCH;                               \
                    float *ah = acc + (hbase + g0) * DIM;                                     \
                    __m512 a[HCH][C];                                                         \
                    for (int i = 0; i < HCH; i++)                                             \
                        for (int c = 0; c < C; c++)                                           \
                            a[i][c] = i < hc ? _mm512_loadu_ps(ah + i * DIM + 16 * c) : _mm512_setzero_ps(); \
                    const float *p = scores + (hbase + g0) * n + t0;                          \
                    for (int j = 0; j < m; j++) {                                             \
                        const T *v = rows[j] + kvh * DIM;                                     \
                        __m512 vf[C];                                                         \
                        for (int c = 0; c < C; c++) vf[c] = VLOAD(v + 16 * c);                \
                        for (int i = 0; i < HCH; i++) {                                       \
                            if (i >= hc) break;                                               \
                            const __m512 pi = _mm512_set1_ps(p[i * n + j]);                   \
                            for (int c = 0; c < C; c++) a[i][c] = _mm512_fmadd_ps(pi, vf[c], a[i][c]); \
                        }                                                                     \
                    }                                                                         \
                    for (int i = 0; i < hc; i++)                                              \
                        for (int c = 0; c < C; c++) _mm512_storeu_ps(ah + i * DIM + 16 * c, a[i][c]); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < heads; h++)                                                       \
            for (int c = 0; c < C; c++)                                                       \
                OSTORE(out + (int64_t)(kv0 * G + h) * DIM + 16 * c, _mm512_loadu_ps(acc + h * DIM + 16 * c)); \
    }

/* float32 query, scaled, into qf (as the portable bodies). */
static inline const float *prep_scaled_f32(const float *q, float *qf, int count, float scale) {
    for (int i = 0; i < count; i++) qf[i] = q[i] * scale;
    return qf;
}

static inline const float *prep_scaled_bf16(const uint16_t *q, float *qf, int count, float scale) {
    for (int i = 0; i < count; i++) qf[i] = bf16_to_f32(q[i]) * scale;
    return qf;
}

#if BF16_DOT
static inline const uint16_t *prep_raw_bf16(const uint16_t *q, float *qf, int count, float scale) {
    (void)qf;
    (void)count;
    (void)scale;
    return q;
}
#endif
