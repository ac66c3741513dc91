/* The passes around the GEMMs of tileattn.fused (the GEMMs themselves are MKL/oneDNN's, called
 * through PyTorch): RMSNorm into the GEMM's A operand, the projections' epilogue (bias, per-head
 * RMSNorm, RoPE, the scatter into the attention kernels' layout or a KV cache) and their backward
 * passes, and a small-M GEMM that reads bf16/fp16 weights as stored (decode).
 *
 * Plain C that the compiler vectorises (-O3 and the CPU's own flags): each row is converted once into
 * a buffer of the compute type (float for fp32/bf16/fp16, double for fp64) that stays in L1, worked
 * on there and converted once on the way out, so every pass reads its input once and writes its
 * output once. Rows are addressed as (batch b, position s) through strides, so one kernel serves
 * every layout; the Python side (tileattn/fused/native.py) validates every pointer and size first.
 *
 * Element types (dt): 0 fp32, 1 fp64, 2 bf16, 3 fp16, the native engine's codes.
 * Reproducibility: a row's result depends only on that row; per-block partial sums (weight
 * gradients) use blocks of a fixed number of rows, summed in block order by the caller, so no bit
 * depends on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, F64 = 1, BF16 = 2, F16 = 3 };

/* rows per block of a weight-gradient partial sum (fixed: the sums' order never depends on threads) */
#define TA_FUSED_BLOCK 64
/* the widest row a pass keeps in its stack buffers (hidden size or heads * head_dim) */
#define TA_FUSED_MAX_WIDTH 65536
/* below this many elements a pass runs on the calling thread (a fork/join costs microseconds) */
#define TA_FUSED_PARALLEL_MIN (1 << 16)

#if defined(__FLT16_MAX__)
typedef _Float16 ta_half;
#define TA_HAVE_FLOAT16 1
#endif

static inline float h2f(uint16_t h) {
#ifdef TA_HAVE_FLOAT16
    ta_half x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t f2h(float f) {
#ifdef TA_HAVE_FLOAT16
    ta_half x = (ta_half)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00;
    if (u >= 0x477ff000u) return sign | 0x7c00;
    if (u < 0x38800000u) {
        float v;
        memcpy(&v, &u, 4);
        return sign | (uint16_t)rintf(v * 16777216.0f);
    }
    u -= 112u << 23;
    u += 0xfffu + ((u >> 13) & 1);
    return sign | (uint16_t)(u >> 13);
#endif
}

/* bf16 <-> fp32 on the bits (the loops vectorise: -fno-strict-aliasing is among the build flags) */
static inline void load_bf16(const uint16_t *p, int64_t n, float *out) {
    uint32_t *o = (uint32_t *)out;
    for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)p[i] << 16;
}

static inline void store_bf16(uint16_t *p, int64_t n, const float *in) {
    const uint32_t *u = (const uint32_t *)in;
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = u[i];
        uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1)) >> 16; /* round to nearest even */
        uint32_t nan = (x >> 16) | 0x40;                            /* a NaN stays a quiet NaN */
        p[i] = (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
    }
}

/* One row of n elements of type dt at p, as the compute type (float or double), and back. */
static void load_f(const void *p, int dt, int64_t n, float *out) {
    switch (dt) {
    case F32: memcpy(out, p, (size_t)n * 4); break;
    case F64: for (int64_t i = 0; i < n; i++) out[i] = (float)((const double *)p)[i]; break;
    case BF16: load_bf16((const uint16_t *)p, n, out); break;
    default: for (int64_t i = 0; i < n; i++) out[i] = h2f(((const uint16_t *)p)[i]);
    }
}

static void store_f(void *p, int dt, int64_t n, const float *in) {
    switch (dt) {
    case F32: memcpy(p, in, (size_t)n * 4); break;
    case F64: for (int64_t i = 0; i < n; i++) ((double *)p)[i] = in[i]; break;
    case BF16: store_bf16((uint16_t *)p, n, in); break;
    default: for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[i] = f2h(in[i]);
    }
}

static void load_d(const void *p, int dt, int64_t n, double *out) {
    switch (dt) {
    case F64: memcpy(out, p, (size_t)n * 8); break;
    case F32: for (int64_t i = 0; i < n; i++) out[i] = ((const float *)p)[i]; break;
    case BF16: for (int64_t i = 0; i < n; i++) { float f; uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16; memcpy(&f, &u, 4); out[i] = f; } break;
    default: for (int64_t i = 0; i < n; i++) out[i] = h2f(((const uint16_t *)p)[i]);
    }
}

