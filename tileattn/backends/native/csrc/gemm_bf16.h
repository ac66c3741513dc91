/* The bf16 micro-GEMM (AVX512_BF16's vdpbf16ps, Arm's BFDOT): the same panels as gemm.h, with bf16
 * operands taken in pairs along k (c += a[2k] b[2k] + a[2k+1] b[2k+1], fp32 accumulation).
 *
 *     C[p][r][0:PW] (+)= sum_kp A2(r, kp) . B2[p][kp][0:PW]
 *
 * A2(r, kp) is the 32-bit pair (A(r, 2kp), A(r, 2kp+1)) broadcast to every lane; B2[p][kp] holds,
 * for each of the PW lanes, its pair of k values (PW * 2 bf16 = TA_NV vectors). Two shapes:
 *
 *   ROWS  A2(r, kp) = A32[r * ld + kp]    K rows (pairs along d): S = K Q^T
 *   COLS  A2(r, kp) = A32[r + kp * ld]    V packed as key pairs (Vp[kp][c] = (V[2kp][c], V[2kp+1][c]))
 *
 * where A32 views the bf16 data as 32-bit pairs and ld counts pairs. Only compiled where the
 * compiler enables AVX512_BF16 or Arm's bf16 extension (+bf16, implied from armv8.6-a).
 */
#ifndef TA_GEMM_BF16_H
#define TA_GEMM_BF16_H

#if (defined(TA_ISA_AVX512) && defined(__AVX512BF16__) || \
     defined(TA_ISA_NEON) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)) && TA_REAL_BITS == 32
#define TA_HAVE_BF16DOT 1

#include <time.h>

#include "tile.h"

/* The ISA's pieces: vbf16 holds VW bf16 pairs (one per fp32 lane); vbf16_dot(c, a, b) adds
 * a[2i] b[2i] + a[2i+1] b[2i+1] to lane i of c; ta_bf16_store_pairs(dst, x0, x1, order) rounds two
 * fp32 vectors (keys 2kp and 2kp+1) to bf16 and stores them interleaved in the pair layout of a B
 * panel, (x0[0], x1[0], x0[1], x1[1], ...), with `order` = ta_bf16_order() hoisted out of loops. */
#if defined(TA_ISA_AVX512)
typedef __m512bh vbf16;
TA_INLINE vbf16 vbf16_load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
TA_INLINE vbf16 vbf16_pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32((int)pair); }
TA_INLINE vr vbf16_dot(vr c, vbf16 a, vbf16 b) { return _mm512_dpbf16_ps(c, a, b); }

typedef __m512i ta_pairs_order;
static inline ta_pairs_order ta_bf16_order(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                            19, 3, 18, 2, 17, 1, 16, 0);
}

static inline __m512i ta_bf16_pairs(__m512 x0, __m512 x1, __m512i order) {
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}

/* a macro: the stores compile exactly as the expression written out */
#define ta_bf16_store_pairs(dst, x0, x1, order) _mm512_storeu_si512((dst), ta_bf16_pairs((x0), (x1), (order)))
#else /* NEON: BFDOT; BFCVTN rounds to nearest even, ST2 interleaves */
typedef bfloat16x8_t vbf16;
TA_INLINE vbf16 vbf16_load(const uint16_t *p) { return vld1q_bf16((const bfloat16_t *)p); }
TA_INLINE vbf16 vbf16_pair(uint32_t pair) { return vreinterpretq_bf16_u32(vdupq_n_u32(pair)); }
TA_INLINE vr vbf16_dot(vr c, vbf16 a, vbf16 b) { return vbfdotq_f32(c, a, b); }

typedef int ta_pairs_order; /* ST2 needs no permutation */
static inline ta_pairs_order ta_bf16_order(void) { return 0; }
TA_INLINE void ta_bf16_store_pairs(uint16_t *dst, vr x0, vr x1, ta_pairs_order order) {
    (void)order;
    uint16x4x2_t z = {{vreinterpret_u16_bf16(vcvt_bf16_f32(x0)), vreinterpret_u16_bf16(vcvt_bf16_f32(x1))}};
    vst2_u16(dst, z);
}
#endif

