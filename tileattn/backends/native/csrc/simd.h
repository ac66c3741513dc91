/* The instruction-set layer: one vector type of `real` lanes and the few operations the kernels use.
 *
 * The kernels are written once against this header and compiled twice: with TA_REAL_BITS=32
 * (fp32 arithmetic, serving fp32, bf16 and fp16 inputs) and TA_REAL_BITS=64 (fp64). build.py
 * defines exactly one ISA:
 *
 *   TA_ISA_AVX512   64-byte vectors (16 fp32 lanes), needs AVX-512 F/BW/VL and FMA
 *   TA_ISA_AVX2     32-byte vectors (8 fp32 lanes), needs AVX2 and FMA
 *   TA_ISA_NEON     16-byte vectors (4 fp32 lanes, one register each), aarch64 Advanced SIMD; with
 *                   the bf16 extension the bf16 dot-product tiles (gemm_bf16.h: BFDOT)
 *   TA_ISA_GENERIC  GCC/clang vector extensions only, 32-byte vectors where the target has AVX or
 *                   NEON's 32 registers (one AVX register, two NEON registers per vector), 16 bytes
 *                   elsewhere (SSE2 without AVX, ...); FMAs wherever the compiler contracts a*b+c
 *
 * Vectors are GCC vector-extension types, so plain arithmetic (+ - * /, comparisons, shifts) works
 * on them everywhere and compiles to the ISA's instructions; only the operations without an
 * operator (broadcast, FMA, max, min, the widening loads of narrow formats, the transposing sum,
 * the byte scan) go through intrinsics where the ISA has them. This header and the matrix-unit
 * headers (amx.h, gemm_bf16.h) are the only files that name an intrinsic or an ISA: the kernels
 * speak the vocabulary below. Each ISA branch defines
 *
 *   TA_VBYTES   bytes per vector
 *   TA_MR       rows of the micro-GEMM's register block (gemm.h): 2 TA_MR accumulators, two B
 *               vectors and a broadcast must fit the register file
 *   TA_ISA_NAME the variant's name, as build.py spells it
 *
 * and the CPU features it was compiled for (TA_CPU_FEATURES, the names of Linux's /proc/cpuinfo).
 */
#ifndef TA_SIMD_H
#define TA_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(TA_ISA_AVX512) + defined(TA_ISA_AVX2) + defined(TA_ISA_NEON) + defined(TA_ISA_GENERIC)) != 1
#error "define exactly one of TA_ISA_AVX512, TA_ISA_AVX2, TA_ISA_NEON, TA_ISA_GENERIC"
#endif

#if defined(TA_ISA_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__FMA__)
#error "TA_ISA_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mfma (or -march=native on such a CPU)"
#endif
#include <immintrin.h>
#define TA_VBYTES 64
#define TA_MR 12
#define TA_ISA_NAME "avx512"
#elif defined(TA_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "TA_ISA_AVX2 needs -mavx2 -mfma (or -march=native on such a CPU)"
#endif
#include <immintrin.h>
#define TA_VBYTES 32
#define TA_MR 6
#define TA_ISA_NAME "avx2"
#elif defined(TA_ISA_NEON)
#if !defined(__aarch64__) || !defined(__ARM_NEON)
#error "TA_ISA_NEON needs an aarch64 target"
#endif
#include <arm_neon.h>
/* one register a vector: 12 x 2 accumulators, two B vectors and the broadcasts fit NEON's 32 */
#define TA_VBYTES 16
#define TA_MR 12
#define TA_ISA_NAME "neon"
#elif defined(__AVX__) || defined(__aarch64__)
#define TA_VBYTES 32
#define TA_MR 6
#define TA_ISA_NAME "generic"
#else
#define TA_VBYTES 16
#define TA_MR 6
#define TA_ISA_NAME "generic"
#endif

#ifndef TA_REAL_BITS
#error "define TA_REAL_BITS (32 or 64)"
#endif

#if TA_REAL_BITS == 64
typedef double real;
typedef int64_t ireal; /* an integer as wide as real: lane masks and exponent bits */
typedef uint64_t uireal;
#define REAL_SUFFIX f64
#define TA_REAL_BYTES 8
#define REAL_MANT 52
#define REAL_BIAS 1023
#define REAL_ROUND_MAGIC 6755399441055744.0 /* 1.5 * 2^52 */
#else
typedef float real;
typedef int32_t ireal;
typedef uint32_t uireal;
#define REAL_SUFFIX f32
#define TA_REAL_BYTES 4
#define REAL_MANT 23
#define REAL_BIAS 127
#define REAL_ROUND_MAGIC 12582912.0f /* 1.5 * 2^23 */
#endif

