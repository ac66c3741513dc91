/* What every kernel shares: the geometry of one sequence (lengths, band offset, row addresses),
 * element conversions, the dropout hash of tileattn/core/score_math.py, per-thread scratch and cancellation.
 */
#ifndef TA_COMMON_H
#define TA_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "ta.h"

#define TA_LOG2E 1.4426950408889634
#define TA_LN2 0.6931471805599453
/* The running row maximum may lag the true maximum by up to this many units of log2: a tile
 * rescales the accumulator only when its maximum exceeds the running one by more (FlashAttention-4's
 * rule). Probabilities then stay below 2^8, far from overflow, and the maximum used for the LSE is
 * never more than 8 binades stale. */
#define TA_RESCALE_THRESHOLD 8.0
#define TA_NO_LIMIT (INT64_MAX / 4)

/* ------------------------------------------------------------------------------ sequence geometry */

/* One batch item: its lengths, its band offset and the element offsets of its rows. */
typedef struct {
    int64_t b, q_len, k_len, off;
    int64_t q0, o0, l0, do0, dq0; /* offset of (row 0, head 0) in q, out, lse/delta, dout, dq */
    int64_t k0, v0, dk0, dv0;     /* same in k, v, dk, dv (unused for paged KV) */
} ta_seq;

static inline int64_t ta_seq_q_rows(const ta_args *a, int64_t b) {
    const int32_t *cu = (const int32_t *)a->cu_q;
    return a->varlen ? (int64_t)cu[b + 1] - cu[b] : a->Sq;
}

static inline void ta_seq_init(const ta_args *a, int64_t b, ta_seq *s) {
    const int32_t *cu_q = (const int32_t *)a->cu_q, *cu_k = (const int32_t *)a->cu_k;
    const int32_t *used = (const int32_t *)a->seqused_k;
    s->b = b;
    s->q_len = ta_seq_q_rows(a, b);
    if (used)
        s->k_len = used[b];
    else if (a->varlen && !a->paged)
        s->k_len = (int64_t)cu_k[b + 1] - cu_k[b];
    else
        s->k_len = a->paged ? a->max_pages * a->page_size : a->Sk;
    s->off = a->shift + (a->bottom_right ? s->k_len - s->q_len : 0);
    /* varlen rows are addressed as token (cu[b] + i), padded rows as (b, i) */
    int64_t tq = a->varlen ? cu_q[b] : 0, tk = (a->varlen && !a->paged) ? cu_k[b] : 0;
    int64_t bq = a->varlen ? 0 : b, bk = (a->varlen && !a->paged) ? 0 : b;
    s->q0 = bq * a->q_st[0] + tq * a->q_st[2];
    s->o0 = bq * a->o_st[0] + tq * a->o_st[2];
    s->l0 = bq * a->lse_st[0] + tq * a->lse_st[2];
    s->do0 = bq * a->do_st[0] + tq * a->do_st[2];
    s->dq0 = bq * a->dq_st[0] + tq * a->dq_st[2];
    s->k0 = bk * a->k_st[0] + tk * a->k_st[2];
    s->v0 = bk * a->v_st[0] + tk * a->v_st[2];
    s->dk0 = bk * a->dk_st[0] + tk * a->dk_st[2];
    s->dv0 = bk * a->dv_st[0] + tk * a->dv_st[2];
}

/* Query row i sees key j iff lo(i) <= j <= hi(i) (inclusive, already clipped to the keys). */
static inline int64_t ta_band_lo(const ta_args *a, const ta_seq *s, int64_t i) {
    int64_t lo = a->left >= 0 ? i + s->off - a->left : 0;
    return lo < 0 ? 0 : lo;
}

static inline int64_t ta_band_hi(const ta_args *a, const ta_seq *s, int64_t i) {
    int64_t hi = a->right >= 0 ? i + s->off + a->right : TA_NO_LIMIT;
    return hi > s->k_len - 1 ? s->k_len - 1 : hi;
}

/* Half-open range of query rows that see at least one key of [j0, j1). */
static inline void ta_query_range(const ta_args *a, const ta_seq *s, int64_t j0, int64_t j1, int64_t *lo,
                                  int64_t *hi) {
    int64_t l = a->right >= 0 ? j0 - s->off - a->right : 0;
    int64_t h = a->left >= 0 ? j1 - 1 - s->off + a->left + 1 : s->q_len;
    *lo = l < 0 ? 0 : l;
    *hi = h > s->q_len ? s->q_len : h;
    if (*hi < *lo) *hi = *lo;
}

