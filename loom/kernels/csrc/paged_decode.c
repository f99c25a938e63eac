/*
 * Decode attention over a paged KV cache, read in place, for any CPU (loom/kernels/cpu_generic.py). Query and
 * output are float32 (is_bf16 = 0) or bfloat16 (is_bf16 = 1: the output rounded to nearest even); the cache
 * elements are float32 (kv_type 0), bfloat16 (1) or IEEE float16 (2: llama.cpp's default KV type, half the
 * bytes of float32 with 11 significant bits). 16-bit rows are widened to float32 in registers (bf16: a shift;
 * f16: F16C's VCVTPH2PS, exact). kv_type 3 is loom's int8 KV row (loom/attention/kv_quant.py): per (token, KV
 * head) D int8 codes u - 128, then ceil(D / 32) float16 scales, then as many float16 minimums, one pair per
 * group of 32 values, x = (u * scale) + lo; each tile's rows are dequantized once into float32 scratch (in
 * torch's order of operations, so they equal loom.attention.kv_quant.dequantize_rows bit for bit).
 *
 * For each request b (one query token) and KV head h: the G = H / H_kv query heads of the group
 * (grouped-query attention, arXiv:2305.13245) attend to keys t in [start, seq_lens[b]), where
 * start = max(0, seq_lens[b] - window) (window 0 = all). Key t of request b lives in block
 * block_table[b, t / block_size], row t % block_size. One pass over the request's own blocks, no gather, no
 * padding, no mask: online softmax (running max m, running sum l, the output accumulator rescaled by
 * e^(m_old - m_new) when the max grows; Milakov & Gimelshein 2018, arXiv:1805.02867). All arithmetic
 * float32, FMA where the AVX2 build multiplies and adds.
 *
 * How it approaches memory bandwidth:
 *   - A head's rows are H_kv * D values apart within a block and blocks lie anywhere, so one pass per KV head
 *     misses in short strided runs, which the hardware prefetchers do not stream (measured on Zen 3: a
 *     quarter to a third of the sequential bandwidth, software prefetch or not). Keys are therefore taken in
 *     tiles (64 keys at head_dim 64, fewer for wider heads), every cache line of a tile (all heads, K and V) is
 *     first touched with one load in memory order (sequential misses, which the prefetchers do stream), then
 *     the tile is computed KV head after KV head from L1/L2 (single-threaded, 16 requests x 3000 keys, 3 KV
 *     heads, blocks shuffled: 4.8 -> 9.4 GB/s).
 *   - (AVX2 build) Each key is loaded once for the whole group of query heads: scores are register tiles of
 *     up to 3 query heads x 4 keys (8 keys for a single head), each K vector feeding every head of the
 *     block; the 4 (or 8) dot products of a head are reduced together by one transpose-add, not one
 *     horizontal sum per key. The p-weighted V sum likewise applies each loaded V vector to up to 3 heads.
 *     16-bit rows are widened in registers, never staged.
 *
 * Work is split over num_threads OpenMP threads (torch's libgomp) by (request, range of SPLIT_KEYS keys), all
 * KV heads together, and the ranges' partial (m, l, accumulator) are merged afterwards (flash-decoding), so that
 * batch 1 uses every thread. The ranges are fixed by each request's own length, so a request's result does not
 * depend on the batch it runs in or on the thread count.
 *
 * Layouts (row-major, contiguous): q, out [B, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D];
 * block_table [B, bt_stride] int64; seq_lens [B] int64, each >= 1. The `avx2` build (-mavx2 -mfma) runs
 * D % 8 == 0 on its vector path and any other D on the portable one; the `generic` build (no ISA flag,
 * portable C, any CPU) takes any D. Any group size G.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_thread_num() 0
#endif

#include "quant_common.h" /* loom_bf16_to_f32, loom_f32_to_bf16 */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE_FLOATS 4096   /* a tile holds about this many floats of one head's K (and of V): 16 KiB each */
#define MAX_TILE 64        /* keys per tile, a multiple of 8 */
/* keys of one range of a request (the last one may be shorter). At batch 1 and 126-254 keys (SmolLM2, 2 threads,
 * float16 cache) the attention of a step took 0.94-1.0 ms with ranges of 128 (one thread worked, the other
 * waited), 0.55-0.63 ms with 64 and 0.70 ms with 32 (benchmarks/NOTES.md, "Issue 9: the per-token overhead of a
 * single stream") */