/* Name a function once per real type: FN(forward) -> ta_forward_f32 / ta_forward_f64. */
#define TA_CAT3(a, b, c) a##b##c
#define TA_XCAT3(a, b, c) TA_CAT3(a, b, c)
#define FN(name) TA_XCAT3(ta_##name, _, REAL_SUFFIX)

#define VW ((int)(TA_VBYTES / sizeof(real)))
typedef real vr __attribute__((vector_size(TA_VBYTES)));
typedef ireal vi __attribute__((vector_size(TA_VBYTES)));
typedef uireal vui __attribute__((vector_size(TA_VBYTES)));
/* Unaligned, aliasing-safe view for loads and stores through any real pointer. */
typedef real vr_mem __attribute__((vector_size(TA_VBYTES), aligned(sizeof(real)), may_alias));
/* 32-bit lanes, one per real lane: band limits and the dropout hash. */
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
typedef int32_t vs32 __attribute__((vector_size(VW * 4)));
typedef int32_t vs32_mem __attribute__((vector_size(VW * 4), aligned(4), may_alias));

#define TA_INLINE static inline __attribute__((always_inline))

TA_INLINE vr vload(const real *p) { return *(const vr_mem *)p; }
TA_INLINE void vstore(real *p, vr x) { *(vr_mem *)p = x; }
TA_INLINE vr vzero(void) { return (vr){0}; }
TA_INLINE vr vbits(vi x) {
    vr r;
    memcpy(&r, &x, sizeof r);
    return r;
}
TA_INLINE vi vibits(vr x) {
    vi r;
    memcpy(&r, &x, sizeof r);
    return r;
}
/* mask lanes are all-ones or zero (the result of a vector comparison) */
TA_INLINE vr vselect(vi mask, vr a, vr b) { return vbits((mask & vibits(a)) | (~mask & vibits(b))); }
/* a 32-bit lane mask widened (fp64) or reinterpreted (fp32) as a mask of real lanes */
TA_INLINE vi vmask32(vs32 m) { return __builtin_convertvector(m, vi); }

