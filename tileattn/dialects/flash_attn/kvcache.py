"""``flash_attn_with_kvcache`` (flash-attn 2.x): decoding attention over a KV cache, forward only.

Every call is one :func:`tileattn.flash_attention` call on the cache *as it is stored*: nothing of
the cache is copied, and the bookkeeping around it is a few vectorised tensor operations, never a
Python loop over batch items or tokens.

* ``cache_seqlens`` (+ the appended tokens) becomes ``seqused_k``: sequence ``b`` attends to its
  first ``cache_seqlens[b] + seqlen_new`` keys, bottom-right aligned to that length (flash-attn).
* ``block_table`` is passed through (a paged pool ``(num_blocks, page_size, Hk, D)``), its entries
  past the pages a sequence uses zeroed in a small copy of the table: flash-attn never reads them,
  so they may hold anything (-1 padding, stale pages).
* ``cache_batch_idx`` reads the contiguous cache ``(B_cache, S_cache, Hk, D)`` as a paged pool of
  ``B_cache`` pages of ``S_cache`` slots with the one-column block table ``cache_batch_idx[:, None]``.
* ``cache_leftpad`` (the valid keys of sequence ``b`` are ``[cache_leftpad[b], cache_seqlens[b])``,
  positions counted from ``cache_leftpad[b]`` for causality, windows and ALiBi, as in flash-attn) reads
  the cache as a pool of pages of ``g`` slots, ``g`` the gcd of the capacity and every left pad, and
  the block table of each sequence starts at its first valid page: exact, and still no copy. A cache
  whose batch and sequence dims cannot be merged into one strided dim (a slice of a longer buffer)
  has its valid rows gathered into a contiguous copy instead.
* New keys/values (``k``, ``v``) are written in place with one ``index_put_`` per cache at computed
  (row, position) or (page, slot) indices (one sequence's through a slice of its row); rotary embedding (GPT-J interleaved or GPT-NeoX halves) is
  applied to them and to q in fp32 by gathering the cos/sin rows of every (sequence, token) at once.
  Every argument is checked before the write; the slots it overwrites are copied first (S_new per
  sequence) and put back if anything fails after it, so the caches are byte-identical after any error.
* ``num_splits`` is flash-attn's hint for how many key chunks the GPU kernel computes in parallel. It
  is validated and not used: tileattn's decode paths (native split-KV, Triton flash-decoding) choose
  the chunks from the problem shape alone, so a result is bitwise the same whatever the hint, the
  batch around it or the number of threads.
* A repeated step (the shapes, strides, dtypes and options of one that passed every check) skips the
  checks that read nothing else; its lengths are checked again (:func:`_step`).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ...core import plans
from ...core.api import flash_attention
from . import descale as _descale
from .checks import _as_int, _check_alibi, _check_options, _check_rank
from .errors import FlashAttnTypeError, _describe, _fail, core_errors

_FN = "flash_attn_with_kvcache"


def _lengths(name, value, batch, what, device):
    """(host list, device int32 tensor) of a per-sequence int argument given as an int or (B,) int32."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        host = [int(value)] * batch
        return host, torch.full((batch,), int(value), dtype=torch.int32, device=device)
    if isinstance(value, torch.Tensor) and value.dtype == torch.int32 and tuple(value.shape) == (batch,):
        if value.device != device:
            _fail(_FN, name, f"device {value.device}", f"q's device {device}")
        return value.tolist(), value
    _fail(_FN, name, _describe(value), f"an int or an int32 tensor of shape ({batch},): {what}", FlashAttnTypeError)


def _check_range(name, values, lower, upper, what):
    bad = [(b, n, lo, hi) for b, (n, lo, hi) in enumerate(zip(values, lower, upper)) if not lo <= n <= hi]
    if bad:
        b, n, lo, hi = bad[0]
        _fail(_FN, name, f"{n} for sequence {b}", f"{what} in [{lo}, {hi}]")