#define SPLIT_KEYS 64


/* the read-only arguments of one request */
typedef struct {
    const void *k_cache, *v_cache;
    const int64_t *blocks; /* this request's row of the block table */
    int64_t block_size, H_kv, D, G, tile;
    float scale;
    int kv; /* cache element type: 0 float32, 1 bfloat16, 2 float16, 3 int8 rows with group scales */
    int64_t hrow; /* bytes of one (token, KV head) row of the cache */
} req_t;

/* per-thread scratch (floats) */
typedef struct {
    float *q;      /* [H, D] the request's queries, float32 */
    float *scores; /* [G, tile] */
    float *kbuf;   /* [tile, D] one head's tile as float32 (int8 rows; 16-bit rows on the portable path) */
    float *vbuf;   /* [tile, D] */
} scratch_t;

#if defined(__AVX2__)
/* e^x, SLEEF's expf algorithm (Cody-Waite reduction, degree-6 polynomial, FMA; 1 ulp); x < -104 gives 0 */
static inline __m256 exp8(__m256 d) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i half = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(0x7f);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), bias), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
    return _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline float exp1(float x) { return _mm_cvtss_f32(_mm256_castps256_ps128(exp8(_mm256_set1_ps(x)))); }

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: one transpose-add instead of four horizontal sums */
static inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* 8 cache values from p as floats: float32 loaded, bfloat16 widened (a bf16 is the top half of a float32) */
#define LOAD_f32(p) _mm256_loadu_ps(p)
#define LOAD_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