#if defined(TA_ISA_AVX512) && TA_REAL_BITS == 32
TA_INLINE vr vset1(real x) { return _mm512_set1_ps(x); }
TA_INLINE vr vfma(vr a, vr b, vr c) { return _mm512_fmadd_ps(a, b, c); }
TA_INLINE vr vmax_(vr a, vr b) { return _mm512_max_ps(a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return _mm512_min_ps(a, b); }
#elif defined(TA_ISA_AVX512)
TA_INLINE vr vset1(real x) { return _mm512_set1_pd(x); }
TA_INLINE vr vfma(vr a, vr b, vr c) { return _mm512_fmadd_pd(a, b, c); }
TA_INLINE vr vmax_(vr a, vr b) { return _mm512_max_pd(a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return _mm512_min_pd(a, b); }
#elif defined(TA_ISA_AVX2) && TA_REAL_BITS == 32
TA_INLINE vr vset1(real x) { return _mm256_set1_ps(x); }
TA_INLINE vr vfma(vr a, vr b, vr c) { return _mm256_fmadd_ps(a, b, c); }
TA_INLINE vr vmax_(vr a, vr b) { return _mm256_max_ps(a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return _mm256_min_ps(a, b); }
#elif defined(TA_ISA_AVX2)
TA_INLINE vr vset1(real x) { return _mm256_set1_pd(x); }
TA_INLINE vr vfma(vr a, vr b, vr c) { return _mm256_fmadd_pd(a, b, c); }
TA_INLINE vr vmax_(vr a, vr b) { return _mm256_max_pd(a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return _mm256_min_pd(a, b); }
#elif defined(TA_ISA_NEON) && TA_REAL_BITS == 32
/* max and min as the x86 instructions compute them (the second operand when either is NaN), which
 * FMAX/FMIN do not (a NaN in either operand wins): the kernels' NaN propagation is that form's */
TA_INLINE vr vset1(real x) { return vdupq_n_f32(x); }
TA_INLINE vr vfma(vr a, vr b, vr c) { return vfmaq_f32(c, a, b); }
TA_INLINE vr vmax_(vr a, vr b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
#elif defined(TA_ISA_NEON)
TA_INLINE vr vset1(real x) { return vdupq_n_f64(x); }
TA_INLINE vr vfma(vr a, vr b, vr c) { return vfmaq_f64(c, a, b); }
TA_INLINE vr vmax_(vr a, vr b) { return vbslq_f64(vcgtq_f64(a, b), a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return vbslq_f64(vcltq_f64(a, b), a, b); }
#else
/* a one-source shuffle of lane 0 is what compilers turn into a broadcast (a loop over the lanes
 * became a chain of lane inserts) */
#define TA_LANE0_2 0, 0
#define TA_LANE0_4 TA_LANE0_2, TA_LANE0_2
#define TA_LANE0_8 TA_LANE0_4, TA_LANE0_4
#define TA_LANE0_16 TA_LANE0_8, TA_LANE0_8
#define TA_LANE0_N(n) TA_LANE0_##n
#define TA_LANE0(n) TA_LANE0_N(n)
#define TA_VW_LITERAL_32_4 8
#define TA_VW_LITERAL_32_8 4
#define TA_VW_LITERAL_16_4 4
#define TA_VW_LITERAL_16_8 2
#define TA_VW_LIT_(b, r) TA_VW_LITERAL_##b##_##r
#define TA_VW_LIT(b, r) TA_VW_LIT_(b, r)
TA_INLINE vr vset1(real x) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
    vr r = {x};
    return __builtin_shufflevector(r, r, TA_LANE0(TA_VW_LIT(TA_VBYTES, TA_REAL_BYTES)));
#define TA_VSET1_DONE
#endif
#endif
#ifndef TA_VSET1_DONE
    vr r;
    for (int i = 0; i < VW; i++) r[i] = x;
    return r;
#endif
}
/* Whether this contracts to one fused instruction depends on the target; the kernels never rely
 * on it, only on computing the same expression the same way in the forward and backward passes. */
TA_INLINE vr vfma(vr a, vr b, vr c) { return a * b + c; }
/* as the x86 instructions: the second operand when either is NaN */
TA_INLINE vr vmax_(vr a, vr b) { return vselect(a > b, a, b); }
TA_INLINE vr vmin_(vr a, vr b) { return vselect(a < b, a, b); }
#endif

/* max/min that return x when x is NaN, so a NaN score or input reaches the output as it does in
 * the reference. */
TA_INLINE vr vmax_keepnan(vr x, vr bound) { return vmax_(bound, x); }
TA_INLINE vr vmin_keepnan(vr x, vr bound) { return vmin_(bound, x); }

/* Transpose a VW x VW block held in VW vectors: x[i][j] <-> x[j][i]. log2(VW) butterfly stages; stage h
 * swaps the off-diagonal h x h blocks of each pair of rows (i, i + h), one two-source shuffle per
 * row (vpermt2ps, vunpck*, ... whatever the ISA has). The query-side packing and the writing of
 * out/dQ use it instead of one scalar store per element. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define TA_HAVE_SHUFFLE 1
#endif
#endif
#ifdef TA_HAVE_SHUFFLE
#define TA_TSTAGE(h)                                                                             \
    _Pragma("GCC unroll 16") for (int i = 0; i < VW; i++)                                        \
        if (!(i & (h))) {                                                                        \
            vr a_ = x[i], b_ = x[i + (h)];                                                       \
            TA_TPAIR_##h                                                                         \
        }
#if TA_VBYTES / TA_REAL_BYTES == 2
#define TA_TPAIR_1 x[i] = __builtin_shufflevector(a_, b_, 0, 2); \
    x[i + 1] = __builtin_shufflevector(a_, b_, 1, 3);
#define TA_TSTAGES TA_TSTAGE(1)
#elif TA_VBYTES / TA_REAL_BYTES == 4
#define TA_TPAIR_1 x[i] = __builtin_shufflevector(a_, b_, 0, 4, 2, 6); \
    x[i + 1] = __builtin_shufflevector(a_, b_, 1, 5, 3, 7);
#define TA_TPAIR_2 x[i] = __builtin_shufflevector(a_, b_, 0, 1, 4, 5); \
    x[i + 2] = __builtin_shufflevector(a_, b_, 2, 3, 6, 7);
#define TA_TSTAGES TA_TSTAGE(1) TA_TSTAGE(2)
#elif TA_VBYTES / TA_REAL_BYTES == 8
#define TA_TPAIR_1 x[i] = __builtin_shufflevector(a_, b_, 0, 8, 2, 10, 4, 12, 6, 14); \
    x[i + 1] = __builtin_shufflevector(a_, b_, 1, 9, 3, 11, 5, 13, 7, 15);
#define TA_TPAIR_2 x[i] = __builtin_shufflevector(a_, b_, 0, 1, 8, 9, 4, 5, 12, 13); \
    x[i + 2] = __builtin_shufflevector(a_, b_, 2, 3, 10, 11, 6, 7, 14, 15);
#define TA_TPAIR_4 x[i] = __builtin_shufflevector(a_, b_, 0, 1, 2, 3, 8, 9, 10, 11); \
    x[i + 4] = __builtin_shufflevector(a_, b_, 4, 5, 6, 7, 12, 13, 14, 15);
#define TA_TSTAGES TA_TSTAGE(1) TA_TSTAGE(2) TA_TSTAGE(4)
#elif TA_VBYTES / TA_REAL_BYTES == 16
#define TA_TPAIR_1 x[i] = __builtin_shufflevector(a_, b_, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30); \
    x[i + 1] = __builtin_shufflevector(a_, b_, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#define TA_TPAIR_2 x[i] = __builtin_shufflevector(a_, b_, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29); \
    x[i + 2] = __builtin_shufflevector(a_, b_, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
#define TA_TPAIR_4 x[i] = __builtin_shufflevector(a_, b_, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27); \
    x[i + 4] = __builtin_shufflevector(a_, b_, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
#define TA_TPAIR_8 x[i] = __builtin_shufflevector(a_, b_, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23); \
    x[i + 8] = __builtin_shufflevector(a_, b_, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#define TA_TSTAGES TA_TSTAGE(1) TA_TSTAGE(2) TA_TSTAGE(4) TA_TSTAGE(8)
#endif
TA_INLINE void vtranspose(vr x[VW]) { TA_TSTAGES }
#else
TA_INLINE void vtranspose(vr x[VW]) {
    for (int i = 0; i < VW; i++)
        for (int j = i + 1; j < VW; j++) {
            real t = x[i][j];
            x[i][j] = x[j][i];
            x[j][i] = t;
        }
}
#endif

TA_INLINE vr vabs(vr x) { return vbits(vibits(x) & ~vibits(vset1((real)-0.0))); }

TA_INLINE real vsum(vr x) {
    real s = 0;
    for (int i = 0; i < VW; i++) s += x[i];
    return s;
}

/* 2^x, accurate to ~1 ulp; NaN -> NaN, -inf -> 0, +inf -> +inf.
 *
 * x = n + f with n = round(x), |f| <= 1/2; 2^f by a polynomial (fp32: minimax, relative error
 * 1.9e-9; fp64: Taylor to degree 13, first omitted term 3e-17), then scaled by 2^n. Without
 * AVX-512 the rounding uses the 1.5*2^mant trick: after t = x + magic the low mantissa bits of t
 * hold n, so shifting t's bits left by the mantissa width yields 2^n's exponent bits directly.
 */
TA_INLINE vr vexp2_poly(vr f, const int lowp) {
#if TA_REAL_BITS == 64
    (void)lowp;
    static const double c[14] = {1.3691488853904124e-12, 2.5678435993488196e-11, 4.44553827187081e-10,
                                 7.054911620801121e-09,  1.0178086009239696e-07, 1.3215486790144305e-06,
                                 1.5252733804059838e-05, 0.00015403530393381606, 0.0013333558146428441,
                                 0.009618129107628477,   0.055504108664821576,   0.2402265069591007,
                                 0.6931471805599453,     1.0};
    vr p = vset1(c[0]);
    for (int k = 1; k < 14; k++) p = vfma(p, f, vset1(c[k]));
#else
    if (lowp) { /* degree 4, relative error 2.6e-6: for probabilities that are rounded to bf16 next */
        vr q = vset1(0.009570102207362652f);
        q = vfma(q, f, vset1(0.05591785907745361f));
        q = vfma(q, f, vset1(0.240247443318367f));
        q = vfma(q, f, vset1(0.6931217908859253f));
        return vfma(q, f, vset1(0.9999992847442627f));
    }
    vr p = vset1(0.00015350866257614953f);
    p = vfma(p, f, vset1(0.0013399974174552543f));
    p = vfma(p, f, vset1(0.009618470186087573f));
    p = vfma(p, f, vset1(0.05550328643246867f));
    p = vfma(p, f, vset1(0.24022647063769273f));
    p = vfma(p, f, vset1(0.6931472058202f));
    p = vfma(p, f, vset1(1.0000000005308562f));
#endif
    return p;
}

TA_INLINE vr vexp2_p(vr x, const int lowp) {
#if defined(TA_ISA_AVX512)
    /* AVX-512 rounds and scales by 2^n in one instruction each (vrndscale, vscalef; vscalef gives
     * inf above the range and NaN for NaN or +inf inputs, like exp). Lanes below 2^-(bias-1),
     * -inf included, are set to exactly 0 by the mask rather than computed: an underflowing
     * vscalef takes a microcode assist on Intel cores, which made masked (causal) tiles twice as
     * slow, and the mask also makes clamping the input unnecessary. */
#if TA_REAL_BITS == 64
    __mmask8 normal = _mm512_cmp_pd_mask(x, vset1((real)(1 - REAL_BIAS)), _CMP_NLT_UQ);
    vr n = _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_pd(normal, vexp2_poly(x - n, lowp), n);
#else
    __mmask16 normal = _mm512_cmp_ps_mask(x, vset1((real)(1 - REAL_BIAS)), _CMP_NLT_UQ);
    vr n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(normal, vexp2_poly(x - n, lowp), n);
#endif
#else
    x = vmax_keepnan(x, vset1((real)-REAL_BIAS));
    x = vmin_keepnan(x, vset1((real)(REAL_BIAS + 1)));
    vr t = x + REAL_ROUND_MAGIC;
    vr n = t - REAL_ROUND_MAGIC;
    /* unsigned lanes: the shift discards the magic's exponent bits (signed overflow would be UB) */
    vui e = ((vui)vibits(t) << REAL_MANT) + ((uireal)REAL_BIAS << REAL_MANT);
    return vexp2_poly(x - n, lowp) * vbits((vi)e);
#endif
}

TA_INLINE vr vexp2(vr x) { return vexp2_p(x, 0); }

/* tanh for the softcap. fp32: (1 - e)/(1 + e) with e = 2^(-2|x| log2 e), and the odd Taylor series
 * below |x| = 0.4 where that quotient cancels (first omitted term < 3e-10 relative). fp64: libm per
 * lane (the fp64 path is for correctness, not speed). */
TA_INLINE vr vtanh(vr x) {
#if TA_REAL_BITS == 64
    vr r;
    for (int i = 0; i < VW; i++) r[i] = tanh(x[i]);
    return r;
#else
    vr ax = vabs(x);
    vr e = vexp2(ax * (real)(-2.0 * 1.4426950408889634));
    vr far = (vset1(1) - e) / (vset1(1) + e);
    vr x2 = ax * ax;
    vr p = vset1(-929569.0f / 638512875.0f);
    p = vfma(p, x2, vset1(21844.0f / 6081075.0f));
    p = vfma(p, x2, vset1(-1382.0f / 155925.0f));
    p = vfma(p, x2, vset1(62.0f / 2835.0f));
    p = vfma(p, x2, vset1(-17.0f / 315.0f));
    p = vfma(p, x2, vset1(2.0f / 15.0f));
    p = vfma(p, x2, vset1(-1.0f / 3.0f));
    vr near = vfma(ax * x2, p, ax);
    vr t = vselect(ax < (real)0.4, near, far);
    return vbits(vibits(t) | (vibits(x) & vibits(vset1((real)-0.0)))); /* the sign of x */
#endif
}

/* ------------------------------------------------------------------------- sums across lanes */

/* out[t] = the sum of the lanes of v[t], t < VW: a transposing reduction tree (the decode kernel's
 * dot products, VW keys at a time). */
TA_INLINE vr vsums(const vr *v) {
#if defined(TA_ISA_AVX512) && TA_REAL_BITS == 32
    __m512 u[8], w[4], z[2];
    for (int k = 0; k < 8; k++)
        u[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; k++)
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(TA_ISA_AVX2) && TA_REAL_BITS == 32
    __m256 u[4], w[2];
    for (int k = 0; k < 4; k++)
        u[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++)
        w[k] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
#elif defined(TA_ISA_NEON) && TA_REAL_BITS == 32
    return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
#elif defined(TA_ISA_NEON)
    return vpaddq_f64(v[0], v[1]);
#else
    vr r;
    for (int t = 0; t < VW; t++) r[t] = vsum(v[t]);
    return r;
#endif
}

/* ------------------------------------------------------------------ narrow formats to real lanes */

/* VW stored elements from p (any alignment) as fp32 lanes, one widening load each (fp32 builds):
 *
 *   TA_VCVT_INT  vload_bf16, vload_i8, vload_i4 (VW / 2 bytes of two's complement nibbles, the low
 *                nibble of a byte first)
 *   TA_VCVT_F16  vload_f16, vload_e5m2 (the top byte of an fp16), vload_e4m3 (through the fp16
 *                conversion: 2^-8 of the values, which the decode kernel folds into its scales;
 *                0x7f / 0xff are NaN unless `finite` says the bytes hold none)
 *
 * Where a macro is not defined the callers convert element by element (common.h, kv.h). */
#if TA_REAL_BITS == 32 && (defined(TA_ISA_AVX512) || defined(TA_ISA_AVX2))
/* 8 bytes of int4 as 16 sign-extended int8 lanes in channel order: nibbles split, interleaved back,
 * then (x ^ 8) - 8 */
TA_INLINE __m128i ta_i4_bytes(__m128i x) {
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    __m128i lo = _mm_and_si128(x, low), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low);
    return _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), eight), eight);
}
#endif

#if TA_REAL_BITS == 32 && defined(TA_ISA_AVX512)
#define TA_VCVT_INT 1
#define TA_VCVT_F16 1
TA_INLINE vr vload_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
}
TA_INLINE vr vload_i8(const void *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))); }
TA_INLINE vr vload_i4(const void *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ta_i4_bytes(_mm_loadl_epi64(p))));
}
TA_INLINE vr vload_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(p)); }
TA_INLINE vr vload_e5m2(const void *p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(p)), 8));
}
TA_INLINE vr vload_e4m3(const void *p, const int finite) {
    __m128i x = _mm_loadu_si128(p);
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7), _mm256_set1_epi16((short)0xbfff));
    if (finite) return _mm512_cvtph_ps(h);
    __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(x, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(NAN));
}
#elif TA_REAL_BITS == 32 && defined(TA_ISA_AVX2)
#define TA_VCVT_INT 1
TA_INLINE vr vload_bf16(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
}
TA_INLINE vr vload_i8(const void *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p))); }
TA_INLINE vr vload_i4(const void *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ta_i4_bytes(_mm_cvtsi32_si128(four))));
}
#ifdef __F16C__
#define TA_VCVT_F16 1
TA_INLINE vr vload_f16(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128(p)); }
TA_INLINE vr vload_e5m2(const void *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(p)), 8));
}
TA_INLINE vr vload_e4m3(const void *p, const int finite) {
    __m128i x = _mm_loadl_epi64(p);
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(x), 7), _mm_set1_epi16((short)0xbfff));
    if (finite) return _mm256_cvtph_ps(h);
    __m128i nan = _mm_cmpeq_epi8(_mm_and_si128(x, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    __m256 nan32 = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan));
    return _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(NAN), nan32);
}
#endif
#elif TA_REAL_BITS == 32 && defined(TA_ISA_NEON)
#define TA_VCVT_INT 1
#define TA_VCVT_F16 1 /* FCVTL: every aarch64 CPU converts fp16 */
TA_INLINE int8x8_t ta_load4_s8(const void *p) { /* 4 bytes in the low lanes */
    uint32_t four;
    memcpy(&four, p, 4);
    return vreinterpret_s8_u32(vdup_n_u32(four));
}
TA_INLINE vr ta_s8_to_f32(int8x8_t x) { return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(x)))); }
TA_INLINE vr vload_bf16(const void *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16)); }
TA_INLINE vr vload_i8(const void *p) { return ta_s8_to_f32(ta_load4_s8(p)); }
TA_INLINE vr vload_i4(const void *p) {
    uint16_t two;
    memcpy(&two, p, 2);
    uint8x8_t x = vreinterpret_u8_u16(vdup_n_u16(two));
    uint8x8_t lo = vand_u8(x, vdup_n_u8(15)), hi = vshr_n_u8(x, 4);
    return ta_s8_to_f32(vsub_s8(vreinterpret_s8_u8(veor_u8(vzip1_u8(lo, hi), vdup_n_u8(8))), vdup_n_s8(8)));
}
TA_INLINE vr vload_f16(const void *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }
TA_INLINE vr vload_e5m2(const void *p) {
    uint16x4_t h = vshl_n_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_s8(ta_load4_s8(p)))), 8);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}
