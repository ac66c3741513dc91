"""``flex_attention`` on CPU: forward and backward, tile by tile over a block mask's :class:`BlockMap`.

Two paths, both walking the map one row of query blocks at a time (only the key blocks some sequence
or head of that row sees are read; EMPTY blocks are skipped, FULL blocks carry no mask, PARTIAL
blocks take their packed bits):

* **mask only** (no ``score_mod``, no max scores asked): each row of blocks is one
  :func:`tileattn.flash_attention` call over the span of its visible keys, with a bool mask of the
  span made for the call from the row's bits (none when every key of the span is visible). The
  native kernels run it, forward and backward, with their own autograd (and skip the tiles of the
  span the mask hides entirely); so does the PyTorch-ops engine without a compiler.
* **score_mod**: the row's scores are computed key-major (the compiled programs' layout), modified by
  the compiled ``score_mod`` (:func:`tileattn.flex.compiler.score_program`; its C derivative gives
  the backward and the gradients of the tensors it captures), masked, and soft-maxed in PyTorch. A
  ``score_mod`` the compiler refuses runs through ``torch.vmap`` on the same tiles (its reason in
  :func:`explain`). With gradients each row is checkpointed (recomputed in the backward), so memory
  stays one row of blocks, never (q_len x kv_len).

The row layouts (visible keys, the mask of the row) are derived once per map and cached beside it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import AuxOutput
from torch.utils.checkpoint import checkpoint

from . import compiler
from .blocks import EMPTY, FULL, PARTIAL, BlockMap, classify
from .semantics import score_tile, validate, working_dtype
from .trace import INDEX_DTYPE, Unsupported

#: PyTorch's own flex_attention, kept before any :func:`tileattn.patch_flex` replaces it (GPU calls)
TORCH_FLEX_ATTENTION = torch_flex.flex_attention
#: rows per block when the call has no block mask
ROWS_WITHOUT_MASK = 128
_COMPILED_TORCH_FLEX = []
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BlockMap -> tuple of Row
#: exponent below which exp() is subnormal, per working precision
_SUBNORMAL_EXP = {torch.float32: -87.0, torch.float64: -708.0}


@dataclass(frozen=True, eq=False)
class Keys:
    """A set of key positions: a slice when they are contiguous, else their index."""

    keys: Optional[slice]
    index: Optional[torch.Tensor]    #: int64 positions when not contiguous

    @property
    def kv_idx(self) -> torch.Tensor:
        """int32 positions (what score_mod sees)."""
        if self.keys is not None:
            return torch.arange(self.keys.start, self.keys.stop, dtype=INDEX_DTYPE)
        return self.index.to(INDEX_DTYPE)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """These keys of ``t`` (..., kv_len, E)."""
        return t[..., self.keys, :] if self.keys is not None else t.index_select(-2, self.index)


@dataclass(frozen=True, eq=False)
class Row:
    """One row of query blocks: its query range, the keys of its blocks FULL for every sequence and head
    (no mask), and the keys of its other visible blocks with their mask."""

    q0: int
    q1: int
    full: Optional[Keys]
    masked: Optional[Keys]
    mask: Optional[torch.Tensor]     #: bool (Bs, Hs, q1 - q0, masked keys), True = visible

    @property
    def parts(self) -> tuple:
        """((keys, mask or None), ...): the masked part first."""
        return tuple(p for p in ((self.masked, self.mask), (self.full, None)) if p[0] is not None)


def _keys(cols: torch.Tensor, block: int, length: int):
    """:class:`Keys` of the key blocks ``cols`` (ascending), cut at ``length``; None when empty."""
    if not len(cols):
        return None, None
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    positions = (cols[:, None] * block + torch.arange(block)).flatten()
    in_range = positions < length
    if c1 - c0 == len(cols):
        keys = slice(c0 * block, min(length, c1 * block))
        return Keys(keys, None), in_range
    return Keys(None, positions[in_range]), in_range


def _unpack(bits: torch.Tensor, block_q: int) -> torch.Tensor:
    """(n, block_kv, ceil(block_q / 8)) packed bits -> bool (n, block_kv, block_q), key-major."""
    unpacked = (bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return unpacked.flatten(-2)[..., :block_q].bool()


def _rows(block_map: BlockMap) -> tuple:
    """The :class:`Row` layouts of a map (cached for as long as the map lives). The masks cover only
    the blocks that are not FULL everywhere: O(partial blocks x block_q x block_kv) bytes."""
    found = _LAYOUTS.get(block_map)
    if found is not None:
        return found
    bq, bk, q_len, kv_len = block_map.block_q, block_map.block_kv, block_map.q_len, block_map.kv_len
    states, partial = block_map.states, block_map.partial
    rows = []
    for r in range(states.shape[2]):
        q0, q1 = r * bq, min(q_len, (r + 1) * bq)
        row_states = states[:, :, r]                                      # (Bs, Hs, cols)
        seen = (row_states != EMPTY).flatten(0, 1).any(0)
        full_everywhere = (row_states == FULL).flatten(0, 1).all(0)
        full, _ = _keys(full_everywhere.nonzero().flatten(), bk, kv_len)
        cols = (seen & ~full_everywhere).nonzero().flatten()
        masked, in_range = _keys(cols, bk, kv_len)
        mask = None
        if masked is not None:
            chosen = row_states[:, :, cols]
            tiles = torch.zeros(*chosen.shape, bk, bq, dtype=torch.bool)   # (Bs, Hs, n, bk, bq), key-major
            tiles[chosen == FULL] = True
            where = chosen == PARTIAL
            if bool(where.any()):
                tiles[where] = _unpack(block_map.bits[partial[:, :, r][:, :, cols][where].long()], bq)
            tiles = tiles.flatten(2, 3)[:, :, in_range, :q1 - q0]
            mask = tiles.transpose(-1, -2).contiguous()                    # (Bs, Hs, rows, keys)
        if full is not None or masked is not None:
            rows.append(Row(q0, q1, full, masked, mask))
    found = _LAYOUTS[block_map] = tuple(rows)
    return found


def _unmasked_rows(q_len: int, kv_len: int) -> tuple:
    """Rows of a call without a block mask (made per call: a few objects, and no cache that grows with
    every length a decode loop passes through)."""
    if kv_len == 0:
        return ()
    every = Keys(slice(0, kv_len), None)
    return tuple(Row(q0, min(q_len, q0 + ROWS_WITHOUT_MASK), every, None, None)
                 for q0 in range(0, q_len, ROWS_WITHOUT_MASK))


# ---------------------------------------------------------------------------------------------
# The compiled score_mod as an autograd function over key-major tiles.


class _CompiledScore(torch.autograd.Function):
    """``score_mod`` on scores (B, H, keys, rows), key-major, by the compiled program; its backward is
    the program's derivative (grad of the raw scores and of each captured float tensor)."""

    @staticmethod
    def forward(ctx, scores, program, kv_idx, q_idx, *captures):
        out = scores.contiguous().clone()
        _run(program, "ta_flex_score_fwd", out, None, kv_idx, q_idx, captures, None)
        ctx.program, ctx.kv_idx, ctx.q_idx = program, kv_idx, q_idx
        ctx.save_for_backward(scores, *captures)
        return out

    @staticmethod
    def backward(ctx, grad):
        scores, *captures = ctx.saved_tensors
        wanted = ctx.needs_input_grad[4:]
        grads = [torch.zeros(t.shape, dtype=torch.float64) if need else None for t, need in zip(captures, wanted)]
        ds = grad.contiguous().clone()
        _run(ctx.program, "ta_flex_score_bwd", scores.contiguous(), ds, ctx.kv_idx, ctx.q_idx, captures, grads)
        capture_grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, captures)]
        return (ds, None, None, None, *capture_grads)


