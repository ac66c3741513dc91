/* Forward pass for a few query rows against many keys: decode steps against a KV cache, as stored.
 *
 * With few rows per kv head (Sq * G <= TA_DECODE_MAX_ROWS) a transposed tile would be mostly empty,
 * and the call is bound by reading K and V once. So each sequence's keys are cut into chunks whose
 * length depends only on that sequence's key count (never on the thread count or on the other
 * sequences), and a task is (sequence, kv head, block of query rows, chunk):
 *
 *   1. scores  each row's dot products with VW keys at a time: VW accumulators over d, then one
 *              transposing reduction gives the VW scores in one vector; up to four rows (the G
 *              heads of a kv head) share every load of K
 *   2. softmax the score pipeline along the row, the chunk's exact maximum, P = 2^(s - m), l
 *   3. P.V     acc[row] += P[row][j] * V[j], each V vector loaded once for up to four rows
 *
 * K and V are read in place in their own format (kv.h) and widened to fp32 in registers: bf16,
 * fp16, int8, fp8 e4m3 / e5m2, int4. A quantised cache's scales are folded where they are linear:
 * a per-channel K scale into q, a per-key K scale and offset into the score, a per-key V scale into
 * P, per-channel V scales and offsets into the accumulator (kv.h's classes); scales that vary with
 * both the key and the channel (per-token groups, int4's Q4_0 blocks) multiply each widened vector
 * (dec_groups) when a group spans whole vectors. Other groups, and head dims that are not a multiple
 * of the vector width, take rows dequantised into a tile buffer first ("converted rows"). Rows are
 * prefetched ahead of the dot products: a BSND cache's rows of one head lie heads * D apart, which
 * the hardware's stream prefetch does not follow.
 *
 * Each task leaves (acc, m, l) per row; a merge combines the chunks of a row in chunk order,
 * lse = log2-sum of the partial sums (see the anchors' "merging partial attention"). Chunks run in
 * parallel when the batch and heads cannot fill the threads (split-KV), and the bits of a row are
 * the same whatever else is in the batch and however many threads run.
 *
 * In a ragged call (varlen queries) every sequence takes its own path: those with few rows come
 * here, the others go to the prefill tiles (forward.c), so a decode row's bits do not depend on the
 * prefill chunks beside it. A quantised cache is read only here: long sequences are cut into blocks
 * of DEC_BLOCK_ROWS rows, each its own tasks.
 */
#include "kernels.h"
#include "kv.h"
#include "tile.h"

/* Rows per task of a sequence with many query rows (a prefill chunk on a quantised cache). */
#define DEC_BLOCK_ROWS 16

typedef struct {
    int64_t b, hk, i0, nq, j0, j1, slot; /* query rows [i0, i0 + nq), keys [j0, j1), partials at slot */
    int64_t alone;                       /* the only task of its rows: it writes out and lse itself */
} dec_task;

typedef struct {
    int64_t Dp, Dvp; /* head dims padded to VW */
    int64_t kd;      /* format of K and V as the tasks read them */
    int direct;      /* K and V read in place; else converted rows */
    int ks, ko, vs, vo; /* classes (TA_QS_*) of k_scale, k_offset, v_scale, v_offset on the direct path */
    int64_t kG, vG;     /* K's / V's scales and offsets applied per (key, channel group) in registers: their
                           group count; 0 = folded by class (see dec_groups) */
    real *part;      /* per task and row: Dv accumulators, m, l */
    const dec_task *tasks;
    const int64_t *groups; /* tasks of (sequence, kv head, row block) g: [groups[g], groups[g + 1]) */
} dec_plan;

/* Key chunk length: a function of the key count only. 512 keys keep a chunk's K and V in L2;
 * long caches use longer chunks so the number of partial results stays bounded. */
static int64_t dec_chunk(int64_t k_len) {
    int64_t c = 512;
    while (c < 4096 && c * 16 < k_len) c *= 2;
    return c;
}

/* Query rows per task: a whole sequence when it has few, else blocks of DEC_BLOCK_ROWS rows. */
static int64_t dec_block_tokens(int64_t q_len, int64_t G) {
    if (q_len * G <= DEC_BLOCK_ROWS) return q_len;
    return DEC_BLOCK_ROWS / G > 0 ? DEC_BLOCK_ROWS / G : 1;
}

/* Accumulators of the score kernel: half the vector registers. */
#if TA_VBYTES == 64
#define DEC_ACC 16
#define DEC_PV_NV 4
#else
#define DEC_ACC 8
#define DEC_PV_NV 2
#endif
#define DEC_KG_MAX (VW < DEC_ACC ? VW : DEC_ACC)

/* Scales that vary with both the key and the channel (per-token groups of channels, int4's Q4_0
 * blocks), applied to K (or V) vectors in registers: channel c of key j reads as
 * x * s[j G + c / gw] + o[j G + c / gw] (o = offset * scale, NULL without offsets). A group spans
 * whole vectors (gw a multiple of VW); keys past the chunk have s = o = 0. */
typedef struct {
    const real *s, *o;
    int64_t G, gw;
} dec_groups;

TA_INLINE vr dec_grouped(vr x, const dec_groups *g, int64_t at) {
    return g->o ? vfma(x, vset1(g->s[at]), vset1(g->o[at])) : x * vset1(g->s[at]);
}

/* Dot products of nr (<= 4) query rows with VW keys of format kd: kg keys advance together
 * (kg * nr <= DEC_ACC independent FMA chains hide the FMA latency) and the rows share every load
 * of K; then one transposing reduction per row, times alpha. ``grouped``: K's group scales (keys
 * key0.. of ``gk``) apply to each vector as it is widened. */
