"""The flash-attn dialect's errors: flash-attn's checks are ``TORCH_CHECK``s and its arguments go
through a ``torch.library`` op schema, both of which raise RuntimeError; Python callers catch
ValueError/TypeError, so every argument error here is both."""

from __future__ import annotations

import torch


class FlashAttnArgumentError(ValueError, RuntimeError):
    """A bad argument value. Also a RuntimeError, which flash-attn's checks raise."""


class FlashAttnTypeError(TypeError, RuntimeError):
    """A bad argument type. Also a RuntimeError, which flash-attn's op schema raises."""


def _fail(fn, arg, given, expected, exc=FlashAttnArgumentError):
    if exc is TypeError:
        exc = FlashAttnTypeError
    raise exc(f"tileattn.compat.flash_attn.{fn}: argument '{arg}': got {given}; expected {expected}.")


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{value!r} ({type(value).__name__})"
