"""``flash_attn_with_kvcache`` (flash-attn 2.x): decoding attention over a KV cache, forward only.

Cache bookkeeping (in-place append at ``cache_seqlens``, ``cache_batch_idx``, a paged cache through
``block_table``) and rotary embedding happen here with plain tensor indexing; the attention itself is
:func:`tileattn.flash_attention` with ``layout="BSND"``, bottom-right aligned to each sequence's
length, like flash-attn.
"""

from __future__ import annotations

import numbers

import torch

from ...api import flash_attention
from .flash_attn_interface import FlashAttnTypeError, _as_int, _check_options, _check_rank, _describe, _fail

_FN = "flash_attn_with_kvcache"


def _int32_vector(name, t, length, upper, what):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (length,):
        _fail(_FN, name, _describe(t), f"an int32 tensor of shape ({length},): {what}", FlashAttnTypeError)
    values = t.tolist()
    if any(not 0 <= x < upper for x in values):
        _fail(_FN, name, values, f"{what} in [0, {upper})")
    return values


def _cache_lengths(cache_seqlens, batch, capacity):
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lengths = [int(cache_seqlens)] * batch
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32 and \
            tuple(cache_seqlens.shape) == (batch,):
        lengths = cache_seqlens.tolist()
    else:
        _fail(_FN, "cache_seqlens", _describe(cache_seqlens), f"an int or an int32 tensor of shape ({batch},)",
              FlashAttnTypeError)
    if any(not 0 <= n <= capacity for n in lengths):
        _fail(_FN, "cache_seqlens", lengths, f"lengths in [0, {capacity}] (the cache's capacity per sequence)")
    return lengths


def _rotate(x, cos, sin, interleaved):
    """Rotary embedding of the first ``2 * cos.shape[-1]`` dims of x (S, H, D) at per-row cos/sin (S, rd/2)."""
    rd = 2 * cos.shape[-1]
    cos, sin = cos[:, None, :].to(torch.float32), sin[:, None, :].to(torch.float32)
    head, tail = x[..., :rd].to(torch.float32), x[..., rd:]
    if interleaved:  # GPT-J: pairs (0, 1), (2, 3), ...
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:  # GPT-NeoX: pairs (j, j + rd/2)
        x1, x2 = head[..., : rd // 2], head[..., rd // 2:]
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rotated.to(x.dtype), tail), dim=-1)


