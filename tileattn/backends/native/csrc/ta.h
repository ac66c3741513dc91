/* The call interface between kernels.py (ctypes) and the C kernels: one flat struct of 8-byte
 * fields, described once by the X-macro TA_FIELDS. The library exports the description as a string
 * (ta_abi), and kernels.py builds its struct.pack format from it at load time, so the two sides
 * cannot disagree on the layout.
 *
 * Conventions (see kernels.py for the Python view):
 *  - q/out/dout/dq: canonical (B, Hq, Sq, D) strided views; strides *_st = (batch, head, seq) in
 *    elements, last-dim stride 1. Varlen: (Tq, Hq, D) with st = (unused, head, token) and
 *    sequence b starting at token cu_q[b].
 *  - k/v/dk/dv: (B, Hkv, Sk, D) likewise; paged KV: pools (pages, page_size, Hkv, D) with
 *    st = (page, head, position) and block_table (B, max_pages).
 *  - lse/delta: (B, Hq, Sq) with st = (batch, head, seq); varlen (Hq, Tq) with st = (0, head, token).
 *  - mask/bias/dbias: 4-d broadcast views (B, Hq, Sq, Sk), strides may be 0.
 */
#ifndef TA_H
#define TA_H

#include <stdint.h>

#define TA_ERR_LEN 512

enum ta_dtype { TA_F32 = 0, TA_F64 = 1, TA_BF16 = 2, TA_F16 = 3 };

enum ta_status { TA_OK = 0, TA_CANCELLED = 1, TA_EINVAL = -1, TA_ENOMEM = -2 };

/* options: test and tuning switches; 0 = the shape-based defaults. */
enum ta_option {
    TA_OPT_FORCE_PREFILL = 1, /* forward: never the decode path */
    TA_OPT_FORCE_DECODE = 2,  /* forward: the decode path whatever the row count */
    TA_OPT_FORCE_SPLIT = 4,   /* backward: separate dK/dV and dQ passes even with many heads */
    TA_OPT_FORCE_FUSED = 8,   /* backward: one pass per head even with few heads */
    TA_OPT_NO_BF16DOT = 16,   /* bf16: fp32 tiles even where the CPU has vdpbf16ps */
    TA_OPT_BF16DOT = 32,      /* bf16: vdpbf16ps tiles where the CPU has them */
};

/* kind: p = pointer, i = int64, d = double, i3/i4 = int64 arrays */
#define TA_FIELDS(X)                                                                                \
    X(p, q) X(p, k) X(p, v) X(p, out) X(p, lse)                                                     \
    X(p, dout) X(p, delta) X(p, dq) X(p, dk) X(p, dv) X(p, dbias)                                   \
    X(p, cu_q) X(p, cu_k) X(p, seqused_k) X(p, block_table)                                         \
    X(p, alibi) X(p, mask) X(p, bias) X(p, cancel) X(p, err)                                        \
    X(i, B) X(i, Hq) X(i, Hkv) X(i, Sq) X(i, Sk) X(i, D) X(i, Dv) X(i, Tq) X(i, Tk)                 \
    X(i, num_pages) X(i, page_size) X(i, max_pages)                                                 \
    X(i3, q_st) X(i3, k_st) X(i3, v_st) X(i3, o_st) X(i3, lse_st)                                   \
    X(i3, do_st) X(i3, dq_st) X(i3, dk_st) X(i3, dv_st)                                             \
    X(i4, mask_st) X(i4, bias_st) X(i4, dbias_st) X(i3, alibi_st) X(i3, bt_st)                      \
    X(i, dtype) X(i, out_dtype) X(i, dout_dtype) X(i, dq_dtype) X(i, dkv_dtype) X(i, bias_dtype)    \
    X(i, left) X(i, right) X(i, bottom_right) X(i, shift)                                           \
    X(i, drop_threshold) X(i, seed) X(i, block_m) X(i, block_n) X(i, num_threads)                   \
    X(i, varlen) X(i, paged) X(i, options)                                                          \
    X(d, scale) X(d, softcap) X(d, dropout_p)

#define TA_FIELD_DECL(kind, name) TA_FIELD_##kind(name)
#define TA_FIELD_p(name) void *name;
#define TA_FIELD_i(name) int64_t name;
#define TA_FIELD_d(name) double name;
#define TA_FIELD_i3(name) int64_t name[3];
#define TA_FIELD_i4(name) int64_t name[4];

typedef struct ta_args {
    TA_FIELDS(TA_FIELD_DECL)
} ta_args;

#endif