/* The register kernels, for each cache element type T (f32: float, bf16 and f16: uint16_t). */
#define LOOM_KERNELS(T, ET)                                                                                  \
    /* sc[0 .. 8) = q . k_j for the 8 keys kp[0 .. 8) (one query head) */                                    \
    static inline void qk1_##T(const float *q, int64_t D, const ET *const *kp, float *sc, int64_t tile) {   \
        (void)tile;                                                                                          \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;     \
        for (int64_t d = 0; d < D; d += 8) {                                                                 \
            const __m256 qv = _mm256_loadu_ps(q + d);                                                        \
            a0 = _mm256_fmadd_ps(qv, LOAD_##T(kp[0] + d), a0);                                               \
            a1 = _mm256_fmadd_ps(qv, LOAD_##T(kp[1] + d), a1);                                               \
            a2 = _mm256_fmadd_ps(qv, LOAD_##T(kp[2] + d), a2);                                               \
            a3 = _mm256_fmadd_ps(qv, LOAD_##T(kp[3] + d), a3);                                               \
            a4 = _mm256_fmadd_ps(qv, LOAD_##T(kp[4] + d), a4);                                               \
            a5 = _mm256_fmadd_ps(qv, LOAD_##T(kp[5] + d), a5);                                               \
            a6 = _mm256_fmadd_ps(qv, LOAD_##T(kp[6] + d), a6);                                               \
            a7 = _mm256_fmadd_ps(qv, LOAD_##T(kp[7] + d), a7);                                               \
        }                                                                                                    \
        _mm_storeu_ps(sc, reduce4(a0, a1, a2, a3));                                                          \
        _mm_storeu_ps(sc + 4, reduce4(a4, a5, a6, a7));                                                      \
    }                                                                                                        \
    LOOM_QK(2, T, ET)                                                                                        \
    LOOM_QK(3, T, ET)                                                                                        \
    LOOM_PV(1, 8, T, ET)                                                                                     \
    LOOM_PV(1, 4, T, ET)                                                                                     \
    LOOM_PV(1, 2, T, ET)                                                                                     \
    LOOM_PV(1, 1, T, ET)                                                                                     \
    LOOM_PV(2, 4, T, ET)                                                                                     \
    LOOM_PV(2, 2, T, ET)                                                                                     \
    LOOM_PV(2, 1, T, ET)                                                                                     \
    LOOM_PV(3, 4, T, ET)                                                                                     \
    LOOM_PV(3, 2, T, ET)                                                                                     \
    LOOM_PV(3, 1, T, ET)                                                                                     \
    /* the V sum of GB heads over all of D (D % 8 == 0) */                                                   \
    static void pv_heads_##T(int gb, float *acc, int64_t D, const float *p, int64_t tile,                    \
                             const ET *const *vp, int64_t n) {                                               \
        int64_t d = 0;                                                                                       \
        if (gb == 1) {                                                                                       \
            for (; d + 64 <= D; d += 64) pv1_8_##T(acc, D, p, tile, vp, n, d);                               \
            if (D - d >= 32) pv1_4_##T(acc, D, p, tile, vp, n, d), d += 32;                                  \
            if (D - d >= 16) pv1_2_##T(acc, D, p, tile, vp, n, d), d += 16;                                  \
            if (D - d >= 8) pv1_1_##T(acc, D, p, tile, vp, n, d);                                            \
        } else if (gb == 2) {                                                                                \
            for (; d + 32 <= D; d += 32) pv2_4_##T(acc, D, p, tile, vp, n, d);                               \
            if (D - d >= 16) pv2_2_##T(acc, D, p, tile, vp, n, d), d += 16;                                  \
            if (D - d >= 8) pv2_1_##T(acc, D, p, tile, vp, n, d);                                            \
        } else {                                                                                             \
            for (; d + 32 <= D; d += 32) pv3_4_##T(acc, D, p, tile, vp, n, d);                               \
            if (D - d >= 16) pv3_2_##T(acc, D, p, tile, vp, n, d), d += 16;                                  \
            if (D - d >= 8) pv3_1_##T(acc, D, p, tile, vp, n, d);                                            \
        }                                                                                                    \
    }                                                                                                        \
    /* the scores of all G query heads (rows D apart) for the keys kp[0 .. nt8), nt8 % 8 == 0 */             \
    static void qk_heads_##T(const float *q, int64_t G, int64_t D, const ET *const *kp, int64_t nt8,         \
                             float *scores, int64_t tile) {                                                  \
        for (int64_t g0 = 0; g0 < G;) {                                                                      \
            const int gb = head_block(G - g0);                                                               \
            for (int64_t j = 0; j < nt8; j += 8) {                                                           \
                if (gb == 1)                                                                                 \
                    qk1_##T(q + g0 * D, D, kp + j, scores + g0 * tile + j, tile);                            \
                else if (gb == 2)                                                                            \
                    qk2_##T(q + g0 * D, D, kp + j, scores + g0 * tile + j, tile);                            \
                else                                                                                         \
                    qk3_##T(q + g0 * D, D, kp + j, scores + g0 * tile + j, tile);                            \
            }                                                                                                \
            g0 += gb;                                                                                        \
        }                                                                                                    \
    }                                                                                                        \
    static void pv_all_##T(float *acc, int64_t G, int64_t D, const float *p, int64_t tile,                   \
                           const ET *const *vp, int64_t nt) {                                                \
        for (int64_t g0 = 0; g0 < G;) {                                                                      \
            const int gb = head_block(G - g0);                                                               \
            pv_heads_##T(gb, acc + g0 * D, D, p + g0 * tile, tile, vp, nt);                                  \
            g0 += gb;                                                                                        \
        }                                                                                                    \
    }

/* sc[g * tile + j] = q_g . k_j for GB query heads (rows D apart) and the 8 keys kp[0 .. 8), as two groups of
 * 4 keys: 4 GB accumulators, each K vector loaded once and used by every head */
#define LOOM_QK(GB, T, ET)                                                                                   \
    static inline void qk##GB##_##T(const float *q, int64_t D, const ET *const *kp, float *sc, int64_t tile) { \
        for (int j = 0; j < 8; j += 4) {                                                                     \
            __m256 a[GB][4];                                                                                 \
            for (int g = 0; g < GB; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();       \
            const ET *k0 = kp[j], *k1 = kp[j + 1], *k2 = kp[j + 2], *k3 = kp[j + 3];                         \
            for (int64_t d = 0; d < D; d += 8) {                                                             \
                __m256 qv[GB];                                                                               \
                for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);                         \
                __m256 k = LOAD_##T(k0 + d);                                                                 \
                for (int g = 0; g < GB; ++g) a[g][0] = _mm256_fmadd_ps(qv[g], k, a[g][0]);                   \
                k = LOAD_##T(k1 + d);                                                                        \
                for (int g = 0; g < GB; ++g) a[g][1] = _mm256_fmadd_ps(qv[g], k, a[g][1]);                   \
                k = LOAD_##T(k2 + d);                                                                        \
                for (int g = 0; g < GB; ++g) a[g][2] = _mm256_fmadd_ps(qv[g], k, a[g][2]);                   \
                k = LOAD_##T(k3 + d);                                                                        \
                for (int g = 0; g < GB; ++g) a[g][3] = _mm256_fmadd_ps(qv[g], k, a[g][3]);                   \
            }                                                                                                \
            for (int g = 0; g < GB; ++g)                                                                     \
                _mm_storeu_ps(sc + g * tile + j, reduce4(a[g][0], a[g][1], a[g][2], a[g][3]));               \
        }                                                                                                    \
    }

/* acc[g * D + off + 8w] += sum_i p[g * tile + i] * vp[i][off + 8w] for GB heads, W vectors of D: each V
 * vector loaded once for every head; GB and W compile-time, so the GB x W accumulators stay in registers */
#define LOOM_PV(GB, W, T, ET)                                                                                \
    static inline void pv##GB##_##W##_##T(float *acc, int64_t D, const float *p, int64_t tile,             \
                                          const ET *const *vp, int64_t n, int64_t off) {                     \
        __m256 c[GB][W];                                                                                     \
        for (int g = 0; g < GB; ++g)                                                                         \
            for (int w = 0; w < W; ++w) c[g][w] = _mm256_loadu_ps(acc + g * D + off + 8 * w);                \
        for (int64_t i = 0; i < n; ++i) {                                                                    \
            __m256 pb[GB];                                                                                   \
            for (int g = 0; g < GB; ++g) pb[g] = _mm256_broadcast_ss(p + g * tile + i);                      \
            const ET *v = vp[i] + off;                                                                       \
            for (int w = 0; w < W; ++w) {                                                                    \
                const __m256 vv = LOAD_##T(v + 8 * w);                                                       \
                for (int g = 0; g < GB; ++g) c[g][w] = _mm256_fmadd_ps(pb[g], vv, c[g][w]);                  \
            }                                                                                                \
        }                                                                                                    \
        for (int g = 0; g < GB; ++g)                                                                         \
            for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * D + off + 8 * w, c[g][w]);                \
    }

/* query heads per register block: 3 at a time, 2 + 2 for four (G = 4 -> 2, 2; 5 -> 3, 2; 8 -> 3, 3, 2) */
static inline int head_block(int64_t left) { return left == 4 ? 2 : left >= 3 ? 3 : (int)left; }

LOOM_KERNELS(f32, float)
LOOM_KERNELS(bf16, uint16_t)
LOOM_KERNELS(f16, uint16_t)
#undef LOOM_KERNELS
#undef LOOM_QK
#undef LOOM_PV

/* D 16-bit cache values (kv 1: bfloat16, 2: float16) as float32 */
static inline void widen_row(float *dst, const uint16_t *src, int64_t D, int kv) {
    int64_t d = 0;
    if (kv == 2) {
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, LOAD_f16(src + d));
        for (; d < D; ++d) dst[d] = loom_f16_to_f32(src[d]);
        return;
    }
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, LOAD_bf16(src + d));
    for (; d < D; ++d) dst[d] = loom_bf16_to_f32(src[d]);
}
#else
static inline float exp1(float x) { return x < -104.0f ? 0.0f : expf(x); }

