/* Forward pass (prefill): FlashAttention-2 over transposed tiles.
 *
 * A task is one block of query rows of one kv head of one sequence: the rows of its G query heads
 * are the lanes of the tile (tile.h). For each block of keys inside the band:
 *
 *   1. S = K Q^T          one GEMM; K is read in place, Q was packed once per task (transposed)
 *   2. scores -> logits   for a plain interior tile, the GEMM's epilogue already scaled by
 *                         scale*log2(e) and took the column max; other tiles go through the score
 *                         pipeline (softcap, ALiBi, bias, band edge, mask)
 *   3. online softmax     one pass: rescale the accumulator only for lanes whose max grew by more
 *                         than TA_RESCALE_THRESHOLD, then P = 2^(S - m), the row sums and dropout
 *   4. acc += V^T P       one GEMM; V is read in place
 *
 * and at the end out = acc / l, lse = (m + log2 l) ln 2. Tasks are independent and each writes its
 * own rows, so the result does not depend on the thread count or on which thread ran what.
 */
#include "amx.h"
#include "gemm_bf16.h"
#include "kernels.h"
#include "profile.h"
#include "tile.h"

typedef struct {
    int64_t bmq, bn; /* query rows (per head) and keys per tile */
    int mods;        /* softcap / ALiBi / bias: every tile takes the score pipeline */
    int engine;      /* FWD_F32, FWD_BF16DOT or FWD_AMX (bf16: P rounded to bf16 for P.V) */
    int convert;     /* fp32 tiles of inputs that are not fp32 rows in place: convert K/V once per task */
} fwd_plan;

typedef struct {
    int64_t b, hk, i0, nqb, cost; /* query blocks [i0, i0 + nqb * bmq) of kv head hk of sequence b */
    int64_t order;                /* position in (sequence, kv head, block) order */
} fwd_task;

/* Step 3: online softmax of one panel of a tile; S holds base-2 logits and receives P. */
static void fwd_softmax(const ta_args *a, const ta_rows *R, int64_t p, real *S, int64_t n, int64_t j0, real *m,
                        real *l, const real *cmax, real *acc, int64_t Dv) {
    const int64_t base = p * PW;
    const int drop = a->dropout_p > 0;
    vr msub[TA_NV], lsum[TA_NV];
    for (int v = 0; v < TA_NV; v++) {
        vr mo = vload(m + base + v * VW), tm = vload(cmax + base + v * VW);
        vi grow = tm > mo + (real)TA_RESCALE_THRESHOLD;
        vr mn = vselect(grow, tm, mo);
        int any = 0;
        for (int i = 0; i < VW; i++) any |= grow[i] != 0;
        if (any) {
            vr f = vselect(grow, vexp2(mo - mn), vset1(1));
            vstore(l + base + v * VW, vload(l + base + v * VW) * f);
            for (int64_t c = 0; c < Dv; c++) vstore(acc + c * PW + v * VW, vload(acc + c * PW + v * VW) * f);
        }
        vstore(m + base + v * VW, mn);
        /* a lane that has seen no key yet keeps m = -inf; subtracting 0 keeps its P at 0, not NaN */
        msub[v] = vselect(mn == -INFINITY, vzero(), mn);
        lsum[v] = vzero();
    }
    for (int64_t j = 0; j < n; j++)
        for (int v = 0; v < TA_NV; v++) {
            vr pr = vexp2(vload(S + j * PW + v * VW) - msub[v]);
            lsum[v] += pr;
            if (drop) pr = vselect(ta_drop_keep(a, R, base + v * VW, j0 + j), pr, vzero());
            vstore(S + j * PW + v * VW, pr);
        }
    for (int v = 0; v < TA_NV; v++) vstore(l + base + v * VW, vload(l + base + v * VW) + lsum[v]);
}

#if defined(TA_HAVE_AMX) || defined(TA_HAVE_BF16DOT)
/* Step 3 for the bf16 engines: P goes straight to bf16 key pairs (the B operand of their P.V
 * GEMMs; no fp32 P is stored), through a degree-4 exp2 (P is rounded to bf16 next).
 *
 * With `speculate` (AMX, plain tile: S is unscaled, `scale` multiplies it, and no column max was
 * taken) a half-panel whose lanes all have a running max computes P against it and takes the tile
 * max in the same sweep; only if some lane's max grew past the threshold is the sweep redone the
 * usual way. After the first tiles of a block that is rare, and one pass over S is saved. */
