/*
 * Matrix-vector products with FP8 (e4m3) weights and a float32 scale per output channel, float32 activations,
 * for a few rows of x (decode), on any CPU (loom/kernels/cpu_generic.py): `--quantization fp8` and
 * compressed-tensors FP8 checkpoints keep their 1-byte weights on the CPU instead of widening them at load to
 * the activation dtype (2 or 4 bytes a weight), so a decode step streams a quarter of float32's bytes.
 *
 * y[m, n] = (sum_k x[m, k] * e4m3(w[n, k])) * scale[n] (+ b[n]) for m < M, n < N; x [M, K] float32 with row
 * stride ldx, w [N, K] bytes in the OCP FP8 E4M3 encoding (float8_e4m3fn: sign, 4 exponent bits of bias 7, 3
 * mantissa bits, no infinities, 0x7F / 0xFF NaN), scale [N] float32, b [N] float32 or NULL, y [M, N] float32
 * contiguous. NaN bytes are not decoded as NaN: callers refuse them at load (Fp8LinearMethod).
 *
 * Decoding an e4m3 byte exactly, without a table: every e4m3 value times 2^-8 is a float16 whose bits are the
 * byte's sign at bit 15 and its seven exponent and mantissa bits at bits 13..7 (float16 has a 5-bit exponent of
 * bias 15, so 2^(e - 7) * 2^-8 = 2^(e - 15); e4m3's subnormals, 2^-6 * 0.mmm, land on float16's subnormals). Bytes
 * sign-extended to 16 bits, shifted left by 7 and masked with 0xBFFF are those bits, and VCVTPH2PS (F16C) widens
 * them to float32 exactly; the 2^8 goes into the row's scale (scale * 256, exact). Per 16 weights: one widening
 * load, a shift, a mask, two conversions and two FMAs. The `generic` build reads the same values from a 256-entry
 * table made per call.
 *
 * Summation order, the same for every (m, n) whatever M, the thread count or the rows sharing a pass (so a row's
 * result is the same bits alone or in a batch), and the same as gemv_f32.c's: 32 partial sums, sum l holding the
 * products k = l mod 32 for k < K32 = K rounded down to a multiple of 32, in k order; combined as ((s[i] +
 * s[i+8]) + (s[i+16] + s[i+24])) for i < 8, then those eight as ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 +
 * t7)); then the tail k >= K32 in k order; then times scale * 256; then the bias. The `avx2` build (-mavx2 -mfma
 * -mf16c) forms each partial product with a fused multiply-add; the `generic` build (portable C) rounds the
 * product and the sum apart, so the two builds may differ in the last bits, each deterministic.
 *
 * Contiguous blocks of NBLOCK weight rows are split over num_threads OpenMP threads; each row is read from memory
 * once, in order, with the rows PREFETCH_ROWS ahead prefetched, and up to MROWS rows of x share each pass over a
 * weight row (its decoding is paid once for them); every tile of MROWS x rows passes over a block before the next.
 */
#include <stdint.h>
#include <string.h>

#include "quant_common.h" /* loom_f16_to_f32 */

#if defined(__AVX2__)
#include <immintrin.h>
#define TABLE_ARG
#define fp8_value(table, b) loom_f16_to_f32(fp8_as_f16_bits(b)) /* the tails: a few values a row */
#else
#define TABLE_ARG , table /* the generic build's row_dots read the per-call table */
#define fp8_value(table, b) (table)[b]
#endif

/* x rows per pass over a weight row: the four 8-lane accumulators of each row (the fixed summation order) and the
 * four decoded weight vectors fill AVX2's 16 registers at 2 rows (at 4 rows they spilled: 2.7x the time of one);
 * AVX-512's 32 registers hold 8 rows' two 16-lane accumulators */
#if defined(__AVX512BW__)
#define MROWS 8
#else
#define MROWS 2
#endif
#define PREFETCH_ROWS 8 /* weight rows prefetched ahead (a row is a quarter of gemv_f32's bytes) */
/* weight rows a tile of x passes over before the next tile: their bytes (16 K) stay in L1 / L2 for every tile,
 * and each tile (MROWS rows of K floats) for the block, instead of every x row streaming past every weight row
 * (at 32 rows of K = 576, 74 KB of x per weight row: one core's rate fell from 31 to 22 GFMA/s) */
#define NBLOCK 16

