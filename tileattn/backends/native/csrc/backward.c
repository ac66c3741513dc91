/* Backward pass: FlashAttention-2's recomputation over transposed tiles, without atomics.
 *
 * For a tile of (n keys) x (query rows as lanes), with lse2 = lse * log2(e) and Delta given:
 *
 *   S   = K Q^T                       (the forward's GEMM and score pipeline, bit for bit)
 *   P   = 2^min(S - lse2, 0)          probabilities; P <= 1 holds exactly, and the clamp keeps a
 *                                     stale fp32 LSE (|q.k| ~ 1e9) from producing overflow
 *   Z   = P * keep / (1 - p)          dropout (Z = P without it)
 *   dV += Z^T dO                      dP = V dO^T
 *   dS  = P * (dP * keep / (1 - p) - Delta)      (times the transforms' derivative: 1 - tanh^2 under a softcap)
 *   dK += dS^T Q * scale              dQ += dS K * scale
 *
 * Two schedules, chosen by how many (batch, kv head) pairs there are per thread:
 *
 *   fused   one task per kv head: query blocks outer, key blocks inner; dQ of a query block is
 *           complete after its inner loop, dK/dV of every key block accumulate in the task
 *   split   kv tasks (key block; query blocks inner) compute dK/dV, q tasks (query block; key
 *           blocks inner) compute dQ: more parallelism, two extra GEMMs per tile
 *
 * Both accumulate every element of dQ, dK, dV (and dbias) through the same GEMM calls on the same
 * tiles in the same order (dK/dV of a key block over query blocks in order, dQ of a query block over
 * key blocks in order), so they produce identical bits, and so does any thread count.
 */
#include "amx.h"
#include "gemm_bf16.h"
#include "kernels.h"
#include "profile.h"
#include "tile.h"

typedef struct {
    int64_t bmq, bn, nkb_max; /* query rows (per head) and keys per tile; key blocks per sequence */
    int64_t bgroup, hgroup;   /* batch items / kv heads one task covers (dbias reduced over them) */
    int mods;
    int amx;                  /* bf16 on AMX tiles (P, Z and dS rounded to bf16 for their GEMMs) */
    int64_t dq_rows;          /* rows of a dQ^T panel: D (rounded up to 32 for AMX) */
} bwd_plan;

enum { BWD_FUSED, BWD_KV, BWD_Q };

typedef struct {
    int kind;
    int64_t b, hk, blk, cost; /* blk: key block (kv task) or query block (q task) */
} bwd_task;

typedef struct {
    real *Qt, *Qn, *dOt, *dOn, *S, *dP, *Z, *T, *kbuf, *vbuf, *tmp;
    /* AMX operands (bf16): Q^T and dO^T as pairs panels, Q and dO as lane pairs, K and V rows, K^T
     * pairs, Z and dS as rows over lanes, dS^T as key pairs */
    uint16_t *qt2, *dot2, *qn2, *don2, *k2, *v2, *kt2, *zb, *dsb, *dsp;
    void *rows_mem;
    /* user functions (user.h): the keys' indices and visibility of a tile, the scores the score_mod
     * received (its derivative is taken there) */
    int32_t *ukv;
    uint8_t *uvis;
    int64_t *uvlo, *uvhi;
    real *upre;
} bwd_bufs;

static int64_t dpanels(int64_t width) { return (width + PW - 1) / PW; }

static int bwd_bufs_get(const ta_args *a, const bwd_plan *P, bwd_bufs *W) {
    const int64_t D = a->D, Dv = a->Dv, G = a->Hq / a->Hkv, bn = P->bn;
    int64_t npan = (P->bmq * G + PW - 1) / PW, lanes = npan * PW, wmax = D > Dv ? D : Dv;
    size_t rows_bytes = ta_round_up((int64_t)ta_rows_bytes(npan), 64);
    int64_t qside = lanes * (D + Dv) + lanes * PW * (dpanels(D) + dpanels(Dv));
    int64_t tiles = 4 * lanes * bn;
    size_t nreal = (size_t)(qside + tiles + bn * (D + Dv) + PW * ta_round_up(wmax, PW));
    const int64_t dpad = ta_round_up(D, 32), dvpad = ta_round_up(Dv, 32);
    size_t nhalf = P->amx ? (size_t)(2 * lanes * (dpad + dvpad) + bn * (2 * dpad + dvpad) + 3 * bn * lanes) : 0;
    char *mem = (char *)ta_scratch(0, rows_bytes + nreal * sizeof(real) + nhalf * 2 + 64);
    if (!mem) return TA_ENOMEM;
    W->qt2 = (uint16_t *)(mem + ta_round_up((int64_t)(rows_bytes + nreal * sizeof(real)), 64));
    W->dot2 = W->qt2 + lanes * dpad;
    W->qn2 = W->dot2 + lanes * dvpad;
    W->don2 = W->qn2 + lanes * dpad;
    W->k2 = W->don2 + lanes * dvpad;
    W->v2 = W->k2 + bn * dpad;
    W->kt2 = W->v2 + bn * dvpad;
    W->zb = W->kt2 + bn * dpad;
    W->dsb = W->zb + bn * lanes;
    W->dsp = W->dsb + bn * lanes;
    W->rows_mem = mem;
    W->Qt = (real *)(mem + rows_bytes);
    W->dOt = W->Qt + lanes * D;
    W->Qn = W->dOt + lanes * Dv;
    W->dOn = W->Qn + lanes * PW * dpanels(D);
    W->S = W->dOn + lanes * PW * dpanels(Dv);
    W->dP = W->S + lanes * bn;
    W->Z = W->dP + lanes * bn;
    W->T = W->Z + lanes * bn;
    W->kbuf = W->T + lanes * bn;
    W->vbuf = W->kbuf + bn * D;
    W->tmp = W->vbuf + bn * Dv;
    W->ukv = NULL, W->uvis = NULL, W->upre = NULL, W->uvlo = W->uvhi = NULL;
    if (a->user) {
        char *user = (char *)ta_scratch(2, (size_t)(lanes * bn) * sizeof(real) + (size_t)(2 * npan * 8 + bn * 4 +
                                                                                           bn * lanes));
        if (!user) return TA_ENOMEM;
        W->upre = (real *)user;
        W->uvlo = (int64_t *)(user + (size_t)(lanes * bn) * sizeof(real));
        W->uvhi = W->uvlo + npan;
        W->ukv = (int32_t *)(W->uvhi + npan);
        W->uvis = (uint8_t *)(W->ukv + bn);
    }
    return TA_OK;
}

