/* The passes of fused.c for one compute type: `real` (float or double), SFX(name) naming them,
 * LOAD / STORE converting a row of any element type to and from `real`, SQRT. Included twice. */

/* sum of v[j] * u[j], j < n, in 16 independent lanes (vectorises without reassociation flags) */
static inline real SFX(dot)(const real *v, const real *u, int64_t n) {
    real acc[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) acc[l] += v[j + l] * u[j + l];
    real sum = 0;
    for (int l = 0; l < 16; l++) sum += acc[l];
    for (; j < n; j++) sum += v[j] * u[j];
    return sum;
}

/* v *= r, then *= w (when set): the two roundings of RMSNorm as PyTorch composes it */
static inline void SFX(scale_row)(real *v, int64_t n, real r, const real *w) {
    if (w)
        for (int64_t j = 0; j < n; j++) v[j] = (v[j] * r) * w[j];
    else
        for (int64_t j = 0; j < n; j++) v[j] = v[j] * r;
}

/* RoPE of one head's first rot values: the pair (a, b) becomes (a c - b s, b c + a s); sign -1 applies
 * the inverse rotation (the gradient's). Pairs are (2i, 2i+1) interleaved, else (i, i + rot/2). */
static inline void SFX(rotate)(real *v, const real *c, const real *s, int64_t rot, int interleaved, real sign) {
    int64_t half = rot / 2;
    if (interleaved) {
        for (int64_t i = 0; i < half; i++) {
            real a = v[2 * i], b = v[2 * i + 1], si = sign * s[i];
            v[2 * i] = a * c[i] - b * si;
            v[2 * i + 1] = b * c[i] + a * si;
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            real a = v[i], b = v[i + half], si = sign * s[i];
            v[i] = a * c[i] - b * si;
            v[i + half] = b * c[i] + a * si;
        }
    }
}

static int SFX(rms)(const void *x, int xdt, int64_t n0, int64_t n1, int64_t xs0, int64_t xs1, int64_t H,
                    const void *w, real eps, void *rstd, int have_rstd, void *xhat, int64_t ldh, int threads) {
    const real *wr = (const real *)w;
    real *rs = (real *)rstd, *xh = (real *)xhat;
    int64_t rows = n0 * n1;
    int nt = threads_for(threads, rows * H), failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        real *buf = xh ? NULL : (real *)malloc((size_t)H * sizeof(real));
        if (!xh && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!xh && !buf) continue;
            int64_t b = row / n1, s = row % n1;
            real *v = xh ? xh + row * ldh : buf;
            LOAD(at(x, b * xs0 + s * xs1, xdt), xdt, H, v);
            real r = have_rstd ? rs[row] : (real)1 / SQRT(SFX(dot)(v, v, H) / (real)H + eps);
            if (!have_rstd) rs[row] = r;
            if (xh) SFX(scale_row)(v, H, r, wr);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

static int SFX(rms_backward)(const void *x, int xdt, int64_t n0, int64_t n1, int64_t xs0, int64_t xs1, int64_t H,
                             const void *w, const void *rstd, const void *dxhat, int64_t ldd, void *dx, int64_t ds0,
                             int64_t ds1, void *dw_part, int threads) {
    const real *wr = (const real *)w, *rs = (const real *)rstd, *dxh = (const real *)dxhat;
    real *dwp = (real *)dw_part;
    int64_t rows = n0 * n1, blocks = (rows + TA_FUSED_BLOCK - 1) / TA_FUSED_BLOCK;
    int nt = threads_for(threads, rows * H), failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        real *xv = (real *)malloc((size_t)H * 2 * sizeof(real));
        if (!xv) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (!xv) continue;
            real *g = xv + H, *dwb = dwp ? dwp + blk * H : NULL;
            if (dwb) memset(dwb, 0, (size_t)H * sizeof(real));
            int64_t end = (blk + 1) * TA_FUSED_BLOCK < rows ? (blk + 1) * TA_FUSED_BLOCK : rows;
            for (int64_t row = blk * TA_FUSED_BLOCK; row < end; row++) {
                int64_t b = row / n1, s = row % n1;
                const real *d = dxh + row * ldd;
                real r = rs[row];
                LOAD(at(x, b * xs0 + s * xs1, xdt), xdt, H, xv);
                if (dwb)
                    for (int64_t j = 0; j < H; j++) dwb[j] += d[j] * (xv[j] * r);
                if (wr)
                    for (int64_t j = 0; j < H; j++) g[j] = d[j] * wr[j];
                else
                    memcpy(g, d, (size_t)H * sizeof(real));
                real coef = r * r * r * SFX(dot)(g, xv, H) / (real)H;
                for (int64_t j = 0; j < H; j++) g[j] = r * g[j] - xv[j] * coef;
                STORE((char *)dx + (b * ds0 + s * ds1) * elsize(xdt), xdt, H, g);
            }
        }
        free(xv);
    }
    return failed ? -2 : 0;
}

