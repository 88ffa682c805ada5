/* AVX-512 bodies of the paged decode kernel for head sizes 64 and 128 (included by
 * paged_decode.c where the compiler targets AVX-512; the portable bodies serve elsewhere).
 *
 * The portable bodies compute each score as one reduced dot product (a horizontal sum per key
 * and query head) and keep the value accumulators in memory. Here the cache is read in row
 * order: each token's row (every kv head of the work item) front to back, for the keys and
 * again for the values, so that over a context of adjacent blocks the reads are one stream the
 * hardware prefetchers follow (reading one kv head of 16 rows, then the next, ran ~30% slower
 * from memory). A key's dot products with its query heads stay as 16-lane partial sums until
 * 16 of them are there, and one transpose-and-add tree turns those into 16 scores (`sum16`);
 * the value sums of up to 32 registers' worth of query heads (all 8 of a 64-wide row of 4 kv
 * heads) are kept across each 16-token tile. bfloat16 keys multiply the bfloat16 query
 * directly where the CPU has AVX512-BF16 (`vdpbf16ps`: exact products, float32 sums; the scale
 * applied to the score), else they are widened to float32 as values always are. Results match
 * the portable bodies to float32 rounding (the sums run in another order).
 */
#include <immintrin.h>

#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1 /* how far ahead (16-token tiles) the rows are asked for */
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
 * (none past n) that start a block away from the previous one. Within a block, and from a
 * block to the one right after it, the rows are read front to back and the hardware
 * prefetchers follow; at a jump they stop, and a context's blocks may be anywhere in the
 * cache. 64 sequences of 170 tokens over 8 layers' caches (past L3), 2 threads: 16-17 GB/s
 * with every row prefetched two tiles ahead, 25 with the jumps only, one tile ahead, on
 * adjacent blocks; 17-19 on scattered or reversed ones (docs/benchmarks.md). */
static inline void prefetch_tile(const char *cache, const int32_t *table, int t, int n, int bs,
                                 size_t row_bytes, size_t off_bytes, size_t bytes) {
    const int end = t + 16 < n ? t + 16 : n;
    for (; t < end; t++) {
        const int blk = t / bs;
        if (blk > 0 && table[blk] == table[blk - 1] + 1) continue;
        const char *p = cache + ((int64_t)table[blk] * bs + t % bs) * row_bytes + off_bytes;
        for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
}

static inline __m512 load_f32x16(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* For query heads first .. first + count - 1 of a work item (G query heads a kv head, its kv
 * heads' rows from offset base): off[i] = the offset of head first + i's kv head in a cached
 * row, fresh[i] = whether that kv head differs from the previous head's (i = 0 always): where
 * a row's next kv head is read. One division, the rest counted. */
static inline void kv_heads_of(int first, int count, int G, int base, int dim, int *off,
                               int *fresh) {
    int kvh = first / G, g = first - kvh * G;
    for (int i = 0; i < count; i++) {
        off[i] = base + kvh * dim;
        fresh[i] = i == 0 || g == 0;
        if (++g == G) g = 0, kvh++;
    }
}

#if defined(__AVX512BF16__)
#define BF16_DOT 1 /* the query stays bfloat16; the scale goes on the score */
#else
#define BF16_DOT 0
#endif

/* The scores of S <= 16 query heads (qs: S heads of DIM, contiguous; head h reads kv head
 * (hfirst + h) / G at row offset kbase) against m <= 16 cached keys (rows[j]), head h's into
 * dst[h * n + j]. A key's row is read front to back, each kv head once for its query heads
 * (the hardware prefetchers follow a row-ordered read; one kv head of every row, then the next,
 * read ~30% slower from memory). Dot products stay as 16-lane partial sums until KB = 16 / SP
 * keys have them (SP: S rounded up to a power of two), and one `sum16` turns the 16 partial
 * sums into 16 scores (lane h * KB + j: head h, key j). Flavours: keys_f32 (float32 query and
 * keys), keys_widened (float32 query, bfloat16 keys widened), keys_bf16 (bfloat16 query and
 * keys: vdpbf16ps, exact products summed in float32). */
#define DEFINE_KEYS(NAME, T, QT, R, LANES, LOAD_Q, LOAD_K, MAC)                               \
    static inline __attribute__((always_inline)) void NAME##_sp(                              \
        const QT *qs, const T *const *rows, int kbase, int hfirst, int S, int G, int m,       \
        float *dst, int n, __m512 scale, const int DIM, const int SP) {                       \
        const int KC = DIM / LANES, KB = 16 / SP;                                             \
        int koff[16], fresh[16]; /* head h's key offset; whether it starts a kv head */       \
        kv_heads_of(hfirst, S, G, kbase, DIM, koff, fresh);                                   \
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); \
        for (int j0 = 0; j0 < m; j0 += KB) {                                                  \
            __m512 part[16];                                                                  \
            for (int jj = 0; jj < KB; jj++) {                                                 \
                const int live = j0 + jj < m;                                                 \
                R kr[128 / LANES];                                                            \
                for (int h = 0; h < SP; h++) {                                                \
                    __m512 acc = _mm512_setzero_ps();                                         \
                    if (live && h < S) {                                                      \
                        if (fresh[h])                                                         \
                            for (int c = 0; c < KC; c++)                                      \
                                kr[c] = LOAD_K(rows[j0 + jj] + koff[h] + c * LANES);          \
                        for (int c = 0; c < KC; c++)                                          \
                            acc = MAC(acc, LOAD_Q(qs + (h * KC + c) * LANES), kr[c]);         \
                    }                                                                         \
                    part[h * KB + jj] = acc;                                                  \
                }                                                                             \
            }                                                                                 \
            const __m512 s = _mm512_mul_ps(sum16(part), scale);                               \
            const __mmask16 valid = (__mmask16)((1u << (m - j0 < KB ? m - j0 : KB)) - 1u);    \
            for (int h = 0; h < SP; h++)                                                      \
                if (h < S)                                                                    \
                    _mm512_mask_storeu_ps(                                                    \
                        dst + h * n + j0, valid,                                              \
                        _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(h * KB)), s)); \
        }                                                                                     \
    }                                                                                         \
    /* All S query heads of a slice (chunks of 16) against m <= 16 keys, as NAME##_sp. */     \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const QT *qs, const T *const *rows, int kbase, int S, int G, int m, float *dst,       \
        int n, __m512 scale, const int DIM) {                                                 \
        for (int h0 = 0; h0 < S; h0 += 16) {                                                  \
            const int sc = S - h0 < 16 ? S - h0 : 16;                                         \
            const QT *qc = qs + (int64_t)h0 * DIM;                                            \
            float *dc = dst + (int64_t)h0 * n;                                                \
            if (sc > 8) NAME##_sp(qc, rows, kbase, h0, sc, G, m, dc, n, scale, DIM, 16);      \
            else if (sc > 4) NAME##_sp(qc, rows, kbase, h0, sc, G, m, dc, n, scale, DIM, 8);  \
            else if (sc > 2) NAME##_sp(qc, rows, kbase, h0, sc, G, m, dc, n, scale, DIM, 4);  \
            else if (sc > 1) NAME##_sp(qc, rows, kbase, h0, sc, G, m, dc, n, scale, DIM, 2);  \
            else NAME##_sp(qc, rows, kbase, h0, sc, G, m, dc, n, scale, DIM, 1);              \
        }                                                                                     \
    }