/* Describe and pack query block qb of kv head hk: q and dout both ways, lse2 and Delta per lane. */
static void bwd_pack_q(const ta_args *a, const bwd_plan *P, const ta_seq *s, int64_t hk, int64_t qb, ta_rows *R,
                       bwd_bufs *W) {
    TA_PROF_T(pt);
    int64_t i0 = qb * P->bmq, nq = s->q_len - i0 < P->bmq ? s->q_len - i0 : P->bmq;
    ta_rows_init(R, W->rows_mem, a, s, hk, i0, nq);
#ifdef TA_HAVE_AMX
    if (P->amx) {
        ta_pack_pairs_T(W->qt2, a->q, a->q_st, s->q0, R, a->D, ta_round_up(a->D, 32) / 2);
        ta_pack_pairs_T(W->dot2, a->dout, a->do_st, s->do0, R, a->Dv, ta_round_up(a->Dv, 32) / 2);
        ta_amx_pack_lane_pairs(W->qn2, a->q, a->q_st, s->q0, R, a->D);
        ta_amx_pack_lane_pairs(W->don2, a->dout, a->do_st, s->do0, R, a->Dv);
    } else
#endif
    {
        ta_pack_rows(W->Qt, 1, a->q, a->dtype, a->q_st, s->q0, R, a->D, W->tmp);
        ta_pack_rows(W->Qn, 0, a->q, a->dtype, a->q_st, s->q0, R, a->D, W->tmp);
        ta_pack_rows(W->dOt, 1, a->dout, a->dout_dtype, a->do_st, s->do0, R, a->Dv, W->tmp);
        ta_pack_rows(W->dOn, 0, a->dout, a->dout_dtype, a->do_st, s->do0, R, a->Dv, W->tmp);
    }
    for (int64_t r = 0; r < R->M; r++) {
        int64_t off = s->l0 + R->head[r] * a->lse_st[1] + R->row[r] * a->lse_st[2];
        double lse = TA_REAL_BITS == 64 ? ((const double *)a->lse)[off] : ((const float *)a->lse)[off];
        double delta = TA_REAL_BITS == 64 ? ((const double *)a->delta)[off] : ((const float *)a->delta)[off];
        /* a row that sees no key has lse = -inf; +inf makes its P exactly 0 (not -inf - -inf) */
        R->lse2[r] = lse == -INFINITY ? (real)INFINITY : (real)(lse * TA_LOG2E);
        R->delta[r] = (real)delta;
    }
    TA_PROF(pt, bwd_pack);
}

/* Add dS of panel p into the caller's fp32 (fp64) dbias, whose broadcast dimensions have stride 0. */
static void bwd_dbias(const ta_args *a, const ta_seq *s, const ta_rows *R, int64_t p, const real *dS, int64_t n,
                      int64_t j0) {
    real *db = (real *)a->dbias;
    for (int64_t l = 0; l < PW && p * PW + l < R->M; l++) {
        int64_t r = p * PW + l;
        real *row = db + s->b * a->dbias_st[0] + R->head[r] * a->dbias_st[1] + R->row[r] * a->dbias_st[2];
        for (int64_t j = 0; j < n; j++) row[(j0 + j) * a->dbias_st[3]] += dS[j * PW + l];
    }
}

/* The elementwise middle of a tile, for panel p: S (scores times sc) -> P, Z and dP -> dS. */
static void bwd_probs(const ta_args *a, const ta_seq *s, const ta_rows *R, int64_t p, real *S, real *dP, real *Z,
                      const real *T, int64_t n, int64_t j0, real sc, int dk_side, const ta_user_tile *U) {
    const int drop = a->dropout_p > 0;
    const real keep_scale = (real)(1.0 / (1.0 - a->dropout_p));
    const vr scv = vset1(sc);
    for (int v = 0; v < TA_NV; v++) {
        const int64_t l0 = p * PW + v * VW;
        vr lse2 = vload(R->lse2 + l0), delta = vload(R->delta + l0);
        for (int64_t j = 0; j < n; j++) {
            const int64_t e = j * PW + v * VW;
            vr pr = vexp2(vmin_keepnan(vfma(vload(S + e), scv, -lse2), vzero()));
            vr dp = vload(dP + e);
            if (drop) {
                vi keep = ta_drop_keep(a, R, l0, j0 + j);
                vstore(Z + e, vselect(keep, pr * keep_scale, vzero()));
                dp = vselect(keep, dp * keep_scale, vzero());
            }
            vstore(S + e, pr);
            vstore(dP + e, pr * (dp - delta));
        }
    }
    /* through the score_mod: dS w.r.t. the scores it received (and its captures' gradients) */
    if (ta_user_scores(a)) ta_user_score_bwd(a, R, p, U->pre, dP, n, U->kv, dk_side);
    if (a->dbias && dk_side) bwd_dbias(a, s, R, p, dP, n, j0);
    if (T)
        for (int64_t e = 0; e < n * PW; e += VW) vstore(dP + e, vload(dP + e) * vload(T + e));
}
/* Which parts of a tile need the score pipeline (0: plain interior), or -1 when a mask, the block map
 * or the user's mask hides it all (user functions: W receives the tile's keys and visibility). */