static void fwd_softmax_pairs(const ta_args *a, const ta_rows *R, int64_t p, const real *S, real scale, int speculate,
                              uint16_t *pairs, int64_t n, int64_t j0, real *m, real *l, const real *cmax, real *acc,
                              int64_t Dv) {
    const int64_t base = p * PW;
    const int drop = a->dropout_p > 0;
    const vr sc = vset1(scale), thr = vset1((real)TA_RESCALE_THRESHOLD);
    const ta_pairs_order order = ta_bf16_order();
    for (int v = 0; v < TA_NV; v++) {
        const real *Sv = S + v * VW;
        uint16_t *Pv = pairs + v * VW * 2;
        vr mo = vload(m + base + v * VW), tm;
        int pass = 0;
        if (speculate) {
            int ready = 1;
            for (int i = 0; i < VW; i++) ready &= mo[i] != -INFINITY;
            vr mx = vset1(-INFINITY);
            if (ready) {
                vr ls = vzero();
                for (int64_t j = 0; j < n; j += 2) {
                    vr s0 = vload(Sv + j * PW), s1 = j + 1 < n ? vload(Sv + (j + 1) * PW) : vset1(-INFINITY);
                    mx = vmax_(mx, vmax_(s0 * sc, s1 * sc));
                    /* the arithmetic of the usual step below, so a lane's bits do not depend on
                     * whether its neighbours let it speculate */
                    vr p0 = vexp2_p(vfma(s0, sc, -mo), 1), p1 = vexp2_p(vfma(s1, sc, -mo), 1);
                    ls += p0 + p1;
                    if (drop) {
                        p0 = vselect(ta_drop_keep(a, R, base + v * VW, j0 + j), p0, vzero());
                        p1 = vselect(ta_drop_keep(a, R, base + v * VW, j0 + j + 1), p1, vzero());
                    }
                    ta_bf16_store_pairs(Pv + (j / 2) * PW * 2, p0, p1, order);
                }
                vi grow = mx > mo + thr;
                int any = 0;
                for (int i = 0; i < VW; i++) any |= grow[i] != 0;
                if (!any) {
                    vstore(l + base + v * VW, vload(l + base + v * VW) + ls);
                    continue;
                }
            } else {
                for (int64_t j = 0; j < n; j++) mx = vmax_(mx, vload(Sv + j * PW) * sc);
            }
            tm = mx;
        } else {
            tm = vload(cmax + base + v * VW);
        }
        /* the usual step: rescale the lanes whose max grew, then P against the new max */
        vi grow = tm > mo + thr;
        vr mn = vselect(grow, tm, mo);
        for (int i = 0; i < VW; i++) pass |= grow[i] != 0;
        if (pass) {
            vr f = vselect(grow, vexp2(mo - mn), vset1(1));
            vstore(l + base + v * VW, vload(l + base + v * VW) * f);
            for (int64_t c = 0; c < Dv; c++) vstore(acc + c * PW + v * VW, vload(acc + c * PW + v * VW) * f);
        }
        vstore(m + base + v * VW, mn);
        vr msub = vselect(mn == -INFINITY, vzero(), mn), ls = vzero();
        for (int64_t j = 0; j < n; j += 2) {
            vr p0 = vexp2_p(vfma(vload(Sv + j * PW), sc, -msub), 1);
            vr p1 = j + 1 < n ? vexp2_p(vfma(vload(Sv + (j + 1) * PW), sc, -msub), 1) : vzero();
            ls += p0 + p1;
            if (drop) {
                p0 = vselect(ta_drop_keep(a, R, base + v * VW, j0 + j), p0, vzero());
                p1 = vselect(ta_drop_keep(a, R, base + v * VW, j0 + j + 1), p1, vzero());
            }
            ta_bf16_store_pairs(Pv + (j / 2) * PW * 2, p0, p1, order);
        }
        vstore(l + base + v * VW, vload(l + base + v * VW) + ls);
    }
}
#endif

/* out = acc / l (scaled by 1/(1-p) under dropout), lse = (m + log2 l) ln 2; rows that saw no key: 0,
 * -inf. A panel at a time: scaled and transposed to rows in tmp (PW rows of Dv rounded up to VW). */
