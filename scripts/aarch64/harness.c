/* The native kernels checked from C, against a double-precision reference computed here: what CI
 * runs on aarch64 under qemu-user (scripts/check_aarch64.sh), where no PyTorch is at hand.
 *
 *     harness LIBRARY [THREADS]
 *
 * dlopens a built libtileattn_native.so (a prebuilt level, a compile, or a wheel's copy), fills the
 * argument record through ta.h (the header the library was compiled with), and runs forward
 * (plain, causal, sliding window, softcap; fp32, fp64, bf16, fp16; GQA; head dims off the vector
 * width), the decode path (several key chunks), backward (both schedules), quantised caches (int8,
 * int4, fp8 e4m3 / e5m2 with per-head and per-token scales), the bf16 dot-product tiles where the
 * library has them, and a user-function program (a score_mod and a mask_mod that tileattn.programs
 * generated, scripts/aarch64/user_programs.py) in prefill, decode and backward. Each case prints its
 * largest error against the reference and the bound it must meet; a case that runs on two threads
 * must also give the bits of one thread. The last line is "N passed, M failed"; the exit status is 1
 * when a case failed.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ta.h"

typedef int (*entry_fn)(ta_args *);
static entry_fn lib_forward, lib_backward;
static int threads = 2, passed, failed;

/* the user programs (user_programs.py), one per working precision */
#define USER_DECL(sfx, real)                                                                             \
    int ta_user_score##sfx(int64_t, int64_t, int64_t, real *, const int32_t *, const int32_t *,         \
                           const int32_t *, const int32_t *, const void *const *, const int64_t *,      \
                           const double *);                                                              \
    int ta_user_score_rows##sfx(int64_t, int64_t, int64_t, real *, const int32_t *, const int32_t *,    \
                                const int32_t *, const int32_t *, const void *const *, const int64_t *, \
                                const double *);                                                         \
    int ta_user_score_bwd##sfx(int64_t, int64_t, int64_t, const real *, real *, const int32_t *,        \
                               const int32_t *, const int32_t *, const int32_t *, const void *const *,  \
                               const int64_t *, const double *, real *const *);                         \
    int ta_user_logits##sfx(int64_t, int64_t, int64_t, real *, const int32_t *, const int32_t *,        \
                            const int32_t *, const int32_t *, const void *const *, const int64_t *,     \
                            const double *, real, real *);
USER_DECL(_f32, float)
USER_DECL(_f64, double)
int ta_user_mask(int64_t, int64_t, int64_t, uint8_t *, const int32_t *, const int32_t *, const int32_t *,
                 const int32_t *, const void *const *, const int64_t *, const double *);
int ta_user_mask_rows(int64_t, int64_t, int64_t, uint8_t *, const int32_t *, const int32_t *, const int32_t *,
                      const int32_t *, const void *const *, const int64_t *, const double *);

/* the same functions in double (user_programs.py); 0.05 * |q_idx - kv_idx| is a float32 product, as
 * PyTorch computes a Python float times an integer tensor */
static double ref_score(double s, int64_t i, int64_t j) { return 10 * tanh(s / 10) - (double)(0.05f * (float)labs((long)(i - j))); }
static double ref_score_grad(double s) {
    double t = tanh(s / 10);
    return 1 - t * t;
}
static int ref_mask(int64_t j) { return j % 5 != 2; }

/* ------------------------------------------------------------------------------------ elements */