static int bwd_flags(const ta_args *a, const bwd_plan *P, const ta_rows *R, int64_t j0, int64_t j1, bwd_bufs *W) {
    int flags = (P->mods ? TA_TILE_MODS : 0) | (ta_tile_on_edge(R, j0, j1) ? TA_TILE_EDGE : 0);
    if (a->mask) {
        int census = ta_mask_census(a, R, j0, j1);
        if (census == 2) return -1;
        if (census == 1) flags |= TA_TILE_MASK;
    }
    if (a->user) {
        int user = ta_user_tile_mask(a, R, j0, j1, W->ukv, W->uvis, W->uvlo, W->uvhi);
        if (user < 0) return -1;
        if (user > 0) flags |= TA_TILE_USER;
    }
    return flags;
}

/* The user state of panel p's keys [k0, k0 + m) of a tile starting at j0 (tp: the panel stride of
 * the tile buffers). */
static ta_user_tile bwd_user(const bwd_bufs *W, int64_t p, int64_t tp, int64_t j0, int64_t n, int64_t k0) {
    ta_user_tile U = {W->ukv + (k0 - j0), W->uvis ? W->uvis + (k0 - j0) * PW : NULL, n * PW,
                      W->upre ? W->upre + p * tp + (k0 - j0) * PW : NULL, 1};
    return U;
}

/* Scores through the pipeline for the panels of a non-plain tile (S already times alpha). */
static void bwd_mods(const ta_args *a, const ta_rows *R, bwd_bufs *W, int64_t tp, int64_t n, int64_t j0, int flags) {
    for (int64_t p = 0; p < R->npan; p++) {
        real cmax[PW];
        for (int k = 0; k < PW; k++) cmax[k] = -INFINITY;
        ta_user_tile U = bwd_user(W, p, tp, j0, n, j0);
        ta_score_mods(a, R, p, W->S + p * tp, n, j0, flags, cmax, ta_transform_derivative(a) ? W->T + p * tp : NULL,
                      &U);
    }
}

/* dV or dK (C, npan_out panels of PW channels, key rows) += T^T X, summed over the lanes of R: T is a
 * tile's P/Z or dS panels (key rows from j0, panel stride tp), X the lane rows of Qn or dOn (panel
 * stride x_ps). Each block of keys sums only over the panels whose key range [pk0, pk1) meets it
 * (rows outside a panel's range are zero in T): on the causal diagonal the hidden half is skipped. */
static void bwd_gemm_lanes(const ta_rows *R, int64_t j0, int64_t n, const real *T, int64_t tp, const real *X,
                           int64_t x_ps, int64_t npan_out, real *C, const int64_t *pk0, const int64_t *pk1, ta_pfs *pf,
                           int64_t budget) {
    const int64_t blocks = npan_out * ((n + TA_MR - 1) / TA_MR), per = blocks > 0 ? (budget + blocks - 1) / blocks : 0;
    for (int64_t op = 0; op < npan_out; op++)
        for (int64_t r0 = 0; r0 < n;) {
            ta_pfs_issue(pf, per);
            int64_t left = n - r0;
            int mr = left >= TA_MR ? TA_MR : left >= 8 && TA_MR > 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            int64_t qa = 0, qb = 0;
            while (qa < R->npan && (pk1[qa] <= j0 + r0 || pk0[qa] >= j0 + r0 + mr)) qa++;
            for (qb = qa; qb < R->npan && pk1[qb] > j0 + r0 && pk0[qb] < j0 + r0 + mr; qb++) {
            }
            int64_t lanes = (qb * PW < R->M ? qb * PW : R->M) - qa * PW;
            if (lanes > 0)
                ta_mk_TA_A_PANELS(mr, lanes, T + qa * tp + r0 * PW, tp, X + op * x_ps + qa * PW * PW,
                                  C + op * tp + r0 * PW, 1, 1, NULL);
            r0 += mr;
        }
}

/* One tile: query block R against keys [j0, j1). Accumulates dK/dV (when dK is not NULL) and
 * dQ^T (when dQt is not NULL). Each panel of lanes computes only the keys it can see (its scores,
 * dP, probabilities and dQ); the other rows of its P and dS are zeroed for the dK/dV sums. pf: what
 * the next tile reads (K and V rows, dK and dV accumulators), pulled into L2 during this one. */