static int SFX(epilogue)(const void *y, int ydt, int64_t ldy, int64_t n0, int64_t n1, int64_t heads, int64_t D,
                         const void *bias, const void *nw, real neps, const void *cs, const void *sn, int64_t cs0,
                         int64_t cs1, int64_t rot, int interleaved, void *dst, int ddt, int64_t ds0, int64_t ds1,
                         int64_t dsh, const int32_t *cache_pos, const int32_t *bt, int64_t bt_st, int64_t page_size,
                         int threads) {
    const real *br = (const real *)bias, *nwr = (const real *)nw, *cr = (const real *)cs, *sr = (const real *)sn;
    int64_t rows = n0 * n1, W = heads * D;
    int nt = threads_for(threads, rows * W), failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        real *buf = (real *)malloc((size_t)W * sizeof(real));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!buf) continue;
            int64_t b = row / n1, s = row % n1;
            LOAD(at(y, row * ldy, ydt), ydt, W, buf);
            if (br)
                for (int64_t j = 0; j < W; j++) buf[j] += br[j];
            int64_t base;
            if (!cache_pos) {
                base = b * ds0 + s * ds1;
            } else {
                int64_t p = (int64_t)cache_pos[b] + s;
                base = bt ? (int64_t)bt[b * bt_st + p / page_size] * ds0 + (p % page_size) * ds1 : b * ds0 + p * ds1;
            }
            for (int64_t h = 0; h < heads; h++) {
                real *v = buf + h * D;
                if (nwr) SFX(scale_row)(v, D, (real)1 / SQRT(SFX(dot)(v, v, D) / (real)D + neps), nwr);
                if (rot) SFX(rotate)(v, cr + b * cs0 + s * cs1, sr + b * cs0 + s * cs1, rot, interleaved, 1);
                STORE((char *)dst + (base + h * dsh) * elsize(ddt), ddt, D, v);
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

static int SFX(epilogue_backward)(const void *g, int gdt, int64_t gs0, int64_t gs1, int64_t gsh, int64_t n0,
                                  int64_t n1, int64_t heads, int64_t D, const void *pre, int64_t ldp, const void *nw,
                                  real neps, void *dnw_part, const void *cs, const void *sn, int64_t cs0, int64_t cs1,
                                  int64_t rot, int interleaved, void *dy, int64_t ldy, int threads) {
    const real *pr = (const real *)pre, *nwr = (const real *)nw, *cr = (const real *)cs, *sr = (const real *)sn;
    real *dyr = (real *)dy, *dnp = (real *)dnw_part;
    int64_t rows = n0 * n1, blocks = (rows + TA_FUSED_BLOCK - 1) / TA_FUSED_BLOCK;
    int nt = threads_for(threads, rows * heads * D);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t blk = 0; blk < blocks; blk++) {
        real *dnb = dnp ? dnp + blk * D : NULL;
        if (dnb) memset(dnb, 0, (size_t)D * sizeof(real));
        int64_t end = (blk + 1) * TA_FUSED_BLOCK < rows ? (blk + 1) * TA_FUSED_BLOCK : rows;
        for (int64_t row = blk * TA_FUSED_BLOCK; row < end; row++) {
            int64_t b = row / n1, s = row % n1;
            for (int64_t h = 0; h < heads; h++) {
                real *v = dyr + row * ldy + h * D;
                LOAD(at(g, b * gs0 + s * gs1 + h * gsh, gdt), gdt, D, v);
                if (rot) SFX(rotate)(v, cr + b * cs0 + s * cs1, sr + b * cs0 + s * cs1, rot, interleaved, -1);
                if (nwr) {
                    /* z = p r w with r = 1/sqrt(mean(p^2) + eps): dp = r (w dz) - p r^3 sum(w dz p) / D */
                    const real *p = pr + row * ldp + h * D;
                    real r = (real)1 / SQRT(SFX(dot)(p, p, D) / (real)D + neps), sum = 0;
                    for (int64_t j = 0; j < D; j++) {
                        if (dnb) dnb[j] += v[j] * (p[j] * r);
                        v[j] *= nwr[j];
                        sum += v[j] * p[j];
                    }
                    real coef = r * r * r * sum / (real)D;
                    for (int64_t j = 0; j < D; j++) v[j] = r * v[j] - p[j] * coef;
                }
            }
        }
    }
    return 0;
}
