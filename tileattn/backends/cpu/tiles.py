"""Per-tile score construction for the CPU engine.

A :class:`SequenceProblem` describes one (batch item or varlen sequence) attention problem in the
terms a kernel needs: strided ``(H, S, D)`` tensors and the score options, nothing of the public API.
:meth:`SequenceProblem.scores` turns ``q_tile . k_tile^T`` into base-2 logits with every score
modifier applied, for forward and backward alike, so the two passes can never disagree.

Work is cut per range of kv heads ``hs``: the queries of the ``G = Hq / Hkv`` heads that share a
kv head are stacked into one ``(G * block_m, D)`` matrix, so one GEMM serves the whole group and K/V
are never repeated; the kv heads of the range form the batch dimension of every tile,
``(nh, G * block_m, block_n)``. Batching a few heads gives each tensor operation more work, which
matters because every operation has a fixed cost (~5-10 microseconds from Python).

Augmented operands (why ``kt_aug``/``vt_aug`` exist): K and V are copied once per sequence,
transposed, with a row of ones appended. A query block with an extra column ``-c`` then gives
``q.k^T - c`` straight out of the GEMM, so subtracting the row maximum (forward), the log-sum-exp
(backward) or ``Delta = rowsum(dO * O)`` (backward, with ``dO`` augmented against ``vt_aug``) costs
no pass over the score tile. The copy is ``O(S * D)`` against the ``O(S^2 * D)`` of the attention.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ... import scores as S

LOG2E = 1.4426950408889634
#: :meth:`SequenceProblem.mask_hidden`'s answer for a tile the user's mask hides entirely.
ALL_HIDDEN = "all hidden"


@dataclass
class SequenceProblem:
    q: torch.Tensor  # (Hq, Sq, D)
    k: torch.Tensor  # (Hkv, Sk, D); in the compute dtype once prepare() ran
    v: torch.Tensor  # (Hkv, Sk, Dv); in the compute dtype once prepare() ran
    scale: float
    left: Optional[int]
    right: Optional[int]
    softcap: float = 0.0
    mask: Optional[torch.Tensor] = None  # (Hm, Sqm, Skm) broadcastable, for this batch item
    bias: Optional[torch.Tensor] = None  # (Hb, Sqb, Skb) broadcastable, for this batch item
    slopes: Optional[torch.Tensor] = None  # (Hq,)
    dropout_p: float = 0.0
    seed: int = 0
    batch_index: int = 0
    compute_dtype: torch.dtype = torch.float32
    kt_aug: Optional[torch.Tensor] = None  # (Hkv, D + 1, Sk): K^T with a row of ones, see module doc
    vt_aug: Optional[torch.Tensor] = None  # (Hkv, Dv + 1, Sk): V^T with a row of ones

    @property
    def heads_q(self):
        return self.q.shape[0]

    @property
    def heads_kv(self):
        return self.k.shape[0]

    @property
    def group(self):
        return self.heads_q // self.heads_kv

    @property
    def sq(self):
        return self.q.shape[1]

    @property
    def sk(self):
        return self.k.shape[1]

    @property
    def head_dim(self):
        return self.q.shape[2]

    @property
    def plain(self) -> bool:
        """No score modifier between the GEMM and the softmax: fold scale*log2(e) into q."""
        return self.softcap == 0 and self.bias is None and self.slopes is None

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

    def mask_hidden(self, hs: slice, i0, i1, j0, j1):
        """The user's mask on the tile: None when it hides nothing there (or there is no mask),
        :data:`ALL_HIDDEN` when it hides the whole tile (skip it), otherwise a bool tensor
        (True = hidden) broadcastable to (nh, G, bm, bn). The band (causal/window) is separate.

        Telling the two uniform cases apart costs two reductions over a bool tile and saves a
        masked fill (slow: ~10x a float pass) on every tile that a block-sparse mask leaves whole.
        """
        if self.mask is None:
            return None
        summary = self._mask_summary(hs, i1 - i0, j1 - j0)
        if summary is not None and i0 % (i1 - i0) == 0 and j0 % (j1 - j0) == 0:
            any_kept, all_kept = summary
            bi, bj = i0 // (i1 - i0), j0 // (j1 - j0)
            if not any_kept[bi][bj]:
                return ALL_HIDDEN
            if all_kept[bi][bj]:
                return None
        keep = self._head_slice(_slice_broadcast(self.mask, i0, i1, j0, j1), hs)
        if summary is None:
            if not bool(keep.any()):
                return ALL_HIDDEN
            if bool(keep.all()):
                return None
        return ~keep

    def _mask_summary(self, hs: slice, bm: int, bn: int):
        """For a mask that tiles exactly into (bm, bn) blocks: per block, whether any / all of its
        entries are kept for every query head of ``hs`` (nested lists), computed once per call
        with two reductions over the whole mask instead of two per tile. None otherwise."""
        cache = self.__dict__.setdefault("_mask_summaries", {})
        key = (hs.start, hs.stop, bm, bn)
        if key not in cache:
            m = self.mask
            summary = None
            exact = m.shape[-2] == self.sq and m.shape[-1] == self.sk
            if exact and self.sq % bm == 0 and self.sk % bn == 0:
                heads = m if m.shape[0] == 1 else m[self.q_heads(hs)]
                blocks = heads.reshape(heads.shape[0], self.sq // bm, bm, self.sk // bn, bn)
                # max/min of the bytes = any/all, and 30x faster than bool any/all on this layout.
                blocks = blocks.view(torch.uint8)
                summary = (blocks.amax((0, 2, 4)).tolist(), blocks.amin((0, 2, 4)).tolist())
            cache[key] = summary
        return cache[key]

    def tile_is_empty(self, hidden) -> bool:
        """Whether the user's mask hides the whole tile. The band alone never does: ``key_blocks``
        only visits key blocks that some row of the query block sees (the rows' windows are
        contiguous)."""
        return hidden is ALL_HIDDEN

    def on_band_edge(self, i0, i1, j0, j1) -> bool:
        """Whether the band (causal/window) hides part of the tile."""
        return not S.band_fully_visible(i0, i1, j0, j1, self.sq, self.sk, self.left, self.right)

    def hide_outside_band(self, s: torch.Tensor, i0, i1, j0, j1):
        """Set the scores outside the band to -inf (before a row maximum is taken)."""
        lo, hi = self._band_diagonals(i0, j0)
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
        NaN included, is discarded). Query i sees key j iff ``lo <= j - i - (Sk - Sq) <= hi``: in
        tile coordinates two diagonals, so ``tril_``/``triu_`` do it (10x faster than a masked
        fill with a bool tile)."""
        p3 = p.view(-1, i1 - i0, j1 - j0)
        lo, hi = self._band_diagonals(i0, j0)
        if hi is not None:
            p3.tril_(hi)
        if lo is not None:
            p3.triu_(lo)

    def _band_diagonals(self, i0, j0):
        """(lo, hi): tile element (r, c) is inside the band iff ``lo <= c - r <= hi`` (None = open)."""
        shift = (self.sk - self.sq) + i0 - j0
        return (None if self.left is None else shift - self.left,
                None if self.right is None else shift + self.right)

    def scores(self, hs: slice, qb: torch.Tensor, i0, i1, j0, j1, hidden, out: torch.Tensor):
        """Base-2 logits of the tile, (nh, G*bm, bn), and the tanh of the softcap (or None).

        ``qb`` is the (nh, G*bm, D) pre-scaled query block (without the augmented column); ``out``
        is the buffer to fill. The user's mask is applied, the band is not.
        """
        s = torch.bmm(qb, self.k[hs, j0:j1].transpose(1, 2), out=out)
        tanh = None
        if not self.plain:
            g, bm, bn = self.group, i1 - i0, j1 - j0
            s3 = s.view(-1, g, bm, bn)
            if self.softcap > 0:
                tanh = torch.tanh(s.div_(self.softcap))
                s.copy_(tanh).mul_(self.softcap)
            if self.slopes is not None:
                dev = s.device
                dist = S.alibi_distance(
                    torch.arange(i0, i1, device=dev), torch.arange(j0, j1, device=dev),
                    self.sq, self.sk, s.dtype,
                )
                slopes = self.slopes[self.q_heads(hs)].view(-1, g, 1, 1).to(s.dtype)
                s3.sub_(slopes * dist)
            if self.bias is not None:
                b = self._head_slice(_slice_broadcast(self.bias, i0, i1, j0, j1), hs)
                s3.add_(b.to(s.dtype))
            s.mul_(LOG2E)
        self.apply_mask(s, hidden, i0, i1)
        return s, tanh

    def apply_mask(self, s: torch.Tensor, hidden, i0, i1):
        """Set the scores the user's mask hides (``hidden`` from :meth:`mask_hidden`) to -inf."""
        if hidden is not None:
            s.view(s.shape[0], self.group, i1 - i0, -1).masked_fill_(hidden, -math.inf)

    def dropout_keep(self, hs: slice, i0, i1, j0, j1) -> torch.Tensor:
        """Bool (nh, G*bm, bn): which probabilities of the tile survive dropout."""
        dev = self.q.device
        qh = self.q_heads(hs)
        keys = S.dropout_row_keys(
            self.seed, self.batch_index, torch.arange(qh.start, qh.stop, device=dev),
            torch.arange(i0, i1, device=dev),
        )
        keep = S.dropout_keep(keys, torch.arange(j0, j1, device=dev), self.dropout_p)
        return keep.view(hs.stop - hs.start, self.group * (i1 - i0), j1 - j0)

    def _head_slice(self, x: torch.Tensor, hs: slice) -> torch.Tensor:
        """(Hq or 1, r, c) -> broadcastable to (nh, G, r, c) for the query heads of kv heads ``hs``."""
        if x.shape[0] == 1:
            return x.unsqueeze(0)
        return x[self.q_heads(hs)].unflatten(0, (hs.stop - hs.start, self.group))


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


def _slice_broadcast(x: torch.Tensor, i0, i1, j0, j1) -> torch.Tensor:
    """Tile [i0:i1, j0:j1] of an (H?, Sq?, Sk?) tensor whose dims may be broadcast (size 1)."""
    rows = slice(None) if x.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if x.shape[-1] == 1 else slice(j0, j1)
    return x[..., rows, cols]
