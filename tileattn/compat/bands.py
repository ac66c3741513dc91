"""Translate "top-left" band masks into tileattn's bottom-right windows without building a mask.

tileattn aligns causal masks and sliding windows to the bottom-right corner (FlashAttention-2):
query ``i`` sees key ``j`` iff ``-left <= j - i - (Sk - Sq) <= right``. PyTorch SDPA's ``is_causal``
and several torch_npu sparse modes count from the top-left corner instead: query ``i`` sees key ``j``
iff ``lo <= j - i <= hi``. The two agree once the key axis is cut so that ``Sk - Sq == hi``: keys
beyond column ``Sq - 1 + hi`` are seen by no query, so dropping them (a view, no copy) changes
nothing, and then ``right = 0``-style bounds line up. Only when the lower bound cannot be expressed
as a non-negative window (or no key is visible at all) do we fall back to an explicit bool mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class BandPlan:
    """How to run a top-left band ``lo <= j - i <= hi`` (None = unbounded) on tileattn.

    ``keys``: use only the first ``keys`` key columns (the rest are never visible).
    ``window``: (left, right) for ``flash_attention`` (None = unbounded side), relative to the cut.
    ``keep``: optional bool (Sq, keys) mask, True = take part, when the window cannot express it.
    """

    keys: int
    window: tuple
    keep: Optional[torch.Tensor] = None


def top_left_keep(sq: int, sk: int, lo, hi, device=None) -> torch.Tensor:
    """Bool (sq, sk): True where ``lo <= j - i <= hi`` (top-left indices, None = unbounded)."""
    rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if lo is not None:
        keep &= rel >= lo
    if hi is not None:
        keep &= rel <= hi
    return keep


def plan_band(sq: int, sk: int, lo, hi, device=None) -> BandPlan:
    """Plan a top-left band on an (sq, sk) score matrix. Bounds beyond the matrix count as unbounded."""
    if lo is not None and lo <= -sq:
        lo = None
    if hi is not None and hi >= sk:
        hi = None
    keys = sk if hi is None else min(sk, sq + hi)
    if keys <= 0 or (lo is not None and hi is not None and lo > hi):
        # No query sees any key: an all-False mask gives zero rows and LSE -inf.
        return BandPlan(sk, (None, None), torch.zeros(sq, sk, dtype=torch.bool, device=device))
    offset = keys - sq
    right = None if hi is None else hi - offset
    left = None if lo is None else offset - lo
    if left is not None and left < 0:
        return BandPlan(keys, (None, right), top_left_keep(sq, keys, lo, None, device))
    return BandPlan(keys, (left, right), None)
