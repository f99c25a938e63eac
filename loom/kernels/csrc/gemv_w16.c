/*
 * Matrix-vector products with bfloat16 weights and float32 activations, for any CPU
 * (loom/kernels/cpu_generic.py): a bf16 checkpoint on a CPU without AVX512-BF16 keeps its 2-byte weights
 * instead of widening them to 4-byte float32, halving the bytes a decode step streams.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for m < M, n < N; x [M, K] float32 with row stride ldx,
 * w [N, K] bfloat16 row-major, b [N] float32 or NULL, y [M, N] float32 contiguous. Products and sums float32.
 *
 * Why this layout of the work: at M = 1 (one decode row) the product is memory-bound on the weight, so
 * the weight is read once, row after row in memory order (the hardware prefetcher streams it), as
 * gemv_bf16.c does; up to 4 rows of x share each pass over a weight row. A bf16 value is the top half of
 * a float32, so 16 weights loaded as eight 32-bit lanes widen with one shift (the even-indexed weights,
 * the low halves) and one mask (the odd ones, the high halves); x is permuted once per call into the
 * matching even/odd order (16 values at a time), so each 16 weights cost one load, two integer ops and two
 * FMAs, with no shuffle. Contiguous ranges of weight rows are split over num_threads OpenMP threads, and each
 * thread prefetches the rows it will read a few rows ahead (PREFETCH_ROWS).
 *
 * The `avx2` build (-mavx2 -mfma) runs that; the `generic` build (no ISA flag, portable C, any CPU) runs the
 * same sums with eight interleaved partial sums that compilers vectorize without reassociating.
 */
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_common.h" /* loom_bf16_to_f32, loom_f32_to_bf16 */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MROWS 4 /* x rows per pass over a weight row */
/* Each weight row's cache lines are prefetched (into L1, PREFETCHT0) this many rows before the row is read. The
 * hardware prefetcher alone streamed the 120 bf16 layer matrices of SmolLM2-135M at 10-11 GB/s on two Ice
 * Lake-class threads; 4 rows ahead (2-16: the same) 13-14 GB/s, the 49152 x 576 LM head 13-15 -> 17-19 GB/s
 * (benchmarks/NOTES.md, "Issue 9: where the named levers did not pay"). PREFETCHNTA halved the speed. */
#define PREFETCH_ROWS 4


#if defined(__AVX2__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 16 bf16 weights -> the even-indexed 8 (low halves of the 32-bit lanes) and the odd-indexed 8, as floats */
#define LOOM_WIDEN(wv, even, odd)                                                                         \
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));                                  \
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(wv, _mm256_set1_epi32((int)0xffff0000u)))

/*
 * dots[m] = sum_k xe[m][k] * w[k] over the first k16 (a multiple of 16) values, for R rows of the permuted x
 * (row stride `stride`). R is a compile-time constant so the 2R (or 4R at R <= 2) accumulators stay in registers.
 */
#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *xe, int64_t stride, int64_t k16, const uint16_t *w,       \
                                   float *dots) {                                                         \
        __m256 e0[R], o0[R], e1[R], o1[R];                                                                \
        for (int m = 0; m < R; ++m) e0[m] = o0[m] = e1[m] = o1[m] = _mm256_setzero_ps();                 \
        int64_t k = 0;                                                                                    \
        if (R <= 2)                                                                                       \
            for (; k + 32 <= k16; k += 32) {                                                              \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k));                          \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + k + 16));                     \
                LOOM_WIDEN(w0, we0, wo0);                                                                 \
                LOOM_WIDEN(w1, we1, wo1);                                                                 \
                for (int m = 0; m < R; ++m) {                                                             \
                    const float *xm = xe + m * stride + k;                                                   \
                    e0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), we0, e0[m]);                             \
                    o0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), wo0, o0[m]);                         \
                    e1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), we1, e1[m]);                        \
                    o1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), wo1, o1[m]);                        \
                }                                                                                         \
            }                                                                                             \
        for (; k < k16; k += 16) {                                                                        \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k));                              \
            LOOM_WIDEN(w0, we0, wo0);                                                                     \
            for (int m = 0; m < R; ++m) {                                                                 \
                const float *xm = xe + m * stride + k;                                                       \
                e0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), we0, e0[m]);                                 \
                o0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), wo0, o0[m]);                             \
            }                                                                                             \
        }                                                                                                 \
        for (int m = 0; m < R; ++m)                                                                       \
            dots[m] = hsum8(_mm256_add_ps(_mm256_add_ps(e0[m], o0[m]), _mm256_add_ps(e1[m], o1[m])));     \
    }