/* Element offset of key row j of kv head h in a k-like tensor (k, v; paged or not). */
static inline int64_t ta_key_off(const ta_args *a, const ta_seq *s, const int64_t st[3], int64_t base, int64_t h,
                                 int64_t j) {
    if (a->paged) {
        const int32_t *bt = (const int32_t *)a->block_table;
        int64_t page = bt[s->b * a->bt_st[0] + (j / a->page_size) * a->bt_st[1]];
        return page * st[0] + h * st[1] + (j % a->page_size) * st[2];
    }
    return base + h * st[1] + j * st[2];
}

/* ------------------------------------------------------------------------------------ conversions */

static inline int64_t ta_elsize(int64_t dtype) { return dtype == TA_F64 ? 8 : dtype == TA_F32 ? 4 : 2; }

static inline const void *ta_at(const void *base, int64_t off, int64_t dtype) {
    return (const char *)base + off * ta_elsize(dtype);
}

static inline float ta_bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t ta_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1);                                                 /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float ta_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f); /* subnormal: m * 2^-24, exact */
        return sign ? -v : v;
    }
    u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t ta_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00;  /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00; /* >= 65520 rounds to infinity */
    if (u < 0x38800000u) {                      /* below 2^-14: a subnormal half */
        float v;
        memcpy(&v, &u, 4);
        return sign | (uint16_t)rintf(v * 16777216.0f);
    }
    u -= 112u << 23;
    u += 0xfffu + ((u >> 13) & 1);
    return sign | (uint16_t)(u >> 13);
}

static inline double ta_load1(const void *p, int64_t dtype) {
    switch (dtype) {
    case TA_F32: return *(const float *)p;
    case TA_F64: return *(const double *)p;
    case TA_BF16: return ta_bf16_to_f32(*(const uint16_t *)p);
    default: return ta_f16_to_f32(*(const uint16_t *)p);
    }
}

/* ------------------------------------------------------------------------------- dropout hash */

/* The counter-based hash of tileattn/core/score_math.py (and the Triton kernels), bit for bit: the decision
 * for (seed, batch, head, row, col) is a pure function of those numbers, so the backward pass
 * regenerates the forward's mask and any tiling gives the same mask. */
#define TA_MUL_A 0x7FEB352Du
#define TA_MUL_B 0x5BD1E995u
#define TA_GOLDEN 0x1E3779B9u

static inline uint32_t ta_mix32(uint32_t x) {
    x ^= x >> 16;
    x *= TA_MUL_A;
    x ^= x >> 15;
    x *= TA_MUL_B;
    return x ^ (x >> 16);
}

static inline uint32_t ta_drop_row_key(const ta_args *a, int64_t b, int64_t h, int64_t i) {
    uint64_t seed = (uint64_t)a->seed;
    uint32_t k = ta_mix32((uint32_t)seed ^ TA_GOLDEN);
    k = ta_mix32(k ^ (uint32_t)(seed >> 32));
    k = ta_mix32(k ^ (uint32_t)b);
    k = ta_mix32(k ^ (uint32_t)h);
    return ta_mix32(k ^ (uint32_t)i);
}

TA_INLINE vu32 ta_vmix32(vu32 x) {
    x ^= x >> 16;
    x *= TA_MUL_A;
    x ^= x >> 15;
    x *= TA_MUL_B;
    return x ^ (x >> 16);
}

/* ------------------------------------------------------------------------ scratch, cancellation */

/* Per-thread scratch that outlives a call (OpenMP keeps its threads), so steady-state calls do
 * not allocate. Defined in api.c; `slot` separates buffers that must coexist. NULL when out of memory. */
void *ta_scratch(int slot, size_t bytes);
void ta_scratch_trim(void);
#define TA_SCRATCH_SLOTS 3

static inline int ta_cancelled(const ta_args *a) {
    return a->cancel && __atomic_load_n((const int32_t *)a->cancel, __ATOMIC_RELAXED) != 0;
}

/* Round n up to a multiple of m. */
static inline int64_t ta_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

#endif
