/* The micro-GEMM: every product of the forward and backward passes is one call of ta_gemm.
 *
 *     C[p][r][0:PW] (+)= sum_k A(r, k) * B[p][k][0:PW]      r < M rows, p < npan panels
 *
 * B and C are "panels" of PW = TA_NV * VW lanes (32 fp32 lanes with AVX-512): B[p] is K rows of PW
 * contiguous values, C[p] is M rows of PW values. A is read in place through strides,
 * A(r, k) = A[r * a_rs + (k % kc) * a_ks + (k / kc) * a_ps], so the same kernel takes K rows
 * (a_rs = key stride), K^T or V^T (a_ks = key stride) and panel-major probabilities (kc = PW):
 * nothing is transposed or copied for fp32 inputs.
 *
 * The register block is TA_MR rows x PW lanes: each step of k broadcasts TA_MR values of A and
 * loads TA_NV vectors of B for TA_MR * TA_NV independent FMAs (24 with AVX-512, which hides the
 * FMA latency with room to spare and leaves registers for the operands).
 *
 * Epilogue options for the score GEMM: multiply by alpha (no accumulation) and fold the tile's
 * column maximum (the running max over rows r, i.e. over keys, per query lane) into cmax.
 */
#ifndef TA_GEMM_H
#define TA_GEMM_H

#include "simd.h"

#define TA_NV 2
#define PW (TA_NV * VW)
#ifndef TA_MR
#if defined(TA_ISA_AVX512)
#define TA_MR 12
#else
#define TA_MR 6
#endif
#endif

TA_INLINE void ta_mk(const int mr, int64_t K, const real *A, int64_t a_rs, int64_t a_ks, int64_t kc, int64_t a_ps,
                     const real *B, real *C, int64_t c_rs, int accumulate, real alpha, real *cmax) {
    vr c0[TA_MR], c1[TA_MR];
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++) {
        c0[r] = accumulate ? vload(C + r * c_rs) : vzero();
        c1[r] = accumulate ? vload(C + r * c_rs + VW) : vzero();
    }
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const real *Ak = A + (k0 / kc) * a_ps;
        const real *Bk = B + k0 * PW;
        int64_t kn = K - k0 < kc ? K - k0 : kc;

#pragma GCC unroll 4
        for (int64_t k = 0; k < kn; k++) {
            vr b0 = vload(Bk + k * PW), b1 = vload(Bk + k * PW + VW);
#pragma GCC unroll 16
            for (int r = 0; r < mr; r++) {
                vr a = vset1(Ak[r * a_rs + k * a_ks]);
                c0[r] = vfma(a, b0, c0[r]);
                c1[r] = vfma(a, b1, c1[r]);
            }
        }
    }
    if (!accumulate && alpha != (real)1) {
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            c0[r] *= alpha;
            c1[r] *= alpha;
        }
    }
    if (cmax) {
        vr m0 = vload(cmax), m1 = vload(cmax + VW);
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            m0 = vmax_(m0, c0[r]);
            m1 = vmax_(m1, c1[r]);
        }
        vstore(cmax, m0);
        vstore(cmax + VW, m1);
    }
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++) {
        vstore(C + r * c_rs, c0[r]);
        vstore(C + r * c_rs + VW, c1[r]);
    }
}

/* One instantiation per row count, so every register block is fully unrolled. */
#define TA_MK_CASE(n)                                                                                \
    case n: ta_mk(n, K, A, a_rs, a_ks, kc, a_ps, B, C, c_rs, accumulate, alpha, cmax); break;

static void ta_mk_rows(int mr, int64_t K, const real *A, int64_t a_rs, int64_t a_ks, int64_t kc, int64_t a_ps,
                       const real *B, real *C, int64_t c_rs, int accumulate, real alpha, real *cmax) {
    switch (mr) {
#if TA_MR >= 12
        TA_MK_CASE(12) TA_MK_CASE(11) TA_MK_CASE(10) TA_MK_CASE(9)
#endif
#if TA_MR >= 8
        TA_MK_CASE(8) TA_MK_CASE(7)
#endif
        TA_MK_CASE(6) TA_MK_CASE(5) TA_MK_CASE(4) TA_MK_CASE(3) TA_MK_CASE(2) TA_MK_CASE(1)
    }
}

/* The operand A of a GEMM: base pointer and strides (see the header comment). */
typedef struct {
    const real *p;
    int64_t rs, ks, kc, ps;
} ta_opa;

static inline ta_opa ta_opa_rows(const real *p, int64_t rs) { return (ta_opa){p, rs, 1, TA_NO_LIMIT, 0}; }
static inline ta_opa ta_opa_cols(const real *p, int64_t ks) { return (ta_opa){p, 1, ks, TA_NO_LIMIT, 0}; }
/* panel-major (npan, rows, PW) data read as A(row, lane + PW * panel) */
static inline ta_opa ta_opa_panels(const real *p, int64_t panel_stride) {
    return (ta_opa){p, PW, 1, PW, panel_stride};
}

/* C = alpha * A B (accumulate = 0) or C += A B over npan panels; b_ps/c_ps: panel strides,
 * C rows are PW apart. cmax (npan * PW values) receives the column maximum when not NULL. */
static void ta_gemm(int64_t M, int64_t npan, int64_t K, ta_opa A, const real *B, int64_t b_ps, real *C,
                    int64_t c_ps, int accumulate, real alpha, real *cmax) {
    for (int64_t p = 0; p < npan; p++)
        for (int64_t r0 = 0; r0 < M; r0 += TA_MR) {
            int mr = M - r0 < TA_MR ? (int)(M - r0) : TA_MR;
            ta_mk_rows(mr, K, A.p + r0 * A.rs, A.rs, A.ks, A.kc, A.ps, B + p * b_ps, C + p * c_ps + r0 * PW, PW,
                       accumulate, alpha, cmax ? cmax + p * PW : NULL);
        }
}

#endif
