"""Per-tile score construction for the CPU engine.

A :class:`SequenceProblem` describes one (batch item or varlen sequence) attention problem in the
terms a kernel needs: strided ``(H, S, D)`` tensors and the score options, nothing of the public API.
:meth:`SequenceProblem.scores` turns ``q_tile . k_tile^T`` into base-2 logits with every score
modifier applied, for forward and backward alike, so the two passes can never disagree.

Queries of the ``G = Hq / Hkv`` heads that share a kv head are stacked into one matrix of
``G * block_m`` rows: one GEMM per kv head serves the whole group and K/V are never repeated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ... import scores as S

LOG2E = 1.4426950408889634


@dataclass
class SequenceProblem:
    q: torch.Tensor  # (Hq, Sq, D)
    k: torch.Tensor  # (Hkv, Sk, D), already in the compute dtype
    v: torch.Tensor  # (Hkv, Sk, Dv), already in the compute dtype
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
    def plain(self) -> bool:
        """No score modifier between the GEMM and the softmax: fold scale*log2(e) into q."""
        return self.softcap == 0 and self.bias is None and self.slopes is None

    @property
    def q_factor(self) -> float:
        return self.scale * LOG2E if self.plain else self.scale

    def load_q(self, i0: int, i1: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows [i0, i1) of every query head, stacked per kv head: (Hkv, G*bm, D), pre-scaled."""
        hkv, g, bm = self.heads_kv, self.group, i1 - i0
        block = torch.empty((hkv, g * bm, self.q.shape[2]), dtype=self.compute_dtype, device=self.q.device)
        block.view(hkv, g, bm, -1).copy_(self.q[:, i0:i1].unflatten(0, (hkv, g)))
        return block.mul_(self.q_factor)

    def load_rows(self, x: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """Rows [i0, i1) of an (Hq, Sq, E) tensor stacked per kv head: (Hkv, G*bm, E) in fp32/64."""
        hkv, g, bm = self.heads_kv, self.group, i1 - i0
        block = torch.empty((hkv, g * bm, x.shape[-1]), dtype=self.compute_dtype, device=x.device)
        block.view(hkv, g, bm, -1).copy_(x[:, i0:i1].unflatten(0, (hkv, g)))
        return block

    def tile_mask(self, i0, i1, j0, j1) -> Optional[torch.Tensor]:
        """Bool keep-mask of the tile broadcastable to (Hkv, G, bm, bn), or None if all visible."""
        keep = None
        if not S.band_fully_visible(i0, i1, j0, j1, self.sq, self.sk, self.left, self.right):
            dev = self.q.device
            keep = S.band_keep(
                torch.arange(i0, i1, device=dev), torch.arange(j0, j1, device=dev),
                self.sq, self.sk, self.left, self.right,
            )
        if self.mask is not None:
            m = _slice_broadcast(self.mask, i0, i1, j0, j1)
            m = _group_heads(m, self.heads_kv, self.group)
            keep = m if keep is None else keep & m
        return keep

    def tile_is_empty(self, keep: Optional[torch.Tensor]) -> bool:
        return keep is not None and not bool(keep.any())

    def scores(self, qb, j0, j1, i0, i1, keep):
        """Base-2 logits of the tile, (Hkv, G*bm, bn), and the tanh of the softcap (or None)."""
        s = torch.bmm(qb, self.k[:, j0:j1].transpose(1, 2))
        tanh = None
        if not self.plain:
            hkv, g, bm, bn = self.heads_kv, self.group, i1 - i0, j1 - j0
            s4 = s.view(hkv, g, bm, bn)
            if self.softcap > 0:
                tanh = torch.tanh(s.div_(self.softcap))
                s.copy_(tanh).mul_(self.softcap)
            if self.slopes is not None:
                dev = s.device
                dist = S.alibi_distance(
                    torch.arange(i0, i1, device=dev), torch.arange(j0, j1, device=dev),
                    self.sq, self.sk, s.dtype,
                )
                s4.sub_(self.slopes.view(hkv, g, 1, 1).to(s.dtype) * dist)
            if self.bias is not None:
                b = _slice_broadcast(self.bias, i0, i1, j0, j1)
                s4.add_(_group_heads(b, hkv, g).to(s.dtype))
            s.mul_(LOG2E)
        if keep is not None:
            s.view(self.heads_kv, self.group, i1 - i0, j1 - j0).masked_fill_(~keep, -math.inf)
        return s, tanh

    def dropout_keep(self, i0, i1, j0, j1) -> torch.Tensor:
        """Bool (Hkv, G*bm, bn): which probabilities of the tile survive dropout."""
        dev = self.q.device
        keys = S.dropout_row_keys(
            self.seed, self.batch_index, torch.arange(self.heads_q, device=dev), torch.arange(i0, i1, device=dev)
        )
        keep = S.dropout_keep(keys, torch.arange(j0, j1, device=dev), self.dropout_p)
        return keep.view(self.heads_kv, self.group * (i1 - i0), j1 - j0)


def _slice_broadcast(x: torch.Tensor, i0, i1, j0, j1) -> torch.Tensor:
    """Tile [i0:i1, j0:j1] of an (H?, Sq?, Sk?) tensor whose dims may be broadcast (size 1)."""
    rows = slice(None) if x.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if x.shape[-1] == 1 else slice(j0, j1)
    return x[..., rows, cols]


def _group_heads(x: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """(Hq or 1, r, c) -> broadcastable to (Hkv, G, r, c)."""
    if x.shape[0] == 1:
        return x.unsqueeze(0)
    return x.unflatten(0, (hkv, g))