TA_INLINE void dec_dots(const int kd, const int nr, const int grouped, const real *q, int64_t Dp,
                        const void *const *kr, const dec_groups *gk, int64_t key0, real alpha, real *out,
                        int64_t out_ld) {
    const int kg0 = DEC_ACC / nr >= 16 ? 16 : DEC_ACC / nr >= 8 ? 8 : DEC_ACC / nr >= 4 ? 4 : DEC_ACC / nr >= 2 ? 2 : 1;
    const int kg = kg0 < VW ? kg0 : VW;
    const int64_t gw = grouped ? gk->gw : Dp;
    vr acc[4][VW];
    for (int t0 = 0; t0 < VW; t0 += kg) {
        vr x[4][DEC_KG_MAX];
        for (int u = 0; u < kg; u++)
            for (int r = 0; r < nr; r++) x[r][u] = vzero();
        for (int64_t g = 0, d = 0; d < Dp; g++)
            for (int64_t e = 0; e < gw; e += VW, d += VW) {
                vr qv[4];
                for (int r = 0; r < nr; r++) qv[r] = vload(q + r * Dp + d);
                for (int u = 0; u < kg; u++) {
                    vr k = ta_kv_vload(kr[t0 + u], d, kd);
                    if (grouped) k = dec_grouped(k, gk, (key0 + t0 + u) * gk->G + g);
                    for (int r = 0; r < nr; r++) x[r][u] = vfma(qv[r], k, x[r][u]);
                }
            }
        for (int r = 0; r < nr; r++)
            for (int u = 0; u < kg; u++) acc[r][t0 + u] = x[r][u];
    }
    for (int r = 0; r < nr; r++) vstore(out + r * out_ld, vsums(acc[r]) * alpha);
}

/* Software prefetch of the rows [j0, j1) of rows (row_bytes each, clipped to n rows): a cache whose
 * keys lie apart (BSND: one head's rows are heads * D elements apart, two to a 4 KiB page) defeats
 * the hardware's stream prefetch, and a decode step is then bound by the latency of each row. */
static inline void dec_prefetch(const void *const *rows, int64_t j0, int64_t j1, int64_t n, int64_t row_bytes) {
    for (int64_t j = j0; j < j1 && j < n; j++)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch((const char *)rows[j] + b, 0, 3);
}

/* Bytes of a row of w elements of format kd (int4: two a byte; q8_0 / q4_0: whole blocks of 32). */
static inline int64_t dec_row_bytes(int64_t kd, int64_t w) {
    if (kd == TA_Q8_0 || kd == TA_Q4_0) return (w + 31) / 32 * ta_block_bytes(kd);
    return kd == TA_I4 ? w / 2 : w * ta_kv_elsize(kd);
}

/* Step 1 for rows [0, M) (q: M rows of Dp values): alpha * q.k of keys [0, n) into S (np per row). */
TA_INLINE void dec_scores_kd(const int kd, const int grouped, const real *q, int64_t M, int64_t Dp,
                             const void *const *krows, const dec_groups *gk, int64_t n, real alpha, real *S,
                             int64_t np, const void *zero) {
    const int64_t rb = dec_row_bytes(kd, Dp);
    dec_prefetch(krows, 0, VW, n, rb);
    for (int64_t t0 = 0; t0 < n; t0 += VW) {
        dec_prefetch(krows, t0 + VW, t0 + 2 * VW, n, rb); /* the next block while this one computes */
        const void *kr[VW];
        for (int t = 0; t < VW; t++) kr[t] = t0 + t < n ? krows[t0 + t] : zero;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) dec_dots(kd, 4, grouped, q + r * Dp, Dp, kr, gk, t0, alpha, S + r * np + t0, np);
        if (M - r == 3) dec_dots(kd, 3, grouped, q + r * Dp, Dp, kr, gk, t0, alpha, S + r * np + t0, np);
        if (M - r == 2) dec_dots(kd, 2, grouped, q + r * Dp, Dp, kr, gk, t0, alpha, S + r * np + t0, np);
        if (M - r == 1) dec_dots(kd, 1, grouped, q + r * Dp, Dp, kr, gk, t0, alpha, S + r * np + t0, np);
    }
}

/* acc[r][c0 : c0 + nv*VW) += sum_j P[r][j] * V[j][c0 : ...) for the rows r < nr (<= 4) over keys
 * [0, n): each V vector is loaded (and widened) once for all rows, with nr * nv accumulators. */
TA_INLINE void dec_pv(const int kd, const int nr, const int nv, const int grouped, real *acc, int64_t acc_ld,
                      const real *P, int64_t p_ld, const void *const *vrows, const dec_groups *gv, int64_t c0,
                      int64_t n) {
    vr x[4][DEC_PV_NV];
    int64_t group[DEC_PV_NV];
    for (int k = 0; k < nv; k++) group[k] = grouped ? (c0 + k * VW) / gv->gw : 0;
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nv; k++) x[r][k] = vload(acc + r * acc_ld + k * VW);
    const int64_t rb = dec_row_bytes(kd, c0 + nv * VW), ahead = 16;
    dec_prefetch(vrows, 0, ahead, n, rb);
    for (int64_t j = 0; j < n; j++) {
        dec_prefetch(vrows, j + ahead, j + ahead + 1, n, rb);
        vr vv[DEC_PV_NV];
        for (int k = 0; k < nv; k++) {
            vv[k] = ta_kv_vload(vrows[j], c0 + k * VW, kd);
            if (grouped) vv[k] = dec_grouped(vv[k], gv, j * gv->G + group[k]);
        }
        for (int r = 0; r < nr; r++) {
            vr p = vset1(P[r * p_ld + j]);
            for (int k = 0; k < nv; k++) x[r][k] = vfma(p, vv[k], x[r][k]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nv; k++) vstore(acc + r * acc_ld + k * VW, x[r][k]);
}

/* Step 3 for rows [0, M): blocks of 4 rows x DEC_PV_NV vectors of Dv, then the leftovers. */
TA_INLINE void dec_pv_kd(const int kd, const int gr, real *acc, int64_t Dvp, const real *P, int64_t np,
                         const void *const *vrows, const dec_groups *gv, int64_t M, int64_t n) {
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        int nr = M - r0 >= 4 ? 4 : (int)(M - r0);
        real *a = acc + r0 * Dvp;
        const real *p = P + r0 * np;
        for (int64_t c = 0; c < Dvp;) {
            int nv = Dvp - c >= DEC_PV_NV * VW ? DEC_PV_NV : 1;
            if (nr == 4 && nv == DEC_PV_NV)
                dec_pv(kd, 4, DEC_PV_NV, gr, a + c, Dvp, p, np, vrows, gv, c, n);
            else if (nv == DEC_PV_NV)
                for (int r = 0; r < nr; r++)
                    dec_pv(kd, 1, DEC_PV_NV, gr, a + r * Dvp + c, Dvp, p + r * np, np, vrows, gv, c, n);
            else
                for (int r = 0; r < nr; r++) dec_pv(kd, 1, 1, gr, a + r * Dvp + c, Dvp, p + r * np, np, vrows, gv, c, n);
            c += nv * VW;
        }
    }
}

