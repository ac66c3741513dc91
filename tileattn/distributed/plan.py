"""Where every token lives: the sharding plan of context parallelism.

One plan serves every mode, so a tensor sharded once can be given to ring, Ulysses or hybrid
attention alike, and ``shard``/``unshard``/RoPE positions agree with the attention by construction.

* ``load_balance=True`` (zigzag, head-tail): each sequence is cut into ``2 * world`` chunks and
  rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``. Under a causal mask chunk ``c`` costs
  about ``c + 1/2`` chunk-blocks of work, so every rank's pair costs the same ``2 * world`` blocks.
* ``load_balance=False``: each sequence is cut into ``world`` contiguous chunks, rank ``r`` holds
  chunk ``r`` (rank ``world - 1`` then does ``2 * world - 1`` times the causal work of rank 0).

Lengths need not divide: chunk sizes differ by at most one token (the first ``L % n`` chunks get
one more), and a chunk may be empty for a sequence shorter than ``n``. Varlen batches (packed
tokens with ``cu_seqlens``) are planned sequence by sequence; a rank's local tokens are its pieces
of sequence 0, then of sequence 1, ..., each in ascending position.

Hybrid (Ulysses inside, ring across, ``world = ring * ulysses``, CP rank ``g = i * ulysses + u``):
the tokens of ring rank ``i`` are the union of those of CP ranks ``i*U .. i*U + U - 1``. With the
zigzag plan over ``2 * world`` chunks that union is exactly the zigzag plan over ``2 * ring``
chunks of ``U`` chunks each (chunks ``iU..iU+U-1`` and ``U(2R-1-i)..U(2R-i)-1``), so the inner
all-to-all gathers a ring rank's share and the outer ring balances as plain ring attention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Sequence, Tuple

import torch

from ..core.modifiers import fail


@dataclass(frozen=True)
class Run:
    """``length`` consecutive tokens of sequence ``seq`` starting at position ``pos`` of that
    sequence, stored at local rows ``row .. row + length - 1``."""

    seq: int
    pos: int
    length: int
    row: int


def split_sizes(length: int, parts: int) -> List[int]:
    """``parts`` sizes summing to ``length``, the first ``length % parts`` one larger."""
    base, extra = divmod(length, parts)
    return [base + (i < extra) for i in range(parts)]


def zigzag_chunks(seq_len: int, world: int, rank: int, load_balance: bool = True) -> List[Tuple[int, int]]:
    """The ``(start, length)`` chunks of a ``seq_len``-token sequence that ``rank`` of ``world`` holds.

    Zigzag (``load_balance``): chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world``;
    otherwise chunk ``rank`` of ``world``. This is the placement Ascend's ``npu_fusion_attention``
    context-parallel modes (``sparse_mode`` 7/8) and PyTorch's head-tail load balancer assume.
    """
    parts = 2 * world if load_balance else world
    sizes = split_sizes(seq_len, parts)
    starts = [sum(sizes[:i]) for i in range(parts)]
    chosen = (rank, parts - 1 - rank) if load_balance else (rank,)
    return [(starts[c], sizes[c]) for c in chosen]


def local_lengths(seq_lens: torch.Tensor, world: int, load_balance: bool = True) -> torch.Tensor:
    """(len(seq_lens), world): the token count of every rank's shard of each sequence length, at once
    (what :func:`zigzag_chunks` gives, summed; for diagnosing shards that do not fit together)."""
    parts = 2 * world if load_balance else world
    base, extra = (seq_lens // parts).unsqueeze(1), (seq_lens % parts).unsqueeze(1)
    rank = torch.arange(world)
    if not load_balance:
        return base + (rank < extra).long()
    return 2 * base + (rank < extra).long() + (parts - 1 - rank < extra).long()


def merge_runs(runs: Sequence[Tuple[int, int, int]]) -> List[Run]:
    """(seq, pos, length) pieces -> sorted, adjacent pieces joined, empty ones dropped, rows assigned."""
    out: List[Run] = []
    row = 0
    for seq, pos, length in sorted(r for r in runs if r[2] > 0):
        if out and out[-1].seq == seq and out[-1].pos + out[-1].length == pos:
            last = out.pop()
            out.append(Run(seq, last.pos, last.length + length, last.row))
        else:
            out.append(Run(seq, pos, length, row))
        row += length
    return out


@dataclass(frozen=True)
class ShardPlan:
    """The token placement of ``world`` ranks for sequences of ``lengths`` (one entry when padded)."""

    lengths: Tuple[int, ...]
    world: int
    load_balance: bool
    varlen: bool = False

    @staticmethod
    def build(world: int, load_balance: bool, seq_len: Optional[int] = None, cu_seqlens=None) -> "ShardPlan":
        if cu_seqlens is not None:
            cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
            if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                fail(ValueError, "cu_seqlens", cu, "non-decreasing cumulative offsets starting at 0 (global, the "
                     "same on every rank)")
            return ShardPlan(tuple(b - a for a, b in zip(cu, cu[1:])), world, load_balance, True)
        return ShardPlan((int(seq_len),), world, load_balance, False)

    @cached_property
    def starts(self) -> Tuple[int, ...]:
        """Packed offset of each sequence (0 for a padded plan)."""
        out, acc = [], 0
        for n in self.lengths:
            out.append(acc)
            acc += n
        return tuple(out)

    def pieces(self, rank: int) -> List[Tuple[int, int, int]]:
        """(seq, pos, length) of every chunk ``rank`` holds, in its local order."""
        return [(b, start, size) for b, n in enumerate(self.lengths)
                for start, size in zigzag_chunks(n, self.world, rank, self.load_balance)]

    def runs(self, ranks: Sequence[int]) -> List[Run]:
        """The runs of the union of ``ranks`` (one rank, or a ring rank's Ulysses group), rows in
        ascending (sequence, position) order."""
        return merge_runs([p for r in ranks for p in self.pieces(r)])

    def local_len(self, rank: int) -> int:
        return sum(p[2] for p in self.pieces(rank))

    def global_index(self, ranks: Sequence[int]) -> torch.Tensor:
        """Packed global index of each token the ranks hold, in the order an all-gather over
        ``ranks`` (rank by rank, each in its local order) lays them out."""
        parts = []
        for r in ranks:
            for run in self.runs([r]):
                start = self.starts[run.seq] + run.pos
                parts.append(torch.arange(start, start + run.length))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def positions(self, rank: int) -> torch.Tensor:
        """Position of each local token inside its own sequence (what RoPE needs)."""
        parts = [torch.arange(run.pos, run.pos + run.length) for run in self.runs([rank])]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def gather_order(self, ranks: Sequence[int]) -> Optional[torch.Tensor]:
        """Permutation that sorts the all-gathered tokens of ``ranks`` into ascending (sequence,
        position) order, or None when they already are."""
        idx = self.global_index(ranks)
        order = torch.argsort(idx)
        if torch.equal(order, torch.arange(idx.numel())):
            return None
        return order
