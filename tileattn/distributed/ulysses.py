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


def _slots(ex: Exchange, device) -> List[torch.Tensor]:
    """For each member, the positions its tokens take in the gathered, position-sorted sequence."""
    inv = ex.inverse()
    slots, at = [], 0
    for n in ex.lengths:
        slots.append(torch.arange(at, at + n, device=device) if inv is None else inv[at:at + n].to(device))
        at += n
    return slots


def seq_to_heads(ex: Exchange, x: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, H, S_local, X) -> (B, H/U, S_group, X) in ascending position order. Each member's piece is
    written straight into its slots of the result: no concatenated or reordered copy in between."""
    g, u = ex.group, ex.group.size
    b, h, s, e = x.shape
    src = _send_dtype(x)
    send = src.reshape(b, u, h // u, s, e).transpose(0, 1).contiguous().view(-1)
    piece = b * (h // u) * e
    recv = torch.empty(piece * sum(ex.lengths), dtype=src.dtype, device=x.device)
    comm.all_to_all(g, recv, send, [piece * n for n in ex.lengths], [piece * s] * u, tag,
                    f"the Ulysses all-to-all of {tag} (sequence -> heads)")
    del send
    out = torch.empty(b, h // u, sum(ex.lengths), e, dtype=x.dtype, device=x.device)
    at = 0
    for n, slots in zip(ex.lengths, _slots(ex, x.device)):
        out.index_copy_(2, slots, recv[at:at + piece * n].view(b, h // u, n, e).to(x.dtype))
        at += piece * n
    return out


def heads_to_seq(ex: Exchange, y: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, H/U, S_group, X) in ascending position order -> (B, H, S_local, X). Each member's rows are
    gathered straight into its piece of the send buffer."""
    g, u = ex.group, ex.group.size
    b, hu, _, e = y.shape
    src = _send_dtype(y)
    piece = b * hu * e
    send = torch.empty(piece * sum(ex.lengths), dtype=src.dtype, device=y.device)
    at = 0
    for n, slots in zip(ex.lengths, _slots(ex, y.device)):
        torch.index_select(src, 2, slots, out=send[at:at + piece * n].view(b, hu, n, e))
        at += piece * n
    mine = ex.lengths[g.rank]
    recv = torch.empty(piece * mine * u, dtype=src.dtype, device=y.device)
    comm.all_to_all(g, recv, send, [piece * mine] * u, [piece * n for n in ex.lengths], tag,
                    f"the Ulysses all-to-all of {tag} (heads -> sequence)")
    del send
    out = recv.view(u, b, hu, mine, e).transpose(0, 1).reshape(b, u * hu, mine, e)
    return out.to(y.dtype)


def _differentiable(name: str, there, back) -> type:
    """An autograd function ``apply(ex, x, tag)`` running the all-to-all ``there``; its gradient
    travels the other way, through ``back``."""

    def forward(ctx, ex: Exchange, x: torch.Tensor, tag: str):
        ctx.ex, ctx.tag = ex, tag
        return there(ex, x, tag)

    def backward(ctx, grad):
        return None, back(ctx.ex, grad.contiguous(), "grad_" + ctx.tag), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward),
                                                   "__module__": __name__})


#: (B, H, S_local, X) -> (B, H/U, S_group, X) and back, differentiable.
SeqToHeads = _differentiable("SeqToHeads", seq_to_heads, heads_to_seq)
HeadsToSeq = _differentiable("HeadsToSeq", heads_to_seq, seq_to_heads)


def kv_repeats(heads_kv: int, ulysses: int) -> int:
    """How many times each kv head is repeated so that ``ulysses`` ranks each get whole kv heads."""
    return ulysses // math.gcd(heads_kv, ulysses)


def head_slice(rank: int, heads: int, ulysses: int) -> slice:
    per = heads // ulysses
    return slice(rank * per, (rank + 1) * per)
