/*
 * Fused elementwise ops of a float32 or bfloat16 decoder layer, for any CPU (loom/kernels/cpu_generic.py):
 * add+RMSNorm, SiLU*up and rotary. Each replaces 2-6 eager torch ops with one call (at one decode token per
 * step these ops cost their dispatch, not their arithmetic) and rounds at the same points as the torch code
 * it replaces (loom/model/layers/norm.py, rotary.py, llama.py's MLP), so that float32 results equal torch's:
 *
 *   - add, rotary: elementwise float32 products and sums, unfused: equal bit for bit.
 *   - RMSNorm: the sum of squares is added in exactly the order of torch's CPU sum kernel (cascade_sum in
 *     aten/src/ATen/native/cpu/SumKernel.cpp: vectors of 8 floats, four interleaved partial sums,
 *     a cascade of levels every 16 steps, then the scalar tail and the lanes in order), then mean = sum / H,
 *     + eps, rsqrt = 1 / sqrt (each correctly rounded), as torch's composite _fused_rms_norm: equal bit for
 *     bit (rows of fewer than 32768 values; a longer single row torch sums on several threads).
 *   - SiLU: the AVX2 build computes e^-x with the algorithm of SLEEF's expf (u10, with FMA), which torch's
 *     x86 kernels call for Vectorized<float>::exp, over the same vector/scalar split as torch's
 *     cpu_kernel_vec (two Vectorized per step per row and per thread range; the tail calls libm's expf, as
 *     torch's scalar path does): equal bit for bit. The portable build calls expf for every element (within
 *     an ulp of torch; 96% of float32 results equal, all bf16 ones in our tests).
 * torch_lanes (loom_silu_mul) is the float width of torch's Vectorized<float> in its elementwise kernels on this
 * CPU (8 on its AVX2 kernels, 16 on its AVX-512 ones), so that an AVX-512 machine running the avx2 build still
 * rounds like its torch. The sum is 8 lanes on every x86 CPU with AVX2: torch registers sum_stub without an
 * AVX-512 variant, so its AVX-512 dispatch runs the AVX2 kernel (measured on a Sapphire Rapids-class CPU: the
 * 8-lane order reproduced torch.sum on every length tried, the 16-lane order did not).
 *
 * Every function takes `is_bf16`: 0 = float32 tensors, 1 = bfloat16 (widened to float32, results rounded
 * to nearest even at the points where torch's bf16 ops round). cos/sin tables are float32 in both.
 *
 * Compiled twice (loom/kernels/registry.py): `avx2` (-mavx2 -mfma -mf16c: the __AVX2__ blocks) and
 * `generic` (portable C, no intrinsics; any CPU, ARM included). Rows are split over OpenMP threads only when
 * there are many (prefill).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_common.h" /* loom_bf16_to_f32, loom_f32_to_bf16 */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN_ROWS 64


/* element i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array */
static inline float get(const void *p, int64_t i, int bf16) {
    return bf16 ? loom_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = loom_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* float32 -> the float32 value of its bfloat16 rounding (what a bf16 tensor op stores) */
static inline float round_bf16(float v) { return loom_bf16_to_f32(loom_f32_to_bf16(v)); }

/* ---- 8-lane vectors: __m256 on AVX2, a struct of 8 floats in the portable build (same lane arithmetic) ---- */
#if defined(__AVX2__)
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline void vstore(float *dst, vf v) { _mm256_storeu_ps(dst, v); }

static inline vf load8(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* round 8 floats to bfloat16, nearest even (NaN stays NaN), as f32_to_bf16 */
static inline __m128i to_bf16x8(vf v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void store8(void *p, int64_t i, vf v, int bf16) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16x8(v));
    else
        _mm256_storeu_ps((float *)p + i, v);
}

static inline vf vround_bf16(vf v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}

/* SLEEF's expf (xexpf, 1.0 ulp), as built for AVX2 (vmla = FMA): torch's Vectorized<float>::exp */
static inline vf sleef_exp8(vf d) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
    const vf qf = _mm256_cvtepi32_ps(q);
    vf s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    vf u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    /* u * 2^q in two steps (2^(q>>1) * 2^(q - (q>>1))), so that large |q| neither overflows nor flushes early */
    const __m256i half = _mm256_srai_epi32(q, 1);
    const __m256i bias = _mm256_set1_epi32(0x7f);
    const vf p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const vf p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), bias), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    u = _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
    return u;
}
#else
typedef struct {
    float v[8];
} vf;
static inline vf vzero(void) {
    vf r;
    for (int l = 0; l < 8; ++l) r.v[l] = 0.0f;
    return r;
}
static inline vf vadd(vf a, vf b) {
    for (int l = 0; l < 8; ++l) a.v[l] += b.v[l];
    return a;
}
static inline vf vmul(vf a, vf b) {
    for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l];
    return a;
}
static inline void vstore(float *dst, vf v) { memcpy(dst, v.v, sizeof v.v); }
static inline vf load8(const void *p, int64_t i, int bf16) {
    vf r;
    for (int l = 0; l < 8; ++l) r.v[l] = get(p, i + l, bf16);
    return r;
}
#endif

