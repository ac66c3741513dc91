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

from .tile_math import (block_indices, decode_chunk_len, finish_rows, head_scores, key_slots, kv_base, load_rows,
                        row_base, score_tile, sequence, softmax_step, visible_key_blocks)


@triton.jit
def _rows(kv_head, group, q_len, BLOCK_M: tl.constexpr):
    """The rows of a tile, ``(r, query, query head, in range)``: row ``r`` is query ``r // group`` of
    query head ``kv_head * group + r % group``."""
    r = tl.arange(0, BLOCK_M)
    qi = r // group
    return r, qi, kv_head * group + r % group, qi < q_len


@triton.jit
def attention_decode_kernel(
    Q, K, V, OutPart, LsePart, mods, q_st, k_st, v_st, p_st, seqs, sizes, sc, F: tl.constexpr,
    MIN_CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Partial output (normalised, fp32) and base-2 LSE of one (key chunk, kv head, sequence).

    ``OutPart`` (B, Hkv, splits, BLOCK_M, BLOCK_DV) and ``LsePart`` (B, Hkv, splits, BLOCK_M) are
    contiguous scratch; ``p_st`` are LsePart's strides (sequence, kv head, chunk, row; OutPart's are
    BLOCK_DV times them). Chunks past the sequence's last key write nothing: the merge never reads
    them. ``F`` has no mask, bias or dropout (those calls take the prefill kernel).
    """
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    seq = sequence(seqs, sizes, sc, batch, F)
    chunk_len = decode_chunk_len(seq.k_len, MIN_CHUNK, MAX_SPLITS, BLOCK_N)
    j_lo = chunk * chunk_len
    if j_lo >= seq.k_len:
        return

    r, qi, head, row_in = _rows(kv_head, sizes.group, seq.q_len, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(row_base(Q, q_st, batch, head, seq.q_start + qi)[:, None] + offs_d[None, :] * q_st.d,
                mask=row_in[:, None] & (offs_d[None, :] < sizes.head_dim), other=0.0)
    # The rows' heads as a column: what the head's modifiers give is a column too (no mask, bias or
    # dropout here). Every row's head is a head of the call, so its loads need no mask.
    hd = head_scores(seq, mods, 0, 0, batch, head[:, None], F)
    k_base = kv_base(K, k_st, batch, kv_head, seq.k_start, F.PAGED)
    v_base = kv_base(V, v_st, batch, kv_head, seq.k_start, F.PAGED)
    table_base = seqs.table + batch.to(tl.int64) * seqs.table_stride

    # The keys some row of the tile may see, cut to this chunk (tiles never straddle two chunks:
    # chunk_len is a multiple of BLOCK_N).
    # (The query rows of the tile are [0, q_len), within [0, BLOCK_M): the range asked for covers them.)
    blocks = visible_key_blocks(0, seq.q_len, seq.k_len, seq.offset, sc.left, sc.right,
                                BLOCK_M, BLOCK_N, F.HAS_LEFT, F.HAS_RIGHT)
    lo = tl.maximum(blocks[0], j_lo)
    hi = tl.minimum(blocks[3], j_lo + chunk_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        cols, col_in = block_indices(j0, seq.k_len, BLOCK_N)
        page, slot = key_slots(cols, seq.k_len, table_base, seqs.page_size, F.PAGED)
        kt = load_rows(k_base, page * k_st.b + slot * k_st.s, col_in, offs_d, k_st.d, sizes.head_dim, True)
        s = score_tile(tl.dot(q, kt, input_precision=DOT_PRECISION), qi[:, None], cols[None, :], hd, sc, True, F)[0]
        # Online softmax in base 2 (score_tile folded log2(e) into the logits).
        p, alpha, m_i, l_i = softmax_step(m_i, l_i, s)
        v = load_rows(v_base, page * v_st.b + slot * v_st.s, col_in, offs_dv, v_st.d, sizes.head_dim_v, False)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    # Normalised partials (not raw sums): each chunk's output is a convex combination of V rows, so
    # the fp32 scratch never overflows, and the merge only needs each chunk's LSE to reweigh it.
    inv_l, lse2 = finish_rows(m_i, l_i)
    part = batch.to(tl.int64) * p_st.b + kv_head.to(tl.int64) * p_st.h + chunk.to(tl.int64) * p_st.s
    tl.store(LsePart + part + r * p_st.d, lse2)
    tl.store(OutPart + part * BLOCK_DV + r[:, None] * (p_st.d * BLOCK_DV) + offs_dv[None, :], acc * inv_l[:, None])


@triton.jit
def attention_decode_merge_kernel(
    OutPart, LsePart, Out, Lse2, o_st, l_st, p_st, seqs, sizes, sc, F: tl.constexpr, MIN_CHUNK: tl.constexpr,
    MAX_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``Out`` and base-2 ``Lse2`` of the rows of one (kv head, sequence) from its chunks, in order."""
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    seq = sequence(seqs, sizes, sc, batch, F)
    chunks = tl.cdiv(seq.k_len, decode_chunk_len(seq.k_len, MIN_CHUNK, MAX_SPLITS, BLOCK_N))
    r, qi, head, row_in = _rows(kv_head, sizes.group, seq.q_len, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    base = batch.to(tl.int64) * p_st.b + kv_head.to(tl.int64) * p_st.h
    # The same stable sum one level up: a running max of the chunks' LSEs, earlier partials rescaled.
    # Chunk order is fixed, so the bits are too.
    for c in range(0, chunks):
        part = base + c * p_st.s
        lse_c = tl.load(LsePart + part + r * p_st.d)
        out_c = tl.load(OutPart + part * BLOCK_DV + r[:, None] * (p_st.d * BLOCK_DV) + offs_dv[None, :])
        m_new = tl.maximum(m, lse_c)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_c - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * out_c
        total = total * alpha + w
        m = m_new

    inv, lse2 = finish_rows(m, total)
    rows = seq.q_start + qi
    tl.store(row_base(Out, o_st, batch, head, rows)[:, None] + offs_dv[None, :] * o_st.d,
             (acc * inv[:, None]).to(Out.dtype.element_ty), mask=row_in[:, None] & (offs_dv[None, :] < sizes.head_dim_v))
    tl.store(row_base(Lse2, l_st, batch, head, rows), lse2, mask=row_in)