def _run(program, name, scores, ds, kv_idx, q_idx, captures, grads):
    """Call a tile function once per (batch, head) tile of key-major ``scores`` (B, H, keys, rows)."""
    import ctypes

    batch, heads, cols, rows = scores.shape
    pointers, sizes, kept = program.pack(captures)
    fn = getattr(program.library, name)
    tail = ()
    if grads is not None:
        tail = ((ctypes.c_void_p * max(1, len(grads)))(*[None if g is None else g.data_ptr() for g in grads]),)
    q_idx = q_idx.contiguous()
    per_tile = cols * rows * scores.element_size()
    for b in range(batch):
        b_idx = torch.full((rows,), b, dtype=INDEX_DTYPE)
        for h in range(heads):
            h_idx = torch.full((rows,), h, dtype=INDEX_DTYPE)
            offset = (b * heads + h) * per_tile
            tiles = (scores.data_ptr() + offset,) + (() if ds is None else (ds.data_ptr() + offset,))
            code = fn(rows, cols, rows, *tiles, b_idx.data_ptr(), h_idx.data_ptr(), q_idx.data_ptr(),
                      kv_idx.data_ptr(), pointers, sizes, *tail)
            if code:
                program._raise(code, kept)


# ---------------------------------------------------------------------------------------------
# The score_mod path: one row of blocks.