def _rotate(x, cos, sin, interleaved):
    """Rotary embedding of the first ``2 * cos.shape[-1]`` dims of x (B, S, H, D), cos/sin (B, S, rd/2)
    per (sequence, token), computed in fp32 and rounded to x's dtype (as flash-attn's kernel)."""
    rd = 2 * cos.shape[-1]
    cos, sin = cos[:, :, None, :].to(torch.float32), sin[:, :, None, :].to(torch.float32)
    head, tail = x[..., :rd].to(torch.float32), x[..., rd:]
    if interleaved:  # GPT-J: pairs (0, 1), (2, 3), ...
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:  # GPT-NeoX: pairs (j, j + rd/2)
        x1, x2 = head[..., : rd // 2], head[..., rd // 2:]
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rotated.to(x.dtype), tail), dim=-1)


def _check_rotary(rotary_cos, rotary_sin, head_dim, capacity, lengths, seqlen_q, local, device):
    """flash-attn's rule: cos/sin of shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim and
    seqlen_ro >= the cache's capacity per sequence (``seqlen_k`` of its kernel); nothing about
    seqlen_q, because non-causal, non-local queries are all rotated at ``cache_seqlens``. Causal or
    local queries are rotated at ``cache_seqlens + i``, which flash-attn reads past the table when it
    is beyond it; that is refused here."""
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            _fail(_FN, name, _describe(t), "a float tensor (seqlen_ro, rotary_dim / 2)", FlashAttnTypeError)
        if t.device != device:
            _fail(_FN, name, f"device {t.device}", f"q's device {device}")
    if rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > head_dim:
        _fail(_FN, "rotary_cos/rotary_sin", f"shapes {tuple(rotary_cos.shape)}, {tuple(rotary_sin.shape)}",
              f"equal shapes (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim {head_dim}")
    seqlen_ro = rotary_cos.shape[0]
    if seqlen_ro < capacity:
        _fail(_FN, "rotary_cos", f"{seqlen_ro} positions",
              f"at least the cache's capacity per sequence, {capacity} (flash-attn: cos/sin seqlen must be at "
              "least the seqlen of KV cache)")
    if local and max(lengths) + seqlen_q > seqlen_ro:
        _fail(_FN, "rotary_cos", f"{seqlen_ro} positions for causal/local queries at cache_seqlens + i",
              f"at least max(cache_seqlens) + seqlen_q = {max(lengths) + seqlen_q}")