static void store_d(void *p, int dt, int64_t n, const double *in) {
    switch (dt) {
    case F64: memcpy(p, in, (size_t)n * 8); break;
    case F32: for (int64_t i = 0; i < n; i++) ((float *)p)[i] = (float)in[i]; break;
    default: {
        float tmp[256];
        for (int64_t i = 0; i < n; i += 256) {
            int64_t m = n - i < 256 ? n - i : 256;
            for (int64_t j = 0; j < m; j++) tmp[j] = (float)in[i + j];
            store_f((char *)p + i * 2, dt, m, tmp);
        }
    }
    }
}

static inline int64_t elsize(int dt) { return dt == F64 ? 8 : dt == F32 ? 4 : 2; }
static inline const char *at(const void *base, int64_t off, int dt) { return (const char *)base + off * elsize(dt); }

static int threads_for(int threads, int64_t elements) {
    return elements < TA_FUSED_PARALLEL_MIN || threads < 1 ? 1 : threads;
}

/* The kernels, once per compute type. */
#define real float
#define SFX(name) name##_f32
#define LOAD load_f
#define STORE store_f
#define SQRT sqrtf
#include "fused_body.h"
#undef real
#undef SFX
#undef LOAD
#undef STORE
#undef SQRT

#define real double
#define SFX(name) name##_f64
#define LOAD load_d
#define STORE store_d
#define SQRT sqrt
#include "fused_body.h"
#undef real
#undef SFX
#undef LOAD
#undef STORE
#undef SQRT

/* ------------------------------------------------------------------ exported: dispatch on compute type */

/* x: rows (b, s) of H elements at x + b*xs0 + s*xs1 (unit stride within a row). Computes
 * rstd[b*n1 + s] = 1/sqrt(mean(x^2) + eps) (or reads it when have_rstd) and, when xhat is set,
 * xhat[row*ldh + j] = x[j] * rstd * w[j] (w may be NULL: 1). rstd, w and xhat are of the compute type
 * (fp64 for fp64 x, else fp32). */
int ta_fused_rms(const void *x, int xdt, int64_t n0, int64_t n1, int64_t xs0, int64_t xs1, int64_t H,
                 const void *w, double eps, void *rstd, int have_rstd, void *xhat, int64_t ldh, int threads) {
    if (H > TA_FUSED_MAX_WIDTH) return -1;
    if (xdt == F64) return rms_f64(x, xdt, n0, n1, xs0, xs1, H, w, eps, rstd, have_rstd, xhat, ldh, threads);
    return rms_f32(x, xdt, n0, n1, xs0, xs1, H, w, (float)eps, rstd, have_rstd, xhat, ldh, threads);
}

/* The gradient of xhat = x * rstd * w: dx (dt of x, rows at dx + b*ds0 + s*ds1) and, when dw_part is
 * set, per block of TA_FUSED_BLOCK rows the partial sums of dxhat * x * rstd (dw_part[block*H + j]). */
int ta_fused_rms_backward(const void *x, int xdt, int64_t n0, int64_t n1, int64_t xs0, int64_t xs1, int64_t H,
                          const void *w, const void *rstd, const void *dxhat, int64_t ldd, void *dx, int64_t ds0,
                          int64_t ds1, void *dw_part, int threads) {
    if (H > TA_FUSED_MAX_WIDTH) return -1;
    if (xdt == F64)
        return rms_backward_f64(x, xdt, n0, n1, xs0, xs1, H, w, rstd, dxhat, ldd, dx, ds0, ds1, dw_part, threads);
    return rms_backward_f32(x, xdt, n0, n1, xs0, xs1, H, w, rstd, dxhat, ldd, dx, ds0, ds1, dw_part, threads);
}

/* The epilogues of the projections (q, k, v), one call: for every row (b, s) and head h of a part's y
 * (its GEMM's output, heads*D values a row at y + (b*n1 + s)*ldy, type ydt), optionally + bias, then a
 * per-head RMSNorm (nw: D weights, eps neps), then, for a part that is rotated, RoPE on the first rot
 * dims (cos/sin: rot/2 values of the row's position at cs + b*cs0 + s*cs1, likewise sn; interleaved
 * pairs (2i, 2i+1) or halves (i, i + rot/2)), stored (type ddt) at dst + b*ds0 + s*ds1 + h*dsh. With
 * cache_pos the row goes to position p = cache_pos[b] + s of sequence b instead of s: at
 * dst + b*ds0 + p*ds1 (contiguous cache) or, with a block table, dst + page*ds0 + (p % page_size)*ds1
 * with page = bt[b*bt_st + p / page_size]. bias, nw, cs and sn are of the compute type (fp64 when ydt
 * or ddt is fp64, else fp32).
 *
 * The arguments travel as one array of int64 (pointers included), read in the order of the enums
 * below: a decode step's call passes one array instead of three calls of two dozen arguments. */
