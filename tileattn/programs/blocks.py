"""Block maps: which (query block, key block) tiles of a call a block mask hides, shows, or leaves to
its ``mask_mod``.

:func:`states_of` reads a PyTorch ``BlockMask`` (from ``create_block_mask``, ``and_masks``/
``or_masks``, ``BlockMask.from_kv_blocks``, or this module's :func:`create_block_mask`) as a dense
:class:`BlockStates`: uint8 ``(B|1, H|1, rows, cols)``, one state per block of ``BLOCK_SIZE`` =
(block_q, block_kv): HIDDEN (not listed: the kernels never visit it), PARTIAL (in ``kv_indices``:
``mask_mod`` decides element by element) or VISIBLE (in ``full_kv_indices``: no mask). That is
compiled FlexAttention's rule and the documented meaning of a block mask; PyTorch's eager path
ignores the lists and applies ``mask_mod`` everywhere, which agrees whenever the lists come from
``create_block_mask`` on the same ``mask_mod``. Reading the lists costs O(blocks) and nothing is
evaluated: the kernels call ``mask_mod`` on partial blocks themselves. The map is cached on the
BlockMask, guarded by the identity and version of its lists.

:func:`create_block_mask` builds a PyTorch ``BlockMask`` as ``torch.nn.attention.flex_attention
.create_block_mask`` does (it evaluates ``mask_mod`` everywhere, so a listed block is partial only
where it is), without materialising the (B, H, Q, KV) mask: a row of blocks at a time, compiled
(:mod:`.compiler`) when the function compiles, else through ``torch.vmap``.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from . import compiler, eager
from .trace import INDEX_DTYPE, Unsupported

HIDDEN, PARTIAL, VISIBLE = 0, 1, 2
#: elements of mask evaluated per step of create_block_mask (bounds its temporary memory)
CHUNK_ELEMENTS = 1 << 22
_CACHE_ATTR = "_tileattn_block_states"
#: block maps of capture-free compiled mask_mods, by (program, scalars, sizes); the most recent kept
FUNCTION_MAPS_KEPT = 64
_FUNCTION_MAPS: "OrderedDict" = OrderedDict()


@dataclass(frozen=True, eq=False)
class BlockStates:
    """A dense block map (see the module docstring); positions outside ``q_len`` x ``kv_len`` are hidden."""

    states: torch.Tensor    #: uint8 (Bs, Hs, rows, cols), contiguous
    block_q: int
    block_kv: int
    q_len: int
    kv_len: int
    #: (left, right) when the mask is exactly a band over this grid: position p sees keys
    #: [p - left, p + right] (None: unbounded); None otherwise or when unknown
    band: object = None

    def counts(self) -> dict:
        return {name: int((self.states == value).sum()) for name, value in
                (("hidden", HIDDEN), ("partial", PARTIAL), ("visible", VISIBLE))}

    def per_element(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, b, h) -> torch.Tensor:
        """uint8 states of the pairs (q_idx[..., i], kv_idx[..., j]) of sequence(s) ``b`` and query
        head(s) ``h`` (index tensors broadcastable against each other): out of range is HIDDEN."""
        bs, hs, rows, cols = self.states.shape
        qi, ki = q_idx.long(), kv_idx.long()
        inside = (qi >= 0) & (qi < self.q_len) & (ki >= 0) & (ki < self.kv_len)
        b = torch.as_tensor(b) if bs > 1 else torch.zeros((), dtype=torch.long)
        h = torch.as_tensor(h) if hs > 1 else torch.zeros((), dtype=torch.long)
        state = self.states[b, h, (qi // self.block_q).clamp(0, rows - 1), (ki // self.block_kv).clamp(0, cols - 1)]
        return torch.where(inside, state, HIDDEN)


def block_grid(block_mask) -> tuple:
    """(query-block rows, key-block columns) of a BlockMask's sequence lengths."""
    q_len, kv_len = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    return -(-q_len // bq), -(-kv_len // bk)


def listed_blocks(num, indices, rows, cols):
    """Bool (B, H, rows, cols): the blocks a (num_blocks, indices) pair lists."""
    indices = indices[..., :rows, :].long()
    valid = torch.arange(indices.shape[-1], device=indices.device) < num[..., :rows, None]
    dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, torch.where(valid, indices, cols), True)
    return dense[..., :cols]