/* the float16 bits of e4m3 byte b times 2^-8 (see the header) */
static inline uint16_t fp8_as_f16_bits(uint8_t b) {
    return (uint16_t)((uint16_t)((int16_t)(int8_t)b * 128) & 0xBFFF);
}

/* the fixed reduction of the 8 values t (see the header) */
static inline float reduce8(const float *t) {
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

#if defined(__AVX2__)
/* 16 e4m3 bytes at p -> 16 float32 (times 2^-8): values 0..7 in *lo, 8..15 in *hi */
static inline void fp8x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

#if defined(__AVX512BW__)
/* 32 e4m3 bytes at p -> 32 float32 (times 2^-8): values 0..15 in *lo, 16..31 in *hi */
static inline void fp8x32(const uint8_t *p, __m512 *lo, __m512 *hi) {
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xBFFF));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* The avx512_vnni build: two 16-lane accumulators per row hold the same 32 partial sums as the four 8-lane ones
 * below (lo: l = 0..15, hi: l = 16..31), combined in the same order, so both builds give the same bits. */
#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *x, int64_t ldx, int64_t k32, const uint8_t *w, float *dots) { \
        __m512 lo[R], hi[R];                                                                              \
        for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm512_setzero_ps();                                 \
        for (int64_t k = 0; k < k32; k += 32) {                                                           \
            __m512 w0, w1;                                                                                \
            fp8x32(w + k, &w0, &w1);                                                                      \
            for (int m = 0; m < R; ++m) {                                                                 \
                const float *xm = x + m * ldx + k;                                                        \
                lo[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm), w0, lo[m]);                                  \
                hi[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), w1, hi[m]);                             \
            }                                                                                             \
        }                                                                                                 \
        for (int m = 0; m < R; ++m) {                                                                     \
            const __m256 a0 = _mm512_castps512_ps256(lo[m]);                                              \
            const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lo[m]), 1));       \
            const __m256 a2 = _mm512_castps512_ps256(hi[m]);                                              \
            const __m256 a3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hi[m]), 1));       \
            float t[8];                                                                                   \
            _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));             \
            dots[m] = reduce8(t);                                                                         \
        }                                                                                                 \
    }
#else
/* dots[m] for R rows of x over the first k32 values of weight row w: four 8-lane accumulators per row */
#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *x, int64_t ldx, int64_t k32, const uint8_t *w, float *dots) { \
        __m256 a0[R], a1[R], a2[R], a3[R];                                                                \
        for (int m = 0; m < R; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm256_setzero_ps();                 \
        for (int64_t k = 0; k < k32; k += 32) {                                                           \
            __m256 w0, w1, w2, w3;                                                                        \
            fp8x16(w + k, &w0, &w1);                                                                      \
            fp8x16(w + k + 16, &w2, &w3);                                                                 \
            for (int m = 0; m < R; ++m) {                                                                 \
                const float *xm = x + m * ldx + k;                                                        \
                a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), w0, a0[m]);                                  \
                a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w1, a1[m]);                              \
                a2[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w2, a2[m]);                             \
                a3[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w3, a3[m]);                             \
            }                                                                                             \
        }                                                                                                 \
        for (int m = 0; m < R; ++m) {                                                                     \
            float t[8];                                                                                   \
            _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(a0[m], a1[m]), _mm256_add_ps(a2[m], a3[m]))); \
            dots[m] = reduce8(t);                                                                         \
        }                                                                                                 \
    }
#endif /* __AVX512BW__ */
#else
/* every byte's value times 2^-8 (NaN bytes: whatever their float16 bits say), set once per call */
static void fp8_table(float *t) {
    for (int b = 0; b < 256; ++b) t[b] = loom_f16_to_f32(fp8_as_f16_bits((uint8_t)b));
}

#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *x, int64_t ldx, int64_t k32, const uint8_t *w, float *dots, \
                                   const float *table) {                                                  \
        float s[R][32];                                                                                   \
        memset(s, 0, sizeof s);                                                                           \
        for (int64_t k = 0; k < k32; k += 32) {                                                           \
            float wf[32];                                                                                 \
            for (int l = 0; l < 32; ++l) wf[l] = table[w[k + l]];                                         \
            for (int m = 0; m < R; ++m)                                                                   \
                for (int l = 0; l < 32; ++l) s[m][l] += x[m * ldx + k + l] * wf[l];                       \
        }                                                                                                 \
        for (int m = 0; m < R; ++m) {                                                                     \
            float t[8];                                                                                   \
            for (int i = 0; i < 8; ++i) t[i] = (s[m][i] + s[m][i + 8]) + (s[m][i + 16] + s[m][i + 24]);   \
            dots[m] = reduce8(t);                                                                         \
        }                                                                                                 \
    }