enum { EP_N0, EP_N1, EP_D, EP_ROT, EP_INTERLEAVED, EP_CS0, EP_CS1, EP_COS, EP_SIN, EP_THREADS, EP_PARTS, EP_HEAD };
enum { PT_Y, PT_YDT, PT_LDY, PT_HEADS, PT_BIAS, PT_NW, PT_ROTATED, PT_DST, PT_DDT, PT_DS0, PT_DS1, PT_DSH, PT_POS,
       PT_BT, PT_BT_ST, PT_PAGE, PT_FIELDS };

#define PTR(v) ((void *)(intptr_t)(v))
int ta_fused_epilogues(const int64_t *a, double neps) {
    for (int64_t i = 0; i < a[EP_PARTS]; i++) {
        const int64_t *p = a + EP_HEAD + i * PT_FIELDS;
        if (p[PT_HEADS] * a[EP_D] > TA_FUSED_MAX_WIDTH) return -1;
        int64_t rot = p[PT_ROTATED] ? a[EP_ROT] : 0;
        int wide = p[PT_YDT] == F64 || p[PT_DDT] == F64, status;
        if (wide)
            status = epilogue_f64(PTR(p[PT_Y]), (int)p[PT_YDT], p[PT_LDY], a[EP_N0], a[EP_N1], p[PT_HEADS], a[EP_D],
                                  PTR(p[PT_BIAS]), PTR(p[PT_NW]), neps, PTR(a[EP_COS]), PTR(a[EP_SIN]), a[EP_CS0],
                                  a[EP_CS1], rot, (int)a[EP_INTERLEAVED], PTR(p[PT_DST]), (int)p[PT_DDT], p[PT_DS0],
                                  p[PT_DS1], p[PT_DSH], PTR(p[PT_POS]), PTR(p[PT_BT]), p[PT_BT_ST], p[PT_PAGE],
                                  (int)a[EP_THREADS]);
        else
            status = epilogue_f32(PTR(p[PT_Y]), (int)p[PT_YDT], p[PT_LDY], a[EP_N0], a[EP_N1], p[PT_HEADS], a[EP_D],
                                  PTR(p[PT_BIAS]), PTR(p[PT_NW]), (float)neps, PTR(a[EP_COS]), PTR(a[EP_SIN]),
                                  a[EP_CS0], a[EP_CS1], rot, (int)a[EP_INTERLEAVED], PTR(p[PT_DST]), (int)p[PT_DDT],
                                  p[PT_DS0], p[PT_DS1], p[PT_DSH], PTR(p[PT_POS]), PTR(p[PT_BT]), p[PT_BT_ST],
                                  p[PT_PAGE], (int)a[EP_THREADS]);
        if (status) return status;
    }
    return 0;
}

/* The epilogue's gradient: from g (the gradient of its output, type gdt, at g + b*gs0 + s*gs1 + h*gsh)
 * to dy (the GEMM output's gradient, compute type, rows of ldy). With a per-head RMSNorm, pre holds
 * the normalised values' input (y + bias, compute type, rows of ldp) and dnw_part gets per block of
 * TA_FUSED_BLOCK rows the partial sums of the norm weight's gradient (D values a block). */
int ta_fused_epilogue_backward(const void *g, int gdt, int64_t gs0, int64_t gs1, int64_t gsh, int64_t n0,
                               int64_t n1, int64_t heads, int64_t D, const void *pre, int64_t ldp, const void *nw,
                               double neps, void *dnw_part, const void *cs, const void *sn, int64_t cs0, int64_t cs1,
                               int64_t rot, int interleaved, void *dy, int64_t ldy, int threads) {
    if (heads * D > TA_FUSED_MAX_WIDTH) return -1;
    if (gdt == F64)
        return epilogue_backward_f64(g, gdt, gs0, gs1, gsh, n0, n1, heads, D, pre, ldp, nw, neps, dnw_part, cs, sn,
                                     cs0, cs1, rot, interleaved, dy, ldy, threads);
    return epilogue_backward_f32(g, gdt, gs0, gs1, gsh, n0, n1, heads, D, pre, ldp, nw, (float)neps, dnw_part, cs,
                                 sn, cs0, cs1, rot, interleaved, dy, ldy, threads);
}

