"""Shared pieces of the torch_npu dialect: error classes, argument checks, layouts.

Errors. torch_npu raises ``RuntimeError`` for bad arguments (its C++ ``TORCH_CHECK``), and Ascend
code catches that; tileattn raises ``ValueError``/``TypeError``. The dialect's errors derive from
both, so either ``except`` clause catches them. Every message names the torch_npu argument, what
was given and what would work, and is raised before any compute.
"""

from __future__ import annotations

import numbers
import warnings
from typing import List, Optional

import torch

from .. import CoreErrors

#: torch_npu's "no limit" for pre/next tokens.
UNBOUNDED = 2147483647
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WARNED = set()


class NpuValueError(ValueError, RuntimeError):
    """A bad argument value (a ``RuntimeError`` as in torch_npu, a ``ValueError`` as in tileattn)."""


class NpuTypeError(TypeError, RuntimeError):
    """A bad argument type (a ``RuntimeError`` as in torch_npu, a ``TypeError`` as in tileattn)."""


class NpuNotImplementedError(NotImplementedError):
    """A documented torch_npu feature tileattn does not provide (``NotImplementedError`` is a
    ``RuntimeError``, so Ascend code that catches torch_npu's errors catches this too)."""


def fail(fn: str, arg: str, given, expected: str, exc=NpuValueError):
    raise exc(f"tileattn.npu.{fn}: argument '{arg}': got {given}; expected {expected}.")


def refuse(fn: str, what: str, instead: str):
    """Raise for a documented feature that is not provided, naming it and what to do instead."""
    raise NpuNotImplementedError(f"tileattn.npu.{fn}: {what} is not supported; {instead}.")


def warn_once(key, message: str):
    """Warn once per ``key`` per process: a call pattern whose meaning differs from what its
    arguments suggest (e.g. a causal sparse_mode without the mask that enables it)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"tileattn.npu: {message}", UserWarning, stacklevel=4)


def reset_warnings():
    """Forget which warnings were given (tests)."""
    _WARNED.clear()


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_int(fn, name, value, minimum=None) -> int:
    if not is_int(value):
        fail(fn, name, repr(value), "an int", NpuTypeError)
    if minimum is not None and value < minimum:
        fail(fn, name, value, f"an int >= {minimum}")
    return int(value)


def check_float(fn, name, value, note="a finite float") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(fn, name, repr(value), note, NpuTypeError)
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        fail(fn, name, value, note)
    return value


def int_list(fn, name, value) -> Optional[List[int]]:
    """A list/tuple/1-d integer tensor of ints as a Python list (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            fail(fn, name, f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}",
                 "a list of ints or a 1-d integer tensor", NpuTypeError)
        return [int(x) for x in value.tolist()]
    if not isinstance(value, (list, tuple)) or not all(is_int(x) for x in value):
        fail(fn, name, repr(value), "a list of ints", NpuTypeError)
    return [int(x) for x in value]


def check_tensor(fn, name, t, rank=None, dtypes=FLOAT_DTYPES, what=""):
    if not isinstance(t, torch.Tensor):
        fail(fn, name, type(t).__name__, f"a torch.Tensor{what}", NpuTypeError)
    if dtypes is not None and t.dtype not in dtypes:
        fail(fn, name, f"dtype {t.dtype}", "one of " + ", ".join(str(d).replace("torch.", "") for d in dtypes),
             NpuTypeError)
    if rank is not None and t.dim() not in (rank if isinstance(rank, tuple) else (rank,)):
        fail(fn, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}", f"a {rank}-d tensor{what}")
    return t


def check_layout(fn, name, value, allowed) -> str:
    """torch_npu upper-cases the layout string before checking it."""
    if not isinstance(value, str):
        fail(fn, name, repr(value), "a string, one of " + ", ".join(repr(x) for x in allowed), NpuTypeError)
    if value.upper() not in allowed:
        fail(fn, name, repr(value), "one of " + ", ".join(repr(x) for x in allowed) + " (case-insensitive)")
    return value.upper()


def band_side(value: int) -> Optional[int]:
    """pre/next tokens as a band side: ``None`` (unbounded) for torch_npu's 2147483647 and above."""
    return None if value >= UNBOUNDED else int(value)


class core_errors(CoreErrors):
    """Re-raise a ``ValueError``/``TypeError`` from tileattn's validation as the dialect's class
    (also a ``RuntimeError``), keeping the message."""

    __slots__ = ()
    prefix = "tileattn.npu"
    kept = (NpuValueError, NpuTypeError, NotImplementedError)
    classes = ((TypeError, NpuTypeError), (ValueError, NpuValueError))