@dataclass(frozen=True)
class _Scored:
    """How a score_mod runs: compiled (program, captures) or through torch.vmap (reason)."""

    fn: object
    program: object
    captures: tuple
    reason: str


def _score_plan(score_mod, dtype) -> _Scored:
    try:
        program, captures = compiler.score_program(score_mod, working_dtype(dtype))
        return _Scored(score_mod, program, captures, "compiled")
    except Unsupported as exc:
        return _Scored(score_mod, None, (), f"torch.vmap: {exc.reason}")


def _row_attention(row: Row, scored: Optional[_Scored], scale: float, want_max: bool, q, k, v):
    """(out, lse, max) of one row of query blocks: q (B, Hq, rows, E); k, v (B, Hq, kv_len, E)."""
    wp = working_dtype(q.dtype)
    q_blk = q[:, :, row.q0:row.q1].to(wp)
    parts = [keys for keys, _ in row.parts]
    k_blk = torch.cat([keys.take(k) for keys in parts], dim=-2) if len(parts) > 1 else parts[0].take(k)
    v_blk = torch.cat([keys.take(v) for keys in parts], dim=-2) if len(parts) > 1 else parts[0].take(v)
    kv_idx = torch.cat([keys.kv_idx for keys in parts]) if len(parts) > 1 else parts[0].kv_idx
    scores = k_blk.to(wp) @ (q_blk * scale).transpose(-1, -2)             # (B, H, keys, rows), key-major
    q_idx = torch.arange(row.q0, row.q1, dtype=INDEX_DTYPE)
    if scored is not None and scored.program is not None and not torch.is_grad_enabled():
        _run(scored.program, "ta_flex_score_fwd", scores, None, kv_idx, q_idx, scored.captures, None)  # ours
    elif scored is not None and scored.program is not None:
        scores = _CompiledScore.apply(scores, scored.program, kv_idx, q_idx, *scored.captures)
    elif scored is not None:
        batch, heads, cols, rows = scores.shape
        b = torch.arange(batch, dtype=INDEX_DTYPE).view(-1, 1, 1).expand(batch, heads, rows).reshape(-1)
        h = torch.arange(heads, dtype=INDEX_DTYPE).view(1, -1, 1).expand(batch, heads, rows).reshape(-1)
        flat = scores.transpose(-1, -2).reshape(-1, cols)
        modified = score_tile(scored.fn, flat, b, h, q_idx.repeat(batch * heads), kv_idx)
        scores = modified.reshape(batch, heads, rows, cols).transpose(-1, -2)
    if row.mask is not None:  # the masked keys come first; a compiled score_mod's output is ours to write
        hidden = ~row.mask.transpose(-1, -2)
        scores = scores if scored is not None and scored.program is not None else scores.clone()
        scores[:, :, :hidden.shape[-2]].masked_fill_(hidden, -math.inf)
    peak = scores.detach().amax(dim=-2, keepdim=True)
    empty = peak == -math.inf
    peak = torch.where(empty, 0.0, peak)
    shifted = scores - peak
    # exp of what would be subnormal is 0 here: it is below the row's largest term by more than the
    # precision can tell, and subnormal exp runs tens of times slower on x86
    weights = torch.exp(shifted.masked_fill_(shifted < _SUBNORMAL_EXP[wp], -math.inf))
    total = torch.where(empty, 1.0, weights.sum(dim=-2, keepdim=True))
    lse = peak + torch.log(total)
    out = ((weights.transpose(-1, -2) @ v_blk.to(wp)) / total.transpose(-1, -2)).to(q.dtype)
    lse = torch.where(empty, -math.inf, lse).squeeze(-2)
    top = torch.where(empty, -math.inf, peak).squeeze(-2) if want_max else None
    return out, lse, top


