/*
 * Matrix products over loom's packed quantized weights (loom/quant/layout.py: q4g and q8g), for the CPU.
 * Bound by loom/kernels/quant.py; the torch reference of every function is loom/quant/torch_kernels.py.
 *
 * One source, compiled once per ISA by loom/kernels/registry.py:
 *   avx512_vnni  the AVX2 code with VPDPBUSD (AVX512-VNNI on 256-bit registers, needs AVX512VL) in place of
 *                VPMADDUBSW + VPMADDWD: one instruction per 32-value integer dot instead of two. It was
 *                compile-checked only (written on a Zen 3 machine, which has no AVX-512); its tests run on a
 *                CPU that lists avx512_vnni (tests/kernels/test_quant_kernels.py).
 *   avx2         AVX2 + FMA + F16C (Haswell, Zen 1-3 and later).
 *   generic      portable C (no intrinsics; ARM included), the same definitions computed one value at a time.
 * `loom_qgemm_impl()` says which code a build holds.
 *
 * Shapes: x [M, K] (float32 or bfloat16 rows, row stride ldx), weights [N, K] packed, y [M, N] row-major,
 * float32 or bfloat16 (nearest even). K % 32 == 0. Blocks are 32 values of k: block b is k in [32b, 32b+32).
 *
 * 1. loom_quantize_act: x -> xq int8 [M, K], xs float32 [M, K/32], xsum float32 [M, K/32]:
 *      s = max|x| / 127 over a block (over the whole row when per_token, the same s stored in every block),
 *      q = round-half-even(x / s) clamped to [-127, 127] (q = 0 where s == 0), xsum = float sum of the
 *      original x of the block. A true division, not a multiplication by 1/s, so the codes equal torch's
 *      torch.round(x / s) exactly. -127..127 only (never -128): the signed dot below relies on it.
 * 2. loom_gemm_{q4g,q8g}_q8 (int8 activations):
 *      y[m,n] = sum_b (xs[m,b] * sc[n,g(b)]) * idot(m,n,b) + sum_g mins[n,g] * gs[m,g] (+ bias[n])
 *    with idot the exact integer dot of the block's codes (q8g group 16: the two 16-value halves separately,
 *    each with its own weight scale) and gs the activation sum of weight group g: xsum[m,g] for groups of
 *    32; the float sum of the group's xsum blocks (in order) for larger groups; for q8g group 16, whose
 *    groups are half a block, xs[m,b] * (sum of the half's codes), i.e. the sum of the dequantized
 *    activations (xsum has no half-block sums). q4g with groups of several blocks (GPTQ / AWQ's 64, 128) is
 *    computed as the same weight with each group's scale and min repeated for its blocks, i.e. with groups of
 *    32: a min term per block (items 2 and 3), so every group size of a file gives the bits its expansion gives.
 * 3. loom_gemm_{q4g,q8g}_f (weight-only, "W4A16 / W8A16"): x is quantized per block of 32 to int16 codes,
 *      s = max|x| / 32767 (NaN when the block holds a NaN), c = round-half-even(x / s) clamped to
 *      [-32767, 32767] (c = 0 where s == 0); then y = x^ W^T with x^ = s * c:
 *      y[m,n] = sum_b (s[m,b] * sc[n,g(b)]) * idot16(m,n,b) + sum_g mins[n,g] * gs[m,g] (+ bias[n]),
 *      idot16 the exact integer dot (q8g group 16: per half, each with its scale), gs the float sum, in order,
 *      of the group's half sums h = s * (integer sum of 16 codes). x^ is within 2^-16 of each block's max|x|
 *      of x: finer than float16 or bfloat16 activations (top-1 agreement with the float32 path: benchmarks/
 *      BENCHMARKS.md). Why int16 and not float: widening 4-bit codes to float32 costs four conversions and
 *      four FMAs per 32 values; VPMADDWD on int16 codes takes half the instructions (2.2 -> 1.35 ns per block
 *      on one Zen 3 thread from L2), which is what lets the decode GEMV approach memory speed. The codes are
 *      computed once per call (loom_quantize_act16 exposes them).
 * 3b. loom_gemm_q4gr16_f, loom_gemm_q8gr16_f: item 3's product over the 16-row interleaved layouts (q4gr16,
 *      q8gr16 with groups of 16 or 32; layout.py), in one order at every M: per output, block by block (and per
 *      16-value half for groups of 16), fma(float(idot16), scale * s, acc), then with mins fma(min, the block's
 *      (or half's) x sum, acc); bias added last. The avx512_vnni build runs it as 16-row groups (a weight row per
 *      lane, section "16 weight rows per vector"); the other builds compute the same steps a lane at a time, so
 *      every build gives the same bits.
 * 4. loom_dequant_{q4g,q8g}: W [N, K] = float32(sc) * q + float32(min), bit for bit layout.dequantize
 *    (loom_dequant_rows: the rows of a lookup, from any of the four layouts)
 *    (the product of a float16 and a code of at most 8 bits is exact, so one FMA rounds like mul + add),
 *    float32 or bfloat16 (the float32 value rounded to nearest even, as torch's .to(bfloat16)).
 *
 * Why this shape: at M = 1 (decode) the products are memory-bound on the packed weights (0.625 byte per
 * weight for q4g with mins, 1.0625 for q8g), so each thread reads a contiguous range of weight rows once,
 * in memory order (qweight, scales, mins: sequential streams the hardware prefetcher follows), with the
 * activations in L1. The integer dot is llama.cpp's: q4 nibbles unpacked with one shift and one and (low
 * nibbles = values 0..15 of the block, high = 16..31, the layout's order), VPMADDUBSW (u8 x s8 -> s16
 * pairs; 15 * 127 * 2 and 128 * 127 * 2 cannot saturate) then VPMADDWD by ones -> 8 int32, converted and
 * FMA'd by the block's scale product into one of two float accumulators (even and odd blocks). q8g is
 * signed x signed: VPSIGNB moves the weight's sign onto the activation (|w| as u8, -128 -> 128 still right
 * as unsigned). The scale products of a row are computed 8 per vector (one F16C conversion, one multiply)
 * before its blocks, and each block broadcasts its own from L1. SmolLM2's rows are short (K = 576: 18
 * blocks), so a row's fixed cost (scale set-up, mins, horizontal sum, call) was as large as its blocks':
 * at M = 1 a call therefore handles four weight rows ("tiles", below), which took a [576, 576] q4g
 * product on one Zen 3 thread from 2.0 to 1.45 ns per block (L2-resident). The four rows are read one
 * after the other: interleaving their blocks (four streams a row apart) halved the cold-memory bandwidth
 * of the q8g LM head [49152, 576]. q4g then takes its blocks in pairs (q4_pair_dot: one 32-byte unpack,
 * one VPMADDWD and one FMA for two blocks, the int8 activations re-laid out once per call to match):
 * 1.25 ns per block, 16 GB/s of weights per thread from L2. Output rows are split in contiguous ranges
 * over `num_threads` OpenMP threads (torch's libgomp, loaded first, so the pool is shared).
 *
 * The functions that need scratch memory (group sums, the paired q4 activations, the int16 codes) return 0, or -1 when malloc failed (nothing written); the others return nothing.
 */
#include "quant_common.h"

#include <math.h> /* NAN */

#define MROWS 4 /* rows of x per pass over the weight rows */
#define MROWS_Q4_16 6 /* the same for q4g with int16 codes (rows16_q4: six accumulators fit the registers) */

enum { KIND_Q4 = 0, KIND_Q8 = 1, KIND_Q8_16 = 2 }; /* q4g; q8g with groups >= 32; q8g with groups of 16 */

/* The avx512_vnni build's 512-bit q4g weight-only tiles (rows16_q4: four blocks per vector) */
#if LOOM_QSIMD && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define LOOM_Q512 1
#else
#define LOOM_Q512 0
#endif
/* q4g blocks per unit of the int16 x-code layout the weight-only tiles read (q4_unit_codes16) */
#define Q4_UNIT (LOOM_Q512 ? 4 : 2)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && LOOM_QSIMD
#define LOOM_QIMPL "avx512_vnni"
#elif LOOM_QSIMD
#define LOOM_QIMPL "avx2"
#else
#define LOOM_QIMPL "scalar"
#endif

const char *loom_qgemm_impl(void) { return LOOM_QIMPL; }

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------------------ */
/* x86 vector helpers                                                                                       */
/* ------------------------------------------------------------------------------------------------------ */
#if LOOM_QSIMD

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 lanes, lane i = sum of the four u8 x s8 products of bytes 4i..4i+3: lanes 0-3 cover values
 * 0..15 of the 32, lanes 4-7 values 16..31 (q8g group 16 relies on that split). */
ALWAYS_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The 32 codes of a q4g block (16 bytes: byte i = value i | value i+16 << 4) as bytes in value order. */
ALWAYS_INLINE __m256i q4_unpack(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

/* 8 float32 from 8 bfloat16 (exact). */
ALWAYS_INLINE __m256 bf16x8_to_f32(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 float32 -> 8 bfloat16, nearest even, NaN kept a (quiet) NaN: the scalar loom_f32_to_bf16 lane-wise. */
ALWAYS_INLINE __m128i f32x8_to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i h = _mm256_blendv_epi8(r, nan, is_nan);
    /* 8 values < 2^16 in int32 lanes -> 8 uint16 */
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

#endif /* LOOM_QSIMD */

/* ------------------------------------------------------------------------------------------------------ */
/* 1. activation quantization                                                                               */
/* ------------------------------------------------------------------------------------------------------ */

/* One row: x (float32 or bfloat16) [K] -> q [K], s [K/32], sum [K/32]. */
static void quantize_row(const void *x, int x_bf16, int64_t K, int per_token, int8_t *q, float *s, float *sum) {
    const int64_t nb = K / 32;
#if LOOM_QSIMD
    const __m256 sign = _mm256_set1_ps(-0.0f);
    float row_scale = 0.0f;
    if (per_token) {
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 v = x_bf16 ? bf16x8_to_f32((const uint16_t *)x + k) : _mm256_loadu_ps((const float *)x + k);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
        }
        row_scale = hmax8(mx) / 127.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
        __m256 v[4];
        for (int i = 0; i < 4; ++i) {
            const int64_t k = 32 * b + 8 * i;
            v[i] = x_bf16 ? bf16x8_to_f32((const uint16_t *)x + k) : _mm256_loadu_ps((const float *)x + k);
        }
        sum[b] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        float d = row_scale;
        if (!per_token) {
            const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            d = hmax8(a) / 127.0f;
        }
        s[b] = d;
        __m256i out;
        if (d > 0.0f) {
            const __m256 dv = _mm256_set1_ps(d), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
            __m256i r[4];
            for (int i = 0; i < 4; ++i) /* MXCSR's default rounding: nearest even, as torch.round */
                r[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], dv), lo), hi));
            /* packs work per 128-bit lane: int32 0-3|8-11 ... ; the permute puts the 32 bytes back in order */
            const __m256i p01 = _mm256_packs_epi32(r[0], r[1]), p23 = _mm256_packs_epi32(r[2], r[3]);
            out = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        } else {
            out = _mm256_setzero_si256();
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * b), out);
    }
#else
    float row_scale = 0.0f;
    float v[32];
    if (per_token) {
        float mx = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            const float a = x_bf16 ? loom_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            const float m = a < 0 ? -a : a;
            mx = m > mx ? m : mx;
        }
        row_scale = mx / 127.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
        float mx = 0.0f, acc = 0.0f;
        for (int j = 0; j < 32; ++j) {
            const int64_t k = 32 * b + j;
            v[j] = x_bf16 ? loom_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            const float m = v[j] < 0 ? -v[j] : v[j];
            mx = m > mx ? m : mx;
            acc += v[j];
        }
        const float d = per_token ? row_scale : mx / 127.0f;
        s[b] = d;
        sum[b] = acc;
        for (int j = 0; j < 32; ++j) {
            float t = 0.0f;
            if (d > 0.0f) {
                t = v[j] / d;
                t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
                t = loom_round_even(t);
            }
            q[32 * b + j] = (int8_t)t;
        }
    }
#endif
}

/* The block Hadamard rotation of an input row before its int8 quantization (QuaRot, Ashkboos et al. 2024,
 * arXiv:2404.00456): `rotate_input` of loom/quant/hadamard.py, value for value. x float32 [M, K] (row stride ldx)
 * -> y float32 [M, K]; block a power of two <= 512 dividing K. Per block: step = max|x| / 2^15 (1 / 2^15 for an
 * all-zero block), q = round_half_even(x / step), y = H q with Sylvester's +-1 Hadamard matrix as a fast
 * Walsh-Hadamard transform (every partial sum an integer of magnitude <= 2^24: exact in float32 in any order,
 * so the butterflies give the values of hadamard.py's two matmuls), then y * (step / sqrt(block)) in float32. */
void loom_rotate_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t block, float *y, int num_threads) {
    int e = 0;
    while (((int64_t)1 << e) < block) ++e;
    /* sqrt(2^e) rounded to float32: a power of two times float32(sqrt(2)) (scaling by 2^k commutes with rounding) */
    const float root = (e & 1 ? 1.41421356237309504880f : 1.0f) * (float)((int64_t)1 << (e / 2));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b0 = 0; b0 < K; b0 += block) {
            const float *xb = x + m * ldx + b0;
            float *yb = y + m * K + b0;
            float amax = 0.0f;
            for (int64_t i = 0; i < block; ++i) {
                const float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            const float step = (amax > 0.0f ? amax : 1.0f) / 32768.0f;
            for (int64_t i = 0; i < block; ++i) yb[i] = loom_round_even(xb[i] / step);
            for (int64_t h = 1; h < block; h *= 2)
                for (int64_t i = 0; i < block; i += 2 * h)
                    for (int64_t j = i; j < i + h; ++j) {
                        const float a = yb[j], c = yb[j + h];
                        yb[j] = a + c;
                        yb[j + h] = a - c;
                    }
            const float f = step / root;
            for (int64_t i = 0; i < block; ++i) yb[i] *= f;
        }
}

void loom_quantize_act(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int per_token, int8_t *xq,
                       float *xs, float *xsum, int num_threads) {
    const int64_t nb = K / 32, elem = x_bf16 ? 2 : 4;
    /* a decode row is a few hundred ns of work: not worth waking the pool for */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 32768)
    for (int64_t m = 0; m < M; ++m)
        quantize_row((const char *)x + m * ldx * elem, x_bf16, K, per_token, xq + m * K, xs + m * nb,
                     xsum + m * nb);
}

/* ------------------------------------------------------------------------------------------------------ */
/* shared: group sums of activations and the min term                                                      */
/* ------------------------------------------------------------------------------------------------------ */

/* float sum of n (a multiple of 16) float32 values. */
static inline float sum_f32(const float *p, int64_t n) {
#if LOOM_QSIMD
    __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    for (int64_t i = 16; i < n; i += 16) {
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
        b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
    }
    return hsum8(_mm256_add_ps(a, b));
#else
    float t = 0.0f;
    for (int64_t i = 0; i < n; ++i) t += p[i];
    return t;
#endif
}