class _Cache:
    """Where each sequence's keys live: a contiguous cache (rows ``cache_batch_idx`` or 0..B-1) or a
    paged pool with a block table; ``capacity`` keys per sequence."""

    def __init__(self, q, k_cache, v_cache, cache_batch_idx, block_table):
        self.k, self.v = k_cache, v_cache
        batch, device = q.shape[0], q.device
        self.table = block_table
        self.rows = None
        if block_table is not None:
            if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or \
                    block_table.dim() != 2 or block_table.shape[0] != batch:
                _fail(_FN, "block_table", _describe(block_table),
                      f"an int32 tensor (batch={batch}, max_blocks_per_sequence)", FlashAttnTypeError)
            if block_table.device != device:
                _fail(_FN, "block_table", f"device {block_table.device}", f"q's device {device}")
            if cache_batch_idx is not None:
                _fail(_FN, "cache_batch_idx", "a tensor together with block_table",
                      "None with a paged cache (flash-attn: paged KV cache does not support cache_batch_idx)")
            self.page_size = k_cache.shape[1]
            self.capacity = block_table.shape[1] * self.page_size
            return
        self.capacity = k_cache.shape[1]
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                _fail(_FN, "k_cache", f"batch {k_cache.shape[0]}", f"q's batch {batch} (or pass cache_batch_idx)")
            return
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32 or \
                tuple(cache_batch_idx.shape) != (batch,):
            _fail(_FN, "cache_batch_idx", _describe(cache_batch_idx),
                  f"an int32 tensor of shape ({batch},): the cache entry of each sequence", FlashAttnTypeError)
        if cache_batch_idx.device != device:
            _fail(_FN, "cache_batch_idx", f"device {cache_batch_idx.device}", f"q's device {device}")
        entries = k_cache.shape[0]
        _check_range("cache_batch_idx", cache_batch_idx.tolist(), [0] * batch, [entries - 1] * batch,
                     "an entry of k_cache (dim 0)")
        self.rows = cache_batch_idx

    def check_capacity(self, used, new):
        """Every sequence's ``used`` keys (its cache_seqlens plus the ``new`` appended ones) fit: in a
        paged cache, in the pages its row of the block table addresses (named, as flash-attn's error)."""
        bad = [(b, n) for b, n in enumerate(used) if n > self.capacity]
        if not bad:
            return
        b, n = bad[0]
        if self.table is not None:
            _fail(_FN, "block_table", f"{self.table.shape[1]} pages of {self.page_size} positions per sequence, "
                  f"{self.capacity} keys", f"pages for cache_seqlens[{b}] + {new} new keys = {n} keys (or a "
                  "shorter cache_seqlens)")
        _fail(_FN, "cache_seqlens", f"{n - new} for sequence {b}",
              f"a length leaving room for the {new} new keys (the cache's capacity per sequence is {self.capacity})"
              if new else f"a length up to the cache's capacity per sequence, {self.capacity}")

    def row_index(self, batch):
        """(B,) int64 cache entry of each sequence of a contiguous cache."""
        if self.rows is not None:
            return self.rows.long()
        return torch.arange(batch, device=self.k.device)

    def used_table(self, used):
        """The block table restricted to the pages the sequences use (``used`` keys each), entries past
        a sequence's last page set to page 0; the pages it does use must exist."""
        pages = max(1, -(-max(used) // self.page_size))
        table = self.table[:, :pages]
        device = table.device
        in_use = torch.arange(pages, device=device)[None, :] < \
            torch.tensor([-(-n // self.page_size) for n in used], device=device)[:, None]
        blocks = self.k.shape[0]
        bad = in_use & ((table < 0) | (table >= blocks))
        if bool(bad.any()):
            b, slot = (int(i) for i in bad.nonzero()[0])
            _fail(_FN, "block_table", f"block_table[{b}][{slot}] = {int(table[b, slot])}",
                  f"a page index in [0, {blocks}) (k_cache's pages) for each page sequence {b} uses "
                  f"(its first {used[b]} positions)")
        return torch.where(in_use, table, 0)

    def write(self, starts, k_new, v_new, lengths):
        """Store k_new/v_new (B, S_new, Hk, D) at positions starts[b] + i of each sequence, in place
        (``lengths``: starts as a host list). Returns what :meth:`restore` needs to put the
        overwritten slots back."""
        batch, new = k_new.shape[:2]
        flat_k, flat_v = _slots(self.k), _slots(self.v)
        if self.table is None and self.rows is None and flat_k is not None and flat_v is not None:
            # the common step: rows 0..B-1 of a contiguous cache, the flat slots computed on the host
            cap = self.k.shape[1]
            if batch == 1:
                # one sequence: its new slots are one run, and a slice's copies cost a third of the
                # index ops below (10 us against 25 us: a decode step's whole write)
                run = slice(lengths[0], lengths[0] + new)
                saved = (run, flat_k[run].clone(), flat_v[run].clone())
                try:
                    flat_k[run].copy_(k_new[0])
                    flat_v[run].copy_(v_new[0])
                except BaseException:
                    self.restore(saved)
                    raise
                return saved
            index = torch.tensor([b * cap + n + i for b, n in enumerate(lengths) for i in range(new)],
                                 dtype=torch.long, device=self.k.device)  # long even when empty (batch 0)
            saved = (index, flat_k.index_select(0, index), flat_v.index_select(0, index))
            flat_k.index_put_((index,), k_new.reshape(-1, *k_new.shape[2:]))
            try:
                flat_v.index_put_((index,), v_new.reshape(-1, *v_new.shape[2:]))
            except BaseException:
                self.restore(saved)
                raise
            return saved
        positions = starts.long()[:, None] + torch.arange(new, device=starts.device)
        if self.table is None:
            first, second = self.row_index(batch)[:, None].expand(batch, new), positions
        else:
            rows = torch.arange(batch, device=starts.device)[:, None]
            first, second = self.table[rows, positions // self.page_size].long(), positions % self.page_size
        if flat_k is not None and flat_v is not None:  # (entry or page, slot) merged: one index_copy_ each
            index = (first * self.k.shape[1] + second).flatten()
            saved = (index, flat_k.index_select(0, index), flat_v.index_select(0, index))
            writes = ((flat_k, k_new.flatten(0, 1)), (flat_v, v_new.flatten(0, 1)))
        else:
            index = (first, second)
            saved = (index, self.k[index], self.v[index])  # copies of the S_new slots per sequence
            writes = ((self.k, k_new), (self.v, v_new))
        self._put(writes[0], index)
        try:
            self._put(writes[1], index)
        except BaseException:
            self.restore(saved)
            raise
        return saved

    @staticmethod
    def _put(write, index):
        target, values = write
        target.index_put_(index if isinstance(index, tuple) else (index,), values)

    def restore(self, saved):
        """Undo :meth:`write`: the caches byte-identical to what they were before it."""
        index, old_k, old_v = saved
        if isinstance(index, slice):  # one sequence's run of slots
            _slots(self.k)[index].copy_(old_k)
            _slots(self.v)[index].copy_(old_v)
        elif isinstance(index, tuple):
            self.k.index_put_(index, old_k)
            self.v.index_put_(index, old_v)
        else:
            _slots(self.k).index_put_((index,), old_k)
            _slots(self.v).index_put_((index,), old_v)


def _slots(cache):
    """A cache (N0, N1, Hk, D) as an (N0 * N1, Hk, D) view of its slots, or None when its first two
    dims do not merge into one strided dim."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return None


def _left_padded(cache, batch, pads, used, used_t, pads_t):
    """(k, v, extra keywords) reading the keys [pads[b], pads[b] + used[b]) of each sequence of a
    contiguous cache as a paged pool of gcd(capacity, pads) slots per page, without a copy (see the
    module doc); a cache whose first two dims cannot be merged is gathered instead."""
    k, v = cache.k, cache.v
    entries, capacity = k.shape[:2]
    rows = cache.row_index(batch)
    device = k.device
    mergeable = all(entries == 1 or t.stride(0) == capacity * t.stride(1) for t in (k, v))
    if not mergeable:
        # Gather the valid rows of every sequence into one contiguous (B, max_used, Hk, D) copy.
        width = max(1, max(used))
        positions = (pads_t.long()[:, None] + torch.arange(width, device=device)).clamp_(max=capacity - 1)
        index = (rows[:, None].expand(batch, width), positions)
        return k[index], v[index], dict(seqused_k=used_t)
    page = math.gcd(capacity, *pads)
    per_entry = capacity // page
    pool_k = k.reshape(entries * per_entry, page, *k.shape[2:])
    pool_v = v.reshape(entries * per_entry, page, *v.shape[2:])
    pages = max(1, -(-max(used) // page))
    first = rows * per_entry + pads_t.long() // page
    # Pages past a sequence's valid keys are never read; clamped, they stay valid indices of the pool.
    table = (first[:, None] + torch.arange(pages, device=device)).clamp_(max=entries * per_entry - 1)
    return pool_k, pool_v, dict(block_table=table.to(torch.int32), seqused_k=used_t)


# ---------------------------------------------------------------------------------------------
# The repeated decode step: a call whose arguments have the shapes, strides, dtypes and option
# values of one that passed every check before (no rotary, leftpad, block table, cache_batch_idx,
# ALiBi or fp8 descales; cache_seqlens an int32 tensor) skips the checks that read nothing else.
# What it still checks are the values: the lengths (>= 0, room for the new keys); any doubt, and
# the call takes the full path below, which raises the error. Its entries (kind "kvcache" of
# tileattn.core.plans) hold the window the options gave, no tensor.

KIND = "kvcache"
_DENSE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _meta(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def _step_key(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, softcap, num_splits,
              return_softmax_lse):
    """The plan key of a step the fast path may serve, or None."""
    tensors = (q, k_cache, v_cache, cache_seqlens) if k is None else (q, k_cache, v_cache, k, v, cache_seqlens)
    if any(type(t) is not torch.Tensor for t in tensors) or q.dtype not in _DENSE or torch.compiler.is_compiling():
        return None
    # options of plain Python types only: their values go into the key (never a tensor)
    if type(causal) is not bool or type(return_softmax_lse) is not bool or type(num_splits) is not int or \
            type(softcap) not in (float, int) or type(window_size) is not tuple or \
            any(type(w) is not int for w in window_size) or \
            (softmax_scale is not None and type(softmax_scale) not in (float, int)):
        return None
    return (KIND, tuple(_meta(t) for t in tensors), k is None, type(softmax_scale), softmax_scale, causal,
            window_size, type(softcap), softcap, num_splits, return_softmax_lse)


def _step(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window, softcap, return_softmax_lse):
    """The full path's arithmetic for a step whose checks passed before; None when a value needs them."""
    lengths = cache_seqlens.tolist()
    new = 0 if k is None else k.shape[1]
    if lengths and (min(lengths) < 0 or max(lengths) + new > k_cache.shape[1]):  # batch 0: nothing to check
        return None
    cache = _Cache(q, k_cache, v_cache, None, None)
    saved = None if k is None else cache.write(cache_seqlens, k, v, lengths)
    try:
        used_t = cache_seqlens + new if new else cache_seqlens
        out, lse = _attend(q, k_cache, v_cache, dict(seqused_k=used_t), softmax_scale, causal, window, softcap, None)
    except BaseException:
        if saved is not None:
            cache.restore(saved)
        raise
    return (out, lse) if return_softmax_lse else out


def _attend(queries, keys, values, extra, softmax_scale, causal, window, softcap, alibi_slopes):
    """A step's one core call, (out, lse): the checked and the repeated step make it alike."""
    with core_errors(_FN):
        return flash_attention(queries, keys, values, **extra, layout="BSND", scale=softmax_scale, causal=causal,
                               window=window, softcap=float(softcap), alibi_slopes=alibi_slopes, return_lse=True)


@torch.no_grad()
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, q_descale=None, k_descale=None, v_descale=None):
    """Decoding attention over a KV cache (forward only, no gradients).

    q (B, Sq, H, D); k_cache/v_cache (B_cache, S_cache, Hk, D), or (num_blocks, page_size, Hk, D) with
    ``block_table`` (B, max_blocks) int32 for a paged cache (only the pages a sequence uses must be
    valid). ``cache_batch_idx`` (B,) int32 picks each sequence's cache entry. ``cache_leftpad`` (B,)
    int32: sequence ``b``'s cache starts at ``cache_leftpad[b]`` (not with a paged cache, as
    flash-attn). When ``k``/``v`` (B, S_new, Hk, D) are given they are written into the caches *in
    place* at positions ``cache_seqlens[b]:cache_seqlens[b] + S_new``, then q attends to the keys
    ``[cache_leftpad[b], cache_seqlens[b] + S_new)`` of its sequence (the whole cache when
    ``cache_seqlens`` is None), bottom-right aligned. With ``rotary_cos/rotary_sin``
    (seqlen_ro, rotary_dim / 2), seqlen_ro at least the cache's capacity per sequence (flash-attn's
    rule), the new keys are rotated at positions ``cache_seqlens[b] + i`` and q at the same positions
    when causal or windowed, else all at ``cache_seqlens[b]``; ``rotary_interleaved`` picks GPT-J
    pairs over GPT-NeoX halves. ``num_splits`` is validated and otherwise not used (see the module
    doc). Returns ``out`` or ``(out, softmax_lse (B, H, Sq))``.

    FlashAttention-3's fp8 cache: k_cache/v_cache (and new k/v) float8, q float8 (output bf16) or bf16
    / fp16 / fp32, with ``q_descale``, ``k_descale``, ``v_descale`` fp32 (batch, nheads_k), None = 1;
    the cache is read as stored, never dequantised into a copy (:mod:`.descale`).
    """
    key = None
    if rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None and \
            block_table is None and alibi_slopes is None and q_descale is None and k_descale is None and \
            v_descale is None and cache_seqlens is not None and (k is None) == (v is None):
        key = _step_key(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, softcap,
                        num_splits, return_softmax_lse)
        window = plans.get(key) if key is not None else None
        if window is not None:
            served = _step(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window, softcap,
                           return_softmax_lse)
            if served is not None:
                return served
    result = _checked(q, k_cache, v_cache, (k, v), _Rotary(rotary_cos, rotary_sin, rotary_interleaved),
                      _Where(cache_seqlens, cache_batch_idx, cache_leftpad, block_table),
                      _Options(softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
                               return_softmax_lse), (q_descale, k_descale, v_descale))
    if key is not None:  # every check passed for this shape: its next call takes _step
        plans.put(key, _check_options(_FN, 0.0, softmax_scale, causal, window_size, softcap, False,
                                      return_softmax_lse, "return_softmax_lse"))
    return result


class _Rotary(NamedTuple):
    """The rotary embedding of the new keys and of q: cos/sin tables and GPT-J pairs or NeoX halves."""

    cos: object
    sin: object
    interleaved: object


class _Where(NamedTuple):
    """Where each sequence's keys are in the caches: its length, its cache entry, its first valid key,
    its pages."""

    cache_seqlens: object
    cache_batch_idx: object
    cache_leftpad: object
    block_table: object


class _Options(NamedTuple):
    """The attention's options, as flash_attn_with_kvcache takes them."""

    softmax_scale: object
    causal: object
    window_size: object
    softcap: object
    alibi_slopes: object
    num_splits: object
    return_softmax_lse: object


def _checked(q, k_cache, v_cache, new_kv, rotary, where, options, descales):
    """flash_attn_with_kvcache with every check (the docstring above), in its steps: the tensors and
    options, the sequences' lengths in the cache, the new keys, then (the caches written only once
    every check passed) the rotation, the write and the attention."""
    q, cache_dtype, fp8, window = _check_call(q, k_cache, v_cache, options, descales)
    batch = q.shape[0]
    cache = _Cache(q, k_cache, v_cache, where.cache_batch_idx, where.block_table)
    lengths, lengths_t = _cache_lengths(where.cache_seqlens, batch, q.device)
    new = _check_new_kv(new_kv, rotary, q, k_cache, v_cache, lengths, cache_dtype)
    used = [cache.capacity] * batch if lengths is None else [n + new for n in lengths]
    cache.check_capacity(used, new)
    pads = _left_pads(where.cache_leftpad, cache, lengths, used, q.device)
    if cache.table is not None:
        cache.table = cache.used_table(used)  # validated before anything is written
    local = options.causal or window != (-1, -1)
    rotating = rotary.cos is not None or rotary.sin is not None
    if rotating:
        _check_rotary(rotary.cos, rotary.sin, q.shape[3], cache.capacity, lengths, q.shape[1], local, q.device)
    k, v = new_kv
    queries = q
    if k is not None and rotating:
        queries, k = _rotated(q, k, rotary, lengths_t, local)
    # Every argument flash-attn checks is checked above, before the caches change. Should the core
    # still refuse the call (or the computation fail), the new keys are taken out again: the caches
    # are byte-identical after any error.
    saved = None if k is None else cache.write(lengths_t, k, v, lengths)
    try:
        used_t = None if lengths is None else (lengths_t + new if new else lengths_t)
        keys, values, extra = _keys_of(cache, batch, pads, used, used_t, q.device)
        if fp8:
            queries, scales = _descale.lower(_FN, queries, keys, values, descales, batch, k_cache.shape[2],
                                             "block_table" in extra)
            extra.update(scales)
        out, lse = _attend(queries, keys, values, extra, options.softmax_scale, options.causal, window,
                           options.softcap, options.alibi_slopes)
    except BaseException:
        if saved is not None:
            cache.restore(saved)
        raise
    return (out, lse) if options.return_softmax_lse else out


def _check_call(q, k_cache, v_cache, options, descales):
    """The tensors' ranks, dtypes, devices and shapes and the options: (q, as the core takes it (an
    fp8 q widened to bf16, exactly), the cache's dtype, whether the cache is FlashAttention-3's fp8
    with descales, the window)."""
    _check_rank(_FN, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_rank(_FN, "k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _check_rank(_FN, "v_cache", v_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim_v)")
    window = _check_options(_FN, 0.0, options.softmax_scale, options.causal, options.window_size, options.softcap,
                            False, options.return_softmax_lse, "return_softmax_lse")
    if _as_int(_FN, "num_splits", options.num_splits, "an int >= 0 (0 = automatic)") < 0:
        _fail(_FN, "num_splits", repr(options.num_splits), "an int >= 0 (0 = automatic)")
    fp8 = _descale.wanted(q, k_cache, v_cache, descales)
    if fp8 and q.dtype in _descale.FP8:
        if k_cache.dtype not in _descale.FP8:
            _fail(_FN, "q", f"dtype {q.dtype} with a cache of dtype {k_cache.dtype}", "fp8 q with an fp8 cache",
                  FlashAttnTypeError)
        q = q.to(torch.bfloat16)  # exact: every fp8 value is a bf16 value
    cache_dtype = k_cache.dtype if fp8 and k_cache.dtype in _descale.FP8 else q.dtype
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != cache_dtype:
            _fail(_FN, name, f"dtype {t.dtype}", f"q's dtype {q.dtype} (or float8 with FlashAttention-3's descales)"
                  if not fp8 else f"the cache's dtype {cache_dtype}", FlashAttnTypeError)
        if t.device != q.device:
            _fail(_FN, name, f"device {t.device}", f"q's device {q.device}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        _fail(_FN, "v_cache", f"shape {tuple(v_cache.shape)}",
              f"the first three dims of k_cache {tuple(k_cache.shape[:3])}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        _fail(_FN, "q", f"dtype {q.dtype}", "fp16, bf16 (flash-attn), fp32 or fp64", FlashAttnTypeError)
    batch, _, heads, _ = q.shape
    if k_cache.shape[3] != q.shape[3]:
        _fail(_FN, "k_cache", f"head dim {k_cache.shape[3]}", f"q's head dim {q.shape[3]}")
    if k_cache.shape[2] == 0 or heads % k_cache.shape[2]:
        _fail(_FN, "k_cache", f"{k_cache.shape[2]} heads for {heads} query heads",
              "a number of kv heads dividing the query heads (MQA/GQA)")
    if 0 in (q.shape[3], v_cache.shape[3]):
        _fail(_FN, "q/v_cache", f"head dims {q.shape[3]}/{v_cache.shape[3]}", "positive head dims")
    _check_alibi(_FN, options.alibi_slopes, batch, heads, q.device)
    return q, cache_dtype, fp8, window


def _cache_lengths(cache_seqlens, batch, device):
    """(host list, device tensor) of the sequences' current lengths, (None, None) for whole caches."""
    if cache_seqlens is None:
        return None, None
    lengths, lengths_t = _lengths("cache_seqlens", cache_seqlens, batch, "the current cache lengths", device)
    negative = [(b, n) for b, n in enumerate(lengths) if n < 0]
    if negative:
        _fail(_FN, "cache_seqlens", f"{negative[0][1]} for sequence {negative[0][0]}", "a length >= 0")
    return lengths, lengths_t


def _check_new_kv(new_kv, rotary, q, k_cache, v_cache, lengths, cache_dtype) -> int:
    """The new keys and values (both or neither, and rotary tables only with them): how many a sequence
    appends."""
    k, v = new_kv
    batch = q.shape[0]
    if (k is None) != (v is None):
        _fail(_FN, "k/v", "only one of them", "both new k and v, or neither")
    if (rotary.cos is not None or rotary.sin is not None) and k is None:
        _fail(_FN, "rotary_cos/rotary_sin", "rotary tables without new k/v", "new k and v to rotate (as flash-attn)")
    if k is None:
        return 0
    _check_rank(_FN, "k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
    _check_rank(_FN, "v", v, 4, "(batch, seqlen_new, nheads_k, headdim_v)")
    if lengths is None:
        _fail(_FN, "cache_seqlens", None, "the current cache lengths, required to append k/v")
    if k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or v.shape[:3] != k.shape[:3] \
            or v.shape[3] != v_cache.shape[3]:
        _fail(_FN, "k/v", f"shapes {tuple(k.shape)}, {tuple(v.shape)}",
              f"(batch={batch}, seqlen_new, {k_cache.shape[2]}, headdim) matching the caches")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != cache_dtype or t.device != q.device:
            _fail(_FN, name, f"dtype {t.dtype} on {t.device}", f"the cache's dtype {cache_dtype} on {q.device}",
                  FlashAttnTypeError)
    return k.shape[1]


def _left_pads(cache_leftpad, cache, lengths, used, device):
    """(host list, device tensor) of where each sequence's cache starts, or None without left pads."""
    if cache_leftpad is None:
        return None
    batch = len(used)
    if cache.table is not None:
        _fail(_FN, "cache_leftpad", "a tensor together with block_table",
              "None with a paged cache (flash-attn: paged KV and leftpad_k cannot be used together)")
    if not isinstance(cache_leftpad, torch.Tensor):
        _fail(_FN, "cache_leftpad", _describe(cache_leftpad), f"an int32 tensor of shape ({batch},)",
              FlashAttnTypeError)
    pads, pads_t = _lengths("cache_leftpad", cache_leftpad, batch, "where each sequence's cache starts", device)
    ends = lengths if lengths is not None else used
    _check_range("cache_leftpad", pads, [0] * batch, ends, "a start at most the sequence's cache length")
    return pads, pads_t


def _rotated(q, k, rotary, lengths_t, local):
    """(q, k) rotated: the new keys at positions cache_seqlens[b] + i, q at the same positions when
    causal or windowed, else all at cache_seqlens[b] (flash-attn's rule)."""
    batch, seqlen_q = q.shape[:2]
    start = lengths_t.long()[:, None]
    k_pos = start + torch.arange(k.shape[1], device=q.device)
    k = _rotate(k, rotary.cos[k_pos], rotary.sin[k_pos], rotary.interleaved)
    q_pos = start + torch.arange(seqlen_q, device=q.device) if local else start.expand(batch, seqlen_q)
    return _rotate(q, rotary.cos[q_pos], rotary.sin[q_pos], rotary.interleaved), k


def _keys_of(cache, batch, pads, used, used_t, device):
    """(keys, values, the core call's keywords that say where each sequence's are) of the cache."""
    if pads is not None:
        pads, pads_t = pads
        valid = [n - p for n, p in zip(used, pads)]
        valid_t = (torch.full((batch,), cache.capacity, dtype=torch.int32, device=device)
                   if used_t is None else used_t) - pads_t
        return _left_padded(cache, batch, pads, valid, valid_t, pads_t)
    if cache.table is not None:
        return cache.k, cache.v, dict(block_table=cache.table, seqused_k=used_t)
    if cache.rows is not None:
        # A contiguous cache is a pool of B_cache pages of S_cache slots; sequence b reads page idx[b].
        return cache.k, cache.v, dict(block_table=cache.rows[:, None], seqused_k=used_t)
    return cache.k, cache.v, dict(seqused_k=used_t)