static void bwd_tile(const ta_args *a, const bwd_plan *P, const ta_seq *s, const ta_rows *R, bwd_bufs *W,
                     int64_t j0, int64_t j1, real *dK, real *dV, real *dQt, ta_pfs *pf) {
    const int64_t D = a->D, Dv = a->Dv, n = j1 - j0, npan = R->npan, tp = P->bn * PW;
    TA_PROF_T(pt);
    int flags = bwd_flags(a, P, R, j0, j1, W);
    if (flags < 0) return;
    int64_t ldk, ldv, pk0[npan], pk1[npan];
    /* the prefetches spread over every GEMM of the tile */
    const int64_t budget = (ta_pfs_lines(pf) + 3 * npan + 1) / (3 * npan + 2);
    const real *K = ta_kv_rows(a, s, a->k, a->k_st, s->k0, R->hk, j0, n, D, W->kbuf, &ldk);
    const real *V = ta_kv_rows(a, s, a->v, a->v_st, s->v0, R->hk, j0, n, Dv, W->vbuf, &ldv);
    real alpha = (real)(P->mods ? a->scale : a->scale * TA_LOG2E);
    real *Z = a->dropout_p > 0 ? W->Z : W->S;
    TA_PROF(pt, bwd_mods);
    for (int64_t p = 0; p < npan; p++) {
        ta_user_panel_keys(R, p, j0, j1, flags & TA_TILE_USER ? W->uvlo : NULL, flags & TA_TILE_USER ? W->uvhi : NULL,
                           &pk0[p], &pk1[p]);
        int64_t o = (pk0[p] - j0) * PW, m = pk1[p] - pk0[p];
        if (m == 0) continue;
        ta_gemm(m, 1, D, ta_opa_rows(K + (pk0[p] - j0) * ldk, ldk), W->Qt + p * D * PW, 0, W->S + p * tp + o, 0, 0,
                alpha, NULL, pf, budget);
        TA_PROF(pt, bwd_scores);
        ta_gemm(m, 1, Dv, ta_opa_rows(V + (pk0[p] - j0) * ldv, ldv), W->dOt + p * Dv * PW, 0, W->dP + p * tp + o, 0,
                0, 1, NULL, pf, budget);
        TA_PROF(pt, bwd_dp);
        int pflags = (flags & ~TA_TILE_EDGE) |
                     (ta_lanes_on_edge(R, p * PW, (p + 1) * PW, pk0[p], pk1[p]) ? TA_TILE_EDGE : 0);
        ta_user_tile U = bwd_user(W, p, tp, j0, n, pk0[p]);
        if (pflags) {
            real cmax[PW];
            for (int k = 0; k < PW; k++) cmax[k] = -INFINITY;
            ta_score_mods(a, R, p, W->S + p * tp + o, m, pk0[p], pflags, cmax,
                          ta_transform_derivative(a) ? W->T + p * tp + o : NULL, &U);
        }
        TA_PROF(pt, bwd_mods);
        bwd_probs(a, s, R, p, W->S + p * tp + o, W->dP + p * tp + o, W->Z + p * tp + o,
                  ta_transform_derivative(a) ? W->T + p * tp + o : NULL, m, pk0[p], 1, dK != NULL, &U);
        TA_PROF(pt, bwd_probs);
    }
    /* now S holds P and dP holds dS, on each panel's key range */
    if (dK) {
        for (int64_t p = 0; p < npan; p++) {
            int64_t lo = pk1[p] > pk0[p] ? pk0[p] - j0 : n, hi = pk1[p] > pk0[p] ? pk1[p] - j0 : n;
            memset(Z + p * tp, 0, (size_t)(lo * PW) * sizeof(real));
            memset(Z + p * tp + hi * PW, 0, (size_t)((n - hi) * PW) * sizeof(real));
            memset(W->dP + p * tp, 0, (size_t)(lo * PW) * sizeof(real));
            memset(W->dP + p * tp + hi * PW, 0, (size_t)((n - hi) * PW) * sizeof(real));
        }
        TA_PROF(pt, bwd_probs);
        bwd_gemm_lanes(R, j0, n, Z, tp, W->dOn, npan * PW * PW, dpanels(Dv), dV, pk0, pk1, pf, budget);
        TA_PROF(pt, bwd_dv);
        bwd_gemm_lanes(R, j0, n, W->dP, tp, W->Qn, npan * PW * PW, dpanels(D), dK, pk0, pk1, pf, budget);
        TA_PROF(pt, bwd_dk);
    }
    if (dQt) {
        for (int64_t p = 0; p < npan; p++)
            if (pk1[p] > pk0[p])
                ta_gemm(D, 1, pk1[p] - pk0[p], ta_opa_cols(K + (pk0[p] - j0) * ldk, ldk),
                        W->dP + p * tp + (pk0[p] - j0) * PW, 0, dQt + p * P->dq_rows * PW, 0, 1, 1, NULL, pf, budget);
        TA_PROF(pt, bwd_dq);
    }
}

#ifdef TA_HAVE_AMX
/* bwd_tile on AMX tiles: the five products are tdpbf16ps GEMMs with bf16 operands (K, V and K^T
 * packed per tile; P, Z and dS rounded to bf16 as GPU FlashAttention does), the elementwise
 * middle is the fp32 code of bwd_tile. Keys are padded to a multiple of 32 with zeros. */
