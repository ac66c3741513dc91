"""Merging partial attention results by their log-sum-exp (split-KV, ring attention, sinks).

Attention over keys ``K = K_1 ∪ ... ∪ K_n`` is a weighted mix of the attentions over each part::

    lse = log(sum_i exp(lse_i))        out = sum_i exp(lse_i - lse) * out_i

:func:`merge_weights` is the one implementation of that rule; every merge in tileattn goes through
it: :func:`merge_attentions` (the public merge), :func:`merge_into` (in place, what ring attention
does after each block), :func:`merge_sink`, and the sinks of the operator, of the reference and of
the Hugging Face integration (a sink is a part with output 0 and LSE = the sink logit).

It computes in the LSEs' dtype with a detached maximum as stabiliser, so that no ``exp``
overflows; a row whose every part is empty (``lse_i = -inf``) gets weights 0 and LSE -inf, and a
part of ``+inf`` (a sink of +inf) takes all the weight, both with zero gradients rather than NaN.
Differentiable through plain autograd.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

from .modifiers import fail
from .layouts import LAYOUTS, row_factor


def merge_weights(*lses: torch.Tensor) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
    """``((w_1, ..., w_n), lse)``: the weights ``exp(lse_i - lse)`` of partial results and their merged
    LSE. The LSEs broadcast against each other (a sink (1, H, 1) against an LSE (B, H, S))."""
    stacked = torch.stack(torch.broadcast_tensors(*lses))
    infinite = torch.isposinf(stacked)
    taken = infinite.any(0)
    # Rows with a part of +inf: those parts share the weight, as constants (no inf - inf).
    stacked = torch.where(taken, torch.where(infinite, 0.0, -math.inf), stacked)
    top = stacked.amax(0).detach()
    top = top.masked_fill(~torch.isfinite(top), 0.0)
    total = torch.exp(stacked - top).sum(0)
    seen = total > 0
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, torch.ones_like(total))), -math.inf)
    weights = torch.exp(stacked - lse.masked_fill(~seen, 0.0))
    return tuple(weights.unbind(0)), lse.masked_fill(taken, math.inf)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
               scratch: bool = False) -> None:
    """In place, ``(out, lse) <- merge((out, lse), (part_out, part_lse))``; ``out`` (..., S, Dv) fp32,
    ``lse`` (..., S). ``scratch=True`` lets it scale ``part_out`` in place instead of allocating a
    temporary the size of the output (ring attention does, block after block)."""
    (w_old, w_new), new = merge_weights(lse, part_lse)
    w_new = w_new.unsqueeze(-1)
    part = part_out.mul_(w_new) if scratch and part_out.dtype == out.dtype else part_out.to(out.dtype) * w_new
    out.mul_(w_old.unsqueeze(-1)).add_(part)
    lse.copy_(new)


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """In place: add one sink logit per head (``sinks`` (H,), heads on dim -2 of ``lse``) to every
    row's softmax denominator: the merge with a partial result of output 0 and LSE = sink."""
    (weight, _), new = merge_weights(lse, sinks.to(lse.dtype).view(-1, 1))
    out.mul_(weight.unsqueeze(-1))
    lse.copy_(new)


def merge_attentions(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *, layout: str = "BNSD",
                     out_dtype=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results ``(out_i, lse_i)`` over disjoint key sets into ``(out, lse)``.

    ``outs`` are outputs in ``layout`` (as :func:`tileattn.attention_partial` returns them, fp32),
    ``lses`` their natural-log LSEs ((B, H, S), or (H, T) for TND). Returns ``out`` in ``out_dtype``
    (default: the accumulation dtype) and ``lse`` in fp32 (fp64 for fp64 parts).
    """
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)) or not outs:
        fail(TypeError, "outs/lses", f"{type(outs).__name__}/{type(lses).__name__}", "two non-empty lists of tensors")
    if len(outs) != len(lses):
        fail(ValueError, "lses", f"{len(lses)} tensors for {len(outs)} outputs", "one LSE per output")
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        fail(ValueError, "layout", repr(layout), "one of " + ", ".join(repr(x) for x in LAYOUTS))
    layout = layout.upper()
    for i, (o, l) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(l, torch.Tensor):
            fail(TypeError, f"outs[{i}]/lses[{i}]", f"{type(o).__name__}/{type(l).__name__}", "tensors")
        if o.shape != outs[0].shape or l.shape != lses[0].shape:
            fail(ValueError, f"outs[{i}]/lses[{i}]", f"shapes {tuple(o.shape)}/{tuple(l.shape)}",
                 f"the shapes of the first part {tuple(outs[0].shape)}/{tuple(lses[0].shape)}")
    acc = torch.float64 if any(t.dtype == torch.float64 for t in list(outs) + list(lses)) else torch.float32
    weights, lse = merge_weights(*(l.to(acc) for l in lses))
    out = None
    for o, w in zip(outs, weights):
        term = row_factor(w, layout, o.shape[-1]) * o.to(acc)
        out = term if out is None else out + term
    return out.to(out_dtype or acc), lse
