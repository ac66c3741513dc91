"""The functions of ``flash_attn.flash_attn_interface`` (flash-attn 2.x), translated onto tileattn.

Every function validates its arguments under flash-attn's own names, then makes one call to
:func:`tileattn.flash_attention` with ``layout="BSND"`` (or ``"TND"`` for varlen). Packed inputs are
split into views, never copied. Gradients flow through autograd like the original; dropout draws its
seed from torch's default generator, so ``torch.manual_seed`` makes it reproducible.

Errors: flash-attn's checks are ``TORCH_CHECK``s and its arguments go through a ``torch.library``
op schema, both of which raise RuntimeError; Python callers catch ValueError/TypeError. Every
argument error here is both (:class:`FlashAttnArgumentError`, :class:`FlashAttnTypeError`), and so
is what the core raises under a call (a :class:`tileattn.NoBackendError` becomes
``FlashAttnNoBackendError``, also a RuntimeError).

Integer arguments (``window_size`` sides, ``max_seqlen*``, ``num_splits``) accept what flash-attn's
op schema accepts for an int: Python and numpy integers and one-element integer tensors (its own
tests pass ``window_size=torch.randint(0, seqlen, (2,))``). Floats, strings and tensors of several
elements are refused as flash-attn refuses them. Two deliberate differences: flash-attn takes
``True`` as 1 and truncates a one-element float tensor (2.7 -> 2); here both are refused.

``S_dmask`` (``return_attn_probs=True``): the softmax probabilities ``P`` of the scores with every
modifier (scale, softcap, ALiBi, causal/window), one (B, H, Sq, Sk) tensor in q's dtype (varlen:
(B, H, max_seqlen_q, max_seqlen_k), zero outside each sequence); where dropout dropped an entry it
is negated, flash-attn's sign convention. Differences from flash-attn's kernel, whose docstring
calls this output "for testing only": its values are unnormalised (``exp(s - m)`` against the
running maximum of the key block being written), its rows and columns are padded to multiples of
128, and with ``dropout_p == 0`` it returns an empty tensor; here ``P`` is normalised (rows sum to
1 before dropout), unpadded, and returned at any ``dropout_p``. It costs one score matrix in q's
dtype (computed a few query rows of one head at a time), on top of the attention itself.
"""

from __future__ import annotations

import math

import torch

from ...core.api import flash_attention
from ...core.score_math import ScoreBlock
from ...core.spec import build_spec, sequence_views
from . import descale as _descale
from .checks import _as_int, _check_alibi, _check_options, _check_qkv, _check_rank
from .errors import (FlashAttnArgumentError, FlashAttnTypeError, _describe, _fail,  # noqa: F401  (re-exported)
                     core_errors)
from .kvcache import flash_attn_with_kvcache  # noqa: F401  (flash-attn's interface module has it too)


def _draw_seed(dropout_p):
    """The dropout seed, from torch's default generator as flash-attn does (None without dropout)."""
    return int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None


#: Score elements computed at once for ``S_dmask`` (a few query rows of one head): bounds the fp32
#: scores and the int64 dropout hashes to about a MiB per worker whatever the sequence lengths.
_PROBS_CHUNK = 1 << 18