static inline void widen_row(float *dst, const uint16_t *src, int64_t D, int kv) {
    if (kv == 2)
        for (int64_t d = 0; d < D; ++d) dst[d] = loom_f16_to_f32(src[d]);
    else
        for (int64_t d = 0; d < D; ++d) dst[d] = loom_bf16_to_f32(src[d]);
}
#endif

/* one int8 KV row (see the top of the file) as D float32 values: ((code + 128) * scale) + lo per group of 32,
 * multiply then add, each rounded (the build has -ffp-contract=off), as dequantize_rows computes it */
static inline void dequant_row_i8(float *dst, const unsigned char *row, int64_t D) {
    const int64_t ng = (D + 31) / 32;
    const int8_t *codes = (const int8_t *)row;
    for (int64_t g = 0; g < ng; ++g) {
        uint16_t sb, lb;
        memcpy(&sb, row + D + 2 * g, 2);
        memcpy(&lb, row + D + 2 * (ng + g), 2);
        const float scale = loom_f16_to_f32(sb), lo = loom_f16_to_f32(lb);
        const int64_t d1 = 32 * g + 32 < D ? 32 * g + 32 : D;
        int64_t d = 32 * g;
#if defined(__AVX2__)
        const __m256 vs = _mm256_set1_ps(scale), vl = _mm256_set1_ps(lo), v128 = _mm256_set1_ps(128.0f);
        for (; d + 8 <= d1; d += 8) {
            const __m128i c = _mm_loadl_epi64((const __m128i *)(codes + d));
            const __m256 u = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), v128);
            _mm256_storeu_ps(dst + d, _mm256_add_ps(_mm256_mul_ps(u, vs), vl));
        }
