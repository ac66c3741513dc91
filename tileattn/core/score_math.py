"""Arithmetic of the score pipeline shared by the exact reference (through the modifiers' hooks)
and the PyTorch-ops engine (which applies the lowered kernel arguments with these functions): tile
states, diagonal offsets, blocks of score-shaped tensors, ALiBi terms, mask tile classification and
the counter-based dropout hash that every engine reproduces bit for bit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Dict

import torch


class TileState(enum.IntEnum):
    """What a masking modifier (or all of them together) does to a (query block, key block) tile."""

    EMPTY = 0  # every pair hidden: the tile is skipped
    PARTIAL = 1  # some pairs hidden: the tile is computed and masked
    FULL = 2  # every pair visible: the tile is computed without masking


def combine(*states: TileState) -> TileState:
    """The state of a tile under several masks: hidden if any hides it, full only if all keep it."""
    return TileState(min(states))


def diagonal_offset(align, q_len: int, k_len: int) -> int:
    """``off``: query row ``i`` of a sequence is aligned with key column ``i + off``."""
    if align == "bottom_right":
        return k_len - q_len
    if align == "top_left":
        return 0
    return int(align)


def to_4d(t: torch.Tensor) -> torch.Tensor:
    """A tensor broadcastable to (B, H, Sq, Sk) as a 4-d view, size-1 dims where it broadcasts."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def reduce_to_shape(full: torch.Tensor, shape) -> torch.Tensor:
    """Sum a gradient over the dimensions a broadcast tensor of ``shape`` was repeated along."""
    shape4 = (1,) * (full.dim() - len(shape)) + tuple(shape)
    dims = [i for i, (n, f) in enumerate(zip(shape4, full.shape)) if n == 1 and f != 1]
    if dims:
        full = full.sum(dim=dims, keepdim=True)
    return full.reshape(shape)


def broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


@dataclass(frozen=True)
class ScoreBlock:
    """Scores of query rows ``i0:i1`` against keys ``j0:j1`` of one sequence (batch item ``batch``),
    for the query heads ``heads`` (a slice of Hq), whose row ``i`` is aligned with key ``i + offset``.
    Score tensors handed to the hooks are (heads, rows, cols), or broadcastable to it."""

    batch: int
    heads: slice
    i0: int
    i1: int
    j0: int
    j1: int
    offset: int
    dtype: torch.dtype
    device: torch.device

    @cached_property
    def rows(self) -> torch.Tensor:
        return torch.arange(self.i0, self.i1, device=self.device)

    @cached_property
    def cols(self) -> torch.Tensor:
        return torch.arange(self.j0, self.j1, device=self.device)

    def head_indices(self, heads_q: int) -> torch.Tensor:
        return torch.arange(heads_q, device=self.device)[self.heads]


def _slice_or_broadcast(size: int, start: int, stop: int) -> slice:
    return slice(None) if size == 1 else slice(start, stop)


