"""The score pipeline shared by every engine, tile by tile.

    s = scale * q . k^T  ->  softcap  ->  + ALiBi + bias  ->  causal, window and mask  ->  softmax
      ->  dropout  ->  . V

The functions here compute the pieces of that pipeline for one tile given the *absolute* row and
column indices of the tile, so the exact reference (one tile = the whole matrix) and the tiled
engines produce the same numbers from the same code. Kernels in other languages (Triton) re-implement
the same formulas; the tests hold them to these.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a product of two 32-bit values fits in int64 without overflow
# and equals the uint32 product modulo 2**32 (what a Triton kernel computes).
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_GOLDEN = 0x1E3779B9


def key_range(i0: int, i1: int, sq: int, sk: int, left, right) -> tuple:
    """Half-open range of key columns that any query row in [i0, i1) may see under the band."""
    off = sk - sq
    lo = 0 if left is None else max(0, i0 + off - left)
    hi = sk if right is None else min(sk, i1 - 1 + off + right + 1)
    return lo, max(lo, hi)


def query_range(j0: int, j1: int, sq: int, sk: int, left, right) -> tuple:
    """Half-open range of query rows that may see any key column in [j0, j1) under the band."""
    off = sk - sq
    lo = 0 if right is None else max(0, j0 - off - right)
    hi = sq if left is None else min(sq, j1 - 1 - off + left + 1)
    return lo, max(lo, hi)


def band_fully_visible(i0, i1, j0, j1, sq, sk, left, right) -> bool:
    """True when every (i, j) of the tile lies inside the band (no masking needed)."""
    off = sk - sq
    if left is not None and j0 < (i1 - 1) + off - left:
        return False
    if right is not None and j1 - 1 > i0 + off + right:
        return False
    return True


def band_keep(rows: torch.Tensor, cols: torch.Tensor, sq: int, sk: int, left, right) -> torch.Tensor:
    """Bool (len(rows), len(cols)): True where query row i may see key column j."""
    rel = cols[None, :] - rows[:, None] - (sk - sq)
    keep = torch.ones(rel.shape, dtype=torch.bool, device=rel.device)
    if left is not None:
        keep &= rel >= -left
    if right is not None:
        keep &= rel <= right
    return keep


def alibi_distance(rows: torch.Tensor, cols: torch.Tensor, sq: int, sk: int, dtype) -> torch.Tensor:
    """|i + Sk - Sq - j| as a (len(rows), len(cols)) tensor; ALiBi adds -slope times this."""
    return (rows[:, None] + (sk - sq) - cols[None, :]).abs().to(dtype)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


def dropout_row_keys(seed: int, batch: int, heads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per (head, row) 32-bit keys, shape (len(heads), len(rows)), int64 holding uint32 values."""
    dev = rows.device
    k = _mix32(torch.tensor([seed & _M32], dtype=torch.int64, device=dev) ^ _GOLDEN)
    k = _mix32(k ^ ((seed >> 32) & _M32))
    k = _mix32(k ^ (batch & _M32))
    kh = _mix32(k ^ heads.to(torch.int64))
    return _mix32(kh[:, None] ^ rows.to(torch.int64)[None, :])


def dropout_keep(row_keys: torch.Tensor, cols: torch.Tensor, p: float) -> torch.Tensor:
    """Bool (..., len(cols)): True where the probability survives dropout.

    Counter-based: the decision for (seed, batch, head, row, col) is a pure function of those five
    numbers, so the backward pass regenerates the mask instead of storing it, and any tiling of the
    matrix gives the same mask.
    """
    x = _mix32(row_keys[..., None] ^ ((cols.to(torch.int64) * _GOLDEN) & _M32))
    threshold = int(round(p * (1 << 24)))
    return (x >> 8) >= threshold