TA_INLINE void ta_mk_bf16(const int kind, const int mr, int64_t K2, const uint32_t *A, int64_t ld,
                          const uint16_t *B, float *C, int accumulate, float alpha, float *cmax) {
    vr c0[TA_MR], c1[TA_MR];
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++) {
        c0[r] = accumulate ? vload(C + r * PW) : vzero();
        c1[r] = accumulate ? vload(C + r * PW + VW) : vzero();
    }
    const uint32_t *g[4] = {A, A + 3 * ld, A + 6 * ld, A + 9 * ld};
    const uint32_t *a = A;
#pragma GCC unroll 4
    for (int64_t k = 0; k < K2; k++) {
        vbf16 b0 = vbf16_load(B + k * 2 * PW);
        vbf16 b1 = vbf16_load(B + k * 2 * PW + 2 * VW);
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            uint32_t pair = kind == TA_A_ROWS ? g[r / 3][(r % 3) * ld] : a[r];
            vbf16 x = vbf16_pair(pair);
            c0[r] = vbf16_dot(c0[r], x, b0);
            c1[r] = vbf16_dot(c1[r], x, b1);
        }
        if (kind == TA_A_ROWS)
            for (int i = 0; i < 4; i++) g[i]++;
        else
            a += ld;
    }
    if (!accumulate && alpha != 1.0f) {
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            c0[r] = c0[r] * vset1(alpha);
            c1[r] = c1[r] * vset1(alpha);
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

#define TA_MKB(kind, n) ta_mk_bf16(kind, n, K2, A, ld, B, C, accumulate, alpha, cmax)
#define TA_MKB_KIND(kind)                                                                                   \
    static void ta_mkb_##kind(int mr, int64_t K2, const uint32_t *A, int64_t ld, const uint16_t *B, float *C, \
                              int accumulate, float alpha, float *cmax) {                                   \
        if (mr == TA_MR) TA_MKB(kind, TA_MR);                                                              \
        else if (mr == 8) TA_MKB(kind, 8);                                                                 \
        else if (mr == 4) TA_MKB(kind, 4);                                                                 \
        else if (mr == 2) TA_MKB(kind, 2);                                                                 \
        else TA_MKB(kind, 1);                                                                              \
    }
TA_MKB_KIND(TA_A_ROWS)
TA_MKB_KIND(TA_A_COLS)

/* As ta_gemm, with K2 pairs of k; A32/ld in 32-bit pairs; B panels of K2 * PW * 2 bf16. */
static void ta_gemm_bf16(int64_t M, int64_t npan, int64_t K2, int kind, const uint32_t *A, int64_t ld,
                         const uint16_t *B, int64_t b_ps, float *C, int64_t c_ps, int accumulate, float alpha,
                         float *cmax) {
    for (int64_t p = 0; p < npan; p++)
        for (int64_t r0 = 0; r0 < M;) {
            int64_t left = M - r0;
            int mr = left >= TA_MR ? TA_MR : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const uint32_t *a = kind == TA_A_ROWS ? A + r0 * ld : A + r0;
            float *c = C + p * c_ps + r0 * PW, *cm = cmax ? cmax + p * PW : NULL;
            if (kind == TA_A_ROWS)
                ta_mkb_TA_A_ROWS(mr, K2, a, ld, B + p * b_ps, c, accumulate, alpha, cm);
            else
                ta_mkb_TA_A_COLS(mr, K2, a, ld, B + p * b_ps, c, accumulate, alpha, cm);
            r0 += mr;
        }
}

/* Seconds of thread CPU time for 480000 bf16 dot products (bf16) or FMAs (0) on whole vectors:
 * api.c's throughput probe, which decides whether the bf16 dot-product tiles beat fp32 tiles on
 * this core. */
