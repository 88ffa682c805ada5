/* bfloat16 <-> float32 for tandem's C kernels (tandem.kernels.build hashes this header into
 * each kernel's cache key). bfloat16 is the top half of a float32: widening is exact; narrowing
 * rounds to nearest even, as torch does (values are finite: built with -ffast-math). */
#ifndef TANDEM_BF16_H
#define TANDEM_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

#endif