def _watched(block_mask):
    return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices)


def _guard(block_mask):
    return (tuple(block_mask.seq_lengths), tuple(block_mask.BLOCK_SIZE),
            tuple(None if t is None else (weakref.ref(t), t._version) for t in _watched(block_mask)))


def _guard_holds(guard, block_mask) -> bool:
    lengths, block_size, entries = guard
    return (lengths == tuple(block_mask.seq_lengths) and block_size == tuple(block_mask.BLOCK_SIZE)
            and all((e is None and t is None) or (e is not None and t is not None and e[0]() is t and e[1] == t._version)
                    for e, t in zip(entries, _watched(block_mask))))


def states_of(block_mask) -> BlockStates:
    """The :class:`BlockStates` of a (CPU) BlockMask's block lists (its sizes already checked)."""
    cached = block_mask.__dict__.get(_CACHE_ATTR)
    if cached is not None and _guard_holds(cached[0], block_mask):
        return cached[1]
    q_len, kv_len = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    rows, cols = block_grid(block_mask)
    num = block_mask.kv_num_blocks
    states = torch.zeros(*num.shape[:2], rows, cols, dtype=torch.uint8)
    states[listed_blocks(num, block_mask.kv_indices, rows, cols)] = PARTIAL
    if block_mask.full_kv_num_blocks is not None:
        states[listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols)] = VISIBLE
    found = BlockStates(states=states, block_q=bq, block_kv=bk, q_len=q_len, kv_len=kv_len)
    block_mask.__dict__[_CACHE_ATTR] = (_guard(block_mask), found)
    return found


def _extent(n_blocks, block, length):
    """In-range size of each block along one axis (int64)."""
    start = torch.arange(n_blocks) * block
    return (length - start).clamp(max=block)


def _clamped(start, count, length):
    return torch.arange(start, start + count, dtype=INDEX_DTYPE).clamp(max=max(length - 1, 0))


def _lists(states, value):
    chosen = (states == value).to(torch.int32)
    return (chosen.sum(-1, dtype=torch.int32),
            torch.argsort(chosen, dim=-1, descending=True, stable=True).to(torch.int32))


def _compiled_evaluator(bound):
    """A function (b, h, q rows, kv columns) -> uint8 (len(q), len(kv)) running a compiled mask."""
    def evaluate(b, h, q, kv):
        out = torch.empty(q.numel(), kv.numel(), dtype=torch.uint8)
        rows = [torch.full((q.numel(),), x, dtype=INDEX_DTYPE) for x in (b, h)]
        bound.mask_rows(out, rows[0], rows[1], q, kv)
        return out
    return evaluate


def _evaluator(mask_mod, compiled: bool):
    """The mask as such a function: compiled when it compiles (and ``compiled``), else torch.vmap."""
    if compiled:
        try:
            return _compiled_evaluator(compiler.mask_program(mask_mod))
        except Unsupported:
            pass

    def evaluate_eager(b, h, q, kv):
        rows = [torch.full((q.numel(),), x, dtype=INDEX_DTYPE) for x in (b, h)]
        return eager.mask_tile(mask_mod, rows[0], rows[1], q, kv).to(torch.uint8)
    return evaluate_eager