/* gs [M, K/G] for the int8 path's min term (see the header; not called for G == 32, where gs = xsum). */
static void q8_group_sums(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, int64_t G,
                          float *gs) {
    const int64_t nb = K / 32, ng = K / G;
    for (int64_t m = 0; m < M; ++m) {
        if (G == 16) {
            for (int64_t h = 0; h < ng; ++h) {
                int32_t c = 0;
                for (int j = 0; j < 16; ++j) c += xq[m * K + 16 * h + j];
                gs[m * ng + h] = xs[m * nb + h / 2] * (float)c;
            }
        } else {
            const int64_t bpg = G / 32;
            for (int64_t g = 0; g < ng; ++g) {
                float t = 0.0f;
                for (int64_t b = 0; b < bpg; ++b) t += xsum[m * nb + g * bpg + b];
                gs[m * ng + g] = t;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------------ */
/* 2. int8-activation GEMM                                                                                  */
/* ------------------------------------------------------------------------------------------------------ */

/* The code of value j (0..31) of block b of a weight row, for the scalar paths. */
static inline int scalar_code(const int kind, const uint8_t *wr, int64_t b, int j) {
    if (kind == KIND_Q4) return j < 16 ? wr[16 * b + j] & 0xF : wr[16 * b + j - 16] >> 4;
    return (int8_t)wr[32 * b + j];
}

#define CH 64 /* blocks per chunk of precomputed scale products (2048 values of k per chunk) */

/* Scale of each 32-block c0 + u of a weight row, u < cc (KIND_Q8_16: of each 16-half, u < 2 cc), times the
 * activation scale of that block when xs is not NULL: d[u]. Vectors of 8; a count that is not a multiple of
 * 8 (but at least 8) ends with one vector overlapping the previous one (the same values written twice),
 * so there is no scalar tail: SmolLM2's rows have 18 and 48 blocks. */
ALWAYS_INLINE void block_scales(const int kind, const uint16_t *sc, int64_t bpg, const float *xs, int64_t c0,
                                int64_t cc, float *d) {
    const int64_t cnt = kind == KIND_Q8_16 ? 2 * cc : cc; /* scales to produce */
    int64_t u = 0;
    if (kind == KIND_Q8 && bpg > 1) { /* groups of 64 and more (per channel: one group): one conversion per group */
        int64_t g = c0 / bpg, end = (g + 1) * bpg - c0; /* blocks [u, end) of the chunk share group g's scale */
        while (u < cc) {
            if (end > cc) end = cc;
            const float sg = loom_f16_to_f32(sc[g]);
#if LOOM_QSIMD
            if (xs)
                for (const __m256 sv = _mm256_set1_ps(sg); u + 8 <= end; u += 8)
                    _mm256_storeu_ps(d + u, _mm256_mul_ps(sv, _mm256_loadu_ps(xs + c0 + u)));
#endif
            for (; u < end; ++u) d[u] = sg * (xs ? xs[c0 + u] : 1.0f);
            ++g;
            end = (g + 1) * bpg - c0;
        }
        return;
    }
    const uint16_t *s0 = sc + (kind == KIND_Q8_16 ? 2 * c0 : c0);
#if LOOM_QSIMD
    if (cnt >= 8) {
        for (int64_t u0 = 0; u0 < cnt; u0 += 8) {
            u = u0 + 8 <= cnt ? u0 : cnt - 8;
            __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s0 + u)));
            if (xs && kind == KIND_Q8_16) { /* 8 halves = 4 blocks: each block's xs twice (u is even) */
                const __m256 x4 = _mm256_castps128_ps256(_mm_loadu_ps(xs + c0 + u / 2));
                v = _mm256_mul_ps(v, _mm256_permutevar8x32_ps(x4, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
            } else if (xs) {
                v = _mm256_mul_ps(v, _mm256_loadu_ps(xs + c0 + u));
            }
            _mm256_storeu_ps(d + u, v);
        }
        return;
    }
#endif
    for (; u < cnt; ++u)
        d[u] = loom_f16_to_f32(s0[u]) * (xs ? xs[c0 + (kind == KIND_Q8_16 ? u / 2 : u)] : 1.0f);
}

#if LOOM_QSIMD
/* acc[i] += mn[i * mn_step + g] * gs[i * gs_step + g] over the ng groups for the cnt slots of a tile, 8 groups per
 * vector (by-x tiles: one weight row's mins, mn_step 0, against each x row's sums; by-row tiles: each weight row's
 * mins against the one x row's sums, gs_step 0); a last partial vector overlaps the previous one with the lanes
 * already counted masked to zero. Every slot's operands are loaded before any accumulator is written, so that a
 * step of 0 (a constant once inlined) loads and converts the shared operand once; the slots' FMA chains
 * interleave. ng < 8 is left to the caller (returns 0). */
static const int32_t tail_mask[16] = {0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1};
ALWAYS_INLINE int min_term(const uint16_t *mn, int64_t mn_step, const float *gs, int64_t gs_step, int64_t ng,
                           const int cnt, __m256 *acc) {
    if (ng < 8) return 0;
    __m256 mv[6], gv[6]; /* NSLOT_MAX slots at most */
    for (int64_t g = 0; g < ng; g += 8) {
        const int64_t at = g + 8 <= ng ? g : ng - 8; /* the last partial vector: lanes < 8 - (ng - g) counted */
        const __m256 keep = g + 8 <= ng ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                                        : _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(tail_mask + (ng - g))));
        for (int i = 0; i < cnt; ++i) {
            mv[i] = _mm256_and_ps(keep, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + i * mn_step + at))));
            gv[i] = _mm256_and_ps(keep, _mm256_loadu_ps(gs + i * gs_step + at));
        }
        for (int i = 0; i < cnt; ++i) acc[i] = _mm256_fmadd_ps(mv[i], gv[i], acc[i]);
    }
    return 1;
}
#endif

/* Register tiles. One call of rows_q8 / rows_16 computes up to four (six: q4g int16) (weight row, x row)
 * products, "slots":
 * at M == 1 the slots are NR = 4 consecutive weight rows against the one x row (the call's fixed costs,
 * scale set-up, mins and horizontal sums, shared by four rows), read one row after the other so that
 * memory is still read in order; at M > 1 one weight row against mc <= MROWS (MROWS_Q4_16) rows of x
 * (each weight block unpacked once for the mc). Every slot has its own even-block and odd-block accumulators as named
 * variables (arrays of them are kept in memory by GCC, stored at every FMA, since the scale loads might
 * alias them), the mins' term goes into the odd one, then one fixed reduction tree: the arithmetic of a
 * (weight row, x row) pair is the same in every tile, so results depend neither on M, nor on N's
 * grouping in fours, nor on the thread count. */
#define NR 4
#define NSLOT 4 /* slots per call: NR x 1 or 1 x MROWS */
#define NSLOT_MAX 6 /* slots of the largest tile: 1 x MROWS_Q4_16 */
_Static_assert(NSLOT_MAX <= 6, "min_term holds the operands of 6 slots at most");
/* OP(i, a_i) for the mc x rows of a by-x q4 tile, whose accumulators are the variables a0 .. a5 */
#define FOR_X_ROWS(OP)                                                                                           \
    do {                                                                                                         \
        OP(0, a0);                                                                                               \
        if (mc > 1) OP(1, a1);                                                                                   \
        if (mc > 2) OP(2, a2);                                                                                   \
        if (mc > 3) OP(3, a3);                                                                                   \
        if (mc > 4) OP(4, a4);                                                                                   \
        if (mc > 5) OP(5, a5);                                                                                   \
    } while (0)

#if LOOM_QSIMD
/* ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) for one vector: the order of hsum4 below. */
ALWAYS_INLINE float hsum8_tree(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

/* The four horizontal sums of v[0..3], lane i = hsum8_tree(v[i]), in three VHADDPS and one add. */
ALWAYS_INLINE __m128 hsum4(const __m256 *v) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The end of a tile of `cnt` slots with accumulators a0 (even blocks) and a1 (odd blocks): the mins' term
 * sum_g mn[g] gs[g] into a1 (mins of slot i at mn + row(i) ng, sums at gs + xrow(i) ng), then
 * out[i] = hsum8_tree(a0[i] + a1[i]) + tail[i] (tail: the scalar mins' term when ng < 8). */
ALWAYS_INLINE void finish(const int cnt, const int rows_are_slots, __m256 *a0, __m256 *a1, const uint16_t *mn,
                          const float *gs, int64_t ng, float *out) {
    float tail[NSLOT] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (mn)
        for (int i = 0; i < cnt; ++i) {
            const uint16_t *mi = mn + (rows_are_slots ? i : 0) * ng;
            const float *gi = gs + (rows_are_slots ? 0 : i) * ng;
            if (!min_term(mi, 0, gi, 0, ng, 1, a1 + i))
                for (int64_t g = 0; g < ng; ++g) tail[i] += loom_f16_to_f32(mi[g]) * gi[g];
        }
    __m256 v[NSLOT];
    for (int i = 0; i < cnt; ++i) v[i] = _mm256_add_ps(a0[i], a1[i]);
    if (cnt == NSLOT) {
        float t[NSLOT];
        _mm_storeu_ps(t, hsum4(v));
        for (int i = 0; i < NSLOT; ++i) out[i] = t[i] + tail[i];
    } else {
        for (int i = 0; i < cnt; ++i) out[i] = hsum8_tree(v[i]) + tail[i];
    }
}

/* A weight block ready for the integer dot: u = the u8 operand (q4 nibbles, or |w| for q8), s = the q8
 * weight bytes whose signs move onto the activation. */
typedef struct {
    __m256i u, s;
} wblock;

ALWAYS_INLINE wblock q8_prep(const int kind, const uint8_t *wb) {
    wblock r;
    if (kind == KIND_Q4) {
        r.u = q4_unpack(wb);
        r.s = r.u;
    } else {
        r.s = _mm256_loadu_si256((const __m256i *)wb);
        r.u = _mm256_sign_epi8(r.s, r.s);
    }
    return r;
}

/* acc + (integer dot of the weight block with the activation codes at xb) * its scale product at dj
 * (KIND_Q8_16: the two halves' products dj[0], dj[1] in lanes 0-3 / 4-7). */
ALWAYS_INLINE __m256 q8_dot(const int kind, wblock wb, const int8_t *xb, const float *dj, __m256 acc) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)xb);
    if (kind != KIND_Q4) xv = _mm256_sign_epi8(xv, wb.s);
    const __m256 dv = kind == KIND_Q8_16
                          ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)dj))),
                                                     _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
                          : _mm256_broadcast_ss(dj);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wb.u, xv)), dv, acc);
}

/* q4g, two blocks at once. 32 packed bytes hold blocks b and b + 1 (16 bytes each); with one shift and
 * two ands they give LO = [values 0..15 of b | values 0..15 of b + 1] and HI = [16..31 of b | 16..31 of
 * b + 1]. The activations are re-laid out to match once per call (q4_pair_activations: XLO, XHI of the
 * pair side by side), so the pair needs two VPMADDUBSW, one VPADDW (<= 2 * 2 * 15 * 127 = 7620: no
 * overflow), one VPMADDWD and one FMA with [d_b x4 | d_b+1 x4]: about two thirds of the work of two single
 * blocks. acc + (integer dots of the pair) * their scale products dj[0], dj[1]. */
typedef struct {
    __m256i lo, hi;
} wpair;

ALWAYS_INLINE wpair q4_pair_prep(const uint8_t *wb) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)wb), m4 = _mm256_set1_epi8(0x0F);
    wpair r;
    r.lo = _mm256_and_si256(v, m4);
    r.hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    return r;
}

ALWAYS_INLINE __m256 q4_pair_dot(wpair wp, const int8_t *xp, const float *dj, __m256 acc) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp), x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i p = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wp.lo, x0), wp.hi, x1);
#else
    const __m256i p = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wp.lo, x0), _mm256_maddubs_epi16(wp.hi, x1)),
                                        _mm256_set1_epi16(1));
#endif
    const __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)dj))),
                                               _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dv, acc);
}
#endif /* LOOM_QSIMD */

/* xp = xq with each pair of blocks (2p, 2p + 1) of a row re-laid out as [x_2p[0:16] x_2p+1[0:16]
 * x_2p[16:32] x_2p+1[16:32]] (a last unpaired block as it is): the order q4_pair_dot reads. M rows of K. */
static void q4_pair_activations(const int8_t *xq, int64_t M, int64_t K, int8_t *xp) {
    const int64_t pairs = K / 64;
    for (int64_t m = 0; m < M; ++m) {
        const int8_t *src = xq + m * K;
        int8_t *dst = xp + m * K;
        for (int64_t p = 0; p < pairs; ++p) {
#if LOOM_QSIMD
            const __m256i a = _mm256_loadu_si256((const __m256i *)(src + 64 * p));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(src + 64 * p + 32));
            _mm256_storeu_si256((__m256i *)(dst + 64 * p), _mm256_permute2x128_si256(a, b, 0x20));
            _mm256_storeu_si256((__m256i *)(dst + 64 * p + 32), _mm256_permute2x128_si256(a, b, 0x31));
#else
            memcpy(dst + 64 * p, src + 64 * p, 16);
            memcpy(dst + 64 * p + 16, src + 64 * p + 32, 16);
            memcpy(dst + 64 * p + 32, src + 64 * p + 16, 16);
            memcpy(dst + 64 * p + 48, src + 64 * p + 48, 16);
#endif
        }
        if (K % 64) memcpy(dst + 64 * pairs, src + 64 * pairs, 32);
    }
}
#if LOOM_QSIMD

/* int16 activation codes (section 3) of a weight block against the block's x codes. q4g takes blocks in
 * pairs: 32 packed bytes (blocks b, b + 1), each byte zero-extended to int16 in its 128-bit lane, give with
 * one and / one shift per half A = [b 0-7 | b+1 0-7], B = [b 16-23 | b+1 16-23], C = [b 8-15 | b+1 8-15],
 * D = [b 24-31 | b+1 24-31] (the order q4_unit_codes16 lays the x codes out in). A last unpaired block is a
 * pair whose second block has zero codes. VPMADDWD of each with the x codes and three adds give 8 int32:
 * lanes 0-3 the dot of block b, lanes 4-7 of b + 1 (|sum| <= 32 * 15 * 32767 < 2^31: exact). */
typedef struct {
    __m256i a, b, c, d;
} w16x4;

ALWAYS_INLINE w16x4 q4_codes16(const uint8_t *p, int pair) {
    const __m256i v = pair ? _mm256_loadu_si256((const __m256i *)p)
                           : _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128((const __m128i *)p));
    const __m256i z = _mm256_setzero_si256(), m = _mm256_set1_epi16(0x0F);
    const __m256i lo = _mm256_unpacklo_epi8(v, z), hi = _mm256_unpackhi_epi8(v, z);
    w16x4 r;
    r.a = _mm256_and_si256(lo, m);
    r.b = _mm256_srli_epi16(lo, 4);
    r.c = _mm256_and_si256(hi, m);
    r.d = _mm256_srli_epi16(hi, 4);
    return r;
}

ALWAYS_INLINE __m256i q4_dot16(const w16x4 *w, const int16_t *xp) {
    const __m256i *x = (const __m256i *)xp;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* VPDPWSSD: each multiply-add with its add, the same exact int32 sums (no saturation, no overflow) */
    __m256i s = _mm256_madd_epi16(w->a, _mm256_loadu_si256(x));
    s = _mm256_dpwssd_epi32(s, w->b, _mm256_loadu_si256(x + 1));
    s = _mm256_dpwssd_epi32(s, w->c, _mm256_loadu_si256(x + 2));
    return _mm256_dpwssd_epi32(s, w->d, _mm256_loadu_si256(x + 3));
#else
    const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(w->a, _mm256_loadu_si256(x)),
                                        _mm256_madd_epi16(w->b, _mm256_loadu_si256(x + 1)));
    const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(w->c, _mm256_loadu_si256(x + 2)),
                                        _mm256_madd_epi16(w->d, _mm256_loadu_si256(x + 3)));
    return _mm256_add_epi32(s0, s1);