TA_INLINE vr vload_e4m3(const void *p, const int finite) {
    int8x8_t x = ta_load4_s8(p);
    int16x4_t h = vand_s16(vshl_n_s16(vget_low_s16(vmovl_s8(x)), 7), vdup_n_s16((short)0xbfff));
    vr r = vcvt_f32_f16(vreinterpret_f16_s16(h));
    if (finite) return r;
    uint8x8_t nan = vceq_u8(vand_u8(vreinterpret_u8_s8(x), vdup_n_u8(0x7f)), vdup_n_u8(0x7f));
    uint32x4_t nan32 = vreinterpretq_u32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(nan)))));
    return vbslq_f32(nan32, vdupq_n_f32(NAN), r);
}
#endif

/* Whether any byte of the rows [0, n) (width bytes each) has its low seven bits set (e4m3's NaN).
 * It prefetches rows ahead: strided rows defeat the hardware prefetcher. */
static inline int vany_byte_7f(const void *const *rows, int64_t n, int64_t width) {
#if defined(TA_ISA_AVX512)
    const __m512i m = _mm512_set1_epi8(0x7f);
    __mmask64 any = 0;
    for (int64_t j = 0; j < n; j++) {
        if (j + 16 < n)
            for (int64_t c = 0; c < width; c += 64) __builtin_prefetch((const char *)rows[j + 16] + c, 0, 3);
        for (int64_t c = 0; c < width; c += 64) {
            __mmask64 live = width - c >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (width - c)) - 1);
            __m512i x = _mm512_maskz_loadu_epi8(live, (const char *)rows[j] + c);
            any |= _mm512_mask_cmpeq_epi8_mask(live, _mm512_and_si512(x, m), m);
        }
    }
    return any != 0;