#define MAC_F32(acc, q, k) _mm512_fmadd_ps(q, k, acc)
DEFINE_KEYS(keys_f32, float, float, __m512, 16, _mm512_loadu_ps, _mm512_loadu_ps, MAC_F32)
DEFINE_KEYS(keys_widened, uint16_t, float, __m512, 16, _mm512_loadu_ps, load_bf16x16, MAC_F32)
#if BF16_DOT
#define LOAD_BF16X32(p) ((__m512bh)_mm512_loadu_si512(p))
DEFINE_KEYS(keys_bf16, uint16_t, uint16_t, __m512bh, 32, LOAD_BF16X32, LOAD_BF16X32,
            _mm512_dpbf16_ps)
#endif

static inline void store_out_f32(float *o, __m512 x) { _mm512_storeu_ps(o, x); }

static inline void store_out_bf16(uint16_t *o, __m512 x) {
    float tmp[16];
    _mm512_storeu_ps(tmp, x);
    for (int i = 0; i < 16; i++) o[i] = f32_to_bf16(tmp[i]);
}

/* One sequence's kv heads kv0 <= kvh < kv1 over n cached tokens, as DEFINE_DECODE's bodies
 * (same arguments and buffers). QPREP fills qf (float32, scaled) for KEYS (a DEFINE_KEYS
 * flavour), whose scores are multiplied by SCORE_SCALE; VLOAD reads 16 values; OSTORE writes
 * 16 outputs. The values go to the query heads HCH at a time (HCH * DIM / 16 = 32 sums: a
 * few spill to the stack, which cost less than reading a row in two passes). */
#define DEFINE_DECODE_AVX512(NAME, T, QT, DIM, QPREP, KEYS, SCORE_SCALE, VLOAD, OSTORE)       \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,    \
                     int n, int bs, int KV, int G, int kv0, int kv1, int Dr, float scale,     \
                     float *scores, float *qf, float *acc, T *out) {                          \
        (void)Dr;                                                                             \
        enum { C = DIM / 16, HCH = 32 / C, TILE = 16 };                                       \
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
            KEYS(qs, rows, kv0 * DIM, heads, G, m, scores + t0, n, score_scale, DIM);         \
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
            for (int h0 = 0; h0 < heads; h0 += HCH) { /* HCH heads' sums in registers */     \
                const int hc = heads - h0 < HCH ? heads - h0 : HCH;                           \
                float *ah = acc + h0 * DIM;                                                   \
                int voff[HCH], fresh[HCH]; /* head's value offset; starts a kv head */        \
                kv_heads_of(h0, hc, G, kv0 * DIM, DIM, voff, fresh);                          \
                __m512 a[HCH][C];                                                             \
                for (int i = 0; i < HCH; i++)                                                 \
                    for (int c = 0; c < C; c++)                                               \
                        a[i][c] = i < hc ? _mm512_loadu_ps(ah + i * DIM + 16 * c) : _mm512_setzero_ps(); \
                const float *p = scores + (int64_t)h0 * n + t0;                               \
                for (int j = 0; j < m; j++) {                                                 \
                    __m512 vf[C];                                                             \
                    for (int i = 0; i < HCH; i++) {                                           \
                        if (i >= hc) break;                                                   \
                        if (fresh[i])                                                         \
                            for (int c = 0; c < C; c++) vf[c] = VLOAD(rows[j] + voff[i] + 16 * c); \
                        const __m512 pi = _mm512_set1_ps(p[i * n + j]);                       \
                        for (int c = 0; c < C; c++) a[i][c] = _mm512_fmadd_ps(pi, vf[c], a[i][c]); \
                    }                                                                         \
                }                                                                             \
                for (int i = 0; i < hc; i++)                                                  \
                    for (int c = 0; c < C; c++) _mm512_storeu_ps(ah + i * DIM + 16 * c, a[i][c]); \
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
