/*
 * One whole decode step of a Llama-family decoder over packed weights, in C (loom/kernels/decode_step.py).
 *
 * Why: at 4 bits a decode step of SmolLM2-135M reads ~96 MB of weights, ~4.3 ms at 22.5 GB/s, while the
 * per-layer Python path makes ~13 ctypes calls, ~15 tensor allocations and ~10 module calls per layer (30
 * layers): about as long again as the weights take to read (benchmarks/NOTES.md, "Per-token overhead"). This
 * function runs the same kernels in the same order for every layer, so its results equal the per-layer path's
 * bit for bit, from one call per step:
 *
 *   for each layer:  (normed, residual) = add_rmsnorm(h, residual)     (layer 0: rmsnorm of the embedding)
 *                    qkv = normed Wqkv^T (+ b)                          (loom_gemm_*_f: int16 x codes)
 *                    (QK-norm models: each q head and k head rmsnorm-ed over D first, with q_norm / k_norm)
 *                    q, k = rotary(qkv[:, :Hq D]), rotary(qkv[:, Hq D : (Hq + Hkv) D])
 *                    K/V cache rows at slot_mapping[b] = k, v           (slot < 0: padding, not written)
 *                    a = paged_decode(q, caches, block_table, seq_lens)
 *                    h = a Wo^T; (Gemma: h = rmsnorm(h) with post_attn_norm)
 *                    (normed, residual) = add_rmsnorm(h, residual)
 *                    h = silu_mul(normed Wgu^T) Wdown^T                (Gemma: gelu_tanh_mul, then h = rmsnorm(h))
 *   out = add_rmsnorm(h, residual) with the final norm
 *
 * All activations are float32 or bfloat16 (`is_bf16`); KV caches are in that dtype, or 16-bit (`kv_type` 1:
 * bfloat16, 2: float16, rounded to nearest even on the write as torch's copy rounds), or loom's int8 rows
 * (`kv_type` 3: group-32 codes with float16 scale and minimum, quantized exactly as
 * loom.attention.kv_quant.quantize_rows does). Scratch buffers are the caller's (reused every step). Returns 0, or -1 when a kernel failed to allocate scratch (out undefined).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_common.h" /* loom_bf16_to_f32, loom_f32_to_bf16, loom_f32_to_f16 */

/* kernels of the other sources compiled into this library (qgemm.c, gemv_w16.c, fused_ops.c, paged_decode.c) */
int loom_gemm_q4g_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *qweight,
                    const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y, int64_t N,
                    int y_bf16, int num_threads);
int loom_gemm_q4gr16_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *qweight,
                       const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y,
                       int64_t N, int y_bf16, int num_threads);
int loom_gemm_q8gr16_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const int8_t *qweight,
                       const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y,
                       int64_t N, int y_bf16, int num_threads);
int loom_gemm_q8g_f(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const int8_t *qweight,
                    const uint16_t *scales, const uint16_t *mins, int64_t group, const float *bias, void *y, int64_t N,
                    int y_bf16, int num_threads);
int loom_gemv_w16(const float *x, int64_t ldx, const uint16_t *w, const float *b, float *y, int64_t M, int64_t N,
                  int64_t K, int num_threads);
int loom_gemv_fp8(const float *x, int64_t ldx, const uint8_t *w, const float *scale, const float *b, float *y,
                  int64_t M, int64_t N, int64_t K, int num_threads);
void loom_rotate_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t block, float *y, int num_threads);
void loom_quantize_act(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int per_token, int8_t *xq,
                       float *xs, float *xsum, int num_threads);
int loom_gemm_q8g_q8(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                     const int8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t group,
                     const float *bias, void *y, int64_t N, int y_bf16, int num_threads);
void loom_gemm_q8c_q8t(const int8_t *xq, const float *xs, int64_t xs_stride, int64_t M, int64_t K, const int8_t *w,
                       const uint16_t *sc, const float *bias, void *y, int64_t N, int y_bf16, int num_threads);
void loom_add_rmsnorm(const void *x, const void *residual, const void *weight, void *out, void *sum_out, int64_t M,
                      int64_t H, float eps, int is_bf16);
void loom_silu_mul(const void *gate_up, void *out, int64_t M, int64_t I, int is_bf16, int torch_lanes,
                   int64_t torch_chunk);
