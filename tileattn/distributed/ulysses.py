"""Ulysses (DeepSpeed): trade the sequence shard for a head shard with one all-to-all, and back.

Before attention each of the ``U`` ranks holds every head of ``S/U`` tokens; after
:func:`seq_to_heads` it holds ``H/U`` heads of all the tokens of its group, in ascending position
order, and attention over them needs no further communication. :func:`heads_to_seq` is the
inverse (for the output), and each is the other's backward, so gradients take the same two
all-to-alls in reverse. Tensors are internal ``(B, H, S, X)``: X is the head dim for q/k/v/out, 1
for the LSE, the key length for a bias or mask sharded by query rows.

Uneven shards are fine: each rank's token count comes from the plan, and the all-to-all moves
flattened buffers with per-rank split sizes.

GQA with ``Hkv`` kv heads on ``U`` ranks: kv heads are repeated ``U / gcd(Hkv, U)`` times (to
``lcm(Hkv, U)`` heads, which divides ``Hq``), the least that gives every rank whole kv heads for its
query heads; their gradients are summed back by autograd. With ``Hkv % U == 0`` nothing is repeated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import comm


@dataclass
class Exchange:
    """One Ulysses group: this rank's place, each member's token count, the gathered order."""

    group: comm.Group
    lengths: List[int]  # tokens held by each member of the group
    order: Optional[torch.Tensor]  # sorts gathered tokens by position (None: already sorted)

    def inverse(self) -> Optional[torch.Tensor]:
        if self.order is None:
            return None
        inv = torch.empty_like(self.order)
        inv[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return inv


def _send_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def seq_to_heads(ex: Exchange, x: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, H, S_local, X) -> (B, H/U, S_group, X) in ascending position order."""
    g, u = ex.group, ex.group.size
    b, h, s, e = x.shape
    src = _send_dtype(x)
    send = src.reshape(b, u, h // u, s, e).transpose(0, 1).contiguous().view(-1)
    piece = b * (h // u) * e
    recv = torch.empty(piece * sum(ex.lengths), dtype=src.dtype, device=x.device)
    comm.all_to_all(g, recv, send, [piece * n for n in ex.lengths], [piece * s] * u, tag,
                    f"the Ulysses all-to-all of {tag} (sequence -> heads)")
    parts, at = [], 0
    for n in ex.lengths:
        parts.append(recv[at:at + piece * n].view(b, h // u, n, e))
        at += piece * n
    out = torch.cat(parts, 2)
    if ex.order is not None:
        out = out.index_select(2, ex.order.to(x.device))
    return out.to(x.dtype)


def heads_to_seq(ex: Exchange, y: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, H/U, S_group, X) in ascending position order -> (B, H, S_local, X)."""
    g, u = ex.group, ex.group.size
    inv = ex.inverse()
    if inv is not None:
        y = y.index_select(2, inv.to(y.device))
    b, hu, _, e = y.shape
    src = _send_dtype(y)
    send = torch.cat([p.reshape(-1) for p in torch.split(src, ex.lengths, dim=2)])
    mine = ex.lengths[g.rank]
    piece = b * hu * e
    recv = torch.empty(piece * mine * u, dtype=src.dtype, device=y.device)
    comm.all_to_all(g, recv, send, [piece * mine] * u, [piece * n for n in ex.lengths], tag,
                    f"the Ulysses all-to-all of {tag} (heads -> sequence)")
    out = recv.view(u, b, hu, mine, e).transpose(0, 1).reshape(b, u * hu, mine, e)
    return out.to(y.dtype)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: Exchange, x: torch.Tensor, tag: str):
        ctx.ex, ctx.tag = ex, tag
        return seq_to_heads(ex, x, tag)

    @staticmethod
    def backward(ctx, grad):
        return None, heads_to_seq(ctx.ex, grad.contiguous(), "grad_" + ctx.tag), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: Exchange, y: torch.Tensor, tag: str):
        ctx.ex, ctx.tag = ex, tag
        return heads_to_seq(ex, y, tag)

    @staticmethod
    def backward(ctx, grad):
        return None, seq_to_heads(ctx.ex, grad.contiguous(), "grad_" + ctx.tag), None


def kv_repeats(heads_kv: int, ulysses: int) -> int:
    """How many times each kv head is repeated so that ``ulysses`` ranks each get whole kv heads."""
    return ulysses // math.gcd(heads_kv, ulysses)


def head_slice(rank: int, heads: int, ulysses: int) -> slice:
    per = heads // ulysses
    return slice(rank * per, (rank + 1) * per)
