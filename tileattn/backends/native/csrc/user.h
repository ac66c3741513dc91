/* User functions and block maps inside the tile loops.
 *
 * A call with a score_mod, a mask_mod or a block map (ta_args.user, see ta.h) runs the same kernels
 * as any other; this file holds what they add to a tile:
 *
 *   1. classify   before any arithmetic, the block map says whether the tile's lanes see none of its
 *                 keys (the tile is skipped: no GEMM, no softmax), all of them (no mask work), or
 *                 some (step 2). The lanes of a query block look up their block rows once (pairs
 *                 below), so a tile costs a few byte loads per distinct (head, block row).
 *   2. visibility the mask_mod runs over the tile (vectorised C from tileattn.programs) where a
 *                 block is partial, the map decides elsewhere; a tile whose mask turns out all
 *                 hidden is skipped as in step 1, one all visible takes no mask.
 *   3. score_mod  after softcap, ALiBi and bias (ta_score_mods), before the masks; the backward
 *                 keeps the scores it received and maps dS through the function's derivative,
 *                 adding the gradients of the tensors it captures into this thread's buffers.
 *
 * The functions see b (the sequence), h (the query head), q_idx = i + off (the row's position on
 * the keys' axis, as the band counts it: bottom-right aligned by default, so a decode row's q_idx
 * is its position at the end of its sequence) and kv_idx = j, all int32. A nonzero return (an index
 * out of range) is recorded in user->status (the mask_mod's negated) and raised by Python after the call.
 */
#ifndef TA_USER_H
#define TA_USER_H

/* included by tile.h after ta_rows, which it reads */
#include "common.h"
#include "kernels.h"

typedef int (*ta_score_fn)(int64_t rows, int64_t cols, int64_t ld, real *s, const int32_t *b, const int32_t *h,
                           const int32_t *q, const int32_t *kv, const void *const *cap, const int64_t *sizes,
                           const double *scalars);
typedef int (*ta_score_bwd_fn)(int64_t rows, int64_t cols, int64_t ld, const real *s, real *ds, const int32_t *b,
                               const int32_t *h, const int32_t *q, const int32_t *kv, const void *const *cap,
                               const int64_t *sizes, const double *scalars, real *const *grads);
typedef int (*ta_logits_fn)(int64_t rows, int64_t cols, int64_t ld, real *s, const int32_t *b, const int32_t *h,
                            const int32_t *q, const int32_t *kv, const void *const *cap, const int64_t *sizes,
                            const double *scalars, real alpha, real *cmax);
typedef int (*ta_mask_fn)(int64_t rows, int64_t cols, int64_t ld, uint8_t *out, const int32_t *b, const int32_t *h,
                          const int32_t *q, const int32_t *kv, const void *const *cap, const int64_t *sizes,
                          const double *scalars);

/* What the block map says about a set of (lane, key) pairs: a bit per state seen. */
enum { TA_SEEN_HIDDEN = 1, TA_SEEN_PARTIAL = 2, TA_SEEN_VISIBLE = 4 };
/* block map states (programs/blocks.py) */
enum { TA_BLOCK_HIDDEN = 0, TA_BLOCK_PARTIAL = 1, TA_BLOCK_VISIBLE = 2 };

static inline const ta_user_args *ta_user(const ta_args *a) { return (const ta_user_args *)a->user; }

static inline int ta_user_masks(const ta_args *a) {
    const ta_user_args *u = ta_user(a);
    return u && (u->mask_fn || u->states);
}

static inline int ta_user_scores(const ta_args *a) { return ta_user(a) && ta_user(a)->score_fn; }

/* Record a user function's nonzero return: positive for the score_mod, negated for the mask_mod. */
static inline void ta_user_status(const ta_args *a, int code) {
    int32_t expected = 0;
    if (code) __atomic_compare_exchange_n((int32_t *)ta_user(a)->status, &expected, code, 0, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED);
}

/* Offset of block row `br` of (sequence b, head h) in the map, or -1 outside it. */
static inline int64_t ta_user_row_off(const ta_user_args *u, int64_t b, int64_t h, int64_t qpos) {
    if (qpos < 0 || qpos >= u->map_q_len) return -1;
    return b * u->states_st[0] + h * u->states_st[1] + (qpos / u->block_q) * u->states_st[2];
}

static inline int ta_user_state(const ta_user_args *u, int64_t row_off, int64_t j) {
    if (row_off < 0 || j >= u->map_kv_len) return TA_BLOCK_HIDDEN;
    return ((const uint8_t *)u->states)[row_off + (j / u->block_kv) * u->states_st[3]];
}