/* One instance of steps 1 and 3 per format (kd is a constant inside each), and one with group scales
 * per quantised format (DEC_GROUPED: the formats dec_groups_fit lets take them). */
#if TA_REAL_BITS == 32
#define DEC_FORMATS(X) \
    X(TA_BF16) X(TA_F16) X(TA_I8) X(TA_F8E4M3) X(TA_F8E4M3_FINITE) X(TA_F8E5M2) X(TA_I4) X(TA_Q8_0) X(TA_Q4_0)
#define DEC_GROUPED(X) X(TA_I8) X(TA_F8E4M3) X(TA_F8E4M3_FINITE) X(TA_F8E5M2) X(TA_I4)
#define DEC_NATIVE TA_F32
#else
#define DEC_FORMATS(X)
#define DEC_GROUPED(X)
#define DEC_NATIVE TA_F64
#endif

static void dec_scores(int64_t kd, const dec_groups *gk, const real *q, int64_t M, int64_t Dp,
                       const void *const *krows, int64_t n, real alpha, real *S, int64_t np, const void *zero) {
#define DEC_CASE(f) \
    case f: dec_scores_kd(f, 0, q, M, Dp, krows, gk, n, alpha, S, np, zero); return;
#define DEC_GCASE(f) \
    case f: dec_scores_kd(f, 1, q, M, Dp, krows, gk, n, alpha, S, np, zero); return;
    if (gk) {
        switch (kd) { DEC_GROUPED(DEC_GCASE) default: break; }
    } else {
        switch (kd) { DEC_FORMATS(DEC_CASE) default: break; }
    }
#undef DEC_CASE
#undef DEC_GCASE
    dec_scores_kd(DEC_NATIVE, 0, q, M, Dp, krows, gk, n, alpha, S, np, zero);
}

static void dec_pv_rows(int64_t kd, const dec_groups *gv, real *acc, int64_t Dvp, const real *P, int64_t np,
                        const void *const *vrows, int64_t M, int64_t n) {
#define DEC_CASE(f) \
    case f: dec_pv_kd(f, 0, acc, Dvp, P, np, vrows, gv, M, n); return;
#define DEC_GCASE(f) \
    case f: dec_pv_kd(f, 1, acc, Dvp, P, np, vrows, gv, M, n); return;
    if (gv) {
        switch (kd) { DEC_GROUPED(DEC_GCASE) default: break; }
    } else {
        switch (kd) { DEC_FORMATS(DEC_CASE) default: break; }
    }
#undef DEC_CASE
#undef DEC_GCASE
    dec_pv_kd(DEC_NATIVE, 0, acc, Dvp, P, np, vrows, gv, M, n);
}

/* Whether a row's scores go through the pipeline (raw scores in, base-2 logits out) rather than
 * arriving as base-2 logits from the dot products. */
static int dec_plain(const ta_args *a) { return !(ta_transforms(a) || ta_user_scores(a)); }

/* Step 2 for one row: raw scores in srow to base-2 logits through the score pipeline; -inf for
 * hidden keys and for the padding up to a multiple of VW. User functions (user.h) read the keys'
 * indices `kv` and n bytes of scratch `vis`. */
static void dec_logits(const ta_args *a, const ta_seq *s, int64_t n, int64_t j0, int64_t h, int64_t i, real *srow,
                       const int32_t *kv, uint8_t *vis) {
    const int plain = dec_plain(a);
    const int64_t nv = ta_round_up(n, VW);
    if (!plain) ta_row_transform(a, s->b, h, i, s->off, srow, j0, n);
    if (a->user) {
        ta_user_decode_row(a, s, h, i, srow, n, j0, kv, vis);
        if (!plain && ta_user_scores(a))
            for (int64_t j = 0; j < n; j++) srow[j] *= (real)TA_LOG2E;
    }
    /* the band hides keys before lo and after hi; the padding past n is hidden too */
    int64_t lo = ta_band_lo(a, s, i) - j0, hi = ta_band_hi(a, s, i) - j0 + 1;
    lo = lo < 0 ? 0 : lo > nv ? nv : lo;
    hi = hi > n ? n : hi < lo ? lo : hi;
    for (int64_t j = 0; j < lo; j++) srow[j] = -INFINITY;
    for (int64_t j = hi; j < nv; j++) srow[j] = -INFINITY;
    if (a->mask) {
        const uint8_t *mask = (const uint8_t *)a->mask + s->b * a->mask_st[0] + h * a->mask_st[1] + i * a->mask_st[2];
        for (int64_t j = lo; j < hi; j++)
            if (!mask[(j0 + j) * a->mask_st[3]]) srow[j] = -INFINITY;
    }
}

