"""Device helpers shared by the kernels: the prologue every kernel opens with, and one score
pipeline, written once. The kernels' arguments come in the groups of :mod:`.arguments`.

The prologue
------------
Every kernel finds its sequence (:func:`sequence`: packed offsets, keys in use, the diagonal) and,
per query head, what the score pipeline reads (:func:`head_scores`), and addresses its rows through
:func:`head_base` / :func:`kv_base` in 64-bit offsets.

The score pipeline
------------------
The forward and backward passes must turn ``q . k^T`` into the *same* base-2 logits, or the backward
differentiates a different function than the forward computed. So the whole pipeline of
:mod:`tileattn.core.modifiers`

    s = scale * q.k^T -> softcap -> + ALiBi + bias -> band (causal/window) and bool mask

lives in :func:`score_tile`, and every kernel calls it. Its ``rows``/``cols`` arguments are index
tensors that broadcast against the tile, so the same code serves a ``(rows, cols)`` tile (forward,
dQ pass) and a transposed ``(cols, rows)`` tile (dK/dV pass): every formula below is elementwise.

Everything here is ``@triton.jit`` and inlined into the kernels by the compiler.
"""

import triton
import triton.language as tl

from .arguments import ScoreHead, Sequence


# log2(e): the kernels work in base 2 (exp2 is one hardware instruction, exp is exp2 plus a multiply).
LOG2E = tl.constexpr(1.4426950408889634)

# The counter-based dropout hash of tileattn/core/score_math.py (dropout_keep), in uint32 arithmetic.
# The multipliers are below 2**31, which is what lets the torch reference emulate these exact
# products in int64.
MUL_A = tl.constexpr(0x7FEB352D)
MUL_B = tl.constexpr(0x5BD1E995)
GOLDEN = tl.constexpr(0x1E3779B9)


@triton.jit
def mix32(x):
    """The 32-bit finaliser of score_math._mix32 (x is uint32; products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * MUL_A
    x = x ^ (x >> 15)
    x = x * MUL_B
    return x ^ (x >> 16)


@triton.jit
def dropout_head_key(seed_lo, seed_hi, batch, head):
    """The per (seed, batch, head) key of score_math.dropout_row_keys, before the row is mixed in."""
    k = mix32(seed_lo.to(tl.uint32) ^ GOLDEN)
    k = mix32(k ^ seed_hi.to(tl.uint32))
    k = mix32(k ^ batch.to(tl.uint32))
    return mix32(k ^ head.to(tl.uint32))


@triton.jit
def dropout_keep(head_key, rows, cols, threshold):
    """True where the probability at (row, col) survives dropout; same bits as score_math.dropout_keep."""
    row_key = mix32(head_key ^ rows.to(tl.uint32))
    x = mix32(row_key ^ (cols.to(tl.uint32) * GOLDEN))
    return (x >> 8) >= threshold


@triton.jit
def tanh(x):
    """tanh in fp32 without libdevice (which the interpreter lacks), accurate to a few ulp.

    Near zero, ``(1 - e^-2|x|) / (1 + e^-2|x|)`` loses digits to cancellation, so |x| < 0.4 uses the
    odd Taylor series, whose first omitted term is below 3e-10 relative there.
    """
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * LOG2E))
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    poly = -929569.0 / 638512875.0
    poly = poly * x2 + 21844.0 / 6081075.0
    poly = poly * x2 - 1382.0 / 155925.0
    poly = poly * x2 + 62.0 / 2835.0
    poly = poly * x2 - 17.0 / 315.0
    poly = poly * x2 + 2.0 / 15.0
    poly = poly * x2 - 1.0 / 3.0
    near = ax + ax * x2 * poly
    t = tl.where(ax < 0.4, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def band_keep(rows, cols, offset, q_len, k_len, window_left, window_right,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Inside the sequence and inside the bottom-right aligned band: j - i - (Sk - Sq) in [-left, right]."""
    keep = (rows < q_len) & (cols < k_len)
    rel = cols - rows - offset
    if HAS_LEFT:
        keep = keep & (rel >= -window_left)
    if HAS_RIGHT:
        keep = keep & (rel <= window_right)
    return keep