#endif
        for (; d < d1; ++d) dst[d] = ((float)codes[d] + 128.0f) * scale + lo;
    }
}

/* q . k over D values, eight interleaved partial sums (vectorizable without reassociation) */
static inline float dot_portable(const float *a, const float *b, int64_t D) {
    float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; ++l) part[l] += a[d + l] * b[d + l];
    float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; d < D; ++d) s += a[d] * b[d];
    return s;
}

/* the rows of one KV head over one tile: float32 rows (the cache's, or 16-bit ones widened, for the portable
 * path), or the cache's own rows of any type (the AVX2 path) */
typedef struct {
    const float *kf[MAX_TILE], *vf[MAX_TILE];
#if defined(__AVX2__)
    const uint16_t *kb[MAX_TILE], *vb[MAX_TILE];
#endif
} rows_t;

/*
 * One KV head over one tile of nt keys (K rows padded to nt8 = nt rounded up to 8 with valid rows): the G
 * query heads q [G, D] update their m [G], l [G], acc [G, D]. vec: the AVX2 path (D % 8 == 0).
 */
static void head_tile(const req_t *R, const float *q, const rows_t *rw, int vec, int64_t nt, int64_t nt8,
                      float *scores, float *m, float *l, float *acc) {
    const int64_t D = R->D, G = R->G, tile = R->tile;
    const int kt = R->kv == 3 ? 0 : R->kv; /* int8 rows arrive dequantized: float32 */
#if defined(__AVX2__)
    if (vec) { /* all scores of the tile */
        if (kt == 1)
            qk_heads_bf16(q, G, D, rw->kb, nt8, scores, tile);
        else if (kt == 2)
            qk_heads_f16(q, G, D, rw->kb, nt8, scores, tile);
        else
            qk_heads_f32(q, G, D, rw->kf, nt8, scores, tile);
    }
#else
    (void)vec, (void)nt8, (void)kt;
#endif
    for (int64_t g = 0; g < G; ++g) {
        float *sc = scores + g * tile, *ag = acc + g * D;
        float tmax = -INFINITY, psum = 0.0f;
#if defined(__AVX2__)
        if (vec) {
            const __m256 scale = _mm256_set1_ps(R->scale);
            __m256 mx = _mm256_set1_ps(-INFINITY);
            for (int64_t j = 0; j < nt8; j += 8) {
                __m256 s = _mm256_mul_ps(_mm256_loadu_ps(sc + j), scale);
                if (j + 8 > nt) { /* the padding keys */
                    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nt - j)), lane);
                    s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(valid));
                }
                _mm256_storeu_ps(sc + j, s);
                mx = _mm256_max_ps(mx, s);
            }
            tmax = hmax8(mx);
        } else