/* ------------------------------------------------------------------------------ scales of a task */

/* One scale or offset of a task (sequence, kv head, keys [j0, j0 + n)) in the form its class
 * folds in: a scalar, a vector over the channels [0, width) or an array over the keys. */
typedef struct {
    int kind;
    real scalar;
    real *v; /* per channel (width) or per key (n, then padding) */
} dec_factor;

static void dec_factor_init(dec_factor *f, int kind, const ta_args *a, const ta_seq *s, int64_t hk, const void *p,
                            const int64_t st[6], int64_t width, int64_t j0, int64_t n, real *mem, real pad) {
    f->kind = kind;
    f->scalar = pad;
    f->v = mem;
    if (kind == TA_QS_SCALAR) {
        f->scalar = (real)ta_qs_at(p, st, s->b, hk, 0, 0);
    } else if (kind == TA_QS_CHANNEL) {
        int64_t per = width / st[5];
        for (int64_t c = 0; c < width; c++) mem[c] = (real)ta_qs_at(p, st, s->b, hk, 0, c / per);
    } else if (kind == TA_QS_TOKEN) {
        int64_t np = ta_round_up(n, VW);
        for (int64_t j = 0; j < n; j++) mem[j] = (real)ta_qs_at(p, st, s->b, hk, ta_qs_pos(a, s, st, j0 + j), 0);
        for (int64_t j = n; j < np; j++) mem[j] = pad;
    }
}

/* Whether a per-tensor/head or per-token K scale of keys [j0, j0 + n) is not finite. The direct path
 * multiplies q.k by that scale after the dot product: +-inf where the reference, which dequantises
 * the keys first, sums +-inf (or 0 * inf) channel terms into NaN. A task that meets one converts its
 * rows instead, which is the reference's arithmetic. */
static int dec_k_scale_nonfinite(const ta_args *a, const ta_seq *s, int kind, int64_t hk, int64_t j0, int64_t n) {
    if (kind != TA_QS_SCALAR && kind != TA_QS_TOKEN) return 0;
    for (int64_t j = 0; j < (kind == TA_QS_TOKEN ? n : 1); j++) {
        float x = ta_qs_at(a->k_scale, a->k_scale_st, s->b, hk, ta_qs_pos(a, s, a->k_scale_st, j0 + j), 0);
        if (x - x != 0) return 1; /* inf - inf and NaN - NaN are NaN */
    }
    return 0;
}

/* Group count G of a scale/offset pair applied per (key, channel group) in registers (dec_groups), or
 * 0: when one of them varies with both the key and the channel, the other is absent or one number
 * per key (or per sequence and head) or has the same groups, a group spans whole vectors, the format
 * has a grouped instance, and an offset does not meet e4m3's 2^-8 lanes. */
static int64_t dec_groups_fit(int sk, const int64_t sst[6], int ok, const int64_t ost[6], int64_t width, int64_t kd) {
    if (sk != TA_QS_GENERAL && ok != TA_QS_GENERAL) return 0;
    if (sk == TA_QS_CHANNEL || ok == TA_QS_CHANNEL) return 0;
    int64_t G = sk == TA_QS_GENERAL ? sst[5] : ost[5];
    if (sk == TA_QS_GENERAL && ok == TA_QS_GENERAL && sst[5] != ost[5]) return 0;
    if (width % G || (width / G) % VW) return 0;
    if (TA_REAL_BITS != 32 || !(kd == TA_I8 || kd == TA_F8E4M3 || kd == TA_F8E5M2 || kd == TA_I4)) return 0;
    if (ok != TA_QS_NONE && ta_kv_unit(kd) != 1) return 0;
    return G;
}

/* The group factors of keys [j0, j0 + n) (dec_groups: s = scale, o = offset * scale), zero past n
 * up to np; mem holds 2 np G reals. */
static void dec_groups_fill(dec_groups *g, real *mem, const ta_args *a, const ta_seq *s, int64_t hk, const void *sp,
                            const int64_t sst[6], int sk, const void *op, const int64_t ost[6], int ok, int64_t G,
                            int64_t width, int64_t j0, int64_t n, int64_t np) {
    real *sv = mem, *ov = ok != TA_QS_NONE ? mem + np * G : NULL;
    for (int64_t j = 0; j < n; j++) {
        int64_t spos = sk != TA_QS_NONE ? ta_qs_pos(a, s, sst, j0 + j) : 0;
        int64_t opos = ok != TA_QS_NONE ? ta_qs_pos(a, s, ost, j0 + j) : 0;
        for (int64_t c = 0; c < G; c++) { /* a class without groups has a group stride of 0 */
            real sc = sk != TA_QS_NONE ? (real)ta_qs_at(sp, sst, s->b, hk, spos, c) : 1;
            sv[j * G + c] = sc;
            if (ov) ov[j * G + c] = (real)ta_qs_at(op, ost, s->b, hk, opos, c) * sc;
        }
    }
    memset(sv + n * G, 0, (size_t)((np - n) * G) * sizeof(real));
    if (ov) memset(ov + n * G, 0, (size_t)((np - n) * G) * sizeof(real));
    g->s = sv;
    g->o = ov;
    g->G = G;
    g->gw = width / G;
}

/* Addresses of keys [j0, j0 + n) of kv head hk in a k-like tensor of element size es: strided within
 * a sequence, one block-table lookup per page for a paged cache. */
