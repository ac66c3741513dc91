"""Block classification of a block mask: which (query block, key block) tiles a kernel skips, computes
unmasked, or computes with a per-element mask, and that mask, packed.

:func:`classify` turns a PyTorch ``BlockMask`` (from ``create_block_mask``, ``and_masks``/``or_masks``,
``BlockMask.from_kv_blocks``, or this module's :func:`create_block_mask`) into a :class:`BlockMap` for a
call with ``batch`` sequences and ``heads`` query heads:

* ``states``: uint8 (Bs, Hs, rows, cols), one :class:`~tileattn.core.score_math.TileState` per block of
  ``BLOCK_SIZE`` = (block_q, block_kv): EMPTY (skip), PARTIAL (apply the bits), FULL (no mask).
  ``rows = ceil(q_len / block_q)``, ``cols = ceil(kv_len / block_kv)``; the last row and column may
  be cut short by the lengths and are classified on their in-range elements only. ``Bs`` is 1 (the
  same for every sequence) or ``batch``; ``Hs`` is 1 or ``heads``: 1 where the mask's block lists are
  broadcast and its mask_mod does not read ``b`` (resp. ``h``).
* ``partial``: int32 of the same shape, the index of a PARTIAL block's bits, -1 elsewhere.
* ``bits``: uint8 (P, block_kv, ceil(block_q / 8)), key-major like the kernels' score tiles: bit
  ``r % 8`` of ``bits[p, j, r // 8]`` says whether query row ``r`` of block ``p`` sees key column
  ``j`` (least significant bit first, so 16 rows load as one little-endian uint16 for an AVX-512
  mask register). Bits of positions past q_len / kv_len are 0.

A block is visible element by element exactly as PyTorch's compiled FlexAttention sees it: blocks in
``full_kv_indices`` are FULL (mask_mod not applied), blocks in ``kv_indices`` apply ``mask_mod(b, h,
q_idx, kv_idx)`` with the call's own ``b`` and ``h``, other blocks are EMPTY. A listed block whose mask
turns out all-true (all-false) over its in-range elements is promoted to FULL (demoted to EMPTY). Only
PARTIAL blocks evaluate the mask: memory is O(blocks + partial blocks x block_q x block_kv / 8), never
O(q_len x kv_len). The mask runs compiled (:func:`tileattn.flex.compiler.mask_program`) when it can,
else through ``torch.vmap`` in chunks. A map is cached on the BlockMask object, keyed by the call's
(batch, heads) and guarded by the mask_mod, the lengths and block size, and the identity and version
of the block lists and of the tensors the mask_mod captures (a repeated call costs tens of microseconds).

:func:`create_block_mask` builds a PyTorch ``BlockMask`` without materialising the (B, H, Q, KV) mask
(PyTorch's does): the mask is evaluated one row of blocks at a time, and the map it yields is cached
on the result.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..core.modifiers import TileState, fail
from . import compiler
from .semantics import block_grid, check_block_mask, listed_blocks, mask_tile
from .trace import INDEX_DTYPE, IndexByTensors, Unsupported, structure, trace

EMPTY, PARTIAL, FULL = int(TileState.EMPTY), int(TileState.PARTIAL), int(TileState.FULL)
#: elements of mask evaluated per chunk (bounds the temporary memory of classification)
CHUNK_ELEMENTS = 1 << 22
_CACHE_ATTR = "_tileattn_block_maps"
_READS = {}  # structure key of a mask_mod the compiler refused -> what it reads (traced once)


@dataclass(frozen=True, eq=False)
class BlockMap:
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    states: torch.Tensor    #: uint8 (Bs, Hs, rows, cols) of EMPTY / PARTIAL / FULL
    partial: torch.Tensor   #: int32 (Bs, Hs, rows, cols): index into bits, -1 if not PARTIAL
    bits: torch.Tensor      #: uint8 (P, block_kv, ceil(block_q / 8)), key-major, LSB first
    how: str                #: "compiled" or the reason the mask ran through torch.vmap

    def counts(self) -> dict:
        return {name: int((self.states == value).sum()) for name, value in
                (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def to_dense(self) -> torch.Tensor:
        """Bool (Bs, Hs, q_len, kv_len) of visible positions: O(q_len x kv_len), for tests and pictures."""
        bq, bk = self.block_q, self.block_kv
        rows, cols = self.states.shape[-2:]
        unpacked = (self.bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        tiles = unpacked.flatten(-2)[..., :bq].transpose(1, 2).bool()            # (P, bq, bk)
        tiles = torch.cat([tiles, torch.zeros(1, bq, bk, dtype=torch.bool), torch.ones(1, bq, bk, dtype=torch.bool)])
        pick = torch.where(self.states == FULL, len(tiles) - 1, torch.where(self.partial >= 0, self.partial.long(),
                                                                            len(tiles) - 2))
        dense = tiles[pick]                                                       # (Bs, Hs, rows, cols, bq, bk)
        dense = dense.permute(0, 1, 2, 4, 3, 5).reshape(*self.states.shape[:2], rows * bq, cols * bk)
        return dense[..., :self.q_len, :self.kv_len]


#: multipliers for 0/1 bytes read 8 at a time as int64 words: the sum of the 8 bytes, or their bits
#: (byte i -> bit i) gathered into the top byte (the products never carry into it)
_SUM_BYTES = 0x0101010101010101
_GATHER_BITS = 0x0102040810204080


def _sum_bytes(x: torch.Tensor) -> torch.Tensor:
    """int32 sums over the last dimension of a 0/1 uint8 tensor (eight bytes per int64 operation)."""
    if x.shape[-1] % 8:
        return x.sum(-1, dtype=torch.int32)
    words = x.contiguous().view(torch.int64)
    n = words.shape[-1]
    group = max(d for d in range(1, 32) if n % d == 0)
    lanes = words.view(*words.shape[:-1], n // group, group).sum(-1)       # each byte lane <= 31
    return (((lanes * _SUM_BYTES) >> 56) & 0xFF).sum(-1, dtype=torch.int32)  # 8 lanes <= 248


def _pack(keymajor: torch.Tensor) -> torch.Tensor:
    """(n, block_kv, block_q) 0/1 uint8 -> (n, block_kv, ceil(block_q / 8)) bits, LSB first."""
    padded = torch.nn.functional.pad(keymajor, (0, -keymajor.shape[-1] % 8)).contiguous()
    return (((padded.view(torch.int64) * _GATHER_BITS) >> 56) & 0xFF).to(torch.uint8)


def _extent(n_blocks, block, length):
    """In-range size of each block along one axis (int64)."""
    start = torch.arange(n_blocks) * block
    return (length - start).clamp(max=block)


def _clamped(start, count, length):
    return torch.arange(start, start + count, dtype=INDEX_DTYPE).clamp(max=max(length - 1, 0))


class _Evaluator:
    """mask_mod on (rows x cols) tiles, compiled when possible, else torch.vmap."""

    def __init__(self, mask_mod, compiled: bool):
        self.mask_mod, self.program, self.captures = mask_mod, None, ()
        self.how = "torch.vmap (compiled=False)"
        if compiled:
            try:
                self.program, self.captures = compiler.mask_program(mask_mod)
                self.how = "compiled"
            except Unsupported as exc:
                self.how = f"torch.vmap: {exc.reason}"

    def reads(self) -> frozenset:
        if self.program is not None:
            return self.program.reads
        try:
            key, captures = structure(self.mask_mod)
        except Unsupported:
            return frozenset(("b", "h"))
        if key not in _READS:
            try:
                _READS[key] = trace(self.mask_mod, "mask", None, captures).reads
            except Unsupported:
                _READS[key] = frozenset(("b", "h"))
        return _READS[key]

    def tile(self, b: int, h: int, q, kv) -> torch.Tensor:
        """uint8 (len(kv), len(q)): key-major 0/1 mask of rows q (batch b, head h) x columns kv."""
        n = q.numel()
        bh = [torch.full((n,), x, dtype=INDEX_DTYPE) for x in (b, h)]
        if self.program is not None:
            out = torch.empty(kv.numel(), n, dtype=torch.uint8)
            self.program.mask(out, bh[0], bh[1], q, kv, self.captures)
            return out
        return mask_tile(self.mask_mod, bh[0], bh[1], q, kv).t().to(torch.uint8).contiguous()

    def blocks(self, coords, bq, bk, q_len, kv_len) -> torch.Tensor:
        """uint8 (n, bk, bq): key-major masks of the blocks ``coords`` (n, 4) = (b, h, row, col)."""
        if self.program is not None:
            out = torch.empty(len(coords), bk, bq, dtype=torch.uint8)
            start = 0
            keys = coords[:, :3].tolist()
            while start < len(coords):  # one call per (b, h, row): its blocks share the query rows
                stop = start + 1
                while stop < len(coords) and keys[stop] == keys[start]:
                    stop += 1
                b, h, row = keys[start]
                kv = torch.cat([_clamped(int(c) * bk, bk, kv_len) for c in coords[start:stop, 3]])
                out[start:stop] = self.tile(b, h, _clamped(row * bq, bq, q_len), kv).view(stop - start, bk, bq)
                start = stop
            return out
        n = len(coords)
        q = (coords[:, 2:3] * bq + torch.arange(bq)).clamp(max=q_len - 1).to(INDEX_DTYPE)   # (n, bq)
        kv = (coords[:, 3:4] * bk + torch.arange(bk)).clamp(max=kv_len - 1).to(INDEX_DTYPE)  # (n, bk)
        flat = [coords[:, 0, None, None].expand(n, bq, bk), coords[:, 1, None, None].expand(n, bq, bk),
                q[:, :, None].expand(n, bq, bk), kv[:, None, :].expand(n, bq, bk)]
        flat = [x.to(INDEX_DTYPE).reshape(-1) for x in flat]
        with IndexByTensors():
            values = torch.vmap(self.mask_mod)(*flat)
        return values.expand(n * bq * bk).reshape(n, bq, bk).transpose(1, 2).to(torch.uint8)


def _watched(block_mask, captures):
    return [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, *captures]


def _guard(block_mask, captures):
    """What a cached map depends on: the mask_mod, the lengths and block size, and the identity and
    version of the block lists and of the tensors the mask_mod captures."""
    return (block_mask.mask_mod, tuple(block_mask.seq_lengths), tuple(block_mask.BLOCK_SIZE),
            tuple(None if t is None else (weakref.ref(t), t._version) for t in _watched(block_mask, captures)))


def _guard_holds(guard, block_mask, captures) -> bool:
    mask_mod, lengths, block_size, entries = guard
    now = _watched(block_mask, captures)
    return (mask_mod is block_mask.mask_mod and lengths == tuple(block_mask.seq_lengths)
            and block_size == tuple(block_mask.BLOCK_SIZE) and len(entries) == len(now)
            and all((e is None and t is None) or (e is not None and t is not None and e[0]() is t and e[1] == t._version)
                    for e, t in zip(entries, now)))


def _captures(mask_mod):
    """The tensors the mask_mod captures (for the cache guard), or None when they cannot be found."""
    try:
        return structure(mask_mod)[1]
    except Unsupported:
        return None


def _cached(block_mask, captures, match):
    """A cached map whose key satisfies ``match`` and whose guard holds, or None."""
    if captures is None:
        return None
    for key, (guard, block_map) in block_mask.__dict__.get(_CACHE_ATTR, {}).items():
        if match(key, block_map) and _guard_holds(guard, block_mask, captures):
            return block_map
    return None


def _store(block_mask, key, captures, block_map):
    if captures is not None:
        block_mask.__dict__.setdefault(_CACHE_ATTR, {})[key] = (_guard(block_mask, captures), block_map)


def classify(block_mask, batch: int, heads: int, *, compiled: bool = True) -> BlockMap:
    """The :class:`BlockMap` of ``block_mask`` for a call with ``batch`` sequences and ``heads`` query
    heads (CPU masks). ``compiled=False`` evaluates the mask with torch.vmap even where it compiles."""
    if not isinstance(block_mask, BlockMask):
        fail(TypeError, "block_mask", type(block_mask).__name__, "a torch.nn.attention.flex_attention.BlockMask")
    captures = _captures(block_mask.mask_mod)
    key = (batch, heads, compiled)
    found = _cached(block_mask, captures, lambda k, m: k == key)
    if found is not None:
        return found
    q_len, kv_len = block_mask.seq_lengths
    check_block_mask(block_mask, q_len, kv_len, batch, heads, "cpu")
    evaluator = _Evaluator(block_mask.mask_mod, compiled)
    reads = evaluator.reads()
    bm_b, bm_h = block_mask.kv_num_blocks.shape[:2]
    bs = batch if bm_b == batch or "b" in reads else 1
    hs = heads if bm_h == heads or "h" in reads else 1
    found = _cached(block_mask, captures, lambda k, m: k[2] == compiled and tuple(m.states.shape[:2]) == (bs, hs))
    if found is not None:  # made for another call size (or by create_block_mask) with the same (Bs, Hs)
        _store(block_mask, key, captures, found)
        return found
    bq, bk = block_mask.BLOCK_SIZE
    rows, cols = block_grid(block_mask)
    states = torch.zeros(bm_b, bm_h, rows, cols, dtype=torch.uint8)
    states[listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, rows, cols)] = PARTIAL
    if block_mask.full_kv_num_blocks is not None:
        states[listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols)] = FULL
    states = states.expand(bs, hs, rows, cols).contiguous()
    coords = (states == PARTIAL).nonzero()
    full_count = _extent(rows, bq, q_len)[:, None] * _extent(cols, bk, kv_len)[None, :]
    valid_q = (torch.arange(bq) < _extent(rows, bq, q_len)[:, None]).to(torch.uint8)    # (rows, bq)
    valid_k = (torch.arange(bk) < _extent(cols, bk, kv_len)[:, None]).to(torch.uint8)   # (cols, bk)
    chunk = max(1, CHUNK_ELEMENTS // (bq * bk))
    kept_bits, kept_coords = [], []
    for start in range(0, len(coords), chunk):
        part = coords[start:start + chunk]
        tiles = evaluator.blocks(part, bq, bk, q_len, kv_len)
        tiles &= valid_k[part[:, 3]][:, :, None] & valid_q[part[:, 2]][:, None, :]
        count = _sum_bytes(tiles).sum(1)
        state = torch.where(count == 0, EMPTY, torch.where(count == full_count[part[:, 2], part[:, 3]], FULL,
                                                           PARTIAL)).to(torch.uint8)
        states[tuple(part.t())] = state
        still = state == PARTIAL
        kept_bits.append(_pack(tiles[still]))
        kept_coords.append(part[still])
    block_map = _finish(q_len, kv_len, bq, bk, states, kept_coords, kept_bits, evaluator.how)
    _store(block_mask, key, captures, block_map)
    return block_map


def _finish(q_len, kv_len, bq, bk, states, coords, bits, how) -> BlockMap:
    partial = torch.full(states.shape, -1, dtype=torch.int32)
    coords = torch.cat(coords) if coords else torch.zeros(0, 4, dtype=torch.int64)
    partial[tuple(coords.t())] = torch.arange(len(coords), dtype=torch.int32)
    bits = torch.cat(bits) if bits else torch.zeros(0, bk, -(-bq // 8), dtype=torch.uint8)
    return BlockMap(q_len=q_len, kv_len=kv_len, block_q=bq, block_kv=bk, states=states, partial=partial, bits=bits,
                    how=how)


def _lists(states, value):
    chosen = (states == value).to(torch.int32)
    return (chosen.sum(-1, dtype=torch.int32),
            torch.argsort(chosen, dim=-1, descending=True, stable=True).to(torch.int32))


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, *, compiled: bool = True):
    """A PyTorch ``BlockMask`` for ``mask_mod``, as ``torch.nn.attention.flex_attention.create_block_mask``
    makes it (B or H None: 1, evaluated at b = 0 / h = 0), built a row of blocks at a time in
    O(blocks + partial blocks x BLOCK_SIZE^2) memory, with its :class:`BlockMap` cached on it."""
    if device is not None and torch.device(device).type != "cpu":
        fail(ValueError, "device", device, "cpu (PyTorch's create_block_mask serves other devices)")
    block_q, block_kv = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("BLOCK_SIZE", block_q), ("BLOCK_SIZE", block_kv)):
        if not isinstance(value, int) or value < 1:
            fail(ValueError, name, value, "a positive int")
    batch, heads = B or 1, H or 1
    rows, cols = -(-Q_LEN // block_q), -(-KV_LEN // block_kv)
    evaluator = _Evaluator(mask_mod, compiled)
    states = torch.empty(batch, heads, rows, cols, dtype=torch.uint8)
    kv = _clamped(0, cols * block_kv, KV_LEN)
    extent_k = _extent(cols, block_kv, KV_LEN)
    step = max(1, CHUNK_ELEMENTS // (block_q * cols * block_kv))
    coords, bits = [], []
    for b in range(batch):
        for h in range(heads):
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                tile = evaluator.tile(b, h, _clamped(r0 * block_q, (r1 - r0) * block_q, Q_LEN), kv)
                tile[KV_LEN:] = 0                       # key-major: rows of the tile are keys
                tile[:, max(0, Q_LEN - r0 * block_q):] = 0
                blocks = tile.view(cols, block_kv, r1 - r0, block_q)
                count = _sum_bytes(blocks).sum(1).t()
                full = _extent(rows, block_q, Q_LEN)[r0:r1, None] * extent_k[None, :]
                state = torch.where(count == 0, EMPTY, torch.where(count == full, FULL, PARTIAL)).to(torch.uint8)
                states[b, h, r0:r1] = state
                where = (state == PARTIAL).nonzero()
                bits.append(_pack(blocks[where[:, 1], :, where[:, 0]]))
                coords.append(torch.cat([torch.tensor([[b, h]]).expand(len(where), 2),
                                         where + torch.tensor([r0, 0])], dim=1))
    block_map = _finish(Q_LEN, KV_LEN, block_q, block_kv, states, coords, bits, evaluator.how)
    (num, idx), (full_num, full_idx) = _lists(states, PARTIAL), _lists(states, FULL)
    block_mask = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=(block_q, block_kv),
                                          mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))
    _store(block_mask, (batch, heads, compiled), _captures(mask_mod), block_map)
    return block_mask
