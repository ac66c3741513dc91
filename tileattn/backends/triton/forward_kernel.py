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

from .tile_math import (block_indices, dropout_keep, finish_rows, head_scores, key_slots, kv_base, load_rows,
                        query_program, row_base, score_tile, softmax_step, stage_blocks, store_rows, visible_key_blocks)


@triton.jit
def _attend_key_blocks(
    acc, m_i, l_i, q, rows, start, end, k_base, v_base, k_st, v_st, table_base, page_size,
    offs_d, offs_dv, sizes, hd, sc, APPLY_BAND: tl.constexpr, F: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Stream key blocks [start, end) through the online softmax of one query block."""
    for j0 in range(start, end, BLOCK_N):
        cols, col_in = block_indices(j0, hd.k_len, BLOCK_N)
        page, slot = key_slots(cols, hd.k_len, table_base, page_size, F.PAGED)
        # K is loaded transposed, (BLOCK_D, BLOCK_N), straight from its strides.
        kt = load_rows(k_base, page * k_st.b + slot * k_st.s, col_in, offs_d, k_st.d, sizes.head_dim, True)
        s, _ = score_tile(tl.dot(q, kt, input_precision=DOT_PRECISION), rows[:, None], cols[None, :], hd, sc,
                          APPLY_BAND, F)
        p, alpha, m_i, l_i = softmax_step(m_i, l_i, s)
        if F.HAS_DROPOUT:
            p = tl.where(dropout_keep(hd.drop_key, rows[:, None], cols[None, :], sc.drop_threshold), p, 0.0)
        v = load_rows(v_base, page * v_st.b + slot * v_st.s, col_in, offs_dv, v_st.d, sizes.head_dim_v, False)
        # P is rounded to V's dtype for the second GEMM, as FlashAttention-2 does (fp32 stays fp32).
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


# Triton turns int arguments equal to 1 into constants; the seed halves are converted to uint32
# inside, which a constant cannot be, and a seed of 1 must not cost a recompile anyway.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def attention_forward_kernel(
    Q, K, V, Out, Lse2, mods, q_st, k_st, v_st, o_st, l_st, seqs, sizes, sc, seed_lo, seed_hi, tune_bucket,
    F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Write ``Out`` and the base-2 ``Lse2`` for one (query block, query head, sequence).

    The argument groups are :mod:`.arguments`' (``mods``: the modifiers' tensors, ``*_st``: each other
    tensor's strides). With ``F.PAGED``, K and V are pools (num_blocks, Hkv, page_size, D) read
    through the block table: ``k_st.b``/``v_st.b`` step from page to page. ``tune_bucket`` is not
    read: it only keys the GPU autotuner's cache by a coarse length bucket.
    """
    batch, head, seq, i0 = query_program(seqs, sizes, sc, F, BLOCK_M)
    if i0 >= seq.q_len:
        return
    kv_head = head // sizes.group
    hd = head_scores(seq, mods, seed_lo, seed_hi, batch, head, F)
    q_base = row_base(Q, q_st, batch, head, seq.q_start)
    k_base = kv_base(K, k_st, batch, kv_head, seq.k_start, F.PAGED)
    v_base = kv_base(V, v_st, batch, kv_head, seq.k_start, F.PAGED)
    table_base = seqs.table + batch.to(tl.int64) * seqs.table_stride

    rows, row_in = block_indices(i0, seq.q_len, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(q_base, rows * q_st.s, row_in, offs_d, q_st.d, sizes.head_dim, False)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    start, mid_lo, mid_hi, end = visible_key_blocks(
        i0, seq.q_len, seq.k_len, seq.offset, sc.left, sc.right, BLOCK_M, BLOCK_N, F.HAS_LEFT, F.HAS_RIGHT)
    # Three stages over the visible blocks: masked head, unmasked interior (no band code), masked tail.
    for stage in tl.static_range(3):
        lo, hi = stage_blocks(stage, start, mid_lo, mid_hi, end)
        acc, m_i, l_i = _attend_key_blocks(acc, m_i, l_i, q, rows, lo, hi, k_base, v_base, k_st, v_st, table_base,
                                           seqs.page_size, offs_d, offs_dv, sizes, hd, sc, stage != 1, F,
                                           BLOCK_N, DOT_PRECISION)

    # Normalise. l == 0 only for rows that saw nothing: they output 0 and lse2 = -inf.
    inv_l, lse2 = finish_rows(m_i, l_i)
    if F.HAS_DROPOUT:
        inv_l = inv_l * sc.drop_scale
    store_rows(row_base(Out, o_st, batch, head, seq.q_start), rows * o_st.s, row_in, offs_dv, o_st.d,
               sizes.head_dim_v, acc * inv_l[:, None])
    tl.store(row_base(Lse2, l_st, batch, head, seq.q_start) + rows * l_st.s, lse2, mask=row_in)
