/*
 * Fused elementwise ops of a bfloat16 decoder layer (loom/kernels/cpu.py). Each replaces 2-6 eager torch
 * ops with one call and rounds at the same points as the torch code it replaces (see each function).
 * Why: at one decode token per step these ops cost their dispatch, not their arithmetic (benchmarks/NOTES.md,
 * "Third pass"). Rows are split over OpenMP threads only when there are many (prefill).
 */
#include <math.h>

#include "bf16_common.h"

#define TARGET LOOM_TARGET
#define PARALLEL_MIN_ROWS 64

TARGET static inline __m512 load_bf16(const uint16_t *src, __mmask16 mask) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET static inline void store_bf16(uint16_t *dst, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v)); /* round to nearest even */
}

/* float32 -> bfloat16 -> float32 (the rounding of a bf16 tensor op) */
TARGET static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/*
 * RMSNorm (arXiv:1910.07467) with an optional residual add, per row of H values:
 *   s = bf16(x + residual)            (written to sum_out; torch: hidden + residual in bf16)
 *   n = bf16(s * (1 / sqrt(mean(s^2) + eps)))   (float32 statistics, like F.rms_norm on s.float())
 *   out = bf16(weight * n)            (torch: weight * n in bf16)
 * residual and sum_out may be NULL together (plain RMSNorm of x).
 */
TARGET void loom_add_rmsnorm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                                  uint16_t *sum_out, int64_t M, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t *xm = x + m * H;
        uint16_t *om = out + m * H;
        const uint16_t *src = xm;
        if (residual) {
            uint16_t *sm = sum_out + m * H;
            for (int64_t h = 0; h < H; h += 16) {
                const __mmask16 k = tail_mask(H - h);
                store_bf16(sm + h, _mm512_add_ps(load_bf16(xm + h, k), load_bf16(residual + m * H + h, k)), k);
            }
            src = sm;
        }
        __m512 sq = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; h += 16) {
            const __m512 v = load_bf16(src + h, tail_mask(H - h));
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)H + eps);
        const __m512 scale = _mm512_set1_ps(inv);
        for (int64_t h = 0; h < H; h += 16) {
            const __mmask16 k = tail_mask(H - h);
            const __m512 n = round_bf16(_mm512_mul_ps(load_bf16(src + h, k), scale));
            store_bf16(om + h, _mm512_mul_ps(load_bf16(weight + h, k), n), k);
        }
    }
}

/*
 * SwiGLU's gating (arXiv:2002.05202): gate_up [M, 2I] = [gate | up] -> out [M, I],
 *   out = bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + e^-g)   (torch: F.silu(gate).mul_(up) in bf16)
 */
TARGET void loom_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t *g = gate_up + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 k = tail_mask(I - i);
            const __m512 gv = load_bf16(g + i, k);
            const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            store_bf16(out + m * I + i, _mm512_mul_ps(round_bf16(silu), load_bf16(u + i, k)), k);
        }
    }
}

/*
 * Rotary embedding (RoFormer, arXiv:2104.09864), rotate-half pairing, on x [n, heads, dim] bf16 whose rows
 * (tokens) are row_stride values apart; cos and signed_sin [n, dim] float32 (sin negated over the first
 * half). out [n, heads, dim] bf16 contiguous:
 *   out = bf16(x * cos + swap_halves(x) * signed_sin), products and sum in float32, not fused
 * (the same roundings as loom.model.layers.rotary.apply_rotary, so the outputs are equal bit for bit).
 * dim % 32 == 0.
 */
TARGET void loom_rotary_bf16(const uint16_t *x, int64_t row_stride, const float *cos, const float *signed_sin,
                             uint16_t *out, int64_t n, int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < n; ++t) {
        const float *c = cos + t * dim, *s = signed_sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *xr = x + t * row_stride + h * dim;
            uint16_t *o = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                const int64_t j = i < half ? i + half : i - half; /* partner of lane block i */
                const __m512 a = _mm512_mul_ps(load_bf16(xr + i, 0xffff), _mm512_loadu_ps(c + i));
                const __m512 b = _mm512_mul_ps(load_bf16(xr + j, 0xffff), _mm512_loadu_ps(s + i));
                store_bf16(o + i, _mm512_add_ps(a, b), 0xffff);
            }
        }
    }
}
