"""Flash-decoding in Triton: split-K attention for a few query rows over a long KV cache.

The problem
-----------
Decoding attends one new token (a few with speculative decoding) to a cache of thousands of keys. The
FlashAttention-2 grid has one program per (query block, query head, sequence): with one query row
that is ``B * Hq`` programs, each streaming the whole cache alone, and a GPU with a hundred
multiprocessors sits mostly idle while every program re-reads K/V that ``group - 1`` others read too.

The split
---------
:func:`attention_decode_kernel` has one program per (key chunk, kv head, sequence). It stacks the
``seqlen_q * group`` query rows that share the kv head (GQA: the rows of all its query heads) into one
BLOCK_M tile, so each K/V tile is loaded once for all of them, and it attends them to one chunk of
keys: the chunks of a sequence run in parallel. Each writes a partial result, its rows' normalised
output and base-2 LSE, in fp32. :func:`attention_decode_merge_kernel`, one program per (kv head,
sequence), combines the chunks in chunk order: ``lse = log2 sum_c 2^lse_c`` and
``out = sum_c 2^(lse_c - lse) out_c`` (chunks that saw nothing have ``lse_c = -inf`` and weigh 0).

Reproducible and batch-invariant
--------------------------------
The chunk length is a function of the sequence's own key count only
(:func:`~.tile_math.decode_chunk_len`), the tile sizes and warps are fixed by the launcher (never
autotuned), and the merge visits chunks in a fixed order: a row's bits do not depend on the other
sequences of the batch, on the grid, or on the run.

Rows, bands and pages
---------------------
Row ``r`` of a tile is query ``r // group`` of query head ``kv_head * group + r % group``. Causality,
windows (:func:`~.tile_math.score_tile`, per row) and ALiBi (a slope per row) apply as in the
prefill kernel; key tiles outside the band of every row are never loaded, so a sliding window reads
only its window. ``PAGED`` pools are read through the block table (:func:`~.tile_math.key_slots`),
``seqused_k`` and varlen queries through :func:`~.tile_math.key_bounds` / ``sequence_bounds``.
"""

import triton
import triton.language as tl

from .tile_math import (decode_chunk_len, diagonal_offset, key_bounds, key_slots, score_tile, sequence_bounds,
                        visible_key_blocks)