static uint64_t rng = 88172645463325252ull;
static double uniform(void) { /* xorshift64: [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / 4503599627370496.0 - 1.0;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static double from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* fp16 <-> double by the format's definition (values here are normal and within range) */
static double from_f16(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return h & 0x8000 ? -v : v;
}
static uint16_t to_f16(double x) { /* the compiler's rounding to nearest even */
    _Float16 h = (_Float16)x;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static double from_e4m3(uint8_t x) {
    int e = (x >> 3) & 15, m = x & 7;
    double v = e ? ldexp(8 + m, e - 10) : ldexp(m, -9);
    return x & 0x80 ? -v : v;
}
static double from_e5m2(uint8_t x) { return from_f16((uint16_t)(x << 8)); }

static size_t elsize(int dt) { return dt == TA_F64 ? 8 : dt == TA_F32 ? 4 : dt >= TA_I8 ? 1 : 2; }

/* A tensor of n elements of dtype dt filled with amplitude * uniform, rounded to dt; `ref` gets the
 * rounded values. Quantised formats: random codes (no NaN), ref their values (int4: n values). */
static void *fill(int dt, int64_t n, double amplitude, double *ref) {
    void *p = calloc((size_t)n, dt == TA_I4 ? 1 : elsize(dt));
    for (int64_t i = 0; i < n; i++) {
        double x = amplitude * uniform();
        switch (dt) {
        case TA_F64: ((double *)p)[i] = ref[i] = x; break;
        case TA_F32: ((float *)p)[i] = (float)x, ref[i] = (float)x; break;
        case TA_BF16: ((uint16_t *)p)[i] = to_bf16((float)x), ref[i] = from_bf16(((uint16_t *)p)[i]); break;
        case TA_F16: ((uint16_t *)p)[i] = to_f16(x), ref[i] = from_f16(((uint16_t *)p)[i]); break;
        case TA_I8: ((int8_t *)p)[i] = (int8_t)(127 * uniform()), ref[i] = ((int8_t *)p)[i]; break;
        case TA_I4: {
            int v = (int)(8 * uniform()); /* [-8, 7] */
            if (v > 7) v = 7;
            ((uint8_t *)p)[i / 2] |= (uint8_t)((v & 15) << (4 * (i & 1)));
            ref[i] = v;
            break;
        }
        case TA_F8E4M3: /* any code but NaN's */
            ((uint8_t *)p)[i] = (uint8_t)(rng >> 20) % 0x7f | (uint8_t)(rng >> 8 & 0x80);
            ref[i] = from_e4m3(((uint8_t *)p)[i]);
            break;
        default: /* e5m2: any code but inf's and NaN's */
            ((uint8_t *)p)[i] = (uint8_t)(rng >> 20) % 0x7c | (uint8_t)(rng >> 8 & 0x80);
            ref[i] = from_e5m2(((uint8_t *)p)[i]);
        }
    }
    return p;
}

static double load(const void *p, int64_t i, int dt) {
    switch (dt) {
    case TA_F64: return ((const double *)p)[i];
    case TA_F32: return ((const float *)p)[i];
    case TA_BF16: return from_bf16(((const uint16_t *)p)[i]);
    default: return from_f16(((const uint16_t *)p)[i]);
    }
}

/* ------------------------------------------------------------------------------------ one case */

typedef struct {
    const char *name;
    int dt, out_dt, B, Hq, Hkv, Sq, Sk, D, Dv;
    int64_t left, right; /* band sides (-1: none); right 0 = causal, bottom-right aligned */
    double softcap;
    int user_score, user_mask, options, backward;
    int kv; /* a quantised cache's format (0: K and V in q's dtype) */
} spec;

/* Reference forward of one (b, hq, i) row: probabilities into p (Sk), returns the LSE; out row. */
static double ref_row(const spec *c, const double *q, const double *k, const double *v, const double *ks,
                      const double *vs, int b, int h, int i, double *p, double *out) {
    int hk = h / (c->Hq / c->Hkv), off = c->Sk - c->Sq;
    double scale = 1 / sqrt((double)c->D), m = -INFINITY;
    const double *qi = q + (((int64_t)b * c->Hq + h) * c->Sq + i) * c->D;
    for (int j = 0; j < c->Sk; j++) {
        int64_t kr = ((int64_t)b * c->Hkv + hk) * c->Sk + j;
        double s = 0;
        for (int d = 0; d < c->D; d++) s += qi[d] * k[kr * c->D + d];
        s *= scale * (ks ? ks[(int64_t)b * c->Hkv + hk] : 1);
        if (c->softcap > 0) s = c->softcap * tanh(s / c->softcap);
        if (c->user_score) s = ref_score(s, i + off, j);
        int seen = (c->right < 0 || j <= i + off + c->right) && (c->left < 0 || j >= i + off - c->left) &&
                   (!c->user_mask || ref_mask(j));
        p[j] = seen ? s : -INFINITY;
        if (p[j] > m) m = p[j];
    }
    double l = 0;
    for (int j = 0; j < c->Sk; j++) l += p[j] = exp(p[j] - m);
    for (int e = 0; e < c->Dv; e++) out[e] = 0;
    for (int j = 0; j < c->Sk; j++) {
        int64_t vr = ((int64_t)b * c->Hkv + hk) * c->Sk + j;
        p[j] /= l;
        for (int e = 0; e < c->Dv; e++) out[e] += p[j] * v[vr * c->Dv + e] * (vs ? vs[vr] : 1);
    }
    return m + log(l);
}

static void verdict(const char *what, const spec *c, double err, double tol, int same_bits) {
    int ok = err <= tol && same_bits; /* a NaN error fails */
    printf("%-4s %-34s %-9s err %.2e (bound %.1e)%s\n", ok ? "ok" : "FAIL", c->name, what, err, tol,
           same_bits ? "" : ", 1 and 2 threads differ");
    ok ? passed++ : failed++;
}

/* |out| <= 1: the output format's rounding (bf16 2^-9, fp16 2^-11) and fp32 arithmetic */
static double out_tol(int dt) { return dt == TA_F64 ? 1e-12 : dt == TA_BF16 ? 8e-3 : dt == TA_F16 ? 2e-3 : 2e-5; }

static void run(const spec *c) {
    const int64_t nq = (int64_t)c->B * c->Hq * c->Sq, nk = (int64_t)c->B * c->Hkv * c->Sk;
    const int real64 = c->dt == TA_F64, kvdt = c->kv ? c->kv : c->dt;
    double *q = malloc(sizeof(double) * nq * c->D), *k = malloc(sizeof(double) * nk * c->D),
           *v = malloc(sizeof(double) * nk * c->Dv);
    void *qp = fill(c->dt, nq * c->D, 1.0, q), *kp = fill(kvdt, nk * c->D, 1.0, k), *vp = fill(kvdt, nk * c->Dv, 1.0, v);
    double *ks = NULL, *vs = NULL;
    float *ksf = NULL, *vsf = NULL;
    if (c->kv) { /* per (sequence, kv head) k_scale, per key v_scale: 1/16 of the codes' range */
        double unit = c->kv == TA_I8 ? 1.0 / 127 : c->kv == TA_I4 ? 1.0 / 8 : c->kv == TA_F8E4M3 ? 1.0 / 448 : 1.0 / 57344;
        ks = malloc(sizeof(double) * c->B * c->Hkv), vs = malloc(sizeof(double) * nk);
        ksf = malloc(sizeof(float) * c->B * c->Hkv), vsf = malloc(sizeof(float) * nk);
        for (int64_t i = 0; i < (int64_t)c->B * c->Hkv; i++) ks[i] = ksf[i] = (float)(unit * (1.5 + uniform()));
        for (int64_t i = 0; i < nk; i++) vs[i] = vsf[i] = (float)(unit * (1.5 + uniform()));
    }
    int ost = c->out_dt, acc = real64 ? TA_F64 : TA_F32;
    void *out[2], *lse[2];
    for (int t = 0; t < 2; t++) out[t] = calloc((size_t)(nq * c->Dv), elsize(ost)), lse[t] = calloc((size_t)nq, elsize(acc));
    char err[TA_ERR_LEN] = "";
    ta_user_args u;
    memset(&u, 0, sizeof u);
    const void *no_caps[1] = {NULL};
    int64_t no_sizes[1] = {0};
    double no_scalars[1] = {0};
    int32_t ustatus = 0;
    if (c->user_score || c->user_mask) {
        u.score_cap = u.mask_cap = (void *)no_caps, u.score_sizes = u.mask_sizes = no_sizes;
        u.score_scalars = u.mask_scalars = no_scalars, u.status = &ustatus;
    }
    if (c->user_score) {
        u.score_fn = real64 ? (void *)ta_user_score_f64 : (void *)ta_user_score_f32;
        u.score_rows_fn = real64 ? (void *)ta_user_score_rows_f64 : (void *)ta_user_score_rows_f32;
        u.score_bwd_fn = real64 ? (void *)ta_user_score_bwd_f64 : (void *)ta_user_score_bwd_f32;
        u.score_logits_fn = real64 ? (void *)ta_user_logits_f64 : (void *)ta_user_logits_f32;
    }
    if (c->user_mask) u.mask_fn = (void *)ta_user_mask, u.mask_rows_fn = (void *)ta_user_mask_rows;

    ta_args a;
    memset(&a, 0, sizeof a);
    a.q = qp, a.k = kp, a.v = vp, a.err = err, a.user = (c->user_score || c->user_mask) ? &u : NULL;
    a.B = c->B, a.Hq = c->Hq, a.Hkv = c->Hkv, a.Sq = c->Sq, a.Sk = c->Sk, a.D = c->D, a.Dv = c->Dv;
    /* int4: two values a byte, strides in bytes */
    int64_t kdiv = kvdt == TA_I4 ? 2 : 1;
    int64_t qst[3] = {(int64_t)c->Hq * c->Sq * c->D, (int64_t)c->Sq * c->D, c->D};
    int64_t kst[3] = {(int64_t)c->Hkv * c->Sk * c->D / kdiv, (int64_t)c->Sk * c->D / kdiv, c->D / kdiv};
    int64_t vst[3] = {(int64_t)c->Hkv * c->Sk * c->Dv / kdiv, (int64_t)c->Sk * c->Dv / kdiv, c->Dv / kdiv};
    int64_t ost3[3] = {(int64_t)c->Hq * c->Sq * c->Dv, (int64_t)c->Sq * c->Dv, c->Dv};
    int64_t lst[3] = {(int64_t)c->Hq * c->Sq, c->Sq, 1};
    memcpy(a.q_st, qst, sizeof qst), memcpy(a.k_st, kst, sizeof kst), memcpy(a.v_st, vst, sizeof vst);
    memcpy(a.o_st, ost3, sizeof ost3), memcpy(a.lse_st, lst, sizeof lst);
    a.dtype = c->dt, a.out_dtype = ost, a.left = c->left, a.right = c->right, a.bottom_right = 1;
    a.scale = 1 / sqrt((double)c->D), a.softcap = c->softcap, a.options = c->options;
    if (c->kv) {
        a.options |= TA_OPT_KV_QUANT, a.kv_dtype = c->kv, a.k_scale = ksf, a.v_scale = vsf;
        int64_t kss[6] = {c->Hkv, 1, 0, 0, 0, 1}, vss[6] = {(int64_t)c->Hkv * c->Sk, c->Sk, 1, 0, 0, 1};
        memcpy(a.k_scale_st, kss, sizeof kss), memcpy(a.v_scale_st, vss, sizeof vss);
    }
    int same = 1;
    for (int t = 0; t < 2; t++) {
        a.out = out[t], a.lse = lse[t], a.num_threads = t ? threads : 1;
        int st = lib_forward(&a);
        if (st != TA_OK || ustatus) {
            printf("FAIL %-34s forward returned %d (%s), user status %d\n", c->name, st, err, ustatus);
            failed++;
            return;
        }
    }
    same = !memcmp(out[0], out[1], (size_t)(nq * c->Dv) * elsize(ost)) && !memcmp(lse[0], lse[1], (size_t)nq * elsize(acc));

    double *p = malloc(sizeof(double) * c->Sk), *o = malloc(sizeof(double) * nq * c->Dv), *L = malloc(sizeof(double) * nq);
    double e_out = 0, e_lse = 0;
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->Hq; h++)
            for (int i = 0; i < c->Sq; i++) {
                int64_t r = ((int64_t)b * c->Hq + h) * c->Sq + i;
                L[r] = ref_row(c, q, k, v, ks, vs, b, h, i, p, o + r * c->Dv);
                for (int e = 0; e < c->Dv; e++) e_out = fmax(e_out, fabs(load(out[1], r * c->Dv + e, ost) - o[r * c->Dv + e]));
                e_lse = fmax(e_lse, fabs(load(lse[1], r, acc) - L[r]));
            }
    verdict("out", c, e_out, out_tol(ost), same);
    verdict("lse", c, e_lse, real64 ? 1e-12 : 5e-5, same);

    if (c->backward) {
        /* gradients in q's dtype (fp64) or fp32; delta = rowsum(dout * out) of the kernel's out, which
         * the reference's dS takes as given */
        int gdt = real64 ? TA_F64 : TA_F32;
        double *dO = malloc(sizeof(double) * nq * c->Dv);
        void *dOp = fill(c->dt, nq * c->Dv, 1.0, dO);
        void *delta = calloc((size_t)nq, elsize(acc)), *g[2][3];
        double *dl = malloc(sizeof(double) * nq);
        for (int64_t r = 0; r < nq; r++) {
            double s = 0;
            for (int e = 0; e < c->Dv; e++) s += dO[r * c->Dv + e] * load(out[1], r * c->Dv + e, ost);
            if (real64) ((double *)delta)[r] = dl[r] = s;
            else ((float *)delta)[r] = (float)s, dl[r] = (float)s;
        }
        for (int t = 0; t < 2; t++) {
            g[t][0] = calloc((size_t)(nq * c->D), elsize(gdt)), g[t][1] = calloc((size_t)(nk * c->D), elsize(gdt));
            g[t][2] = calloc((size_t)(nk * c->Dv), elsize(gdt));
            a.out = NULL, a.lse = lse[1], a.dout = dOp, a.delta = delta, a.dq = g[t][0], a.dk = g[t][1], a.dv = g[t][2];
            memcpy(a.do_st, ost3, sizeof ost3), memcpy(a.dq_st, qst, sizeof qst);
            int64_t gk[3] = {(int64_t)c->Hkv * c->Sk * c->D, (int64_t)c->Sk * c->D, c->D};
            memcpy(a.dk_st, gk, sizeof gk), memcpy(a.dv_st, gk, sizeof gk);
            a.dout_dtype = c->dt, a.dq_dtype = gdt, a.dkv_dtype = gdt, a.num_threads = t ? threads : 1;
            memcpy(a.o_st, ost3, sizeof ost3);
            int st = lib_backward(&a);
            if (st != TA_OK || ustatus) {
                printf("FAIL %-34s backward returned %d (%s), user status %d\n", c->name, st, err, ustatus);
                failed++;
                return;
            }
        }
        same = 1;
        for (int x = 0; x < 3; x++)
            same &= !memcmp(g[0][x], g[1][x], (size_t)((x ? nk : nq) * (x == 2 ? c->Dv : c->D)) * elsize(gdt));
        double *dq = calloc((size_t)(nq * c->D), sizeof(double)), *dk = calloc((size_t)(nk * c->D), sizeof(double)),
               *dv = calloc((size_t)(nk * c->Dv), sizeof(double));
        double scale = 1 / sqrt((double)c->D);
        for (int b = 0; b < c->B; b++)
            for (int h = 0; h < c->Hq; h++)
                for (int i = 0; i < c->Sq; i++) {
                    int64_t r = ((int64_t)b * c->Hq + h) * c->Sq + i, hk = h / (c->Hq / c->Hkv);
                    ref_row(c, q, k, v, NULL, NULL, b, h, i, p, o + r * c->Dv);
                    for (int j = 0; j < c->Sk; j++) {
                        int64_t kr = ((int64_t)b * c->Hkv + hk) * c->Sk + j;
                        if (p[j] == 0) continue;
                        double dp = 0, s = 0;
                        for (int e = 0; e < c->Dv; e++) {
                            dp += dO[r * c->Dv + e] * v[kr * c->Dv + e];
                            dv[kr * c->Dv + e] += p[j] * dO[r * c->Dv + e];
                        }
                        for (int d = 0; d < c->D; d++) s += q[r * c->D + d] * k[kr * c->D + d];
                        double ds = p[j] * (dp - dl[r]) * scale;
                        if (c->softcap > 0) {
                            double t = tanh(s * scale / c->softcap);
                            ds *= 1 - t * t;
                        }
                        if (c->user_score) ds *= ref_score_grad(s * scale);
                        for (int d = 0; d < c->D; d++) {
                            dq[r * c->D + d] += ds * k[kr * c->D + d];
                            dk[kr * c->D + d] += ds * q[r * c->D + d];
                        }
                    }
                }
        const char *names[3] = {"dq", "dk", "dv"};
        double *refs[3] = {dq, dk, dv};
        for (int x = 0; x < 3; x++) {
            int64_t n = (x ? nk : nq) * (x == 2 ? c->Dv : c->D);
            double e = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) {
                e = fmax(e, fabs(load(g[1][x], i, gdt) - refs[x][i]));
                mag = fmax(mag, fabs(refs[x][i]));
            }
            verdict(names[x], c, e / fmax(mag, 1e-300), real64 ? 1e-11 : 1e-4, same);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s LIBRARY [THREADS]\n", argv[0]);
        return 2;
    }
    if (argc > 2) threads = atoi(argv[2]);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "harness: %s\n", dlerror());
        return 2;
    }
    lib_forward = (entry_fn)dlsym(lib, "ta_forward");
    lib_backward = (entry_fn)dlsym(lib, "ta_backward");
    const char *(*info)(void) = (const char *(*)(void))dlsym(lib, "ta_build_info");
    const char *(*features)(void) = (const char *(*)(void))dlsym(lib, "ta_isa_features");
    const char *(*abi)(void) = (const char *(*)(void))dlsym(lib, "ta_abi");
    if (!lib_forward || !lib_backward || !info || !features || !abi) {
        fprintf(stderr, "harness: %s lacks the kernels' entry points\n", argv[1]);
        return 2;
    }
