"""How a torch_npu call becomes ``flash_attention`` calls, and how their results come back.

A call becomes one or more :class:`Piece`: tensors plus ``flash_attention`` keywords. Most calls
are one piece on the caller's own tensors (views, never copies). Two cases take more:

* sparse_mode 7/8 (one rank's shard of a context-parallel split): the one sequence whose band
  differs from the others is a contiguous slice of the packed tensors, so the call is two pieces
  on views, not one per sequence.
* a per-sequence pattern that one varlen call cannot express (an ``atten_mask`` with TND, prefix
  mode 6 with TND, a band above the diagonal with unequal per-sequence offsets): the sequences
  are gathered once into a padded (B, maxS, N, D) copy with the exact kept region as a bool mask,
  :class:`PadIndex`; still one call, no Python loop over sequences. tileattn's varlen layout takes
  no mask (the core refuses one), which is why this copies.

Bands. torch_npu's bands are ``lo <= j - i - d <= hi`` with ``d = 0`` (counted from the top-left
corner) or ``d = Sk - Sq`` per sequence (bottom-right). :func:`band_call` maps one onto tileattn's
window around a diagonal placed by ``align``; a band that ends left of the bottom-right diagonal
(``hi < 0``) drops its last ``-hi`` keys per sequence through ``seqused_k`` (alignment counts from
the keys used), which keeps it one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from ...core.api import attention_backward, flash_attention
from ...core.reference import row_max as reference_row_max

@dataclass(frozen=True)
class Band:
    """The kept region ``lo <= j - i - d <= hi`` of every sequence; ``None`` = open side.
    ``anchor`` "top_left" (d = 0) or "bottom_right" (d = k_len - q_len of the sequence)."""

    anchor: str
    lo: Optional[int]
    hi: Optional[int]


def band_call(band: Band, common_offset: Optional[int]):
    """``flash_attention`` keywords for a non-empty ``band``: ``align``/``window``, plus ``trim``
    (keys to drop from the end of every sequence). ``common_offset``: ``k_len - q_len`` when all
    sequences share it (padded layouts), else None. Returns None when one call cannot express it
    (a bottom-right band entirely above the diagonal with unequal offsets)."""
    lo, hi = band.lo, band.hi
    if lo is None and hi is None:
        return {}
    shift = 0 if band.anchor == "top_left" else common_offset
    if shift is not None:
        lo = None if lo is None else lo + shift
        hi = None if hi is None else hi + shift
        if hi is None:
            return dict(align=lo, window=(0, None))
        return dict(align=hi, window=(None if lo is None else hi - lo, 0))
    if hi is None or hi >= 0:
        if lo is not None and lo > 0:
            return None
        return dict(align="bottom_right", window=(None if lo is None else -lo, hi))
    return dict(align="bottom_right", window=(None if lo is None else hi - lo, 0), trim=-hi)


def region(band: Optional[Band], q_len, k_len, sq: int, sk: int, prefix=None):
    """The kept region of padded sequences as a bool (B, 1, sq, sk) tensor: rows ``< q_len[b]``,
    keys ``< k_len[b]`` (int64 (B,) tensors), inside ``band`` or, with ``prefix`` (B,), inside the
    bottom-right causal triangle or among the first ``prefix[b]`` keys (modes 5/6)."""
    device = q_len.device
    i = torch.arange(sq, device=device)[None, :, None]
    j = torch.arange(sk, device=device)[None, None, :]
    lq, lk = q_len[:, None, None], k_len[:, None, None]
    keep = (i < lq) & (j < lk)
    if prefix is not None:
        keep = keep & ((j <= i + (lk - lq)) | (j < prefix[:, None, None]))
    elif band is not None:
        rel = j - i - ((lk - lq) if band.anchor == "bottom_right" else 0)
        if band.lo is not None:
            keep = keep & (rel >= band.lo)
        if band.hi is not None:
            keep = keep & (rel <= band.hi)
    return keep[:, None]


class PadIndex:
    """Gathers the sequences of packed (T, N, D) tensors into padded (B, maxS, N, D) copies and
    back, with index tensors built once (no loop over sequences)."""

    def __init__(self, cu_q: List[int], cu_k: List[int], device):
        self.q_len = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])], device=device)
        self.k_len = torch.tensor([b - a for a, b in zip(cu_k, cu_k[1:])], device=device)
        self.sq = max(1, int(self.q_len.max()))
        self.sk = max(1, int(self.k_len.max()))
        self.src_q, self.flat_q = self._index(cu_q, self.q_len, self.sq, device)
        self.src_k, self.flat_k = self._index(cu_k, self.k_len, self.sk, device)

    @staticmethod
    def _index(cu, lens, s, device):
        pos = torch.arange(s, device=device)[None, :]
        valid = pos < lens[:, None]
        src = (torch.tensor(cu[:-1], device=device)[:, None] + pos).masked_fill(~valid, 0)
        return src, valid.flatten().nonzero().flatten()

    def pad_q(self, t):
        return t[self.src_q]

    def pad_k(self, t):
        return t[self.src_k]

    def unpad_q(self, t):
        """(B, maxSq, ...) -> packed rows (Tq, ...)."""
        return t.flatten(0, 1)[self.flat_q]

    def unpad_k(self, t):
        return t.flatten(0, 1)[self.flat_k]

    def pad_lse(self, lse):
        """(N, Tq) -> (B, N, maxSq)."""
        return lse[:, self.src_q].permute(1, 0, 2)

    def unpad_lse(self, lse):
        """(B, N, maxSq) -> (N, Tq)."""
        return lse.permute(1, 0, 2).flatten(1)[:, self.flat_q]


@dataclass
class Piece:
    """One ``flash_attention`` call. ``rows``/``keys``: the packed query/key rows it covers (TND
    split pieces); ``pad``: it runs on padded copies of packed sequences; ``bias_fn``: builds the
    bias from the caller's pse (so that autograd, or the grad op's vector-Jacobian product, reaches
    pse)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict
    rows: Optional[slice] = None
    keys: Optional[slice] = None
    pad: Optional[PadIndex] = None
    bias_fn: Optional[Callable[[], torch.Tensor]] = field(default=None, repr=False)

    def call_kwargs(self) -> dict:
        kwargs = dict(self.kwargs)
        if self.bias_fn is not None:
            kwargs["bias"] = self.bias_fn()
        return kwargs