static void fwd_finish(const ta_args *a, const ta_seq *s, const ta_rows *R, const real *acc, int64_t accr,
                       const real *m, const real *l, real *tmp) {
    const int64_t Dv = a->Dv, ld = ta_round_up(Dv, VW);
    const double keep_scale = 1.0 / (1.0 - a->dropout_p);
    for (int64_t p = 0; p < R->npan; p++) {
        real inv[PW];
        for (int64_t k = 0; k < PW; k++) inv[k] = l[p * PW + k] == 0 ? 0 : (real)(keep_scale / l[p * PW + k]);
        int64_t nrows = R->M - p * PW < PW ? R->M - p * PW : PW;
        ta_panel_to_rows(tmp, ld, nrows, acc + p * accr * PW, Dv, inv);
        for (int64_t k = 0; k < nrows; k++) {
            int64_t r = p * PW + k, h = R->head[r], i = R->row[r];
            double lr = l[r], lse = lr == 0 ? -INFINITY : ((double)m[r] + log2(lr)) * TA_LN2;
            if (lr == 0) memset(tmp + k * ld, 0, (size_t)Dv * sizeof(real));
            ta_store_row((char *)a->out + (s->o0 + h * a->o_st[1] + i * a->o_st[2]) * ta_elsize(a->out_dtype),
                         tmp + k * ld, Dv, a->out_dtype);
            int64_t lo = s->l0 + h * a->lse_st[1] + i * a->lse_st[2];
            if (TA_REAL_BITS == 64)
                ((double *)a->lse)[lo] = lse;
            else
                ((float *)a->lse)[lo] = (float)lse;
        }
    }
}

/* How a task multiplies: fp32 tiles (any input), vdpbf16ps tiles or AMX tiles (bf16 inputs). */
enum { FWD_F32, FWD_BF16DOT, FWD_AMX };

/* A task's buffers. The bf16 operands (dot-product and AMX engines) are Q^T and P as pair panels,
 * K rows and V (as pairs for vdpbf16ps, transposed for AMX). */
typedef struct {
    real *Qt, *S, *acc, *m, *l, *cmax, *kbuf, *vbuf, *tmp;
    uint16_t *qt2, *k2, *p2, *v2;
    int64_t kbase, kld; /* AMX: k2 and v2 hold the task's keys from kbase on, v2 rows kld keys long */
    real *kconv, *vconv; /* fp32 tiles of fp16/bf16 inputs: the task's K and V rows from kbase on, in fp32 */
    int32_t *ukv;        /* user functions: the keys' indices of a tile, its visibility and the columns */
    uint8_t *uvis;       /* each panel sees (user.h) */
    int64_t *uvlo, *uvhi;
    int64_t sp;   /* rows of an S panel: keys per tile rounded up to 32 */
    int64_t accr; /* rows of an accumulator panel: Dv (rounded up to 32 for AMX) */
    int64_t q2;   /* pair rows of a Q^T panel */
} fwd_bufs;

static int fwd_bufs_get(const ta_args *a, const fwd_plan *P, int64_t npan, void **rows_mem, fwd_bufs *W) {
    const int64_t D = a->D, Dv = a->Dv, lanes = npan * PW, amx = P->engine == FWD_AMX;
    W->sp = ta_round_up(P->bn, 32);
    W->kbase = W->kld = 0;
    W->kconv = W->vconv = NULL;
    W->accr = amx ? ta_round_up(Dv, 32) : Dv;
    W->q2 = amx ? ta_round_up(D, 32) / 2 : (D + 1) / 2;
    const int64_t sp = W->sp, wmax = D > Dv ? D : Dv;
    size_t rows_bytes = ta_round_up((int64_t)ta_rows_bytes(npan), 64);
    size_t nreal = (size_t)(lanes * (D + sp + W->accr + 3) + sp * (D + Dv) + PW * ta_round_up(wmax, VW));
    size_t nhalf = P->engine == FWD_F32 ? 0 : (size_t)(lanes * W->q2 * 2 + sp * W->q2 * 2 + lanes * sp + sp * W->accr);
    char *mem = (char *)ta_scratch(0, rows_bytes + nreal * sizeof(real) + nhalf * 2 + 128);
    if (!mem) return TA_ENOMEM;
    *rows_mem = mem;
    W->Qt = (real *)(mem + rows_bytes);
    W->S = W->Qt + lanes * D;
    W->acc = W->S + lanes * sp;
    W->m = W->acc + lanes * W->accr;
    W->l = W->m + lanes;
    W->cmax = W->l + lanes;
    W->kbuf = W->cmax + lanes;
    W->vbuf = W->kbuf + sp * D;
    W->tmp = W->vbuf + sp * Dv;
    W->qt2 = (uint16_t *)(mem + ta_round_up((int64_t)(rows_bytes + nreal * sizeof(real)), 64));
    W->k2 = W->qt2 + lanes * W->q2 * 2;
    W->p2 = W->k2 + sp * W->q2 * 2;
    W->v2 = W->p2 + lanes * sp;
    W->ukv = NULL, W->uvis = NULL, W->uvlo = W->uvhi = NULL;
    if (a->user) {
        char *user = (char *)ta_scratch(2, (size_t)(2 * npan * 8 + sp * 4 + sp * lanes));
        if (!user) return TA_ENOMEM;
        W->uvlo = (int64_t *)user;
        W->uvhi = W->uvlo + npan;
        W->ukv = (int32_t *)(W->uvhi + npan);
        W->uvis = (uint8_t *)(W->ukv + sp);
    }
    return TA_OK;
}