#elif defined(TA_ISA_NEON)
    const uint8x16_t m = vdupq_n_u8(0x7f);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = (const uint8_t *)rows[j];
        if (j + 16 < n)
            for (int64_t c = 0; c < width; c += 64) __builtin_prefetch((const char *)rows[j + 16] + c, 0, 3);
        uint8x16_t hit = vdupq_n_u8(0);
        int64_t c = 0;
        for (; c + 16 <= width; c += 16) hit = vorrq_u8(hit, vceqq_u8(vandq_u8(vld1q_u8(row + c), m), m));
        for (; c < width; c++)
            if ((row[c] & 0x7f) == 0x7f) return 1;
        if (vmaxvq_u8(hit)) return 1;
    }
    return 0;
#elif defined(TA_ISA_AVX2)
    const __m256i m = _mm256_set1_epi8(0x7f);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = (const uint8_t *)rows[j];
        if (j + 16 < n)
            for (int64_t c = 0; c < width; c += 64) __builtin_prefetch((const char *)rows[j + 16] + c, 0, 3);
        __m256i hit = _mm256_setzero_si256();
        int64_t c = 0;
        for (; c + 32 <= width; c += 32) {
            const __m256i x = _mm256_loadu_si256((const void *)(row + c));
            hit = _mm256_or_si256(hit, _mm256_cmpeq_epi8(_mm256_and_si256(x, m), m));
        }
        for (; c < width; c++)
            if ((row[c] & 0x7f) == 0x7f) return 1;
        if (_mm256_movemask_epi8(hit)) return 1;
    }
    return 0;
