/*
 * The compute roofline of this CPU for the instructions loom's kernels are built on: how many per second one core
 * and all cores retire when nothing else limits them (12 independent accumulators, operands in registers).
 *
 *   gcc -O2 -fopenmp -mavx2 -mfma -mavx512f -mavx512bw -mavx512vl -mavx512vnni benchmarks/isa_peak.c -o /tmp/isa_peak
 *   /tmp/isa_peak            (AVX-512 VNNI CPUs; on AVX2-only CPUs build with -DAVX2_ONLY and only -mavx2 -mfma)
 *
 * Prints, per instruction: G instructions/s on one thread, on every OpenMP thread together, and the multiply-adds
 * per second that makes (VPDPWSSD: 2 int16 products per 32-bit lane; VPDPBUSD: 4 int8 ones; VPMADDWD: 2, with no
 * accumulate; FMA: 1 per float lane), plus the latency of one dependent chain.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERS 20000000L
#define ACC 12

/* one thread's instructions per second for BODY over ACC accumulators of TYPE, each its own variable (an array
 * would be kept in memory, and store-to-load forwarding would then bound the loop instead of the instruction) */
#define STEP12(BODY)                                                                                           \
    a0 = BODY(a0, w, x); a1 = BODY(a1, w, x); a2 = BODY(a2, w, x); a3 = BODY(a3, w, x);                       \
    a4 = BODY(a4, w, x); a5 = BODY(a5, w, x); a6 = BODY(a6, w, x); a7 = BODY(a7, w, x);                       \
    a8 = BODY(a8, w, x); a9 = BODY(a9, w, x); a10 = BODY(a10, w, x); a11 = BODY(a11, w, x);
#define RATE(NAME, TYPE, INIT, BODY, FOLD)                                                                     \
    static double NAME(void) {                                                                                 \
        TYPE a0 = INIT(1), a1 = INIT(2), a2 = INIT(3), a3 = INIT(4), a4 = INIT(5), a5 = INIT(6);               \
        TYPE a6 = INIT(7), a7 = INIT(8), a8 = INIT(9), a9 = INIT(10), a10 = INIT(11), a11 = INIT(12);          \
        TYPE w = INIT(3), x = INIT(5);                                                                         \
        double t0 = now();                                                                                     \
        for (long n = 0; n < ITERS; ++n) {                                                                     \
            STEP12(BODY)                                                                                       \
            __asm__ volatile("" ::: "memory");                                                                 \
        }                                                                                                      \
        double t = now() - t0;                                                                                 \
        volatile float sink = FOLD(a0) + FOLD(a1) + FOLD(a2) + FOLD(a3) + FOLD(a4) + FOLD(a5) + FOLD(a6) +    \
                              FOLD(a7) + FOLD(a8) + FOLD(a9) + FOLD(a10) + FOLD(a11);                         \
        (void)sink;                                                                                            \
        return ITERS * ACC / t;                                                                                \
    }

/* accumulate in place by inline assembly: with intrinsics GCC copies each accumulator every iteration */
#define ASM_ACC(INSN)                                                                                          \
    ({                                                                                                         \
        __typeof__(a) r_ = a;                                                                                  \
        __asm__(INSN " %2, %1, %0" : "+v"(r_) : "v"(w), "v"(x));                                             \
        r_;                                                                                                    \
    })

static float fold256i(__m256i v) { return (float)_mm256_extract_epi32(v, 0); }
static float fold256f(__m256 v) { return _mm256_cvtss_f32(v); }
static inline __m256 fma256(__m256 a, __m256 w, __m256 x) { return ASM_ACC("vfmadd231ps"); }
static inline __m256i maddwd256(__m256i a, __m256i w, __m256i x) {
    __m256i p;
    __asm__ volatile("vpmaddwd %2, %1, %0" : "=v"(p) : "v"(w), "v"(x)); /* volatile: not hoisted */
    __asm__("vpaddd %1, %0, %0" : "+v"(a) : "v"(p));
    return a;
}
RATE(rate_fma256, __m256, _mm256_set1_ps, fma256, fold256f)
RATE(rate_maddwd256, __m256i, _mm256_set1_epi32, maddwd256, fold256i)
#ifndef AVX2_ONLY
static float fold512i(__m512i v) { return (float)_mm512_reduce_add_epi32(v); }
static float fold512f(__m512 v) { return _mm512_reduce_add_ps(v); }
static inline __m512 fma512(__m512 a, __m512 w, __m512 x) { return ASM_ACC("vfmadd231ps"); }
static inline __m512i dpwssd512(__m512i a, __m512i w, __m512i x) { return ASM_ACC("vpdpwssd"); }
static inline __m512i dpbusd512(__m512i a, __m512i w, __m512i x) { return ASM_ACC("vpdpbusd"); }
static inline __m256i dpwssd256(__m256i a, __m256i w, __m256i x) { return ASM_ACC("vpdpwssd"); }
RATE(rate_dpwssd512, __m512i, _mm512_set1_epi32, dpwssd512, fold512i)
RATE(rate_dpbusd512, __m512i, _mm512_set1_epi32, dpbusd512, fold512i)
RATE(rate_dpwssd256, __m256i, _mm256_set1_epi32, dpwssd256, fold256i)
RATE(rate_fma512, __m512, _mm512_set1_ps, fma512, fold512f)
#endif

static void report(const char *name, double (*rate)(void), int products) {
    double one = rate(), all = 0;
#pragma omp parallel reduction(+ : all)
    all += rate();
    printf("%-22s 1 thread %6.3f G/s   %d threads %6.3f G/s = %7.1f G multiply-adds/s\n", name, one / 1e9,
           omp_get_max_threads(), all / 1e9, all * products / 1e9);
}

/* the core clock, from a chain of dependent 64-bit adds (one cycle each on every x86 core since the P6) */
static double clock_ghz(void) {
    long v = 0;
    const long n = 400000000L;
    double t0 = now();
    for (long i = 0; i < n; i += 8)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                         "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
                         : "+r"(v));
    return n / (now() - t0) / 1e9 * (v == n ? 1.0 : 0.0);
}

int main(void) {
    printf("clock (dependent adds): %.2f GHz\n", clock_ghz());
#ifndef AVX2_ONLY
    report("vpdpwssd zmm (int16)", rate_dpwssd512, 32);
    report("vpdpbusd zmm (int8)", rate_dpbusd512, 64);
    report("vpdpwssd ymm (int16)", rate_dpwssd256, 16);
    report("vfmadd zmm (float32)", rate_fma512, 16);
    __m512i c = _mm512_set1_epi32(1), w = _mm512_set1_epi32(3), x = _mm512_set1_epi32(5);
    double t0 = now();
    for (long n = 0; n < ITERS; ++n) {
        c = _mm512_dpwssd_epi32(c, w, x);
        __asm__ volatile("" : "+v"(w));
    }
    printf("vpdpwssd zmm dependent chain: %.3f ns per instruction (%d)\n", (now() - t0) / ITERS * 1e9,
           _mm512_reduce_add_epi32(c));
#endif
    report("vpmaddwd+vpaddd ymm", rate_maddwd256, 16);
    report("vfmadd ymm (float32)", rate_fma256, 8);
    return 0;
}
