"""FlashAttention-2 forward in Triton: output and log-sum-exp, one query block per program.

The problem
-----------
For one query row ``q_i`` and the keys it may see, attention is ``sum_j softmax(s_i)_j v_j`` with
``s_ij`` the score of :mod:`tileattn.core.modifiers`. Materialising ``s`` costs O(Sq * Sk) memory; the
FlashAttention idea is never to hold more than one ``BLOCK_M x BLOCK_N`` tile of it.

The grid
--------
One program per (query block, query head, sequence): ``(cdiv(max_seqlen_q, BLOCK_M), Hq, B)``.
Query head ``h`` reads kv head ``h // group`` (GQA/MQA), so K and V are never repeated in memory:
the ``group`` programs that share a kv head simply read the same addresses (and L2 serves them).
Varlen (packed) problems read their sequence's start and length from ``cu_seqlens``; programs whose
block lies past the end of a short sequence exit at once.

The online softmax, in base 2
-----------------------------
Per row the program keeps ``m`` (running max of the base-2 logits), ``l`` (running sum of
``2^(s - m)``) and ``acc`` (unnormalised output). A new tile with a larger max rescales the old state
by ``alpha = 2^(m_old - m_new)``; ``exp2`` is the hardware's native exponential and the factor
``log2(e)`` is folded into the softmax scale, so no ``exp`` is ever computed. At the end
``out = acc / l`` and ``lse2 = m + log2(l)``; the kernel stores the log-sum-exp in base 2 (the
backward wants it so) and the launcher converts it to the natural log of the public API.

Rows that see no key at all (a window, Sq > Sk under causal, an all-False mask) keep ``m = -inf`` and
``l = 0``: a "safe" max of 0 avoids ``-inf - -inf = NaN``, and they output 0 with ``lse = -inf``.

Skipping and masking
--------------------
:func:`~.tile_math.visible_key_blocks` splits the keys of the block into: blocks the band hides from
every row (never loaded: for causal that is half the work), blocks visible to every row (no masking
code at all) and the boundary blocks (diagonal, window edge, last partial block), which alone pay for
the mask. Head dims that are not powers of two (40, 80, 96, ...) are padded to ``BLOCK_D`` with masked
loads; the padding columns load as zeros and contribute nothing to the dot products.

Dropout drops probabilities *after* they enter ``l`` (the softmax denominator is that of the undropped
weights) and scales the output by ``1 / (1 - p)``; the keep decision is the counter-based hash of
:mod:`tileattn.core.modifiers`, so the backward regenerates it instead of storing it.
"""

import triton
import triton.language as tl

from .tile_math import (diagonal_offset, dropout_head_key, dropout_keep, key_bounds, key_slots, score_tile,
                        sequence_bounds, visible_key_blocks)