LOOM_ROW_DOTS(1)
LOOM_ROW_DOTS(2)
LOOM_ROW_DOTS(3)
LOOM_ROW_DOTS(4)
#undef LOOM_ROW_DOTS
#undef LOOM_WIDEN

#else
/* dots[m] = sum_k x_m[k] * w[k] over the first k8 (a multiple of 8) values for R rows of x (stride ldx):
 * eight interleaved partial sums per row, R compile-time so compilers keep them in vector registers */
#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *x, int64_t ldx, int64_t k8, const uint16_t *w, float *dots) { \
        float part[R][8];                                                                                 \
        memset(part, 0, sizeof part);                                                                     \
        for (int64_t k = 0; k < k8; k += 8) {                                                             \
            float wf[8];                                                                                  \
            for (int l = 0; l < 8; ++l) wf[l] = loom_bf16_to_f32(w[k + l]);                                    \
            for (int m = 0; m < R; ++m)                                                                   \
                for (int l = 0; l < 8; ++l) part[m][l] += x[m * ldx + k + l] * wf[l];                     \
        }                                                                                                 \
        for (int m = 0; m < R; ++m) {                                                                     \
            const float *p = part[m];                                                                     \
            dots[m] = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));                  \
        }                                                                                                 \
    }
LOOM_ROW_DOTS(1)
LOOM_ROW_DOTS(2)
LOOM_ROW_DOTS(3)
LOOM_ROW_DOTS(4)
#undef LOOM_ROW_DOTS

#endif

/* y = x w^T + b: row_dots over the first kv values of xv (x as row_dots reads it, rows `xv_stride` apart), the
 * tail k >= kv from x itself; contiguous ranges of weight rows per OpenMP thread. */
static void gemv_rows(const float *xv, int64_t xv_stride, int64_t kv, const float *x, int64_t ldx, const uint16_t *w,
                      const float *b, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t *wr = w + n * K;
        if (n + PREFETCH_ROWS < N) {
            const char *ahead = (const char *)(w + (n + PREFETCH_ROWS) * K);
            for (int64_t o = 0; o < K * 2; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        const float bias = b ? b[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += MROWS) {
            const int64_t mc = M - m0 < MROWS ? M - m0 : MROWS;
            float dots[MROWS];
            const float *xb = xv + m0 * xv_stride;
            switch (mc) {
            case 1: row_dots1(xb, xv_stride, kv, wr, dots); break;
            case 2: row_dots2(xb, xv_stride, kv, wr, dots); break;
            case 3: row_dots3(xb, xv_stride, kv, wr, dots); break;
            default: row_dots4(xb, xv_stride, kv, wr, dots); break;
            }
            for (int64_t m = 0; m < mc; ++m) {
                float s = dots[m];
                const float *xm = x + (m0 + m) * ldx;
                for (int64_t k = kv; k < K; ++k) s += xm[k] * loom_bf16_to_f32(wr[k]);
                y[(m0 + m) * N + n] = s + bias;
            }
        }
    }
}

/* Returns 0, or -1 when the permuted copy of x could not be allocated (y not written). */
#if defined(__AVX2__)
int loom_gemv_w16(const float *x, int64_t ldx, const uint16_t *w, const float *b, float *y, int64_t M, int64_t N,
                  int64_t K, int num_threads) {
    const int64_t k16 = K & ~(int64_t)15;
    /* x permuted per 16 values: [x0 x2 .. x14 | x1 x3 .. x15], matching LOOM_WIDEN's even/odd halves */
    /* 64-byte aligned (rows of k16 floats stay aligned): no load of x splits a cache line */
    void *mem = NULL;
    if (posix_memalign(&mem, 64, sizeof(float) * (size_t)(M * k16 + 16))) return -1;
    float *xe = (float *)mem;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < k16; k += 16)
            for (int i = 0; i < 8; ++i) {
                xe[m * k16 + k + i] = x[m * ldx + k + 2 * i];
                xe[m * k16 + k + 8 + i] = x[m * ldx + k + 2 * i + 1];
            }
    gemv_rows(xe, k16, k16, x, ldx, w, b, y, M, N, K, num_threads);
    free(xe);
    return 0;
}
#else
int loom_gemv_w16(const float *x, int64_t ldx, const uint16_t *w, const float *b, float *y, int64_t M, int64_t N,
                  int64_t K, int num_threads) {
    gemv_rows(x, ldx, K & ~(int64_t)7, x, ldx, w, b, y, M, N, K, num_threads);
    return 0;
}
#endif
