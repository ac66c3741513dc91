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
 *  - quantised K/V (options & TA_OPT_KV_QUANT): kv_dtype and the scale descriptor of kv.h.
 *  - user functions and block maps: `user` points at a ta_user_args (below), NULL without them.
 */
#ifndef TA_H
#define TA_H

#include <stdint.h>

#define TA_ERR_LEN 512

/* TA_I8 .. TA_Q4_0: formats of a quantised K/V cache (kv_dtype, see kv.h), never of q */
enum ta_dtype {
    TA_F32 = 0, TA_F64 = 1, TA_BF16 = 2, TA_F16 = 3, TA_I8 = 4, TA_F8E4M3 = 5, TA_F8E5M2 = 6, TA_I4 = 7,
    TA_Q8_0 = 8, TA_Q4_0 = 9
};

enum ta_status { TA_OK = 0, TA_CANCELLED = 1, TA_EINVAL = -1, TA_ENOMEM = -2 };

/* options: test and tuning switches; 0 = the shape-based defaults. */
enum ta_option {
    TA_OPT_FORCE_PREFILL = 1, /* forward: never the decode path */
    TA_OPT_FORCE_DECODE = 2,  /* forward: the decode path whatever the row count */
    TA_OPT_FORCE_SPLIT = 4,   /* backward: separate dK/dV and dQ passes even with many heads */
    TA_OPT_FORCE_FUSED = 8,   /* backward: one pass per head even with few heads */
    TA_OPT_NO_BF16DOT = 16,   /* bf16: fp32 tiles even where the CPU has vdpbf16ps */
    TA_OPT_BF16DOT = 32,      /* bf16: vdpbf16ps tiles where the CPU has them */
    TA_OPT_NO_AMX = 64,       /* bf16: no AMX tiles even where the CPU and the OS allow them */
    TA_OPT_KV_QUANT = 128,    /* the "quant" section is set: k/v format and scales (kernels.py sets it) */
};

/* X(section, kind, name); kind: p = pointer, i = int64, d = double, i3/i4/i6 = int64 arrays.
 * Sections are contiguous and written by Python as units: "core" on every call, the others only
 * when the call uses them (the kernels read a section only when its pointer is set: block_table,
 * mask, bias, alibi, dout, dbias), so a decode step packs 62 values, not all of them. */
#define TA_FIELDS(X)                                                                                \
    X(core, p, q) X(core, p, k) X(core, p, v) X(core, p, out) X(core, p, lse)                       \
    X(core, p, dout) X(core, p, delta) X(core, p, dq) X(core, p, dk) X(core, p, dv)                 \
    X(core, p, dbias) X(core, p, cu_q) X(core, p, cu_k) X(core, p, seqused_k)                       \
    X(core, p, block_table) X(core, p, alibi) X(core, p, mask) X(core, p, bias)                     \
    X(core, p, cancel) X(core, p, err) X(core, p, user)                                             \
    X(core, i, B) X(core, i, Hq) X(core, i, Hkv) X(core, i, Sq) X(core, i, Sk) X(core, i, D)        \
    X(core, i, Dv) X(core, i, Tq) X(core, i, Tk)                                                    \
    X(core, i3, q_st) X(core, i3, k_st) X(core, i3, v_st) X(core, i3, o_st) X(core, i3, lse_st)     \
    X(core, i, dtype) X(core, i, out_dtype) X(core, i, left) X(core, i, right)                      \
    X(core, i, bottom_right) X(core, i, shift) X(core, i, drop_threshold) X(core, i, seed)          \
    X(core, i, block_m) X(core, i, block_n) X(core, i, num_threads) X(core, i, varlen)              \
    X(core, i, paged) X(core, i, options)                                                           \
    X(core, d, scale) X(core, d, softcap) X(core, d, dropout_p)                                     \
    X(paged, i, num_pages) X(paged, i, page_size) X(paged, i, max_pages) X(paged, i3, bt_st)        \
    X(mask, i4, mask_st)                                                                            \
    X(bias, i4, bias_st) X(bias, i, bias_dtype)                                                     \
    X(alibi, i3, alibi_st)                                                                          \
    X(bwd, i3, do_st) X(bwd, i3, dq_st) X(bwd, i3, dk_st) X(bwd, i3, dv_st) X(bwd, i, dout_dtype)   \
    X(bwd, i, dq_dtype) X(bwd, i, dkv_dtype)                                                        \
    X(dbias, i4, dbias_st)                                                                          \
    X(quant, i, kv_dtype) X(quant, p, k_scale) X(quant, p, k_offset) X(quant, p, v_scale)           \
    X(quant, p, v_offset) X(quant, p, q_scale) X(quant, i6, k_scale_st) X(quant, i6, k_offset_st)   \
    X(quant, i6, v_scale_st) X(quant, i6, v_offset_st) X(quant, i3, q_scale_st)

