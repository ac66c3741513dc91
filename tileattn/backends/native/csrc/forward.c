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
#include "gemm_bf16.h"
#include "kernels.h"
#include "tile.h"

typedef struct {
    int64_t bmq, bn; /* query rows (per head) and keys per tile */
    int mods;        /* softcap / ALiBi / bias: every tile takes the score pipeline */
    int bf16dot;     /* bf16 inputs multiplied by vdpbf16ps (P rounded to bf16 for P.V) */
} fwd_plan;

typedef struct {
    int64_t b, hk, i0, cost;
} fwd_task;

/* Step 3: online softmax of one panel of a tile; S holds base-2 logits and receives P. */
static void fwd_softmax(const ta_args *a, const ta_rows *R, int64_t p, real *S, int64_t n, int64_t j0, real *m,
                        real *l, const real *cmax, real *acc, int64_t Dv) {
    const int64_t base = p * PW;
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
    if (a->dropout_p > 0) {
        for (int64_t j = 0; j < n; j++)
            for (int v = 0; v < TA_NV; v++) {
                vr pr = vexp2(vload(S + j * PW + v * VW) - msub[v]);
                lsum[v] += pr;
                vstore(S + j * PW + v * VW, vselect(ta_drop_keep(a, R, base + v * VW, j0 + j), pr, vzero()));
            }
    } else {
        for (int64_t j = 0; j < n; j++)
            for (int v = 0; v < TA_NV; v++) {
                vr pr = vexp2(vload(S + j * PW + v * VW) - msub[v]);
                lsum[v] += pr;
                vstore(S + j * PW + v * VW, pr);
            }
    }
    for (int v = 0; v < TA_NV; v++) vstore(l + base + v * VW, vload(l + base + v * VW) + lsum[v]);
}

/* out = acc / l (scaled by 1/(1-p) under dropout), lse = (m + log2 l) ln 2; rows that saw no key: 0, -inf. */
static void fwd_finish(const ta_args *a, const ta_seq *s, const ta_rows *R, const real *acc, const real *m,
                       const real *l, real *tmp) {
    const int64_t Dv = a->Dv;
    const double keep_scale = 1.0 / (1.0 - a->dropout_p);
    for (int64_t r = 0; r < R->M; r++) {
        const real *col = acc + (r / PW) * Dv * PW + r % PW;
        double lr = l[r], lse;
        if (lr == 0) {
            memset(tmp, 0, (size_t)Dv * sizeof(real));
            lse = -INFINITY;
        } else {
            real inv = (real)(keep_scale / lr);
            for (int64_t c = 0; c < Dv; c++) tmp[c] = col[c * PW] * inv;
            lse = ((double)m[r] + log2(lr)) * TA_LN2;
        }
        int64_t h = R->head[r], i = R->row[r];
        ta_store_row((char *)a->out + (s->o0 + h * a->o_st[1] + i * a->o_st[2]) * ta_elsize(a->out_dtype), tmp, Dv,
                     a->out_dtype);
        int64_t lo = s->l0 + h * a->lse_st[1] + i * a->lse_st[2];
        if (TA_REAL_BITS == 64)
            ((double *)a->lse)[lo] = lse;
        else
            ((float *)a->lse)[lo] = (float)lse;
    }
}

/* The bf16 pair buffers of a task (vdpbf16ps path): Q^T, K rows, P and V as pairs. */
typedef struct {
    uint16_t *qt, *k, *p, *v;
} fwd_pairs;

static size_t fwd_pairs_bytes(const ta_args *a, const fwd_plan *P, int64_t lanes) {
    int64_t D2 = (a->D + 1) / 2, n2 = (P->bn + 1) / 2;
    return P->bf16dot ? (size_t)(lanes * D2 * 2 + P->bn * D2 * 2 + lanes * n2 * 2 + n2 * a->Dv * 2) * 2 : 0;
}