/* fp32 rows [j0, j0 + n) of K (v = 0) or V (v = 1) as the GEMMs read them: converted rows of the task,
 * or the input in place (NULL where it is neither, e.g. paged fp32 rows gathered per tile). */
static const real *fwd_kv_direct(const ta_args *a, const ta_seq *s, const fwd_bufs *W, int v, int64_t hk, int64_t j0,
                                 int64_t *ld) {
    const int64_t w = v ? a->Dv : a->D;
    if (W->kconv) {
        *ld = w;
        return (v ? W->vconv : W->kconv) + (j0 - W->kbase) * w;
    }
    int native = (TA_REAL_BITS == 64) ? a->dtype == TA_F64 : a->dtype == TA_F32;
    if (!native || a->paged) return NULL;
    const int64_t *st = v ? a->v_st : a->k_st;
    *ld = st[2];
    return (const real *)(v ? a->v : a->k) + (v ? s->v0 : s->k0) + hk * st[1] + j0 * st[2];
}

#if defined(TA_HAVE_AMX) || defined(TA_HAVE_BF16DOT)
/* Step 1 for the bf16 engines: S = alpha * K Q^T over the npan panels, and the column max when cmax
 * is not NULL; the AMX engine leaves plain tiles (cmax not NULL) unscaled for fwd_softmax_pairs, and
 * any tile without `scale_amx`. */
static void fwd_scores_bf16(const ta_args *a, const fwd_plan *P, const ta_seq *s, int64_t hk, int64_t j0, int64_t n,
                            int64_t npan, const fwd_bufs *W, real alpha, real *cmax, int scale_amx) {
#ifdef TA_HAVE_AMX
    if (P->engine == FWD_AMX) {
        int64_t np = ta_round_up(n, 32), dpad = 2 * W->q2;
        ta_amx_gemm(np, npan, dpad, W->k2 + (j0 - W->kbase) * dpad, dpad, W->qt2, W->q2 * PW * 2, W->S, W->sp * PW, 0);
        /* the matrix unit has no epilogue: a plain tile is left unscaled (the softmax applies alpha
         * and takes the max in its own sweep), and so is one of the user's fused sweep (which scales
         * it); other tiles are scaled here for the score pipeline */
        if (!cmax && scale_amx)
            for (int64_t p = 0; p < npan; p++)
                for (int64_t e = 0; e < n * PW; e += VW) vstore(W->S + p * W->sp * PW + e, vload(W->S + p * W->sp * PW + e) * alpha);
        return;
    }
#endif
#ifdef TA_HAVE_BF16DOT
    int64_t ld;
    const uint32_t *K2 = ta_k_pairs(a, s, hk, j0, n, W->k2, &ld);
    ta_gemm_bf16(n, npan, W->q2, TA_A_ROWS, K2, ld, W->qt2, W->q2 * PW * 2, W->S, W->sp * PW, 0, alpha, cmax);
#endif
}

/* Step 4 for the bf16 engines: acc += V^T P over the npan panels (P as pairs in p2). */
static void fwd_accumulate_bf16(const ta_args *a, const fwd_plan *P, const ta_seq *s, int64_t hk, int64_t j0,
                                int64_t n, int64_t npan, const fwd_bufs *W) {
    const int64_t tp = W->sp * PW;
    /* the softmax wrote P as pairs; AMX reads whole 32-key blocks, so zero the pairs past n */
    int64_t np = P->engine == FWD_AMX ? ta_round_up(n, 32) : n;
    for (int64_t p = 0; p < npan; p++)
        memset(W->p2 + p * tp + (n + 1) / 2 * PW * 2, 0, (size_t)((np + 1) / 2 - (n + 1) / 2) * PW * 2 * 2);
#ifdef TA_HAVE_AMX
    if (P->engine == FWD_AMX) {
        ta_amx_gemm(W->accr, npan, np, W->v2 + (j0 - W->kbase), W->kld, W->p2, tp, W->acc, W->accr * PW, 1);
        return;
    }
#endif
#ifdef TA_HAVE_BF16DOT
    ta_pack_v_pairs(W->v2, a, s, hk, j0, n);
    ta_gemm_bf16(a->Dv, npan, (n + 1) / 2, TA_A_COLS, (const uint32_t *)W->v2, a->Dv, W->p2, tp, W->acc, W->accr * PW,
                 1, 1, NULL);
#endif
}
#endif

/* Steps 1-4 of a tile for the fp32 engine, one panel of PW query lanes at a time: a panel's scores
 * stay in L1 from the GEMM that makes them through the softmax to the GEMM that consumes them, and a
 * panel visits only the keys of the tile its lanes can see (on the causal diagonal about half). The
 * GEMMs pull the next tile's K (score GEMMs) and V (P.V GEMMs) rows into L2, a share per panel. */