#endif
        {
            for (int64_t i = 0; i < nt; ++i) {
                sc[i] = dot_portable(q + g * D, rw->kf[i], D) * R->scale;
                tmax = sc[i] > tmax ? sc[i] : tmax;
            }
        }
        /* online softmax: rescale what came before when the max grows */
        const float m_new = tmax > m[g] ? tmax : m[g];
        if (m_new > m[g]) {
            const float alpha = m[g] == -INFINITY ? 0.0f : exp1(m[g] - m_new);
            l[g] *= alpha;
            for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
            m[g] = m_new;
        }
#if defined(__AVX2__)
        if (vec) {
            const __m256 mv = _mm256_set1_ps(m_new);
            __m256 total = _mm256_setzero_ps();
            for (int64_t j = 0; j < nt8; j += 8) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
                _mm256_storeu_ps(sc + j, p);
                total = _mm256_add_ps(total, p);
            }
            psum = hsum8(total);
        } else
#endif
        {
            for (int64_t i = 0; i < nt; ++i) {
                sc[i] = exp1(sc[i] - m_new);
                psum += sc[i];
            }
            for (int64_t i = 0; i < nt; ++i) {
                const float p = sc[i], *v = rw->vf[i];
                for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
            }
        }
        l[g] += psum;
    }
#if defined(__AVX2__)
    if (vec) {
        if (kt == 1)
            pv_all_bf16(acc, G, D, scores, tile, rw->vb, nt);
        else if (kt == 2)
            pv_all_f16(acc, G, D, scores, tile, rw->vb, nt);
        else
            pv_all_f32(acc, G, D, scores, tile, rw->vf, nt);
    }
#endif
}

/*
 * Unnormalized attention of all H = H_kv * G query heads of a request over its keys [t0, t1): m[hq] the
 * running max of the scores, l[hq] the sum of e^(s - m), acc[hq, :] the sum of e^(s - m) v, hq = h * G + g.
 * An empty range leaves m = -inf, l = 0, acc = 0.
 */
static void attend_range(const req_t *R, const scratch_t *S, int64_t t0, int64_t t1, float *m, float *l,
                         float *acc) {
    const int64_t D = R->D, G = R->G, H_kv = R->H_kv, tile = R->tile, bs = R->block_size;
    const int64_t hrow = R->hrow, row_bytes = H_kv * hrow; /* bytes of one key's rows (all heads) */
    const unsigned char *kc = (const unsigned char *)R->k_cache, *vc = (const unsigned char *)R->v_cache;
#if defined(__AVX2__)
    const int vec = D % 8 == 0;
#else
    const int vec = 0;
#endif
    for (int64_t i = 0; i < H_kv * G; ++i) m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(H_kv * G * D));
    rows_t rw;
    int64_t rows[MAX_TILE]; /* byte offset of each key's rows (all heads) in the caches */
    unsigned sink = 0;
    for (int64_t ts = t0; ts < t1; ts += tile) {
        const int64_t nt = t1 - ts < tile ? t1 - ts : tile;
        const int64_t nt8 = (nt + 7) & ~(int64_t)7;
        int64_t bi = ts / bs, off = ts % bs; /* walk the block table */
        for (int64_t i = 0; i < nt; ++i) {
            rows[i] = (R->blocks[bi] * bs + off) * row_bytes;
            if (++off == bs) off = 0, ++bi;
        }
        /* touch every cache line of the tile (all heads) in memory order, one byte per line (see the top of
         * the file); the heads then read the tile from L1/L2 */
        for (int64_t i = 0; i < nt; ++i) {
            const unsigned char *kr = kc + rows[i], *vr = vc + rows[i];
            for (int64_t o = 0; o < row_bytes; o += 64) sink |= (unsigned)(kr[o] ^ vr[o]);
            sink |= (unsigned)(kr[row_bytes - 1] ^ vr[row_bytes - 1]); /* the last line, if the row straddles one */
        }
        for (int64_t h = 0; h < H_kv; ++h) {
            for (int64_t i = 0; i < nt; ++i) {
                const unsigned char *kr = kc + rows[i] + h * hrow, *vr = vc + rows[i] + h * hrow;
                if (!R->kv) {
                    rw.kf[i] = (const float *)kr;
                    rw.vf[i] = (const float *)vr;
                } else if (R->kv == 3) { /* int8 rows: dequantized once per tile */
                    dequant_row_i8(S->kbuf + i * D, kr, D);
                    dequant_row_i8(S->vbuf + i * D, vr, D);
                    rw.kf[i] = S->kbuf + i * D;
                    rw.vf[i] = S->vbuf + i * D;
                } else if (!vec) { /* the portable path widens the rows once */
                    widen_row(S->kbuf + i * D, (const uint16_t *)kr, D, R->kv);
                    widen_row(S->vbuf + i * D, (const uint16_t *)vr, D, R->kv);
                    rw.kf[i] = S->kbuf + i * D;
                    rw.vf[i] = S->vbuf + i * D;
                }
#if defined(__AVX2__)
                else {
                    rw.kb[i] = (const uint16_t *)kr;
                    rw.vb[i] = (const uint16_t *)vr;
                }
#endif
            }
            for (int64_t i = nt; i < nt8; ++i) { /* padding keys, masked in head_tile */
#if defined(__AVX2__)
                if ((R->kv == 1 || R->kv == 2) && vec) {
                    rw.kb[i] = rw.kb[nt - 1];
                    continue;
                }
#endif
                rw.kf[i] = rw.kf[nt - 1];
            }
            head_tile(R, S->q + h * G * D, &rw, vec, nt, nt8, S->scores, m + h * G, l + h * G, acc + h * G * D);
        }
    }
    *(volatile float *)S->scores = (float)sink; /* keeps the touching loads */
}