#else
    /* eight bytes a step: a byte whose low seven bits are all set carries into its top bit when 1 is
     * added, and no other byte does (at most 0x7f + 1 = 0x80: no carry into the next byte) */
    const uint64_t low7 = 0x7f7f7f7f7f7f7f7full, ones = 0x0101010101010101ull, tops = 0x8080808080808080ull;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = (const uint8_t *)rows[j];
        uint64_t hit = 0;
        int64_t c = 0;
        for (; c + 8 <= width; c += 8) {
            uint64_t w;
            memcpy(&w, row + c, 8);
            hit |= ((w & low7) + ones) & tops;
        }
        for (; c < width; c++)
            if ((row[c] & 0x7f) == 0x7f) return 1;
        if (hit) return 1;
    }
    return 0;
#endif
}

/* ------------------------------------------------------------- the thread's floating-point mode */

/* Tasks run with subnormal results flushed to zero (the thread's own floating-point mode, restored
 * when its tasks end: api.c). A row's accumulator is subnormal while its first keys carry
 * probabilities near 2^-126 (ALiBi's far keys, a softcap's floor), and every FMA with a subnormal
 * operand takes a microcode assist on Intel cores: a decode step with ALiBi ran 1.3x slower than
 * without. What is flushed is below 2^-126 of a row whose largest probability is 1, far under fp32's
 * rounding. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int ta_fp_mode;
static inline ta_fp_mode flush_subnormals(void) {
    const ta_fp_mode mode = _mm_getcsr();
    _mm_setcsr(mode | _MM_FLUSH_ZERO_ON);
    return mode;
}
static inline void restore_fp_mode(ta_fp_mode mode) { _mm_setcsr(mode); }
#elif defined(__aarch64__)
/* FPCR.FZ (bit 24) flushes subnormal operands and results of single and double precision (half
 * precision, the fp16 and fp8 conversions included, has its own bit, FZ16, left alone) */
