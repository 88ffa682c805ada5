/* The elements that differ between two arrays of 1-, 2- or 4-byte values, as int32 flat
 * indices in ascending order (tandem.kernels.delta): what a delta push encodes
 * (tandem.exchange.delta). Each returns how many differ and writes at most ``cap`` of them.
 *
 * numpy finds them in two passes (a bool mask, then np.flatnonzero) at ~0.7 ns an element;
 * here one pass compares 32 or 64 values at a time (AVX-512BW: a mask per vector) and walks
 * the set bits of each mask, so the cost is one read of both arrays plus one step per
 * difference. Without AVX-512BW the loop compares element by element.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Each set bit of ``mask`` is a difference at base + its position: written while there is
 * room (``cap``), counted always. */
#define WALK(mask, base)                                                \
    while (mask) {                                                      \
        if (k < cap) idx[k] = (int32_t)((base) + __builtin_ctzll(mask)); \
        k++;                                                            \
        mask &= mask - 1;                                               \
    }
#define TAIL                        \
    for (; i < n; i++)              \
        if (a[i] != b[i]) {         \
            if (k < cap) idx[k] = (int32_t)i; \
            k++;                    \
        }

/* One function per width: 64, 32 or 16 values compared per AVX-512 vector, then the tail. */
#if defined(__AVX512BW__)
#define VECTOR(STEP, CMP)                                                           \
    for (; i + (STEP) <= n; i += (STEP)) {                                          \
        uint64_t m = CMP(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i)); \
        WALK(m, i)                                                                  \
    }
#else
#define VECTOR(STEP, CMP)
#endif
#define CHANGED(NAME, T, STEP, CMP)                                                      \
    int64_t NAME(const T *a, const T *b, int64_t n, int32_t *idx, int64_t cap) {         \
        int64_t k = 0, i = 0;                                                            \
        VECTOR(STEP, CMP)                                                                \
        TAIL                                                                             \
        return k;                                                                        \
    }

CHANGED(changed8, uint8_t, 64, _mm512_cmpneq_epi8_mask)
CHANGED(changed16, uint16_t, 32, _mm512_cmpneq_epi16_mask)
CHANGED(changed32, uint32_t, 16, _mm512_cmpneq_epi32_mask)

/* torch's float32 -> bfloat16 on the CPU (its vectorized conversion, which `Tensor.to` runs):
 * to nearest even, any NaN to 0xffff. */
static inline uint16_t to_bf16(uint32_t bits) {
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* One contiguous run of a float32 box: its ``n`` elements (``src``) are the box's elements
 * ``at`` .. ``at + n`` (the shadow's and the bitmap's positions), each rounded as torch rounds,
 * compared with the shadow and written into it; the changed ones marked in ``bitmap`` (bit j
 * of byte i is element 8i + j), their values appended to ``vals`` from ``k`` on and their
 * positions plus ``base`` to ``idx`` while there is room (``cap``). Returns the new count.
 * The vector path runs where ``at`` is a multiple of 8 (each vector of 16 then owns two
 * bitmap bytes), the scalar one elsewhere. */
static int64_t encode_run(const float *src, int64_t n, uint16_t *shadow, uint8_t *bitmap,
                          int64_t at, uint16_t *vals, int32_t *idx, int64_t cap, int64_t base,
                          int64_t k) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i qnan = _mm512_set1_epi32((int)0xffff0000u);
#if defined(__AVX512VBMI2__)
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    for (; at % 8 == 0 && i + 16 <= n; i += 16) {
        int64_t p = at + i;
        __m512i b = _mm512_loadu_si512(src + i);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
        __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(half, lsb));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, abs), inf);
        r = _mm512_mask_mov_epi32(r, nan, qnan);
        __m256i v = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
        __m256i old = _mm256_loadu_si256((const __m256i *)(shadow + p));
        __mmask16 m = _mm256_cmpneq_epi16_mask(v, old);
        uint16_t bits16 = (uint16_t)m;
        memcpy(bitmap + (p >> 3), &bits16, 2);
        if (!m) continue;  /* nothing written: an unchanged line is not written back */
        _mm256_storeu_si256((__m256i *)(shadow + p), v);