#define TA_COUNT(section, kind, name) +1
    int fields = 0 TA_FIELDS(TA_COUNT), described = 0;
    for (const char *s = abi(); *s; s++) described += *s == ',';
    if (fields != described) {
        fprintf(stderr, "harness: the library describes %d fields, ta.h here %d\n", described, fields);
        return 2;
    }
    printf("library %s\n  %s\n  features %s\n", argv[1], info(), features());
    int bf16dot = strstr(info(), "bf16dot=1") != NULL;

    const int F32 = TA_F32, F64 = TA_F64, BF = TA_BF16, H = TA_F16;
    spec cases[] = {
        /* name                      dt   out  B Hq Hkv Sq  Sk  D   Dv  left right cap us um options bwd kv */
        {"prefill f32",              F32, F32, 2, 4, 2, 70, 90, 64, 64, -1, -1, 0, 0, 0, 0, 0, 0},
        {"prefill f32 causal d40",   F32, F32, 2, 4, 2, 70, 70, 40, 40, -1, 0, 0, 0, 0, 0, 0, 0},
        {"prefill f32 window softcap", F32, F32, 1, 2, 1, 96, 130, 32, 48, 24, 0, 5.0, 0, 0, 0, 0, 0},
        {"prefill f64 causal",       F64, F64, 2, 4, 2, 50, 60, 40, 40, -1, 0, 0, 0, 0, 0, 0, 0},
        {"prefill bf16 causal",      BF,  BF,  2, 4, 2, 70, 70, 64, 64, -1, 0, 0, 0, 0, 0, 0, 0},
        {"prefill bf16 dot tiles",   BF,  BF,  2, 4, 2, 70, 90, 64, 64, -1, 0, 0, 0, 0, TA_OPT_BF16DOT, 0, 0},
        {"prefill f16",              H,   H,   2, 4, 2, 70, 90, 64, 64, -1, -1, 0, 0, 0, 0, 0, 0},
        {"decode f32 1300 keys",     F32, F32, 2, 8, 2, 1, 1300, 64, 64, -1, 0, 0, 0, 0, 0, 0, 0},
        {"decode f64",               F64, F64, 2, 8, 2, 1, 600, 40, 40, -1, 0, 0, 0, 0, 0, 0, 0},
        {"decode bf16",              BF,  BF,  2, 8, 2, 1, 700, 64, 64, -1, 0, 0, 0, 0, 0, 0, 0},
        {"decode f16 2 rows",        H,   H,   2, 8, 2, 2, 700, 128, 128, -1, 0, 0, 0, 0, 0, 0, 0},
        {"backward f32 causal fused", F32, F32, 2, 4, 2, 70, 70, 40, 40, -1, 0, 0, 0, 0, TA_OPT_FORCE_FUSED, 1, 0},
        {"backward f32 split",       F32, F32, 1, 2, 1, 70, 90, 64, 64, -1, -1, 0, 0, 0, TA_OPT_FORCE_SPLIT, 1, 0},
        {"backward f32 softcap",     F32, F32, 1, 4, 2, 50, 50, 32, 32, -1, 0, 5.0, 0, 0, 0, 1, 0},
        {"backward f64 causal",      F64, F64, 2, 4, 2, 40, 50, 40, 40, -1, 0, 0, 0, 0, 0, 1, 0},
        {"backward bf16",            BF,  F32, 1, 4, 2, 64, 64, 64, 64, -1, 0, 0, 0, 0, 0, 1, 0},
        {"cache int8",               F32, F32, 2, 8, 2, 1, 700, 64, 64, -1, 0, 0, 0, 0, 0, 0, TA_I8},
        {"cache int4 (bf16 q)",      BF,  BF,  2, 8, 2, 3, 700, 64, 64, -1, 0, 0, 0, 0, 0, 0, TA_I4},
        {"cache fp8 e4m3",           F32, F32, 2, 8, 2, 1, 700, 128, 128, -1, 0, 0, 0, 0, 0, 0, TA_F8E4M3},
        {"cache fp8 e5m2 (f16 q)",   H,   H,   2, 8, 2, 1, 700, 64, 64, -1, 0, 0, 0, 0, 0, 0, TA_F8E5M2},
        {"user score_mod f32",       F32, F32, 2, 4, 2, 70, 90, 64, 64, -1, 0, 0, 1, 0, 0, 1, 0},
        {"user score_mod f64",       F64, F64, 1, 4, 2, 40, 50, 32, 32, -1, -1, 0, 1, 0, 0, 1, 0},
        {"user score_mod decode",    F32, F32, 2, 8, 2, 1, 600, 64, 64, -1, 0, 0, 1, 0, 0, 0, 0},
        {"user mask_mod",            F32, F32, 2, 4, 2, 70, 90, 64, 64, -1, -1, 0, 0, 1, 0, 0, 0},
        {"user mask_mod decode",     BF,  BF,  2, 8, 2, 1, 600, 64, 64, -1, -1, 0, 0, 1, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].options & TA_OPT_BF16DOT && !bf16dot) {
            printf("skip %-34s no bf16 dot-product tiles in this build\n", cases[i].name);
            continue;
        }
        run(&cases[i]);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