#define TA_FIELD_DECL(section, kind, name) TA_FIELD_##kind(name)
#define TA_FIELD_p(name) void *name;
#define TA_FIELD_i(name) int64_t name;
#define TA_FIELD_d(name) double name;
#define TA_FIELD_i3(name) int64_t name[3];
#define TA_FIELD_i4(name) int64_t name[4];
#define TA_FIELD_i6(name) int64_t name[6];

typedef struct ta_args {
    TA_FIELDS(TA_FIELD_DECL)
} ta_args;

/* Whether a call's scores take the built-in transforms between the GEMM and the softmax (softcap,
 * ALiBi, bias: tile.h's ta_score_transform and ta_row_transform); a new transform's field joins here. */
static inline int ta_transforms(const ta_args *a) { return a->softcap > 0 || a->alibi || a->bias; }

/* Whether those transforms have a derivative other than 1 (the softcap's 1 - tanh^2): the backward pass
 * then has tile.h's ta_score_transform keep it per score and multiplies dS by it; a new transform with
 * a derivative joins here. */
static inline int ta_transform_derivative(const ta_args *a) { return a->softcap > 0; }

/* User functions (score_mod / mask_mod compiled by tileattn.programs, see programs/codegen.py for
 * their signatures) and a block map, read through ta_args.user. Score functions work on the
 * kernels' `real` (the program was compiled for the call's working precision). Indices passed to
 * them: b = sequence, h = query head, q_idx = i + off (the row's position aligned with the keys, as
 * the band counts it), kv_idx = key j of the sequence.
 *  - score_*: the score_mod (forward key-major, forward row-major, backward, and the forward's fused
 *    sweep: score_mod, masks, base-2 logits and row maxima in one pass), its captures (pointer
 *    array, their sizes), run-time scalars, and for the backward score_grad[t * score_ncap + c], the
 *    buffer of thread t for capture c (NULL: no gradient), each `real` and shaped like the capture.
 *  - mask_*: the mask_mod likewise (forward only: a mask has no gradient).
 *  - states: uint8 block map (B|1, Hq|1, rows, cols) of block_q x block_kv blocks, 0 = hidden,
 *    1 = mask_fn decides, 2 = visible; states_st its strides (0 where broadcast). Positions outside
 *    map_q_len x map_kv_len are hidden. NULL: every block is 1 (mask_fn) or 2 (no mask_fn).
 *  - status: an int32 that receives the first nonzero return of a user function (a failed index
 *    check; the mask_mod's negated), for Python to raise. */
#define TA_USER_FIELDS(X)                                                                           \
    X(user, p, score_fn) X(user, p, score_rows_fn) X(user, p, score_bwd_fn) X(user, p, score_logits_fn) \
    X(user, p, score_cap)                                                                           \
    X(user, p, score_sizes) X(user, p, score_scalars) X(user, p, score_grad) X(user, i, score_ncap)  \
    X(user, p, mask_fn) X(user, p, mask_rows_fn) X(user, p, mask_cap) X(user, p, mask_sizes)        \
    X(user, p, mask_scalars) X(user, p, states) X(user, i4, states_st) X(user, i, block_q)           \
    X(user, i, block_kv) X(user, i, map_q_len) X(user, i, map_kv_len) X(user, p, status)

typedef struct ta_user_args {
    TA_USER_FIELDS(TA_FIELD_DECL)
} ta_user_args;

#endif