void loom_gelu_tanh_mul(const void *gate_up, void *out, int64_t M, int64_t I, int is_bf16);
void loom_rotary(const void *x, int64_t row_stride, const float *cos, const float *signed_sin, void *out, int64_t n,
                 int64_t heads, int64_t dim, int is_bf16);
int loom_paged_decode(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                      int64_t bt_stride, const int64_t *seq_lens, void *out, int64_t B, int64_t H, int64_t H_kv,
                      int64_t D, int64_t block_size, float scale, int64_t window, int num_threads, int is_bf16,
                      int kv_type);

/* A weight [N, K] in one of the layouts the step reads (`kind`): 0 q4g (4: q4gr16, its 16-row interleave) and 1 q8g
 * (5: q8gr16) with `group`
 * (loom/quant/layout.py: codes, float16 scales and minimums), 2 bfloat16 values row-major (a bf16 checkpoint
 * under `--quantization bf16`: gemv_w16.c, float32 activations only; scales and mins NULL), 6 FP8 e4m3 values
 * row-major with a float32 scale per row at `scales` (`--quantization fp8`: gemv_fp8.c, float32 activations only;
 * mins NULL), 3 q8g under int8
 * activations (W8A8, float32 models only), quantized per token or, where `act_scale` > 0, with that static
 * scale, after a block Hadamard rotation of `rot` channels (0: none; every part of a chain the same). A
 * projection whose shards have different layouts (a GGUF file that stores q and k as Q4_K and v as Q6_K) is a
 * chain of parts, each giving the next output columns. */
typedef struct LoomPacked {
    const void *qweight;
    const uint16_t *scales; /* float16 bits [N, K / group] */
    const uint16_t *mins;   /* float16 bits [N, K / group] or NULL */
    const float *bias;      /* float32 [N] or NULL */
    int64_t n, k, group, kind;
    const struct LoomPacked *next; /* the part for the following output columns, or NULL */
    int64_t rot;                   /* kind 3: channels per Hadamard block of the input rotation, 0 = none */
    float act_scale;               /* kind 3: a static activation scale (the checkpoint's input_scale), 0 = per token */
} LoomPacked;

typedef struct {
    LoomPacked qkv, o, gate_up, down;
    const void *norm1, *norm2; /* [hidden] model dtype: input_layernorm, post_attention_layernorm */
    void *k_cache, *v_cache;   /* [num_blocks, block_size, Hkv, D] model dtype or kv_type */
    const void *q_norm, *k_norm; /* [D] model dtype: QK-norm weights (Qwen3, Gemma 3), or NULL */
    /* Gemma's sandwich norms, or NULL: on the attention output (post_attention_layernorm; norm2 is then
     * pre_feedforward_layernorm) and on the MLP output (post_feedforward_layernorm) */
    const void *post_attn_norm, *post_ffw_norm;
    int64_t window;     /* sliding window of this layer (keys seen, itself included), 0 = all */
    int64_t local_rope; /* 1: rotate with the local tables (Gemma 3's sliding layers), 0: the global ones */
    /* a hybrid KV cache (one block table per group of layers): this layer's block table [B, bt_stride] and slot
     * mapping [B], or NULL for the step's own */
    const int64_t *block_table, *slot_mapping;
    int64_t bt_stride;
    /* block-sparse decode attention (Quest, arXiv:2406.10774; loom/attention/sparse.py), or NULL: per KV head and
     * block the channel-wise max then min of the block's keys, bfloat16 rounded outward [Hkv, num_blocks, 2, D]
     * (bit patterns), and a validity
     * flag per block [num_blocks] (bool bytes). The step widens them with the keys it writes and each request's
     * query reads its sink, recent and top-k blocks by the bound sum_d max(q_d min_d, q_d max_d) */
    uint16_t *summaries;
    unsigned char *summary_valid;
} LoomLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;
    int is_bf16, torch_lanes, num_threads;
    int kv_type; /* cache elements: 0 the model dtype, 1 bfloat16, 2 float16, 3 int8 rows */
    int act;     /* the gated MLP's activation: 0 SiLU (SwiGLU), 1 GELU-tanh (GeGLU, Gemma) */
    /* block-sparse decode (layers with summaries): blocks read per query besides sink_blocks first and recent_blocks
     * last; num_blocks of the cache (the summaries' stride) */
    int64_t sparse_topk, sparse_sink, sparse_recent, num_blocks;
} LoomDims;