static void bwd_tile_amx(const ta_args *a, const bwd_plan *P, const ta_seq *s, const ta_rows *R, bwd_bufs *W,
                         int64_t j0, int64_t j1, real *dK, real *dV, real *dQt) {
    const int64_t D = a->D, Dv = a->Dv, n = j1 - j0, npan = R->npan, tp = P->bn * PW, lanes = npan * PW;
    const int64_t np = ta_round_up(n, 32), dpad = ta_round_up(D, 32), dvpad = ta_round_up(Dv, 32);
    TA_PROF_T(pt);
    int flags = bwd_flags(a, P, R, j0, j1, W);
    if (flags < 0) return;
    ta_amx_pack_rows(W->k2, a, s, a->k, a->k_st, s->k0, R->hk, j0, n, D, np, dpad);
    ta_amx_pack_rows(W->v2, a, s, a->v, a->v_st, s->v0, R->hk, j0, n, Dv, np, dvpad);
    TA_PROF(pt, bwd_pack);
    ta_amx_gemm(np, npan, dpad, W->k2, dpad, W->qt2, dpad * PW, W->S, tp, 0);
    TA_PROF(pt, bwd_scores);
    ta_amx_gemm(np, npan, dvpad, W->v2, dvpad, W->dot2, dvpad * PW, W->dP, tp, 0);
    TA_PROF(pt, bwd_dp);
    real alpha = (real)(P->mods ? a->scale : a->scale * TA_LOG2E), sc = alpha;
    if (flags) {
        for (int64_t p = 0; p < npan; p++)
            for (int64_t e = 0; e < n * PW; e += VW) vstore(W->S + p * tp + e, vload(W->S + p * tp + e) * alpha);
        bwd_mods(a, R, W, tp, n, j0, flags);
        sc = 1;
    }
    TA_PROF(pt, bwd_mods);
    for (int64_t p = 0; p < npan; p++) {
        ta_user_tile U = bwd_user(W, p, tp, j0, n, j0);
        bwd_probs(a, s, R, p, W->S + p * tp, W->dP + p * tp, W->Z + p * tp,
                  ta_transform_derivative(a) ? W->T + p * tp : NULL, n, j0, sc, dK != NULL, &U);
    }
    TA_PROF(pt, bwd_probs);
    if (dK) {
        ta_amx_rows_bf16(W->zb, a->dropout_p > 0 ? W->Z : W->S, tp, npan, n, np, R->M);
        ta_amx_rows_bf16(W->dsb, W->dP, tp, npan, n, np, R->M);
        TA_PROF(pt, bwd_pack);
        ta_amx_gemm(np, dpanels(Dv), lanes, W->zb, lanes, W->don2, lanes * PW, dV, tp, 1);
        TA_PROF(pt, bwd_dv);
        ta_amx_gemm(np, dpanels(D), lanes, W->dsb, lanes, W->qn2, lanes * PW, dK, tp, 1);
        TA_PROF(pt, bwd_dk);
    }
    if (dQt) {
        for (int64_t p = 0; p < npan; p++) {
            uint16_t *d = W->dsp + p * tp;
            const real *dS = W->dP + p * tp;
            const ta_pairs_order order = ta_bf16_order();
            for (int64_t kp = 0; kp < np / 2; kp++)
                for (int v = 0; v < TA_NV; v++) {
                    vr x0 = 2 * kp < n ? vload(dS + 2 * kp * PW + v * VW) : vzero();
                    vr x1 = 2 * kp + 1 < n ? vload(dS + (2 * kp + 1) * PW + v * VW) : vzero();
                    ta_bf16_store_pairs(d + (kp * PW + v * VW) * 2, x0, x1, order);
                }
        }
        ta_amx_pack_vt(W->kt2, np, a, s, a->k, a->k_st, s->k0, R->hk, j0, n, D, dpad);
        TA_PROF(pt, bwd_pack);
        ta_amx_gemm(dpad, npan, np, W->kt2, np, W->dsp, tp, dQt, P->dq_rows * PW, 1);
        TA_PROF(pt, bwd_dq);
    }
}
#endif

static void bwd_tile_any(const ta_args *a, const bwd_plan *P, const ta_seq *s, const ta_rows *R, bwd_bufs *W,
                         int64_t j0, int64_t j1, real *dK, real *dV, real *dQt, ta_pfs *pf) {
#ifdef TA_HAVE_AMX
    if (P->amx) {
        bwd_tile_amx(a, P, s, R, W, j0, j1, dK, dV, dQt);
        return;
    }
#endif
    bwd_tile(a, P, s, R, W, j0, j1, dK, dV, dQt, pf);
}

/* dK/dV rows [j0, j0 + n) of kv head hk from their accumulators (dK scaled); zero rows past n up to
 * `rows`. tmp holds one row of max(D, Dv) rounded up to PW. */
static void bwd_store_kv(const ta_args *a, const ta_seq *s, int64_t hk, int64_t j0, int64_t n, int64_t rows,
                         const real *dK, const real *dV, int64_t tp, real *tmp) {
    TA_PROF_T(pt);
    const vr scale = vset1((real)a->scale);
    for (int64_t j = 0; j < rows; j++) {
        for (int pass = 0; pass < 2; pass++) {
            int64_t w = pass ? a->Dv : a->D;
            const real *acc = pass ? dV : dK;
            for (int64_t d0 = 0; d0 < w; d0 += VW)
                vstore(tmp + d0, j < n ? (pass ? vload(acc + (d0 / PW) * tp + j * PW + d0 % PW)
                                               : vload(acc + (d0 / PW) * tp + j * PW + d0 % PW) * scale)
                                       : vzero());
            const int64_t *st = pass ? a->dv_st : a->dk_st;
            int64_t off = (pass ? s->dv0 : s->dk0) + hk * st[1] + (j0 + j) * st[2];
            ta_store_row((char *)(pass ? a->dv : a->dk) + off * ta_elsize(a->dkv_dtype), tmp, w, a->dkv_dtype);
        }
    }
    TA_PROF(pt, bwd_store);
}

