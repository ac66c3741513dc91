/* Tiles in the transposed layout shared by the forward and backward passes.
 *
 * A tile is (n keys) x (M query rows), stored key-major in panels: S[p][j][0:PW] holds the scores
 * of key j for the PW query rows ("lanes") of panel p. The G query heads that share a kv head are
 * stacked as rows, lane r = (i - i0) * G + g, so K and V tiles are read once per kv head. In this
 * layout every per-row quantity of the softmax (running max, sum, LSE, Delta) is a vector of lanes
 * and the whole softmax is vertical: no horizontal reductions, no shuffles.
 *
 * This file holds the per-lane row descriptions, the packing of the query side (q, dout) into
 * panels, the K/V tile access and the score pipeline for tiles that need more than a scale:
 *
 *     s = scale * q.k  ->  softcap  ->  + ALiBi + bias  ->  score_mod  ->  band, bool mask, the
 *         user's mask and block map  ->  * log2(e)
 */
#ifndef TA_TILE_H
#define TA_TILE_H

#include "common.h"
#include "gemm.h"

/* Per-lane (query row) description of a block of rows. Arrays have npan * PW entries; lanes past
 * the M real rows are padding that sees no key. */
typedef struct {
    int64_t M, npan, i0, nq, G, hk;
    int64_t *head, *row;        /* query head and row index (within the sequence) of each lane */
    int32_t *lo, *hi;           /* visible keys lo..hi (inclusive); lo > hi for padding */
    real *slope, *dist0;        /* ALiBi: slope and i + off of each lane */
    uint32_t *rkey;             /* dropout row key */
    int64_t *bias_row, *mask_row; /* offset of (b, h, i, 0) in the bias / mask */
    real *lse2, *delta;         /* backward: LSE in log2 units and Delta per lane */
    int64_t *plo, *phi;         /* per panel: the lowest lo and the highest hi of its lanes */
    int32_t *ub, *uh, *uq;      /* user functions (user.h): b, h and q_idx of each lane */
    int32_t *upair;             /* the lane's entry in pair_off */
    int64_t *pair_off, npairs;  /* the distinct block-map rows of the lanes (-1: outside the map) */
} ta_rows;

static size_t ta_rows_bytes(int64_t npan) {
    int64_t n = npan * PW;
    return (size_t)n * (5 * sizeof(int64_t) + 6 * sizeof(int32_t) + 4 * sizeof(real) + sizeof(uint32_t)) +
           (size_t)npan * 2 * sizeof(int64_t) + 64;
}

#include "user.h"

/* Carve the arrays out of `mem` (ta_rows_bytes(npan) bytes) and describe rows [i0, i0 + nq) of the
 * query heads of kv head hk of sequence s. */
