"""User functions evaluated by PyTorch on tiles (``torch.vmap`` over index vectors): the exact reference
applies them this way, and so does every path that runs a function the compiler refuses."""

from __future__ import annotations

import torch

from .trace import IndexByTensors, check_return


def _checked(kind: str, fn):
    """``fn`` whose value, per element, is checked (:func:`~.trace.check_return`) and made a tensor."""
    def one(*args):
        out = fn(*args)
        check_return(kind, out)
        if isinstance(out, torch.Tensor):
            return out
        return torch.tensor(out, dtype=args[0].dtype if kind == "score" else torch.bool, device=args[0].device)
    return one


def score_tile(score_mod, scores, b, h, q, kv):
    """``score_mod`` on a tile: ``scores`` (R, C), ``b``, ``h``, ``q`` (R,), ``kv`` (C,) -> (R, C)."""
    inner = torch.vmap(_checked("score", score_mod), in_dims=(0, None, None, None, 0))
    with IndexByTensors():
        return torch.vmap(inner, in_dims=(0, 0, 0, 0, None))(scores, b, h, q, kv)


def mask_tile(mask_mod, b, h, q, kv):
    """``mask_mod`` on a tile of rows ``b``, ``h``, ``q`` (R,) x columns ``kv`` (C,) -> bool (R, C)."""
    inner = torch.vmap(_checked("mask", mask_mod), in_dims=(None, None, None, 0))
    with IndexByTensors():
        out = torch.vmap(inner, in_dims=(0, 0, 0, None))(b, h, q, kv)
    return out.expand(b.numel(), kv.numel())