static void fwd_tile_f32(const ta_args *a, const fwd_plan *P, const ta_seq *s, const ta_rows *R, const fwd_bufs *W,
                         int64_t hk, int64_t j0, int64_t j1, int64_t next_n, int flags, real alpha,
                         const ta_user_tile *U) {
    const int user_vis = (flags & TA_TILE_USER) != 0;
    const int64_t D = a->D, Dv = a->Dv, npan = R->npan, tp = W->sp * PW, n = j1 - j0;
    int64_t kld, vld, nkld = 0, nvld = 0;
    const real *K = fwd_kv_direct(a, s, W, 0, hk, j0, &kld), *V = fwd_kv_direct(a, s, W, 1, hk, j0, &vld);
    if (!K) K = ta_kv_rows(a, s, a->k, a->k_st, s->k0, hk, j0, n, D, W->kbuf, &kld);
    if (!V) V = ta_kv_rows(a, s, a->v, a->v_st, s->v0, hk, j0, n, Dv, W->vbuf, &vld);
    ta_pfs pf = {0};
    if (next_n > 0) {
        const real *nK = fwd_kv_direct(a, s, W, 0, hk, j1, &nkld), *nV = fwd_kv_direct(a, s, W, 1, hk, j1, &nvld);
        ta_pfs_add(&pf, ta_pf_rows(nK, nkld, D, next_n));
        ta_pfs_add(&pf, ta_pf_rows(nV, nvld, Dv, next_n));
    }
    const int64_t budget = (ta_pfs_lines(&pf) + 2 * npan - 1) / (2 * npan);
    for (int64_t p = 0; p < npan; p++) {
        int64_t k0, k1;
        ta_user_panel_keys(R, p, j0, j1, user_vis ? W->uvlo : NULL, user_vis ? W->uvhi : NULL, &k0, &k1);
        if (k0 == k1) continue; /* no lane of the panel sees the tile */
        TA_PROF_T(pt);
        real *Sp = W->S + p * tp, *cmax = W->cmax + p * PW, *acc = W->acc + p * W->accr * PW;
        int pflags = (flags & ~TA_TILE_EDGE) | (ta_lanes_on_edge(R, p * PW, (p + 1) * PW, k0, k1) ? TA_TILE_EDGE : 0);
        for (int64_t r = 0; r < PW; r++) cmax[r] = -INFINITY;
        TA_PROF(pt, fwd_mods);
        ta_gemm(k1 - k0, 1, D, ta_opa_rows(K + (k0 - j0) * kld, kld), W->Qt + p * D * PW, 0, Sp, 0, 0, alpha,
                pflags ? NULL : cmax, &pf, budget);
        TA_PROF(pt, fwd_scores);
        if (pflags) {
            ta_user_tile Up = {U->kv + (k0 - j0), U->vis ? U->vis + (k0 - j0) * PW : NULL, U->vis_panel, NULL, 1};
            ta_score_mods(a, R, p, Sp, k1 - k0, k0, pflags, cmax, NULL, &Up);
        }
        TA_PROF(pt, fwd_mods);
        fwd_softmax(a, R, p, Sp, k1 - k0, k0, W->m, W->l, W->cmax, acc, Dv);
        TA_PROF(pt, fwd_softmax);
        ta_gemm(Dv, 1, k1 - k0, ta_opa_cols(V + (k0 - j0) * vld, vld), Sp, 0, acc, 0, 1, 1, NULL, &pf, budget);
        TA_PROF(pt, fwd_pv);
    }
}

