"""FlashAttention-2 backward in Triton: dQ, dK, dV (and the bias gradient), without atomics.

The gradients
-------------
The forward saved only ``out`` and the base-2 log-sum-exp ``lse2`` per row. The backward rebuilds
each probability tile from them, ``P = 2^(s - lse2)``, instead of storing the Sq x Sk matrix. With
``Delta_i = sum_d dO_id O_id - dLSE_i`` (computed by the caller, :mod:`tileattn.core.ops`)::

    dV_j = sum_i P_ij dO_i          dP_ij = dO_i . V_j          dS_ij = P_ij (dP_ij - Delta_i)
    dQ_i = scale * sum_j dS_ij K_j  dK_j  = scale * sum_i dS_ij Q_i

(``dS`` is the gradient of the natural-log scores: ``P`` is the same number whatever the base of
the logarithm, so working in base 2 changes nothing here.) Dropout multiplies ``P`` and ``dP`` by the
regenerated keep mask over ``1 - p``; a softcap multiplies ``dS`` by ``1 - tanh^2`` on its way back to
``q.k^T``; the gradient of an additive bias is ``dS`` itself.

Two passes, no atomics
----------------------
``dK``/``dV`` are sums over query rows and ``dQ`` a sum over keys. One fused loop would have to add
one of them from many programs at once (atomics: fast, but the summation order changes from run to
run). Here each gradient has its own pass, and each program owns the rows it writes:

* :func:`attention_backward_dkdv_kernel`, one program per (key block, kv head, sequence), loops over
  the query blocks of *every* query head of its GQA group and writes its dK/dV block once;
* :func:`attention_backward_dq_kernel`, one program per (query block, query head, sequence), loops
  over the key blocks like the forward and writes its dQ block once (and the bias gradient tile).

The price is computing ``q.k^T`` and ``P`` twice. The gain: every sum has a fixed order, so the
gradients are bitwise reproducible, and ``deterministic=True`` costs nothing.

The dK/dV pass works on transposed tiles (keys along rows, queries along columns) so that its
accumulators are (BLOCK_N, D) row blocks; :func:`~.tile_math.score_tile` is elementwise in its
``rows``/``cols`` indices, which is what lets both passes share it.
"""

import triton
import triton.language as tl

from .tile_math import (diagonal_offset, dropout_head_key, dropout_keep, key_bounds, score_tile, sequence_bounds,
                        visible_key_blocks, visible_query_blocks)