#endif
}

/* q8g: a block's 32 codes as two vectors of 16 int16 (values 0..15, 16..31), and its dots with the x codes
 * in value order: 8 int32 each (|sum| <= 16 * 128 * 32767 < 2^31). */
ALWAYS_INLINE void q8_codes16(const uint8_t *p, __m256i *w) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
}

typedef struct { /* one step's weight codes: q4 (a pair) or q8 (a block) */
    w16x4 w4;
    __m256i w8[2];
} wcodes;

/* [d[0] x4 | d[1] x4] (pair = 0: [d[0] x4 | 0 x4]) */
ALWAYS_INLINE __m256 pair_scales(const float *d, int pair) {
    if (!pair) return _mm256_castps128_ps256(_mm_broadcast_ss(d)); /* upper lanes zero */
    const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)d));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* acc + the dots of a q4 pair (pair = 0: one block) times their scale products d[0], d[1]. */
ALWAYS_INLINE __m256 dot16_q4(const w16x4 *w, const int16_t *xp, const float *d, int pair, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_dot16(w, xp)), pair_scales(d, pair), acc);
}

/* q8g (groups >= 32): acc + the block's dot times d[0]. */
ALWAYS_INLINE __m256 dot16_q8(const __m256i *w, const int16_t *x, const float *d, __m256 acc) {
    const __m256i lo = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)x));
    const __m256i hi = _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_broadcast_ss(d), acc);
}

/* q8g groups of 16: acc + the dot of one 16-value half (codes w, x codes at x) times its scale product d. */
ALWAYS_INLINE __m256 dot16_half(__m256i w, const int16_t *x, const float *d, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)x))),
                           _mm256_broadcast_ss(d), acc);
}

/* A pair's two weight block scales (float16 bits at sc) as [s0 x4 | s1 x4] float32 (pair = 0: [s0 x4 | 0 x4],
 * reading only sc[0]). */
ALWAYS_INLINE __m256 pair_weight_scales(const uint16_t *sc, int pair) {
    uint32_t bits = sc[0];
    if (pair) bits |= (uint32_t)sc[1] << 16;
    const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* The end of a rows16_q4 tile of cnt = nr * mc slots (accumulators acc): the mins' term (by-x tiles: each vector
 * of mins converted once for the mc rows of x), then the horizontal sums into dots. */
ALWAYS_INLINE void finish16(const int cnt, const int by_row, const int mc, __m256 *acc, const uint16_t *mn, int64_t ng,
                            const float *gs, float *dots) {
    float tail[NSLOT_MAX] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (mn) {
        int vec = 1;
        if (by_row)
            vec = min_term(mn, ng, gs, 0, ng, cnt, acc);
        else
            vec = min_term(mn, 0, gs, ng, ng, mc, acc);
        if (!vec)
            for (int i = 0; i < cnt; ++i) {
                const uint16_t *mi = mn + (by_row ? i : 0) * ng;
                const float *gi = gs + (by_row ? 0 : i) * ng;
                for (int64_t g = 0; g < ng; ++g) tail[i] += loom_f16_to_f32(mi[g]) * gi[g];
            }
    }
    int i = 0;
    float t[4];
    for (; i + 4 <= cnt; i += 4) { /* lane j of hsum4 = hsum8_tree(acc[i + j]) */
        _mm_storeu_ps(t, hsum4(acc + i));
        for (int j = 0; j < 4; ++j) dots[i + j] = t[j] + tail[i + j];
    }
    if (cnt - i == 3) { /* three sums in one hsum4 (a zero fourth) */
        const __m256 v[4] = {acc[i], acc[i + 1], acc[i + 2], _mm256_setzero_ps()};
        _mm_storeu_ps(t, hsum4(v));
        for (int j = 0; j < 3; ++j) dots[i + j] = t[j] + tail[i + j];
    } else if (cnt - i == 2) { /* two sums: the same tree, two VHADDPS for both */
        const __m256 h = _mm256_hadd_ps(acc[i], acc[i + 1]);
        const __m256 h2 = _mm256_hadd_ps(h, h);
        _mm_storeu_ps(t, _mm_add_ps(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
        dots[i] = t[0] + tail[i];
        dots[i + 1] = t[1] + tail[i + 1];
    } else if (cnt - i == 1) {
        dots[i] = hsum8_tree(acc[i]) + tail[i];
    }
}

/* q4g tiles of rows_16 with one accumulator per slot: acc += float(idot(pair)) * d for the pairs of blocks
 * in order, d = [f16(s_b) xs_b x4 | f16(s_b+1) xs_b+1 x4] (the same float32 products in both tiles), then the
 * mins' term, then hsum8_tree, the same sequence in by-row and by-x tiles. By-row tiles read one weight row
 * after the other (the order the DRAM stream wants) and form the products of 8 blocks with one multiply, each
 * pair's d by one permute of them (the scalar scale loads, a conversion and a multiply per pair had cost ~10%
 * of a one-row product: benchmarks/NOTES.md "the one-row tile"); by-x tiles unpack each pair of one weight row once for up to six
 * x rows (MROWS_Q4_16) and take the scale products from the pair's weight scales times the x rows' pair scale
 * vectors. With the two accumulators per slot of the q8 tiles, the by-x tile held eight accumulators and
 * GCC kept them on the stack (a store and a reload around every FMA: 8 cycles per pair and x row from L1,
 * benchmarks/NOTES.md "Third pass"). */
ALWAYS_INLINE void rows16_q4_256(const int nr, const int mc, const uint8_t *w, int64_t row_bytes,
                                 const uint16_t *sc, const uint16_t *mn, int64_t ng, const int16_t *xc, int64_t xstride,
                                 const float *xs, const float *xv, const float *gs, int64_t K, float *dots) {
    const int64_t nb = K / 32;
    const int cnt = nr * mc, by_row = nr == NR;
    __m256 acc[NSLOT_MAX];
    if (by_row) {
        /* the scale products of 8 blocks at a time (f16(sc) * xs, lane for lane block_scales' product), spread
         * to each pair's [d_b x4 | d_b+1 x4] by one permute */
        const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                                   _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
        for (int r = 0; r < NR; ++r) {
            __m256 a = _mm256_setzero_ps();
            const uint8_t *wr = w + r * row_bytes;
            const uint16_t *sr = sc + r * ng;
            int64_t j = 0;
            for (; j + 8 <= nb; j += 8) {
                const __m256 P = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sr + j))),
                                               _mm256_loadu_ps(xs + j));
                for (int u = 0; u < 4; ++u) { /* the pair at block j + 2u */
                    const w16x4 q = q4_codes16(wr + 16 * (j + 2 * u), 1);
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_dot16(&q, xc + 32 * (j + 2 * u))),
                                        _mm256_permutevar8x32_ps(P, spread[u]), a);
                }
            }
            for (; j < nb; j += 2) {
                const int pair = j + 1 < nb;
                const w16x4 q = q4_codes16(wr + 16 * j, pair);
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_dot16(&q, xc + 32 * j)),
                                    _mm256_mul_ps(pair_weight_scales(sr + j, pair), _mm256_loadu_ps(xv + 4 * j)), a);
            }
            acc[r] = a;
        }
    } else {
        /* d = S * X per pair: S = the weight row's two block scales [s_b x4 | s_b+1 x4] (once per pair, shared
         * by the mc rows of x), X = the x rows' pair scale vectors xv (once per call); lane for lane the same
         * float32 product as block_scales' f16(sc) * xs, without its per-slot arrays */
        const int64_t np = (nb + 1) / 2;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        for (int64_t p = 0; p < np; ++p) {
            const int64_t j = 2 * p;
            const int pair = j + 1 < nb;
            const w16x4 q = q4_codes16(w + 16 * j, pair);
            const __m256 S = pair_weight_scales(sc + j, pair);
            const int16_t *x = xc + 64 * p;
            const float *X = xv + 8 * p;
/* the pair against x row I into accumulator A: A + float(idot) * (S * X_I) */
#define X_PAIR(I, A)                                                                                             \
    A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_dot16(&q, x + (I) * xstride)),                                     \
                        _mm256_mul_ps(S, _mm256_loadu_ps(X + (I) * 8 * np)), A)
            FOR_X_ROWS(X_PAIR);
#undef X_PAIR
        }
        acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5;
    }
    finish16(cnt, by_row, mc, acc, mn, ng, gs, dots);
}

#if LOOM_Q512
/* The 512-bit q4g tile (avx512_vnni build): four blocks per vector. 64 packed bytes (blocks b .. b + 3, 16
 * bytes each, one per 128-bit lane) give with two unpacks, two ands and two shifts A = [v0-7 of b | of b+1 |
 * of b+2 | of b+3], B = [v16-23 ...], C = [v8-15 ...], D = [v24-31 ...] as int16, the order q4_unit_codes16
 * lays the x codes out in; VPMADDWD and three VPDPWSSD give 16 int32, lanes 4j..4j+3 the dot of block b + j
 * (exact: |sum| <= 32 * 15 * 32767 < 2^31). A last unit of 1-3 blocks is read with masked loads (zeros past
 * the row). Half the vector operations per block of the 256-bit tile. */
typedef struct {
    __m512i a, b, c, d;
} w16x4q;

ALWAYS_INLINE w16x4q q4_codes16_quad(const uint8_t *p, int nvalid) {
    const __m512i v = nvalid == 4 ? _mm512_loadu_si512((const void *)p)
                                  : _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * nvalid)) - 1, p);
    const __m512i z = _mm512_setzero_si512(), m = _mm512_set1_epi16(0x0F);
    const __m512i lo = _mm512_unpacklo_epi8(v, z), hi = _mm512_unpackhi_epi8(v, z);
    w16x4q r;
    r.a = _mm512_and_si512(lo, m);
    r.b = _mm512_srli_epi16(lo, 4);
    r.c = _mm512_and_si512(hi, m);
    r.d = _mm512_srli_epi16(hi, 4);
    return r;
}

ALWAYS_INLINE __m512i q4_dot16_quad(const w16x4q *w, const int16_t *xp) {
    __m512i s = _mm512_madd_epi16(w->a, _mm512_loadu_si512((const void *)xp));
    s = _mm512_dpwssd_epi32(s, w->b, _mm512_loadu_si512((const void *)(xp + 32)));
    s = _mm512_dpwssd_epi32(s, w->c, _mm512_loadu_si512((const void *)(xp + 64)));
    return _mm512_dpwssd_epi32(s, w->d, _mm512_loadu_si512((const void *)(xp + 96)));
}

/* The unit's weight block scales (float16 bits at sc, nvalid <= 4 of them) as [s0 x4 | s1 x4 | s2 x4 | s3 x4]
 * float32, missing blocks 0. */
ALWAYS_INLINE __m512 quad_weight_scales(const uint16_t *sc, int nvalid) {
    const __m128i h = nvalid == 4 ? _mm_loadl_epi64((const __m128i *)sc)
                                  : _mm_maskz_loadu_epi16((__mmask8)((1u << nvalid) - 1), sc);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(_mm_cvtph_ps(h)));
}

/* A last unit of one or two blocks in 256-bit vectors: the low halves of the quad's A-D and x vectors are the
 * pair layout of the 256-bit tiles, so the 256-bit pair dot gives lanes 0-7 of the quad's dot bit for bit
 * (its upper lanes would be 0 * 0); acc's lanes 0-7 get the same FMA, its upper lanes are left as they are
 * (the quad would add 0 * (S * X) = +0 to them). Two blocks of work instead of four: SmolLM2's 576-wide rows
 * are 4.5 units. */
ALWAYS_INLINE __m512 q4_half_unit(__m512 acc, const uint8_t *w, int nv, const int16_t *xp, __m512 d) {
    const w16x4 c = q4_codes16(w, nv == 2);
    const __m256i *x = (const __m256i *)xp; /* the low halves of the quad's four x vectors: int16 0, 32, 64, 96 */
    __m256i s = _mm256_madd_epi16(c.a, _mm256_loadu_si256(x));
    s = _mm256_dpwssd_epi32(s, c.b, _mm256_loadu_si256(x + 2));
    s = _mm256_dpwssd_epi32(s, c.c, _mm256_loadu_si256(x + 4));
    s = _mm256_dpwssd_epi32(s, c.d, _mm256_loadu_si256(x + 6));
    const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm512_castps512_ps256(d), _mm512_castps512_ps256(acc));
    return _mm512_insertf32x8(acc, lo, 0);
}

/* rows16_q4 in 512-bit vectors: acc += float(idot(unit)) * (S * X) per unit of four blocks in order, S the
 * weight row's four block scales, X the x row's unit scale vector xv (as the 256-bit by-x tiles: lane for
 * lane the float32 product f16(sc) * xs), in by-row and by-x tiles alike; then the two halves of the
 * accumulator added and the 256-bit tile's finish (mins, horizontal sums). */
ALWAYS_INLINE void rows16_q4_512(const int nr, const int mc, const uint8_t *w, int64_t row_bytes, const uint16_t *sc,
                                 const uint16_t *mn, int64_t ng, const int16_t *xc, int64_t xstride, const float *xv,
                                 const float *gs, int64_t K, float *dots) {
    const int64_t nb = K / 32, nq = (nb + 3) / 4;
    const int cnt = nr * mc, by_row = nr == NR;
    __m512 acc[NSLOT_MAX];
    if (by_row) {
        for (int r = 0; r < NR; ++r) {
            const uint8_t *wr = w + r * row_bytes;
            const uint16_t *sr = sc + r * ng;
            __m512 a = _mm512_setzero_ps();
            for (int64_t q = 0; q < nq; ++q) {
                const int nv = nb - 4 * q < 4 ? (int)(nb - 4 * q) : 4;
                const __m512 d = _mm512_mul_ps(quad_weight_scales(sr + 4 * q, nv), _mm512_loadu_ps(xv + 16 * q));
                if (nv <= 2) {
                    a = q4_half_unit(a, wr + 64 * q, nv, xc + 128 * q, d);
                    continue;
                }
                const w16x4q c = q4_codes16_quad(wr + 64 * q, nv);
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_dot16_quad(&c, xc + 128 * q)), d, a);
            }
            acc[r] = a;
        }
    } else {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        for (int64_t q = 0; q < nq; ++q) {
            const int nv = nb - 4 * q < 4 ? (int)(nb - 4 * q) : 4;
            const __m512 S = quad_weight_scales(sc + 4 * q, nv);
            const int16_t *x = xc + 128 * q;
            const float *X = xv + 16 * q;
            if (nv <= 2) {
/* the half unit against x row I into accumulator A */
#define X_HALF(I, A) A = q4_half_unit(A, w + 64 * q, nv, x + (I) * xstride, _mm512_mul_ps(S, _mm512_loadu_ps(X + (I) * 16 * nq)))
                FOR_X_ROWS(X_HALF);
#undef X_HALF
                continue;
            }
            const w16x4q c = q4_codes16_quad(w + 64 * q, nv);
/* the unit against x row I into accumulator A */
#define X_QUAD(I, A)                                                                                             \
    A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_dot16_quad(&c, x + (I) * xstride)),                                \
                        _mm512_mul_ps(S, _mm512_loadu_ps(X + (I) * 16 * nq)), A)
            FOR_X_ROWS(X_QUAD);
#undef X_QUAD
        }
        acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5;
    }
    __m256 acc8[NSLOT_MAX];
    for (int i = 0; i < cnt; ++i)
        acc8[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1));
    finish16(cnt, by_row, mc, acc8, mn, ng, gs, dots);
}
#endif /* LOOM_Q512 */