/* Step 1: S = alpha * K Q^T over the npan panels, and the column max when cmax is not NULL. */
static void fwd_scores(const ta_args *a, const fwd_plan *P, const ta_seq *s, int64_t hk, int64_t j0, int64_t n,
                       int64_t npan, const real *Qt, const fwd_pairs *pr, real *kbuf, real *S, real alpha,
                       real *cmax) {
    int64_t ld;
#ifdef TA_HAVE_BF16DOT
    if (P->bf16dot) {
        const uint32_t *K2 = ta_k_pairs(a, s, hk, j0, n, pr->k, &ld);
        int64_t D2 = (a->D + 1) / 2;
        ta_gemm_bf16(n, npan, D2, TA_A_ROWS, K2, ld, pr->qt, D2 * PW * 2, S, P->bn * PW, 0, alpha, cmax);
        return;
    }
#endif
    (void)pr;
    const real *K = ta_kv_rows(a, s, a->k, a->k_st, s->k0, hk, j0, n, a->D, kbuf, &ld);
    ta_gemm(n, npan, a->D, ta_opa_rows(K, ld), Qt, a->D * PW, S, P->bn * PW, 0, alpha, cmax);
}

/* Step 4: acc += V^T P over the npan panels (P in S). */
static void fwd_accumulate(const ta_args *a, const fwd_plan *P, const ta_seq *s, int64_t hk, int64_t j0,
                           int64_t n, int64_t npan, const fwd_pairs *pr, real *vbuf, const real *S, real *acc) {
    int64_t ld;
#ifdef TA_HAVE_BF16DOT
    if (P->bf16dot) {
        int64_t n2 = (n + 1) / 2, tp = (P->bn + 1) / 2 * PW * 2;
        for (int64_t p = 0; p < npan; p++) ta_pack_p_pairs(pr->p + p * tp, S + p * P->bn * PW, n);
        ta_pack_v_pairs(pr->v, a, s, hk, j0, n);
        ta_gemm_bf16(a->Dv, npan, n2, TA_A_COLS, (const uint32_t *)pr->v, a->Dv, pr->p, tp, acc, a->Dv * PW, 1, 1,
                     NULL);
        return;
    }
#endif
    (void)pr;
    const real *V = ta_kv_rows(a, s, a->v, a->v_st, s->v0, hk, j0, n, a->Dv, vbuf, &ld);
    ta_gemm(a->Dv, npan, n, ta_opa_cols(V, ld), S, P->bn * PW, acc, a->Dv * PW, 1, 1, NULL);
}

static int fwd_block(const ta_args *a, const void *plan, const void *task) {
    const fwd_plan *P = (const fwd_plan *)plan;
    const fwd_task *t = (const fwd_task *)task;
    const int64_t D = a->D, Dv = a->Dv, bn = P->bn;
    ta_seq s;
    ta_seq_init(a, t->b, &s);
    int64_t nq = s.q_len - t->i0 < P->bmq ? s.q_len - t->i0 : P->bmq;
    int64_t G = a->Hq / a->Hkv, npan = (nq * G + PW - 1) / PW, lanes = npan * PW;
    int64_t wmax = D > Dv ? D : Dv;
    size_t rows_bytes = ta_round_up((int64_t)ta_rows_bytes(npan), 64);
    size_t nreal = (size_t)(lanes * (D + bn + Dv + 3) + bn * (D + Dv) + wmax);
    char *mem = (char *)ta_scratch(0, rows_bytes + nreal * sizeof(real) + fwd_pairs_bytes(a, P, lanes) + 64);
    if (!mem) return TA_ENOMEM;
    ta_rows R;
    ta_rows_init(&R, mem, a, &s, t->hk, t->i0, nq);
    real *Qt = (real *)(mem + rows_bytes), *S = Qt + lanes * D, *acc = S + lanes * bn, *m = acc + lanes * Dv;
    real *l = m + lanes, *cmax = l + lanes, *kbuf = cmax + lanes, *vbuf = kbuf + bn * D, *tmp = vbuf + bn * Dv;
    fwd_pairs pr;
    pr.qt = (uint16_t *)(mem + ta_round_up((int64_t)(rows_bytes + nreal * sizeof(real)), 64));
    pr.k = pr.qt + lanes * ((D + 1) / 2) * 2;
    pr.p = pr.k + bn * ((D + 1) / 2) * 2;
    pr.v = pr.p + lanes * ((bn + 1) / 2) * 2;

#ifdef TA_HAVE_BF16DOT
    if (P->bf16dot)
        ta_pack_q_pairs(pr.qt, a, &s, &R);
    else
#endif
        ta_pack_rows(Qt, 1, a->q, a->dtype, a->q_st, s.q0, &R, D, tmp);
    for (int64_t r = 0; r < lanes; r++) m[r] = -INFINITY, l[r] = 0;
    memset(acc, 0, (size_t)(lanes * Dv) * sizeof(real));

    int64_t jlo = ta_band_lo(a, &s, t->i0), jhi = ta_band_hi(a, &s, t->i0 + nq - 1) + 1;
    for (int64_t j0 = jlo; j0 < jhi; j0 += bn) {
        if (ta_cancelled(a)) return TA_CANCELLED;
        int64_t j1 = j0 + bn < jhi ? j0 + bn : jhi, n = j1 - j0;
        int flags = (P->mods ? TA_TILE_MODS : 0) | (ta_tile_on_edge(&R, j0, j1) ? TA_TILE_EDGE : 0);
        if (a->mask) {
            int census = ta_mask_census(a, &R, j0, j1);
            if (census == 2) continue; /* every score hidden: the tile changes nothing */
            if (census == 1) flags |= TA_TILE_MASK;
        }
        for (int64_t r = 0; r < lanes; r++) cmax[r] = -INFINITY;
        real alpha = (real)(P->mods ? a->scale : a->scale * TA_LOG2E);
        fwd_scores(a, P, &s, t->hk, j0, n, npan, Qt, &pr, kbuf, S, alpha, flags ? NULL : cmax);
        if (flags)
            for (int64_t p = 0; p < npan; p++)
                ta_score_mods(a, &R, p, S + p * bn * PW, n, j0, flags, cmax + p * PW, NULL);
        for (int64_t p = 0; p < npan; p++)
            fwd_softmax(a, &R, p, S + p * bn * PW, n, j0, m, l, cmax, acc + p * Dv * PW, Dv);
        fwd_accumulate(a, P, &s, t->hk, j0, n, npan, &pr, vbuf, S, acc);
    }
    fwd_finish(a, &s, &R, acc, m, l, tmp);
    return TA_OK;
}