typedef uint64_t ta_fp_mode;
static inline ta_fp_mode flush_subnormals(void) {
    ta_fp_mode mode;
    __asm__ volatile("mrs %0, fpcr" : "=r"(mode));
    __asm__ volatile("msr fpcr, %0" : : "r"(mode | ((ta_fp_mode)1 << 24)));
    return mode;
}
static inline void restore_fp_mode(ta_fp_mode mode) { __asm__ volatile("msr fpcr, %0" : : "r"(mode)); }
#else
typedef int ta_fp_mode;
static inline ta_fp_mode flush_subnormals(void) { return 0; }
static inline void restore_fp_mode(ta_fp_mode mode) { (void)mode; }
#endif

/* ---------------------------------------------------------- the CPU features the build relies on */

/* What the compiler was allowed to emit, as Linux's /proc/cpuinfo names it (x86 "flags", aarch64
 * "Features"), after a marker so Python can read the list from the library's bytes before loading
 * it (prebuilt.py): a library copied into another variant's folder must be refused, not loaded into
 * a process whose CPU would die of SIGILL at the first kernel call. api.c's ta_isa_features returns
 * the list once loaded (it ends at the first ";"). AMX is left out: the kernels ask the OS for the
 * tile state at run time (amx.h). */
#define TA_FEATURE_MARKER "tileattn-isa-features:"
static const char ta_cpu_features[] __attribute__((unused)) = TA_FEATURE_MARKER
#ifdef __SSE4_2__
    "sse4_2,"