ALWAYS_INLINE void rows16_q4(const int nr, const int mc, const uint8_t *w, int64_t row_bytes, const uint16_t *sc,
                             const uint16_t *mn, int64_t ng, const int16_t *xc, int64_t xstride, const float *xs,
                             const float *xv, const float *gs, int64_t K, float *dots) {
#if LOOM_Q512
    (void)xs;
    rows16_q4_512(nr, mc, w, row_bytes, sc, mn, ng, xc, xstride, xv, gs, K, dots);
#else
    rows16_q4_256(nr, mc, w, row_bytes, sc, mn, ng, xc, xstride, xs, xv, gs, K, dots);
#endif
}
#endif /* LOOM_QSIMD */

/* dots[i] for the slots i of a tile (see above): weight rows at w + r row_bytes (scales sc + r ng, one per
 * group of bpg blocks, KIND_Q8_16: two per block; mins mn + r ng or NULL) against rows m of the int8
 * activations (xq stride K, xs stride K/32) and their group sums gs (stride ng):
 * sum_b (xs sc) idot + sum_g mn gs. nr == NR (then mc == 1) or nr == 1; both compile-time constants. */
ALWAYS_INLINE void rows_q8(const int kind, const int nr, const int mc, const uint8_t *w, int64_t row_bytes,
                           const uint16_t *sc, const uint16_t *mn, int64_t ng, int64_t bpg, const int8_t *xq,
                           const float *xs, const float *gs, int64_t K, float *dots) {
    const int64_t nb = K / 32;
#if LOOM_QSIMD
    const int64_t bb = kind == KIND_Q4 ? 16 : 32, ds = kind == KIND_Q8_16 ? 2 : 1;
    const int cnt = nr * mc, by_row = nr == NR;
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    for (int64_t c0 = 0; c0 < nb; c0 += CH) {
        const int64_t cc = nb - c0 < CH ? nb - c0 : CH;
        float d[NSLOT][2 * CH]; /* scale products of the chunk's blocks, per slot */
        for (int i = 0; i < cnt; ++i)
            block_scales(kind, sc + (by_row ? i : 0) * ng, bpg, xs + (by_row ? 0 : i) * nb, c0, cc, d[i]);
/* block c0 + (J) of weight row I (by_row tiles) into the accumulator A */
#define Q8_STEP(I, J, A)                                                                                         \
    A = q8_dot(kind, q8_prep(kind, w + (I) * row_bytes + bb * (c0 + (J))), xq + 32 * (c0 + (J)), d[I] + ds * (J), A)
/* all blocks of the chunk for weight row I: even ones into E, odd ones into O */
#define Q8_SLOT(I, E, O)                                                                                         \
    do {                                                                                                         \
        int64_t j_ = 0;                                                                                          \
        for (; j_ + 2 <= cc; j_ += 2) {                                                                          \
            Q8_STEP(I, j_, E);                                                                                   \
            Q8_STEP(I, j_ + 1, O);                                                                               \
        }                                                                                                        \
        if (j_ < cc) Q8_STEP(I, j_, E);                                                                          \
    } while (0)
/* q4g: the pairs of blocks of the chunk for weight row I, alternately into E and O (xq: paired layout) */
#define Q4_SLOT(I, E, O)                                                                                         \
    do {                                                                                                         \
        const uint8_t *w_ = w + (I) * row_bytes + 16 * c0;                                                       \
        const int8_t *x_ = xq + 32 * c0;                                                                         \
        int64_t j_ = 0;                                                                                          \
        for (; j_ + 4 <= cc; j_ += 4) {                                                                          \
            E = q4_pair_dot(q4_pair_prep(w_ + 16 * j_), x_ + 32 * j_, d[I] + j_, E);                             \
            O = q4_pair_dot(q4_pair_prep(w_ + 16 * j_ + 32), x_ + 32 * j_ + 64, d[I] + j_ + 2, O);               \
        }                                                                                                        \
        if (j_ + 2 <= cc) {                                                                                      \
            E = q4_pair_dot(q4_pair_prep(w_ + 16 * j_), x_ + 32 * j_, d[I] + j_, E);                             \
            j_ += 2;                                                                                             \
        }                                                                                                        \
        if (j_ < cc) O = q8_dot(kind, q8_prep(kind, w_ + 16 * j_), x_ + 32 * j_, d[I] + j_, O);                  \
    } while (0)
        if (kind == KIND_Q4 && by_row) {
            Q4_SLOT(0, e0, o0);
            Q4_SLOT(1, e1, o1);
            Q4_SLOT(2, e2, o2);
            Q4_SLOT(3, e3, o3);
        } else if (kind == KIND_Q4) { /* each pair of weight blocks unpacked once for the mc rows of x */
            const uint8_t *w_ = w + 16 * c0;
            const int8_t *x_ = xq + 32 * c0;
            int64_t j = 0;
            for (; j + 4 <= cc; j += 4) {
                const wpair pa = q4_pair_prep(w_ + 16 * j), pb = q4_pair_prep(w_ + 16 * j + 32);
                e0 = q4_pair_dot(pa, x_ + 32 * j, d[0] + j, e0);
                o0 = q4_pair_dot(pb, x_ + 32 * j + 64, d[0] + j + 2, o0);
                if (mc > 1) {
                    e1 = q4_pair_dot(pa, x_ + K + 32 * j, d[1] + j, e1);
                    o1 = q4_pair_dot(pb, x_ + K + 32 * j + 64, d[1] + j + 2, o1);
                }
                if (mc > 2) {
                    e2 = q4_pair_dot(pa, x_ + 2 * K + 32 * j, d[2] + j, e2);
                    o2 = q4_pair_dot(pb, x_ + 2 * K + 32 * j + 64, d[2] + j + 2, o2);
                }
                if (mc > 3) {
                    e3 = q4_pair_dot(pa, x_ + 3 * K + 32 * j, d[3] + j, e3);
                    o3 = q4_pair_dot(pb, x_ + 3 * K + 32 * j + 64, d[3] + j + 2, o3);
                }
            }
            if (j + 2 <= cc) {
                const wpair pa = q4_pair_prep(w_ + 16 * j);
                e0 = q4_pair_dot(pa, x_ + 32 * j, d[0] + j, e0);
                if (mc > 1) e1 = q4_pair_dot(pa, x_ + K + 32 * j, d[1] + j, e1);
                if (mc > 2) e2 = q4_pair_dot(pa, x_ + 2 * K + 32 * j, d[2] + j, e2);
                if (mc > 3) e3 = q4_pair_dot(pa, x_ + 3 * K + 32 * j, d[3] + j, e3);
                j += 2;
            }
            if (j < cc) {
                const wblock wa = q8_prep(kind, w_ + 16 * j);
                o0 = q8_dot(kind, wa, x_ + 32 * j, d[0] + j, o0);
                if (mc > 1) o1 = q8_dot(kind, wa, x_ + K + 32 * j, d[1] + j, o1);
                if (mc > 2) o2 = q8_dot(kind, wa, x_ + 2 * K + 32 * j, d[2] + j, o2);
                if (mc > 3) o3 = q8_dot(kind, wa, x_ + 3 * K + 32 * j, d[3] + j, o3);
            }
        } else if (by_row) {
            /* one weight row after the other: the tile reads its 4 rows in memory order (interleaving them,
             * four streams a row apart, halved the cold bandwidth of the q8g LM head) */
            Q8_SLOT(0, e0, o0);
            Q8_SLOT(1, e1, o1);
            Q8_SLOT(2, e2, o2);
            Q8_SLOT(3, e3, o3);
        } else { /* each weight block unpacked once for the mc rows of x */
            int64_t j = 0;
            for (; j + 2 <= cc; j += 2) {
                const wblock wa = q8_prep(kind, w + bb * (c0 + j)), wb = q8_prep(kind, w + bb * (c0 + j + 1));
                const int8_t *xj = xq + 32 * (c0 + j);
                e0 = q8_dot(kind, wa, xj, d[0] + ds * j, e0);
                o0 = q8_dot(kind, wb, xj + 32, d[0] + ds * (j + 1), o0);
                if (mc > 1) {
                    e1 = q8_dot(kind, wa, xj + K, d[1] + ds * j, e1);
                    o1 = q8_dot(kind, wb, xj + K + 32, d[1] + ds * (j + 1), o1);
                }
                if (mc > 2) {
                    e2 = q8_dot(kind, wa, xj + 2 * K, d[2] + ds * j, e2);
                    o2 = q8_dot(kind, wb, xj + 2 * K + 32, d[2] + ds * (j + 1), o2);
                }
                if (mc > 3) {
                    e3 = q8_dot(kind, wa, xj + 3 * K, d[3] + ds * j, e3);
                    o3 = q8_dot(kind, wb, xj + 3 * K + 32, d[3] + ds * (j + 1), o3);
                }
            }
            if (j < cc) {
                const wblock wa = q8_prep(kind, w + bb * (c0 + j));
                const int8_t *xj = xq + 32 * (c0 + j);
                e0 = q8_dot(kind, wa, xj, d[0] + ds * j, e0);
                if (mc > 1) e1 = q8_dot(kind, wa, xj + K, d[1] + ds * j, e1);
                if (mc > 2) e2 = q8_dot(kind, wa, xj + 2 * K, d[2] + ds * j, e2);
                if (mc > 3) e3 = q8_dot(kind, wa, xj + 3 * K, d[3] + ds * j, e3);
            }
        }
#undef Q4_SLOT
#undef Q8_SLOT
#undef Q8_STEP
    }
    __m256 a0[NSLOT] = {e0, e1, e2, e3}, a1[NSLOT] = {o0, o1, o2, o3};
    finish(cnt, by_row, a0, a1, mn, gs, ng, dots);
#else
    for (int r = 0; r < nr; ++r) {
        const uint8_t *wr = w + r * row_bytes;
        const uint16_t *scr = sc + r * ng;
        for (int m = 0; m < mc; ++m) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const int8_t *xb = xq + m * K + 32 * b;
                int32_t lo = 0, hi = 0; /* values 0..15 and 16..31 of the block */
                for (int j = 0; j < 16; ++j) {
                    const int qa = scalar_code(kind, wr, b, j), qb = scalar_code(kind, wr, b, 16 + j);
                    lo += qa * xb[j];
                    hi += qb * xb[16 + j];
                }
                const float xsb = xs[m * nb + b];
                if (kind == KIND_Q8_16) {
                    acc += (xsb * loom_f16_to_f32(scr[2 * b])) * (float)lo;
                    acc += (xsb * loom_f16_to_f32(scr[2 * b + 1])) * (float)hi;
                } else {
                    acc += (xsb * loom_f16_to_f32(scr[b / bpg])) * (float)(lo + hi);
                }
            }
            if (mn)
                for (int64_t g = 0; g < ng; ++g) acc += loom_f16_to_f32(mn[r * ng + g]) * gs[m * ng + g];
            dots[r * mc + m] = acc;
        }
    }
#endif
}

/* dots[i] = sum_b d[b] idot16(b) + sum_g mn[g] gs[m, g] for the slots of a tile (as rows_q8): the int16 x
 * codes of section 3 (xc: row stride xstride; q4g in SIMD builds: the pair layout), d = the weight block
 * scales times the x block scales xs (stride K/32), gs the group sums of the dequantized x (stride ng). */
ALWAYS_INLINE void rows_16(const int kind, const int nr, const int mc, const uint8_t *w, int64_t row_bytes,
                           const uint16_t *sc, const uint16_t *mn, int64_t ng, int64_t bpg, const int16_t *xc,
                           int64_t xstride, const float *xs, const float *xv, const float *gs, int64_t K,
                           float *dots) {
    const int64_t nb = K / 32;
#if LOOM_QSIMD
    if (kind == KIND_Q4) {
        rows16_q4(nr, mc, w, row_bytes, sc, mn, ng, xc, xstride, xs, xv, gs, K, dots);
        return;
    }
    const int64_t bb = kind == KIND_Q4 ? 16 : 32, step = kind == KIND_Q4 ? 2 : 1; /* blocks per step */
    const int cnt = nr * mc, by_row = nr == NR;
    __m256 a0[NSLOT], a1[NSLOT];
/* One step of the chunk (q4: the pair at block j, `pair` = 0 for a lone last block; q8: block j) of the
 * weight codes WQ against the x codes at X with scale products D, into ACC (q4 and q8 groups >= 32) or, for
 * groups of 16, the first half into E and the second into O. Steps go to E, O, E, ... from each chunk's
 * start (ACC = E for even steps j / step), in by-row and by-x tiles alike. */
#define STEP(WQ, X, D, J, PAIR, ACC, E, O)                                                                       \
    do {                                                                                                         \
        if (kind == KIND_Q4) {                                                                                   \
            ACC = dot16_q4(&(WQ).w4, X, D + (J), PAIR, ACC);                                                     \
        } else if (kind == KIND_Q8_16) {                                                                         \
            E = dot16_half((WQ).w8[0], X, D + 2 * (J), E);                                                       \
            O = dot16_half((WQ).w8[1], (X) + 16, D + 2 * (J) + 1, O);                                            \
        } else {                                                                                                 \
            ACC = dot16_q8((WQ).w8, X, D + (J), ACC);                                                            \
        }                                                                                                        \
    } while (0)
#define LOAD(WQ, WR, J, PAIR)                                                                                    \
    do {                                                                                                         \
        if (kind == KIND_Q4) (WQ).w4 = q4_codes16((WR) + 16 * (J), PAIR);                                        \
        else q8_codes16((WR) + 32 * (J), (WQ).w8);                                                               \
    } while (0)
/* all steps of the chunk for weight row I (by-row tiles): an even and an odd step per iteration */
#define R_SLOT(I, E, O)                                                                                          \
    do {                                                                                                         \
        const uint8_t *wr_ = w + (I) * row_bytes + bb * c0;                                                      \
        const int16_t *x_ = xc + 32 * c0;                                                                        \
        wcodes wq_;                                                                                              \
        int64_t j = 0;                                                                                           \
        for (; j + 2 * step <= cc; j += 2 * step) {                                                              \
            LOAD(wq_, wr_, j, 1);                                                                                \
            STEP(wq_, x_ + 32 * j, dr, j, 1, E, E, O);                                                         \
            LOAD(wq_, wr_, j + step, 1);                                                                         \
            STEP(wq_, x_ + 32 * (j + step), dr, j + step, 1, O, E, O);                                         \
        }                                                                                                        \
        if (j < cc) { /* an even step left: a whole pair or a lone block */                                     \
            LOAD(wq_, wr_, j, j + 1 < cc);                                                                       \
            STEP(wq_, x_ + 32 * j, dr, j, j + 1 < cc, E, E, O);                                                  \
            j += step;                                                                                           \
        }                                                                                                        \
        if (j < cc) { /* q4 only: then an odd one, a lone last block (cc - j was 3) */                           \
            LOAD(wq_, wr_, j, 0);                                                                                \
            STEP(wq_, x_ + 32 * j, dr, j, 0, O, E, O);                                                           \
        }                                                                                                        \
    } while (0)
/* the step at j of the one weight row (codes in wq) against x row M (by-x tiles) */
#define X_STEP(M, E, O)                                                                                          \
    do {                                                                                                         \
        const int16_t *x_ = xc + (M) * xstride + 32 * (c0 + j);                                                  \
        if (odd) STEP(wq, x_, d[M], j, pair, O, E, O);                                                           \
        else STEP(wq, x_, d[M], j, pair, E, E, O);                                                               \
    } while (0)
    if (by_row) {
        /* one weight row after the other, in memory order (see rows_q8), each with its own two accumulators in
         * registers (eight live across the rows spilled inside the loop) */
        for (int r = 0; r < NR; ++r) {
            __m256 e = _mm256_setzero_ps(), o = e;
            for (int64_t c0 = 0; c0 < nb; c0 += CH) { /* CH is even: chunks start on a pair */
                const int64_t cc = nb - c0 < CH ? nb - c0 : CH;
                float dr[2 * CH]; /* scale products of the chunk's blocks (KIND_Q8_16: halves) */
                block_scales(kind, sc + r * ng, bpg, xs, c0, cc, dr);
                R_SLOT(r, e, o);
            }
            a0[r] = e;
            a1[r] = o;
        }
    } else {
        __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
        for (int64_t c0 = 0; c0 < nb; c0 += CH) {
            const int64_t cc = nb - c0 < CH ? nb - c0 : CH;
            float d[NSLOT][2 * CH]; /* scale products of the chunk's blocks, per x row */
            for (int i = 0; i < mc; ++i) block_scales(kind, sc, bpg, xs + i * nb, c0, cc, d[i]);
            for (int64_t j = 0; j < cc; j += step) {
                const int pair = kind == KIND_Q4 && j + 1 < cc, odd = (j / step) & 1;
                wcodes wq;
                LOAD(wq, w + bb * c0, j, pair);
                X_STEP(0, e0, o0);
                if (mc > 1) X_STEP(1, e1, o1);
                if (mc > 2) X_STEP(2, e2, o2);
                if (mc > 3) X_STEP(3, e3, o3);
            }
        }
        a0[0] = e0, a0[1] = e1, a0[2] = e2, a0[3] = e3;
        a1[0] = o0, a1[1] = o1, a1[2] = o2, a1[3] = o3;
    }
#undef X_STEP
#undef R_SLOT
#undef LOAD
#undef STEP
    finish(cnt, by_row, a0, a1, mn, gs, ng, dots);
#else
    for (int r = 0; r < nr; ++r) {
        const uint8_t *wr = w + r * row_bytes;
        const uint16_t *scr = sc + r * ng;
        for (int m = 0; m < mc; ++m) {
            const int16_t *xm = xc + m * xstride;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                int32_t lo = 0, hi = 0; /* values 0..15 and 16..31 */
                for (int j = 0; j < 16; ++j) {
                    const int qa = scalar_code(kind, wr, b, j), qb = scalar_code(kind, wr, b, 16 + j);
                    lo += qa * xm[32 * b + j];
                    hi += qb * xm[32 * b + 16 + j];
                }
                const float xsb = xs[m * nb + b];
                if (kind == KIND_Q8_16) {
                    acc += (loom_f16_to_f32(scr[2 * b]) * xsb) * (float)lo;
                    acc += (loom_f16_to_f32(scr[2 * b + 1]) * xsb) * (float)hi;
                } else {
                    acc += (loom_f16_to_f32(scr[b / bpg]) * xsb) * (float)(lo + hi);
                }
            }
            if (mn)
                for (int64_t g = 0; g < ng; ++g) acc += loom_f16_to_f32(mn[r * ng + g]) * gs[m * ng + g];
            dots[r * mc + m] = acc;
        }
    }
