/* Helpers of loom's bfloat16 CPU kernel (gemv_bf16.c): scalar conversions and its target attribute. */
#ifndef LOOM_BF16_COMMON_H
#define LOOM_BF16_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define LOOM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                              /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#endif