/* ---- add + RMSNorm ---- */

static inline int64_t ceil_log2(int64_t x) { /* torch's utils::CeilLog2 */
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

/* sum of the squares of x[0 .. H) in the order of torch's cascade_sum over its Vectorized<float> of 8 floats
 * (its AVX2 kernel, which runs on every x86 CPU: see the top of the file). */
static float sum_squares(const void *x, int64_t H, int bf16) {
    const int64_t lanes = 8;
    if (H < lanes) { /* scalar_inner_sum: row_sum over scalars, four interleaved partial sums */
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t groups = H / 4;
        for (int64_t k = 0; k < 4 * groups; ++k) {
            const float v = get(x, k, bf16);
            part[k % 4] += v * v;
        }
        for (int64_t k = 4 * groups; k < H; ++k) {
            const float v = get(x, k, bf16);
            part[0] += v * v;
        }
        return 0.0f + (((part[0] + part[1]) + part[2]) + part[3]);
    }
    /* vectorized_inner_sum: row_sum over the H / lanes vectors, as a (-1, 4) array in multi_row_sum */
    const int64_t nvec = H / lanes, size = nvec / 4;
    const int64_t level_power = ceil_log2(size) / 4 > 4 ? ceil_log2(size) / 4 : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    vf acc[4][4];
    for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 4; ++k) acc[j][k] = vzero();
#define LOOM_ADD_SQUARES(dst, vec)                                  \
    do {                                                             \
        const vf v_ = load8(x, (vec) * lanes, bf16);                 \
        (dst) = vadd((dst), vmul(v_, v_));                           \
    } while (0)
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < 4; ++k) LOOM_ADD_SQUARES(acc[0][k], 4 * i + k);
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k) {
                acc[j][k] = vadd(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = vzero();
            }
            if (i & (level_mask << (j * level_power))) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < 4; ++k) LOOM_ADD_SQUARES(acc[0][k], 4 * i + k);
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k) acc[0][k] = vadd(acc[0][k], acc[j][k]);
    for (int64_t t = 4 * size; t < nvec; ++t) LOOM_ADD_SQUARES(acc[0][0], t);
#undef LOOM_ADD_SQUARES
    float acc_s = 0.0f;
    for (int64_t k = nvec * lanes; k < H; ++k) {
        const float v = get(x, k, bf16);
        acc_s += v * v;
    }
    float part[8];
    vstore(part, vadd(vadd(vadd(acc[0][0], acc[0][1]), acc[0][2]), acc[0][3]));
    for (int l = 0; l < 8; ++l) acc_s += part[l];
    return acc_s;
}

static inline float inv_rms(float sum_sq, int64_t H, float eps) {
    const float var = sum_sq / (float)H + eps;
#if defined(__AVX2__)
    return 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(var)));
#else
    return 1.0f / sqrtf(var);
#endif
}

/*
 * RMSNorm (arXiv:1910.07467) with an optional residual add, per row of H values:
 *   s = x + residual                           (written to sum_out; bf16: rounded, as torch's bf16 add)
 *   r = 1 / sqrt(sum(s^2) / H + eps)           (float32, torch's summation order)
 *   float32: out = (s * r) * weight            (F.rms_norm(s, (H,), weight, eps))
 *   bf16:    out = bf16(weight * bf16(s * r))  (weight * F.rms_norm(s.float(), (H,), None, eps).to(bf16))
 * residual and sum_out may be NULL together (plain RMSNorm of x). weight has the dtype of x.
 */