#endif
}

/* rows_q8 / rows_16 with `kind`, `nr` and `mc` turned into constants: nr == NR (then mc == 1), or nr == 1. */
#define DEFINE_ROWS(ROWS, XT, KIND, NAME, MAXMC)                                                                       \
    static void NAME(int64_t nr, int64_t mc, const uint8_t *w, int64_t rb, const uint16_t *sc, const uint16_t *mn, \
                     int64_t ng, int64_t bpg, const XT *x, int64_t ldx, const float *xs, const float *xv,          \
                     const float *gs, int64_t K, float *dots) {                                                  \
        (void)ldx; /* each path reads only its own arguments */                                                 \
        (void)xs;                                                                                                \
        (void)xv;                                                                                                \
        if (nr == NR) {                                                                                          \
            ROWS(KIND, NR, 1, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots);                                  \
            return;                                                                                              \
        }                                                                                                        \
        switch (mc) {                                                                                            \
        case 1: ROWS(KIND, 1, 1, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots); break;                        \
        case 2: ROWS(KIND, 1, 2, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots); break;                        \
        case 3: ROWS(KIND, 1, 3, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots); break;                        \
        case 4: ROWS(KIND, 1, 4, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots); break;                        \
        case 5: ROWS(KIND, 1, (MAXMC) > 4 ? 5 : 4, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots); break;      \
        default: ROWS(KIND, 1, (MAXMC) > 4 ? 6 : 4, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots); break;                       \
        }                                                                                                        \
    }
/* one signature for both paths: q8 (x = xq, ldx unused, xs = scales, gs = group sums), f (xs unused) */
#define ROWS_Q8_ARGS(KIND, NR_, MC_, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots) \
    rows_q8(KIND, NR_, MC_, w, rb, sc, mn, ng, bpg, x, xs, gs, K, dots)
#define ROWS_16_ARGS(KIND, NR_, MC_, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots) \
    rows_16(KIND, NR_, MC_, w, rb, sc, mn, ng, bpg, x, ldx, xs, xv, gs, K, dots)
DEFINE_ROWS(ROWS_Q8_ARGS, int8_t, KIND_Q4, rows_q8_q4, MROWS)
DEFINE_ROWS(ROWS_Q8_ARGS, int8_t, KIND_Q8, rows_q8_q8, MROWS)
DEFINE_ROWS(ROWS_Q8_ARGS, int8_t, KIND_Q8_16, rows_q8_q8_16, MROWS)
DEFINE_ROWS(ROWS_16_ARGS, int16_t, KIND_Q4, rows_16_q4, MROWS_Q4_16)
DEFINE_ROWS(ROWS_16_ARGS, int16_t, KIND_Q8, rows_16_q8, MROWS)
DEFINE_ROWS(ROWS_16_ARGS, int16_t, KIND_Q8_16, rows_16_q8_16, MROWS)
typedef void (*rows_q8_fn)(int64_t, int64_t, const uint8_t *, int64_t, const uint16_t *, const uint16_t *, int64_t,
                           int64_t, const int8_t *, int64_t, const float *, const float *, const float *, int64_t,
                           float *);
typedef void (*rows_16_fn)(int64_t, int64_t, const uint8_t *, int64_t, const uint16_t *, const uint16_t *, int64_t,
                           int64_t, const int16_t *, int64_t, const float *, const float *, const float *, int64_t,
                           float *);

/* Work below which the products run on the calling thread: waking the pool costs more than it saves. */
#define PAR_MIN_WORK 32768

/* Software prefetch of weight rows [n0, n0 + rows) (codes, scales, mins) a few tiles ahead of use: 16 rows
 * ahead took 30 cold [3072, 576] q4g products on 2 Zen 3 threads from 13.6 to 15.5-21 GB/s (8 rows: about
 * the same, none: the first figure; benchmarks/NOTES.md, "Second pass"). */
#define PREFETCH_ROWS 16
static inline void prefetch_rows(const uint8_t *w, int64_t row_bytes, const uint16_t *sc, const uint16_t *mn,
                                 int64_t ng, int64_t n0, int64_t rows, int64_t N) {
    if (n0 >= N) return;
    if (rows > N - n0) rows = N - n0;
    const char *p = (const char *)(w + n0 * row_bytes);
    for (int64_t off = 0; off < rows * row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    p = (const char *)(sc + n0 * ng);
    for (int64_t off = 0; off < rows * ng * 2; off += 64) __builtin_prefetch(p + off, 0, 3);
    if (mn) {
        p = (const char *)(mn + n0 * ng);
        for (int64_t off = 0; off < rows * ng * 2; off += 64) __builtin_prefetch(p + off, 0, 3);
    }
}

/* M > 1: the weight rows in chunks of at most CHUNK_BYTES (codes, scales, mins), in a multiple of
 * num_threads chunks of equal size. */
#define CHUNK_BYTES (128 * 1024)
static int64_t weight_chunks(int64_t N, int64_t row_bytes, int num_threads) {
    const int64_t t = num_threads > 0 ? num_threads : 1;
    int64_t rows = CHUNK_BYTES / (row_bytes > 0 ? row_bytes : 1);
    if (rows < 1) rows = 1;
    const int64_t per = t * rows;
    const int64_t chunks = t * ((N + per - 1) / per);
    return chunks < N ? chunks : (N > 0 ? N : 1);
}

/* y = the tiles over all (n, m), shared by both paths: `rows(nr, mc, n, m0, dots)` computes one tile. At
 * M == 1 the work items are fixed groups of NR rows (a last partial group runs a row at a time); at M > 1
 * chunks of weight rows (weight_chunks), each running its rows against the x rows in passes of MR: the
 * pass's x rows stay in L1 and the chunk in L2 (one weight row against all M rows before the next read the
 * M rows from L2 and beyond: at M = 512 a layer's four q4 matrices took 67 ms instead of 43; running each
 * pass over all N rows re-read the 28 MB LM head from DRAM per pass; benchmarks/NOTES.md, "Fourth pass").
 * Contiguous ranges of items per thread. */
#define FOR_EACH_TILE(TILE, MR, WROW_BYTES)                                                                      \
    const int64_t items = M == 1 ? (N + NR - 1) / NR : weight_chunks(N, (WROW_BYTES), num_threads);              \
    const int64_t chunk = M == 1 ? NR : (N + items - 1) / items;                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (N * K * M >= PAR_MIN_WORK)")       \
    for (int64_t it = 0; it < items; ++it) {                                                                     \
        float dots[NSLOT_MAX];                                                                                   \
        if (M == 1) {                                                                                            \
            const int64_t n0 = it * NR, cnt = N - n0 < NR ? N - n0 : NR;                                         \
            prefetch_rows(w, row_bytes, sc, mn, ng, n0 + PREFETCH_ROWS, NR, N);                                  \
            if (cnt == NR) {                                                                                     \
                TILE(NR, 1, n0, 0);                                                                              \
                for (int64_t r = 0; r < NR; ++r)                                                                 \
                    loom_store_out(y, n0 + r, dots[r] + (bias ? bias[n0 + r] : 0.0f), y_bf16);                   \
            } else {                                                                                             \
                for (int64_t n = n0; n < n0 + cnt; ++n) {                                                        \
                    TILE(1, 1, n, 0);                                                                            \
                    loom_store_out(y, n, dots[0] + (bias ? bias[n] : 0.0f), y_bf16);                             \
                }                                                                                                \
            }                                                                                                    \
        } else {                                                                                                 \
            const int64_t lo = it * chunk, hi = N - lo < chunk ? N : lo + chunk;                                 \
            for (int64_t m0 = 0; m0 < M; m0 += (MR)) {                                                           \
                const int64_t mc = M - m0 < (MR) ? M - m0 : (MR);                                                \
                for (int64_t n = lo; n < hi; ++n) {                                                              \
                    if (m0 == 0) prefetch_rows(w, row_bytes, sc, mn, ng, n + PREFETCH_ROWS, 1, hi);              \
                    TILE(1, mc, n, m0);                                                                          \
                    const float bn = bias ? bias[n] : 0.0f;                                                      \
                    for (int64_t m = 0; m < mc; ++m) loom_store_out(y, (m0 + m) * N + n, dots[m] + bn, y_bf16);  \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }

/* q4g with groups of bpg > 1 blocks: the scales (and mins, where mn) of nr rows at sc / mn (ng groups a row) each
 * repeated for the bpg blocks of its group into esc / emn (nb = ng bpg a row), the one-scale-per-block form the
 * q4 tiles read: they then compute exactly what they compute for the same weight expanded to groups of 32. */
static inline void repeat_u16(const uint16_t *src, int64_t n, int64_t times, uint16_t *dst) {
    if (times == 2) /* g64: the common cases spelled out, so that they vectorise */
        for (int64_t i = 0; i < n; ++i) dst[2 * i] = dst[2 * i + 1] = src[i];
    else if (times == 4) /* g128 */
        for (int64_t i = 0; i < n; ++i) dst[4 * i] = dst[4 * i + 1] = dst[4 * i + 2] = dst[4 * i + 3] = src[i];
    else
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < times; ++j) dst[i * times + j] = src[i];
}

static inline void q4_block_scales(const uint16_t *sc, const uint16_t *mn, int64_t ng, int64_t bpg, int64_t nr,
                                   uint16_t *esc, uint16_t *emn) {
    repeat_u16(sc, nr * ng, bpg, esc);
    if (mn) repeat_u16(mn, nr * ng, bpg, emn);
}

/* In a tile macro of rows [N_, N_ + NR_): tsc / tmn, the scales and mins the tiles read (ng a row, or for q4x
 * the rows' copies expanded to one a block into the stack buffers esc / emn). Needs sc, mn, ng, nb, bpg, q4x. */
#define TILE_SCALES(NR_, N_)                                                                                     \
    const uint16_t *tsc = sc + (N_) * ng, *tmn = mn ? mn + (N_) * ng : NULL;                                     \
    uint16_t esc[q4x ? (NR_) * nb : 1], emn[q4x && mn ? (NR_) * nb : 1];                                         \
    if (q4x) {                                                                                                   \
        q4_block_scales(tsc, tmn, ng, bpg, (NR_), esc, emn);                                                     \
        tsc = esc, tmn = mn ? emn : NULL;                                                                        \
    }

static int gemm_q8(int kind, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                   const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t G, const float *bias, void *y,
                   int64_t N, int y_bf16, int num_threads) {
    const int64_t nb = K / 32, ng = K / G, row_bytes = kind == KIND_Q4 ? K / 2 : K;
    const int64_t bpg = G >= 32 ? G / 32 : 1;
    /* q4g with groups of several blocks: each tile's scales and mins expanded per block (q4_block_scales), the
     * mins' term per block against xsum */
    const int q4x = kind == KIND_Q4 && G > 32;
    const int64_t tng = q4x ? nb : ng, tbpg = q4x ? 1 : bpg;
    const float *gs = xsum;
    float *scratch = NULL;
    if (mn && G != 32 && !q4x) {
        scratch = (float *)loom_alloc64((size_t)(M * ng) * sizeof(float));
        if (!scratch) return -1;
        q8_group_sums(xq, xs, xsum, M, K, G, scratch);
        gs = scratch;
    }
    int8_t *xp = NULL; /* q4g (SIMD builds): the activations in the paired layout of q4_pair_dot */
    if (kind == KIND_Q4 && LOOM_QSIMD) {
        xp = (int8_t *)loom_alloc64((size_t)(M * K));
        if (!xp) {
            free(scratch);
            return -1;
        }
        q4_pair_activations(xq, M, K, xp);
        xq = xp;
    }
    const rows_q8_fn rows = kind == KIND_Q4 ? rows_q8_q4 : (kind == KIND_Q8 ? rows_q8_q8 : rows_q8_q8_16);
#define Q8_TILE(NR_, MC_, N_, M0_)                                                                               \
    do {                                                                                                         \
        TILE_SCALES(NR_, N_);                                                                                    \
        rows(NR_, MC_, w + (N_) * row_bytes, row_bytes, tsc, tmn, tng, tbpg, xq + (M0_) * K, K, xs + (M0_) * nb, \
             NULL, gs + (M0_) * tng, K, dots);                                                                   \
    } while (0)
    FOR_EACH_TILE(Q8_TILE, MROWS, row_bytes + 2 * ng * (mn ? 2 : 1))
#undef Q8_TILE
    free(xp);
    free(scratch);
    return 0;
}