static void dec_row_ptrs(const ta_args *a, const ta_seq *s, const void *base, const int64_t st[3], int64_t seq_off,
                         int64_t hk, int64_t j0, int64_t n, int64_t es, const void **rows) {
    const char *b = (const char *)base;
    const int64_t step = es * st[2];
    if (!a->paged) {
        const char *p = b + es * (seq_off + hk * st[1] + j0 * st[2]);
        for (int64_t j = 0; j < n; j++) rows[j] = p + j * step;
        return;
    }
    const int32_t *bt = (const int32_t *)a->block_table;
    for (int64_t j = 0; j < n;) {
        int64_t key = j0 + j, slot = key % a->page_size, cnt = a->page_size - slot < n - j ? a->page_size - slot : n - j;
        const char *p = b + es * (bt[s->b * a->bt_st[0] + (key / a->page_size) * a->bt_st[1]] * st[0] + hk * st[1] +
                                  slot * st[2]);
        for (int64_t u = 0; u < cnt; u++) rows[j + u] = p + u * step;
        j += cnt;
    }
}

/* Converted rows: keys [j0, j0 + n) of kv head hk of a k-like tensor, dequantised with any scale
 * and offset, into buf (n rows of wpad reals, zero padded). */
static void dec_convert_rows(const ta_args *a, const ta_seq *s, const void *base, const int64_t st[3],
                             int64_t seq_off, int64_t hk, int64_t j0, int64_t n, int64_t width, int64_t wpad,
                             const void *scale, const int64_t sst[6], const void *offset, const int64_t ost[6],
                             real *buf, const void **rows) {
    const int64_t kd = ta_kv_dtype(a), es = ta_kv_elsize(kd);
    const int64_t sper = scale ? width / sst[5] : 1, oper = offset ? width / ost[5] : 1;
    for (int64_t j = 0; j < n; j++) {
        const char *src = (const char *)base + es * ta_key_off(a, s, st, seq_off, hk, j0 + j);
        real *dst = buf + j * wpad;
        int64_t spos = scale ? ta_qs_pos(a, s, sst, j0 + j) : 0, opos = offset ? ta_qs_pos(a, s, ost, j0 + j) : 0;
        for (int64_t c = 0; c < width; c++) {
            real x = (real)ta_kv_load1(src, c, kd);
            if (offset) x += (real)ta_qs_at(offset, ost, s->b, hk, opos, c / oper);
            if (scale) x *= (real)ta_qs_at(scale, sst, s->b, hk, spos, c / sper);
            dst[c] = x;
        }
        memset(dst + width, 0, (size_t)(wpad - width) * sizeof(real));
        rows[j] = dst;
    }
}

/* Row i, query head h of sequence s: out (normalised) and lse = (m + log2(l)) ln 2 (-inf when the row
 * saw no key). */
static void dec_write_row(const ta_args *a, const ta_seq *s, int64_t i, int64_t h, const real *row, double m,
                          double l) {
    double lse = l == 0 ? -INFINITY : (m + log2(l)) * TA_LN2;
    ta_store_row((char *)a->out + (s->o0 + h * a->o_st[1] + i * a->o_st[2]) * ta_elsize(a->out_dtype), row, a->Dv,
                 a->out_dtype);
    int64_t lo = s->l0 + h * a->lse_st[1] + i * a->lse_st[2];
    if (TA_REAL_BITS == 64)
        ((double *)a->lse)[lo] = lse;
    else
        ((float *)a->lse)[lo] = (float)lse;
}

/* -------------------------------------------------------------------------------------- one task */

