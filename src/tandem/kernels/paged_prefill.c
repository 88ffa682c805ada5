/* bfloat16 prefill attention straight from the paged KV cache (tandem.kernels.paged_prefill).
 *
 * Span s has counts[s] query tokens, rows starts[s] .. starts[s] + counts[s] - 1 of q
 * ([T, H, D]); its context is its first lens[s] cached tokens (a cached prefix, then the span's
 * own tokens, already written to the cache by the caller), token t in slot
 * tables[s][t / bs] * bs + t % bs of k_cache / v_cache ([slots, KV, D]). Causal: the span's
 * i-th query token sits at position lens[s] - counts[s] + i and attends the tokens up to it.
 * Query head h reads key/value head h / (H / KV). Output rows go to the same rows of out.
 *
 * Flash attention on AMX (`tdpbf16ps`: bfloat16 pairs multiplied exactly, summed in float32).
 * A work item is (span, kv head, up to QCHUNK query tokens): it lays the keys it needs out once
 * in 16-key tiles in AMX's B layout (a row per (d, d+1) pair, 16 keys of 32 bits) and the
 * values with pairs of keys interleaved (a row per key pair, 16 values of 32 bits), so that
 * both products are tile products with no transposes on the way. Query rows (a token's G
 * heads, then the next token's) go 16 at a time over 32 keys a step: the 16 x 32 scores from
 * tiles, the online softmax (running max and sum, float32) and the 16 x D output accumulators
 * in AVX-512, probabilities rounded to bfloat16 for the value product, as bf16 flash kernels
 * do. Items run longest first over OpenMP threads (torch's pool: the library links torch's
 * libgomp); each thread configures its tiles once per call.
 *
 * Built only where the compiler targets AVX512-F/BW/BF16 and AMX-BF16, and served only where
 * Linux grants the process AMX tile state (`paged_prefill_serves`); elsewhere, and for head
 * sizes other than 64 and 128, torch's attention serves. (An AVX512-BF16 `vdpbf16ps` version
 * of this kernel ran no faster than torch's flash attention here: both at that instruction's
 * rate, ~77 GFLOP/s a core on this VM, against ~200 on tiles.)
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SERVES 1
#include <immintrin.h>
#include <math.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SERVES 0
#endif

#if SERVES

#define TILE 16
#define QCHUNK 32 /* query tokens per work item */
#define NEG (-1e30f)

/* exp(x) for x <= 0 (cephes' expf: 2^n * p(r), |r| <= ln2 / 2; relative error ~1e-7). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline const uint16_t *cached(const uint16_t *cache, const int32_t *table, int t, int bs,
                                     int KV, int kvh, int D) {
    return cache + (((int64_t)table[t / bs] * bs + t % bs) * KV + kvh) * D;
}

/* Keys [0, nk) of one kv head as tiles: kt[tile][p][j] = the (2p, 2p+1) pair of key
 * tile * 16 + j (32 bits); vt[tile][u][c][i] = values 16c + i of keys 2u and 2u + 1 of the tile
 * interleaved. Keys past nk are zero. */
static void lay_out(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                    int nk, int bs, int KV, int kvh, int D, uint32_t *kt, uint16_t *vt) {
    const int half = D / 2, tiles = (nk + 2 * TILE - 1) / (2 * TILE) * 2; /* even: 32-key steps */
    uint32_t rows[TILE * 64];
    const __m512i stride = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(half));
    __m512i lo, hi;
    {
        int16_t a[32], b[32];
        for (int i = 0; i < 16; i++) a[2 * i] = i, a[2 * i + 1] = 32 + i;
        for (int i = 0; i < 16; i++) b[2 * i] = 16 + i, b[2 * i + 1] = 48 + i;
        lo = _mm512_loadu_si512(a);
        hi = _mm512_loadu_si512(b);
    }
    for (int tile = 0; tile < tiles; tile++) {
        const int t0 = tile * TILE;
        for (int j = 0; j < TILE; j++) {
            if (t0 + j < nk)
                memcpy(rows + j * half, cached(k_cache, table, t0 + j, bs, KV, kvh, D), 2 * D);
            else
                memset(rows + j * half, 0, 2 * D);
        }
        uint32_t *kd = kt + (int64_t)tile * half * TILE;
        for (int p = 0; p < half; p++)
            _mm512_storeu_si512(kd + p * TILE, _mm512_i32gather_epi32(stride, rows + p, 4));
        uint16_t *vd = vt + (int64_t)tile * TILE * D;
        for (int u = 0; u < TILE / 2; u++) {
            const int ta = t0 + 2 * u, tb = ta + 1;
            const uint16_t *va = ta < nk ? cached(v_cache, table, ta, bs, KV, kvh, D) : NULL;
            const uint16_t *vb = tb < nk ? cached(v_cache, table, tb, bs, KV, kvh, D) : NULL;
            for (int d = 0; d < D; d += 32) {
                const __m512i a = va ? _mm512_loadu_si512(va + d) : _mm512_setzero_si512();
                const __m512i b = vb ? _mm512_loadu_si512(vb + d) : _mm512_setzero_si512();
                _mm512_storeu_si512(vd + (2 * u * D) + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_storeu_si512(vd + (2 * u * D) + 2 * d + 32,
                                    _mm512_permutex2var_epi16(a, hi, b));
            }
        }
    }
}