@triton.jit
def score_tile(qk, rows, cols, hd, sc, APPLY_BAND: tl.constexpr, F: tl.constexpr):
    """Base-2 logits of a tile (-inf where hidden) and, for the backward, the derivative of the
    transformed scores with respect to ``scale * q.k`` (1 unless a transform changes it: a softcap's
    ``1 - tanh^2``), which ``dS`` is multiplied by on its way back to ``q.k``. ``hd``: the tile's
    :class:`ScoreHead`; ``sc``: the call's :class:`Scalars`.

    ``APPLY_BAND`` is False for tiles the launcher's block ranges proved fully visible: the interior
    of a causal or windowed problem pays for no masking at all.
    """
    PLAIN: tl.constexpr = not (F.HAS_SOFTCAP or F.HAS_ALIBI_SLOPES or F.HAS_BIAS)
    grad = 1.0
    if PLAIN:
        # One multiply: the softmax scale and the change to base 2 folded together.
        s = qk * (sc.scale * LOG2E)
    else:
        s = qk * sc.scale
        if F.HAS_SOFTCAP:
            t = tanh(s / sc.softcap)
            s = sc.softcap * t
            grad = 1.0 - t * t
        if F.HAS_ALIBI_SLOPES:
            s = s - hd.slope * tl.abs(rows + hd.offset - cols).to(tl.float32)
        if F.HAS_BIAS:
            inside = (rows < hd.q_len) & (cols < hd.k_len)
            b = tl.load(hd.bias + rows * hd.bias_st.s + cols * hd.bias_st.d, mask=inside, other=0.0)
            s = s + b.to(tl.float32)
        s = s * LOG2E
    if APPLY_BAND:
        s = tl.where(band_keep(rows, cols, hd.offset, hd.q_len, hd.k_len, sc.left, sc.right,
                               F.HAS_LEFT, F.HAS_RIGHT), s, float("-inf"))
    if F.HAS_MASK:
        inside = (rows < hd.q_len) & (cols < hd.k_len)
        m = tl.load(hd.mask + rows * hd.mask_st.s + cols * hd.mask_st.d, mask=inside, other=0)
        s = tl.where(m != 0, s, float("-inf"))
    return s, grad