/* xq int8 [M, K], xs / xsum float32 [M, K/32] (loom_quantize_act); qweight uint8 [N, K/2]; scales / mins
 * float16 bits [N, K/group] (mins may be NULL), group a multiple of 32 dividing K (groups of several blocks give
 * exactly the product of the weight expanded to groups of 32: the mins' term per block); bias float32 [N] or NULL;
 * y [M, N] float32 or bfloat16. */
int loom_gemm_q4g_q8(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                     const uint8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t group,
                     const float *bias, void *y, int64_t N, int y_bf16, int num_threads) {
    return gemm_q8(KIND_Q4, xq, xs, xsum, M, K, qweight, scales, mins, group, bias, y, N, y_bf16, num_threads);
}

/* As loom_gemm_q4g_q8 for q8g: qweight int8 [N, K], scales / mins [N, K/group] (group 16 or a multiple of
 * 32 dividing K). */
int loom_gemm_q8g_q8(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                     const int8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t group,
                     const float *bias, void *y, int64_t N, int y_bf16, int num_threads) {
    return gemm_q8(group == 16 ? KIND_Q8_16 : KIND_Q8, xq, xs, xsum, M, K, (const uint8_t *)qweight, scales, mins,
                   group, bias, y, N, y_bf16, num_threads);
}

/* ------------------------------------------------------------------------------------------------------ */
/* 2b. int8 x int8 with one scale per weight row and one per x row: exact int32 dots                         */
/* ------------------------------------------------------------------------------------------------------ */

/* y[m, n] = ((float)dot(xq[m], w[n]) * f16(sc[n])) * xs[m * xs_stride] (+ bias[n]), the dot an exact int32 sum
 * over all K (|dot| <= K * 128 * 127 < 2^31 for K < 132,000), so any summation order gives the same bits, and the
 * float epilogue is that of methods._int8_gemm over torch's exact int8 GEMM (convert, times the weight scale,
 * times the activation scale, plus the bias: -ffp-contract=off keeps them apart): the two are interchangeable
 * bit for bit, whatever the number of rows. W8A8 with per-channel weights and per-token (or static) activation
 * scales. xq int8 [M, K] (K % 32 == 0), w int8 [N, K] (codes -128..127), sc float16 bits [N]. */
#if LOOM_QSIMD
ALWAYS_INLINE int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* acc + the 8 int32 partial dots of one block of 32 codes: |w| (u8) times x with w's sign moved onto it (s8),
 * pairs summed to int16 (|2 * 128 * 127| < 2^15), then pairs of those to int32 */
ALWAYS_INLINE __m256i dot_i8_block(__m256i u, __m256i w, const int8_t *x, __m256i acc) {
    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), _mm256_set1_epi16(1)));
}
#endif

void loom_gemm_q8c_q8t(const int8_t *xq, const float *xs, int64_t xs_stride, int64_t M, int64_t K, const int8_t *w,
                       const uint16_t *sc, const float *bias, void *y, int64_t N, int y_bf16, int num_threads) {
    const int64_t nb = K / 32;
    /* weight rows in chunks of ~32 KB; each chunk against all x rows in passes of 4 (the chunk stays in L2) */
    const int64_t rows = K > 0 && K < 32768 ? 32768 / K : 1, chunks = (N + rows - 1) / rows;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = c * rows, hi = lo + rows < N ? lo + rows : N;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mc = M - m0 < 4 ? (int)(M - m0) : 4;
            for (int64_t n = lo; n < hi; ++n) {
                const int8_t *wn = w + n * K, *x0 = xq + m0 * K;
                int32_t dot[4] = {0, 0, 0, 0};
#if LOOM_QSIMD
                __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t b = 0; b < nb; ++b) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(wn + 32 * b));
                    const __m256i u = _mm256_sign_epi8(wv, wv);
                    a0 = dot_i8_block(u, wv, x0 + 32 * b, a0);
                    if (mc > 1) a1 = dot_i8_block(u, wv, x0 + K + 32 * b, a1);
                    if (mc > 2) a2 = dot_i8_block(u, wv, x0 + 2 * K + 32 * b, a2);
                    if (mc > 3) a3 = dot_i8_block(u, wv, x0 + 3 * K + 32 * b, a3);
                }
                dot[0] = hsum8_epi32(a0), dot[1] = hsum8_epi32(a1), dot[2] = hsum8_epi32(a2), dot[3] = hsum8_epi32(a3);
#else
                for (int i = 0; i < mc; ++i)
                    for (int64_t k = 0; k < K; ++k) dot[i] += (int32_t)wn[k] * (int32_t)x0[i * K + k];
#endif
                const float sw = loom_f16_to_f32(sc[n]);
                for (int i = 0; i < mc; ++i) {
                    float v = ((float)dot[i] * sw) * xs[(m0 + i) * xs_stride];
                    if (bias) v += bias[n];
                    loom_store_out(y, (m0 + i) * N + n, v, y_bf16);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------------ */
/* 3. weight-only GEMM: int16 activation codes                                                              */
/* ------------------------------------------------------------------------------------------------------ */

/* One row x [K] (float32 or bfloat16) -> int16 codes c [K] in value order, block scales s [K/32] and the
 * sums of the dequantized halves h [K/16] (the header's item 3). */
static void quantize_row16(const void *x, int x_bf16, int64_t K, int16_t *c, float *s, float *h) {
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; ++b) {
#if LOOM_QSIMD
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            const int64_t k = 32 * b + 8 * i;
            v[i] = x_bf16 ? bf16x8_to_f32((const uint16_t *)x + k) : _mm256_loadu_ps((const float *)x + k);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        const float d = _mm256_movemask_ps(nan) ? NAN : hmax8(a) / 32767.0f;
        s[b] = d;
        if (d > 0.0f) {
            const __m256 dv = _mm256_set1_ps(d), lo = _mm256_set1_ps(-32767.0f), hi = _mm256_set1_ps(32767.0f);
            __m256i r[4];
            for (int i = 0; i < 4; ++i) /* MXCSR's default rounding: nearest even, as torch.round */
                r[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], dv), lo), hi));
            /* packs works per 128-bit lane; the permute puts the 16 values back in order */
            _mm256_storeu_si256((__m256i *)(c + 32 * b), _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(c + 32 * b + 16),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
            h[2 * b] = d * (float)hsum8_epi32(_mm256_add_epi32(r[0], r[1]));
            h[2 * b + 1] = d * (float)hsum8_epi32(_mm256_add_epi32(r[2], r[3]));
            continue;
        }
#else
        float v[32], mx = 0.0f;
        int nan = 0;
        for (int j = 0; j < 32; ++j) {
            const int64_t k = 32 * b + j;
            v[j] = x_bf16 ? loom_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            const float m = v[j] < 0 ? -v[j] : v[j];
            mx = m > mx ? m : mx;
            nan |= v[j] != v[j];
        }
        const float d = nan ? NAN : mx / 32767.0f;
        s[b] = d;
        if (d > 0.0f) {
            int32_t half[2] = {0, 0};
            for (int j = 0; j < 32; ++j) {
                float t = v[j] / d;
                t = t < -32767.0f ? -32767.0f : (t > 32767.0f ? 32767.0f : t);
                c[32 * b + j] = (int16_t)loom_round_even(t);
                half[j / 16] += c[32 * b + j];
            }
            h[2 * b] = d * (float)half[0];
            h[2 * b + 1] = d * (float)half[1];
            continue;
        }
#endif
        memset(c + 32 * b, 0, 32 * sizeof(int16_t)); /* s == 0 (an all-zero block) or NaN */
        h[2 * b] = h[2 * b + 1] = d * 0.0f;         /* NaN stays NaN */
    }
}

void loom_quantize_act16(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int16_t *c, float *s,
                         float *h, int num_threads) {
    const int64_t nb = K / 32, elem = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m)
        quantize_row16((const char *)x + m * ldx * elem, x_bf16, K, c + m * K, s + m * nb, h + m * 2 * nb);
}

/* One allocation holding x's int16 codes c [M, K], block scales s [M, K/32] and half sums h [M, K/16], filled by
 * loom_quantize_act16 (the activations of the 16-row products); NULL when malloc failed. Free the result. */
static char *act16(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int num_threads, int16_t **c,
                   float **s, float **h) {
    const int64_t nb = K / 32;
    char *buf = (char *)loom_alloc64((size_t)(M * K) * sizeof(int16_t) + (size_t)(M * 3 * nb) * sizeof(float));
    if (!buf) return NULL;
    *c = (int16_t *)buf;
    *s = (float *)(buf + (size_t)(M * K) * sizeof(int16_t));
    *h = *s + M * nb;
    loom_quantize_act16(x, ldx, x_bf16, M, K, *c, *s, *h, num_threads);
    return buf;
}

/* q4g in SIMD builds: the codes of each unit of u = Q4_UNIT blocks (2 in the 256-bit tiles, 4 in the 512-bit
 * ones) of a row laid out as q4_codes16 / q4_codes16_quad read them: values 0-7 of each of the u blocks, then
 * 16-23, then 8-15, then 24-31 (u = 2: [b 0-7 | b+1 0-7 | b 16-23 | b+1 16-23 | b 8-15 | b+1 8-15 | b 24-31 |
 * b+1 24-31]), missing blocks of a last unit as zeros; rows of `stride` = 32 u ceil(K / 32 u) codes. */
static void q4_unit_codes16(const int16_t *c, int64_t M, int64_t K, int64_t stride, int16_t *cp) {
    static const int offsets[4] = {0, 16, 8, 24};
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t p = 0; Q4_UNIT * p < nb; ++p)
            for (int i = 0; i < 4 * Q4_UNIT; ++i) {
                const int64_t blk = Q4_UNIT * p + i % Q4_UNIT;
                int16_t *dst = cp + m * stride + 32 * Q4_UNIT * p + 8 * i;
                if (blk < nb) memcpy(dst, c + m * K + 32 * blk + offsets[i / Q4_UNIT], 8 * sizeof(int16_t));
                else memset(dst, 0, 8 * sizeof(int16_t));
            }
}

#if LOOM_Q512
/* ---- q4g at many rows of x (prefill, large batches): 16 weight rows per vector ----------------------------
 * The tiles above put the K of one weight row across a vector's lanes, so each 128 products cost a dot, a
 * conversion, a scale product and an FMA (their int16 rate is torch's float32 GEMM's, ~1 product per float
 * FMA). Here a lane is a weight row instead: a group of 16 rows is copied once per call into lanes (each
 * 32-bit word of a block's 16 bytes, for the 16 rows side by side, rows past N zero), and each VPDPWSSD takes a
 * pair of x codes broadcast from memory against 16 rows; a block of 32 values is 16 of them per x row, then one
 * conversion, one scale product and one or two FMAs. The raw word W of bytes 4j..4j+3 of a block (low nibble of
 * byte i = value i, high = value i + 16) gives the int16 pairs (W >> s) & 0x000F000F, s = 0, 4, 8, 12: values
 * (4j, 4j+2), (4j+16, 4j+18), (4j+1, 4j+3), (4j+17, 4j+19); the x codes of each block are laid out in that
 * order (nx16_codes). Exact integer dots per block as the other tiles (|sum| <= 32 * 15 * 32767 < 2^31); the
 * same definition as section 3, summed in another order. */
#define NX16_MR 10 /* x rows per pass: 10 int32 + 10 float accumulators, 4 weight vectors (a 9-row verify step in one
                     * pass: 8 left a ninth row to a pass of its own, latency-bound) */
#define NX16_AHEAD 8 /* blocks ahead whose words are prefetched (2 KB) */
/* rows of x from which gemm_16 takes this path for q4g: above loom/quant/methods.py's DENSE_MIN_ROWS_BY_LAYOUT
 * (128), where the layer used to dequantize and run torch's float32 GEMM, so that every row count at which the
 * tiles ran keeps their bits (a row's result does not depend on its batch up to 128 rows); tests move it with
 * loom_set_nx16_min_rows */
static int64_t loom_nx16_min_rows = 129;

/* int16 codes c [M, K] from value order to the pair order of the words above, block by block, in place */
static void nx16_codes(int16_t *c, int64_t M, int64_t K, int num_threads) {
    static const int order[32] = {0,  2,  16, 18, 1,  3,  17, 19, 4,  6,  20, 22, 5,  7,  21, 23,
                                  8,  10, 24, 26, 9,  11, 25, 27, 12, 14, 28, 30, 13, 15, 29, 31};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t i = m * K; i < (m + 1) * K; i += 32) {
            int16_t block[32];
            memcpy(block, c + i, sizeof(block));
            for (int j = 0; j < 32; ++j) c[i + j] = block[order[j]];
        }
}

/* rows n0 .. n0 + nr - 1 (nr <= 16) of the weight into pk [nb][4][16] words, scales and mins (float16 bits) into
 * pd / pm [nb][16]: the q4gr16 layout of one group (loom/quant/layout.py), lanes past nr zero */
static void nx16_pack(const uint8_t *w, int64_t row_bytes, const uint16_t *sc, const uint16_t *mn, int64_t nb,
                      int64_t bpg, int64_t n0, int nr, uint32_t *pk, uint16_t *pd, uint16_t *pm) {
    if (nr < 16) {
        memset(pk, 0, (size_t)nb * 64 * sizeof(uint32_t));
        memset(pd, 0, (size_t)nb * 16 * sizeof(uint16_t));
        if (mn) memset(pm, 0, (size_t)nb * 16 * sizeof(uint16_t));
    }
    for (int r = 0; r < nr; ++r) {
        const uint8_t *wr = w + (n0 + r) * row_bytes;
        const int64_t ng = nb / bpg;
        const uint16_t *sr = sc + (n0 + r) * ng, *mr = mn ? mn + (n0 + r) * ng : NULL;
        for (int64_t b = 0; b < nb; ++b) {
            uint32_t v[4];
            memcpy(v, wr + 16 * b, 16);
            for (int j = 0; j < 4; ++j) pk[(b * 4 + j) * 16 + r] = v[j];
            pd[b * 16 + r] = sr[b / bpg]; /* a group's scale and min repeated for each of its blocks */
            if (mr) pm[b * 16 + r] = mr[b / bpg];
        }
    }
}

/* mc (compile-time) rows of x codes xc (stride K, pair order), their block scales xs and block sums gs (stride
 * nb; gs NULL without mins) against the packed group, whose scales and mins pd / pm are [nb / bpg][16] (each
 * used for bpg blocks in turn): the 16 outputs of each row into out (stride 16) */
ALWAYS_INLINE void nx16_rows(const int mc, const uint32_t *pk, const uint16_t *pd, const uint16_t *pm, int64_t nb,
                             int64_t bpg, const int16_t *xc, int64_t K, const float *xs, const float *gs, float *out) {
    const __m512i m4 = _mm512_set1_epi32(0x000F000F);
    __m512 af[NX16_MR];
    for (int r = 0; r < mc; ++r) af[r] = _mm512_setzero_ps();
    int64_t left = bpg; /* blocks left in the group of pd / pm */
    for (int64_t b = 0; b < nb; ++b) {
        __m512i ai[NX16_MR];
        for (int r = 0; r < mc; ++r) ai[r] = _mm512_setzero_si512();
        for (int line = 0; line < 4; ++line) /* a block's words: 4 cache lines */
            _mm_prefetch((const char *)(pk + (b + NX16_AHEAD) * 64 + 16 * line), _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) {
            const __m512i W = _mm512_loadu_si512((const void *)(pk + (b * 4 + j) * 16));
            const __m512i A = _mm512_and_si512(W, m4), B = _mm512_and_si512(_mm512_srli_epi32(W, 4), m4);
            const __m512i C = _mm512_and_si512(_mm512_srli_epi32(W, 8), m4);
            const __m512i D = _mm512_and_si512(_mm512_srli_epi32(W, 12), m4);
            for (int r = 0; r < mc; ++r) {
                const int32_t *xp = (const int32_t *)(xc + r * K + 32 * b + 8 * j);
                ai[r] = _mm512_dpwssd_epi32(ai[r], A, _mm512_set1_epi32(xp[0]));
                ai[r] = _mm512_dpwssd_epi32(ai[r], B, _mm512_set1_epi32(xp[1]));
                ai[r] = _mm512_dpwssd_epi32(ai[r], C, _mm512_set1_epi32(xp[2]));
                ai[r] = _mm512_dpwssd_epi32(ai[r], D, _mm512_set1_epi32(xp[3]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pd));
        for (int r = 0; r < mc; ++r)
            af[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r * nb + b])), af[r]);
        if (gs) {
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pm));
            for (int r = 0; r < mc; ++r) af[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(gs[r * nb + b]), af[r]);
        }
        if (--left == 0) { /* the next group's scales and mins */
            left = bpg;
            pd += 16;
            if (pm) pm += 16;
        }
    }
    for (int r = 0; r < mc; ++r) _mm512_storeu_ps(out + 16 * r, af[r]);
}

