/* A few rows times a weight, y = x W^T (+ b), read from the weight as it lives ([out, in],
 * row-major, float32 or bfloat16): the decode steps of small batches (`tandem.kernels.gemv`).
 *
 * At one to a few rows a matmul is one pass over the weight, and a decode step's weights do not
 * fit in the last-level cache: its time is the weight's bytes over the memory bandwidth, plus
 * the library's fixed cost per call. Each thread takes a contiguous run of W rows and reads
 * them front to back, one row at a time (one sequential stream per thread, for the hardware
 * prefetchers), keeping per x row a few vectors of partial sums (independent FMA chains) in
 * registers; the x rows come from L1. So each weight byte is read once, whatever the row
 * count (at most MAX_ROWS in gemv.py).
 * bfloat16 weights are widened to float32 as they are loaded (a shift: exact) and summed in
 * float32, and the sums are rounded to bfloat16 once, to nearest even, as oneDNN and torch
 * round their float32 accumulators. Vectors are GCC's vector extensions at the widest width
 * the build targets (16 floats with AVX-512, 8 with AVX2), so one source serves both.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define UNROLL _Pragma("GCC unroll 16") /* the small loops: arrays of sums become registers */
#define XROWS 4 /* x rows one pass over W serves (more rows: another pass) */

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

static inline vf load_f32(const float *p) { return *(const vf *)p; }

/* Widening is a zero-extension and a shift; GCC's generic conversion of a whole vector takes
 * two half-width steps and an insert, so the targets it knows get their one instruction. */
