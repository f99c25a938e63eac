/* Helpers of loom's portable CPU kernels (qgemm.c, fused_ops.c, paged_decode.c, gemv_w16.c): scalar float16 /
 * bfloat16 conversions and output stores.
 *
 * Portable on purpose: this header needs no ISA. x86 intrinsics are included only when the translation unit
 * is compiled for AVX2 + FMA + F16C (the `avx2` and `avx512_vnni` builds of loom/kernels/registry.py); the
 * `generic` build (no ISA flag, ARM included) gets plain C. Unlike bf16_common.h it carries no target
 * attributes, so nothing here asks for an instruction the build was not compiled for.
 */
#ifndef LOOM_QUANT_COMMON_H
#define LOOM_QUANT_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOOM_QSIMD 1 /* the x86 vector paths */
#include <immintrin.h>
#else
#define LOOM_QSIMD 0 /* portable scalar C */
#endif

/* Kernel scratch: n bytes on a 64-byte boundary (free() releases it), or NULL. malloc's 16-byte alignment put
 * every 64-byte vector load of the int16 activation codes across two cache lines, which the load ports pay
 * twice: the 512-bit q4g tiles ran 1.25-1.75x slower for it (benchmarks/NOTES.md, "Aligned scratch"). */
static inline void *loom_alloc64(size_t n) { return aligned_alloc(64, ((n ? n : 1) + 63) & ~(size_t)63); }

/* float16 bit pattern -> float32, exact (every float16, subnormals included, is a float32). */
static inline float loom_f16_to_f32(uint16_t h) {
#if LOOM_QSIMD
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13); /* inf / NaN (payload kept) */
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13); /* rebias 15 -> 127 */
    } else {
        /* zero or subnormal: man * 2^-24, exact in float32 (man < 2^10, a power-of-two scaling) */
        const float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float loom_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 rounded to nearest even (torch's rounding; NaN stays a NaN). */
static inline uint16_t loom_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* y[at] = v as float32, or as bfloat16 (nearest even) when y_bf16. */
static inline void loom_store_out(void *y, int64_t at, float v, int y_bf16) {
    if (y_bf16)
        ((uint16_t *)y)[at] = loom_f32_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

/* nearest integer, ties to even, of 0 <= v <= 1024 (adding and subtracting 2^23 rounds under IEEE semantics) */
static inline float loom_round_even_small(float v) {
    const float magic = 8388608.0f;
    return (v + magic) - magic;
}

/* float32 -> IEEE float16 bit pattern, rounded to nearest even (torch's `.to(torch.float16)`): overflow gives
 * infinity, tiny values round into the subnormals, NaN stays a (quiet) NaN. */
static inline uint16_t loom_f32_to_f16(float f) {
#if LOOM_QSIMD
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN, quieted */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: infinity */
    if (a < 0x38800000u) {                                   /* below 2^-14: a float16 subnormal (or zero) */
        /* a's value times 2^24 rounded to an integer, ties to even: the subnormal's mantissa */
        float g;
        memcpy(&g, &a, 4);
        return (uint16_t)(sign | (uint16_t)loom_round_even_small(g * 16777216.0f));
    }
    /* normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even */
    const uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - (112u << 23);
    return (uint16_t)(sign | (uint16_t)(r >> 13));
#endif
}

/* Bytes of one (token, KV head) row of D values in a cache of element type kv: 0 float32, 1 bfloat16, 2 float16,
 * 3 loom's int8 row (D codes, then a float16 scale and a float16 minimum per group of 32 values:
 * loom/attention/kv_quant.py's kv_row_width). */
static inline int64_t loom_kv_row_bytes(int64_t D, int kv) {
    return kv == 3 ? D + 4 * ((D + 31) / 32) : D * (kv ? 2 : 4);
}

/* Round to nearest, ties to even, for |v| <= 2^22 without libm (the generic build must not depend on
 * nearbyintf being inlined): adding and subtracting 1.5 * 2^23 leaves the float32 rounding of v to an
 * integer under the default rounding mode. Needs IEEE semantics (no -ffast-math), which loom builds with. */
static inline float loom_round_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic; /* not folded to v: without -ffast-math the compiler keeps both roundings */
}

#endif