/* one (token, KV head) row of D values (float32, or bfloat16 when src_bf16) as loom's int8 KV row: per group of
 * 32, lo = min clamped to the float16 range and stored as float16, scale = (max - lo) / 255 clamped to
 * [2^-24, 65504] and stored as float16, codes clamp(round_half_even((x - lo) / scale), 0, 255) - 128 from the
 * stored lo and scale; then the D codes, the scales, the minimums (quantize_rows in loom/attention/kv_quant.py,
 * the same float32 operations in the same order) */
static void quantize_row_i8(unsigned char *dst, const void *src, int64_t D, int src_bf16) {
    const int64_t ng = (D + 31) / 32;
    for (int64_t g = 0; g < ng; ++g) {
        const int64_t d0 = 32 * g, d1 = d0 + 32 < D ? d0 + 32 : D;
        float v[32];
        for (int64_t d = d0; d < d1; ++d)
            v[d - d0] = src_bf16 ? loom_bf16_to_f32(((const uint16_t *)src)[d]) : ((const float *)src)[d];
        float mn = v[0], mx = v[0];
        for (int64_t i = 1; i < d1 - d0; ++i) {
            mn = v[i] < mn ? v[i] : mn;
            mx = v[i] > mx ? v[i] : mx;
        }
        const float lo_c = mn < -65504.0f ? -65504.0f : mn > 65504.0f ? 65504.0f : mn;
        const uint16_t lo16 = loom_f32_to_f16(lo_c);
        const float lo = loom_f16_to_f32(lo16);
        float sc = (mx - lo) / 255.0f;
        sc = sc < 5.9604644775390625e-08f ? 5.9604644775390625e-08f : sc > 65504.0f ? 65504.0f : sc;
        const uint16_t s16 = loom_f32_to_f16(sc);
        const float scale = loom_f16_to_f32(s16);
        for (int64_t d = d0; d < d1; ++d) {
            float u = (v[d - d0] - lo) / scale;
            u = u < 0.0f ? 0.0f : u > 255.0f ? 255.0f : u; /* clamp, then round: the same as round, then clamp */
            dst[d] = (unsigned char)(int8_t)((int)loom_round_even(u) - 128);
        }
        memcpy(dst + D + 2 * g, &s16, 2);
        memcpy(dst + D + 2 * (ng + g), &lo16, 2);
    }
}

/* n activations (float32, or bfloat16 when src_bf16) into a cache row of type kv 0-2 (0: the same dtype) */
static void store_kv(void *dst, const void *src, int64_t n, int src_bf16, int kv) {
    if (kv == 0 || (kv == 1 && src_bf16)) {
        memcpy(dst, src, (size_t)n * (src_bf16 ? 2 : 4));
        return;
    }
    uint16_t *o = (uint16_t *)dst;
    for (int64_t i = 0; i < n; ++i) {
        const float v = src_bf16 ? loom_bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i];
        o[i] = kv == 2 ? loom_f32_to_f16(v) : loom_f32_to_bf16(v);
    }
}

/* W8A8 (kind 3): the int8 activations every part of a projection multiplies (prepared once by int8_activations) */
typedef struct {
    const int8_t *xq;
    const float *xs, *xsum;
    int per_channel; /* every part one scale per row and no mins: exact int32 dots (methods' int_gemm) */
} Int8Act;