/* y [M, N] = the q4g weight-only product (section 3) by the 16-row groups above; x codes (reordered here, in
 * place), scales and half sums from loom_quantize_act16. The weight is q4g (each group laid out per call) or,
 * with `r16`, already in the q4gr16 layout (N a multiple of 16). Returns -1 when malloc failed (y then
 * incomplete). */
static int gemm16_q4_nx16(int16_t *xc, const float *xs, const float *h, int64_t M, int64_t K,
                          const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t bpg, int r16,
                          const float *bias, void *y, int64_t N, int y_bf16, int num_threads) {
    const int64_t nb = K / 32, ng = nb / bpg, row_bytes = K / 2, groups = (N + 15) / 16;
    float *gs = mn ? (float *)loom_alloc64((size_t)(M * nb) * sizeof(float)) : NULL;
    if (mn && !gs) return -1;
    nx16_codes(xc, M, K, num_threads);
    if (gs)
        for (int64_t i = 0; i < M * nb; ++i) gs[i] = h[2 * i] + h[2 * i + 1];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K * M >= PAR_MIN_WORK)
    {
        char *buf = r16 ? NULL : (char *)loom_alloc64((size_t)nb * 16 * (4 * sizeof(uint32_t) + 2 * sizeof(uint16_t)));
        if (!r16 && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            if (!r16 && !buf) continue;
            const int64_t n0 = 16 * g;
            const int nr = N - n0 < 16 ? (int)(N - n0) : 16;
            const uint32_t *pk;
            const uint16_t *pd, *pm;
            if (r16) {
                pk = (const uint32_t *)(w + n0 * row_bytes);
                pd = sc + n0 * ng;
                pm = mn ? mn + n0 * ng : NULL;
            } else {
                uint32_t *k = (uint32_t *)buf;
                uint16_t *d = (uint16_t *)(k + nb * 64), *m = d + nb * 16;
                nx16_pack(w, row_bytes, sc, mn, nb, bpg, n0, nr, k, d, m);
                pk = k, pd = d, pm = m;
            }
            const int64_t pbpg = r16 ? bpg : 1; /* the packed copy holds a scale per block */
            float out[16 * NX16_MR];
            for (int64_t m0 = 0; m0 < M; m0 += NX16_MR) {
                const int mc = M - m0 < NX16_MR ? (int)(M - m0) : NX16_MR;
                const int16_t *xr = xc + m0 * K;
                const float *xsr = xs + m0 * nb, *gsr = gs ? gs + m0 * nb : NULL;
                switch (mc) {
#define NX16_CASE(MC) \
    case MC: nx16_rows(MC, pk, pd, pm, nb, pbpg, xr, K, xsr, gsr, out); break;
                    NX16_CASE(1) NX16_CASE(2) NX16_CASE(3) NX16_CASE(4) NX16_CASE(5) NX16_CASE(6) NX16_CASE(7)
                    NX16_CASE(8) NX16_CASE(9) NX16_CASE(10)
#undef NX16_CASE
                }
                for (int r = 0; r < mc; ++r)
                    for (int i = 0; i < nr; ++i)
                        loom_store_out(y, (m0 + r) * N + n0 + i, out[16 * r + i] + (bias ? bias[n0 + i] : 0.0f), y_bf16);
            }
        }
        free(buf);
    }
    free(gs);
    return failed ? -1 : 0;
}

/* int16 codes, block scales and half sums of x [M, K] (loom_quantize_act16), then the 16-row groups */
static int gemm16_q4_groups(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *w,
                            const uint16_t *sc, const uint16_t *mn, int64_t bpg, int r16, const float *bias, void *y,
                            int64_t N, int y_bf16, int num_threads) {
    int16_t *c16;
    float *xs16, *h16;
    char *s16 = act16(x, ldx, x_bf16, M, K, num_threads, &c16, &xs16, &h16);
    if (!s16) return -1;
    const int rc = gemm16_q4_nx16(c16, xs16, h16, M, K, w, sc, mn, bpg, r16, bias, y, N, y_bf16, num_threads);
    free(s16);
    return rc;
}

/* ---- q8gr16: q8g (groups of 16 or 32) with 16 rows interleaved word by word (loom/quant/layout.py) -----------
 * A 32-bit lane holds bytes 4j..4j+3 of one row's block: values (4j, 4j+2) and (4j+1, 4j+3) are its two int16
 * pairs, (W << 8) >> 8 and W >> 8 per 16-bit half (arithmetic shifts: the codes are signed); the x codes of each
 * block are laid out in that order (nx16_codes_q8). Per block and per group of 16 (or the block, for groups of
 * 32): an exact int32 dot, then fma(dot, scale * x scale, acc) and, with mins, fma(min, the group's x sum, acc),
 * in block order; the portable code in loom_gemm_q8gr16_f does the same steps. */
static void nx16_codes_q8(int16_t *c, int64_t M, int64_t K, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t i = m * K; i < (m + 1) * K; i += 4) {
            const int16_t t = c[i + 1];
            c[i + 1] = c[i + 2], c[i + 2] = t;
        }
}

#define NX16_Q8_MR 10 /* x rows per pass of the q8 groups with groups of 32 (Q8_0, Q5_0: the LM heads); groups of
                        * 16 take 8 (two int32 accumulators a row) */

ALWAYS_INLINE void nx16_rows_q8(const int mc, const int g16, const uint32_t *pk, const uint16_t *sc,
                                const uint16_t *mn, int64_t nb, const int16_t *xc, int64_t K, const float *xs,
                                const float *h, float *out) {
    __m512 af[NX16_Q8_MR];
    for (int r = 0; r < mc; ++r) af[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int line = 0; line < 8; ++line) /* a block's words: 8 cache lines */
            _mm_prefetch((const char *)(pk + (b + NX16_AHEAD) * 128 + 16 * line), _MM_HINT_T0);
        __m512i a0[NX16_Q8_MR], a1[NX16_Q8_MR];
        for (int r = 0; r < mc; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
            const __m512i W = _mm512_loadu_si512((const void *)(pk + (b * 8 + j) * 16));
            const __m512i A = _mm512_srai_epi16(_mm512_slli_epi16(W, 8), 8), B = _mm512_srai_epi16(W, 8);
            for (int r = 0; r < mc; ++r) {
                const int32_t *xp = (const int32_t *)(xc + r * K + 32 * b + 4 * j);
                if (g16 && j >= 4) {
                    a1[r] = _mm512_dpwssd_epi32(a1[r], A, _mm512_set1_epi32(xp[0]));
                    a1[r] = _mm512_dpwssd_epi32(a1[r], B, _mm512_set1_epi32(xp[1]));
                } else {
                    a0[r] = _mm512_dpwssd_epi32(a0[r], A, _mm512_set1_epi32(xp[0]));
                    a0[r] = _mm512_dpwssd_epi32(a0[r], B, _mm512_set1_epi32(xp[1]));
                }
            }
        }
        const int64_t s0 = g16 ? 2 * b : b;
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + s0 * 16)));
        if (g16) {
            const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + (s0 + 1) * 16)));
            for (int r = 0; r < mc; ++r) {
                const __m512 sx = _mm512_set1_ps(xs[r * nb + b]);
                af[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_mul_ps(d0, sx), af[r]);
                af[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), _mm512_mul_ps(d1, sx), af[r]);
            }
            if (mn) {
                const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + s0 * 16)));
                const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + (s0 + 1) * 16)));
                for (int r = 0; r < mc; ++r) {
                    af[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(h[r * 2 * nb + 2 * b]), af[r]);
                    af[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(h[r * 2 * nb + 2 * b + 1]), af[r]);
                }
            }
        } else {
            for (int r = 0; r < mc; ++r)
                af[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_mul_ps(d0, _mm512_set1_ps(xs[r * nb + b])),
                                        af[r]);
            if (mn) {
                const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + s0 * 16)));
                for (int r = 0; r < mc; ++r)
                    af[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(h[r * 2 * nb + 2 * b] + h[r * 2 * nb + 2 * b + 1]),
                                            af[r]);
            }
        }
    }
    for (int r = 0; r < mc; ++r) _mm512_storeu_ps(out + 16 * r, af[r]);
}

static void gemm16_q8_r16(int16_t *xc, const float *xs, const float *h, int64_t M, int64_t K, const int8_t *w,
                          const uint16_t *sc, const uint16_t *mn, int g16, const float *bias, void *y, int64_t N,
                          int y_bf16, int num_threads) {
    const int64_t nb = K / 32, ng = g16 ? 2 * nb : nb;
    nx16_codes_q8(xc, M, K, num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t g = 0; g < N / 16; ++g) {
        const uint32_t *pk = (const uint32_t *)(w + 16 * g * K);
        const uint16_t *pd = sc + 16 * g * ng, *pm = mn ? mn + 16 * g * ng : NULL;
        float out[16 * NX16_Q8_MR];
        const int64_t per_pass = g16 ? 8 : NX16_Q8_MR;
        for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
            const int mc = M - m0 < per_pass ? (int)(M - m0) : (int)per_pass;
            const int16_t *xr = xc + m0 * K;
            const float *xsr = xs + m0 * nb, *hr = h + m0 * 2 * nb;
            switch (mc * 2 + g16) {
#define NX16_Q8_CASE(MC) \
    case 2 * MC: nx16_rows_q8(MC, 0, pk, pd, pm, nb, xr, K, xsr, hr, out); break; \
    case 2 * MC + 1: nx16_rows_q8(MC, 1, pk, pd, pm, nb, xr, K, xsr, hr, out); break;
                NX16_Q8_CASE(1) NX16_Q8_CASE(2) NX16_Q8_CASE(3) NX16_Q8_CASE(4) NX16_Q8_CASE(5) NX16_Q8_CASE(6)
                NX16_Q8_CASE(7) NX16_Q8_CASE(8)
    case 18: nx16_rows_q8(9, 0, pk, pd, pm, nb, xr, K, xsr, hr, out); break;
    case 20: nx16_rows_q8(10, 0, pk, pd, pm, nb, xr, K, xsr, hr, out); break;
#undef NX16_Q8_CASE
            }
            for (int r = 0; r < mc; ++r)
                for (int i = 0; i < 16; ++i)
                    loom_store_out(y, (m0 + r) * N + 16 * g + i, out[16 * r + i] + (bias ? bias[16 * g + i] : 0.0f),
                                   y_bf16);
        }
    }
}
#endif /* LOOM_Q512 */

/* Sets the row count from which q4g's weight-only product runs the 16-row groups (avx512_vnni builds);
 * returns the previous value, or -1 in builds without them. */
int64_t loom_set_nx16_min_rows(int64_t rows) {
#if LOOM_Q512
    const int64_t old = loom_nx16_min_rows;
    loom_nx16_min_rows = rows < 1 ? 1 : rows;
    return old;
#else
    (void)rows;
    return -1;
#endif
}

static int gemm_16(int kind, const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *w,
                   const uint16_t *sc, const uint16_t *mn, int64_t G, const float *bias, void *y, int64_t N,
                   int y_bf16, int num_threads) {
    const int64_t nb = K / 32, ng = K / G, row_bytes = kind == KIND_Q4 ? K / 2 : K;
    const int64_t bpg = G >= 32 ? G / 32 : 1;
    /* q4g with groups of several blocks: each tile's scales and mins expanded per block (q4_block_scales), the
     * mins' term per block (tG: the group the tiles see) */
    const int q4x = kind == KIND_Q4 && G > 32;
    const int64_t tG = q4x ? 32 : G, tng = K / tG, tbpg = q4x ? 1 : bpg;
#if LOOM_Q512
    if (kind == KIND_Q4 && M >= loom_nx16_min_rows)
        return gemm16_q4_groups(x, ldx, x_bf16, M, K, w, sc, mn, bpg, 0, bias, y, N, y_bf16, num_threads);
#endif
    const int paired = kind == KIND_Q4 && LOOM_QSIMD;
    const int64_t np = (nb + Q4_UNIT - 1) / Q4_UNIT, vw = 4 * Q4_UNIT; /* q4 units per row, floats per unit vector */
    const int64_t xstride = paired ? 32 * Q4_UNIT * np : K; /* int16 codes per row, as the kernel reads them */
    /* scratch (64-byte aligned, as the tiles' vector loads want): codes [M, K], unit-laid-out codes [M, xstride],
     * then floats: paired, the unit scale vectors xv [M, np, vw] (rows16_q4), then xs [M, nb], h [M, 2 nb],
     * gs [M, ng] (the offsets of the codes and of xv are multiples of 64 bytes: K % 32 == 0) */
    const size_t ncodes = (size_t)(M * K) + (paired ? (size_t)(M * xstride) : 0);
    const size_t nfloat = (size_t)(M * 3 * nb) + (mn ? (size_t)(M * tng) : 0) + (paired ? (size_t)(M * np * vw) : 0);
    char *scratch = (char *)loom_alloc64(ncodes * sizeof(int16_t) + nfloat * sizeof(float));
    if (!scratch) return -1;
    int16_t *codes = (int16_t *)scratch, *xc = codes;
    float *xv = paired ? (float *)(scratch + ncodes * sizeof(int16_t)) : NULL;
    float *xs = (float *)(scratch + ncodes * sizeof(int16_t)) + (paired ? M * np * vw : 0);
    float *h = xs + M * nb, *gs = mn ? h + M * 2 * nb : NULL;
    loom_quantize_act16(x, ldx, x_bf16, M, K, codes, xs, h, num_threads);
    if (paired) {
        xc = codes + M * K;
        q4_unit_codes16(codes, M, K, xstride, xc);
        for (int64_t m = 0; m < M; ++m) /* [xs_up x4 | xs_up+1 x4 | ...], missing blocks of a last unit: 0 x4 */
            for (int64_t p = 0; p < np; ++p)
                for (int i = 0; i < vw; ++i) {
                    const int64_t b = Q4_UNIT * p + i / 4;
                    xv[(m * np + p) * vw + i] = b < nb ? xs[m * nb + b] : 0.0f;
                }
    }
    if (mn) /* group sums of the dequantized x: its halves summed in order */
        for (int64_t m = 0; m < M; ++m)
            for (int64_t g = 0; g < tng; ++g) {
                const int64_t per = tG / 16;
                float t = h[m * 2 * nb + g * per];
                for (int64_t i = 1; i < per; ++i) t += h[m * 2 * nb + g * per + i];
                gs[m * tng + g] = t;
            }
    const rows_16_fn rows = kind == KIND_Q4 ? rows_16_q4 : (kind == KIND_Q8 ? rows_16_q8 : rows_16_q8_16);
    /* inlined tiles instead of the call through `rows`: the q4 by-row tile at M == 1, and the q8g by-x tile in
     * its full passes of MROWS x rows (the LM head at M > 1: its 576-wide rows are 72 block-rows of work per call,
     * and the call's set-up cost 14-20% of [49152, 576] at 4-16 rows; benchmarks/NOTES.md "the q8 LM head") */
    const int q4_inline = kind == KIND_Q4 && LOOM_QSIMD;
#define TILE16(NR_, MC_, N_, M0_)                                                                                \
    do {                                                                                                         \
        TILE_SCALES(NR_, N_);                                                                                    \
        if (q4_inline && (NR_) == NR && (MC_) == 1)                                                              \
            rows16_q4(NR, 1, w + (N_) * row_bytes, row_bytes, tsc, tmn, tng, xc, xstride, xs, xv, gs, K, dots);  \
        else if (kind == KIND_Q8 && (NR_) == 1 && (MC_) == MROWS)                                                \
            rows_16(KIND_Q8, 1, MROWS, w + (N_) * row_bytes, row_bytes, tsc, tmn, tng, tbpg,                     \
                    xc + (M0_) * xstride, xstride, xs + (M0_) * nb, NULL, mn ? gs + (M0_) * tng : NULL, K, dots); \
        else                                                                                                     \
            rows(NR_, MC_, w + (N_) * row_bytes, row_bytes, tsc, tmn, tng, tbpg, xc + (M0_) * xstride, xstride,  \
                 xs + (M0_) * nb, xv ? xv + (M0_) * np * vw : NULL, mn ? gs + (M0_) * tng : NULL, K, dots);       \
    } while (0)
    FOR_EACH_TILE(TILE16, kind == KIND_Q4 && LOOM_QSIMD ? MROWS_Q4_16 : MROWS, row_bytes + 2 * ng * (mn ? 2 : 1))
#undef TILE16
    free(scratch);
    return 0;
}