static void ta_rows_init(ta_rows *R, void *mem, const ta_args *a, const ta_seq *s, int64_t hk, int64_t i0,
                         int64_t nq) {
    int64_t G = a->Hq / a->Hkv;
    R->G = G;
    R->hk = hk;
    R->i0 = i0;
    R->nq = nq;
    R->M = nq * G;
    R->npan = (R->M + PW - 1) / PW;
    int64_t n = R->npan * PW;
    char *m = (char *)mem;
    R->head = (int64_t *)m, m += n * sizeof(int64_t);
    R->row = (int64_t *)m, m += n * sizeof(int64_t);
    R->bias_row = (int64_t *)m, m += n * sizeof(int64_t);
    R->mask_row = (int64_t *)m, m += n * sizeof(int64_t);
    R->slope = (real *)m, m += n * sizeof(real);
    R->dist0 = (real *)m, m += n * sizeof(real);
    R->lse2 = (real *)m, m += n * sizeof(real);
    R->delta = (real *)m, m += n * sizeof(real);
    R->lo = (int32_t *)m, m += n * sizeof(int32_t);
    R->hi = (int32_t *)m, m += n * sizeof(int32_t);
    R->rkey = (uint32_t *)m, m += n * sizeof(uint32_t);
    R->pair_off = (int64_t *)m, m += n * sizeof(int64_t);
    R->ub = (int32_t *)m, m += n * sizeof(int32_t);
    R->uh = (int32_t *)m, m += n * sizeof(int32_t);
    R->uq = (int32_t *)m, m += n * sizeof(int32_t);
    R->upair = (int32_t *)m, m += n * sizeof(int32_t);
    R->plo = (int64_t *)m, m += R->npan * sizeof(int64_t);
    R->phi = (int64_t *)m;
    for (int64_t r = 0; r < n; r++) {
        int real_row = r < R->M;
        int64_t i = i0 + (real_row ? r / G : 0), h = hk * G + (real_row ? r % G : 0);
        R->head[r] = h;
        R->row[r] = i;
        R->lo[r] = real_row ? (int32_t)ta_band_lo(a, s, i) : 1;
        R->hi[r] = real_row ? (int32_t)ta_band_hi(a, s, i) : 0;
        R->slope[r] = a->alibi ? ((const float *)a->alibi)[s->b * a->alibi_st[0] + h * a->alibi_st[1]] : 0;
        R->dist0[r] = (real)(i + s->off);
        R->rkey[r] = a->dropout_p > 0 ? ta_drop_row_key(a, s->b, h, i) : 0;
        R->bias_row[r] = a->bias ? s->b * a->bias_st[0] + h * a->bias_st[1] + i * a->bias_st[2] : 0;
        R->mask_row[r] = a->mask ? s->b * a->mask_st[0] + h * a->mask_st[1] + i * a->mask_st[2] : 0;
        R->lse2[r] = 0;
        R->delta[r] = 0;
    }
    for (int64_t p = 0; p < R->npan; p++) {
        R->plo[p] = TA_NO_LIMIT, R->phi[p] = -1;
        for (int64_t r = p * PW; r < (p + 1) * PW && r < R->M; r++) {
            R->plo[p] = R->lo[r] < R->plo[p] ? R->lo[r] : R->plo[p];
            R->phi[p] = R->hi[r] > R->phi[p] ? R->hi[r] : R->phi[p];
        }
    }
    if (a->user) ta_user_rows(a, s, R);
}

/* The keys of [j0, j1) that some lane of panel p sees (by the band), as [*k0, *k1) (empty: k0 == k1).
 * On the causal diagonal a panel of 32 rows sees about half of a tile's keys; the keys it skips are
 * hidden from every one of its lanes, so leaving them out changes no sum. */
static inline void ta_panel_keys(const ta_rows *R, int64_t p, int64_t j0, int64_t j1, int64_t *k0, int64_t *k1) {
    int64_t lo = R->plo[p] > j0 ? R->plo[p] : j0, hi = R->phi[p] + 1 < j1 ? R->phi[p] + 1 : j1;
    *k0 = lo < hi ? lo : j0;
    *k1 = lo < hi ? hi : j0;
}

/* The keys [*k0, *k1) panel p computes of a tile starting at j0: its band range (ta_panel_keys) cut to
 * the columns the user's visibility shows it (vlo/vhi of ta_user_census, NULL when no mask work). */
static inline void ta_user_panel_keys(const ta_rows *R, int64_t p, int64_t j0, int64_t j1, const int64_t *vlo,
                                      const int64_t *vhi, int64_t *k0, int64_t *k1) {
    ta_panel_keys(R, p, j0, j1, k0, k1);
    if (!vlo) return;
    int64_t lo = j0 + vlo[p] > *k0 ? j0 + vlo[p] : *k0, hi = j0 + vhi[p] < *k1 ? j0 + vhi[p] : *k1;
    *k0 = lo < hi ? lo : j0;
    *k1 = lo < hi ? hi : j0;
}

/* ------------------------------------------------------------------------------------ conversion */