static int dec_block(const ta_args *a, const void *plan, const void *task) {
    const dec_plan *P = (const dec_plan *)plan;
    const dec_task *t = (const dec_task *)task;
    const int64_t D = a->D, Dv = a->Dv, Dp = P->Dp, Dvp = P->Dvp, G = a->Hq / a->Hkv, hk = t->hk;
    if (ta_cancelled(a)) return TA_CANCELLED;
    ta_seq s;
    ta_seq_init(a, t->b, &s);
    /* the keys of the chunk that some row of the block sees (none when a window ends before it) */
    int64_t j0 = ta_band_lo(a, &s, t->i0), j1 = ta_band_hi(a, &s, t->i0 + t->nq - 1) + 1;
    j0 = j0 > t->j0 ? j0 : t->j0;
    j1 = j1 < t->j1 ? j1 : t->j1;
    if (j1 < j0) j1 = j0;
    const int64_t M = t->nq * G, n = j1 - j0, np = ta_round_up(n, VW), W = Dp > Dvp ? Dp : Dvp;
    const int64_t F = np > W ? np : W; /* a scale factor's space: per key or per channel */
    /* (a grouped K scale meets its keys in registers, the reference's arithmetic: no check needed) */
    const int direct = P->direct && (P->kG || !dec_k_scale_nonfinite(a, &s, P->ks, hk, j0, n));
    size_t nreal = (size_t)(M * (Dp + np + Dvp + 2) + 4 * F + 2 * W + VW + 2 * np * (P->kG + P->vG));
    if (!direct) nreal += (size_t)(n * (Dp + Dvp));
    char *mem = (char *)ta_scratch(0, nreal * sizeof(real) + (size_t)(2 * n) * sizeof(void *));
    if (!mem) return TA_ENOMEM;
    real *q = (real *)mem, *S = q + M * Dp, *acc = S + M * np, *rowc = acc + M * Dvp, *fk = rowc + 2 * M;
    real *zero = fk + 4 * F, *gmem = zero + 2 * W + VW, *kbuf = gmem + 2 * np * (P->kG + P->vG), *vbuf = kbuf + n * Dp;
    const void **krows = (const void **)(mem + nreal * sizeof(real)), **vrows = krows + n;
    memset(zero, 0, (size_t)(2 * W + VW) * sizeof(real)); /* a zero row of any format */
    memset(acc, 0, (size_t)(M * Dvp) * sizeof(real));
    real *part = P->part + t->slot;
    int32_t *ukv = NULL;
    uint8_t *uvis = NULL;
    if (a->user) {
        if (ta_user_chunk_hidden(a, &s, hk, t->i0, t->nq, j0, j1)) { /* the block map hides the chunk */
            for (int64_t r = 0; r < M; r++) {
                real *pr = part + r * (Dv + 2);
                memset(pr, 0, (size_t)Dv * sizeof(real));
                pr[Dv] = -INFINITY;
                pr[Dv + 1] = 0;
            }
            return TA_OK;
        }
        char *user = (char *)ta_scratch(2, (size_t)(np * 5 + 64));
        if (!user) return TA_ENOMEM;
        ukv = (int32_t *)user;
        uvis = (uint8_t *)(ukv + np);
        ta_user_keys(ukv, j0, n);
    }

    dec_factor ks = {TA_QS_NONE, 1, NULL}, ko = {TA_QS_NONE, 0, NULL}, vs = ks, vo = ko;
    dec_groups kgroups, vgroups;
    const dec_groups *gk = NULL, *gv = NULL;
    int64_t kd = P->kd;
    real unit_k = 1, unit_v = 1;
    if (direct) {
        const int64_t es = ta_kv_elsize(kd);
        dec_row_ptrs(a, &s, a->k, a->k_st, s.k0, hk, j0, n, es, krows);
        dec_row_ptrs(a, &s, a->v, a->v_st, s.v0, hk, j0, n, es, vrows);
        /* most e4m3 chunks hold no NaN: a scan here spares every widening its NaN check */
        if (kd == TA_F8E4M3 && !vany_byte_7f(krows, n, D) && !vany_byte_7f(vrows, n, Dv)) kd = TA_F8E4M3_FINITE;
        if (P->kG) {
            dec_groups_fill(&kgroups, gmem, a, &s, hk, a->k_scale, a->k_scale_st, P->ks, a->k_offset, a->k_offset_st,
                            P->ko, P->kG, D, j0, n, np);
            gk = &kgroups;
        } else {
            dec_factor_init(&ks, P->ks, a, &s, hk, a->k_scale, a->k_scale_st, D, j0, n, fk, 1);
            dec_factor_init(&ko, P->ko, a, &s, hk, a->k_offset, a->k_offset_st, D, j0, n, fk + F, 0);
        }
        if (P->vG) {
            dec_groups_fill(&vgroups, gmem + 2 * np * P->kG, a, &s, hk, a->v_scale, a->v_scale_st, P->vs, a->v_offset,
                            a->v_offset_st, P->vo, P->vG, Dv, j0, n, np);
            gv = &vgroups;
        } else {
            dec_factor_init(&vs, P->vs, a, &s, hk, a->v_scale, a->v_scale_st, Dv, j0, n, fk + 2 * F, 1);
            dec_factor_init(&vo, P->vo, a, &s, hk, a->v_offset, a->v_offset_st, Dv, j0, n, fk + 3 * F, 0);
        }
        unit_k = unit_v = ta_kv_unit(kd);
    } else {
        const int quant = (a->options & TA_OPT_KV_QUANT) != 0;
        dec_convert_rows(a, &s, a->k, a->k_st, s.k0, hk, j0, n, D, Dp, quant ? a->k_scale : NULL, a->k_scale_st,
                         quant ? a->k_offset : NULL, a->k_offset_st, kbuf, krows);
        dec_convert_rows(a, &s, a->v, a->v_st, s.v0, hk, j0, n, Dv, Dvp, quant ? a->v_scale : NULL, a->v_scale_st,
                         quant ? a->v_offset : NULL, a->v_offset_st, vbuf, vrows);
        kd = DEC_NATIVE;
    }
    const real *kch = ks.kind == TA_QS_CHANNEL ? ks.v : NULL, *koch = ko.kind == TA_QS_CHANNEL ? ko.v : NULL;

    /* q rows (times a per-channel K scale), and what the K offset adds to each row's scores:
     * rowc[2r] = q'.offset (per channel or scalar offset), rowc[2r + 1] = sum(q') (per key) */
    for (int64_t r = 0; r < M; r++) {
        int64_t i = t->i0 + r / G, h = hk * G + r % G;
        real *qr = q + r * Dp;
        ta_load_row(qr, ta_at(a->q, s.q0 + h * a->q_st[1] + i * a->q_st[2], a->dtype), D, a->dtype);
        memset(qr + D, 0, (size_t)(Dp - D) * sizeof(real));
        if (kch)
            for (int64_t c = 0; c < D; c++) qr[c] *= kch[c];
        double dot_off = 0, sum = 0;
        if (ko.kind != TA_QS_NONE) {
            for (int64_t c = 0; c < D; c++) {
                sum += qr[c];
                dot_off += (double)qr[c] * (koch ? koch[c] : ko.scalar);
            }
        }
        rowc[2 * r] = (real)dot_off;
        rowc[2 * r + 1] = (real)sum;
        if (unit_k != 1)
            for (int64_t c = 0; c < D; c++) qr[c] *= unit_k;
    }

    /* scale * q_descale * a per-tensor/head K scale * log2(e) when no modifier needs raw scores */
    const int plain = dec_plain(a);
    double alpha = plain ? a->scale * TA_LOG2E : a->scale;
    if ((a->options & TA_OPT_KV_QUANT) && a->q_scale)
        alpha *= ((const float *)a->q_scale)[s.b * a->q_scale_st[0] + hk * a->q_scale_st[1]];
    if (ks.kind == TA_QS_SCALAR) alpha *= ks.scalar;
    const int per_key = ks.kind == TA_QS_TOKEN || ko.kind != TA_QS_NONE;
    dec_scores(kd, gk, q, M, Dp, krows, n, per_key ? 1 : (real)alpha, S, np, zero);
    if (per_key) /* s = alpha * scale_j * (q'.k_j + offset term) */
        for (int64_t r = 0; r < M; r++) {
            real *srow = S + r * np;
            for (int64_t j = 0; j < n; j++) {
                real off = ko.kind == TA_QS_TOKEN ? ko.v[j] * rowc[2 * r + 1] : rowc[2 * r];
                srow[j] = (srow[j] + off) * (real)alpha * (ks.kind == TA_QS_TOKEN ? ks.v[j] : 1);
            }
        }

    for (int64_t r = 0; r < M; r++) {
        int64_t i = t->i0 + r / G, h = hk * G + r % G;
        real *srow = S + r * np;
        dec_logits(a, &s, n, j0, h, i, srow, ukv, uvis);

        vr mv = vset1(-INFINITY);
        for (int64_t j = 0; j < np; j += VW) mv = vmax_(mv, vload(srow + j));
        real m = mv[0];
        for (int k = 1; k < VW; k++) m = mv[k] > m ? mv[k] : m;
        for (int k = 0; k < VW; k++) m = mv[k] != mv[k] ? mv[k] : m; /* a NaN score poisons the row */
        vr msub = vset1(m == -INFINITY ? 0 : m), lsum = vzero();
        uint32_t rk = a->dropout_p > 0 ? ta_drop_row_key(a, s.b, h, i) : 0;
        for (int64_t j = 0; j < np; j += VW) {
            vr p = vexp2(vload(srow + j) - msub);
            lsum += p;
            if (a->dropout_p > 0) {
                uint32_t first[VW];
                for (int k = 0; k < VW; k++) first[k] = (uint32_t)(j0 + j + k);
                vu32 cols;
                memcpy(&cols, first, sizeof cols);
                vu32 x = ta_vmix32(rk ^ (cols * TA_GOLDEN));
                p = vselect(vmask32((vs32)((x >> 8) >= (uint32_t)a->drop_threshold)), p, vzero());
            }
            vstore(srow + j, p);
        }
        real *pr = part + r * (Dv + 2);
        pr[Dv] = m;
        pr[Dv + 1] = vsum(lsum);
        /* a per-key V scale weighs P; the V offset adds offset * (sum of those weights) */
        if (vs.kind == TA_QS_TOKEN)
            for (int64_t j = 0; j < n; j++) srow[j] *= vs.v[j];
        double off = 0;
        if (vo.kind != TA_QS_NONE)
            for (int64_t j = 0; j < n; j++) off += (double)srow[j] * (vo.kind == TA_QS_TOKEN ? vo.v[j] : 1);
        rowc[2 * r] = (real)off;
    }
    dec_pv_rows(kd, gv, acc, Dvp, S, np, vrows, M, n);
    /* the V offset and a per-channel or scalar V scale (kinds read once: pr may alias nothing here,
     * but the compiler cannot know it) */
    const int vok = vo.kind, vsk = vs.kind;
    const real *vov = vo.v, *vsv = vs.v, vos = vo.scalar, vss = vs.scalar;
    for (int64_t r = 0; r < M; r++) {
        real *ar = acc + r * Dvp, off = rowc[2 * r];
        if (vok == TA_QS_NONE && (vsk == TA_QS_NONE || vsk == TA_QS_TOKEN)) {
            if (unit_v != 1)
                for (int64_t c = 0; c < Dv; c++) ar[c] *= unit_v;
        } else {
            for (int64_t c = 0; c < Dv; c++) {
                real x = ar[c] * unit_v;
                if (vok != TA_QS_NONE) x += vok == TA_QS_TOKEN ? off : off * (vok == TA_QS_CHANNEL ? vov[c] : vos);
                if (vsk != TA_QS_NONE && vsk != TA_QS_TOKEN) x *= vsk == TA_QS_CHANNEL ? vsv[c] : vss;
                ar[c] = x;
            }
        }
        if (t->alone) { /* no other chunk: normalise and write the row (dec_merge's arithmetic for one chunk) */
            const real *pr = part + r * (Dv + 2);
            double l = pr[Dv + 1];
            real inv = l == 0 ? 0 : (real)((1.0 / (1.0 - a->dropout_p)) / l);
            for (int64_t c = 0; c < Dv; c++) ar[c] *= inv;
            dec_write_row(a, &s, t->i0 + r / G, hk * G + r % G, ar, l == 0 ? -INFINITY : pr[Dv], l);
        } else {
            memcpy(part + r * (Dv + 2), ar, (size_t)Dv * sizeof(real));
        }
    }
    return TA_OK;
}

