/* Forward pass for a few query rows against many keys: a decode step against a KV cache.
 *
 * With Sq * G <= TA_DECODE_MAX_ROWS rows per kv head a transposed tile would be mostly empty, and
 * the call is bound by reading K and V once. So the keys of each sequence are cut into chunks whose
 * length depends only on that sequence's key count (never on the thread count or on the other
 * sequences), and a task is (sequence, kv head, chunk):
 *
 *   1. scores  each row's dot products with VW keys at a time: VW accumulators over d, then one
 *              transposing reduction gives the VW scores in one vector
 *   2. softmax the score pipeline along the row, the chunk's exact maximum, P = 2^(s - m), l
 *   3. P.V     acc[row] += P[row][j] * V[j], V rows read in place
 *
 * Each task leaves (acc, m, l) per row; a merge pass combines the chunks of a row in chunk order,
 * lse = log2-sum of the partial sums (see the anchors' "merging partial attention"). Chunks run in
 * parallel when the batch and heads cannot fill the threads (split-KV), and the bits of a row are
 * the same whatever else is in the batch and however many threads run.
 */
#include "kernels.h"
#include "tile.h"

typedef struct {
    int64_t b, hk, c, j0, j1, slot; /* chunk keys [j0, j1), partial results at slot */
} dec_task;

typedef struct {
    int64_t rows, Dp, Dvp; /* rows per kv head (Sq * G), head dims padded to VW */
    real *part;            /* per task and row: Dv accumulators, m, l */
} dec_plan;

/* Key chunk length: a function of the key count only. 512 keys keep a chunk's K and V in L2;
 * long caches use longer chunks so the number of partial results stays bounded. */
static int64_t dec_chunk(int64_t k_len) {
    int64_t c = 512;
    while (c < 4096 && c * 16 < k_len) c *= 2;
    return c;
}

/* out[t] = sum of the lanes of v[t], t < VW: a transposing reduction tree. */
TA_INLINE vr dec_hsum(const vr *v) {
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
#else
    vr r;
    for (int t = 0; t < VW; t++) r[t] = vsum(v[t]);
    return r;
#endif
}

/* K or V rows of a chunk: pointers to real rows whose width is a multiple of VW (zero padded). In
 * place for fp32 (fp64) inputs whose width already is such a multiple, else converted into buf. */
static void dec_rows(const ta_args *a, const ta_seq *s, const void *base, const int64_t st[3], int64_t seq_off,
                     int64_t hk, int64_t j0, int64_t n, int64_t width, int64_t wpad, real *buf, const real **rows) {
    int native = (TA_REAL_BITS == 64) ? a->dtype == TA_F64 : a->dtype == TA_F32;
    if (native && width == wpad && !a->paged) {
        const real *r0 = (const real *)base + seq_off + hk * st[1] + j0 * st[2];
        for (int64_t j = 0; j < n; j++) rows[j] = r0 + j * st[2];
        return;
    }
    for (int64_t j = 0; j < n; j++) {
        const void *src = ta_at(base, ta_key_off(a, s, st, seq_off, hk, j0 + j), a->dtype);
        if (native && width == wpad) {
            rows[j] = (const real *)src;
        } else {
            real *dst = buf + j * wpad;
            ta_load_row(dst, src, width, a->dtype);
            memset(dst + width, 0, (size_t)(wpad - width) * sizeof(real));
            rows[j] = dst;
        }
    }
}

/* Dot products of nr (1 or 2) query rows with VW keys: a vector of partial sums per (row, key),
 * then one transposing reduction per row. DEC_G keys advance together (DEC_G * nr independent FMA
 * chains hide the FMA latency) and two rows share every load of K. */