void loom_add_rmsnorm(const void *x, const void *residual, const void *weight, void *out, void *sum_out, int64_t M,
                      int64_t H, float eps, int is_bf16) {
    const int bf16 = is_bf16 != 0;
    const size_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; ++m) {
        const void *xm = (const char *)x + (size_t)(m * H) * es;
        void *om = (char *)out + (size_t)(m * H) * es;
        const void *src = xm;
        int64_t h = 0;
        if (residual) {
            const void *rm = (const char *)residual + (size_t)(m * H) * es;
            void *sm = (char *)sum_out + (size_t)(m * H) * es;
#if defined(__AVX2__)
            for (; h + 8 <= H; h += 8) store8(sm, h, _mm256_add_ps(load8(xm, h, bf16), load8(rm, h, bf16)), bf16);
#endif
            for (; h < H; ++h) put(sm, h, get(xm, h, bf16) + get(rm, h, bf16), bf16);
            src = sm;
        }
        const float r = inv_rms(sum_squares(src, H, bf16), H, eps);
        h = 0;
#if defined(__AVX2__)
        const vf rv = _mm256_set1_ps(r);
        for (; h + 8 <= H; h += 8) {
            const vf n = _mm256_mul_ps(load8(src, h, bf16), rv);
            const vf w = load8(weight, h, bf16);
            store8(om, h, bf16 ? _mm256_mul_ps(w, vround_bf16(n)) : _mm256_mul_ps(n, w), bf16);
        }
#endif
        for (; h < H; ++h) {
            const float n = get(src, h, bf16) * r, w = get(weight, h, bf16);
            put(om, h, bf16 ? w * round_bf16(n) : n * w, bf16);
        }
    }
}

/* ---- SiLU * up ---- */

static inline float silu_scalar(float g) { return g / (1.0f + expf(-g)); }

/*
 * SwiGLU's gating (arXiv:2002.05202): gate_up [M, 2I] = [gate | up] -> out [M, I],
 *   out = silu(gate) * up, silu(g) = g / (1 + e^-g)        (float32: F.silu(gate).mul_(up))
 *   out = bf16(bf16(silu(gate)) * up), silu in float32     (bfloat16: the same torch code in bf16)
 * torch_chunk: when torch runs its elementwise loop on several threads (M * I >= its grain of 32768), the
 * elements (row-major over [M, I]) per thread; each thread's range restarts torch's vector loop, which moves
 * the vector/scalar split of the row it starts in (0: one range).
 */
void loom_silu_mul(const void *gate_up, void *out, int64_t M, int64_t I, int is_bf16, int torch_lanes,
                   int64_t torch_chunk) {
    const int bf16 = is_bf16 != 0, lanes = torch_lanes == 16 ? 16 : 8;
    const size_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; ++m) {
        const void *g = (const char *)gate_up + (size_t)(m * 2 * I) * es;
        const void *u = (const char *)g + (size_t)I * es;
        void *o = (char *)out + (size_t)(m * I) * es;
        for (int64_t seg = 0; seg < I;) { /* the row's pieces between torch's thread ranges */
            int64_t seg_end = I;
            if (torch_chunk > 0) {
                const int64_t next = ((m * I + seg) / torch_chunk + 1) * torch_chunk - m * I;
                seg_end = next < I ? next : I;
            }
            int64_t i = seg;
#if defined(__AVX2__)
            /* torch's vectorized loop: two Vectorized<scalar_t> per step (16 floats, 32 bf16), the rest scalar */
            const int64_t step = bf16 ? 4 * lanes : 2 * lanes;
            const int64_t vec_end = seg + (seg_end - seg) / step * step;
            const vf one = _mm256_set1_ps(1.0f);
            for (; i < vec_end; i += 8) {
                const vf gv = load8(g, i, bf16);
                const vf e = sleef_exp8(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)));
                vf s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
                if (bf16) s = vround_bf16(s);
                store8(o, i, _mm256_mul_ps(s, load8(u, i, bf16)), bf16);
            }
#else
            (void)lanes;
#endif
            for (; i < seg_end; ++i) {
                float s = silu_scalar(get(g, i, bf16));
                if (bf16) s = round_bf16(s);
                put(o, i, s * get(u, i, bf16), bf16);
            }
            seg = seg_end;
        }
    }
}

/* ---- GELU (tanh approximation) * up ---- */

#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

/* 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)) with u = sqrt(2/pi) (g + 0.044715 g^3): one exponential, no
 * cancellation near u = 0 (where 1 - 2 / (1 + e^(2u)) would lose tanh's low bits) */
static inline float gelu_tanh_scalar(float g) {
    const float u = GELU_BETA * (g + GELU_KAPPA * g * g * g);
    return g / (1.0f + expf(-2.0f * u));
}