static int gemm_part(const LoomPacked *w, const void *x, int64_t ldx, int64_t M, void *y, int bf16, int threads,
                     const Int8Act *a) {
    if (w->kind == 3) { /* float32 models only */
        if (a->per_channel) {
            loom_gemm_q8c_q8t(a->xq, a->xs, w->k / 32, M, w->k, (const int8_t *)w->qweight, w->scales, w->bias, y,
                              w->n, 0, threads);
            return 0;
        }
        return loom_gemm_q8g_q8(a->xq, a->xs, a->xsum, M, w->k, (const int8_t *)w->qweight, w->scales, w->mins,
                                w->group, w->bias, y, w->n, 0, threads);
    }
    if (w->kind == 6) /* fp8: float32 models only, `scales` holds float32 values */
        return loom_gemv_fp8((const float *)x, ldx, (const uint8_t *)w->qweight, (const float *)(const void *)w->scales,
                             w->bias, (float *)y, M, w->n, w->k, threads);
    if (w->kind == 2) /* the binding sets up bf16 weights for float32 models only */
        return loom_gemv_w16((const float *)x, ldx, (const uint16_t *)w->qweight, w->bias, (float *)y, M, w->n, w->k,
                             threads);
    if (w->kind == 4) /* fast in avx512_vnni builds, the same bits a lane at a time in others */
        return loom_gemm_q4gr16_f(x, ldx, bf16, M, w->k, (const uint8_t *)w->qweight, w->scales, w->mins, w->group,
                                  w->bias, y, w->n, bf16, threads) ? -1 : 0;
    if (w->kind == 5)
        return loom_gemm_q8gr16_f(x, ldx, bf16, M, w->k, (const int8_t *)w->qweight, w->scales, w->mins, w->group,
                                  w->bias, y, w->n, bf16, threads) ? -1 : 0;
    if (w->kind == 1)
        return loom_gemm_q8g_f(x, ldx, bf16, M, w->k, (const int8_t *)w->qweight, w->scales, w->mins, w->group,
                               w->bias, y, w->n, bf16, threads);
    return loom_gemm_q4g_f(x, ldx, bf16, M, w->k, (const uint8_t *)w->qweight, w->scales, w->mins, w->group,
                           w->bias, y, w->n, bf16, threads);
}

/* W8A8 (kind 3): x float32 [M, K] rotated (rot > 0), then quantized to int8 once for all parts, per token or with
 * the static scale (PackedLinearMethod.apply's kernels.rotate_input and _int8_activations); each part then runs
 * gemm_q8_per_channel where every part has one scale per row and no mins (the exact dots whose bits torch's int8
 * GEMM gives too), else the per-block gemm_q8. Returns the scratch the activations live in (the caller frees it),
 * NULL when it cannot be allocated. */
static char *int8_activations(const LoomPacked *w, const float *x, int64_t ldx, int64_t M, int threads,
                              Int8Act *a) {
    const int64_t K = w->k, nb = K / 32;
    const size_t rot_floats = w->rot ? (size_t)(M * K) : 0;
    char *scratch = (char *)loom_alloc64((rot_floats + (size_t)(2 * M * nb)) * sizeof(float) + (size_t)(M * K));
    if (!scratch) return NULL;
    float *rotated = (float *)scratch, *xs = rotated + rot_floats, *xsum = xs + M * nb;
    int8_t *xq = (int8_t *)(xsum + M * nb);
    if (w->rot) {
        loom_rotate_rows(x, ldx, M, K, w->rot, rotated, threads);
        x = rotated;
        ldx = K;
    }
    if (w->act_scale > 0.0f) { /* static: round(x / s) clamped to +-127 (methods._int8_activations), s for every row;
                                * clamped first, the same codes for integer bounds, and round_even stays in range */
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t k = 0; k < K; ++k) {
                float v = x[m * ldx + k] / w->act_scale;
                v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
                xq[m * K + k] = (int8_t)loom_round_even(v);
            }
            for (int64_t b = 0; b < nb; ++b) xs[m * nb + b] = w->act_scale, xsum[m * nb + b] = 0.0f;
        }
    } else {
        loom_quantize_act(x, ldx, 0, M, K, 1, xq, xs, xsum, threads);
    }
    a->xq = xq, a->xs = xs, a->xsum = xsum, a->per_channel = 1;
    for (const LoomPacked *p = w; p; p = p->next) a->per_channel &= p->group == K && !p->mins;
    return scratch;
}

/* y [M, N of all parts] = x W^T, part after part (the same kernel calls as the per-layer path's, whose
 * outputs it concatenates). At M > 1 a part's rows are not contiguous in y: computed apart, then copied. */