/* c[m*ldc + n] = sum_k a[m*lda + k] * w[n*ldw + k] for m < M (M small: a decode step's rows), a in fp32,
 * w in bf16 or fp16 read as stored, c in fp32: every weight is read from memory once and converted in
 * registers, where converting the weights to fp32 first would write and read them again. Vectors of 8
 * lanes (GCC/clang vector extensions: AVX2 registers, two NEON ones); a block of R weight rows shares
 * each load of a's rows, with M * R accumulators in registers (M and R constant per instantiation). */
#define TA_GEMV_ROWS 8
typedef float ta_v8f __attribute__((vector_size(32)));
typedef uint16_t ta_v8u16 __attribute__((vector_size(16)));
typedef uint32_t ta_v8u32 __attribute__((vector_size(32)));
#ifdef TA_HAVE_FLOAT16
typedef ta_half ta_v8h __attribute__((vector_size(16)));
#endif

static inline __attribute__((always_inline)) ta_v8f load8_w(const uint16_t *p, int wdt) {
    ta_v8u16 u;
    memcpy(&u, p, 16);
    if (wdt == BF16) {
        ta_v8u32 wide = __builtin_convertvector(u, ta_v8u32) << 16;
        ta_v8f f;
        memcpy(&f, &wide, 32);
        return f;
    }
#ifdef TA_HAVE_FLOAT16
    ta_v8h h;
    memcpy(&h, &u, 16);
    return __builtin_convertvector(h, ta_v8f);
#else
    ta_v8f f;
    for (int l = 0; l < 8; l++) f[l] = h2f(u[l]);
    return f;
#endif
}

static inline __attribute__((always_inline)) void gemv_block(const int M, const int R, const float *a, int64_t K,
                                                            int64_t lda, const uint16_t *w, int wdt, int64_t ldw,
                                                            int64_t n, float *c, int64_t ldc) {
    ta_v8f acc[TA_GEMV_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = (ta_v8f){0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        ta_v8f wv[4];
        for (int r = 0; r < R; r++) wv[r] = load8_w(w + (n + r) * ldw + k, wdt);
        for (int m = 0; m < M; m++) {
            ta_v8f av;
            memcpy(&av, a + m * lda + k, 32);
            for (int r = 0; r < R; r++) acc[m][r] += av * wv[r];
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int l = 0; l < 8; l++) sum += acc[m][r][l];
            for (int64_t kk = k; kk < K; kk++) {
                float wk;
                load_f(w + (n + r) * ldw + kk, wdt, 1, &wk);
                sum += a[m * lda + kk] * wk;
            }
            c[m * ldc + n + r] = sum;
        }
}

/* rows of w a block takes: 4 for one row of a, 2 for two, else 1 (M * R accumulators stay within the
 * 16 vector registers of AVX2) */
#define TA_GEMV_R(M) ((M) == 1 ? 4 : (M) == 2 ? 2 : 1)
#define TA_GEMV_CASE(M)                                                                             \
    case M: {                                                                                       \
        int rows = n + TA_GEMV_R(M) <= end ? TA_GEMV_R(M) : 1;                                      \
        if (rows == TA_GEMV_R(M))                                                                   \
            gemv_block(M, TA_GEMV_R(M), a, K, lda, w, wdt, ldw, n, c, ldc);                         \
        else                                                                                        \
            gemv_block(M, 1, a, K, lda, w, wdt, ldw, n, c, ldc);                                    \
        n += rows;                                                                                  \
        break;                                                                                      \
    }

int ta_fused_gemm_lowp(const float *a, int64_t M, int64_t K, int64_t lda, const uint16_t *w, int wdt, int64_t N,
                       int64_t ldw, float *c, int64_t ldc, int threads) {
    if (M < 1 || M > TA_GEMV_ROWS || (wdt != BF16 && wdt != F16)) return -1;
    int nt = threads_for(threads, N * K);
    /* chunks of 64 weight rows, a block of rows never crossing a chunk's end */
    int64_t chunks = (N + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        int64_t end = (chunk + 1) * 64 < N ? (chunk + 1) * 64 : N;
        for (int64_t n = chunk * 64; n < end;) {
            switch (M) {
                TA_GEMV_CASE(1)
                TA_GEMV_CASE(2)
                TA_GEMV_CASE(3)
                TA_GEMV_CASE(4)
                TA_GEMV_CASE(5)
                TA_GEMV_CASE(6)
                TA_GEMV_CASE(7)
                TA_GEMV_CASE(8)
            }
        }
    }
    return 0;
}