/* The lanes' indices for the functions and their distinct block rows ("pairs"): called by
 * ta_rows_init for a call with user functions. */
static void ta_user_rows(const ta_args *a, const ta_seq *s, ta_rows *R) {
    const ta_user_args *u = ta_user(a);
    const int64_t n = R->npan * PW;
    R->npairs = 0;
    for (int64_t r = 0; r < n; r++) {
        R->ub[r] = (int32_t)s->b;
        R->uh[r] = (int32_t)R->head[r];
        R->uq[r] = (int32_t)(R->row[r] + s->off);
        if (!u->states || r >= R->M) continue;
        int64_t off = ta_user_row_off(u, s->b, R->head[r], R->row[r] + s->off), k = 0;
        while (k < R->npairs && R->pair_off[k] != off) k++;
        if (k == R->npairs) R->pair_off[R->npairs++] = off;
        R->upair[r] = (int32_t)k;
    }
}

/* Step 1: the states the block map gives keys [j0, j1) of R's lanes (TA_SEEN_* bits). Without a map
 * every key is partial (the mask_mod decides) or visible (no mask_mod). */
static int ta_user_classify(const ta_args *a, const ta_rows *R, int64_t j0, int64_t j1) {
    const ta_user_args *u = ta_user(a);
    if (!u->states) return u->mask_fn ? TA_SEEN_PARTIAL : TA_SEEN_VISIBLE;
    int seen = j1 > u->map_kv_len ? TA_SEEN_HIDDEN : 0;
    int64_t last = (j1 < u->map_kv_len ? j1 : u->map_kv_len) - 1;
    for (int64_t k = 0; k < R->npairs; k++) {
        if (R->pair_off[k] < 0) {
            seen |= TA_SEEN_HIDDEN;
            continue;
        }
        for (int64_t c = j0 / u->block_kv; c * u->block_kv <= last; c++)
            seen |= 1 << ((const uint8_t *)u->states)[R->pair_off[k] + c * u->states_st[3]];
    }
    return seen;
}

/* Step 2 for panel p: vis (n keys x PW lanes, key-major) = 1 where lane l sees key j0 + j. `kv`
 * holds the keys' indices. Padding lanes see nothing. */
static void ta_user_visibility(const ta_args *a, const ta_rows *R, int64_t p, int64_t j0, int64_t n,
                               const int32_t *kv, int seen, uint8_t *vis) {
    const ta_user_args *u = ta_user(a);
    const int64_t base = p * PW, rows = R->M - base < PW ? R->M - base : PW;
    if ((seen & TA_SEEN_PARTIAL) && u->mask_fn)
        ta_user_status(a, -((ta_mask_fn)u->mask_fn)(rows, n, PW, vis, R->ub + base, R->uh + base, R->uq + base, kv,
                                                     (const void *const *)u->mask_cap, (const int64_t *)u->mask_sizes,
                                                     (const double *)u->mask_scalars));
    else
        memset(vis, 1, (size_t)(n * PW));
    for (int64_t j = 0; j < n; j++) memset(vis + j * PW + rows, 0, (size_t)(PW - rows));
    if (!u->states) return;
    /* block by block of the map: each lane's state there, then the columns, lanes innermost */
    for (int64_t j = 0; j < n;) {
        const int64_t jj = j0 + j;
        const int64_t end = jj < u->map_kv_len ? ((jj / u->block_kv + 1) * u->block_kv < j0 + n ?
                                                   (jj / u->block_kv + 1) * u->block_kv - j0 : n) : n;
        uint8_t state[PW], keep[PW];
        for (int64_t l = 0; l < PW; l++) {
            state[l] = l < rows ? (uint8_t)ta_user_state(u, R->pair_off[R->upair[base + l]], jj) : TA_BLOCK_HIDDEN;
            keep[l] = state[l] == TA_BLOCK_PARTIAL && u->mask_fn;  /* the mask_mod's value stands */
        }
        for (; j < end; j++)
            for (int64_t l = 0; l < PW; l++) {
                uint8_t *v = vis + j * PW + l;
                *v = keep[l] ? *v : state[l] != TA_BLOCK_HIDDEN;
            }
    }
}

/* The census of a tile's visibility over R's real lanes: TA_SEEN_HIDDEN / _VISIBLE bits, and per
 * panel the first and one past the last key column some lane sees (vlo[p] == vhi[p]: none), so a
 * panel computes only those keys, as it does inside the band. Eight lanes a step as 64-bit words
 * (padding lanes are 0, so they are masked out of the "visible" test). */
