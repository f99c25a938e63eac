/*
 * bfloat16 matrix-vector products for decode steps of one to a few sequences (loom/kernels/cpu.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for m < M (M small: 1 to 8), n < N, with x [M, K], w [N, K]
 * and b [N] bfloat16, row-major; y bfloat16 (round to nearest even) or float32. Products and sums are
 * float32 (AVX512-BF16 VDPBF16PS, two products per lane per instruction, 16 lanes).
 *
 * Why: at M = 1 a decode step is memory-bound on the weights (benchmarks/NOTES.md, "Third pass"). The
 * weight is read once, row after row in memory order, straight from the checkpoint's row-major layout, so
 * the hardware prefetcher streams it (measured 22 GB/s over SmolLM2's 121 matrices on 2 Zen 4 threads,
 * against 16 GB/s for interleaving four rows and ~15 GB/s for oneDNN); the x rows stay in L1. Each row's
 * dot product runs on two accumulators (even and odd 32-value chunks) to hide the VDPBF16PS latency.
 * Contiguous ranges of rows are split over `num_threads` OpenMP threads (torch's libgomp, which the
 * process has loaded first).
 */
#include "bf16_common.h"

#define MROWS 4 /* x rows per pass over a weight row */

/* y[m0 + m, n] for m < mc: the dot products of one weight row with up to MROWS rows of x. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline void
row_dots(const uint16_t *x, const uint16_t *wr, int64_t K, int64_t mc, float *dots) {
    __m512 even[MROWS], odd[MROWS];
    for (int m = 0; m < MROWS; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wr + k));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wr + k + 32));
        for (int64_t m = 0; m < mc; ++m) {
            even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k)), w0);
            odd[m] = _mm512_dpbf16_ps(odd[m], (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k + 32)), w1);
        }
    }
    for (; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
        for (int64_t m = 0; m < mc; ++m)
            even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), w0);
    }
    for (int64_t m = 0; m < mc; ++m) dots[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void loom_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, void *y, int64_t M, int64_t N,
                    int64_t K, int y_is_f32, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; ++n) {
        const float bias = b ? bf16_to_f32(b[n]) : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += MROWS) {
            const int64_t mc = M - m0 < MROWS ? M - m0 : MROWS;
            float dots[MROWS];
            row_dots(x + m0 * K, w + n * K, K, mc, dots);
            for (int64_t m = 0; m < mc; ++m) {
                const float s = dots[m] + bias;
                const int64_t at = (m0 + m) * N + n;
                if (y_is_f32)
                    ((float *)y)[at] = s;
                else
                    ((uint16_t *)y)[at] = f32_to_bf16(s);
            }
        }
    }
}