/* AMX: tile registers 0-1 hold the scores of 16 query rows against 32 keys, 2 a query tile, 4 a
 * key tile (kt is already the B layout: a row per (2p, 2p+1) pair, 16 keys of 32 bits), 5 the
 * 16 x 32 bfloat16 probabilities, 6 a value tile (vt's rows: 16 values of a key pair), 7 their
 * product. Every tile is 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void tiles_on(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* Whether this process may use AMX tile data (Linux asks each process to request it; torch's
 * oneDNN has usually done so already). */
static int amx_permitted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

int paged_prefill_serves(void) { return amx_permitted(); }

/* Query rows [r0, r0 + rr) of an item (row r: token q0 + r / G, head r % G of kv head kvh),
 * 16 at a time (rows past rr repeat the last and are not stored), over 32 keys a step, the
 * online softmax and the output accumulators (o, 16 x DIM float32) in AVX-512. `first` is the
 * position of the item's first query token. */
#define DEFINE_ROWS(NAME, DIM)                                                                   \
    static void NAME(const uint16_t *q, uint16_t *out, const uint32_t *kt, const uint16_t *vt,   \
                     int64_t row0, int first, int r0, int rr, int G, int H, int kvh,             \
                     float scale) {                                                              \
        enum { C = DIM / 16, HALF = DIM / 2, ROWS = 16, KEYS = 32 };                             \
        _Alignas(64) uint16_t qa[ROWS * DIM];                                                    \
        _Alignas(64) float sb[ROWS * KEYS], o[ROWS * DIM], rb[ROWS * 16];                        \
        _Alignas(64) uint16_t pb[ROWS * KEYS];                                                   \
        uint16_t *orow[ROWS];                                                                    \
        int limit[ROWS], most = 0;                                                               \
        float mx[ROWS], sum[ROWS];                                                               \
        for (int r = 0; r < ROWS; r++) {                                                         \
            const int x = r0 + (r < rr ? r : rr - 1), token = x / G, g = x % G;                  \
            const int64_t at = ((row0 + token) * H + (int64_t)kvh * G + g) * DIM;                \
            memcpy(qa + r * DIM, q + at, 2 * DIM);                                               \
            orow[r] = out + at;                                                                  \
            limit[r] = first + token + 1; /* keys it attends */                                  \
            most = limit[r] > most ? limit[r] : most;                                            \
            mx[r] = NEG;                                                                         \
            sum[r] = 0.f;                                                                        \
        }                                                                                        \
        memset(o, 0, sizeof o);                                                                  \
        const __m512 sc = _mm512_set1_ps(scale);                                                 \
        for (int t0 = 0; t0 < most; t0 += KEYS) {                                                \
            const uint32_t *kd = kt + (int64_t)(t0 / TILE) * HALF * TILE;                        \
            _tile_zero(0);                                                                       \
            _tile_zero(1);                                                                       \
            for (int h = 0; h < DIM / 32; h++) {                                                 \
                _tile_loadd(2, qa + 32 * h, 2 * DIM);                                            \
                _tile_loadd(4, kd + h * 16 * TILE, 64);                                          \
                _tile_dpbf16ps(0, 2, 4);                                                         \
                _tile_loadd(4, kd + HALF * TILE + h * 16 * TILE, 64);                            \
                _tile_dpbf16ps(1, 2, 4);                                                         \
            }                                                                                    \
            _tile_stored(0, sb, 4 * KEYS);                                                       \
            _tile_stored(1, sb + 16, 4 * KEYS);                                                  \
            for (int r = 0; r < ROWS; r++) {                                                     \
                const int valid = limit[r] - t0;                                                 \
                const __mmask16 m0 = valid >= 16 ? 0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1u); \
                const __mmask16 m1 = valid >= 32 ? 0xffff : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1u); \
                const __m512 neg = _mm512_set1_ps(NEG);                                          \
                const __m512 x0 = _mm512_mask_mov_ps(neg, m0, _mm512_mul_ps(_mm512_load_ps(sb + r * KEYS), sc)); \
                const __m512 x1 = _mm512_mask_mov_ps(neg, m1, _mm512_mul_ps(_mm512_load_ps(sb + r * KEYS + 16), sc)); \
                const float here = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));                  \
                const float top = here > mx[r] ? here : mx[r];                                   \
                const __m512 t = _mm512_set1_ps(top);                                            \
                const __m512 p0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(x0, t)));          \
                const __m512 p1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(x1, t)));          \
                const float alpha = expf(mx[r] - top);                                           \
                sum[r] = sum[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));           \
                mx[r] = top;                                                                     \
                _mm512_store_si512(pb + r * KEYS, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));         \
                if (alpha != 1.f) {                                                              \
                    const __m512 a = _mm512_set1_ps(alpha);                                      \
                    for (int c = 0; c < C; c++)                                                  \
                        _mm512_store_ps(o + r * DIM + 16 * c,                                    \
                                        _mm512_mul_ps(_mm512_load_ps(o + r * DIM + 16 * c), a)); \
                }                                                                                \
            }                                                                                    \
            _tile_loadd(5, pb, 2 * KEYS);                                                        \
            for (int c = 0; c < C; c++) {                                                        \
                _tile_zero(7);                                                                   \
                _tile_loadd(6, vt + (int64_t)t0 * DIM + 32 * c, 4 * DIM);                        \
                _tile_dpbf16ps(7, 5, 6);                                                         \
                _tile_stored(7, rb, 64);                                                         \
                for (int r = 0; r < ROWS; r++)                                                   \
                    _mm512_store_ps(o + r * DIM + 16 * c, _mm512_add_ps(_mm512_load_ps(o + r * DIM + 16 * c), \
                                                                        _mm512_load_ps(rb + r * 16))); \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < rr; r++) {                                                           \
            const __m512 inv = _mm512_set1_ps(1.f / sum[r]);                                     \
            for (int c = 0; c < C; c++)                                                          \
                _mm256_storeu_si256((__m256i *)(orow[r] + 16 * c),                               \
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * DIM + 16 * c), inv))); \
        }                                                                                        \
    }