/* The tiles of one task, from the packed queries to out and lse. */
static int fwd_tiles(const ta_args *a, const fwd_plan *P, const fwd_task *t, const ta_seq *s, const ta_rows *R,
                     const fwd_bufs *W) {
    const int64_t npan = R->npan, lanes = npan * PW, tp = W->sp * PW;
    for (int64_t r = 0; r < lanes; r++) W->m[r] = -INFINITY, W->l[r] = 0;
    memset(W->acc, 0, (size_t)(lanes * W->accr) * sizeof(real));
    /* tiles start on multiples of bn whatever the query block, so a row meets the same tiles (and
     * gets the same bits) however the rows are grouped into blocks */
    int64_t jlo = ta_band_lo(a, s, R->i0) / P->bn * P->bn, jhi = ta_band_hi(a, s, R->i0 + R->nq - 1) + 1;
    for (int64_t j0 = jlo; j0 < jhi; j0 += P->bn) {
        if (ta_cancelled(a)) return TA_CANCELLED;
        TA_PROF_T(pt);
        int64_t j1 = j0 + P->bn < jhi ? j0 + P->bn : jhi, n = j1 - j0;
        int flags = (P->mods ? TA_TILE_MODS : 0) | (ta_tile_on_edge(R, j0, j1) ? TA_TILE_EDGE : 0);
        if (a->mask) {
            int census = ta_mask_census(a, R, j0, j1);
            if (census == 2) continue; /* every score hidden: the tile changes nothing */
            if (census == 1) flags |= TA_TILE_MASK;
        }
        /* the fused user sweep scales the AMX engine's unscaled scores itself (fp32 and vdpbf16ps GEMMs
         * scale in their epilogue) */
        const int fused_amx = P->engine == FWD_AMX && ta_user_fused(a);
        ta_user_tile U = {W->ukv, NULL, n * PW, NULL, fused_amx ? (real)a->scale : 1};
        if (a->user) {
            int user = ta_user_tile_mask(a, R, j0, j1, W->ukv, W->uvis, W->uvlo, W->uvhi);
            if (user < 0) continue; /* the block map or the mask_mod hides the whole tile */
            if (user > 0) flags |= TA_TILE_USER, U.vis = W->uvis;
        }
        real alpha = (real)(P->mods ? a->scale : a->scale * TA_LOG2E);
        TA_PROF(pt, fwd_mods);
        if (P->engine == FWD_F32) {
            fwd_tile_f32(a, P, s, R, W, t->hk, j0, j1, j1 + P->bn < jhi ? P->bn : jhi - j1, flags, alpha, &U);
            continue;
        }
#if defined(TA_HAVE_AMX) || defined(TA_HAVE_BF16DOT)
        for (int64_t r = 0; r < lanes; r++) W->cmax[r] = -INFINITY;
        fwd_scores_bf16(a, P, s, t->hk, j0, n, npan, W, alpha, flags ? NULL : W->cmax, !fused_amx);
        TA_PROF(pt, fwd_scores);
        if (flags)
            for (int64_t p = 0; p < npan; p++)
                ta_score_mods(a, R, p, W->S + p * tp, n, j0, flags, W->cmax + p * PW, NULL, &U);
        TA_PROF(pt, fwd_mods);
        int speculate = P->engine == FWD_AMX && !flags;
        for (int64_t p = 0; p < npan; p++)
            fwd_softmax_pairs(a, R, p, W->S + p * tp, speculate ? alpha : 1, speculate, W->p2 + p * tp, n, j0, W->m,
                              W->l, W->cmax, W->acc + p * W->accr * PW, a->Dv);
        TA_PROF(pt, fwd_softmax);
        fwd_accumulate_bf16(a, P, s, t->hk, j0, n, npan, W);
        TA_PROF(pt, fwd_pv);
#endif
    }
    TA_PROF_T(pt);
    fwd_finish(a, s, R, W->acc, W->accr, W->m, W->l, W->tmp);
    TA_PROF(pt, fwd_finish);
    return TA_OK;
}

/* AMX: the keys every query block of the task may see, K as padded rows and V^T as key pairs,
 * packed once per task (task scratch slot 1) and shared by its query blocks. */
static int fwd_amx_pack(const ta_args *a, const fwd_plan *P, const fwd_task *t, const ta_seq *s, fwd_bufs *W) {
#ifdef TA_HAVE_AMX
    int64_t i_last = t->i0 + t->nqb * P->bmq;
    i_last = (i_last < s->q_len ? i_last : s->q_len) - 1;
    W->kbase = ta_band_lo(a, s, t->i0) / P->bn * P->bn;
    int64_t range = ta_band_hi(a, s, i_last) + 1 - W->kbase, dpad = 2 * W->q2;
    if (range < 0) range = 0;
    W->kld = ta_round_up(range, 32) + 32;
    uint16_t *mem = (uint16_t *)ta_scratch(1, (size_t)(W->kld * (dpad + W->accr)) * 2);
    if (!mem) return TA_ENOMEM;
    W->k2 = mem;
    W->v2 = mem + W->kld * dpad;
    ta_amx_pack_rows(W->k2, a, s, a->k, a->k_st, s->k0, t->hk, W->kbase, range, a->D, W->kld, dpad);
    ta_amx_pack_vt(W->v2, W->kld, a, s, a->v, a->v_st, s->v0, t->hk, W->kbase, range, a->Dv, W->accr);
#else
    (void)a, (void)P, (void)t, (void)s, (void)W;
#endif
    return TA_OK;
}

/* fp32 tiles of fp16/bf16 (or paged) inputs: the task's keys converted to fp32 rows once, shared by
 * its query blocks, instead of once per tile. */