/* dQ of the lanes of R from dQ^T (scaled), a panel at a time through tmp (PW rows). */
static void bwd_store_q(const ta_args *a, const bwd_plan *P, const ta_seq *s, const ta_rows *R, const real *dQt,
                        real *tmp) {
    TA_PROF_T(pt);
    const int64_t ld = ta_round_up(a->D, PW);
    real scale[PW];
    for (int64_t k = 0; k < PW; k++) scale[k] = (real)a->scale;
    for (int64_t p = 0; p < R->npan; p++) {
        int64_t nrows = R->M - p * PW < PW ? R->M - p * PW : PW;
        ta_panel_to_rows(tmp, ld, nrows, dQt + p * P->dq_rows * PW, a->D, scale);
        for (int64_t k = 0; k < nrows; k++) {
            int64_t r = p * PW + k, off = s->dq0 + R->head[r] * a->dq_st[1] + R->row[r] * a->dq_st[2];
            ta_store_row((char *)a->dq + off * ta_elsize(a->dq_dtype), tmp + k * ld, a->D, a->dq_dtype);
        }
    }
    TA_PROF(pt, bwd_store);
}

/* Key blocks [*kb0, *kb1) that query block qb sees, and query blocks that key block kb is seen by. */
static void bwd_kb_range(const ta_args *a, const bwd_plan *P, const ta_seq *s, int64_t qb, int64_t *kb0, int64_t *kb1) {
    int64_t i0 = qb * P->bmq, i1 = i0 + P->bmq < s->q_len ? i0 + P->bmq : s->q_len;
    int64_t lo = ta_band_lo(a, s, i0), hi = ta_band_hi(a, s, i1 - 1);
    *kb0 = lo / P->bn;
    *kb1 = hi >= lo ? hi / P->bn + 1 : *kb0;
}

static void bwd_qb_range(const ta_args *a, const bwd_plan *P, const ta_seq *s, int64_t kb, int64_t *qb0, int64_t *qb1) {
    int64_t j0 = kb * P->bn, j1 = j0 + P->bn < s->k_len ? j0 + P->bn : s->k_len, lo, hi;
    ta_query_range(a, s, j0, j1, &lo, &hi);
    *qb0 = lo / P->bmq;
    *qb1 = hi > lo ? (hi - 1) / P->bmq + 1 : *qb0;
}

static int64_t bwd_kb_size(const bwd_plan *P, const ta_seq *s, int64_t kb) {
    int64_t j0 = kb * P->bn;
    return j0 + P->bn < s->k_len ? P->bn : s->k_len - j0;
}

/* What the tile of key block kb reads from beyond L2: its K and V rows (fp32 inputs read in place)
 * and, when given, its dK and dV accumulators (`acc` reals each). */
static ta_pfs bwd_prefetch(const ta_args *a, const bwd_plan *P, const ta_seq *s, int64_t hk, int64_t kb,
                           const real *dK, const real *dV, int64_t dk_len, int64_t dv_len) {
    ta_pfs pf = {0};
    int64_t j0 = kb * P->bn, n = bwd_kb_size(P, s, kb);
    int native = (TA_REAL_BITS == 64) ? a->dtype == TA_F64 : a->dtype == TA_F32;
    if (kb < 0 || n <= 0) return pf;
    if (native) {
        ta_pfs_add(&pf, ta_pf_rows((const real *)a->k + s->k0 + hk * a->k_st[1] + j0 * a->k_st[2], a->k_st[2], a->D, n));
        ta_pfs_add(&pf, ta_pf_rows((const real *)a->v + s->v0 + hk * a->v_st[1] + j0 * a->v_st[2], a->v_st[2], a->Dv, n));
    }
    if (dK) ta_pfs_add(&pf, ta_pf_rows(dK, dk_len, dk_len, 1));
    if (dV) ta_pfs_add(&pf, ta_pf_rows(dV, dv_len, dv_len, 1));
    return pf;
}