/* ------------------------------------------------------------------------------------------ merge */

/* Combine the chunks of one (sequence, kv head, row block) in chunk order and write out and lse. */
static int dec_merge(const ta_args *a, const void *plan, const void *task) {
    const dec_plan *P = (const dec_plan *)plan;
    const int64_t g = *(const int64_t *)task, t0 = P->groups[g], t1 = P->groups[g + 1];
    const dec_task *tasks = P->tasks, *first = tasks + t0;
    const int64_t Dv = a->Dv, G = a->Hq / a->Hkv;
    const double keep_scale = 1.0 / (1.0 - a->dropout_p);
    real *tmp = (real *)ta_scratch(1, (size_t)Dv * sizeof(real));
    if (!tmp) return TA_ENOMEM;
    ta_seq s;
    ta_seq_init(a, first->b, &s);
    for (int64_t r = 0; r < first->nq * G; r++) {
        double m = -INFINITY, l = 0;
        for (int64_t t = t0; t < t1; t++) {
            double mc = P->part[tasks[t].slot + r * (Dv + 2) + Dv];
            m = mc > m || mc != mc ? mc : m;
        }
        double msub = m == -INFINITY ? 0 : m;
        memset(tmp, 0, (size_t)Dv * sizeof(real));
        for (int64_t t = t0; t < t1; t++) {
            const real *pr = P->part + tasks[t].slot + r * (Dv + 2);
            real w = (real)exp2((double)pr[Dv] - msub);
            if (pr[Dv + 1] == 0) continue; /* the chunk saw no key of this row */
            l += (double)w * pr[Dv + 1];
            for (int64_t c = 0; c < Dv; c++) tmp[c] += w * pr[c];
        }
        real inv = l == 0 ? 0 : (real)(keep_scale / l);
        for (int64_t c = 0; c < Dv; c++) tmp[c] *= inv;
        dec_write_row(a, &s, first->i0 + r / G, first->hk * G + r % G, tmp, m, l);
    }
    return TA_OK;
}