static int gemm(const LoomPacked *w, const void *x, int64_t ldx, int64_t M, void *y, int bf16, int threads) {
    Int8Act act = {0};
    char *act_scratch = NULL;
    if (w->kind == 3 && !(act_scratch = int8_activations(w, (const float *)x, ldx, M, threads, &act))) return -1;
    int rc = 0;
    if (!w->next) {
        rc = gemm_part(w, x, ldx, M, y, bf16, threads, &act);
        free(act_scratch);
        return rc;
    }
    const size_t es = bf16 ? 2 : 4;
    int64_t total = 0, widest = 0;
    for (const LoomPacked *p = w; p; p = p->next) {
        total += p->n;
        widest = p->n > widest ? p->n : widest;
    }
    char *tmp = M > 1 ? (char *)loom_alloc64((size_t)(M * widest) * es) : NULL;
    if (M > 1 && !tmp) rc = -1;
    int64_t off = 0;
    for (const LoomPacked *p = w; p && !rc; p = p->next) {
        void *dst = M > 1 ? (void *)tmp : (void *)((char *)y + (size_t)off * es);
        rc = gemm_part(p, x, ldx, M, dst, bf16, threads, &act);
        for (int64_t m = 0; !rc && M > 1 && m < M; ++m)
            memcpy((char *)y + (size_t)(m * total + off) * es, tmp + (size_t)(m * p->n) * es, (size_t)p->n * es);
        off += p->n;
    }
    free(tmp);
    free(act_scratch);
    return rc;
}

/* float32 -> bfloat16 rounded toward +inf (bf16_up) or -inf (bf16_down): truncation moves toward zero, so an
 * inexact value moves one step away from zero on the side it rounds to (loom/attention/sparse.py's
 * bf16_round_up / bf16_round_down, bit for bit). */
static inline uint16_t bf16_up(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u >> 16) + ((u & 0xFFFFu) && !(u >> 31)));
}
static inline uint16_t bf16_down(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u >> 16) + ((u & 0xFFFFu) && (u >> 31)));
}

/* Fold the key rows just written (k [B, Hkv, D] model dtype, at slots) into their blocks' summaries (bfloat16,
 * the max rounded up and the min down): a block whose first row is written starts over (and becomes valid);
 * other rows widen its max / min. */
static void update_summaries(const LoomDims *d, const LoomLayer *L, const void *k, const int64_t *slots, int64_t B) {
    const int64_t D = d->head_dim, Hkv = d->kv_heads, bs = d->block_size, nb = d->num_blocks;
    const uint16_t minus_inf = 0xFF80u, plus_inf = 0x7F80u;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t slot = slots[b];
        if (slot < 0) continue;
        const int64_t block = slot / bs, off = slot - block * bs;
        for (int64_t hk = 0; hk < Hkv; ++hk) {
            uint16_t *mx = L->summaries + ((hk * nb + block) * 2) * D, *mn = mx + D;
            if (off == 0)
                for (int64_t i = 0; i < D; ++i) mx[i] = minus_inf, mn[i] = plus_inf;
            for (int64_t i = 0; i < D; ++i) {
                const int64_t at = (b * Hkv + hk) * D + i;
                const float v = d->is_bf16 ? loom_bf16_to_f32(((const uint16_t *)k)[at]) : ((const float *)k)[at];
                if (v > loom_bf16_to_f32(mx[i])) mx[i] = bf16_up(v);
                if (v < loom_bf16_to_f32(mn[i])) mn[i] = bf16_down(v);
            }
        }
        if (off == 0) L->summary_valid[block] = 1;
    }
}

typedef struct { float score; int64_t pos; } ScoredBlock;

/* Whether block x ranks below block y: a lower score, or the same score and the newer position (a strict total
 * order, so the top k are one set however they are found). */
static inline int ranks_below(const ScoredBlock *x, const ScoredBlock *y) {
    return x->score < y->score || (x->score == y->score && x->pos > y->pos);
}

/* heap[0..n) is a min-heap by rank (its root the lowest-ranked block): move heap[at] down to its place. */
static void sift_down(ScoredBlock *heap, int64_t n, int64_t at) {
    const ScoredBlock item = heap[at];
    for (int64_t child; (child = 2 * at + 1) < n; at = child) {
        if (child + 1 < n && ranks_below(&heap[child + 1], &heap[child])) ++child;
        if (!ranks_below(&heap[child], &item)) break;
        heap[at] = heap[child];
    }
    heap[at] = item;
}

/* Keep in heap[0..k) the k highest-ranked of the n blocks streamed through `top_k_push` (n log k, where sorting
 * all n took n log n: at 8k tokens 500 blocks per request and layer, k = 16). Returns the heap's new size. */