class _Cache:
    """Where sequence ``b`` of the batch lives in k_cache/v_cache (contiguous, indexed or paged)."""

    def __init__(self, k_cache, v_cache, batch, cache_batch_idx, block_table):
        self.k, self.v = k_cache, v_cache
        self.pages = None
        if block_table is not None:
            if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or \
                    block_table.dim() != 2 or block_table.shape[0] != batch:
                _fail(_FN, "block_table", _describe(block_table),
                      f"an int32 tensor (batch={batch}, max_blocks_per_sequence)", FlashAttnTypeError)
            if cache_batch_idx is not None:
                _fail(_FN, "cache_batch_idx", "a tensor together with block_table", "None with a paged cache")
            self.pages = block_table.tolist()
            self.page_size = k_cache.shape[1]
            self.capacity = block_table.shape[1] * self.page_size
            self.rows = list(range(batch))
        else:
            self.capacity = k_cache.shape[1]
            if cache_batch_idx is None:
                if k_cache.shape[0] != batch:
                    _fail(_FN, "k_cache", f"batch {k_cache.shape[0]}", f"q's batch {batch} (or pass cache_batch_idx)")
                self.rows = list(range(batch))
            else:
                self.rows = _int32_vector("cache_batch_idx", cache_batch_idx, batch, k_cache.shape[0],
                                          "indices of the cache entries of each sequence")

    def check_pages(self, used):
        """The pages each sequence reads or writes (those holding its first ``used[b]`` positions)
        must exist. Entries past them are never read, as in flash-attn (block tables are often
        padded with arbitrary values)."""
        if self.pages is None:
            return
        blocks = self.k.shape[0]
        for b, n in enumerate(used):
            for slot, page in enumerate(self.pages[b][: -(-n // self.page_size)]):
                if not 0 <= page < blocks:
                    _fail(_FN, "block_table", f"block_table[{b}][{slot}] = {page}",
                          f"a page index in [0, {blocks}) (k_cache's pages) for each page sequence {b} "
                          f"uses (its first {n} positions)")

    def write(self, b, start, k_new, v_new):
        """Store (S_new, Hk, D) keys/values at positions start.. of sequence b, in place."""
        if self.pages is None:
            self.k[self.rows[b], start:start + k_new.shape[0]] = k_new
            self.v[self.rows[b], start:start + v_new.shape[0]] = v_new
            return
        for i in range(k_new.shape[0]):
            page, slot = divmod(start + i, self.page_size)
            self.k[self.pages[b][page], slot] = k_new[i]
            self.v[self.pages[b][page], slot] = v_new[i]

    def keys(self, b, used):
        """(1, used, Hk, D) views (contiguous cache) or gathered copies (paged cache) of sequence b."""
        if self.pages is None:
            r = self.rows[b]
            return self.k[r:r + 1, :used], self.v[r:r + 1, :used]
        blocks = self.pages[b][: -(-used // self.page_size)] if used else []
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        return (self.k[idx].flatten(0, 1)[:used].unsqueeze(0), self.v[idx].flatten(0, 1)[:used].unsqueeze(0))


def _check_rotary(rotary_cos, rotary_sin, head_dim, capacity, lengths, seqlen_q, local):
    """flash-attn's rule: cos/sin of shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim and
    seqlen_ro >= the cache's capacity per sequence (``seqlen_k`` of its kernel); nothing about
    seqlen_q, because non-causal, non-local queries are all rotated at ``cache_seqlens``. Causal or
    local queries are rotated at ``cache_seqlens + i``, which flash-attn reads past the table when it
    is beyond it; that is refused here."""
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            _fail(_FN, name, _describe(t), "a float tensor (seqlen_ro, rotary_dim / 2)", FlashAttnTypeError)
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


@torch.no_grad()
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Decoding attention over a KV cache (forward only, no gradients).

    q (B, Sq, H, D); k_cache/v_cache (B_cache, S_cache, Hk, D), or (num_blocks, page_size, Hk, D) with
    ``block_table`` (B, max_blocks) int32 for a paged cache (only the pages a sequence uses must be
    valid). ``cache_batch_idx`` (B,) int32 picks each sequence's cache entry. When ``k``/``v``
    (B, S_new, Hk, D) are given they are written into the caches *in place* at positions
    ``cache_seqlens[b]:cache_seqlens[b] + S_new``, then q attends to the first
    ``cache_seqlens[b] + S_new`` entries of its sequence (the whole cache when ``cache_seqlens`` is
    None). With ``rotary_cos/rotary_sin`` (seqlen_ro, rotary_dim / 2), seqlen_ro at least the cache's
    capacity per sequence (flash-attn's rule), the new keys are rotated at positions
    ``cache_seqlens[b] + i`` and q at the same positions when causal or windowed, else all at
    ``cache_seqlens[b]``; ``rotary_interleaved`` picks GPT-J pairs over GPT-NeoX halves.
    ``num_splits`` is a GPU scheduling hint and is ignored. Returns ``out`` or
    ``(out, softmax_lse (B, H, Sq))``.
    """
    if cache_leftpad is not None:
        raise NotImplementedError(f"tileattn.compat.flash_attn.{_FN}: argument 'cache_leftpad' (left-padded "
                                  "caches) is not supported; pass None and keep each sequence's cache left-aligned.")
    _check_rank(_FN, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_rank(_FN, "k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _check_rank(_FN, "v_cache", v_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim_v)")
    window = _check_options(_FN, 0.0, softmax_scale, causal, window_size, softcap, False, return_softmax_lse,
                            "return_softmax_lse")
    if _as_int(_FN, "num_splits", num_splits, "an int >= 0 (0 = automatic)") < 0:
        _fail(_FN, "num_splits", repr(num_splits), "an int >= 0 (0 = automatic)")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        _fail(_FN, "v_cache", f"shape {tuple(v_cache.shape)}",
              f"the first three dims of k_cache {tuple(k_cache.shape[:3])}")
    batch = q.shape[0]
    cache = _Cache(k_cache, v_cache, batch, cache_batch_idx, block_table)
    lengths = _cache_lengths(cache_seqlens, batch, cache.capacity)
    if (k is None) != (v is None):
        _fail(_FN, "k/v", "only one of them", "both new k and v, or neither")
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary and k is None:
        _fail(_FN, "rotary_cos/rotary_sin", "rotary tables without new k/v", "new k and v to rotate (as flash-attn)")
    new = 0
    if k is not None:
        _check_rank(_FN, "k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        _check_rank(_FN, "v", v, 4, "(batch, seqlen_new, nheads_k, headdim_v)")
        if lengths is None:
            _fail(_FN, "cache_seqlens", None, "the current cache lengths, required to append k/v")
        new = k.shape[1]
        if k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != v_cache.shape[3]:
            _fail(_FN, "k/v", f"shapes {tuple(k.shape)}, {tuple(v.shape)}",
                  f"(batch={batch}, seqlen_new, {k_cache.shape[2]}, headdim) matching the caches")
        if max(lengths) + new > cache.capacity:
            _fail(_FN, "cache_seqlens", lengths,
                  f"lengths + seqlen_new ({new}) <= the cache capacity ({cache.capacity}) so the new keys fit")
    cache.check_pages([cache.capacity] * batch if lengths is None else [n + new for n in lengths])
    local = causal or window != (-1, -1)
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, q.shape[3], cache.capacity, lengths, q.shape[1], local)
    queries = q
    if k is not None:
        rotated_q = []
        for b, start in enumerate(lengths):
            k_b = k[b]
            if rotary:
                pos = torch.arange(start, start + new, device=q.device)
                k_b = _rotate(k_b, rotary_cos[pos], rotary_sin[pos], rotary_interleaved)
                q_pos = (torch.arange(start, start + q.shape[1], device=q.device)
                         if local else torch.full((q.shape[1],), start, device=q.device))
                rotated_q.append(_rotate(q[b], rotary_cos[q_pos], rotary_sin[q_pos], rotary_interleaved))
            cache.write(b, start, k_b, v[b])
        lengths = [n + new for n in lengths]
        if rotary:
            queries = torch.stack(rotated_q)
    kwargs = dict(layout="BSND", scale=softmax_scale, causal=causal, window=window, softcap=float(softcap),
                  return_lse=True)
    simple = cache.pages is None and cache.rows == list(range(batch))
    if simple and (lengths is None or len(set(lengths)) == 1):
        used = cache.capacity if lengths is None else lengths[0]
        out, lse = flash_attention(queries, k_cache[:, :used], v_cache[:, :used], alibi_slopes=alibi_slopes, **kwargs)
    else:
        # Each sequence has its own cache length (so its own bottom-right corner) or its own cache rows.
        outs, lses = [], []
        for b in range(batch):
            used = cache.capacity if lengths is None else lengths[b]
            if used == 0:  # an empty cache: no key to see, like a fully masked row
                outs.append(q.new_zeros((1, q.shape[1], q.shape[2], v_cache.shape[3])))
                lses.append(torch.full((1, q.shape[2], q.shape[1]), float("-inf"), device=q.device,
                                       dtype=torch.float64 if q.dtype == torch.float64 else torch.float32))
                continue
            keys, values = cache.keys(b, used)
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            o, l = flash_attention(queries[b:b + 1], keys, values, alibi_slopes=slopes, **kwargs)
            outs.append(o)
            lses.append(l)
        out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_softmax_lse else out
