/* The micro-GEMM: every product of the forward and backward passes is one call of ta_gemm.
 *
 *     C[p][r][0:PW] (+)= sum_k A(r, k) * B[p][k][0:PW]      r < M rows, p < npan panels
 *
 * B and C are "panels" of PW = TA_NV * VW lanes (32 fp32 lanes with AVX-512): B[p] is K rows of PW
 * contiguous values, C[p] is M rows of PW values. A is read in place, in one of three shapes:
 *
 *   TA_A_ROWS    A(r, k) = A[r * ld + k]        K or V rows (scores S = K Q^T, dP = V dO^T)
 *   TA_A_COLS    A(r, k) = A[r + k * ld]        K^T or V^T  (acc += V^T P, dQ^T += K^T dS^T)
 *   TA_A_PANELS  A(r, k) = A[(k / PW) * ld + r * PW + k % PW]   a tile's own panels (dV, dK)
 *
 * so nothing is transposed or copied for fp32 inputs. Each shape gets its own fully unrolled
 * register block, because the addressing decides whether the compiler runs out of registers: with a
 * runtime row stride every row needs its own address, which the ROWS kernel groups into four base
 * pointers of three rows each ([base], [base + ld], [base + 2 ld]).
 *
 * The register block is TA_MR rows x PW lanes: each step of k broadcasts TA_MR values of A and
 * loads TA_NV vectors of B for TA_MR * TA_NV independent FMAs (24 with AVX-512, which hides the FMA
 * latency and leaves registers for the operands). Rows that do not fill a block are done in blocks
 * of 8, 4, 2 and 1.
 *
 * Epilogue options for the score GEMM: multiply by alpha (no accumulation) and fold the tile's
 * column maximum (the max over rows r, i.e. over keys, per query lane) into cmax.
 *
 * Prefetch: a GEMM can pull the rows the next one will read (the next tile's K or V, which come from
 * L3 or memory: a head's K and V are larger than L2 at long sequences) into L2 while it computes,
 * spread evenly over its register blocks. Without it the first panel of every tile waited on those
 * rows: the two GEMMs of the forward ran at 75-84 % of the FMA peak at S=4096 instead of 88 %.
 */
#ifndef TA_GEMM_H
#define TA_GEMM_H

#include "common.h"

#define TA_NV 2
#define PW (TA_NV * VW)
/* TA_MR, the rows of the register block, comes with the ISA (simd.h) */

enum { TA_A_ROWS, TA_A_COLS, TA_A_PANELS };

TA_INLINE real ta_a_at(const int kind, const int r, const real *const *g, int64_t ld, const real *a) {
    if (kind == TA_A_ROWS) return g[r / 3][(r % 3) * ld];
    if (kind == TA_A_COLS) return a[r];
    return a[r * PW];
}

TA_INLINE void ta_mk(const int kind, const int mr, int64_t K, const real *A, int64_t ld, const real *B, real *C,
                     int accumulate, real alpha, real *cmax) {
    vr c0[TA_MR], c1[TA_MR];
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++) {
        c0[r] = accumulate ? vload(C + r * PW) : vzero();
        c1[r] = accumulate ? vload(C + r * PW + VW) : vzero();
    }
    /* ROWS: four base pointers, each serving three consecutive rows */
    const real *g[4] = {A, A + 3 * ld, A + 6 * ld, A + 9 * ld};
    const int64_t kc = kind == TA_A_PANELS ? PW : K;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const real *a = kind == TA_A_PANELS ? A + (k0 / PW) * ld : A;
        const real *Bk = B + k0 * PW;
        int64_t kn = K - k0 < kc ? K - k0 : kc;
#pragma GCC unroll 4
        for (int64_t k = 0; k < kn; k++) {
            vr b0 = vload(Bk + k * PW), b1 = vload(Bk + k * PW + VW);
#pragma GCC unroll 16
            for (int r = 0; r < mr; r++) {
                vr x = vset1(ta_a_at(kind, r, g, ld, a));
                c0[r] = vfma(x, b0, c0[r]);
                c1[r] = vfma(x, b1, c1[r]);
            }
            if (kind == TA_A_ROWS)
                for (int i = 0; i < 4; i++) g[i]++;
            else if (kind == TA_A_COLS)
                a += ld;
            else
                a++;
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
        vstore(C + r * PW, c0[r]);
        vstore(C + r * PW + VW, c1[r]);
    }
}

/* The operand A of a GEMM: base pointer, shape and stride (ld; the panel stride for PANELS). */
typedef struct {
    const real *p;
    int kind;
    int64_t ld;
} ta_opa;

static inline ta_opa ta_opa_rows(const real *p, int64_t ld) { return (ta_opa){p, TA_A_ROWS, ld}; }
static inline ta_opa ta_opa_cols(const real *p, int64_t ld) { return (ta_opa){p, TA_A_COLS, ld}; }
static inline ta_opa ta_opa_panels(const real *p, int64_t panel_stride) {
    return (ta_opa){p, TA_A_PANELS, panel_stride};
}