static int64_t top_k_push(ScoredBlock *heap, int64_t size, int64_t k, ScoredBlock item) {
    if (k <= 0) return size;
    if (size < k) { /* sift up */
        int64_t at = size;
        for (; at > 0 && ranks_below(&item, &heap[(at - 1) / 2]); at = (at - 1) / 2) heap[at] = heap[(at - 1) / 2];
        heap[at] = item;
        return size + 1;
    }
    if (ranks_below(&heap[0], &item)) { heap[0] = item; sift_down(heap, size, 0); }
    return size;
}

/* Each request's selected blocks in position order into sel [B, width] (width = sink + recent + topk) and their
 * key counts into sel_lens [B]: every block when the context has at most width blocks, else its sink and recent
 * blocks and the topk others of the largest bound (the max over query heads). Scratch: scored [topk] (a heap),
 * chosen [max blocks], qpm [2 Hq D] float32 (a query's positive and negative parts).
 * Returns 0, or -1 when a needed summary is stale (the caller refreshes every layer's summaries, reruns the step). */
static int select_blocks(const LoomDims *d, const LoomLayer *L, const void *q, const int64_t *table, int64_t stride,
                         const int64_t *seq_lens, int64_t B, int64_t *sel, int64_t *sel_lens, ScoredBlock *scored,
                         unsigned char *chosen, float *qpm) {
    const int64_t D = d->head_dim, Hq = d->heads, Hkv = d->kv_heads, bs = d->block_size, nb_cache = d->num_blocks;
    const int64_t sink = d->sparse_sink, recent = d->sparse_recent, width = sink + recent + d->sparse_topk;
    const int64_t group = Hq / Hkv;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t *row = table + b * stride;
        const int64_t nb = (seq_lens[b] + bs - 1) / bs;
        int64_t *out = sel + b * width;
        if (nb <= width) {
            for (int64_t j = 0; j < width; ++j) out[j] = row[j < nb ? j : nb - 1];
            sel_lens[b] = seq_lens[b];
            continue;
        }
        /* max(q m, q M) = max(q, 0) M + min(q, 0) m for m <= M: two branch-free dot products per head */
        float *qp = qpm, *qm = qpm + Hq * D;
        for (int64_t i = 0; i < Hq * D; ++i) {
            const int64_t at = b * Hq * D + i;
            const float v = d->is_bf16 ? loom_bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at];
            qp[i] = v > 0.0f ? v : 0.0f;
            qm[i] = v < 0.0f ? v : 0.0f;
        }
        int64_t n = 0;
        for (int64_t j = sink; j < nb - recent; ++j) {
            const int64_t block = row[j];
            if (!L->summary_valid[block]) return -1;
            float best = -INFINITY;
            for (int64_t h = 0; h < Hq; ++h) {
                const uint16_t *mx = L->summaries + (((h / group) * nb_cache + block) * 2) * D, *mn = mx + D;
                const float *hp = qp + h * D, *hm = qm + h * D;
                float lane[16] = {0}; /* 16 partial sums, so that the loop vectorizes without reordering */
                int64_t i = 0;
                for (; i + 16 <= D; i += 16)
                    for (int t = 0; t < 16; ++t)
                        lane[t] += hp[i + t] * loom_bf16_to_f32(mx[i + t]) + hm[i + t] * loom_bf16_to_f32(mn[i + t]);
                float acc = 0.0f;
                for (; i < D; ++i) acc += hp[i] * loom_bf16_to_f32(mx[i]) + hm[i] * loom_bf16_to_f32(mn[i]);
                for (int t = 0; t < 16; ++t) acc += lane[t];
                best = acc > best ? acc : best;
            }
            n = top_k_push(scored, n, d->sparse_topk, (ScoredBlock){best, j});
        }
        memset(chosen, 0, (size_t)nb);
        for (int64_t i = 0; i < n; ++i) chosen[scored[i].pos] = 1;
        int64_t m = 0;
        for (int64_t j = 0; j < nb; ++j)
            if (j < sink || j >= nb - recent || chosen[j]) out[m++] = row[j];
        sel_lens[b] = seq_lens[b] - (nb - width) * bs; /* the partial last block is among the recent ones */
    }
    return 0;
}