@triton.jit
def visible_key_blocks(i0, q_len, k_len, offset, window_left, window_right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key-block ranges for query rows [i0, i0 + BLOCK_M): ``(start, mid_lo, mid_hi, end)``.

    Blocks in [start, mid_lo) and [mid_hi, end) straddle the band edge or the end of the keys and need
    masking; blocks in [mid_lo, mid_hi) are visible to every row and need none; blocks outside
    [start, end) are hidden from every row and are never loaded. All bounds are multiples of BLOCK_N
    counted from ``start`` (itself a multiple of BLOCK_N).
    """
    i_last = tl.minimum(i0 + BLOCK_M, q_len) - 1
    lo = 0
    hi = k_len
    full_lo = 0
    full_hi = k_len
    if HAS_LEFT:
        lo = tl.maximum(i0 + offset - window_left, 0)
        full_lo = tl.maximum(i_last + offset - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(i_last + offset + window_right + 1, k_len)
        full_hi = tl.minimum(i0 + offset + window_right + 1, k_len)
    return _split_blocks(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def visible_query_blocks(j0, q_len, k_len, offset, window_left, window_right,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The transpose of :func:`visible_key_blocks`: query-block ranges for keys [j0, j0 + BLOCK_N).
    Key j is seen by the queries i with ``j - off - right <= i <= j - off + left``: the band of the
    transposed problem, offset negated and sides swapped."""
    return visible_key_blocks(j0, k_len, q_len, -offset, window_right, window_left, BLOCK_N, BLOCK_M,
                              HAS_RIGHT, HAS_LEFT)


@triton.jit
def _split_blocks(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Cut [lo, hi) into masked head, unmasked middle and masked tail on a BLOCK grid."""
    start = (lo // BLOCK) * BLOCK
    span = tl.maximum(hi - start, 0)
    end = start + tl.cdiv(span, BLOCK) * BLOCK
    mid_lo = start + tl.cdiv(tl.maximum(full_lo - start, 0), BLOCK) * BLOCK
    mid_hi = start + (tl.maximum(full_hi - start, 0) // BLOCK) * BLOCK
    mid_lo = tl.minimum(mid_lo, end)
    mid_hi = tl.maximum(tl.minimum(mid_hi, end), mid_lo)
    return start, mid_lo, mid_hi, end


@triton.jit
def diagonal_offset(q_len, k_len, align_shift, BOTTOM_RIGHT: tl.constexpr):
    """Query row i is aligned with key column i + offset (tileattn.core.score_math.diagonal_offset):
    ``k_len - q_len`` bottom-right (FlashAttention-2), 0 top-left (SDPA), plus a fixed shift."""
    if BOTTOM_RIGHT:
        return align_shift + k_len - q_len
    return align_shift + q_len * 0


@triton.jit
def key_bounds(cu_seqlens_k, seqused_k, batch, seqlen_k, IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
               PAGED: tl.constexpr):
    """(first key row, key count) of sequence ``batch``: packed rows from cu_seqlens_k (not for a paged
    cache, whose rows come from the block table), the count from seqused_k when given."""
    start = tl.full([], 0, tl.int32)
    length = start + seqlen_k
    if IS_VARLEN:
        if not PAGED:
            start = tl.load(cu_seqlens_k + batch)
            length = tl.load(cu_seqlens_k + batch + 1) - start
    if HAS_SEQUSED:
        length = tl.load(seqused_k + batch)
    return start, length


@triton.jit
def key_slots(cols, k_len, table_base, page_size, PAGED: tl.constexpr):
    """(page, row in page) of key columns ``cols``: a key's address is ``page * stride_page + row *
    stride_row`` (plus the head's). Without a paged cache the page is 0 and the row is the column; with
    one, the page comes from the sequence's block table (``table_base``); columns past ``k_len`` read
    page 0 and are masked by the callers."""
    page = 0
    slot = cols
    if PAGED:  # a constexpr branch: the compiler lets it change the variables' types
        page = tl.load(table_base + cols // page_size, mask=cols < k_len, other=0).to(tl.int64)
        slot = cols % page_size
    return page, slot


@triton.jit
def decode_chunk_len(k_len, MIN_CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of the flash-decoding kernel for a sequence of ``k_len`` keys: at most
    MAX_SPLITS splits of at least MIN_CHUNK keys, rounded up to whole BLOCK_N tiles. A function of the
    sequence's own key count only, so a row's bits do not depend on the rest of the batch
    (the launcher's host copy is :func:`tileattn.backends.triton.launch.decode_chunks`)."""
    splits = tl.maximum(tl.minimum(tl.cdiv(k_len, MIN_CHUNK), MAX_SPLITS), 1)
    # At least one tile, so that an empty sequence has zero chunks rather than a zero divisor.
    return tl.maximum(tl.cdiv(tl.cdiv(k_len, splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def sequence_bounds(cu_seqlens, batch, seqlen, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence ``batch``: from cu_seqlens when packed, else (0, seqlen)."""
    # A tensor even when padded: the callers widen it to int64 for their base offsets.
    start = tl.full([], 0, tl.int32)
    length = start + seqlen
    if IS_VARLEN:
        start = tl.load(cu_seqlens + batch)
        length = tl.load(cu_seqlens + batch + 1) - start
    return start, length


# ------------------------------------------------------------------------ the kernels' prologue


@triton.jit
def sequence(seqs, sizes, sc, batch, F: tl.constexpr):
    """The :class:`Sequence` of sequence ``batch``."""
    q_start, q_len = sequence_bounds(seqs.cu_q, batch, sizes.seqlen_q, F.IS_VARLEN)
    k_start, k_len = key_bounds(seqs.cu_k, seqs.used_k, batch, sizes.seqlen_k, F.IS_VARLEN, F.HAS_SEQUSED, F.PAGED)
    return Sequence(q_start, q_len, k_start, k_len, diagonal_offset(q_len, k_len, sc.shift, F.BOTTOM_RIGHT))


@triton.jit
def head_base(ptr, st, batch, head):
    """``ptr`` at (batch, head) of a tensor with strides ``st``, in 64-bit offsets (B * H * S * D
    overflows int32 on large problems)."""
    return ptr + batch.to(tl.int64) * st.b + head.to(tl.int64) * st.h


@triton.jit
def row_base(ptr, st, batch, head, row):
    """``ptr`` at (batch, head, row) (:func:`head_base`)."""
    return head_base(ptr, st, batch, head) + row.to(tl.int64) * st.s


@triton.jit
def kv_base(ptr, st, batch, kv_head, k_start, PAGED: tl.constexpr):
    """K or V at the sequence's first key of ``kv_head``; a pool's pages are addressed per key
    (:func:`key_slots`), so for a paged cache only the head."""
    base = ptr + kv_head.to(tl.int64) * st.h
    if not PAGED:
        base += batch.to(tl.int64) * st.b + k_start.to(tl.int64) * st.s
    return base


@triton.jit
def head_scores(seq, mods, seed_lo, seed_hi, batch, head, F: tl.constexpr):
    """The :class:`ScoreHead` of query head ``head`` of sequence ``seq``, from the call's
    :class:`ModifierTensors` ``mods``. ``head`` may be a column of heads, one per row of a tile (the
    decode kernel's), with no mask, bias or dropout: then the slope is a column too."""
    st = mods.st
    slope = 0.0
    if F.HAS_ALIBI_SLOPES:
        slope = tl.load(mods.alibi_slopes + batch * st.alibi_slopes.b + head * st.alibi_slopes.h)
    drop_key = 0
    if F.HAS_DROPOUT:
        drop_key = dropout_head_key(seed_lo, seed_hi, batch, head)
    return ScoreHead(seq.offset, seq.q_len, seq.k_len, slope, head_base(mods.mask, st.mask, batch, head),
                     head_base(mods.bias, st.bias, batch, head), st.mask, st.bias, drop_key)


@triton.jit
def block_indices(start, length, BLOCK: tl.constexpr):
    """The indices of the block at ``start`` (a multiple of BLOCK) and which of them are below ``length``."""
    idx = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
    return idx, idx < length


@triton.jit
def query_program(seqs, sizes, sc, F: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program of a (query blocks, query heads, sequences) grid: ``(batch, head, its sequence, the
    block's first row)``."""
    batch = tl.program_id(2)
    return batch, tl.program_id(1), sequence(seqs, sizes, sc, batch, F), tl.program_id(0) * BLOCK_M


@triton.jit
def stage_blocks(stage: tl.constexpr, start, mid_lo, mid_hi, end):
    """The blocks of one stage of a sweep over the visible blocks: 0 the masked head, 1 the unmasked
    interior (no band code), 2 the masked tail."""
    lo, hi = start, mid_lo
    if stage == 1:
        lo, hi = mid_lo, mid_hi
    if stage == 2:
        lo, hi = mid_hi, end
    return lo, hi


@triton.jit
def load_rows(base, offsets, valid, cols, col_stride, width, TRANSPOSED: tl.constexpr):
    """The rows at ``offsets`` from ``base`` (those ``valid``), columns ``cols`` below ``width`` (the
    padding of a head dim loads 0): a (rows, cols) tile, or its transpose."""
    if TRANSPOSED:  # a constexpr branch: one return, whose shape the branch decides
        at = base + offsets[None, :] + cols[:, None] * col_stride
        inside = valid[None, :] & (cols[:, None] < width)
    else:
        at = base + offsets[:, None] + cols[None, :] * col_stride
        inside = valid[:, None] & (cols[None, :] < width)
    return tl.load(at, mask=inside, other=0.0)


@triton.jit
def store_rows(base, offsets, valid, cols, col_stride, width, value):
    """Store a (rows, cols) tile in the element type of ``base``, as :func:`load_rows` reads it."""
    tl.store(base + offsets[:, None] + cols[None, :] * col_stride, value.to(base.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < width))


# ------------------------------------------------------------------------ the online softmax


@triton.jit
def softmax_step(m_i, l_i, s):
    """One tile of the online softmax in base 2 (``s``: base-2 logits): ``(p, alpha, m, l)``, the
    tile's weights, the factor that rescales the rows' earlier state, the new maxima and sums. A row
    that has seen no visible key keeps m = -inf: subtracting 0 instead keeps -inf - -inf = NaN away."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def finish_rows(m_i, l_i):
    """``(1 / l, lse2)`` of rows with maxima ``m_i`` and sums ``l_i``: rows that saw no key (l == 0)
    get 0 (their output is 0) and lse2 = -inf."""
    saw_keys = l_i > 0
    l_safe = tl.where(saw_keys, l_i, 1.0)
    return tl.where(saw_keys, 1.0 / l_safe, 0.0), tl.where(saw_keys, m_i + tl.log2(l_safe), float("-inf"))