@triton.jit
def attention_decode_kernel(
    Q, K, V, OutPart, LsePart, Slopes, CuSeqQ, CuSeqK, SeqUsedK, BlockTable,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_pb, stride_ph, stride_pc, stride_pr,
    stride_ab, stride_ah, stride_btb,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, page_size,
    sm_scale, softcap, window_left, window_right, align_shift,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr,
    MIN_CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Partial output (normalised, fp32) and base-2 LSE of one (key chunk, kv head, sequence).

    ``OutPart`` (B, Hkv, splits, BLOCK_M, BLOCK_DV) and ``LsePart`` (B, Hkv, splits, BLOCK_M) are
    contiguous scratch; ``stride_p*`` are LsePart's strides (OutPart's are BLOCK_DV times them).
    Chunks past the sequence's last key write nothing: the merge never reads them.
    """
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, q_len = sequence_bounds(CuSeqQ, batch, seqlen_q, IS_VARLEN)
    k_start, k_len = key_bounds(CuSeqK, SeqUsedK, batch, seqlen_k, IS_VARLEN, HAS_SEQUSED, PAGED)
    chunk_len = decode_chunk_len(k_len, MIN_CHUNK, MAX_SPLITS, BLOCK_N)
    j_lo = chunk * chunk_len
    if j_lo >= k_len:
        return
    offset = diagonal_offset(q_len, k_len, align_shift, BOTTOM_RIGHT)
    batch64 = batch.to(tl.int64)

    r = tl.arange(0, BLOCK_M)
    qi = r // group
    head = kv_head * group + r % group
    row_in = qi < q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = batch64 * stride_qb + head.to(tl.int64) * stride_qh + (q_start + qi).to(tl.int64) * stride_qs
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :] * stride_qd,
                mask=row_in[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch * stride_ab + head * stride_ah, mask=row_in, other=0.0)[:, None]

    k_base = K + kv_head.to(tl.int64) * stride_kh
    v_base = V + kv_head.to(tl.int64) * stride_vh
    if not PAGED:
        k_base += batch64 * stride_kb + k_start.to(tl.int64) * stride_ks
        v_base += batch64 * stride_vb + k_start.to(tl.int64) * stride_vs
    table_base = BlockTable + batch64 * stride_btb

    # The keys some row of the tile may see, cut to this chunk (tiles never straddle two chunks:
    # chunk_len is a multiple of BLOCK_N).
    # (The query rows of the tile are [0, q_len), within [0, BLOCK_M): the range asked for covers them.)
    blocks = visible_key_blocks(0, q_len, k_len, offset, window_left, window_right,
                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    lo = tl.maximum(blocks[0], j_lo)
    hi = tl.minimum(blocks[3], j_lo + chunk_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j0 = tl.multiple_of(j0, BLOCK_N)
        cols = j0 + tl.arange(0, BLOCK_N)
        page, slot = key_slots(cols, k_len, table_base, page_size, PAGED)
        kt = tl.load(k_base + (page * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None] * stride_kd,
                     mask=(cols[None, :] < k_len) & (offs_d[:, None] < head_dim), other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        s = score_tile(
            qk, qi[:, None], cols[None, :], offset, q_len, k_len,
            sm_scale, softcap, slope, Q, 0, 0, Q, 0, 0, window_left, window_right,
            True, HAS_LEFT, HAS_RIGHT, False, False, HAS_ALIBI, HAS_SOFTCAP,
        )[0]
        # Online softmax in base 2 (score_tile folded log2(e) into the logits). A row that has seen
        # no visible key yet keeps m = -inf: subtracting 0 instead keeps -inf - -inf = NaN away.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_dv[None, :] * stride_vd,
                    mask=(cols[:, None] < k_len) & (offs_dv[None, :] < head_dim_v), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Normalised partials (not raw sums): each chunk's output is a convex combination of V rows, so
    # the fp32 scratch never overflows, and the merge only needs each chunk's LSE to reweigh it.
    saw_keys = l_i > 0
    l_safe = tl.where(saw_keys, l_i, 1.0)
    out = acc * tl.where(saw_keys, 1.0 / l_safe, 0.0)[:, None]
    lse2 = tl.where(saw_keys, m_i + tl.log2(l_safe), float("-inf"))
    part = batch64 * stride_pb + kv_head.to(tl.int64) * stride_ph + chunk.to(tl.int64) * stride_pc
    tl.store(LsePart + part + r * stride_pr, lse2)
    tl.store(OutPart + part * BLOCK_DV + r[:, None] * (stride_pr * BLOCK_DV) + offs_dv[None, :], out)


@triton.jit
def attention_decode_merge_kernel(
    OutPart, LsePart, Out, Lse2, CuSeqQ, CuSeqK, SeqUsedK,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_pb, stride_ph, stride_pc, stride_pr,
    seqlen_q, seqlen_k, group, head_dim_v,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr,
    MIN_CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``Out`` and base-2 ``Lse2`` of the rows of one (kv head, sequence) from its chunks, in order."""
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    q_start, q_len = sequence_bounds(CuSeqQ, batch, seqlen_q, IS_VARLEN)
    _, k_len = key_bounds(CuSeqK, SeqUsedK, batch, seqlen_k, IS_VARLEN, HAS_SEQUSED, PAGED)
    chunks = tl.cdiv(k_len, decode_chunk_len(k_len, MIN_CHUNK, MAX_SPLITS, BLOCK_N))
    batch64 = batch.to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    qi = r // group
    head = kv_head * group + r % group
    row_in = qi < q_len
    offs_dv = tl.arange(0, BLOCK_DV)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    base = batch64 * stride_pb + kv_head.to(tl.int64) * stride_ph
    # The same stable sum one level up: a running max of the chunks' LSEs, earlier partials rescaled.
    # Chunk order is fixed, so the bits are too.
    for c in range(0, chunks):
        part = base + c * stride_pc
        lse_c = tl.load(LsePart + part + r * stride_pr)
        out_c = tl.load(OutPart + part * BLOCK_DV + r[:, None] * (stride_pr * BLOCK_DV) + offs_dv[None, :])
        m_new = tl.maximum(m, lse_c)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_c - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * out_c
        total = total * alpha + w
        m = m_new

    saw_keys = total > 0
    t_safe = tl.where(saw_keys, total, 1.0)
    out = acc * tl.where(saw_keys, 1.0 / t_safe, 0.0)[:, None]
    lse2 = tl.where(saw_keys, m + tl.log2(t_safe), float("-inf"))
    rows64 = (q_start + qi).to(tl.int64)
    o_rows = batch64 * stride_ob + head.to(tl.int64) * stride_oh + rows64 * stride_os
    tl.store(Out + o_rows[:, None] + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v))
    tl.store(Lse2 + batch64 * stride_lb + head.to(tl.int64) * stride_lh + rows64 * stride_ls, lse2, mask=row_in)