#define TA_MK(kind, n) ta_mk(kind, n, K, A, ld, B, C, accumulate, alpha, cmax)
#if TA_MR > 8
#define TA_MK_8(kind) else if (mr == 8) TA_MK(kind, 8);
#else
#define TA_MK_8(kind)
#endif
#define TA_MK_KIND(kind)                                                                                     \
    static void ta_mk_##kind(int mr, int64_t K, const real *A, int64_t ld, const real *B, real *C, int accumulate, \
                             real alpha, real *cmax) {                                                       \
        if (mr == TA_MR) TA_MK(kind, TA_MR);                                                               \
        TA_MK_8(kind)                                                                                      \
        else if (mr == 4) TA_MK(kind, 4);                                                                  \
        else if (mr == 2) TA_MK(kind, 2);                                                                  \
        else TA_MK(kind, 1);                                                                               \
    }
TA_MK_KIND(TA_A_ROWS)
TA_MK_KIND(TA_A_COLS)
TA_MK_KIND(TA_A_PANELS)

/* Rows to prefetch into L2 during the GEMMs of a tile: up to four ranges of `rows` rows of `bytes`
 * bytes, `ld` bytes apart, issued in order as the GEMMs ask (a few cache lines before each register
 * block, so the loads never queue up behind a burst of prefetches). */
typedef struct {
    const char *p;
    int64_t ld, bytes, rows;
} ta_pf;

typedef struct {
    ta_pf r[4];
    int n, i;
    int64_t row, line;
} ta_pfs;

static inline ta_pf ta_pf_rows(const void *p, int64_t ld, int64_t width, int64_t rows) {
    return (ta_pf){(const char *)p, ld * (int64_t)sizeof(real), width * (int64_t)sizeof(real), p ? rows : 0};
}

/* cache lines a row of the range touches (one more when rows do not start on a line boundary) */
static inline int64_t ta_pf_lpr(const ta_pf *r) {
    return (r->bytes + 63) / 64 + ((((uintptr_t)r->p | (uintptr_t)r->ld) & 63) != 0);
}

static inline void ta_pfs_add(ta_pfs *s, ta_pf r) {
    if (r.rows > 0 && r.bytes > 0 && s->n < 4) s->r[s->n++] = r;
}

static inline int64_t ta_pfs_lines(const ta_pfs *s) {
    int64_t t = 0;
    for (int k = s->i; k < s->n; k++) t += s->r[k].rows * ta_pf_lpr(&s->r[k]) - (k == s->i ? s->row * ta_pf_lpr(&s->r[k]) + s->line : 0);
    return t;
}

static inline void ta_pfs_issue(ta_pfs *s, int64_t lines) {
    while (lines-- > 0 && s->i < s->n) {
        const ta_pf *r = &s->r[s->i];
        __builtin_prefetch(r->p + s->row * r->ld + s->line * 64, 0, 2);
        if (++s->line == ta_pf_lpr(r)) {
            s->line = 0;
            if (++s->row == r->rows) s->row = 0, s->i++;
        }
    }
}

/* C = alpha * A B (accumulate = 0) or C += A B over npan panels; b_ps/c_ps: panel strides, C rows
 * are PW apart. cmax (npan * PW values) receives the column maximum when not NULL. When pf is not
 * NULL, `budget` of its cache lines are prefetched on the way. */
static void ta_gemm(int64_t M, int64_t npan, int64_t K, ta_opa A, const real *B, int64_t b_ps, real *C,
                    int64_t c_ps, int accumulate, real alpha, real *cmax, ta_pfs *pf, int64_t budget) {
    const int64_t blocks = npan * ((M + TA_MR - 1) / TA_MR), per = pf && blocks > 0 ? (budget + blocks - 1) / blocks : 0;
    for (int64_t p = 0; p < npan; p++) {
        for (int64_t r0 = 0; r0 < M;) {
            if (per) ta_pfs_issue(pf, per);
            int64_t left = M - r0;
            int mr = left >= TA_MR ? TA_MR : left >= 8 && TA_MR > 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const real *a = A.kind == TA_A_ROWS ? A.p + r0 * A.ld : A.kind == TA_A_COLS ? A.p + r0 : A.p + r0 * PW;
            real *c = C + p * c_ps + r0 * PW, *cm = cmax ? cmax + p * PW : NULL;
            const real *b = B + p * b_ps;
            if (A.kind == TA_A_ROWS)
                ta_mk_TA_A_ROWS(mr, K, a, A.ld, b, c, accumulate, alpha, cm);
            else if (A.kind == TA_A_COLS)
                ta_mk_TA_A_COLS(mr, K, a, A.ld, b, c, accumulate, alpha, cm);
            else
                ta_mk_TA_A_PANELS(mr, K, a, A.ld, b, c, accumulate, alpha, cm);
            r0 += mr;
        }
    }
}

#endif