/* ---------------------------------------------------------------------------------------- driver */

/* The tasks of one (sequence, kv head, row block): the chunks that hold a key some row sees, or one
 * empty task when there is none (its rows get out = 0, lse = -inf). Returns the new task count. */
static int64_t dec_add_tasks(const ta_args *a, const ta_seq *s, int64_t hk, int64_t i0, int64_t nq, dec_task *tasks,
                             int64_t nt, int64_t *slot, double *work) {
    const int64_t ch = dec_chunk(s->k_len), rows = nq * (a->Hq / a->Hkv);
    int64_t lo = ta_band_lo(a, s, i0), hi = ta_band_hi(a, s, i0 + nq - 1);
    int64_t c0 = lo / ch, c1 = hi >= lo ? hi / ch + 1 : c0 + 1;
    for (int64_t c = c0; c < c1; c++) {
        int64_t j0 = c * ch, j1 = hi >= lo ? (j0 + ch < s->k_len ? j0 + ch : s->k_len) : j0;
        if (tasks) tasks[nt] = (dec_task){s->b, hk, i0, nq, j0, j1, *slot, c1 - c0 == 1};
        nt++;
        *slot += rows * (a->Dv + 2);
        *work += (double)(j1 - j0) * rows * (a->D + a->Dv);
    }
    return nt;
}

/* Every sequence that takes this path (ta_decode_takes), cut into tasks; *rest counts the others. */
static int64_t dec_plan_tasks(const ta_args *a, dec_task *tasks, int64_t *groups, int64_t *ngroups, int64_t *slots,
                              double *work, int64_t *rest) {
    const int64_t G = a->Hq / a->Hkv;
    int64_t nt = 0, ng = 0, slot = 0;
    *rest = 0;
    *work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        if (s.q_len == 0) continue;
        if (!ta_decode_takes(a, s.q_len)) {
            (*rest)++;
            continue;
        }
        int64_t blk = dec_block_tokens(s.q_len, G);
        for (int64_t hk = 0; hk < a->Hkv; hk++)
            for (int64_t i0 = 0; i0 < s.q_len; i0 += blk) {
                if (groups) groups[ng] = nt;
                ng++;
                nt = dec_add_tasks(a, &s, hk, i0, s.q_len - i0 < blk ? s.q_len - i0 : blk, tasks, nt, &slot, work);
            }
    }
    if (groups) groups[ng] = nt;
    *ngroups = ng;
    *slots = slot;
    return nt;
}

int FN(decode)(const ta_args *a, int64_t *rest) {
    dec_plan P = {ta_round_up(a->D, VW), ta_round_up(a->Dv, VW), ta_kv_dtype(a), 1, TA_QS_NONE, TA_QS_NONE,
                  TA_QS_NONE, TA_QS_NONE, 0, 0, NULL, NULL, NULL};
    if (a->options & TA_OPT_KV_QUANT) {
        P.ks = ta_qs_kind(a->k_scale, a->k_scale_st);
        P.ko = ta_qs_kind(a->k_offset, a->k_offset_st);
        P.vs = ta_qs_kind(a->v_scale, a->v_scale_st);
        P.vo = ta_qs_kind(a->v_offset, a->v_offset_st);
        P.kG = dec_groups_fit(P.ks, a->k_scale_st, P.ko, a->k_offset_st, a->D, P.kd);
        P.vG = dec_groups_fit(P.vs, a->v_scale_st, P.vo, a->v_offset_st, a->Dv, P.kd);
    }
    /* scales varying with both the key and the channel that no group instance takes: converted rows */
    int general = (!P.kG && (P.ks == TA_QS_GENERAL || P.ko == TA_QS_GENERAL)) ||
                  (!P.vG && (P.vs == TA_QS_GENERAL || P.vo == TA_QS_GENERAL));
    int vector_kd = P.kd == DEC_NATIVE || (TA_REAL_BITS == 32 && P.kd != TA_F64);
    P.direct = !general && vector_kd && P.Dp == a->D && P.Dvp == a->Dv;
    int64_t ng, slots;
    double work;
    int64_t nt = dec_plan_tasks(a, NULL, NULL, &ng, &slots, &work, rest);
    if (nt == 0) return TA_OK;
    dec_task *tasks = (dec_task *)malloc((size_t)nt * sizeof(dec_task));
    int64_t *groups = (int64_t *)malloc((size_t)(2 * ng + 1) * sizeof(int64_t));
    P.part = (real *)malloc((size_t)slots * sizeof(real));
    if (!tasks || !groups || !P.part) {
        free(tasks);
        free(groups);
        free(P.part);
        return TA_ENOMEM;
    }
    dec_plan_tasks(a, tasks, groups, &ng, &slots, &work, rest);
    P.tasks = tasks;
    P.groups = groups;
    int status = ta_run_tasks(a, nt, work, tasks, sizeof(dec_task), dec_block, &P);
    if (status == TA_OK) { /* the groups of several chunks (a single chunk wrote its rows itself) */
        int64_t *ids = groups + ng + 1, nm = 0;
        for (int64_t g = 0; g < ng; g++)
            if (groups[g + 1] - groups[g] > 1) ids[nm++] = g;
        if (nm) status = ta_run_tasks(a, nm, (double)slots * 4, ids, sizeof(int64_t), dec_merge, &P);
    }
    free(tasks);
    free(groups);
    free(P.part);
    return status;
}