#endif
#ifdef __POPCNT__
    "popcnt,"
#endif
#ifdef __AVX__
    "avx,"
#endif
#ifdef __AVX2__
    "avx2,"
#endif
#ifdef __FMA__
    "fma,"
#endif
#ifdef __F16C__
    "f16c,"
#endif
#ifdef __BMI__
    "bmi1,"
#endif
#ifdef __BMI2__
    "bmi2,"
#endif
#ifdef __AVX512F__
    "avx512f,"
#endif
#ifdef __AVX512BW__
    "avx512bw,"
#endif
#ifdef __AVX512CD__
    "avx512cd,"
#endif
#ifdef __AVX512DQ__
    "avx512dq,"
#endif
#ifdef __AVX512VL__
    "avx512vl,"
#endif
#ifdef __AVX512BF16__
    "avx512_bf16,"
#endif
#ifdef __AVX512FP16__
    "avx512_fp16,"
#endif
#ifdef __aarch64__
    "fp,asimd,"
#endif
#ifdef __ARM_FEATURE_ATOMICS
    "atomics,"
#endif
#ifdef __ARM_FEATURE_CRC32
    "crc32,"
#endif
#ifdef __ARM_FEATURE_QRDMX
    "asimdrdm,"
#endif
#ifdef __ARM_FEATURE_FP16_SCALAR_ARITHMETIC
    "fphp,"
#endif
#ifdef __ARM_FEATURE_FP16_VECTOR_ARITHMETIC
    "asimdhp,"
#endif
#ifdef __ARM_FEATURE_DOTPROD
    "asimddp,"
#endif
#ifdef __ARM_FEATURE_COMPLEX
    "fcma,"
#endif
#ifdef __ARM_FEATURE_JCVT
    "jscvt,"
#endif
#ifdef __ARM_FEATURE_FRINT
    "frint,"
#endif
#ifdef __ARM_FEATURE_BF16_VECTOR_ARITHMETIC
    "bf16,"
#endif
#ifdef __ARM_FEATURE_MATMUL_INT8
    "i8mm,"
#endif
#ifdef __ARM_FEATURE_SVE
    "sve,"
#endif
#ifdef __ARM_FEATURE_SVE2
    "sve2,"
#endif
    ";";

#endif