static int fwd_convert(const ta_args *a, const fwd_plan *P, const fwd_task *t, const ta_seq *s, fwd_bufs *W) {
    int64_t i_last = t->i0 + t->nqb * P->bmq;
    i_last = (i_last < s->q_len ? i_last : s->q_len) - 1;
    W->kbase = ta_band_lo(a, s, t->i0) / P->bn * P->bn;
    int64_t range = ta_band_hi(a, s, i_last) + 1 - W->kbase;
    if (range <= 0) return TA_OK;
    real *mem = (real *)ta_scratch(1, (size_t)(range * (a->D + a->Dv)) * sizeof(real));
    if (!mem) return TA_ENOMEM;
    int64_t ld;
    W->kconv = mem;
    W->vconv = mem + range * a->D;
    for (int64_t j = 0; j < range; j++) {
        ta_kv_rows(a, s, a->k, a->k_st, s->k0, t->hk, W->kbase + j, 1, a->D, W->kconv + j * a->D, &ld);
        ta_kv_rows(a, s, a->v, a->v_st, s->v0, t->hk, W->kbase + j, 1, a->Dv, W->vconv + j * a->Dv, &ld);
    }
    return TA_OK;
}

static int fwd_block(const ta_args *a, const void *plan, const void *task) {
    const fwd_plan *P = (const fwd_plan *)plan;
    const fwd_task *t = (const fwd_task *)task;
    ta_seq s;
    ta_seq_init(a, t->b, &s);
    const int64_t G = a->Hq / a->Hkv;
    fwd_bufs W;
    void *rows_mem;
    TA_PROF_T(tp);
    if (fwd_bufs_get(a, P, (P->bmq * G + PW - 1) / PW, &rows_mem, &W)) return TA_ENOMEM;
    if (P->engine == FWD_AMX && fwd_amx_pack(a, P, t, &s, &W)) return TA_ENOMEM;
    if (P->engine == FWD_F32 && P->convert && fwd_convert(a, P, t, &s, &W)) return TA_ENOMEM;
    TA_PROF(tp, fwd_kv_convert);
    int status = TA_OK;
#ifdef TA_HAVE_AMX
    if (P->engine == FWD_AMX) ta_amx_begin();
#endif
    for (int64_t qb = 0; qb < t->nqb && status == TA_OK; qb++) {
        int64_t i0 = t->i0 + qb * P->bmq, nq = s.q_len - i0 < P->bmq ? s.q_len - i0 : P->bmq;
        if (nq <= 0) break;
        TA_PROF_T(tq);
        ta_rows R;
        ta_rows_init(&R, rows_mem, a, &s, t->hk, i0, nq);
        if (P->engine == FWD_F32)
            ta_pack_rows(W.Qt, 1, a->q, a->dtype, a->q_st, s.q0, &R, a->D, W.tmp);
#if defined(TA_HAVE_AMX) || defined(TA_HAVE_BF16DOT)
        else
            ta_pack_pairs_T(W.qt2, a->q, a->q_st, s.q0, &R, a->D, W.q2);
#endif
        TA_PROF(tq, fwd_pack);
        status = fwd_tiles(a, P, t, &s, &R, &W);
    }
#ifdef TA_HAVE_AMX
    if (P->engine == FWD_AMX) ta_amx_end();
#endif
    return status;
}

/* Longest first; equal costs in (sequence, kv head, block) order, so a thread that takes consecutive
 * tasks of one head often finds its K and V still in L2. */
static int fwd_cost_desc(const void *x, const void *y) {
    const fwd_task *a = (const fwd_task *)x, *b = (const fwd_task *)y;
    if (a->cost != b->cost) return (a->cost < b->cost) - (a->cost > b->cost);
    return (a->order > b->order) - (a->order < b->order);
}

/* Query blocks of a task, at `lanes` lanes (query rows times the G heads of a kv head). */
static int64_t fwd_units(const ta_args *a, int64_t bmq) {
    int64_t units = 0;
    for (int64_t b = 0; b < a->B; b++) units += (ta_seq_q_rows(a, b) + bmq - 1) / bmq * a->Hkv;
    return units;
}

/* Keys per tile: 256 amortise the softmax's per-tile bookkeeping; wide heads take fewer, so that a
 * tile of K and V stays ~256 KiB. Query lanes per block: the most of 512, 256, ..., 32 whose working
 * set (Q^T, the accumulator and the scores of the block, K and V of a tile) fits 3/4 of this core's
 * L2 and which still gives every thread 4 blocks. Each block streams the whole key range through L2,
 * so wider blocks read K and V less often per FLOP (in the two GEMMs at S=4096, 128 lanes: 88 % of
 * the FMA peak, 256: 92 %). GQA trades query rows for heads at the same lane count. The tile grid
 * is fixed (fwd_tiles), so the choice changes no bit of the result. */