def _attention_probs(q, k, v, lse, kwargs, seed, max_seqlen_q, max_seqlen_k):
    """``S_dmask``: see the module docstring. ``lse`` is the call's own (natural-log) LSE, so the
    probabilities are exactly those the output was made of: ``P = exp(s - lse)``, built chunk by chunk
    from the call's modifiers (a few query rows of one head at a time)."""
    spec = build_spec(q, k, v, seed=seed, **kwargs)
    cdt = spec.acc_dtype()
    probs = torch.zeros(spec.batch, spec.heads_q, max_seqlen_q, max_seqlen_k, dtype=q.dtype, device=q.device)
    with torch.no_grad():
        for seq in spec.sequences:
            qs, ks, _ = sequence_views(spec, seq)
            ls = lse[:, seq.q_start:seq.q_start + seq.q_len] if spec.is_varlen else lse[seq.batch]
            rows_per_chunk = max(1, _PROBS_CHUNK // max(seq.k_len, 1))
            for h in range(spec.heads_q):
                for r0 in range(0, seq.q_len, rows_per_chunk):
                    r1 = min(r0 + rows_per_chunk, seq.q_len)
                    _probs_chunk(spec, cdt, seq, h, qs[h, r0:r1], ks[h // spec.group_size], ls[h, r0:r1], r0,
                                 probs[seq.batch, h, r0:r1, :seq.k_len])
    return probs


def _probs_chunk(spec, cdt, seq, h, q_rows, k, lse, r0, out):
    """Rows ``r0..`` (``q_rows``, with their ``lse``) of head ``h`` of sequence ``seq``: write ``out``."""
    block = ScoreBlock(seq.batch, slice(h, h + 1), r0, r0 + q_rows.shape[0], 0, seq.k_len, seq.offset, cdt,
                       out.device)
    s = torch.matmul(q_rows.to(cdt), k.to(cdt).T).mul_(spec.scale)[None]
    # The call's modifiers through their own (reference) hooks, in pipeline order.
    for m in spec.modifiers:
        s = m.scores(s, block)
    for m in spec.modifiers:
        visible = m.visible(block)
        if visible is not None:
            s = s.masked_fill(~visible, -math.inf)
    # Rows that see no key have LSE -inf: shift them by +inf instead (P = 0, not NaN).
    lse = lse.to(cdt).masked_fill(lse == -math.inf, math.inf)
    p = s.sub_(lse[:, None]).exp_()
    weights = torch.ones_like(p)
    for m in spec.modifiers:
        weights = m.weights(weights, block, spec.heads_q)
    out.copy_(torch.where(weights == 0, p.neg(), p)[0])  # dropped entries negated (flash-attn's convention)


class _PagedForward(torch.autograd.Function):
    """flash-attn's paged varlen call (``block_table``) is forward only, and its own tests build q
    with ``requires_grad=True``: the forward runs whatever q, k, v require; a backward through it
    raises, naming ``block_table``."""

    @staticmethod
    def forward(ctx, fn, run, q, k, v):
        ctx.fn = fn
        out, lse = run(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        _fail(ctx.fn, "block_table", "a paged KV cache in a backward pass",
              "no block_table in a call to differentiate (flash-attn's paged varlen call is forward only): "
              "pass k/v packed as (total_k, nheads_k, headdim) with cu_seqlens_k")


def _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
         deterministic, return_attn_probs, max_seqlens=None, **layout_kwargs):
    window = _check_options(fn, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                            return_attn_probs)
    _check_qkv(fn, q, k, v)
    batch = q.shape[0] if q.dim() == 4 else layout_kwargs["cu_seqlens_q"].numel() - 1
    _check_alibi(fn, alibi_slopes, batch, q.shape[-2], q.device)
    seed = _draw_seed(dropout_p)
    kwargs = dict(scale=softmax_scale, causal=causal, window=window, softcap=float(softcap),
                  alibi_slopes=alibi_slopes, deterministic=deterministic, dropout_p=float(dropout_p),
                  **layout_kwargs)
    if max_seqlens is not None:
        kwargs.update(max_seqlen_q=max_seqlens[0], max_seqlen_k=max_seqlens[1])
    with core_errors(fn):
        if "block_table" in kwargs:
            out, lse = _PagedForward.apply(fn, lambda q, k, v: flash_attention(q, k, v, seed=seed, return_lse=True,
                                                                               **kwargs), q, k, v)
        else:
            out, lse = flash_attention(q, k, v, seed=seed, return_lse=True, **kwargs)
    if not return_attn_probs:
        return out
    sq, sk = max_seqlens if max_seqlens is not None else (q.shape[1], k.shape[1])
    return out, lse, _attention_probs(q, k, v, lse.detach(), kwargs, seed, sq, sk)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    q_descale=None, k_descale=None, v_descale=None):
    """Attention of q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv); H % Hk == 0.

    Causal and ``window_size`` are aligned to the bottom-right corner; -1 = unbounded window side.
    Returns ``out`` (B, Sq, H, Dv), or ``(out, softmax_lse (B, H, Sq) fp32, S_dmask)`` with
    ``return_attn_probs=True``: ``S_dmask`` is the (B, H, Sq, Sk) softmax in q's dtype, normalised,
    with the entries dropout dropped negated (flash-attn's own is unnormalised and padded; see the
    module docstring).

    FlashAttention-3's fp8 inference: q/k/v float8 (e4m3, or e5m2) and/or ``q_descale``,
    ``k_descale``, ``v_descale`` fp32 (batch, nheads_k); the output of fp8 inputs is bf16; forward
    only (:mod:`.descale`).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank("flash_attn_func", name, t, 4, "(batch, seqlen, nheads, headdim)")
    descales = (q_descale, k_descale, v_descale)
    if _descale.wanted(q, k, v, descales):
        fn = "flash_attn_func"
        _descale.refuse_training(fn, dropout_p, return_attn_probs)
        window = _check_options(fn, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, False)
        q, scales = _descale.lower(fn, q, k, v, descales, q.shape[0], k.shape[2], False)
        _check_qkv(fn, q, q.new_empty(()).expand(k.shape), q.new_empty(()).expand(v.shape))  # shapes only
        _check_alibi(fn, alibi_slopes, q.shape[0], q.shape[2], q.device)
        with core_errors(fn):
            return flash_attention(q, k, v, layout="BSND", scale=softmax_scale, causal=causal, window=window,
                                   softcap=float(softcap), alibi_slopes=alibi_slopes, **scales)
    return _run("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, layout="BSND")


def _unpack(fn, name, packed, rank, count, shape):
    _check_rank(fn, name, packed, rank, shape)
    if packed.shape[-3] != count:
        _fail(fn, name, f"shape {tuple(packed.shape)} (dim {rank - 3} has size {packed.shape[-3]})",
              f"{shape} with dim {rank - 3} of size {count}")
    return [packed.select(rank - 3, i) for i in range(count)]


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on qkv (B, S, 3, H, D), read as three views (no copy)."""
    fn = "flash_attn_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, layout="BSND")


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on q (B, Sq, H, D) and kv (B, Sk, 2, Hk, D) (views, no copy)."""
    fn = "flash_attn_kvpacked_func"
    _check_rank(fn, "q", q, 4, "(batch, seqlen, nheads, headdim)")
    k, v = _unpack(fn, "kv", kv, 5, 2, "(batch, seqlen, 2, nheads_k, headdim)")
    return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, layout="BSND")


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    max_seqlens = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        n = _as_int(fn, name, value, "a non-negative int (the longest sequence)")
        if n < 0:
            _fail(fn, name, n, "a non-negative int (the longest sequence)")
        max_seqlens.append(n)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
            _fail(fn, name, _describe(cu), "an int32 tensor of shape (batch + 1,) of cumulative offsets",
                  FlashAttnTypeError)
    if block_table is not None:
        return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, max_seqlens=tuple(max_seqlens), layout="TND",
                    cu_seqlens_q=cu_seqlens_q, **_paged_keys(fn, k, cu_seqlens_q, cu_seqlens_k, block_table))
    return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, max_seqlens=tuple(max_seqlens), layout="TND",
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def _paged_keys(fn, k, cu_seqlens_q, cu_seqlens_k, block_table):
    """flash-attn's paged varlen call: sequence b has ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` keys in the
    pages ``block_table[b]`` of the pool k (num_blocks, page_block_size, nheads_k, headdim). Entries
    past the pages a sequence uses are never read (flash-attn), so they are zeroed in a small copy."""
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != batch + 1:
        _fail(fn, "cu_seqlens_k", f"shape {tuple(cu_seqlens_k.shape)}", f"({batch + 1},), as cu_seqlens_q")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != batch:
        _fail(fn, "block_table", _describe(block_table), f"an int32 tensor (batch={batch}, max_num_blocks_per_seq)",
              FlashAttnTypeError)
    if block_table.device != k.device:
        _fail(fn, "block_table", f"device {block_table.device}", f"q's device {k.device}")
    lengths = cu_seqlens_k.diff()
    page, blocks = k.shape[1], k.shape[0]
    host = lengths.tolist()
    if host and min(host) < 0:
        _fail(fn, "cu_seqlens_k", cu_seqlens_k.tolist(), "non-decreasing cumulative offsets")
    capacity = block_table.shape[1] * page
    if host and max(host) > capacity:
        b = max(range(batch), key=lambda i: host[i])
        _fail(fn, "block_table", f"{block_table.shape[1]} pages of {page} positions per sequence",
              f"pages for the {host[b]} keys of sequence {b} (cu_seqlens_k)")
    in_use = torch.arange(block_table.shape[1], device=k.device)[None, :] < (lengths.long()[:, None] + page - 1) // page
    bad = in_use & ((block_table < 0) | (block_table >= blocks))
    if bool(bad.any()):
        b, slot = (int(i) for i in bad.nonzero()[0])
        _fail(fn, "block_table", f"block_table[{b}][{slot}] = {int(block_table[b, slot])}",
              f"a page index in [0, {blocks}) for each page sequence {b} uses")
    return dict(block_table=torch.where(in_use, block_table, 0), seqused_k=lengths.to(torch.int32))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """Variable-length attention: q (total_q, H, D), k/v (total_k, Hk, D); sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]``. softmax_lse is (H, total_q); ``S_dmask`` (B, H, max_seqlen_q,
    max_seqlen_k). With ``block_table`` (batch, max_num_blocks_per_seq) int32, k/v are paged pools
    (num_blocks, page_block_size, nheads_k, headdim) and sequence ``b`` reads its
    ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` keys from its pages (flash-attn's paged varlen call, forward
    only): decode rows and prefill chunks of one pool in one call, causal at each sequence's end."""
    fn = "flash_attn_varlen_func"
    _check_rank(fn, "q", q, 3, "(total_tokens, nheads, headdim)")
    for name, t in (("k", k), ("v", v)):
        if block_table is None:
            _check_rank(fn, name, t, 3, "(total_tokens, nheads, headdim)")
        else:
            _check_rank(fn, name, t, 4, "(num_blocks, page_block_size, nheads_k, headdim) (block_table is given)")
    return _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                   block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on qkv (total, 3, H, D), one cu_seqlens for q and k."""
    fn = "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 4, 3, "(total_tokens, 3, nheads, headdim)")
    return _varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on q (total_q, H, D) and kv (total_k, 2, Hk, D)."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_rank(fn, "q", q, 3, "(total_tokens, nheads, headdim)")
    k, v = _unpack(fn, "kv", kv, 4, 2, "(total_tokens, 2, nheads_k, headdim)")
    return _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


# The decoding entry point lives in its own module (cache bookkeeping, rotary, paged KV).
