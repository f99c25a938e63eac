/*
 * Matrix-vector products with float32 weights and activations, for a few rows of x (decode), on any CPU
 * (loom/kernels/cpu_generic.py): the dense layers a quantized checkpoint leaves unquantized (a GPTQ, AWQ or
 * compressed-tensors file's lm_head, by their defaults), which loom holds in float32 on the CPU.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for m < M, n < N; x [M, K] float32 with row stride ldx, w [N, K]
 * float32 row-major, b [N] float32 or NULL, y [M, N] float32 contiguous.
 *
 * Why: at one row the product is memory-bound on the weight, and torch 2.13's float32 F.linear (MKL's GEMV)
 * read SmolLM2-135M's 49152 x 576 LM head (113 MB) at ~10.5 GB/s on a 2-core AMD EPYC (Zen 4), the same with
 * one thread or two, while the machine reads ~32 GB/s (benchmarks/NOTES.md, "Where a step's time went that no
 * kernel owned"). Here contiguous ranges of weight rows are split over num_threads OpenMP threads, each row read
 * once in memory order with the rows PREFETCH_ROWS ahead prefetched, and up to two rows of x share each pass
 * over a weight row (a 576-float row stays in L1 for the passes of further rows).
 *
 * Summation order, the same for every (m, n) whatever M, the thread count or the rows sharing a pass (so a
 * row's result is the same bits alone or in a batch): 32 partial sums, sum l holding the products k = l mod 32
 * for k < K32 = K rounded down to a multiple of 32, in k order; combined as ((s[i] + s[i+8]) + (s[i+16] +
 * s[i+24])) for i < 8, then those eight as ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)); then the tail
 * k >= K32 in k order; then the bias. The `avx2` build (-mavx2 -mfma) forms each partial product with a fused
 * multiply-add; the `generic` build (portable C) rounds the product and the sum apart, so the two builds may
 * differ in the last bits, each deterministic.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MROWS 2 /* x rows per pass over a weight row */
#define PREFETCH_ROWS 4 /* weight rows prefetched ahead (as gemv_w16.c: the hardware prefetcher alone is slower) */

/* the fixed reduction of the 8 values t (see the header) */
static inline float reduce8(const float *t) {
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

#if defined(__AVX2__)
/* dots[m] for R rows of x over the first k32 values of weight row w: four 8-lane accumulators per row */
#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *x, int64_t ldx, int64_t k32, const float *w, float *dots) { \
        __m256 a0[R], a1[R], a2[R], a3[R];                                                                \
        for (int m = 0; m < R; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm256_setzero_ps();                 \
        for (int64_t k = 0; k < k32; k += 32) {                                                           \
            const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);                   \
            const __m256 w2 = _mm256_loadu_ps(w + k + 16), w3 = _mm256_loadu_ps(w + k + 24);              \
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
#else
#define LOOM_ROW_DOTS(R)                                                                                  \
    static inline void row_dots##R(const float *x, int64_t ldx, int64_t k32, const float *w, float *dots) { \
        float s[R][32];                                                                                   \
        memset(s, 0, sizeof s);                                                                           \
        for (int64_t k = 0; k < k32; k += 32)                                                             \
            for (int m = 0; m < R; ++m)                                                                   \
                for (int l = 0; l < 32; ++l) s[m][l] += x[m * ldx + k + l] * w[k + l];                    \
        for (int m = 0; m < R; ++m) {                                                                     \
            float t[8];                                                                                   \
            for (int i = 0; i < 8; ++i) t[i] = (s[m][i] + s[m][i + 8]) + (s[m][i + 16] + s[m][i + 24]);   \
            dots[m] = reduce8(t);                                                                         \
        }                                                                                                 \
    }
#endif
LOOM_ROW_DOTS(1)
LOOM_ROW_DOTS(2)
#undef LOOM_ROW_DOTS

/* Returns 0 (nothing to allocate; the int return matches the other kernels' bindings). */
int loom_gemv_f32(const float *x, int64_t ldx, const float *w, const float *b, float *y, int64_t M, int64_t N,
                  int64_t K, int num_threads) {
    const int64_t k32 = K & ~(int64_t)31;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; ++n) {
        const float *wr = w + n * K;
        if (n + PREFETCH_ROWS < N) {
            const char *ahead = (const char *)(w + (n + PREFETCH_ROWS) * K);
            for (int64_t o = 0; o < K * 4; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        for (int64_t m0 = 0; m0 < M; m0 += MROWS) {
            const int64_t mc = M - m0 < MROWS ? M - m0 : MROWS;
            float dots[MROWS];
            if (mc == 1)
                row_dots1(x + m0 * ldx, ldx, k32, wr, dots);
            else
                row_dots2(x + m0 * ldx, ldx, k32, wr, dots);
            for (int64_t m = 0; m < mc; ++m) {
                float s = dots[m];
                const float *xm = x + (m0 + m) * ldx;
                for (int64_t k = k32; k < K; ++k) s += xm[k] * wr[k];
                y[(m0 + m) * N + n] = b ? s + b[n] : s;
            }
        }
    }
    return 0;
}