/* Fused schedule: every (query block, key block) tile of the task's kv heads. */
static int bwd_fused(const ta_args *a, const bwd_plan *P, const bwd_task *t) {
    const int64_t Dpad = dpanels(a->D) * PW, Dvpad = dpanels(a->Dv) * PW, tp = P->bn * PW;
    bwd_bufs W;
    if (bwd_bufs_get(a, P, &W)) return TA_ENOMEM;
    int64_t G = a->Hq / a->Hkv, lanes = (P->bmq * G + PW - 1) / PW * PW;
    size_t acc_len = (size_t)(P->nkb_max * tp * (Dpad + Dvpad) / PW + lanes * P->dq_rows);
    real *acc = (real *)ta_scratch(1, acc_len * sizeof(real));
    if (!acc) return TA_ENOMEM;
    for (int64_t b = t->b; b < t->b + P->bgroup; b++)
        for (int64_t hk = t->hk; hk < t->hk + P->hgroup; hk++) {
            ta_seq s;
            ta_seq_init(a, b, &s);
            int64_t nkb = (s.k_len + P->bn - 1) / P->bn;
            real *dKall = acc, *dVall = acc + nkb * tp * Dpad / PW, *dQt = dVall + nkb * tp * Dvpad / PW;
            memset(acc, 0, (size_t)(nkb * tp * (Dpad + Dvpad) / PW) * sizeof(real));
            for (int64_t qb = 0; qb * P->bmq < s.q_len; qb++) {
                if (ta_cancelled(a)) return TA_CANCELLED;
                ta_rows R;
                bwd_pack_q(a, P, &s, hk, qb, &R, &W);
                memset(dQt, 0, (size_t)(R.npan * PW * P->dq_rows) * sizeof(real));
                int64_t kb0, kb1;
                bwd_kb_range(a, P, &s, qb, &kb0, &kb1);
                /* the tile after the last of this row of tiles is the first of the next query block */
                int64_t nkb0 = -1, nkb1 = -1;
                if ((qb + 1) * P->bmq < s.q_len) bwd_kb_range(a, P, &s, qb + 1, &nkb0, &nkb1);
                for (int64_t kb = kb0; kb < kb1; kb++) {
                    int64_t next = kb + 1 < kb1 ? kb + 1 : nkb0 < nkb1 ? nkb0 : -1;
                    ta_pfs pf = bwd_prefetch(a, P, &s, hk, next, next >= 0 ? dKall + next * tp * Dpad / PW : NULL,
                                             next >= 0 ? dVall + next * tp * Dvpad / PW : NULL, tp * Dpad / PW,
                                             tp * Dvpad / PW);
                    bwd_tile_any(a, P, &s, &R, &W, kb * P->bn, kb * P->bn + bwd_kb_size(P, &s, kb),
                                 dKall + kb * tp * Dpad / PW, dVall + kb * tp * Dvpad / PW, dQt, &pf);
                }
                bwd_store_q(a, P, &s, &R, dQt, W.tmp);
            }
            for (int64_t kb = 0; kb < nkb; kb++)
                bwd_store_kv(a, &s, hk, kb * P->bn, bwd_kb_size(P, &s, kb), bwd_kb_size(P, &s, kb),
                             dKall + kb * tp * Dpad / PW, dVall + kb * tp * Dvpad / PW, tp, W.tmp);
        }
    return TA_OK;
}

/* Split schedule, kv side: dK/dV of one key block of the task's kv heads. */
static int bwd_kv(const ta_args *a, const bwd_plan *P, const bwd_task *t) {
    const int64_t Dpad = dpanels(a->D) * PW, Dvpad = dpanels(a->Dv) * PW, tp = P->bn * PW;
    bwd_bufs W;
    if (bwd_bufs_get(a, P, &W)) return TA_ENOMEM;
    real *dK = (real *)ta_scratch(1, (size_t)(tp * (Dpad + Dvpad) / PW) * sizeof(real));
    if (!dK) return TA_ENOMEM;
    real *dV = dK + tp * Dpad / PW;
    for (int64_t b = t->b; b < t->b + P->bgroup; b++)
        for (int64_t hk = t->hk; hk < t->hk + P->hgroup; hk++) {
            ta_seq s;
            ta_seq_init(a, b, &s);
            int64_t kb = t->blk;
            if (kb * P->bn >= s.k_len) continue; /* a shorter sequence of a varlen batch */
            memset(dK, 0, (size_t)(tp * (Dpad + Dvpad) / PW) * sizeof(real));
            int64_t qb0, qb1, n = bwd_kb_size(P, &s, kb);
            bwd_qb_range(a, P, &s, kb, &qb0, &qb1);
            for (int64_t qb = qb0; qb < qb1; qb++) {
                if (ta_cancelled(a)) return TA_CANCELLED;
                ta_rows R;
                bwd_pack_q(a, P, &s, hk, qb, &R, &W);
                ta_pfs pf = {0};
                bwd_tile_any(a, P, &s, &R, &W, kb * P->bn, kb * P->bn + n, dK, dV, NULL, &pf);
            }
            bwd_store_kv(a, &s, hk, kb * P->bn, n, n, dK, dV, tp, W.tmp);
        }
    return TA_OK;
}

/* Split schedule, q side: dQ of one query block. */
static int bwd_q(const ta_args *a, const bwd_plan *P, const bwd_task *t) {
    bwd_bufs W;
    if (bwd_bufs_get(a, P, &W)) return TA_ENOMEM;
    ta_seq s;
    ta_seq_init(a, t->b, &s);
    ta_rows R;
    bwd_pack_q(a, P, &s, t->hk, t->blk, &R, &W);
    real *dQt = (real *)ta_scratch(1, (size_t)(R.npan * PW * P->dq_rows) * sizeof(real));
    if (!dQt) return TA_ENOMEM;
    memset(dQt, 0, (size_t)(R.npan * PW * P->dq_rows) * sizeof(real));
    int64_t kb0, kb1;
    bwd_kb_range(a, P, &s, t->blk, &kb0, &kb1);
    for (int64_t kb = kb0; kb < kb1; kb++) {
        if (ta_cancelled(a)) return TA_CANCELLED;
        ta_pfs pf = bwd_prefetch(a, P, &s, t->hk, kb + 1 < kb1 ? kb + 1 : -1, NULL, NULL, 0, 0);
        bwd_tile_any(a, P, &s, &R, &W, kb * P->bn, kb * P->bn + bwd_kb_size(P, &s, kb), NULL, NULL, dQt, &pf);
    }
    bwd_store_q(a, P, &s, &R, dQt, W.tmp);
    return TA_OK;
}

