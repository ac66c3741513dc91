"""User functions evaluated by PyTorch on tiles (``torch.vmap`` over index vectors): the exact reference
applies them this way, and so does every path that runs a function the compiler refuses."""

from __future__ import annotations

import torch

from .trace import IndexByTensors


def score_tile(score_mod, scores, b, h, q, kv):
    """``score_mod`` on a tile: ``scores`` (R, C), ``b``, ``h``, ``q`` (R,), ``kv`` (C,) -> (R, C)."""
    inner = torch.vmap(score_mod, in_dims=(0, None, None, None, 0))
    with IndexByTensors():
        return torch.vmap(inner, in_dims=(0, 0, 0, 0, None))(scores, b, h, q, kv)


def mask_tile(mask_mod, b, h, q, kv):
    """``mask_mod`` on a tile of rows ``b``, ``h``, ``q`` (R,) x columns ``kv`` (C,) -> bool (R, C)."""
    inner = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    with IndexByTensors():
        out = torch.vmap(inner, in_dims=(0, 0, 0, None))(b, h, q, kv)
    return out.expand(b.numel(), kv.numel())