static double ta_bf16dot_probe_seconds(int bf16) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    vr acc[24];
    for (int i = 0; i < 24; i++) acc[i] = vset1((float)i);
    const vr x = vset1(1e-3f);
    const vbf16 xb = vbf16_pair(0x3a833a83u); /* ~1e-3 in bf16, twice */
    if (bf16)
        for (int it = 0; it < 20000; it++)
#pragma GCC unroll 24
            for (int i = 0; i < 24; i++) acc[i] = vbf16_dot(acc[i], xb, xb);
    else
        for (int it = 0; it < 20000; it++)
#pragma GCC unroll 24
            for (int i = 0; i < 24; i++) acc[i] = vfma(acc[i], x, x);
    float sink = 0;
    for (int i = 0; i < 24; i++) sink += vsum(acc[i]);
    __asm__ volatile("" : : "m"(sink));
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

/* ------------------------------------------------------------------------------- packing to pairs */

/* The lanes of R from a q-like bf16 tensor (q, dout) into T2[p][c/2][PW][2], the B operand of
 * S = K Q^T and dP = V dO^T, with `pairs` >= width/2 pair rows per panel (zero padded). */
static void ta_pack_pairs_T(uint16_t *dst, const void *base, const int64_t st[3], int64_t seq_off, const ta_rows *R,
                            int64_t width, int64_t pairs) {
    memset(dst, 0, (size_t)(R->npan * pairs * PW * 2) * sizeof(uint16_t));
    for (int64_t r = 0; r < R->M; r++) {
        const uint16_t *src = (const uint16_t *)base + seq_off + R->head[r] * st[1] + R->row[r] * st[2];
        uint16_t *d = dst + (r / PW) * pairs * PW * 2 + (r % PW) * 2;
        for (int64_t c = 0; c < width; c++) d[(c / 2) * PW * 2 + c % 2] = src[c];
    }
}

/* Keys [j0, j0 + n) of kv head hk as 32-bit (d, d+1) pairs: in place when every row starts 4-byte
 * aligned with an even length, else copied into buf (n rows of D2 pairs, zero padded). */
static const uint32_t *ta_k_pairs(const ta_args *a, const ta_seq *s, int64_t hk, int64_t j0, int64_t n,
                                  uint16_t *buf, int64_t *ld) {
    const int64_t D = a->D, D2 = (D + 1) / 2;
    const uint16_t *k0 = (const uint16_t *)a->k + ta_key_off(a, s, a->k_st, s->k0, hk, j0);
    if (!a->paged && D % 2 == 0 && a->k_st[2] % 2 == 0 && ((uintptr_t)k0 & 3) == 0) {
        *ld = a->k_st[2] / 2;
        return (const uint32_t *)k0;
    }
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *src = (const uint16_t *)a->k + ta_key_off(a, s, a->k_st, s->k0, hk, j0 + j);
        memcpy(buf + j * D2 * 2, src, (size_t)D * sizeof(uint16_t));
        if (D % 2) buf[j * D2 * 2 + D] = 0;
    }
    *ld = D2;
    return (const uint32_t *)buf;
}

/* Keys [j0, j0 + n) of V as key pairs Vp[kp][c] = (V[2kp][c], V[2kp+1][c]), the A operand of the
 * P.V GEMM; an odd last key is paired with zeros. */
static void ta_pack_v_pairs(uint16_t *dst, const ta_args *a, const ta_seq *s, int64_t hk, int64_t j0, int64_t n) {
    const int64_t Dv = a->Dv;
    for (int64_t kp = 0; kp < (n + 1) / 2; kp++) {
        const uint16_t *r0 = (const uint16_t *)a->v + ta_key_off(a, s, a->v_st, s->v0, hk, j0 + 2 * kp);
        const uint16_t *r1 = 2 * kp + 1 < n ? (const uint16_t *)a->v + ta_key_off(a, s, a->v_st, s->v0, hk, j0 + 2 * kp + 1)
                                            : NULL;
        uint16_t *d = dst + kp * Dv * 2;
        for (int64_t c = 0; c < Dv; c++) {
            d[2 * c] = r0[c];
            d[2 * c + 1] = r1 ? r1[c] : 0;
        }
    }
}

#endif
#endif
