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
regenerated keep mask over ``1 - p``; a transform's derivative (a softcap's ``1 - tanh^2``, which
:func:`~.tile_math.score_tile` gives with the scores) multiplies ``dS`` on its way back to ``q.k^T``;
the gradient of an additive bias is ``dS`` itself.

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

from .tile_math import (block_indices, dropout_keep, head_base, head_scores, kv_base, load_rows, query_program,
                        row_base, score_tile, sequence, stage_blocks, store_rows, visible_key_blocks,
                        visible_query_blocks)


@triton.jit
def _dkdv_query_blocks(
    dk, dv, k, v, cols, start, end, q_base, do_base, lse_base, delta_base, q_st, g_st, l_st,
    offs_d, offs_dv, sizes, hd, sc, APPLY_BAND: tl.constexpr, F: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one key block's dK/dV over query blocks [start, end) of one query head."""
    for i0 in range(start, end, BLOCK_M):
        rows, row_in = block_indices(i0, hd.q_len, BLOCK_M)
        # Q and dO are loaded transposed, (D, BLOCK_M), for the transposed score tile.
        qt = load_rows(q_base, rows * q_st.s, row_in, offs_d, q_st.d, sizes.head_dim, True)
        do = load_rows(do_base, rows * g_st.s, row_in, offs_dv, g_st.d, sizes.head_dim_v, False)
        # +inf for rows past the end (and, via the launcher, for rows that saw no key): P = 0 there.
        lse2 = tl.load(lse_base + rows * l_st.s, mask=row_in, other=float("inf"))
        delta = tl.load(delta_base + rows * l_st.s, mask=row_in, other=0.0)

        qk_t = tl.dot(k, qt, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        s_t, grad_t = score_tile(qk_t, rows[None, :], cols[:, None], hd, sc, APPLY_BAND, F)
        p_t = tl.exp2(s_t - lse2[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if F.HAS_DROPOUT:
            keep_t = dropout_keep(hd.drop_key, rows[None, :], cols[:, None], sc.drop_threshold)
            p_used = tl.where(keep_t, p_t * sc.drop_scale, 0.0)
            dp_t = tl.where(keep_t, dp_t * sc.drop_scale, 0.0)
        else:
            p_used = p_t
        dv += tl.dot(p_used.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :]) * grad_t
        dk += tl.dot(ds_t.to(qt.dtype), tl.trans(qt), input_precision=DOT_PRECISION)
    return dk, dv


# Triton turns int arguments equal to 1 into constants; the seed halves are converted to uint32
# inside, which a constant cannot be, and a seed of 1 must not cost a recompile anyway.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def attention_backward_dkdv_kernel(
    Q, K, V, DOut, Lse2, Delta, DK, DV, mods, q_st, k_st, v_st, g_st, l_st, dk_st, dv_st, seqs, sizes, sc,
    seed_lo, seed_hi, tune_bucket, F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK and dV of one (key block, kv head, sequence), summed over the kv head's query heads.
    ``g_st``: dO's strides; ``l_st``: the LSE's, which Delta shares."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    seq = sequence(seqs, sizes, sc, batch, F)
    j0 = block * BLOCK_N
    if j0 >= seq.k_len:
        return

    cols, col_in = block_indices(j0, seq.k_len, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_rows(kv_base(K, k_st, batch, kv_head, seq.k_start, False), cols * k_st.s, col_in, offs_d, k_st.d,
                  sizes.head_dim, False)
    v = load_rows(kv_base(V, v_st, batch, kv_head, seq.k_start, False), cols * v_st.s, col_in, offs_dv, v_st.d,
                  sizes.head_dim_v, False)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    start, mid_lo, mid_hi, end = visible_query_blocks(
        j0, seq.q_len, seq.k_len, seq.offset, sc.left, sc.right, BLOCK_M, BLOCK_N, F.HAS_LEFT, F.HAS_RIGHT)

    # The query heads of this kv head, in a fixed order (part of what makes the sum reproducible).
    for g in range(0, sizes.group):
        head = kv_head * sizes.group + g
        hd = head_scores(seq, mods, seed_lo, seed_hi, batch, head, F)
        q_base = row_base(Q, q_st, batch, head, seq.q_start)
        do_base = row_base(DOut, g_st, batch, head, seq.q_start)
        lse_base = row_base(Lse2, l_st, batch, head, seq.q_start)
        delta_base = row_base(Delta, l_st, batch, head, seq.q_start)
        # Three stages over the visible blocks: masked head, unmasked interior (no band code), masked tail.
        for stage in tl.static_range(3):
            lo, hi = stage_blocks(stage, start, mid_lo, mid_hi, end)
            dk, dv = _dkdv_query_blocks(dk, dv, k, v, cols, lo, hi, q_base, do_base, lse_base, delta_base, q_st, g_st,
                                        l_st, offs_d, offs_dv, sizes, hd, sc, stage != 1, F, BLOCK_M,
                                        DOT_PRECISION)

    store_rows(row_base(DK, dk_st, batch, kv_head, seq.k_start), cols * dk_st.s, col_in, offs_d, dk_st.d,
               sizes.head_dim, dk * sc.scale)
    store_rows(row_base(DV, dv_st, batch, kv_head, seq.k_start), cols * dv_st.s, col_in, offs_dv, dv_st.d,
               sizes.head_dim_v, dv)


@triton.jit
def _dq_key_blocks(
    dq, q, do, lse2, delta, rows, start, end, k_base, v_base, k_st, v_st, dbias_base, db_st,
    offs_d, offs_dv, sizes, hd, sc, APPLY_BAND: tl.constexpr, F: tl.constexpr, WRITE_DBIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query block's dQ over key blocks [start, end)."""
    for j0 in range(start, end, BLOCK_N):
        cols, col_in = block_indices(j0, hd.k_len, BLOCK_N)
        kt = load_rows(k_base, cols * k_st.s, col_in, offs_d, k_st.d, sizes.head_dim, True)
        vt = load_rows(v_base, cols * v_st.s, col_in, offs_dv, v_st.d, sizes.head_dim_v, True)
        s, grad = score_tile(tl.dot(q, kt, input_precision=DOT_PRECISION), rows[:, None], cols[None, :], hd, sc,
                             APPLY_BAND, F)
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        if F.HAS_DROPOUT:
            keep = dropout_keep(hd.drop_key, rows[:, None], cols[None, :], sc.drop_threshold)
            dp = tl.where(keep, dp * sc.drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if WRITE_DBIAS:
            # Every (row, col) of the band is visited by exactly one program: a plain store suffices.
            tl.store(dbias_base + rows[:, None] * db_st.s + cols[None, :], ds,
                     mask=(rows[:, None] < hd.q_len) & col_in[None, :])
        ds = ds * grad
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
    return dq


# Triton turns int arguments equal to 1 into constants; the seed halves are converted to uint32
# inside, which a constant cannot be, and a seed of 1 must not cost a recompile anyway.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def attention_backward_dq_kernel(
    Q, K, V, DOut, Lse2, Delta, DQ, DBias, mods, q_st, k_st, v_st, g_st, l_st, dq_st, db_st, seqs, sizes, sc,
    seed_lo, seed_hi, tune_bucket, F: tl.constexpr, WRITE_DBIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ of one (query block, query head, sequence); with WRITE_DBIAS also its dS rows (dense fp32)."""
    batch, head, seq, i0 = query_program(seqs, sizes, sc, F, BLOCK_M)
    if i0 >= seq.q_len:
        return
    kv_head = head // sizes.group
    hd = head_scores(seq, mods, seed_lo, seed_hi, batch, head, F)

    rows, row_in = block_indices(i0, seq.q_len, BLOCK_M)
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(row_base(Q, q_st, batch, head, seq.q_start), rows64 * q_st.s, row_in, offs_d, q_st.d,
                  sizes.head_dim, False)
    do = load_rows(row_base(DOut, g_st, batch, head, seq.q_start), rows64 * g_st.s, row_in, offs_dv, g_st.d,
                   sizes.head_dim_v, False)
    lse2 = tl.load(row_base(Lse2, l_st, batch, head, seq.q_start) + rows64 * l_st.s, mask=row_in,
                   other=float("inf"))
    delta = tl.load(row_base(Delta, l_st, batch, head, seq.q_start) + rows64 * l_st.s, mask=row_in, other=0.0)

    k_base = kv_base(K, k_st, batch, kv_head, seq.k_start, False)
    v_base = kv_base(V, v_st, batch, kv_head, seq.k_start, False)
    dbias_base = head_base(DBias, db_st, batch, head)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    start, mid_lo, mid_hi, end = visible_key_blocks(
        i0, seq.q_len, seq.k_len, seq.offset, sc.left, sc.right, BLOCK_M, BLOCK_N, F.HAS_LEFT, F.HAS_RIGHT)
    # Three stages over the visible blocks: masked head, unmasked interior (no band code), masked tail.
    for stage in tl.static_range(3):
        lo, hi = stage_blocks(stage, start, mid_lo, mid_hi, end)
        dq = _dq_key_blocks(dq, q, do, lse2, delta, rows, lo, hi, k_base, v_base, k_st, v_st, dbias_base, db_st,
                            offs_d, offs_dv, sizes, hd, sc, stage != 1, F, WRITE_DBIAS, BLOCK_N, DOT_PRECISION)

    store_rows(row_base(DQ, dq_st, batch, head, seq.q_start), rows64 * dq_st.s, row_in, offs_d, dq_st.d,
               sizes.head_dim, dq * sc.scale)