def _classify(evaluate, batch, heads, q_len, kv_len, block_q, block_kv, rows_out=None) -> torch.Tensor:
    """uint8 (batch, heads, rows, cols) states of a mask evaluated a row of blocks at a time. With
    ``rows_out`` (batch and heads 1), each query position's (first visible key, last, count) is
    appended to it, for :func:`_band_of`."""
    rows, cols = -(-q_len // block_q), -(-kv_len // block_kv)
    states = torch.empty(batch, heads, rows, cols, dtype=torch.uint8)
    kv = _clamped(0, cols * block_kv, kv_len)
    extent_k = _extent(cols, block_kv, kv_len)
    step = max(1, CHUNK_ELEMENTS // (block_q * cols * block_kv))
    for b in range(batch):
        for h in range(heads):
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                tile = evaluate(b, h, _clamped(r0 * block_q, (r1 - r0) * block_q, q_len), kv)
                tile[:, kv_len:] = 0
                tile[max(0, q_len - r0 * block_q):] = 0
                count = tile.view(r1 - r0, block_q, cols, block_kv).sum((1, 3), dtype=torch.int64)
                full = _extent(rows, block_q, q_len)[r0:r1, None] * extent_k[None, :]
                states[b, h, r0:r1] = torch.where(count == 0, HIDDEN,
                                                  torch.where(count == full, VISIBLE, PARTIAL)).to(torch.uint8)
                if rows_out is not None:
                    seen = tile[:min(q_len, r1 * block_q) - r0 * block_q, :kv_len].bool()
                    first = seen.int().argmax(1)
                    last = kv_len - 1 - seen.flip(1).int().argmax(1)
                    rows_out.append(torch.stack([first, last, seen.sum(1)], 1))
    return states


def _band_of(rows: torch.Tensor, kv_len: int):
    """(left, right) when every query position p of ``rows`` ((first, last, count) per position)
    sees exactly the keys [p - left, p + right] cut to [0, kv_len) (None: an unbounded side), else
    None: then the mask, on this grid, is that band and nothing else."""
    first, last, count = rows[:, 0], rows[:, 1], rows[:, 2]
    p = torch.arange(len(rows))
    seen = count > 0
    if bool((seen & (count != last - first + 1)).any()):
        return None  # a row with a hole
    lefts, rights = (p - first)[seen & (first > 0)], (last - p)[seen & (last < kv_len - 1)]
    if (len(lefts) and bool((lefts != lefts[0]).any())) or (len(rights) and bool((rights != rights[0]).any())):
        return None
    left = int(lefts[0]) if len(lefts) else None
    right = int(rights[0]) if len(rights) else None
    lo = (p - left).clamp(min=0) if left is not None else torch.zeros_like(p)
    hi = (p + right).clamp(max=kv_len - 1) if right is not None else torch.full_like(p, kv_len - 1)
    expected_seen = lo <= hi
    if not torch.equal(expected_seen, seen) or not (torch.equal(lo[seen], first[seen])
                                                     and torch.equal(hi[seen], last[seen])):
        return None
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None  # a band that leaves out the diagonal (q_idx > kv_idx): not one the kernels take
    return left, right


def function_states(bound, batch: int, heads: int, q_len: int, kv_len: int, block: int = 128) -> BlockStates:
    """The block map of a compiled mask_mod that captures no tensor, over query positions [0, q_len)
    and keys [0, kv_len): a pure function of the program, its run-time scalars and these sizes, so
    it is made once (one evaluation of the whole grid, in C) and kept for the next call of that size.
    Per sequence / head only where the function reads ``b`` / ``h``; one that reads neither and turns
    out to be exactly a band on this grid (causal, a sliding window) says so (:attr:`BlockStates.band`)."""
    reads = bound.program.reads
    batch, heads = (batch if "b" in reads else 1), (heads if "h" in reads else 1)
    key = (bound.program, bound.scalars, batch, heads, q_len, kv_len, block)
    found = _FUNCTION_MAPS.get(key)
    if found is None:
        rows = [] if batch == heads == 1 else None
        states = _classify(_compiled_evaluator(bound), batch, heads, q_len, kv_len, block, block, rows)
        band = _band_of(torch.cat(rows), kv_len) if rows else None
        found = _FUNCTION_MAPS[key] = BlockStates(states, block, block, q_len, kv_len, band)
        while len(_FUNCTION_MAPS) > FUNCTION_MAPS_KEPT:
            _FUNCTION_MAPS.popitem(last=False)
    _FUNCTION_MAPS.move_to_end(key)
    return found


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128, *, compiled: bool = True) -> BlockMask:
    """A PyTorch ``BlockMask`` for ``mask_mod`` (B or H None: 1, evaluated at b = 0 / h = 0), built a
    row of blocks at a time in O(blocks) memory, its block map cached on it."""
    block_q, block_kv = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    batch, heads = B or 1, H or 1
    states = _classify(_evaluator(mask_mod, compiled), batch, heads, Q_LEN, KV_LEN, block_q, block_kv)
    (num, idx), (full_num, full_idx) = _lists(states, PARTIAL), _lists(states, VISIBLE)
    block_mask = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=(block_q, block_kv),
                                          mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))
    block_mask.__dict__[_CACHE_ATTR] = (_guard(block_mask), BlockStates(states, block_q, block_kv, Q_LEN, KV_LEN))
    return block_mask