static void store_out(void *out, int64_t at, const float *acc, float inv, int64_t D, int bf16) {
    if (bf16) {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t d = 0; d < D; ++d) o[d] = loom_f32_to_bf16(acc[d] * inv);
    } else {
        float *o = (float *)out + at;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
}

/* out row `at` (query head hq of one request) from the partials (m [H], l [H], acc [H, D] each, part_floats
 * apart) of its `ranges` key ranges, in range order: each scaled by e^(m_range - max m); acc is D floats of
 * scratch */
static void merge_ranges(const float *first, int64_t ranges, int64_t part_floats, int64_t H, int64_t D, int64_t hq,
                         float *acc, void *out, int64_t at, int bf16) {
    float mx = -INFINITY, total = 0.0f;
    for (int64_t sp = 0; sp < ranges; ++sp) {
        const float ms = first[sp * part_floats + hq];
        mx = ms > mx ? ms : mx;
    }
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int64_t sp = 0; sp < ranges; ++sp) {
        const float *part = first + sp * part_floats;
        if (part[H + hq] == 0.0f) continue; /* an empty range */
        const float w = exp1(part[hq] - mx);
        total += part[H + hq] * w;
        const float *a = part + 2 * H + hq * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
    }
    store_out(out, at, acc, 1.0f / total, D, bf16);
}

/* Returns 0, or -1 when its scratch memory cannot be allocated (nothing is written to out then). Every buffer is
 * allocated before the parallel region, so that a failed allocation is reported, never met inside a thread. */
int loom_paged_decode(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                      int64_t bt_stride, const int64_t *seq_lens, void *out, int64_t B, int64_t H, int64_t H_kv,
                      int64_t D, int64_t block_size, float scale, int64_t window, int num_threads, int is_bf16,
                      int kv_type) {
    const int bf16 = is_bf16 != 0, kv = kv_type >= 1 && kv_type <= 3 ? kv_type : 0;
    const int64_t hrow = loom_kv_row_bytes(D, kv); /* bytes of a (token, head) row */
    const int64_t G = H / H_kv;
    if (num_threads < 1) num_threads = 1;
    int64_t tile = (TILE_FLOATS / D) & ~(int64_t)7;
    tile = tile < 8 ? 8 : tile > MAX_TILE ? MAX_TILE : tile;
    /* every request's keys in ranges of SPLIT_KEYS from its first attended key, each range's partial (m, l,
     * accumulator) merged afterwards in range order (flash-decoding; merge_ranges): the ranges depend on the
     * request alone, never on the batch or the thread count, so a request's output is the same bits in any batch.
     * With fewer requests than 4 per thread the ranges are the work items (batch 1 uses every thread); with more,
     * a request is one item whose ranges run in turn into its thread's buffer (partials of one request only). */
    int64_t *first_item = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!first_item) return -1;
    first_item[0] = 0;
    int64_t most = 1;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n = window > 0 && seq_lens[b] > window ? window : seq_lens[b];
        const int64_t ranges = (n + SPLIT_KEYS - 1) / SPLIT_KEYS;
        first_item[b + 1] = first_item[b] + ranges;
        most = ranges > most ? ranges : most;
    }
    const int by_range = num_threads > 1 && B < 4 * (int64_t)num_threads;
    const int64_t items = by_range ? first_item[B] : B;
    const int64_t part_floats = H * D + 2 * H; /* m, l, acc of one (request, range) */
    float *parts = by_range ? (float *)loom_alloc64(sizeof(float) * (size_t)(items * part_floats)) : NULL;
    /* each thread's scratch, 64-byte aligned pieces so that no vector load of q, the scores or the accumulators
     * splits a line: q [H, D], scores [G, tile], two tiles [tile, D], acc [H, D] (+ 2H), and without key-range
     * items its own request's partials [most ranges, part_floats] */
