/*
 * Decode attention over a paged bfloat16 KV cache, read in place (loom/kernels/cpu.py).
 *
 * For each request b (one query token) and KV head h: the G = H / H_kv query heads of the group
 * (grouped-query attention, arXiv:2305.13245) attend to keys t in [start, seq_lens[b]), where
 * start = max(0, seq_lens[b] - window) (window 0 = all). Key t of request b lives in block
 * block_table[b, t / block_size], row t % block_size. Exact softmax in three passes over the request's
 * own blocks: scores q.k * scale (float32 sums of bf16 products), then exp(s - max) (exp_ps, bf16_common.h) and their sum, then
 * the p-weighted sum of V rows, divided by the sum and rounded to bfloat16 (nearest even).
 *
 * Layouts (row-major, contiguous): q, out [B, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D];
 * block_table [B, bt_stride] int64; seq_lens [B] int64. D % 32 == 0, D <= 256, G <= 16 (checked by the
 * caller). The (b, h) pairs are split over num_threads OpenMP threads (torch's libgomp).
 */
#include <math.h>
#include <stdlib.h>

#include "bf16_common.h"

#define TARGET LOOM_TARGET
#define MAX_D 256
#define MAX_G 16

TARGET static inline __m512 bf16x16_to_f32(const uint16_t *src) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET static void attend_one(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *blocks, int64_t start, int64_t end, int64_t block_size,
                              int64_t H_kv, int64_t kv_head, int64_t D, int64_t G, float scale, float *scores,
                              uint16_t *out) {
    const int64_t n = end - start;
    const int64_t chunks = D / 32; /* bf16 pairs per dot: 32 values per 512-bit register */
    const int64_t row_stride = H_kv * D;
    __m512bh qv[MAX_G][MAX_D / 32];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < chunks; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(q + g * D + c * 32));

    /* pass 1: scores[g * n + i] = scale * q_g . k_(start + i) */
    float maxs[MAX_G];
    for (int64_t g = 0; g < G; ++g) maxs[g] = -INFINITY;
    for (int64_t t = start; t < end; ++t) {
        const uint16_t *k = k_cache + (blocks[t / block_size] * block_size + t % block_size) * row_stride + kv_head * D;
        __m512bh kv[MAX_D / 32];
        for (int64_t c = 0; c < chunks; ++c) kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(k + c * 32));
        for (int64_t g = 0; g < G; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
            const float s = _mm512_reduce_add_ps(acc) * scale;
            scores[g * n + (t - start)] = s;
            if (s > maxs[g]) maxs[g] = s;
        }
    }
    /* pass 2: p = exp(s - max) in place, and the sum of p */
    float sums[MAX_G];
    for (int64_t g = 0; g < G; ++g) {
        float *s = scores + g * n;
        const __m512 m = _mm512_set1_ps(maxs[g]);
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 mask = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            const __m512 p = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), m));
            _mm512_mask_storeu_ps(s + i, mask, p);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, p));
        }
        sums[g] = _mm512_reduce_add_ps(total);
    }
    /* pass 3: out_g = sum_i p_g,i v_(start + i) / sum_g */
    __m512 acc[MAX_G][MAX_D / 16];
    const int64_t lanes = D / 16;
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < lanes; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = start; t < end; ++t) {
        const uint16_t *v = v_cache + (blocks[t / block_size] * block_size + t % block_size) * row_stride + kv_head * D;
        __m512 vv[MAX_D / 16];
        for (int64_t c = 0; c < lanes; ++c) vv[c] = bf16x16_to_f32(v + c * 16);
        for (int64_t g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * n + (t - start)]);
            for (int64_t c = 0; c < lanes; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float row[MAX_D];
        const __m512 inv = _mm512_set1_ps(1.0f / sums[g]);
        for (int64_t c = 0; c < lanes; ++c) _mm512_storeu_ps(row + c * 16, _mm512_mul_ps(acc[g][c], inv));
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = f32_to_bf16(row[d]);
    }
}

TARGET void loom_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int64_t *block_table, int64_t bt_stride, const int64_t *seq_lens,
                                   uint16_t *out, int64_t B, int64_t H, int64_t H_kv, int64_t D,
                                   int64_t block_size, float scale, int64_t window, int num_threads) {
    const int64_t G = H / H_kv;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * H_kv; ++task) {
            const int64_t b = task / H_kv, h = task % H_kv;
            const int64_t end = seq_lens[b];
            const int64_t start = (window > 0 && end > window) ? end - window : 0;
            attend_one(q + (b * H + h * G) * D, k_cache, v_cache, block_table + b * bt_stride, start, end,
                       block_size, H_kv, h, D, G, scale, scores, out + (b * H + h * G) * D);
        }
        free(scores);
    }
}