static inline vf load_bf16(const bf16 *p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16);
#endif
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* One W row's dot products with x rows 0 .. m (m <= XROWS, a constant where inlined; x in
 * float32, rows `in` apart) into sums[0 .. m). U vectors of the row per step, each its own
 * partial sum per x row: four at one or two x rows, two past that (the sums stay in registers
 * with AVX2's 16). */
#define DEFINE_ROW(NAME, T, LOAD, ONE)                                                         \
    static inline __attribute__((always_inline)) void NAME(const float *x, int64_t in,        \
                                                           const T *row, const int m,         \
                                                           float *sums) {                     \
        const int U = m <= 2 ? 4 : 2;                                                         \
        vf acc[XROWS][4];                                                                     \
        UNROLL                                                                                \
        for (int r = 0; r < m; r++)                                                           \
            UNROLL                                                                            \
            for (int u = 0; u < U; u++) acc[r][u] = (vf){0};                                  \
        int64_t i = 0;                                                                        \
        for (; i + U * LANES <= in; i += U * LANES)                                           \
            UNROLL                                                                            \
            for (int u = 0; u < U; u++) {                                                     \
                const vf wv = LOAD(row + i + u * LANES);                                      \
                UNROLL                                                                        \
                for (int r = 0; r < m; r++)                                                   \
                    acc[r][u] += wv * load_f32(x + r * in + i + u * LANES);                   \
            }                                                                                 \
        for (; i + LANES <= in; i += LANES) {                                                 \
            const vf wv = LOAD(row + i);                                                      \
            UNROLL                                                                            \
            for (int r = 0; r < m; r++) acc[r][0] += wv * load_f32(x + r * in + i);           \
        }                                                                                     \
        UNROLL                                                                                \
        for (int r = 0; r < m; r++) {                                                         \
            vf total = acc[r][0];                                                             \
            UNROLL                                                                            \
            for (int u = 1; u < U; u++) total += acc[r][u];                                   \
            float s = hsum(total);                                                            \
            for (int64_t t = i; t < in; t++) s += ONE(row[t]) * x[r * in + t];                \
            sums[r] = s;                                                                      \
        }                                                                                     \
    }

#define SAME(v) (v)

DEFINE_ROW(row_f32, float, load_f32, SAME)
DEFINE_ROW(row_bf16, bf16, load_bf16, bf16_to_f32)

/* x rows [rows, in] (row stride x_stride), W [out, in], bias [out] or NULL, y rows [rows, out]
 * (row stride y_stride), on `threads` OpenMP threads. The x rows are first packed `in` apart
 * as XT (float32, widened by TO_X; or bfloat16 as they are, for the dot-product rows below):
 * rows * in elements on the stack, rows <= MAX_ROWS in gemv.py. */
#define DEFINE_GEMV(NAME, T, XT, ROW_FN, TO_X, TO_F32, STORE)                                  \
    void NAME(const T *x, int64_t x_stride, int64_t rows, const T *w, int64_t in, int64_t out, \
              const T *bias, T *y, int64_t y_stride, int threads) {                           \
        XT xs_all[rows * in];                                                                 \
        for (int64_t r = 0; r < rows; r++)                                                    \
            for (int64_t i = 0; i < in; i++) xs_all[r * in + i] = TO_X(x[r * x_stride + i]);  \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                     \
        for (int64_t o = 0; o < out; o++) {                                                   \
            float sums[XROWS];                                                                \
            for (int64_t r0 = 0; r0 < rows; r0 += XROWS) {                                    \
                const int m = rows - r0 < XROWS ? (int)(rows - r0) : XROWS;                   \
                const XT *xs = xs_all + r0 * in;                                              \
                switch (m) { /* a constant row count per call: its loops unroll */            \
                case 1: ROW_FN(xs, in, w + o * in, 1, sums); break;                           \
                case 2: ROW_FN(xs, in, w + o * in, 2, sums); break;                           \
                case 3: ROW_FN(xs, in, w + o * in, 3, sums); break;                           \
                default: ROW_FN(xs, in, w + o * in, 4, sums); break;                          \
                }                                                                             \
                for (int r = 0; r < m; r++) {                                                 \
                    const float s = bias ? sums[r] + TO_F32(bias[o]) : sums[r];               \
                    y[(r0 + r) * y_stride + o] = STORE(s);                                    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_GEMV(gemv_f32, float, float, row_f32, SAME, SAME, SAME)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* With AVX512-BF16, a bfloat16 row takes the dot-product instruction (vdpbf16ps: 32 weight
 * and x pairs, each pair's two products exact in float32, added into 16 float32 sums) on x as
 * it is, bfloat16: one instruction per 64 bytes of weight where widening took three. That ran
 * the weights at the memory's speed (a 30-layer model's decode step: 21.5 GB/s widened, 28 with
 * the instruction, float32's rate). The sums are still float32, rounded to bfloat16 once;
 * their order differs from the widened path's (and the instruction treats subnormals as zero),
 * so a result may differ from it in the last bit. */
static inline __attribute__((always_inline)) void row_bf16_dot(const bf16 *x, int64_t in,
                                                               const bf16 *row, const int m,
                                                               float *sums) {
    enum { U = 2 };
    __m512 acc[XROWS][U];
    UNROLL
    for (int r = 0; r < m; r++)
        UNROLL
        for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + U * 32 <= in; i += U * 32)
        UNROLL
        for (int u = 0; u < U; u++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + i + u * 32);
            UNROLL
            for (int r = 0; r < m; r++)
                acc[r][u] = _mm512_dpbf16_ps(acc[r][u], wv,
                                             (__m512bh)_mm512_loadu_si512(x + r * in + i + u * 32));
        }
    for (; i < in; i += 32) { /* the rest, under a mask: missing pairs read as zeros */
        const int64_t left = in - i;
        const __mmask32 k = left >= 32 ? (__mmask32)-1 : (__mmask32)((1u << left) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(k, row + i);
        UNROLL
        for (int r = 0; r < m; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv,
                                         (__m512bh)_mm512_maskz_loadu_epi16(k, x + r * in + i));
    }
    UNROLL
    for (int r = 0; r < m; r++) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

DEFINE_GEMV(gemv_bf16, bf16, bf16, row_bf16_dot, SAME, bf16_to_f32, f32_to_bf16)
#else
DEFINE_GEMV(gemv_bf16, bf16, float, row_bf16, bf16_to_f32, bf16_to_f32, f32_to_bf16)
#endif
