"""Per-tile score construction for the CPU engine.

A :class:`SequenceProblem` describes one (batch item or varlen sequence) attention problem in the
terms a kernel needs: strided ``(H, S, D)`` tensors and the call's kernel arguments
(:class:`tileattn.core.kernel_args.KernelArgs`: the modifiers lowered), nothing of the public API.
:meth:`SequenceProblem.scores` turns ``q_tile . k_tile^T`` into base-2 logits with every score
modifier applied, for forward and backward alike, so the two passes can never disagree. Geometry
(which keys a query block sees, whether a tile is cut by the band, which tiles a mask hides) and
the dropout hash come from :mod:`tileattn.core.score_math` and the band's geometry
(:attr:`KernelArgs.band`); this module only does the in-place tile arithmetic.

Work is cut per range of kv heads ``hs``: the queries of the ``G = Hq / Hkv`` heads that share a
kv head are stacked into one ``(G * block_m, D)`` matrix, so one GEMM serves the whole group and K/V
are never repeated; the kv heads of the range form the batch dimension of every tile,
``(nh, G * block_m, block_n)``. Batching a few heads gives each tensor operation more work, which
matters because every operation has a fixed cost (~5-10 microseconds from Python).

Augmented operands (why ``kt_aug``/``vt_aug`` exist): K and V are copied once per sequence,
transposed, with a row of ones appended. A query block with an extra column ``-c`` then gives
``q.k^T - c`` straight out of the GEMM, so subtracting the row maximum (forward), the log-sum-exp
(backward) or ``Delta`` (backward, with ``dO`` augmented against ``vt_aug``) costs no pass over the
score tile. The copy is ``O(S * D)`` against the ``O(S^2 * D)`` of the attention.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ...core.kernel_args import KernelArgs
from ...core.modifiers import Band
from ...core.score_math import TileState, alibi_scores, dropout_keep, mask_tile_states, score_block

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MaskTile:
    """What the user's bool mask does to one tile: its state, and for a PARTIAL tile the bool
    tensor (True = hidden) broadcastable to (nh, G, bm, bn)."""

    state: TileState
    hidden: Optional[torch.Tensor] = None


_NO_MASK = MaskTile(TileState.FULL)


@dataclass
class SequenceProblem:
    q: torch.Tensor  # (Hq, Sq, D)
    k: torch.Tensor  # (Hkv, Sk, D); in the compute dtype once prepare() ran
    v: torch.Tensor  # (Hkv, Sk, Dv); in the compute dtype once prepare() ran
    args: KernelArgs
    offset: int  # query row i is aligned with key column i + offset
    batch_index: int = 0
    block_m: int = 64
    block_n: int = 64
    compute_dtype: torch.dtype = torch.float32
    kt_aug: Optional[torch.Tensor] = None  # (Hkv, D + 1, Sk): K^T with a row of ones, see module doc
    vt_aug: Optional[torch.Tensor] = None  # (Hkv, Dv + 1, Sk): V^T with a row of ones

    def __post_init__(self):
        self.band: Optional[Band] = self.args.band
        # The sizes (prepare() converts k and v, keeping their shapes) and the kernel arguments read
        # per tile; plain: no score modifier between the GEMM and the softmax (scale*log2(e) folds into q).
        self.heads_q, self.sq, self.head_dim = self.q.shape
        self.heads_kv, self.sk = self.k.shape[:2]
        self.group = self.heads_q // self.heads_kv
        self.scale, self.dropout_p, self.plain = self.args.scale, self.args.dropout_p, self.args.plain

    @property
    def q_factor(self) -> float:
        return self.scale * LOG2E if self.plain else self.scale

    def prepare(self, augment_k: bool, augment_v: bool):
        """Convert K and V to the compute dtype once for the sequence, and build ``kt_aug``/``vt_aug``
        (transposed, with the ones row) where asked."""
        cdt = self.compute_dtype
        if augment_k:
            self.kt_aug = _transposed_with_ones_row(self.k, cdt)
        if augment_v:
            self.vt_aug = _transposed_with_ones_row(self.v, cdt)
        # Unaugmented operands stay as they are when already in the compute dtype (no copy for fp32
        # inputs): GEMMs on rows padded to D + 1 run up to 12% slower than on the original rows.
        self.k = self.k.to(cdt)
        self.v = self.v.to(cdt)

    def q_heads(self, hs: slice) -> slice:
        """The query heads served by the kv heads ``hs``."""
        return slice(hs.start * self.group, hs.stop * self.group)

    def key_range(self, i0: int, i1: int):
        """Keys that some query row of [i0, i1) sees under the band: (lo, hi)."""
        if self.band is None:
            return 0, self.sk
        return self.band.key_range(i0, i1, self.sk, self.offset)

    def load_q(self, hs: slice, i0: int, i1: int) -> torch.Tensor:
        """Rows [i0, i1) of the query heads of kv heads ``hs``, stacked, pre-scaled:
        (nh, G*bm, D + 1), in the thread's "q" buffer. The last column is left for the caller (the
        value subtracted through ``kt_aug``)."""
        return self._stack_rows(self.q, hs, i0, i1, 1, "q", self.q_factor)

    def load_rows(self, x: torch.Tensor, hs: slice, i0: int, i1: int, extra: int, slot: str) -> torch.Tensor:
        """Rows [i0, i1) of an (Hq, Sq, E) tensor for kv heads ``hs``: (nh, G*bm, E + extra), in the
        thread's ``slot`` buffer."""
        return self._stack_rows(x, hs, i0, i1, extra, slot)

    def _stack_rows(self, x, hs, i0, i1, extra, slot, factor=None):
        nh, g, bm, e = hs.stop - hs.start, self.group, i1 - i0, x.shape[-1]
        block = scratch(nh * g * bm * (e + extra), self.compute_dtype, slot).view(nh, g * bm, e + extra)
        rows = x[self.q_heads(hs), i0:i1].unflatten(0, (nh, g))
        target = block[..., :e].view(nh, g, bm, e)
        target.copy_(rows)
        if factor is not None:
            # Scale after the upcast: torch.mul(fp16 rows, factor, out=fp32) rounds the product to
            # fp16 first, an error that large scores amplify (hub tutorial 05, large inputs).
            target.mul_(factor)
        return block

    def mask_hidden(self, hs: slice, i0, i1, j0, j1) -> MaskTile:
        """The user's mask on the tile (the band is separate). Tiles on the block grid read their
        state from :func:`~tileattn.core.score_math.mask_tile_states` (computed once per call); a tile the mask keeps whole
        skips the masked fill (slow: ~10x a float pass)."""
        mask = self.args.mask
        if mask is None:
            return _NO_MASK
        heads = self.q_heads(hs)
        if i0 % self.block_m == 0 and j0 % self.block_n == 0:
            states = mask_tile_states(mask, self.batch_index, heads, self.sq, self.sk, self.block_m, self.block_n)
            state = TileState(int(states[i0 // self.block_m, j0 // self.block_n]))
        else:
            state = TileState.PARTIAL
        if state != TileState.PARTIAL:
            return MaskTile(state)
        keep = self._head_slice(score_block(mask, self.batch_index, heads, i0, i1, j0, j1), hs)
        return MaskTile(TileState.PARTIAL, ~keep)

    def tile_is_empty(self, hidden: MaskTile) -> bool:
        """Whether the user's mask hides the whole tile. The band alone never does: the key blocks
        visited are those some row of the query block sees (the rows' windows are contiguous)."""
        return hidden.state == TileState.EMPTY

    def on_band_edge(self, i0, i1, j0, j1) -> bool:
        """Whether the band (causal/window) or the end of the keys cuts the tile."""
        return self.band is not None and self.band.tile_state(i0, i1, j0, j1, self.offset) != TileState.FULL

    def hide_outside_band(self, s: torch.Tensor, i0, i1, j0, j1):
        """Set the scores outside the band to -inf (before a row maximum is taken)."""
        lo, hi = self.band.tile_diagonals(i0, j0, self.offset)
        bm, bn = i1 - i0, j1 - j0
        hidden = None
        if hi is not None:
            hidden = torch.ones((bm, bn), dtype=torch.bool, device=s.device).triu_(hi + 1)
        if lo is not None:
            below = torch.ones((bm, bn), dtype=torch.bool, device=s.device).tril_(lo - 1)
            hidden = below if hidden is None else hidden.logical_or_(below)
        s.view(-1, bm, bn).masked_fill_(hidden, -math.inf)

    def zero_outside_band(self, p: torch.Tensor, i0, i1, j0, j1):
        """Set the probabilities outside the band to 0 (after exp2; whatever exp2 gave there, inf or
        NaN included, is discarded). In tile coordinates the band lies between two diagonals, so
        ``tril_``/``triu_`` do it (10x faster than a masked fill with a bool tile)."""
        p3 = p.view(-1, i1 - i0, j1 - j0)
        lo, hi = self.band.tile_diagonals(i0, j0, self.offset)
        if hi is not None:
            p3.tril_(hi)
        if lo is not None:
            p3.triu_(lo)

    def scores(self, hs: slice, qb: torch.Tensor, i0, i1, j0, j1, hidden: MaskTile, out: torch.Tensor):
        """Base-2 logits of the tile, (nh, G*bm, bn), and the tanh of the softcap (or None).

        ``qb`` is the (nh, G*bm, D) pre-scaled query block (without the augmented column); ``out``
        is the buffer to fill. The user's mask is applied, the band is not.
        """
        s = torch.bmm(qb, self.k[hs, j0:j1].transpose(1, 2), out=out)
        tanh = None
        if not self.plain:
            g, bm, bn = self.group, i1 - i0, j1 - j0
            s3 = s.view(-1, g, bm, bn)
            args = self.args
            if args.softcap:
                tanh = torch.tanh(s.div_(args.softcap))
                s.copy_(tanh).mul_(args.softcap)
            if args.alibi_slopes is not None:
                dev = s.device
                term = alibi_scores(args.alibi_slopes, self.batch_index, self.q_heads(hs),
                                    torch.arange(i0, i1, device=dev), torch.arange(j0, j1, device=dev), self.offset,
                                    s.dtype)
                s3.add_(term.view(-1, g, bm, bn))
            if args.bias is not None:
                b = self._head_slice(score_block(args.bias, self.batch_index, self.q_heads(hs), i0, i1, j0, j1), hs)
                s3.add_(b.to(s.dtype))
            s.mul_(LOG2E)
        self.apply_mask(s, hidden, i0, i1)
        return s, tanh

    def apply_mask(self, s: torch.Tensor, hidden: MaskTile, i0, i1):
        """Set the scores the user's mask hides (a PARTIAL :class:`MaskTile`) to -inf."""
        if hidden.hidden is not None:
            s.view(s.shape[0], self.group, i1 - i0, -1).masked_fill_(hidden.hidden, -math.inf)

    def dropout_keep(self, hs: slice, i0, i1, j0, j1) -> torch.Tensor:
        """Bool (nh, G*bm, bn): which probabilities of the tile survive dropout."""
        dev = self.q.device
        qh = self.q_heads(hs)
        keep = dropout_keep(self.args.seed, self.args.dropout_p, self.batch_index,
                            torch.arange(qh.start, qh.stop, device=dev), torch.arange(i0, i1, device=dev),
                            torch.arange(j0, j1, device=dev))
        return keep.view(hs.stop - hs.start, self.group * (i1 - i0), j1 - j0)

    def _head_slice(self, x: torch.Tensor, hs: slice) -> torch.Tensor:
        """(Hq or 1, r, c) -> broadcastable to (nh, G, r, c) for the query heads of kv heads ``hs``."""
        if x.shape[0] == 1:
            return x.unsqueeze(0)
        return x.unflatten(0, (hs.stop - hs.start, self.group))


_per_thread = threading.local()


def scratch(numel: int, dtype: torch.dtype, slot: str = "tile") -> torch.Tensor:
    """A flat buffer of ``numel`` elements owned by the calling thread, reused by every block.

    Why reuse: score tiles, query blocks and accumulators are 100 KiB to 2 MiB, above the size where
    the C allocator maps fresh pages from the kernel, so allocating them per step (or per block)
    pays page faults and zeroing on every first touch (measured: 1.6x slower tile loop) and, with
    several threads, an unmap that must reach every core. One buffer per ``slot``, grown on demand;
    it lives as long as its thread (a worker of one call, or the caller's thread).
    """
    buffers = getattr(_per_thread, "buffers", None)
    if buffers is None:
        buffers = _per_thread.buffers = {}
    buf = buffers.get(slot)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = buffers[slot] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def scratch_tile(buffer: torch.Tensor, nh: int, rows: int, cols: int) -> torch.Tensor:
    """A contiguous (nh, rows, cols) view at the start of a flat buffer from :func:`scratch`."""
    return buffer[: nh * rows * cols].view(nh, rows, cols)


def _transposed_with_ones_row(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(H, S, E) -> (H, E + 1, S): stored transposed so that ``q_block @ kt_aug[h, :, j0:j1]`` is a
    plain (non-transposed) GEMM, which MKL runs ~5% faster than ``q_block @ k_slice.t()``."""
    h, s, e = x.shape
    out = torch.empty((h, e + 1, s), dtype=dtype, device=x.device)
    out[:, :e].copy_(x.transpose(1, 2))
    out[:, e].fill_(1.0)
    return out