#define LOOM_ROUND16(n) (((n) + 15) & ~(int64_t)15)
    const int64_t n_q = LOOM_ROUND16(H * D), n_sc = LOOM_ROUND16(G * tile), n_buf = LOOM_ROUND16(tile * D);
    const int64_t n_mem = LOOM_ROUND16(2 * n_q + n_sc + 2 * n_buf + 2 * H);
    const int64_t n_own = by_range ? 0 : LOOM_ROUND16(most * part_floats);
#undef LOOM_ROUND16
    float *scratch = (float *)loom_alloc64(sizeof(float) * (size_t)(num_threads * (n_mem + n_own)));
    if (!scratch || (by_range && !parts)) {
        free(scratch), free(parts), free(first_item);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        /* the team may be smaller than num_threads, never larger: thread t owns slice t */
        float *mem = scratch + (int64_t)omp_get_thread_num() * (n_mem + n_own);
        float *own = by_range ? NULL : mem + n_mem;
        const scratch_t S = {mem, mem + n_q, mem + n_q + n_sc, mem + n_q + n_sc + n_buf};
        float *acc = mem + n_q + n_sc + 2 * n_buf; /* [H, D] */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            int64_t b = item, sp0 = 0, sp1;
            if (by_range) { /* the request b with first_item[b] <= item < first_item[b + 1] */
                int64_t lo = 0, hi = B;
                while (hi - lo > 1) {
                    const int64_t mid = (lo + hi) / 2;
                    if (first_item[mid] <= item) lo = mid;
                    else hi = mid;
                }
                b = lo, sp0 = item - first_item[b];
                sp1 = sp0 + 1;
            } else {
                sp1 = first_item[b + 1] - first_item[b];
            }
            const int64_t end = seq_lens[b];
            const int64_t start = (window > 0 && end > window) ? end - window : 0;
            const req_t R = {k_cache, v_cache, block_table + b * bt_stride, block_size, H_kv, D, G, tile, scale,
                             kv, hrow};
            for (int64_t i = 0; i < H * D; ++i)
                S.q[i] = bf16 ? loom_bf16_to_f32(((const uint16_t *)q)[b * H * D + i]) : ((const float *)q)[b * H * D + i];
            for (int64_t sp = sp0; sp < sp1; ++sp) {
                const int64_t t0 = start + sp * SPLIT_KEYS, t1 = t0 + SPLIT_KEYS < end ? t0 + SPLIT_KEYS : end;
                float *part = by_range ? parts + item * part_floats : own + sp * part_floats;
                attend_range(&R, &S, t0, t1, part, part + H, part + 2 * H);
            }
            if (!by_range)
                for (int64_t hq = 0; hq < H; ++hq)
                    merge_ranges(own, sp1, part_floats, H, D, hq, acc, out, (b * H + hq) * D, bf16);
        }
        if (by_range) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; ++bh) {
                const int64_t b = bh / H;
                merge_ranges(parts + first_item[b] * part_floats, first_item[b + 1] - first_item[b], part_floats, H,
                             D, bh % H, acc, out, bh * D, bf16);
            }
        }
    }
    free(scratch);
    free(parts);
    free(first_item);
    return 0;
}