@dataclass
class Geometry:
    """Where pieces' results go: LSE shape of the whole call ((B, N, Sq) or (N, T)) and, for TND,
    the packed query rows ``total`` (rows no piece covers, trailing batches left out with zeros in
    ``actual_seq_qlen``, give output 0 and LSE -inf)."""

    lse_shape: tuple
    total: int = 0


def _single(pieces: List[Piece]) -> bool:
    return len(pieces) == 1 and pieces[0].rows is None and pieces[0].pad is None


def _gather_lse(pieces, lses, geo: Geometry, device):
    parts = [p.pad.unpad_lse(l) if p.pad is not None else l for p, l in zip(pieces, lses)]
    covered = sum(p.shape[-1] for p in parts)
    if covered < geo.total:
        parts.append(torch.full((geo.lse_shape[0], geo.total - covered), -math.inf, dtype=parts[0].dtype,
                                device=device))
    return torch.cat(parts, 1)


def forward(pieces: List[Piece], geo: Geometry):
    """(out in the caller's layout, LSE) of the whole call; differentiable."""
    results = [flash_attention(p.q, p.k, p.v, return_lse=True, **p.call_kwargs()) for p in pieces]
    if _single(pieces):
        return results[0]
    outs = [p.pad.unpad_q(o) if p.pad is not None else o for p, (o, _) in zip(pieces, results)]
    covered = sum(o.shape[0] for o in outs)
    if covered < geo.total:
        o = outs[0]
        outs.append(o.new_zeros((geo.total - covered,) + tuple(o.shape[1:])))
    return torch.cat(outs, 0), _gather_lse(pieces, [l for _, l in results], geo, pieces[0].q.device)


def row_max(pieces: List[Piece], geo: Geometry):
    """Row maximum of the masked, scaled scores (sinks included), shaped like the LSE: the core's
    :func:`tileattn.core.reference.row_max` on each piece's own call (same masks, bands, varlen,
    bias, ALiBi, sinks), from the scores in fp32 (fp64 for fp64 inputs), a block of rows at a time."""
    maxima = []
    for piece in pieces:
        cdtype = torch.float64 if piece.q.dtype == torch.float64 else torch.float32
        maxima.append(reference_row_max(piece.q, piece.k, piece.v, compute_dtype=cdtype, **piece.call_kwargs()))
    if _single(pieces):
        return maxima[0]
    return _gather_lse(pieces, maxima, geo, pieces[0].q.device)


@torch.no_grad()
def backward(pieces: List[Piece], dy, out, lse, q, k, v):
    """Gradients ``(dq, dk, dv, dbias per piece, dsinks)`` given the output gradient ``dy``, the
    output ``out`` (caller's layout) and LSE of the *whole* attention: ring attention passes
    merged statistics, and each call then returns its share of the whole attention's gradients."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbiases, dsinks = [], None
    for piece in pieces:
        kwargs = piece.call_kwargs()
        if kwargs.get("bias") is not None:
            kwargs["bias"] = kwargs["bias"].detach().requires_grad_(True)
        if piece.pad is not None:
            p_dy, p_out, p_lse = piece.pad.pad_q(dy), piece.pad.pad_q(out), piece.pad.pad_lse(lse)
        elif piece.rows is not None:
            p_dy, p_out, p_lse = dy[piece.rows], out[piece.rows], lse[:, piece.rows]
        else:
            p_dy, p_out, p_lse = dy, out, lse
        grads = attention_backward(p_dy.to(piece.q.dtype), piece.q, piece.k, piece.v, p_out.to(piece.q.dtype),
                                   p_lse.contiguous(), **kwargs)
        if piece.pad is not None:
            rows_q = piece.pad.src_q.flatten()[piece.pad.flat_q]
            rows_k = piece.pad.src_k.flatten()[piece.pad.flat_k]
            dq.index_add_(0, rows_q, piece.pad.unpad_q(grads.dq))
            dk.index_add_(0, rows_k, piece.pad.unpad_k(grads.dk))
            dv.index_add_(0, rows_k, piece.pad.unpad_k(grads.dv))
        else:
            (dq[piece.rows] if piece.rows is not None else dq).add_(grads.dq)
            (dk[piece.keys] if piece.keys is not None else dk).add_(grads.dk)
            (dv[piece.keys] if piece.keys is not None else dv).add_(grads.dv)
        dbiases.append(grads.dbias)
        if grads.dsinks is not None:
            dsinks = grads.dsinks if dsinks is None else dsinks + grads.dsinks
    return dq, dk, dv, dbiases, dsinks
