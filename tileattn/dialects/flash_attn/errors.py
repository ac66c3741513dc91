"""The flash-attn dialect's errors: flash-attn's checks are ``TORCH_CHECK``s and its arguments go
through a ``torch.library`` op schema, both of which raise RuntimeError; Python callers catch
ValueError/TypeError, so every argument error here is both. What tileattn's core raises under a
dialect call (its validation, :class:`tileattn.NoBackendError`) leaves it as these classes too
(:class:`core_errors`): ``except RuntimeError`` catches it as with flash-attn, and tileattn's own
``except ValueError`` / ``except tileattn.NoBackendError`` still do."""

from __future__ import annotations

import torch

from ...core.dispatch import NoBackendError
from .. import CoreErrors


class FlashAttnArgumentError(ValueError, RuntimeError):
    """A bad argument value. Also a RuntimeError, which flash-attn's checks raise."""


class FlashAttnTypeError(TypeError, RuntimeError):
    """A bad argument type. Also a RuntimeError, which flash-attn's op schema raises."""


class FlashAttnNoBackendError(NoBackendError, RuntimeError):
    """No engine runs the call (:class:`tileattn.NoBackendError`, a ValueError). Also a RuntimeError,
    which flash-attn raises for a call its kernels do not take."""


class core_errors(CoreErrors):
    """Re-raise what tileattn's core raises as the dialect's class (also a RuntimeError), the message
    kept and prefixed with the function's name."""

    __slots__ = ()
    prefix = "tileattn.compat.flash_attn"
    kept = (FlashAttnArgumentError, FlashAttnTypeError, FlashAttnNoBackendError)
    classes = ((NoBackendError, FlashAttnNoBackendError), (TypeError, FlashAttnTypeError),
               (ValueError, FlashAttnArgumentError))


def _fail(fn, arg, given, expected, exc=FlashAttnArgumentError):
    if exc is TypeError:
        exc = FlashAttnTypeError
    raise exc(f"tileattn.compat.flash_attn.{fn}: argument '{arg}': got {given}; expected {expected}.")


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{value!r} ({type(value).__name__})"
