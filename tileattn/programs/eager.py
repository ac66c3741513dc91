"""User functions evaluated by PyTorch on tiles (``torch.vmap`` over index vectors): the exact reference
applies them this way, and so does every path that runs a function the compiler refuses."""

from __future__ import annotations

import contextlib

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


class Replaced(torch.overrides.TorchFunctionMode):
    """Every torch call of the function sees ``replace[id(t)]`` where it was given the tensor ``t`` (a
    captured table read as a wider copy, whose gradient then sums in that precision)."""

    def __init__(self, replace):
        super().__init__()
        self.replace = replace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def swap(x):
            return self.replace.get(id(x), x) if isinstance(x, torch.Tensor) else x
        args, kwargs = torch.utils._pytree.tree_map(swap, (args, kwargs or {}))
        return func(*args, **kwargs)


def score_tile(score_mod, scores, b, h, q, kv, replace=None):
    """``score_mod`` on a tile: ``scores`` (R, C), ``b``, ``h``, ``q`` (R,), ``kv`` (C,) -> (R, C);
    ``replace``: id of a captured tensor -> the tensor the function reads instead (:class:`Replaced`)."""
    inner = torch.vmap(_checked("score", score_mod), in_dims=(0, None, None, None, 0))
    # IndexByTensors entered last runs first: t[i] reaches Replaced as aten.index(t, [i])
    with Replaced(replace) if replace else contextlib.nullcontext(), IndexByTensors():
        return torch.vmap(inner, in_dims=(0, 0, 0, 0, None))(scores, b, h, q, kv)


def mask_tile(mask_mod, b, h, q, kv):
    """``mask_mod`` on a tile of rows ``b``, ``h``, ``q`` (R,) x columns ``kv`` (C,) -> bool (R, C)."""
    inner = torch.vmap(_checked("mask", mask_mod), in_dims=(None, None, None, 0))
    with IndexByTensors():
        out = torch.vmap(inner, in_dims=(0, 0, 0, None))(b, h, q, kv)
    return out.expand(b.numel(), kv.numel())