#define DEC_G (VW < 8 ? VW : 8)
TA_INLINE void dec_dots(const int nr, const real *q, int64_t Dp, const real *const *kr, real alpha, real *out,
                        int64_t out_ld) {
    vr acc[2][VW];
    for (int t0 = 0; t0 < VW; t0 += DEC_G) {
        vr x[2][DEC_G];
        const real *p[DEC_G];
        for (int u = 0; u < DEC_G; u++) {
            p[u] = kr[t0 + u];
            for (int r = 0; r < nr; r++) x[r][u] = vzero();
        }
        for (int64_t d = 0; d < Dp; d += VW) {
            vr q0 = vload(q + d), q1 = nr > 1 ? vload(q + Dp + d) : q0;
            for (int u = 0; u < DEC_G; u++) {
                vr k = vload(p[u] + d);
                x[0][u] = vfma(q0, k, x[0][u]);
                if (nr > 1) x[1][u] = vfma(q1, k, x[1][u]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int u = 0; u < DEC_G; u++) acc[r][t0 + u] = x[r][u];
    }
    for (int r = 0; r < nr; r++) vstore(out + r * out_ld, dec_hsum(acc[r]) * alpha);
}

/* Step 1 for rows [0, M) (q: M rows of Dp values): alpha * q.k of keys [0, n) into S (np per row). */
static void dec_raw_scores(const real *q, int64_t M, int64_t Dp, const real *const *krows, int64_t n, real alpha,
                           real *S, int64_t np, const real *zero) {
    for (int64_t t0 = 0; t0 < n; t0 += VW) {
        const real *kr[VW];
        for (int t = 0; t < VW; t++) kr[t] = t0 + t < n ? krows[t0 + t] : zero;
        int64_t r = 0;
        for (; r + 1 < M; r += 2) dec_dots(2, q + r * Dp, Dp, kr, alpha, S + r * np + t0, np);
        if (r < M) dec_dots(1, q + r * Dp, Dp, kr, alpha, S + r * np + t0, np);
    }
}

/* Step 2 for one row: raw scores in srow to base-2 logits through the score pipeline; -inf for
 * hidden keys and for the padding up to a multiple of VW. */
static void dec_logits(const ta_args *a, const ta_seq *s, int64_t n, int64_t j0, int64_t h, int64_t i, real *srow) {
    const int plain = !(a->softcap > 0 || a->alibi || a->bias);
    if (!plain) {
        const real cap = (real)a->softcap;
        real slope = a->alibi ? ((const float *)a->alibi)[s->b * a->alibi_st[0] + h * a->alibi_st[1]] : 0;
        for (int64_t j = 0; j < n; j++) {
            real x = srow[j];
            if (cap > 0) x = cap * (real)tanh((double)(x / cap));
            if (a->alibi) x -= slope * (real)fabs((double)(i + s->off - (j0 + j)));
            if (a->bias)
                x += (real)ta_load1(ta_at(a->bias, s->b * a->bias_st[0] + h * a->bias_st[1] + i * a->bias_st[2] +
                                                       (j0 + j) * a->bias_st[3], a->bias_dtype),
                                    a->bias_dtype);
            srow[j] = x * (real)TA_LOG2E;
        }
    }
    /* the band hides keys before lo and after hi; the padding past n is hidden too */
    int64_t lo = ta_band_lo(a, s, i) - j0, hi = ta_band_hi(a, s, i) - j0 + 1, np = ta_round_up(n, VW);
    lo = lo < 0 ? 0 : lo > np ? np : lo;
    hi = hi > n ? n : hi < lo ? lo : hi;
    for (int64_t j = 0; j < lo; j++) srow[j] = -INFINITY;
    for (int64_t j = hi; j < np; j++) srow[j] = -INFINITY;
    if (a->mask) {
        const uint8_t *mask = (const uint8_t *)a->mask + s->b * a->mask_st[0] + h * a->mask_st[1] + i * a->mask_st[2];
        for (int64_t j = lo; j < hi; j++)
            if (!mask[(j0 + j) * a->mask_st[3]]) srow[j] = -INFINITY;
    }
}

/* acc[r][c0 : c0 + nv*VW) += sum_j P[r][j] * V[j][c0 : ...) for the rows r < nr (<= 4) over keys
 * [jb, je): each V vector is loaded once for all rows, with nr * nv (<= 16) accumulators. */
TA_INLINE void dec_pv(const int nr, const int nv, real *acc, int64_t acc_ld, const real *P, int64_t p_ld,
                      const real *const *vrows, int64_t c0, int64_t jb, int64_t je) {
    vr x[4][4];
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nv; k++) x[r][k] = vload(acc + r * acc_ld + k * VW);
    for (int64_t j = jb; j < je; j++) {
        const real *vj = vrows[j] + c0;
        vr vv[4];
        for (int k = 0; k < nv; k++) vv[k] = vload(vj + k * VW);
        for (int r = 0; r < nr; r++) {
            vr p = vset1(P[r * p_ld + j]);
            for (int k = 0; k < nv; k++) x[r][k] = vfma(p, vv[k], x[r][k]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nv; k++) vstore(acc + r * acc_ld + k * VW, x[r][k]);
}

/* Step 3 for rows [0, M): blocks of 4 rows x 4 vectors of Dv, then the leftovers. */
static void dec_pv_rows(real *acc, int64_t Dvp, const real *P, int64_t np, const real *const *vrows, int64_t M,
                        int64_t n) {
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        int nr = M - r0 >= 4 ? 4 : (int)(M - r0);
        real *a = acc + r0 * Dvp;
        const real *p = P + r0 * np;
        for (int64_t c = 0; c < Dvp;) {
            int nv = Dvp - c >= 4 * VW ? 4 : 1;
            if (nr == 4 && nv == 4)
                dec_pv(4, 4, a + c, Dvp, p, np, vrows, c, 0, n);
            else if (nv == 4)
                for (int r = 0; r < nr; r++) dec_pv(1, 4, a + r * Dvp + c, Dvp, p + r * np, np, vrows, c, 0, n);
            else
                for (int r = 0; r < nr; r++) dec_pv(1, 1, a + r * Dvp + c, Dvp, p + r * np, np, vrows, c, 0, n);
            c += nv * VW;
        }
    }
}

static int dec_block(const ta_args *a, const void *plan, const void *task) {
    const dec_plan *P = (const dec_plan *)plan;
    const dec_task *t = (const dec_task *)task;
    const int64_t D = a->D, Dv = a->Dv, Dp = P->Dp, Dvp = P->Dvp, G = a->Hq / a->Hkv;
    if (ta_cancelled(a)) return TA_CANCELLED;
    ta_seq s;
    ta_seq_init(a, t->b, &s);
    /* the keys of the chunk that some row sees (none when a window ends before the chunk) */
    int64_t j0 = ta_band_lo(a, &s, 0), j1 = ta_band_hi(a, &s, s.q_len - 1) + 1;
    j0 = j0 > t->j0 ? j0 : t->j0;
    j1 = j1 < t->j1 ? j1 : t->j1;
    if (j1 < j0) j1 = j0;
    int64_t M = s.q_len * G, n = j1 - j0, np = ta_round_up(n, VW);
    size_t nreal = (size_t)(M * (Dp + np + Dvp) + n * (Dp + Dvp) + Dp + VW);
    char *mem = (char *)ta_scratch(0, nreal * sizeof(real) + (size_t)(2 * n) * sizeof(real *));
    if (!mem) return TA_ENOMEM;
    real *q = (real *)mem, *S = q + M * Dp, *acc = S + M * np, *kbuf = acc + M * Dvp, *vbuf = kbuf + n * Dp;
    real *zero = vbuf + n * Dvp;
    const real **krows = (const real **)(zero + Dp + VW), **vrows = krows + n;
    memset(zero, 0, (size_t)(Dp + VW) * sizeof(real));
    memset(acc, 0, (size_t)(M * Dvp) * sizeof(real));
    real *part = P->part + t->slot * P->rows * (Dv + 2);

    dec_rows(a, &s, a->k, a->k_st, s.k0, t->hk, j0, n, D, Dp, kbuf, krows);
    dec_rows(a, &s, a->v, a->v_st, s.v0, t->hk, j0, n, Dv, Dvp, vbuf, vrows);
    for (int64_t r = 0; r < M; r++) {
        int64_t i = r / G, h = t->hk * G + r % G;
        ta_load_row(q + r * Dp, ta_at(a->q, s.q0 + h * a->q_st[1] + i * a->q_st[2], a->dtype), D, a->dtype);
        memset(q + r * Dp + D, 0, (size_t)(Dp - D) * sizeof(real));
    }
    const int plain = !(a->softcap > 0 || a->alibi || a->bias);
    dec_raw_scores(q, M, Dp, krows, n, (real)(plain ? a->scale * TA_LOG2E : a->scale), S, np, zero);
    for (int64_t r = 0; r < M; r++) {
        int64_t i = r / G, h = t->hk * G + r % G;
        real *srow = S + r * np;
        dec_logits(a, &s, n, j0, h, i, srow);

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
    }
    dec_pv_rows(acc, Dvp, S, np, vrows, M, n);
    for (int64_t r = 0; r < M; r++) memcpy(part + r * (Dv + 2), acc + r * Dvp, (size_t)Dv * sizeof(real));
    return TA_OK;
}

/* Combine the chunks of every (sequence, kv head) in chunk order and write out and lse. */
static void dec_merge(const ta_args *a, const dec_plan *P, const dec_task *tasks, int64_t ntasks, real *tmp) {
    const int64_t Dv = a->Dv, G = a->Hq / a->Hkv;
    const double keep_scale = 1.0 / (1.0 - a->dropout_p);
    for (int64_t t0 = 0; t0 < ntasks;) {
        int64_t t1 = t0;
        while (t1 < ntasks && tasks[t1].b == tasks[t0].b && tasks[t1].hk == tasks[t0].hk) t1++;
        ta_seq s;
        ta_seq_init(a, tasks[t0].b, &s);
        for (int64_t r = 0; r < s.q_len * G; r++) {
            double m = -INFINITY, l = 0;
            for (int64_t t = t0; t < t1; t++) {
                double mc = P->part[(tasks[t].slot * P->rows + r) * (Dv + 2) + Dv];
                m = mc > m || mc != mc ? mc : m;
            }
            double msub = m == -INFINITY ? 0 : m;
            memset(tmp, 0, (size_t)Dv * sizeof(real));
            for (int64_t t = t0; t < t1; t++) {
                const real *pr = P->part + (tasks[t].slot * P->rows + r) * (Dv + 2);
                real w = (real)exp2((double)pr[Dv] - msub);
                if (pr[Dv + 1] == 0) continue; /* the chunk saw no key of this row */
                l += (double)w * pr[Dv + 1];
                for (int64_t c = 0; c < Dv; c++) tmp[c] += w * pr[c];
            }
            double lse = l == 0 ? -INFINITY : (m + log2(l)) * TA_LN2;
            real inv = l == 0 ? 0 : (real)(keep_scale / l);
            for (int64_t c = 0; c < Dv; c++) tmp[c] *= inv;
            int64_t i = r / G, h = tasks[t0].hk * G + r % G;
            ta_store_row((char *)a->out + (s.o0 + h * a->o_st[1] + i * a->o_st[2]) * ta_elsize(a->out_dtype), tmp,
                         Dv, a->out_dtype);
            int64_t lo = s.l0 + h * a->lse_st[1] + i * a->lse_st[2];
            if (TA_REAL_BITS == 64)
                ((double *)a->lse)[lo] = lse;
            else
                ((float *)a->lse)[lo] = (float)lse;
        }
        t0 = t1;
    }
}

int FN(decode)(const ta_args *a) {
    const int64_t G = a->Hq / a->Hkv;
    dec_plan P = {a->Sq * G, ta_round_up(a->D, VW), ta_round_up(a->Dv, VW), NULL};
    int64_t ntasks = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        int64_t ch = dec_chunk(s.k_len);
        ntasks += a->Hkv * (s.k_len > 0 ? (s.k_len + ch - 1) / ch : 1);
    }
    if (ntasks == 0) return TA_OK;
    dec_task *tasks = (dec_task *)malloc((size_t)ntasks * sizeof(dec_task));
    P.part = (real *)malloc((size_t)(ntasks * P.rows * (a->Dv + 2) + a->Dv) * sizeof(real));
    if (!tasks || !P.part) {
        free(tasks);
        free(P.part);
        return TA_ENOMEM;
    }
    int64_t nt = 0;
    double work = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ta_seq s;
        ta_seq_init(a, b, &s);
        int64_t ch = dec_chunk(s.k_len), nch = s.k_len > 0 ? (s.k_len + ch - 1) / ch : 1;
        for (int64_t hk = 0; hk < a->Hkv; hk++)
            for (int64_t c = 0; c < nch; c++) {
                int64_t j0 = c * ch, j1 = j0 + ch < s.k_len ? j0 + ch : s.k_len;
                tasks[nt] = (dec_task){b, hk, c, j0, j1, nt};
                nt++;
                work += (double)(j1 - j0) * s.q_len * G * (a->D + a->Dv);
            }
    }
    int status = ta_run_tasks(a, nt, work, tasks, sizeof(dec_task), dec_block, &P);
    if (status == TA_OK) dec_merge(a, &P, tasks, nt, P.part + ntasks * P.rows * (a->Dv + 2));
    free(tasks);
    free(P.part);
    return status;
}