#endif
LOOM_ROW_DOTS(1)
LOOM_ROW_DOTS(2)
#if MROWS == 8
LOOM_ROW_DOTS(3)
LOOM_ROW_DOTS(4)
LOOM_ROW_DOTS(5)
LOOM_ROW_DOTS(6)
LOOM_ROW_DOTS(7)
LOOM_ROW_DOTS(8)
#endif
#undef LOOM_ROW_DOTS

/* Returns 0 (nothing to allocate; the int return matches the other kernels' bindings). */
int loom_gemv_fp8(const float *x, int64_t ldx, const uint8_t *w, const float *scale, const float *b, float *y,
                  int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t k32 = K & ~(int64_t)31;
    if (num_threads < 1) num_threads = 1;
#if !defined(__AVX2__)
    float table[256];
    fp8_table(table);
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n0 = 0; n0 < N; n0 += NBLOCK) {
        const int64_t n1 = n0 + NBLOCK < N ? n0 + NBLOCK : N;
        for (int64_t m0 = 0; m0 < M; m0 += MROWS) {
            const int64_t mc = M - m0 < MROWS ? M - m0 : MROWS;
            const float *xb = x + m0 * ldx;
            for (int64_t n = n0; n < n1; ++n) {
                const uint8_t *wr = w + n * K;
                if (m0 == 0 && n + PREFETCH_ROWS < N) { /* the first pass streams the rows from memory */
                    const char *ahead = (const char *)(w + (n + PREFETCH_ROWS) * K);
                    for (int64_t o = 0; o < K; o += 64) __builtin_prefetch(ahead + o, 0, 3);
                }
                float dots[MROWS];
                switch (mc) {
                case 1: row_dots1(xb, ldx, k32, wr, dots TABLE_ARG); break;
#if MROWS == 8
                case 3: row_dots3(xb, ldx, k32, wr, dots TABLE_ARG); break;
                case 4: row_dots4(xb, ldx, k32, wr, dots TABLE_ARG); break;
                case 5: row_dots5(xb, ldx, k32, wr, dots TABLE_ARG); break;
                case 6: row_dots6(xb, ldx, k32, wr, dots TABLE_ARG); break;
                case 7: row_dots7(xb, ldx, k32, wr, dots TABLE_ARG); break;
                case 8: row_dots8(xb, ldx, k32, wr, dots TABLE_ARG); break;
#endif
                default: row_dots2(xb, ldx, k32, wr, dots TABLE_ARG); break;
                }
                const float s256 = scale[n] * 256.0f;
                for (int64_t m = 0; m < mc; ++m) {
                    float s = dots[m];
                    const float *xm = xb + m * ldx;
                    for (int64_t k = k32; k < K; ++k) s += xm[k] * fp8_value(table, wr[k]);
                    s *= s256;
                    y[(m0 + m) * N + n] = b ? s + b[n] : s;
                }
            }
        }
    }
    return 0;
}

/* out [N, K] float32 = e4m3(w[n, k]) * scale[n], each product rounded once (the weight a GEMM over many rows of x
 * multiplies: torch's `w.to(float32) * scale`, bit for bit). Returns 0. */
int loom_dequant_fp8(const uint8_t *w, const float *scale, float *out, int64_t N, int64_t K, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#if !defined(__AVX2__)
    float table[256];
    fp8_table(table);
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *wr = w + n * K;
        float *o = out + n * K;
        const float s = scale[n];
        int64_t k = 0;
#if defined(__AVX2__)
        /* (v * 2^-8) * 256 is v exactly, then one rounding of the product by s: the same as v * s */
        const __m256 sv = _mm256_set1_ps(s), c256 = _mm256_set1_ps(256.0f);
        for (; k + 16 <= K; k += 16) {
            __m256 lo, hi;
            fp8x16(wr + k, &lo, &hi);
            _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(lo, c256), sv));
            _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(_mm256_mul_ps(hi, c256), sv));
        }
#endif
        for (; k < K; ++k) o[k] = (fp8_value(table, wr[k]) * 256.0f) * s;
    }
    return 0;
}