def score_block(t4: torch.Tensor, b: int, heads: slice, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """Rows i0:i1, cols j0:j1 of batch item b, query heads ``heads`` of a 4-d score-shaped tensor
    (a bias or a mask, size-1 dims where it broadcasts), broadcast dims kept at 1."""
    t = t4[b if t4.shape[0] > 1 else 0]
    t = t[heads] if t.shape[0] > 1 else t
    return t[:, _slice_or_broadcast(t.shape[1], i0, i1), _slice_or_broadcast(t.shape[2], j0, j1)]


def alibi_scores(slopes: torch.Tensor, b: int, heads: slice, rows: torch.Tensor, cols: torch.Tensor, offset: int,
                 dtype) -> torch.Tensor:
    """``-slope[h] * |i + off - j|`` for query heads ``heads``: (nheads, len(rows), len(cols))."""
    per_head = (slopes if slopes.dim() == 1 else slopes[b])[heads].to(dtype)
    distance = (rows[:, None] + offset - cols[None, :]).abs().to(dtype)
    return -per_head[:, None, None] * distance


def mask_tile_states(mask4: torch.Tensor, b: int, heads: slice, q_len: int, k_len: int, block_m: int,
                     block_n: int) -> torch.Tensor:
    """uint8 (ceil(q_len/block_m), ceil(k_len/block_n)) of :class:`TileState` for batch item ``b``
    and every query head of ``heads`` together (EMPTY only if the mask hides the tile from all of
    them, FULL only if it keeps it whole for all). Two reductions over the mask, once per call:
    per-tile checks would cost two reductions per tile."""
    key = (b, heads.start, heads.stop, q_len, k_len, block_m, block_n)
    # Inference tensors have no version counter (so no safe cache key), and no backward reuses
    # their states: they are classified afresh.
    cache = {} if mask4.is_inference() else _TILE_STATE_CACHE.setdefault(_tensor_key(mask4), {})
    if key not in cache:
        m = score_block(mask4, b, heads, 0, q_len, 0, k_len).expand(-1, q_len, k_len)
        rows, cols = -(-q_len // block_m), -(-k_len // block_n)
        pad = (0, cols * block_n - k_len, 0, rows * block_m - q_len)
        # max/min of the bytes are any/all, and much faster than bool any/all on this layout.
        tiles = m.view(torch.uint8)
        any_kept = torch.nn.functional.pad(tiles, pad, value=0)
        all_kept = torch.nn.functional.pad(tiles, pad, value=1)
        shape = (m.shape[0], rows, block_m, cols, block_n)
        any_kept = any_kept.reshape(shape).amax((0, 2, 4))
        all_kept = all_kept.reshape(shape).amin((0, 2, 4))
        cache[key] = any_kept + all_kept  # 0 = EMPTY, 1 = PARTIAL, 2 = FULL
    return cache[key]


#: Tile states of masks, by (data pointer, version, shape, strides) of the mask tensor: computed once
#: per call and reused by the backward pass. Bounded: masks change rarely within a training loop.
#: Holds the states only, never the mask.
_TILE_STATE_CACHE: Dict[tuple, dict] = {}
_TILE_STATE_CACHE_LIMIT = 8


def _tensor_key(t: torch.Tensor) -> tuple:
    key = (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.device.type)
    if key not in _TILE_STATE_CACHE and len(_TILE_STATE_CACHE) >= _TILE_STATE_CACHE_LIMIT:
        _TILE_STATE_CACHE.pop(next(iter(_TILE_STATE_CACHE)))
    return key


_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a product of two 32-bit values fits in int64 without overflow
# and equals the uint32 product modulo 2**32 (what the Triton and C kernels compute).
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_GOLDEN = 0x1E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


def dropout_threshold(p: float) -> int:
    """A weight survives when the top 24 bits of its hash are >= this."""
    return int(round(p * (1 << 24)))


def dropout_row_keys(seed: int, batch: int, heads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per (head, row) 32-bit keys, shape (len(heads), len(rows)), int64 holding uint32 values."""
    dev = rows.device
    k = _mix32(torch.tensor([seed & _M32], dtype=torch.int64, device=dev) ^ _GOLDEN)
    k = _mix32(k ^ ((seed >> 32) & _M32))
    k = _mix32(k ^ (batch & _M32))
    kh = _mix32(k ^ heads.to(torch.int64))
    return _mix32(kh[:, None] ^ rows.to(torch.int64)[None, :])


def dropout_keep(seed: int, p: float, batch: int, heads: torch.Tensor, rows: torch.Tensor,
                 cols: torch.Tensor) -> torch.Tensor:
    """Bool (len(heads), len(rows), len(cols)): True where the weight survives dropout."""
    keys = dropout_row_keys(seed, batch, heads, rows)
    x = _mix32(keys[..., None] ^ ((cols.to(torch.int64) * _GOLDEN) & _M32))
    return (x >> 8) >= dropout_threshold(p)


def accumulate_broadcast(grad4: torch.Tensor, ds: torch.Tensor, block: ScoreBlock):
    """Add dS (heads, rows, cols) of a block into a (B?, H?, Sq?, Sk?) gradient, summing over the
    dimensions where it broadcasts."""
    target = grad4[block.batch if grad4.shape[0] > 1 else 0]
    target = target[block.heads] if target.shape[0] > 1 else target
    t = ds
    for dim in range(3):
        if target.shape[dim] == 1 and t.shape[dim] != 1:
            t = t.sum(dim, keepdim=True)
    rows = _slice_or_broadcast(target.shape[1], block.i0, block.i1)
    cols = _slice_or_broadcast(target.shape[2], block.j0, block.j1)
    target[:, rows, cols] += t.to(target.dtype)