static int ta_user_census(const ta_rows *R, const uint8_t *vis, int64_t n, int64_t *vlo, int64_t *vhi) {
    int seen = 0;
    for (int64_t p = 0; p < R->npan; p++) {
        const int64_t rows = R->M - p * PW < PW ? R->M - p * PW : PW;
        const uint8_t *v = vis + p * n * PW;
        uint64_t any = 0, all = ~(uint64_t)0, want[PW / 8];
        for (int64_t w = 0; w < PW / 8; w++) {
            const int64_t lanes = rows - w * 8 < 0 ? 0 : rows - w * 8 > 8 ? 8 : rows - w * 8;
            want[w] = lanes == 8 ? 0x0101010101010101ull : (((uint64_t)1 << (8 * lanes)) - 1) & 0x0101010101010101ull;
        }
        int64_t lo = n, hi = 0;
        for (int64_t j = 0; j < n; j++) {
            uint64_t column = 0;
            for (int64_t w = 0; w < PW / 8; w++) {
                uint64_t x;
                memcpy(&x, v + j * PW + w * 8, 8);
                column |= x;
                all &= (x & want[w]) == want[w] ? ~(uint64_t)0 : 0;
            }
            if (column) {
                lo = j < lo ? j : lo;
                hi = j + 1;
            }
            any |= column;
        }
        vlo[p] = lo < hi ? lo : 0;
        vhi[p] = lo < hi ? hi : 0;
        seen |= (any ? TA_SEEN_VISIBLE : 0) | (all ? 0 : TA_SEEN_HIDDEN);
    }
    return seen;
}

/* What one tile needs of the user functions, for ta_score_mods: the keys' indices, the visibility
 * (NULL: no mask work) with its panel stride, and for the backward where to keep the scores the
 * score_mod received (NULL in the forward). */
typedef struct {
    const int32_t *kv;
    const uint8_t *vis;
    int64_t vis_panel;
    real *pre;
    real alpha; /* what the fused sweep multiplies the scores by first (1 when the GEMM scaled them) */
} ta_user_tile;

/* Whether the forward's score pipeline is the score_mod alone (no softcap, ALiBi, bias or bool mask):
 * then one fused sweep per panel does it all (ta_user_logits). */
static inline int ta_user_fused(const ta_args *a) {
    return ta_user_scores(a) && !(ta_transforms(a) || a->mask);
}

/* Key indices j0 .. j0 + n - 1 into kv. */
static inline void ta_user_keys(int32_t *kv, int64_t j0, int64_t n) {
    for (int64_t j = 0; j < n; j++) kv[j] = (int32_t)(j0 + j);
}

/* Steps 1 and 2 for a tile: -1 when its lanes see none of keys [j0, j1) (skip it), 0 when they see all
 * (no mask work), 1 when `vis` (all panels, n x PW each) says which and vlo/vhi which columns each
 * panel sees. `kv` receives the keys' indices. */
static int ta_user_tile_mask(const ta_args *a, const ta_rows *R, int64_t j0, int64_t j1, int32_t *kv, uint8_t *vis,
                             int64_t *vlo, int64_t *vhi) {
    const int64_t n = j1 - j0;
    ta_user_keys(kv, j0, n);
    if (!ta_user_masks(a)) return 0;
    int seen = ta_user_classify(a, R, j0, j1);
    if (seen == TA_SEEN_HIDDEN) return -1;
    if (seen == TA_SEEN_VISIBLE) return 0;
    for (int64_t p = 0; p < R->npan; p++) ta_user_visibility(a, R, p, j0, n, kv, seen, vis + p * n * PW);
    seen = ta_user_census(R, vis, n, vlo, vhi);
    return seen == TA_SEEN_HIDDEN ? -1 : seen == TA_SEEN_VISIBLE ? 0 : 1;
}

/* Step 3 on panel p's n scores (raw, after softcap, ALiBi and bias); with `pre` the scores the
 * function received are kept there for the backward. */
static void ta_user_score(const ta_args *a, const ta_rows *R, int64_t p, real *S, int64_t n, const int32_t *kv,
                          real *pre) {
    const ta_user_args *u = ta_user(a);
    const int64_t base = p * PW, rows = R->M - base < PW ? R->M - base : PW;
    if (pre) memcpy(pre, S, (size_t)(n * PW) * sizeof(real));
    ta_user_status(a, ((ta_score_fn)u->score_fn)(rows, n, PW, S, R->ub + base, R->uh + base, R->uq + base, kv,
                                                 (const void *const *)u->score_cap, (const int64_t *)u->score_sizes,
                                                 (const double *)u->score_scalars));
}

/* Step 3 fused with the rest of the forward's pipeline on panel p's n raw scores (times alpha): the
 * score_mod and base-2 logits in one sweep, the column maxima folded into cmax. */