/* x [M, K] float32 (x_bf16 = 0) or bfloat16 (1), row stride ldx elements; the rest as loom_gemm_q4g_q8. */
int loom_gemm_q4g_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *qweight,
                    const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y, int64_t N,
                    int y_bf16, int num_threads) {
    return gemm_16(KIND_Q4, x, ldx, x_bf16, M, K, qweight, scales, mins, group, bias, y, N, y_bf16, num_threads);
}

/* The same product as loom_gemm_q4g_f with the weight in the q4gr16 layout (loom/quant/layout.py: 16 rows
 * interleaved word by word, N a multiple of 16), by the 16-row groups at every M: one summation order whatever
 * the batch, so a row's result does not depend on the rows beside it. Returns -2 when N % 16 != 0 (nothing
 * written), -1 when malloc failed. */
int loom_gemm_q4gr16_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *qweight,
                       const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y, int64_t N,
                       int y_bf16, int num_threads) {
    if (N % 16) return -2;
    const int64_t bpg = group / 32; /* blocks per group */
#if LOOM_Q512
    return gemm16_q4_groups(x, ldx, x_bf16, M, K, qweight, scales, mins, bpg, 1, bias, y, N, y_bf16, num_threads);
#else
    const int64_t ng = K / group;
    /* Other builds read the layout too (slowly: one lane at a time), with the groups' arithmetic step for step, so
     * that the result is the same bits: exact int32 dots per block, then per block fmaf(dot, d * s, acc) and
     * fmaf(min, the block's x sum, acc), in block order (fmaf: one rounding, as VFMADD). */
    const int64_t nb = K / 32, row_bytes = K / 2;
    int16_t *c16;
    float *xs, *h;
    char *s16 = act16(x, ldx, x_bf16, M, K, num_threads, &c16, &xs, &h);
    if (!s16) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t g = 0; g < N / 16; ++g) {
        const uint32_t *pk = (const uint32_t *)(qweight + 16 * g * row_bytes);
        const uint16_t *pd = scales + 16 * g * ng, *pm = mins ? mins + 16 * g * ng : NULL;
        for (int64_t m = 0; m < M; ++m) {
            float acc[16] = {0};
            for (int64_t b = 0; b < nb; ++b) {
                const int16_t *cx = c16 + m * K + 32 * b;
                const float sx = xs[m * nb + b], gx = h[2 * (m * nb + b)] + h[2 * (m * nb + b) + 1];
                const int64_t gb = b / bpg; /* the block's group */
                for (int r = 0; r < 16; ++r) {
                    int32_t dot = 0;
                    for (int j = 0; j < 4; ++j) {
                        const uint32_t word = pk[(b * 4 + j) * 16 + r];
                        for (int t = 0; t < 4; ++t) {
                            const int i = 4 * j + t, byte = (int)((word >> (8 * t)) & 0xFF);
                            dot += (byte & 15) * cx[i] + (byte >> 4) * cx[i + 16];
                        }
                    }
                    acc[r] = fmaf((float)dot, loom_f16_to_f32(pd[gb * 16 + r]) * sx, acc[r]);
                    if (pm) acc[r] = fmaf(loom_f16_to_f32(pm[gb * 16 + r]), gx, acc[r]);
                }
            }
            for (int r = 0; r < 16; ++r)
                loom_store_out(y, m * N + 16 * g + r, acc[r] + (bias ? bias[16 * g + r] : 0.0f), y_bf16);
        }
    }
    free(s16);
    return 0;
#endif
}

/* The q8g weight-only product (groups of 16 or 32) with the weight in the q8gr16 layout (loom/quant/layout.py: 16
 * rows interleaved word by word, N a multiple of 16), one summation order at every M (gemm16_q8_r16). Returns -2
 * for N % 16 != 0 or another group (nothing written), -1 when malloc failed. */
int loom_gemm_q8gr16_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const int8_t *qweight,
                       const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y,
                       int64_t N, int y_bf16, int num_threads) {
    if (N % 16 || (group != 16 && group != 32)) return -2;
    const int64_t nb = K / 32, g16 = group == 16, ng = g16 ? 2 * nb : nb;
    int16_t *c16;
    float *xs, *h;
    char *s16 = act16(x, ldx, x_bf16, M, K, num_threads, &c16, &xs, &h);
    if (!s16) return -1;
#if LOOM_Q512
    gemm16_q8_r16(c16, xs, h, M, K, qweight, scales, mins, (int)g16, bias, y, N, y_bf16, num_threads);
#else
    /* a lane at a time, the groups' arithmetic step for step (see loom_gemm_q4gr16_f) */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t g = 0; g < N / 16; ++g) {
        const int8_t *pk = qweight + 16 * g * K;
        const uint16_t *pd = scales + 16 * g * ng, *pm = mins ? mins + 16 * g * ng : NULL;
        for (int64_t m = 0; m < M; ++m) {
            float acc[16] = {0};
            for (int64_t b = 0; b < nb; ++b) {
                const int16_t *cx = c16 + m * K + 32 * b;
                const float sx = xs[m * nb + b], h0 = h[2 * (m * nb + b)], h1 = h[2 * (m * nb + b) + 1];
                const int64_t s0 = g16 ? 2 * b : b;
                for (int r = 0; r < 16; ++r) {
                    int32_t dot[2] = {0, 0};
                    for (int j = 0; j < 8; ++j)
                        for (int t = 0; t < 4; ++t) /* word j of lane r: bytes 4j .. 4j + 3 of the row's block */
                            dot[g16 && j >= 4] += (int32_t)pk[((b * 8 + j) * 16 + r) * 4 + t] * cx[4 * j + t];
                    acc[r] = fmaf((float)dot[0], loom_f16_to_f32(pd[s0 * 16 + r]) * sx, acc[r]);
                    if (g16) acc[r] = fmaf((float)dot[1], loom_f16_to_f32(pd[(s0 + 1) * 16 + r]) * sx, acc[r]);
                    if (pm && g16) {
                        acc[r] = fmaf(loom_f16_to_f32(pm[s0 * 16 + r]), h0, acc[r]);
                        acc[r] = fmaf(loom_f16_to_f32(pm[(s0 + 1) * 16 + r]), h1, acc[r]);
                    } else if (pm) {
                        acc[r] = fmaf(loom_f16_to_f32(pm[s0 * 16 + r]), h0 + h1, acc[r]);
                    }
                }
            }
            for (int r = 0; r < 16; ++r)
                loom_store_out(y, m * N + 16 * g + r, acc[r] + (bias ? bias[16 * g + r] : 0.0f), y_bf16);
        }
    }
#endif
    free(s16);
    return 0;
}

int loom_gemm_q8g_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const int8_t *qweight,
                    const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y, int64_t N,
                    int y_bf16, int num_threads) {
    return gemm_16(group == 16 ? KIND_Q8_16 : KIND_Q8, x, ldx, x_bf16, M, K, (const uint8_t *)qweight, scales, mins,
                   group, bias, y, N, y_bf16, num_threads);
}

/* ------------------------------------------------------------------------------------------------------ */
/* 4. dequantization                                                                                        */
/* ------------------------------------------------------------------------------------------------------ */

static void dequant(int q4, const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t G, int64_t N,
                    int64_t K, void *out, int out_bf16, int num_threads) {
    const int64_t ng = K / G, row_bytes = q4 ? K / 2 : K;
    /* a few rows (an embedding lookup) on the calling thread: a team for one row took 5.8 ms on a loaded 2-core
     * machine, waiting for a worker the OS had not scheduled */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K >= PAR_MIN_WORK)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *wr = w + n * row_bytes;
        float *of = out_bf16 ? NULL : (float *)out + n * K;
        uint16_t *oh = out_bf16 ? (uint16_t *)out + n * K : NULL;
#if LOOM_QSIMD
        const __m256i lo4 = _mm256_set1_epi32(0x0F);
        for (int64_t k = 0; k < K; k += 16) { /* 16 values: one group (of >= 16) */
            const int64_t g = k / G;
            const __m256 s = _mm256_set1_ps(loom_f16_to_f32(sc[n * ng + g]));
            const __m256 mv = _mm256_set1_ps(mn ? loom_f16_to_f32(mn[n * ng + g]) : 0.0f);
            __m256 q0, q1;
            if (q4) {
                /* values k..k+15 of block k/32: the low (k % 32 == 0) or high nibbles of its 16 bytes */
                const uint8_t *p = wr + (k / 32) * 16;
                const int shift = (k % 32) ? 4 : 0;
                const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
                const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
                q0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(c0, shift), lo4));
                q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(c1, shift), lo4));
            } else {
                q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k))));
                q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k + 8))));
            }
            /* s * q is exact, so the FMA's single rounding is layout.dequantize's rounding of (s * q) + min;
             * without mins a plain product, so that a -0.0 stays -0.0 as in the reference */
            const __m256 v0 = mn ? _mm256_fmadd_ps(q0, s, mv) : _mm256_mul_ps(q0, s);
            const __m256 v1 = mn ? _mm256_fmadd_ps(q1, s, mv) : _mm256_mul_ps(q1, s);
            if (out_bf16) {
                _mm_storeu_si128((__m128i *)(oh + k), f32x8_to_bf16(v0));
                _mm_storeu_si128((__m128i *)(oh + k + 8), f32x8_to_bf16(v1));
            } else {
                _mm256_storeu_ps(of + k, v0);
                _mm256_storeu_ps(of + k + 8, v1);
            }
        }
#else
        for (int64_t k = 0; k < K; ++k) {
            const int64_t g = k / G;
            int c;
            if (q4) {
                const uint8_t byte = wr[(k / 32) * 16 + (k % 16)];
                c = (k % 32) < 16 ? (byte & 0xF) : (byte >> 4);
            } else {
                c = (int8_t)wr[k];
            }
            float v = loom_f16_to_f32(sc[n * ng + g]) * (float)c; /* exact */
            if (mn) v = v + loom_f16_to_f32(mn[n * ng + g]);
            if (out_bf16)
                oh[k] = loom_f32_to_bf16(v);
            else
                of[k] = v;
        }
#endif
    }
}

/* W [N, K] of a q4g weight with groups of `group` (a multiple of 32), float32 (out_bf16 = 0) or bfloat16 (1). */
void loom_dequant_q4g(const uint8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t group, int64_t N,
                      int64_t K, void *out, int out_bf16, int num_threads) {
    dequant(1, qweight, scales, mins, group, N, K, out, out_bf16, num_threads);
}

/* W [N, K] of a q8g weight with groups of `group`. */
void loom_dequant_q8g(const int8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t group, int64_t N,
                      int64_t K, void *out, int out_bf16, int num_threads) {
    dequant(0, (const uint8_t *)qweight, scales, mins, group, N, K, out, out_bf16, num_threads);
}

/* Rows ids[0..n_ids) of a packed table [N, K] (an embedding lookup), [n_ids, K] float32 or bfloat16, bit for bit
 * loom_dequant_{q4g,q8g} of those rows: q4 picks 4-bit codes, `interleaved` the 16-row arrangement (q4gr16,
 * q8gr16: row r's 32-bit word w at ((r / 16) * words + w) * 16 + r % 16, its group j's scale and minimum at
 * ((r / 16) * ng + j) * 16 + r % 16; layout.py), whose row is gathered first. One call in place of the
 * gather's several tensor ops, which took ~90 us for one row inside a decode step (benchmarks/NOTES.md, "Issue 9
 * on the Zen 4: where a single-stream token goes now"). Returns 0, -1 for an id outside [0, N) (all are checked first: nothing is written),
 * -2 when the gather's scratch cannot be allocated. */
int loom_dequant_rows(int q4, int interleaved, const uint8_t *qweight, const uint16_t *scales, const uint16_t *mins,
                      int64_t group, int64_t N, int64_t K, const int64_t *ids, int64_t n_ids, void *out, int out_bf16,
                      int num_threads) {
    const int64_t ng = K / group, row_bytes = q4 ? K / 2 : K, words = row_bytes / 4, size = out_bf16 ? 2 : 4;
    for (int64_t i = 0; i < n_ids; ++i)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    if (!interleaved) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n_ids * K >= PAR_MIN_WORK)
        for (int64_t i = 0; i < n_ids; ++i)
            dequant(q4, qweight + ids[i] * row_bytes, scales + ids[i] * ng, mins ? mins + ids[i] * ng : NULL, group,
                    1, K, (char *)out + i * K * size, out_bf16, 1);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (n_ids * K >= PAR_MIN_WORK)
    {
        /* one row's codes (words), then its scales and minimums (ng float16 each) in row-major order */
        uint32_t *row = malloc((size_t)words * sizeof(uint32_t) + (size_t)(2 * ng) * sizeof(uint16_t));
        if (row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_ids; ++i) {
            if (row == NULL) continue;
            const int64_t g16 = ids[i] / 16, lane = ids[i] % 16;
            const uint32_t *wq = (const uint32_t *)qweight + g16 * words * 16 + lane;
            for (int64_t w = 0; w < words; ++w) row[w] = wq[w * 16];
            uint16_t *sc = (uint16_t *)(row + words), *mn = sc + ng;
            for (int64_t j = 0; j < ng; ++j) {
                sc[j] = scales[(g16 * ng + j) * 16 + lane];
                if (mins) mn[j] = mins[(g16 * ng + j) * 16 + lane];
            }
            dequant(q4, (const uint8_t *)row, sc, mins ? mn : NULL, group, 1, K, (char *)out + i * K * size,
                    out_bf16, 1);
        }
        free(row);
    }
    return failed ? -2 : 0;
}