@triton.jit
def _attend_key_blocks(
    acc, m_i, l_i, q, rows, start, end,
    k_base, v_base, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, table_base, page_size,
    offs_d, offs_dv, head_dim, head_dim_v, offset, q_len, k_len,
    sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
    window_left, window_right, head_key, drop_threshold,
    APPLY_BAND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Stream key blocks [start, end) through the online softmax of one query block."""
    for j0 in range(start, end, BLOCK_N):
        j0 = tl.multiple_of(j0, BLOCK_N)
        cols = j0 + tl.arange(0, BLOCK_N)
        page, slot = key_slots(cols, k_len, table_base, page_size, PAGED)
        # K is loaded transposed, (BLOCK_D, BLOCK_N), straight from its strides.
        kt = tl.load(k_base + (page * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None] * stride_kd,
                     mask=(cols[None, :] < k_len) & (offs_d[:, None] < head_dim), other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        s, _ = score_tile(
            qk, rows[:, None], cols[None, :], offset, q_len, k_len,
            sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
            window_left, window_right,
            APPLY_BAND, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = tl.where(dropout_keep(head_key, rows[:, None], cols[None, :], drop_threshold), p, 0.0)
        v = tl.load(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_dv[None, :] * stride_vd,
                    mask=(cols[:, None] < k_len) & (offs_dv[None, :] < head_dim_v), other=0.0)
        # P is rounded to V's dtype for the second GEMM, as FlashAttention-2 does (fp32 stays fp32).
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Triton turns int arguments equal to 1 into constants; the seed halves are converted to uint32
# inside, which a constant cannot be, and a seed of 1 must not cost a recompile anyway.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def attention_forward_kernel(
    Q, K, V, Out, Lse2, Mask, Bias, Slopes, CuSeqQ, CuSeqK, SeqUsedK, BlockTable,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_ab, stride_ah, stride_btb,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, page_size,
    sm_scale, softcap, window_left, window_right, align_shift,
    seed_lo, seed_hi, drop_threshold, drop_scale, tune_bucket,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Write ``Out`` and the base-2 ``Lse2`` for one (query block, query head, sequence).

    With ``PAGED``, K and V are pools (num_blocks, Hkv, page_size, D) read through the block table:
    ``stride_kb``/``stride_vb`` step from page to page. ``tune_bucket`` is not read: it only keys the
    GPU autotuner's cache by a coarse length bucket.
    """
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, q_len = sequence_bounds(CuSeqQ, batch, seqlen_q, IS_VARLEN)
    k_start, k_len = key_bounds(CuSeqK, SeqUsedK, batch, seqlen_k, IS_VARLEN, HAS_SEQUSED, PAGED)
    i0 = block * BLOCK_M
    if i0 >= q_len:
        return
    kv_head = head // group
    offset = diagonal_offset(q_len, k_len, align_shift, BOTTOM_RIGHT)

    # 64-bit base offsets: B * H * S * D overflows int32 on large problems.
    batch64 = batch.to(tl.int64)
    q_base = Q + batch64 * stride_qb + head.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qs
    k_base = K + kv_head.to(tl.int64) * stride_kh
    v_base = V + kv_head.to(tl.int64) * stride_vh
    if not PAGED:  # a pool's pages are addressed per key, through the block table
        k_base += batch64 * stride_kb + k_start.to(tl.int64) * stride_ks
        v_base += batch64 * stride_vb + k_start.to(tl.int64) * stride_vs
    table_base = BlockTable + batch64 * stride_btb
    mask_base = Mask + batch64 * stride_mb + head.to(tl.int64) * stride_mh
    bias_base = Bias + batch64 * stride_bb + head.to(tl.int64) * stride_bh

    rows = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=(rows[:, None] < q_len) & (offs_d[None, :] < head_dim), other=0.0)

    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch * stride_ab + head * stride_ah)
    head_key = 0
    if HAS_DROPOUT:
        head_key = dropout_head_key(seed_lo, seed_hi, batch, head)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

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
        acc, m_i, l_i = _attend_key_blocks(
            acc, m_i, l_i, q, rows, lo, hi, k_base, v_base,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, table_base, page_size,
            offs_d, offs_dv, head_dim, head_dim_v, offset, q_len, k_len,
            sm_scale, softcap, slope, mask_base, stride_mq, stride_mk, bias_base, stride_bq, stride_bk,
            window_left, window_right, head_key, drop_threshold,
            stage != 1, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, PAGED,
            BLOCK_N, DOT_PRECISION)

    # Normalise. l == 0 only for rows that saw nothing: they output 0 and lse2 = -inf.
    saw_keys = l_i > 0
    l_safe = tl.where(saw_keys, l_i, 1.0)
    inv_l = tl.where(saw_keys, 1.0 / l_safe, 0.0)
    if HAS_DROPOUT:
        inv_l = inv_l * drop_scale
    out = acc * inv_l[:, None]
    lse2 = tl.where(saw_keys, m_i + tl.log2(l_safe), float("-inf"))

    o_base = Out + batch64 * stride_ob + head.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_os
    tl.store(o_base + rows[:, None] * stride_os + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < q_len) & (offs_dv[None, :] < head_dim_v))
    l_base = Lse2 + batch64 * stride_lb + head.to(tl.int64) * stride_lh + q_start.to(tl.int64) * stride_ls
    tl.store(l_base + rows * stride_ls, lse2, mask=rows < q_len)