@triton.jit
def _dkdv_query_blocks(
    dk, dv, k, v, cols, start, end,
    q_base, do_base, lse_base, delta_base,
    stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
    offs_d, offs_dv, head_dim, head_dim_v, offset, q_len, k_len,
    sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
    window_left, window_right, head_key, drop_threshold, drop_scale,
    APPLY_BAND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate one key block's dK/dV over query blocks [start, end) of one query head."""
    for i0 in range(start, end, BLOCK_M):
        i0 = tl.multiple_of(i0, BLOCK_M)
        rows = i0 + tl.arange(0, BLOCK_M)
        row_in = rows < q_len
        # Q and dO are loaded transposed, (D, BLOCK_M), for the transposed score tile.
        qt = tl.load(q_base + rows[None, :] * stride_qs + offs_d[:, None] * stride_qd,
                     mask=row_in[None, :] & (offs_d[:, None] < head_dim), other=0.0)
        do = tl.load(do_base + rows[:, None] * stride_gs + offs_dv[None, :] * stride_gd,
                     mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
        # +inf for rows past the end (and, via the launcher, for rows that saw no key): P = 0 there.
        lse2 = tl.load(lse_base + rows * stride_ls, mask=row_in, other=float("inf"))
        delta = tl.load(delta_base + rows * stride_ls, mask=row_in, other=0.0)

        qk_t = tl.dot(k, qt, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        s_t, tanh_t = score_tile(
            qk_t, rows[None, :], cols[:, None], offset, q_len, k_len,
            sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
            window_left, window_right,
            APPLY_BAND, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
        )
        p_t = tl.exp2(s_t - lse2[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if HAS_DROPOUT:
            keep_t = dropout_keep(head_key, rows[None, :], cols[:, None], drop_threshold)
            p_used = tl.where(keep_t, p_t * drop_scale, 0.0)
            dp_t = tl.where(keep_t, dp_t * drop_scale, 0.0)
        else:
            p_used = p_t
        dv += tl.dot(p_used.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        dk += tl.dot(ds_t.to(qt.dtype), tl.trans(qt), input_precision=DOT_PRECISION)
    return dk, dv


# Triton turns int arguments equal to 1 into constants; the seed halves are converted to uint32
# inside, which a constant cannot be, and a seed of 1 must not cost a recompile anyway.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def attention_backward_dkdv_kernel(
    Q, K, V, DOut, Lse2, Delta, DK, DV, Mask, Bias, Slopes, CuSeqQ, CuSeqK, SeqUsedK,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_lb, stride_lh, stride_ls,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_ab, stride_ah,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v,
    sm_scale, softcap, window_left, window_right, align_shift,
    seed_lo, seed_hi, drop_threshold, drop_scale, tune_bucket,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dK and dV of one (key block, kv head, sequence), summed over the kv head's query heads."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, q_len = sequence_bounds(CuSeqQ, batch, seqlen_q, IS_VARLEN)
    k_start, k_len = key_bounds(CuSeqK, SeqUsedK, batch, seqlen_k, IS_VARLEN, HAS_SEQUSED, False)
    j0 = block * BLOCK_N
    if j0 >= k_len:
        return
    offset = diagonal_offset(q_len, k_len, align_shift, BOTTOM_RIGHT)
    batch64 = batch.to(tl.int64)
    q_start64 = q_start.to(tl.int64)

    cols = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_in = cols < k_len
    k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_ks
    v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vs
    k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=col_in[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                mask=col_in[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    start, mid_lo, mid_hi, end = visible_query_blocks(
        j0, q_len, k_len, offset, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    # The query heads of this kv head, in a fixed order (part of what makes the sum reproducible).
    for g in range(0, group):
        head = kv_head * group + g
        head64 = head.to(tl.int64)
        q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_start64 * stride_qs
        do_base = DOut + batch64 * stride_gb + head64 * stride_gh + q_start64 * stride_gs
        lse_base = Lse2 + batch64 * stride_lb + head64 * stride_lh + q_start64 * stride_ls
        delta_base = Delta + batch64 * stride_lb + head64 * stride_lh + q_start64 * stride_ls
        mask_base = Mask + batch64 * stride_mb + head64 * stride_mh
        bias_base = Bias + batch64 * stride_bb + head64 * stride_bh
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + batch * stride_ab + head * stride_ah)
        head_key = 0
        if HAS_DROPOUT:
            head_key = dropout_head_key(seed_lo, seed_hi, batch, head)
        # Three stages over the visible blocks: masked head, unmasked interior (no band code), masked tail.
        for stage in tl.static_range(3):
            if stage == 0:
                lo, hi = start, mid_lo
            elif stage == 1:
                lo, hi = mid_lo, mid_hi
            else:
                lo, hi = mid_hi, end
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, cols, lo, hi, q_base, do_base, lse_base, delta_base,
                stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
                offs_d, offs_dv, head_dim, head_dim_v, offset, q_len, k_len,
                sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
                window_left, window_right, head_key, drop_threshold, drop_scale,
                stage != 1, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT,
                BLOCK_M, DOT_PRECISION)

    dk = dk * sm_scale
    dk_base = DK + batch64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + k_start.to(tl.int64) * stride_dks
    dv_base = DV + batch64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh + k_start.to(tl.int64) * stride_dvs
    tl.store(dk_base + cols[:, None] * stride_dks + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=col_in[:, None] & (offs_d[None, :] < head_dim))
    tl.store(dv_base + cols[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=col_in[:, None] & (offs_dv[None, :] < head_dim_v))


@triton.jit
def _dq_key_blocks(
    dq, q, do, lse2, delta, rows, start, end,
    k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, dbias_base, stride_dbq,
    offs_d, offs_dv, head_dim, head_dim_v, offset, q_len, k_len,
    sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
    window_left, window_right, head_key, drop_threshold, drop_scale,
    APPLY_BAND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, WRITE_DBIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query block's dQ over key blocks [start, end)."""
    for j0 in range(start, end, BLOCK_N):
        j0 = tl.multiple_of(j0, BLOCK_N)
        cols = j0 + tl.arange(0, BLOCK_N)
        col_in = cols < k_len
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                     mask=col_in[None, :] & (offs_d[:, None] < head_dim), other=0.0)
        vt = tl.load(v_base + cols[None, :] * stride_vs + offs_dv[:, None] * stride_vd,
                     mask=col_in[None, :] & (offs_dv[:, None] < head_dim_v), other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        s, tanh = score_tile(
            qk, rows[:, None], cols[None, :], offset, q_len, k_len,
            sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
            window_left, window_right,
            APPLY_BAND, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
        )
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(head_key, rows[:, None], cols[None, :], drop_threshold)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if WRITE_DBIAS:
            # Every (row, col) of the band is visited by exactly one program: a plain store suffices.
            tl.store(dbias_base + rows[:, None] * stride_dbq + cols[None, :], ds,
                     mask=(rows[:, None] < q_len) & col_in[None, :])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
    return dq


# Triton turns int arguments equal to 1 into constants; the seed halves are converted to uint32
# inside, which a constant cannot be, and a seed of 1 must not cost a recompile anyway.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def attention_backward_dq_kernel(
    Q, K, V, DOut, Lse2, Delta, DQ, DBias, Mask, Bias, Slopes, CuSeqQ, CuSeqK, SeqUsedK,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_lb, stride_lh, stride_ls,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_dbb, stride_dbh, stride_dbq,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_ab, stride_ah,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v,
    sm_scale, softcap, window_left, window_right, align_shift,
    seed_lo, seed_hi, drop_threshold, drop_scale, tune_bucket,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, WRITE_DBIAS: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ of one (query block, query head, sequence); with WRITE_DBIAS also its dS rows (dense fp32)."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, q_len = sequence_bounds(CuSeqQ, batch, seqlen_q, IS_VARLEN)
    k_start, k_len = key_bounds(CuSeqK, SeqUsedK, batch, seqlen_k, IS_VARLEN, HAS_SEQUSED, False)
    i0 = block * BLOCK_M
    if i0 >= q_len:
        return
    kv_head = head // group
    offset = diagonal_offset(q_len, k_len, align_shift, BOTTOM_RIGHT)
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    q_start64 = q_start.to(tl.int64)

    rows = i0 + tl.arange(0, BLOCK_M)
    row_in = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + batch64 * stride_qb + head64 * stride_qh + (q_start64 + rows[:, None]) * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_in[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    do = tl.load(DOut + batch64 * stride_gb + head64 * stride_gh + (q_start64 + rows[:, None]) * stride_gs
                 + offs_dv[None, :] * stride_gd, mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
    lse_rows = batch64 * stride_lb + head64 * stride_lh + (q_start64 + rows) * stride_ls
    lse2 = tl.load(Lse2 + lse_rows, mask=row_in, other=float("inf"))
    delta = tl.load(Delta + lse_rows, mask=row_in, other=0.0)

    k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_ks
    v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vs
    mask_base = Mask + batch64 * stride_mb + head64 * stride_mh
    bias_base = Bias + batch64 * stride_bb + head64 * stride_bh
    dbias_base = DBias + batch64 * stride_dbb + head64 * stride_dbh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch * stride_ab + head * stride_ah)
    head_key = 0
    if HAS_DROPOUT:
        head_key = dropout_head_key(seed_lo, seed_hi, batch, head)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    start, mid_lo, mid_hi, end = visible_key_blocks(
        i0, q_len, k_len, offset, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # Three stages over the visible blocks: masked head, unmasked interior (no band code), masked tail.
    for stage in tl.static_range(3):
        if stage == 0:
            lo, hi = start, mid_lo
        elif stage == 1:
            lo, hi = mid_lo, mid_hi
        else:
            lo, hi = mid_hi, end
        dq = _dq_key_blocks(
            dq, q, do, lse2, delta, rows, lo, hi,
            k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, dbias_base, stride_dbq,
            offs_d, offs_dv, head_dim, head_dim_v, offset, q_len, k_len,
            sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
            window_left, window_right, head_key, drop_threshold, drop_scale,
            stage != 1, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, WRITE_DBIAS,
            BLOCK_N, DOT_PRECISION)

    dq = dq * sm_scale
    tl.store(DQ + batch64 * stride_dqb + head64 * stride_dqh + (q_start64 + rows[:, None]) * stride_dqs
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=row_in[:, None] & (offs_d[None, :] < head_dim))