# ---------------------------------------------------------------------------------------------
# The public function.


def _torch_flex_on_device(*args, **kwargs):
    """GPU and other devices: PyTorch's compiled FlexAttention (compiled once per process)."""
    if not _COMPILED_TORCH_FLEX:
        _COMPILED_TORCH_FLEX.append(torch.compile(TORCH_FLEX_ATTENTION))
    return _COMPILED_TORCH_FLEX[0](*args, **kwargs)


def _block_map(call):
    if call.block_mask is None:
        return None
    return classify(call.block_mask, call.batch, call.heads_q)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """:func:`torch.nn.attention.flex_attention.flex_attention`, forward and backward, on CPU.

    Same signature, returns and semantics (see :mod:`tileattn.flex`): ``score_mod(score, b, h, q_idx,
    kv_idx)`` then the block mask (PyTorch's ``BlockMask`` from ``create_block_mask``, ``and_masks`` /
    ``or_masks``, ``BlockMask.from_kv_blocks``, or :func:`tileattn.flex.create_block_mask`), then the
    softmax; natural-log LSE with ``return_lse`` or ``return_aux=AuxRequest(lse=True)`` (and
    ``max_scores``); rows that see nothing give 0 and LSE -inf. Gradients reach q, k, v and every
    floating tensor ``score_mod`` captures. Tensors on another device go to PyTorch's compiled
    FlexAttention. :func:`explain` says which path a call takes and why.
    """
    if isinstance(query, torch.Tensor) and query.device.type != "cpu":
        return _torch_flex_on_device(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                     enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
                                     return_aux=return_aux)
    call = validate(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux)
    block_map = _block_map(call)
    scored = _score_plan(score_mod, query.dtype) if score_mod is not None else None
    if scored is not None and scored.program is not None and scored.program.generated.identity:
        scored = None  # transformers passes a score_mod that changes nothing
    if scored is None and not call.want_max:
        out, lse = _mask_only(call, block_map, query, key, value)
        top = None
    else:
        out, lse, top = _scored(call, block_map, scored, query, key, value)
    if call.aux:
        return out, AuxOutput(lse=lse if call.want_lse else None, max_scores=top)
    return (out, lse) if call.want_lse else out


def _expand_kv(call, t):
    """k or v (B or 1, Hkv, S, E) -> (B, Hkv, S, E) (a view)."""
    return t.expand(call.batch, -1, -1, -1)


def _span(row: Row):
    """(keys, mask): the row's visible keys as one contiguous slice, with a bool mask of the span built
    now from the row's parts (None when every key of the span is visible). O(rows x span) bytes, for
    this call only; the native kernels skip the span's tiles the mask hides entirely."""
    parts = row.parts
    starts = [keys.keys.start if keys.keys is not None else int(keys.index[0]) for keys, _ in parts]
    stops = [keys.keys.stop if keys.keys is not None else int(keys.index[-1]) + 1 for keys, _ in parts]
    lo, hi = min(starts), max(stops)
    if len(parts) == 1 and parts[0][1] is None and parts[0][0].keys is not None:
        return slice(lo, hi), None
    heads = row.mask.shape[:2] if row.mask is not None else (1, 1)
    mask = torch.zeros(*heads, row.q1 - row.q0, hi - lo, dtype=torch.bool)
    for keys, part_mask in parts:
        where = slice(keys.keys.start - lo, keys.keys.stop - lo) if keys.keys is not None else keys.index - lo
        mask[..., where] = True if part_mask is None else part_mask
    return slice(lo, hi), mask