/*
 * GeGLU's gating (Shazeer 2020, arXiv:2002.05202; Gemma): gate_up [M, 2I] = [gate | up] -> out [M, I],
 *   out = gelu_tanh(gate) * up                         (float32)
 *   out = bf16(bf16(gelu_tanh(gate)) * up)             (bfloat16, gelu in float32)
 * gelu_tanh is torch's F.gelu(approximate="tanh") (Hendrycks & Gimpel 2016, arXiv:1606.08415) written as
 * g / (1 + e^(-2u)); within a few ulp of torch's, not bit-equal (torch evaluates tanh with SLEEF): the per-layer
 * path calls this same function wherever the decode step runs it, so the two paths stay equal.
 */
void loom_gelu_tanh_mul(const void *gate_up, void *out, int64_t M, int64_t I, int is_bf16) {
    const int bf16 = is_bf16 != 0;
    const size_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; ++m) {
        const void *g = (const char *)gate_up + (size_t)(m * 2 * I) * es;
        const void *u = (const char *)g + (size_t)I * es;
        void *o = (char *)out + (size_t)(m * I) * es;
        int64_t i = 0;
#if defined(__AVX2__)
        const vf one = _mm256_set1_ps(1.0f), beta2 = _mm256_set1_ps(-2.0f * GELU_BETA);
        const vf kappa = _mm256_set1_ps(GELU_KAPPA);
        for (; i + 8 <= I; i += 8) {
            const vf gv = load8(g, i, bf16);
            const vf inner = _mm256_add_ps(gv, _mm256_mul_ps(kappa, _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv)));
            const vf e = sleef_exp8(_mm256_mul_ps(beta2, inner));
            vf s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            if (bf16) s = vround_bf16(s);
            store8(o, i, _mm256_mul_ps(s, load8(u, i, bf16)), bf16);
        }
#endif
        for (; i < I; ++i) {
            float s = gelu_tanh_scalar(get(g, i, bf16));
            if (bf16) s = round_bf16(s);
            put(o, i, s * get(u, i, bf16), bf16);
        }
    }
}

/* ---- rotary ---- */

/*
 * Rotary embedding (RoFormer, arXiv:2104.09864), rotate-half pairing, on x [n, heads, dim] whose rows
 * (tokens) are row_stride elements apart; cos and signed_sin [n, dim] float32 (sin negated over the first
 * half). out [n, heads, dim] contiguous, dtype of x:
 *   out = x * cos + swap_halves(x) * signed_sin, products and sum in float32, not fused (bf16: rounded once)
 * (the roundings of loom.model.layers.rotary.apply_rotary, so the outputs are equal bit for bit). dim even.
 */
void loom_rotary(const void *x, int64_t row_stride, const float *cos, const float *signed_sin, void *out, int64_t n,
                 int64_t heads, int64_t dim, int is_bf16) {
    const int bf16 = is_bf16 != 0;
    const size_t es = bf16 ? 2 : 4;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < n; ++t) {
        const float *c = cos + t * dim, *s = signed_sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const void *xr = (const char *)x + (size_t)(t * row_stride + h * dim) * es;
            void *o = (char *)out + (size_t)((t * heads + h) * dim) * es;
            for (int side = 0; side < 2; ++side) { /* i in [lo, lo + half), partner i + shift */
                const int64_t lo = side ? half : 0, shift = side ? -half : half;
                int64_t i = lo;
#if defined(__AVX2__)
                for (; i + 8 <= lo + half; i += 8) {
                    const vf a = _mm256_mul_ps(load8(xr, i, bf16), _mm256_loadu_ps(c + i));
                    const vf b = _mm256_mul_ps(load8(xr, i + shift, bf16), _mm256_loadu_ps(s + i));
                    store8(o, i, _mm256_add_ps(a, b), bf16);
                }
#endif
                for (; i < lo + half; ++i) {
                    const float a = get(xr, i, bf16) * c[i], b = get(xr, i + shift, bf16) * s[i];
                    put(o, i, a + b, bf16);
                }
            }
        }
    }
}

/* dst[i] = src[i] as IEEE float16 bits, rounded to nearest even (the conversion the C decode step applies when
 * it writes float32 K/V rows into a float16 cache; exported so that tests can hold it to torch's `.half()`). */
void loom_f32_to_f16_n(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = loom_f32_to_f16(src[i]);
}