static void fwd_tiling(const ta_args *a, int64_t G, int64_t nthreads, fwd_plan *P) {
    const int64_t width = a->D + a->Dv;
    int64_t bn = 256 * 256 / width / 32 * 32;
    P->bn = a->block_n > 0 ? a->block_n : bn < 64 ? 64 : bn > 256 ? 256 : bn;
    /* AMX tiles are whole 32-key blocks; their K and V are bf16 copies packed once per task, so wide
     * heads keep 256 keys a tile (at D=512, 64 keys a tile ran at 0.85x SDPA's own AMX path) */
    if (P->engine == FWD_AMX) P->bn = a->block_n > 0 ? ta_round_up(a->block_n, 32) : 256;
    if (a->block_m > 0) {
        P->bmq = a->block_m / G > 0 ? a->block_m / G : 1;
        return;
    }
    int64_t lanes = P->engine == FWD_AMX ? 128 : 512;
    while (lanes > 32) {
        int64_t bytes = (lanes * (width + P->bn) + P->bn * width) * (int64_t)sizeof(real);
        int64_t bmq = lanes / G > 0 ? lanes / G : 1;
        if (bytes <= ta_l2_bytes() / 4 * 3 && fwd_units(a, bmq) >= 4 * nthreads) break;
        lanes /= 2;
    }
    P->bmq = lanes / G > 0 ? lanes / G : 1;
}

static int prefill(const ta_args *a) {
    int64_t G = a->Hq / a->Hkv;
    fwd_plan P;
    P.mods = ta_transforms(a) || ta_user_scores(a);
    P.engine = FWD_F32;
#ifdef TA_HAVE_BF16DOT
    if (a->dtype == TA_BF16 && (a->options & TA_OPT_BF16DOT) && !(a->options & TA_OPT_NO_BF16DOT))
        P.engine = FWD_BF16DOT;
#endif
#ifdef TA_HAVE_AMX
    if (a->dtype == TA_BF16 && !(a->options & TA_OPT_NO_AMX) && ta_amx_available()) P.engine = FWD_AMX;
#endif

    /* AMX tasks and converting fp32 tasks take several query blocks of a head, so the packed or
     * converted K and V serve them all; enough tasks remain for every thread. Grouping changes no
     * arithmetic: tiles start at fixed positions, so the result does not depend on it (nor on the
     * thread count that sets it). */
    int64_t nthreads = a->num_threads > 0 ? a->num_threads : 1;
    fwd_tiling(a, G, nthreads, &P);
    int64_t units = fwd_units(a, P.bmq);
    int native = TA_REAL_BITS == 64 ? a->dtype == TA_F64 : a->dtype == TA_F32;
    P.convert = P.engine == FWD_F32 && (!native || a->paged);
    int64_t group = (P.engine == FWD_AMX || P.convert) && units > 4 * nthreads ? units / (4 * nthreads) : 1;
    fwd_task *tasks = (fwd_task *)malloc((size_t)(units > 0 ? units : 1) * sizeof(fwd_task));
    if (!tasks) return TA_ENOMEM;
    int64_t nt = 0;
    double work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        if (ta_decode_takes(a, s.q_len)) continue;
        for (int64_t i0 = 0; i0 < s.q_len; i0 += P.bmq * group) {
            int64_t i1 = i0 + P.bmq * group < s.q_len ? i0 + P.bmq * group : s.q_len, cost = 0;
            for (int64_t i = i0; i < i1; i += P.bmq) {
                int64_t e = i + P.bmq < i1 ? i + P.bmq : i1;
                int64_t keys = ta_band_hi(a, &s, e - 1) + 1 - ta_band_lo(a, &s, i);
                cost += (keys > 0 ? keys : 0) * (e - i);
            }
            for (int64_t hk = 0; hk < a->Hkv; hk++) {
                tasks[nt] = (fwd_task){b, hk, i0, (i1 - i0 + P.bmq - 1) / P.bmq, cost,
                                       (b * a->Hkv + hk) * (a->Sq + 1) + i0 / P.bmq};
                nt++;
                work += (double)cost * G * (a->D + a->Dv);
            }
        }
    }
    /* longest first, so no thread is left with a long task at the end (causal, varlen) */
    qsort(tasks, (size_t)nt, sizeof(fwd_task), fwd_cost_desc);
    int status = ta_run_tasks(a, nt, work, tasks, sizeof(fwd_task), fwd_block, &P);
    free(tasks);
    return status;
}

int FN(forward)(const ta_args *a) {
    int64_t rest;
    int status = FN(decode)(a, &rest);
    return status == TA_OK && rest > 0 ? prefill(a) : status;
}