def _mask_only(call, block_map, q, k, v):
    """One tileattn.flash_attention call per row of blocks, over the span of its visible keys."""
    from ..core.api import flash_attention

    k, v = _expand_kv(call, k), _expand_kv(call, v)
    if block_map is None:
        if call.kv_len == 0:
            return _finish(call, q, v, [], [], 0)
        return flash_attention(q, k, v, scale=call.scale, return_lse=True)
    outs, lses, filled = [], [], 0
    for row in _rows(block_map):
        if row.q0 > filled:
            _fill(call, q, v, outs, lses, [], filled, row.q0)
        keys, mask = _span(row)
        out, lse = flash_attention(q[:, :, row.q0:row.q1], k[:, :, keys], v[:, :, keys], scale=call.scale, mask=mask,
                                   return_lse=True)
        outs.append(out)
        lses.append(lse)
        filled = row.q1
    return _finish(call, q, v, outs, lses, filled)


def _finish(call, q, v, outs, lses, filled):
    if filled < call.q_len:
        _fill(call, q, v, outs, lses, [], filled, call.q_len)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _scored(call, block_map, scored, q, k, v):
    group = call.heads_q // call.heads_kv
    k, v = _expand_kv(call, k), _expand_kv(call, v)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    rows = _unmasked_rows(call.q_len, call.kv_len) if block_map is None else _rows(block_map)
    grad = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or
                                        (scored is not None and any(t.requires_grad for t in scored.captures)))
    outs, lses, tops, filled = [], [], [], 0
    for row in rows:
        if row.q0 > filled:
            _fill(call, q, v, outs, lses, tops, filled, row.q0)
        args = (row, scored, call.scale, call.want_max, q, k, v)
        if grad:
            out, lse, top = checkpoint(_row_attention, *args, use_reentrant=False)
        else:
            out, lse, top = _row_attention(*args)
        outs.append(out)
        lses.append(lse)
        tops.append(top)
        filled = row.q1
    if filled < call.q_len:
        _fill(call, q, v, outs, lses, tops, filled, call.q_len)
    top = torch.cat(tops, dim=2) if call.want_max else None
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), top


def _fill(call, q, v, outs, lses, tops, start, stop):
    """Rows start..stop see no key: output 0, LSE and max -inf."""
    outs.append(q.new_zeros(call.batch, call.heads_q, stop - start, v.shape[-1]))
    empty = torch.full((call.batch, call.heads_q, stop - start), -math.inf, dtype=working_dtype(q.dtype))
    lses.append(empty)
    tops.append(empty if call.want_max else None)


def explain(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
            kernel_options=None, *, return_aux=None) -> dict:
    """How :func:`flex_attention` would run this call: {"path", "score_mod", "mask_mod", "blocks"}."""
    if isinstance(query, torch.Tensor) and query.device.type != "cpu":
        return {"path": f"PyTorch's compiled FlexAttention (tensors on {query.device})"}
    call = validate(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux)
    block_map = _block_map(call)
    found = {"blocks": None if block_map is None else block_map.counts(),
             "mask_mod": "no block mask" if block_map is None else block_map.how}
    scored = _score_plan(score_mod, query.dtype) if score_mod is not None else None
    found["score_mod"] = "none" if scored is None else scored.reason
    if scored is not None and scored.program is not None and scored.program.generated.identity:
        scored, found["score_mod"] = None, "compiled: returns its score unchanged (skipped)"
    if scored is None and not call.want_max:
        found["path"] = "mask only: tileattn.flash_attention per row of blocks (native kernels when built)"
    else:
        found["path"] = "score_mod: PyTorch tiles per row of blocks"
    return found