static void ta_user_logits(const ta_args *a, const ta_rows *R, int64_t p, real *S, int64_t n, const int32_t *kv,
                           real alpha, real *cmax) {
    const ta_user_args *u = ta_user(a);
    const int64_t base = p * PW, rows = R->M - base < PW ? R->M - base : PW;
    ta_user_status(a, ((ta_logits_fn)u->score_logits_fn)(rows, n, PW, S, R->ub + base, R->uh + base, R->uq + base, kv,
                                                          (const void *const *)u->score_cap,
                                                          (const int64_t *)u->score_sizes,
                                                          (const double *)u->score_scalars, alpha, cmax));
}

/* Backward of step 3 on panel p: dS (n x PW, w.r.t. the modified scores) becomes dS w.r.t. the scores
 * the function received (`pre`); with `grads` the captures' gradients are added into this thread's
 * buffers (once per element: only the pass that computes dK passes them). */
static void ta_user_score_bwd(const ta_args *a, const ta_rows *R, int64_t p, const real *pre, real *dS, int64_t n,
                              const int32_t *kv, int grads) {
    const ta_user_args *u = ta_user(a);
    const int64_t base = p * PW, rows = R->M - base < PW ? R->M - base : PW;
    real **mine = NULL;
    if (grads && u->score_grad) {
        const int64_t t = ta_thread_index();
        mine = (real **)u->score_grad + t * u->score_ncap;
    }
    ta_user_status(a, ((ta_score_bwd_fn)u->score_bwd_fn)(rows, n, PW, pre, dS, R->ub + base, R->uh + base,
                                                         R->uq + base, kv, (const void *const *)u->score_cap,
                                                         (const int64_t *)u->score_sizes,
                                                         (const double *)u->score_scalars, mine));
}

/* Whether the block map hides keys [j0, j1) from every query head of kv head hk in rows [i0, i0 + nq)
 * (a decode chunk that is then never read). */
static int ta_user_chunk_hidden(const ta_args *a, const ta_seq *s, int64_t hk, int64_t i0, int64_t nq, int64_t j0,
                                int64_t j1) {
    const ta_user_args *u = ta_user(a);
    if (!u || !u->states) return 0;
    const int64_t G = a->Hq / a->Hkv, last = (j1 < u->map_kv_len ? j1 : u->map_kv_len) - 1;
    for (int64_t i = i0; i < i0 + nq; i++)
        for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
            const int64_t off = ta_user_row_off(u, s->b, h, i + s->off);
            if (off < 0) continue;
            for (int64_t c = j0 / u->block_kv; c * u->block_kv <= last; c++)
                if (((const uint8_t *)u->states)[off + c * u->states_st[3]] != TA_BLOCK_HIDDEN) return 0;
        }
    return 1;
}

/* Decode rows (row-major, one row of n keys): step 3 on srow's raw scores, then steps 1-2 as -inf
 * where the row does not see a key. kv: the keys' indices, vis: n bytes of scratch. */
static void ta_user_decode_row(const ta_args *a, const ta_seq *s, int64_t h, int64_t i, real *srow, int64_t n,
                               int64_t j0, const int32_t *kv, uint8_t *vis) {
    const ta_user_args *u = ta_user(a);
    const int32_t b32 = (int32_t)s->b, h32 = (int32_t)h, q32 = (int32_t)(i + s->off);
    if (u->score_fn)
        ta_user_status(a, ((ta_score_fn)u->score_rows_fn)(1, n, n, srow, &b32, &h32, &q32, kv,
                                                          (const void *const *)u->score_cap,
                                                          (const int64_t *)u->score_sizes,
                                                          (const double *)u->score_scalars));
    if (!ta_user_masks(a)) return;
    if (u->mask_fn)
        ta_user_status(a, -((ta_mask_fn)u->mask_rows_fn)(1, n, n, vis, &b32, &h32, &q32, kv,
                                                        (const void *const *)u->mask_cap,
                                                        (const int64_t *)u->mask_sizes,
                                                        (const double *)u->mask_scalars));
    else
        memset(vis, 1, (size_t)n);
    if (u->states) {
        const int64_t off = ta_user_row_off(u, s->b, h, i + s->off);
        for (int64_t j = 0; j < n; j++) {
            const int st = ta_user_state(u, off, j0 + j);
            if (st != TA_BLOCK_PARTIAL || !u->mask_fn) vis[j] = st != TA_BLOCK_HIDDEN;
        }
    }
    for (int64_t j = 0; j < n; j++)
        if (!vis[j]) srow[j] = -INFINITY;
}

#endif