/*
 * hidden [B, hidden] (the embedding rows, read only); cos / signed_sin float32 [B, D] (cos_local / signed_sin_local:
 * the tables of layers with local_rope, or NULL when none has it); slot_mapping int64 [B];
 * block_table int64 [B, bt_stride]; seq_lens int64 [B] (>= 1); out [B, hidden]: the final-norm hidden states.
 * Scratch (model dtype): residual, normed, h [B, hidden]; qkv [B, (Hq + 2 Hkv) D]; q [B, Hq, D];
 * k [B, Hkv, D]; attn [B, Hq D]; gate_up [B, 2 inter]; act [B, inter].
 */
int loom_decode_step(const LoomDims *d, const LoomLayer *layers, const void *final_norm, const void *hidden,
                     const float *cos, const float *signed_sin, const int64_t *slot_mapping,
                     const int64_t *block_table, int64_t bt_stride, const int64_t *seq_lens, int64_t B, void *out,
                     void *residual, void *normed, void *h, void *qkv, void *q, void *k, void *attn, void *gate_up,
                     void *act, int64_t torch_chunk, const float *cos_local, const float *signed_sin_local) {
    const int bf16 = d->is_bf16, threads = d->num_threads, lanes = d->torch_lanes;
    const size_t es = bf16 ? 2 : 4;
    const int kv = d->kv_type;
    const int64_t H = d->hidden, D = d->head_dim, Hq = d->heads, Hkv = d->kv_heads;
    const int64_t qkv_width = (Hq + 2 * Hkv) * D, row = Hkv * D;
    /* bytes of one (token, KV head) cache row, and of a token slot (all KV heads) */
    const int cache_kv = kv ? kv : bf16; /* paged_decode's kv_type of these caches */
    const int64_t hrow = loom_kv_row_bytes(D, cache_kv), slot_bytes = Hkv * hrow;
    /* QK-norm scratch: the normed q and k heads of every row, [B, (Hq + Hkv) D] */
    char *qkn = NULL;
    for (int64_t l = 0; l < d->num_layers && !qkn; ++l)
        if (layers[l].q_norm && !(qkn = (char *)loom_alloc64((size_t)(B * (Hq + Hkv) * D) * es))) return -1;
    /* block-sparse decode scratch: each request's selected blocks and key counts, the scored blocks */
    int64_t *sel = NULL, *sel_lens = NULL, max_nb = 1;
    ScoredBlock *scored = NULL;
    unsigned char *chosen = NULL;
    float *qpm = NULL;
    const int64_t width = d->sparse_sink + d->sparse_recent + d->sparse_topk;
    if (layers[0].summaries) {
        for (int64_t b = 0; b < B; ++b) max_nb = (seq_lens[b] + d->block_size - 1) / d->block_size > max_nb
                                                     ? (seq_lens[b] + d->block_size - 1) / d->block_size : max_nb;
        sel = (int64_t *)malloc((size_t)(B * width) * sizeof(int64_t));
        sel_lens = (int64_t *)malloc((size_t)B * sizeof(int64_t));
        scored = (ScoredBlock *)malloc((size_t)d->sparse_topk * sizeof(ScoredBlock));
        chosen = (unsigned char *)malloc((size_t)max_nb);
        qpm = (float *)loom_alloc64((size_t)(2 * Hq * D) * sizeof(float));
        if (!sel || !sel_lens || !scored || !chosen || !qpm) goto fail;
    }
    for (int64_t l = 0; l < d->num_layers; ++l) {
        const LoomLayer *L = &layers[l];
        if (l == 0) {
            memcpy(residual, hidden, (size_t)(B * H) * es);
            loom_add_rmsnorm(hidden, NULL, L->norm1, normed, NULL, B, H, d->eps, bf16);
        } else {
            loom_add_rmsnorm(h, residual, L->norm1, normed, residual, B, H, d->eps, bf16);
        }
        if (gemm(&L->qkv, normed, H, B, qkv, bf16, threads)) goto fail;
        const char *qsrc = (const char *)qkv, *ksrc = (const char *)qkv + (size_t)(Hq * D) * es;
        int64_t qstride = qkv_width, kstride = qkv_width;
        if (L->q_norm) { /* every head of a row is D contiguous values: Hq (Hkv) rows of D per token */
            char *qn = qkn, *kn = qkn + (size_t)(B * Hq * D) * es;
            for (int64_t b = 0; b < B; ++b) {
                loom_add_rmsnorm(qsrc + (size_t)(b * qkv_width) * es, NULL, L->q_norm, qn + (size_t)(b * Hq * D) * es,
                                 NULL, Hq, D, d->eps, bf16);
                loom_add_rmsnorm(ksrc + (size_t)(b * qkv_width) * es, NULL, L->k_norm, kn + (size_t)(b * Hkv * D) * es,
                                 NULL, Hkv, D, d->eps, bf16);
            }
            qsrc = qn, ksrc = kn, qstride = Hq * D, kstride = Hkv * D;
        }
        const float *c = L->local_rope ? cos_local : cos, *sn = L->local_rope ? signed_sin_local : signed_sin;
        loom_rotary(qsrc, qstride, c, sn, q, B, Hq, D, bf16);
        loom_rotary(ksrc, kstride, c, sn, k, B, Hkv, D, bf16);
        const int64_t *slots = L->slot_mapping ? L->slot_mapping : slot_mapping;
        const int64_t *table = L->block_table ? L->block_table : block_table;
        const int64_t table_stride = L->block_table ? L->bt_stride : bt_stride;
        for (int64_t b = 0; b < B; ++b) {
            const int64_t slot = slots[b];
            if (slot < 0) continue;
            unsigned char *kd = (unsigned char *)L->k_cache + slot * slot_bytes;
            unsigned char *vd = (unsigned char *)L->v_cache + slot * slot_bytes;
            const char *ks = (const char *)k + (size_t)(b * row) * es;
            const char *vs = (const char *)qkv + (size_t)(b * qkv_width + (Hq + Hkv) * D) * es;
            if (kv == 3) {
                for (int64_t hk = 0; hk < Hkv; ++hk) {
                    quantize_row_i8(kd + hk * hrow, ks + (size_t)(hk * D) * es, D, bf16);
                    quantize_row_i8(vd + hk * hrow, vs + (size_t)(hk * D) * es, D, bf16);
                }
            } else {
                store_kv(kd, ks, row, bf16, kv);
                store_kv(vd, vs, row, bf16, kv);
            }
        }
        const int64_t *read_table = table, *read_lens = seq_lens;
        int64_t read_stride = table_stride;
        if (L->summaries) {
            update_summaries(d, L, k, slots, B);
            if (select_blocks(d, L, q, table, table_stride, seq_lens, B, sel, sel_lens, scored, chosen, qpm)) {
                free(qkn), free(sel), free(sel_lens), free(scored), free(chosen), free(qpm);
                return -2; /* a stale summary: the caller refreshes and reruns the step (idempotent) */
            }
            read_table = sel, read_lens = sel_lens, read_stride = width;
        }
        if (loom_paged_decode(q, L->k_cache, L->v_cache, read_table, read_stride, read_lens, attn, B, Hq, Hkv, D,
                              d->block_size, d->scale, L->window, threads, bf16, cache_kv))
            goto fail;
        if (gemm(&L->o, attn, Hq * D, B, h, bf16, threads)) goto fail;
        /* in place: the norm reads a row's sum of squares before it writes the row, element by element */
        if (L->post_attn_norm) loom_add_rmsnorm(h, NULL, L->post_attn_norm, h, NULL, B, H, d->eps, bf16);
        loom_add_rmsnorm(h, residual, L->norm2, normed, residual, B, H, d->eps, bf16);
        if (gemm(&L->gate_up, normed, H, B, gate_up, bf16, threads)) goto fail;
        if (d->act == 1)
            loom_gelu_tanh_mul(gate_up, act, B, d->inter, bf16);
        else
            loom_silu_mul(gate_up, act, B, d->inter, bf16, lanes, torch_chunk);
        if (gemm(&L->down, act, d->inter, B, h, bf16, threads)) goto fail;
        if (L->post_ffw_norm) loom_add_rmsnorm(h, NULL, L->post_ffw_norm, h, NULL, B, H, d->eps, bf16);
    }
    free(qkn), free(sel), free(sel_lens), free(scored), free(chosen), free(qpm);
    loom_add_rmsnorm(h, residual, final_norm, out, residual, B, H, d->eps, bf16);
    return 0;
fail: /* a kernel could not allocate its scratch */
    free(qkn), free(sel), free(sel_lens), free(scored), free(chosen), free(qpm);
    return -1;
}