#if defined(__AVX512VBMI2__)
        /* compressed in a register, then stored whole: a compress straight to memory is
         * microcoded on some CPUs (AMD Zen 4: ~20x slower). k <= p, and vals has room for
         * every element, so 16 values fit. */
        _mm256_storeu_si256((__m256i *)(vals + k), _mm256_maskz_compress_epi16(m, v));
        int64_t got = __builtin_popcount(m);
        if (k + 16 <= cap) {
            __m512i where = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(base + p)), lane);
            _mm512_storeu_si512(idx + k, _mm512_maskz_compress_epi32(m, where));
        } else {
            uint64_t w = m;
            for (int64_t j = k; w; j++, w &= w - 1)
                if (j < cap) idx[j] = (int32_t)(base + p + __builtin_ctzll(w));
        }
        k += got;
#else
        uint64_t w = m;
        while (w) {
            int j = __builtin_ctzll(w);
            vals[k] = shadow[p + j];
            if (k < cap) idx[k] = (int32_t)(base + p + j);
            k++;
            w &= w - 1;
        }
#endif
    }
#endif
    for (; i < n; i++) {
        int64_t p = at + i;
        uint32_t bits;
        memcpy(&bits, src + i, 4);
        uint16_t v = to_bf16(bits);
        if (v != shadow[p]) {
            bitmap[p >> 3] |= (uint8_t)(1u << (p & 7));
            vals[k] = v;
            if (k < cap) idx[k] = (int32_t)(base + p);
            k++;
            shadow[p] = v;
        }
    }
    return k;
}

/* A float32 box of ``rows`` rows of ``cols`` elements, row r at ``src + r * stride`` (a part
 * of a larger box: its element 0 is the box's element ``base``), against its bfloat16 shadow
 * (rows * cols, contiguous), in one pass: each element rounded as torch rounds, compared with
 * the shadow and written into it; the changed ones marked in ``bitmap`` (ceil(rows * cols / 8)
 * bytes, zeroed by the caller), their values appended to ``vals`` (room for rows * cols) and
 * their indices, plus ``base``, to ``idx`` while there is room (``cap``). Returns how many
 * changed. */
int64_t encode_f32_bf16(const float *src, int64_t rows, int64_t cols, int64_t stride,
                        uint16_t *shadow, uint8_t *bitmap, uint16_t *vals, int32_t *idx,
                        int64_t cap, int64_t base) {
    int64_t k = 0;
    for (int64_t r = 0; r < rows; r++)
        k = encode_run(src + r * stride, cols, shadow, bitmap, r * cols, vals, idx, cap, base, k);
    return k;
}

/* A sparse payload applied to a contiguous 16-bit box: element i of the box takes the next
 * value of ``vals`` where bit i of ``bitmap`` is set (``idx`` == NULL), or at each of the
 * ``k`` indices of ``idx``; the values it had go to ``old`` in the same order (the undo: the
 * same call with ``old`` as ``vals`` puts them back). The payload is checked before anything
 * is written: -1 if an index is out of the box or not above the one before, or the bitmap
 * marks another number than ``k`` (or a bit past ``n``); else ``k``. */
int64_t apply16(uint16_t *live, int64_t n, const uint8_t *bitmap, const int32_t *idx,
                const uint16_t *vals, int64_t k, uint16_t *old) {
    if (idx != NULL) {
        for (int64_t j = 0; j < k; j++)
            if (idx[j] < 0 || idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1])) return -1;
        for (int64_t j = 0; j < k; j++) {
            old[j] = live[idx[j]];
            live[idx[j]] = vals[j];
        }
        return k;
    }
    int64_t bytes = (n + 7) / 8, marked = 0;
    for (int64_t b = 0; b < bytes; b++) marked += __builtin_popcount(bitmap[b]);
    if (n % 8 && (bitmap[bytes - 1] >> (n % 8))) return -1;
    if (marked != k) return -1;
    int64_t j = 0, words = n / 64;
    for (int64_t w = 0; w < words; w++) {
        uint64_t m;
        memcpy(&m, bitmap + 8 * w, 8);
        while (m) {
            int64_t i = 64 * w + __builtin_ctzll(m);
            old[j] = live[i];
            live[i] = vals[j++];
            m &= m - 1;
        }
    }
    for (int64_t i = 64 * words; i < n; i++) {
        if (bitmap[i >> 3] & (1u << (i & 7))) {
            old[j] = live[i];
            live[i] = vals[j++];
        }
    }
    return k;
}