static int fwd_cost_desc(const void *x, const void *y) {
    int64_t a = ((const fwd_task *)x)->cost, b = ((const fwd_task *)y)->cost;
    return (a < b) - (a > b);
}

static int prefill(const ta_args *a) {
    int64_t G = a->Hq / a->Hkv;
    fwd_plan P;
    /* ~128 lanes per tile (4 AVX-512 panels): the packed Q^T, the score tile and the accumulator
     * stay in L2 while K and V stream through; 256 keys per tile amortise the per-tile softmax
     * bookkeeping. GQA trades query rows for heads at the same lane count. */
    int64_t lanes = a->block_m > 0 ? a->block_m : 128;
    P.bmq = lanes / G > 0 ? lanes / G : 1;
    P.bn = a->block_n > 0 ? a->block_n : 256;
    P.mods = a->softcap > 0 || a->alibi || a->bias;
#ifdef TA_HAVE_BF16DOT
    P.bf16dot = a->dtype == TA_BF16 && (a->options & TA_OPT_BF16DOT) && !(a->options & TA_OPT_NO_BF16DOT);
#else
    P.bf16dot = 0;
#endif

    int64_t ntasks = 0;
    for (int64_t b = 0; b < a->B; b++) ntasks += (ta_seq_q_rows(a, b) + P.bmq - 1) / P.bmq * a->Hkv;
    fwd_task *tasks = (fwd_task *)malloc((size_t)(ntasks > 0 ? ntasks : 1) * sizeof(fwd_task));
    if (!tasks) return TA_ENOMEM;
    int64_t nt = 0;
    double work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        for (int64_t i0 = 0; i0 < s.q_len; i0 += P.bmq) {
            int64_t i1 = i0 + P.bmq < s.q_len ? i0 + P.bmq : s.q_len;
            int64_t keys = ta_band_hi(a, &s, i1 - 1) + 1 - ta_band_lo(a, &s, i0);
            for (int64_t hk = 0; hk < a->Hkv; hk++) {
                tasks[nt++] = (fwd_task){b, hk, i0, keys > 0 ? keys : 0};
                work += (double)(keys > 0 ? keys : 0) * (i1 - i0) * G * (a->D + a->Dv);
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
    int64_t G = a->Hq / a->Hkv;
    int decode = (a->options & TA_OPT_FORCE_DECODE) ||
                 (!(a->options & TA_OPT_FORCE_PREFILL) && a->Sq * G <= TA_DECODE_MAX_ROWS);
    return decode ? FN(decode)(a) : prefill(a);
}