/* n elements of dtype at src -> real. */
static void ta_load_row(real *dst, const void *src, int64_t n, int64_t dtype) {
#if TA_REAL_BITS == 64
    (void)dtype;
    memcpy(dst, src, (size_t)n * sizeof(real));
#else
    if (dtype == TA_F32) {
        memcpy(dst, src, (size_t)n * sizeof(real));
    } else if (dtype == TA_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = ta_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        int64_t i = 0;
#ifdef TA_VCVT_F16
        for (; i + VW <= n; i += VW) vstore(dst + i, vload_f16(s + i));
#endif
        for (; i < n; i++) dst[i] = ta_f16_to_f32(s[i]);
    }
#endif
}

/* n reals -> dtype at dst (round to nearest even). */
static void ta_store_row(void *dst, const real *src, int64_t n, int64_t dtype) {
    if (dtype == TA_F64) {
        double *d = (double *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = src[i];
    } else if (dtype == TA_F32) {
        float *d = (float *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (float)src[i];
    } else if (dtype == TA_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = ta_f32_to_bf16((float)src[i]);
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = ta_f32_to_f16((float)src[i]);
    }
}

/* ---------------------------------------------------------------------------- query-side packing */

/* Rows -> panel: dst[c][l] = rows[l][c] for the PW lanes l (a NULL row gives zeros) and c < width,
 * VW x VW blocks at a time through registers. */
static void ta_rows_to_panel(real *dst, const real *const *rows, int64_t width) {
    for (int64_t l0 = 0; l0 < PW; l0 += VW)
        for (int64_t c0 = 0; c0 < width; c0 += VW) {
            const int64_t cn = width - c0 < VW ? width - c0 : VW;
            vr x[VW];
            for (int i = 0; i < VW; i++) {
                const real *row = rows[l0 + i];
                x[i] = vzero();
                if (row && cn == VW)
                    x[i] = vload(row + c0);
                else if (row)
                    memcpy(&x[i], row + c0, (size_t)cn * sizeof(real));
            }
            vtranspose(x);
            for (int64_t j = 0; j < cn; j++) vstore(dst + (c0 + j) * PW + l0, x[j]);
        }
}

/* Panel -> rows: rows[l][c] = src[c][l] * scale[l] for lanes l < nrows and c < width; rows are `ld`
 * reals apart and hold at least round_up(width, VW) reals. */
static void ta_panel_to_rows(real *rows, int64_t ld, int64_t nrows, const real *src, int64_t width,
                             const real *scale) {
    for (int64_t l0 = 0; l0 < PW && l0 < nrows; l0 += VW) {
        const vr sc = vload(scale + l0);
        for (int64_t c0 = 0; c0 < width; c0 += VW) {
            vr x[VW];
            for (int j = 0; j < VW; j++) x[j] = c0 + j < width ? vload(src + (c0 + j) * PW + l0) * sc : vzero();
            vtranspose(x);
            for (int64_t i = 0; i < VW && l0 + i < nrows; i++) vstore(rows + (l0 + i) * ld + c0, x[i]);
        }
    }
}

/* Rows of a q-like tensor (q, dout) for the lanes of R into panels, either transposed
 * ("T": dst[p][d][PW], the B operand of K q^T) or not ("N": dst[dp][r][PW] with the d axis cut
 * into panels, the B operand of dS^T q). `tmp` holds PW rows of `width` (inputs that are not `real`
 * are converted there first). Padding lanes / columns are zero. */
static void ta_pack_rows(real *dst, int transposed, const void *base, int64_t dtype,
                         const int64_t st[3], int64_t seq_off, const ta_rows *R, int64_t width, real *tmp) {
    const int64_t n = R->npan * PW, wpan = (width + PW - 1) / PW;
    const int native = (TA_REAL_BITS == 64) ? dtype == TA_F64 : dtype == TA_F32;
    if (!transposed) memset(dst, 0, (size_t)(wpan * n * PW) * sizeof(real));
    for (int64_t p = 0; p < R->npan; p++) {
        const real *rows[PW];
        for (int64_t l = 0; l < PW; l++) {
            int64_t r = p * PW + l;
            rows[l] = NULL;
            if (r >= R->M) continue;
            const void *src = ta_at(base, seq_off + R->head[r] * st[1] + R->row[r] * st[2], dtype);
            if (native) {
                rows[l] = (const real *)src;
            } else {
                ta_load_row(tmp + l * width, src, width, dtype);
                rows[l] = tmp + l * width;
            }
        }
        if (transposed) {
            ta_rows_to_panel(dst + p * width * PW, rows, width);
            continue;
        }
        for (int64_t l = 0; l < PW && rows[l]; l++)
            for (int64_t c0 = 0; c0 < width; c0 += PW)
                memcpy(dst + (c0 / PW) * n * PW + (p * PW + l) * PW, rows[l] + c0,
                       (size_t)(width - c0 < PW ? width - c0 : PW) * sizeof(real));
    }
}

/* ----------------------------------------------------------------------------------- K/V tiles */

/* Rows [j0, j0 + n) of kv head hk of a k-like tensor as real rows: in place when the tensor is
 * already `real`, contiguous in d and not paged (fp32 in, fp32 math: nothing is copied), else
 * converted/gathered into buf (n x width). Returns the rows and sets *ld to their stride. */
static const real *ta_kv_rows(const ta_args *a, const ta_seq *s, const void *base, const int64_t st[3],
                              int64_t seq_off, int64_t hk, int64_t j0, int64_t n, int64_t width, real *buf,
                              int64_t *ld) {
    int64_t dtype = a->dtype;
    int native = (TA_REAL_BITS == 64) ? dtype == TA_F64 : dtype == TA_F32;
    if (native && !a->paged) {
        *ld = st[2];
        return (const real *)base + seq_off + hk * st[1] + j0 * st[2];
    }
    for (int64_t j = 0; j < n; j++)
        ta_load_row(buf + j * width, ta_at(base, ta_key_off(a, s, st, seq_off, hk, j0 + j), dtype), width, dtype);
    *ld = width;
    return buf;
}

/* ---------------------------------------------------------------------------- the score pipeline */

/* What a tile needs beyond scale * q.k (TA_TILE_MODS: a score transform, the user's score_mod
 * included; TA_TILE_USER: the user's mask or block map hides part of it). */
enum { TA_TILE_EDGE = 1, TA_TILE_MASK = 2, TA_TILE_MODS = 4, TA_TILE_USER = 8 };

/* Whether the band hides part of keys [j0, j1) from some lane of lanes [r0, r1) (padding lanes
 * never matter). */
static int ta_lanes_on_edge(const ta_rows *R, int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
    for (int64_t r = r0; r < r1 && r < R->M; r++)
        if (R->lo[r] > j0 || R->hi[r] < j1 - 1) return 1;
    return 0;
}

static int ta_tile_on_edge(const ta_rows *R, int64_t j0, int64_t j1) { return ta_lanes_on_edge(R, 0, R->M, j0, j1); }

/* Bool-mask census of a tile: 0 = all visible, 1 = mixed, 2 = all hidden. */
static int ta_mask_census(const ta_args *a, const ta_rows *R, int64_t j0, int64_t j1) {
    const uint8_t *mask = (const uint8_t *)a->mask;
    int64_t ms = a->mask_st[3];
    int any_hidden = 0, any_visible = 0;
    for (int64_t r = 0; r < R->M && !(any_hidden && any_visible); r++) {
        const uint8_t *row = mask + R->mask_row[r];
        for (int64_t j = j0; j < j1; j++) {
            uint8_t v = row[j * ms];
            any_hidden |= !v;
            any_visible |= v != 0;
        }
    }
    return any_hidden ? (any_visible ? 1 : 2) : 0;
}

/* The score transforms of key j0 + j (column j of panel p): softcap, ALiBi and bias on raw scores. */
TA_INLINE void ta_score_transform(const ta_args *a, const ta_rows *R, int64_t p, real *srow, int64_t jj,
                                  real *tanh_row) {
    const real cap = (real)a->softcap, inv_cap = cap > 0 ? (real)(1.0 / a->softcap) : 0;
    const int64_t base = p * PW;
    for (int v = 0; v < TA_NV; v++) {
        vr x = vload(srow + v * VW);
        if (cap > 0) {
            vr t = vtanh(x * inv_cap);
            x = t * cap;
            if (tanh_row) vstore(tanh_row + v * VW, vset1(1) - t * t);
        }
        if (a->alibi) {
            vr dist = vabs(vload(R->dist0 + base + v * VW) - (real)jj);
            x = x - vload(R->slope + base + v * VW) * dist;
        }
        vstore(srow + v * VW, x);
    }
    if (a->bias) {
        const int64_t bs = a->bias_st[3];
        for (int64_t l = 0; l < PW && base + l < R->M; l++)
            srow[l] += (real)ta_load1(ta_at(a->bias, R->bias_row[base + l] + jj * bs, a->bias_dtype), a->bias_dtype);
    }
}

/* The same transforms on the raw scores srow[0 .. n) of one query row (keys j0 + j of head h of
 * sequence b; row i aligned with key i + off): the decode kernel's rows, one loop per transform so
 * each vectorises (srow holds n rounded up to VW; the caller hides the padding lanes). Then the step
 * to base-2 logits, unless a score_mod follows (it takes the transformed raw scores). */
static void ta_row_transform(const ta_args *a, int64_t b, int64_t h, int64_t i, int64_t off, real *srow, int64_t j0,
                             int64_t n) {
    if (a->softcap > 0) {
        const real cap = (real)a->softcap, inv_cap = (real)(1.0 / a->softcap);
        for (int64_t j = 0; j < n; j += VW) vstore(srow + j, vtanh(vload(srow + j) * inv_cap) * cap);
    }
    if (a->alibi) {
        const real slope = ((const float *)a->alibi)[b * a->alibi_st[0] + h * a->alibi_st[1]];
        const real dist0 = (real)(i + off - j0); /* the distance to key j0 + j is |dist0 - j| */
        for (int64_t j = 0; j < n; j++) {
            const real d = dist0 - (real)j;
            srow[j] -= slope * (d < 0 ? -d : d);
        }
    }
    if (a->bias)
        for (int64_t j = 0; j < n; j++)
            srow[j] += (real)ta_load1(ta_at(a->bias, b * a->bias_st[0] + h * a->bias_st[1] + i * a->bias_st[2] +
                                                         (j0 + j) * a->bias_st[3], a->bias_dtype),
                                      a->bias_dtype);
    if (!ta_user_scores(a))
        for (int64_t j = 0; j < n; j++) srow[j] *= (real)TA_LOG2E;
}

/* The masks of key j0 + j and the step to base-2 logits (with TA_TILE_MODS; without, the GEMM's
 * epilogue scaled already), folding the column max into cmax. `vis`: the user's visibility of the
 * column (PW lanes), or NULL. */
TA_INLINE void ta_score_finish(const ta_args *a, const ta_rows *R, int64_t p, real *srow, int64_t jj, int flags,
                               real *cmax, const uint8_t *vis) {
    const vr log2e = vset1((real)TA_LOG2E), ninf = vset1(-INFINITY);
    const int64_t base = p * PW;
    if (flags & TA_TILE_MASK) {
        const uint8_t *mask = (const uint8_t *)a->mask;
        for (int64_t l = 0; l < PW && base + l < R->M; l++)
            if (!mask[R->mask_row[base + l] + jj * a->mask_st[3]]) srow[l] = -INFINITY;
    }
    if (vis)
        for (int64_t l = 0; l < PW; l++) srow[l] = vis[l] ? srow[l] : -INFINITY;
    for (int v = 0; v < TA_NV; v++) {
        vr x = vload(srow + v * VW);
        if (flags & TA_TILE_MODS) x *= log2e;
        if (flags & TA_TILE_EDGE) {
            vs32 jv = (vs32){0} + (int32_t)jj;
            vs32 lo = *(const vs32_mem *)(R->lo + base + v * VW), hi = *(const vs32_mem *)(R->hi + base + v * VW);
            x = vselect(vmask32((jv < lo) | (jv > hi)), ninf, x);
        }
        vstore(srow + v * VW, x);
        vstore(cmax + v * VW, vmax_(vload(cmax + v * VW), x));
    }
}

/* Finish the scores of panel p in S (keys j0 .. j0 + n - 1): -inf where the band edge, the mask or
 * the user's mask hides them, and with TA_TILE_MODS (softcap, ALiBi, bias or a score_mod present)
 * the whole pipeline from the raw scale * q.k to base-2 logits. Without modifiers S already holds
 * base-2 logits: every tile of a problem computes its logits with the same arithmetic, so the
 * backward pass reproduces the forward's bits whatever the tiling. Folds the column max into cmax
 * (PW values); tanh_out (a backward whose transforms have a derivative, ta.h), when not NULL, receives
 * their derivative at each score (a softcap's 1 - tanh^2).
 * U: the tile's user state (user.h), NULL without user functions; its visibility applies with
 * TA_TILE_USER, its score_mod with TA_TILE_MODS (in one fused sweep with the rest when nothing else
 * transforms the scores: U->alpha then scales them first). */
static void ta_score_mods(const ta_args *a, const ta_rows *R, int64_t p, real *S, int64_t n, int64_t j0, int flags,
                          real *cmax, real *tanh_out, const ta_user_tile *U) {
    const uint8_t *vis = U && (flags & TA_TILE_USER) ? U->vis + p * U->vis_panel : NULL;
    if (U && !U->pre && ta_user_fused(a) && (flags & TA_TILE_MODS)) {
        if (!(flags & (TA_TILE_EDGE | TA_TILE_USER))) {  /* an interior tile: one sweep */
            ta_user_logits(a, R, p, S, n, U->kv, U->alpha, cmax);
            return;
        }
        /* a tile the band or the user's mask cuts: the sweep, then the masks, then the maxima again
         * (a hidden score must not raise a row's maximum) */
        real scratch[PW];
        for (int l = 0; l < PW; l++) scratch[l] = -INFINITY;
        ta_user_logits(a, R, p, S, n, U->kv, U->alpha, scratch);
        for (int64_t j = 0; j < n; j++) ta_score_finish(a, R, p, S + j * PW, j0 + j, flags & ~TA_TILE_MODS, cmax,
                                                        vis ? vis + j * PW : NULL);
        return;
    }
    if (U && ta_user_scores(a) && (flags & TA_TILE_MODS)) {
        if (ta_transforms(a))
            for (int64_t j = 0; j < n; j++)
                ta_score_transform(a, R, p, S + j * PW, j0 + j, tanh_out ? tanh_out + j * PW : NULL);
        ta_user_score(a, R, p, S, n, U->kv, U->pre);
        for (int64_t j = 0; j < n; j++) ta_score_finish(a, R, p, S + j * PW, j0 + j, flags, cmax, vis ? vis + j * PW : NULL);
        return;
    }
    for (int64_t j = 0; j < n; j++) {
        if (flags & TA_TILE_MODS) ta_score_transform(a, R, p, S + j * PW, j0 + j, tanh_out ? tanh_out + j * PW : NULL);
        ta_score_finish(a, R, p, S + j * PW, j0 + j, flags, cmax, vis ? vis + j * PW : NULL);
    }
}

/* Dropout keep mask of key jj for the VW lanes starting at lane l0 of R (all ones without dropout). */
TA_INLINE vi ta_drop_keep(const ta_args *a, const ta_rows *R, int64_t l0, int64_t jj) {
    vu32 rk;
    memcpy(&rk, R->rkey + l0, sizeof rk);
    vu32 x = ta_vmix32(rk ^ (uint32_t)((uint32_t)jj * TA_GOLDEN));
    return vmask32((vs32)((x >> 8) >= (uint32_t)a->drop_threshold));
}

#endif