static int bwd_run(const ta_args *a, const void *plan, const void *task) {
    const bwd_task *t = (const bwd_task *)task;
    const bwd_plan *P = (const bwd_plan *)plan;
#ifdef TA_HAVE_AMX
    if (P->amx) ta_amx_begin();
#endif
    int status = t->kind == BWD_FUSED ? bwd_fused(a, P, t) : t->kind == BWD_KV ? bwd_kv(a, P, t) : bwd_q(a, P, t);
#ifdef TA_HAVE_AMX
    if (P->amx) ta_amx_end();
#endif
    return status;
}

static int bwd_cost_desc(const void *x, const void *y) {
    int64_t a = ((const bwd_task *)x)->cost, b = ((const bwd_task *)y)->cost;
    return (a < b) - (a > b);
}

/* dK/dV rows past a sequence's used keys (seqused_k) get zeros. */
static void bwd_zero_unused(const ta_args *a) {
    real *zero = (real *)calloc((size_t)ta_round_up(a->D > a->Dv ? a->D : a->Dv, PW), sizeof(real));
    if (!zero) return;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        int64_t cap = a->varlen ? (int64_t)((const int32_t *)a->cu_k)[b + 1] - ((const int32_t *)a->cu_k)[b] : a->Sk;
        for (int64_t hk = 0; hk < a->Hkv; hk++)
            bwd_store_kv(a, &s, hk, s.k_len, 0, cap - s.k_len, zero, zero, 0, zero);
    }
    free(zero);
}

int FN(backward)(const ta_args *a) {
    const int64_t G = a->Hq / a->Hkv;
    bwd_plan P;
    int64_t lanes = a->block_m > 0 ? a->block_m : 128;
    P.bmq = lanes / G > 0 ? lanes / G : 1;
    P.bn = a->block_n > 0 ? a->block_n : 256;
    P.mods = ta_transforms(a) || ta_user_scores(a);
    P.bgroup = (a->dbias && a->dbias_st[0] == 0) ? a->B : 1;
    P.hgroup = (a->dbias && a->dbias_st[1] == 0) ? a->Hkv : 1;
    P.nkb_max = (a->Sk + P.bn - 1) / P.bn;
    P.amx = 0;
#ifdef TA_HAVE_AMX
    P.amx = a->dtype == TA_BF16 && !(a->options & TA_OPT_NO_AMX) && ta_amx_available();
#endif
    P.dq_rows = P.amx ? ta_round_up(a->D, 32) : a->D;

    int64_t groups = (a->B / P.bgroup) * (a->Hkv / P.hgroup), nthreads = a->num_threads > 0 ? a->num_threads : 1;
    /* dbias reduced over keys gathers contributions from several key blocks: only the fused order
     * is defined for it, whatever the thread count */
    int keys_reduced = a->dbias && a->dbias_st[3] == 0 && a->Sk > 1;
    int fused = (a->options & TA_OPT_FORCE_FUSED) || keys_reduced ||
                (!(a->options & TA_OPT_FORCE_SPLIT) && (nthreads == 1 || groups >= 2 * nthreads));

    int64_t ntasks = groups;
    if (!fused) {
        ntasks = groups * P.nkb_max;
        for (int64_t b = 0; b < a->B; b++) ntasks += a->Hkv * ((ta_seq_q_rows(a, b) + P.bmq - 1) / P.bmq);
    }
    bwd_task *tasks = (bwd_task *)malloc((size_t)(ntasks > 0 ? ntasks : 1) * sizeof(bwd_task));
    if (!tasks) return TA_ENOMEM;
    int64_t nt = 0;
    double work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        double pairs = 0;
        for (int64_t i = 0; i < s.q_len; i += 16) pairs += (double)(ta_band_hi(a, &s, i) + 1 - ta_band_lo(a, &s, i));
        work += 16 * pairs * G * a->Hkv * 2.5 * (a->D + a->Dv);
    }
    for (int64_t b = 0; b < a->B; b += P.bgroup)
        for (int64_t hk = 0; hk < a->Hkv; hk += P.hgroup) {
            if (fused) {
                tasks[nt++] = (bwd_task){BWD_FUSED, b, hk, 0, 1};
                continue;
            }
            for (int64_t kb = 0; kb < P.nkb_max; kb++) {
                ta_seq s;
                ta_seq_init(a, b, &s);
                int64_t qb0, qb1;
                bwd_qb_range(a, &P, &s, kb, &qb0, &qb1);
                tasks[nt++] = (bwd_task){BWD_KV, b, hk, kb, (qb1 - qb0) * P.bgroup * P.hgroup};
            }
        }
    if (!fused)
        for (int64_t b = 0; b < a->B; b++) {
            ta_seq s;
            ta_seq_init(a, b, &s);
            for (int64_t qb = 0; qb * P.bmq < s.q_len; qb++) {
                int64_t kb0, kb1;
                bwd_kb_range(a, &P, &s, qb, &kb0, &kb1);
                for (int64_t hk = 0; hk < a->Hkv; hk++) tasks[nt++] = (bwd_task){BWD_Q, b, hk, qb, kb1 - kb0};
            }
        }
    qsort(tasks, (size_t)nt, sizeof(bwd_task), bwd_cost_desc);
    int status = ta_run_tasks(a, nt, work, tasks, sizeof(bwd_task), bwd_run, &P);
    free(tasks);
    if (status == TA_OK) bwd_zero_unused(a);
    return status;
}