DEFINE_ROWS(rows_64, 64)
DEFINE_ROWS(rows_128, 128)

#else
int paged_prefill_serves(void) { return 0; }
#endif

#if SERVES
typedef struct {
    int span, kvh, q0, q1;
    int64_t cost;
} item_t;

static int by_cost(const void *a, const void *b) {
    const int64_t x = ((const item_t *)a)->cost, y = ((const item_t *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

#endif

/* Returns 0, or -1 when the arguments cannot be served (the caller raises). */
int paged_prefill(const void *q, const void *k_cache, const void *v_cache, void *out,
                  const int32_t *starts, const int32_t *counts, const int32_t *lens,
                  const int32_t *tables, int S, int max_blocks, int bs, int H, int KV, int D,
                  float scale, int nthreads) {
#if SERVES
    if (KV <= 0 || H % KV || (D != 64 && D != 128) || bs <= 0) return -1;
    for (int s = 0; s < S; s++)
        if (counts[s] < 1 || counts[s] > lens[s] || (lens[s] + bs - 1) / bs > max_blocks) return -1;
    if (nthreads < 1) nthreads = 1;
    const int G = H / KV, R = 16;
    int n_items = 0, longest = 1;
    for (int s = 0; s < S; s++) {
        n_items += KV * ((counts[s] + QCHUNK - 1) / QCHUNK);
        longest = lens[s] > longest ? lens[s] : longest;
    }
    item_t *items = malloc(sizeof(item_t) * (n_items > 0 ? n_items : 1));
    if (!items) return -1;
    int at = 0;
    for (int s = 0; s < S; s++)
        for (int q0 = 0; q0 < counts[s]; q0 += QCHUNK) {
            const int q1 = q0 + QCHUNK < counts[s] ? q0 + QCHUNK : counts[s];
            const int64_t keys = lens[s] - counts[s] + (q0 + q1) / 2;
            for (int kvh = 0; kvh < KV; kvh++)
                items[at++] = (item_t){s, kvh, q0, q1, (int64_t)(q1 - q0) * (keys + 1)};
        }
    qsort(items, n_items, sizeof(item_t), by_cost);
    const int64_t tiles = (longest + 2 * TILE - 1) / (2 * TILE) * 2; /* 32-key steps */
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        tiles_on();
        uint32_t *kt = aligned_alloc(64, sizeof(uint32_t) * tiles * TILE * D / 2);
        uint16_t *vt = aligned_alloc(64, sizeof(uint16_t) * tiles * TILE * D);
        if (!kt || !vt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n_items; i++) {
            if (!kt || !vt) continue;
            const item_t it = items[i];
            const int first = lens[it.span] - counts[it.span] + it.q0; /* its first position */
            const int32_t *table = tables + (int64_t)it.span * max_blocks;
            lay_out(k_cache, v_cache, table, first + (it.q1 - it.q0), bs, KV, it.kvh, D, kt, vt);
            const int rows = (it.q1 - it.q0) * G;
            const int64_t row0 = starts[it.span] + it.q0;
            for (int r0 = 0; r0 < rows; r0 += R) {
                const int rr = rows - r0 < R ? rows - r0 : R;
                if (D == 64)
                    rows_64(q, out, kt, vt, row0, first, r0, rr, G, H, it.kvh, scale);
                else
                    rows_128(q, out, kt, vt, row0, first, r0, rr, G, H, it.kvh, scale);
            }
        }
        free(kt);
        free(vt);
        _tile_release();
    }
    free(items);
    return failed ? -1 : 0;
#else
    (void)q, (void)k_cache, (void)v_cache, (void)out, (void)starts, (void)counts, (void)lens;
    (void)tables, (void)S, (void)max_blocks, (void)bs, (void)H, (void)KV, (void)D, (void)scale;
    (void)nthreads;
    return -1;
#endif
}
