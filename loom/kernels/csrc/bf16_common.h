/* Helpers shared by loom's bfloat16 CPU kernels: scalar conversions and a vector e^x. */
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

/* e^x: 2^n * 2^f, n = round(x log2 e), |f| <= 1/2, Taylor degree 7 of 2^f (relative error < 1e-8 before
 * float32 rounding); x clamped to [-87, 88], so very negative inputs give ~0, never a denormal or NaN. */
LOOM_TARGET static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
