"""PyTorch's ``scaled_dot_product_attention``, served by tileattn.

Same signature and semantics as :func:`torch.nn.functional.scaled_dot_product_attention`:
``(..., H, S, D)`` tensors, **top-left** aligned ``is_causal`` (``tril(ones(Sq, Sk))``), bool masks with
True = take part, float masks added to the scores, ``scale`` default ``1/sqrt(D)``, GQA only with
``enable_gqa=True``; ``attn_mask`` together with ``is_causal=True`` is an error, as torch documents.
The call is translated onto :func:`tileattn.flash_attention` with ``align="top_left"``.

Under ``torch.autocast`` it behaves as torch's SDPA, which is on autocast's lower-precision list on
CPU and CUDA: floating inputs other than fp64 (query, key, value and a float ``attn_mask``) are cast
to the autocast dtype, so mixed fp32/bf16 inputs are accepted and the output has the autocast dtype;
then the operator runs with autocast off (:func:`autocast_dtype`, :func:`autocast_inputs`).

:func:`patch_sdpa` routes ``torch.nn.functional.scaled_dot_product_attention`` through tileattn
inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch
import torch.nn.functional as F

from ..core.api import flash_attention

__all__ = ["scaled_dot_product_attention", "patch_sdpa", "SdpaArgumentError", "autocast_dtype", "autocast_inputs"]


class SdpaArgumentError(ValueError, RuntimeError):
    """Bad SDPA arguments. Also a RuntimeError, which is what torch raises for the same mistakes."""


def _fail(arg, given, expected, exc=SdpaArgumentError):
    raise exc(f"tileattn.scaled_dot_product_attention: argument '{arg}': got {given}; expected {expected}.")


def autocast_dtype(device_type: str):
    """The dtype torch's autocast casts SDPA's inputs to on ``device_type``, or None when autocast is
    off there (or does not know the device type)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_inputs(dtype, *tensors):
    """Autocast's lower-precision cast, tensor by tensor: floating tensors other than fp64 become
    ``dtype``; fp64, integer and bool tensors (bool masks) and non-tensors are returned unchanged."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, "a torch.Tensor of shape (..., heads, seqlen, head_dim)", TypeError)
    if getattr(t, "is_nested", False):
        _fail(name, "a nested tensor", "a regular strided tensor (nested tensors are not supported)", TypeError)
    if t.dim() < 3:
        _fail(name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}", "at least 3 dims (..., heads, seqlen, head_dim)")


def _lead_shape(query, key, value):
    """The common leading (batch-like) shape: every dim before the heads dim must match exactly."""
    lead = tuple(query.shape[:-3])
    for name, t in (("key", key), ("value", value)):
        if t.dim() != query.dim() or tuple(t.shape[:-3]) != lead:
            _fail(name, f"shape {tuple(t.shape)}", f"the leading dims {lead} of query {tuple(query.shape)}")
    return lead


def _to_4d(t, lead):
    """(lead..., H, S, D) -> (B, H, S, D); a view whenever the leading dims allow it."""
    batch = math.prod(lead) if lead else 1
    return t.reshape((batch,) + tuple(t.shape[-3:]))


def _mask_to_4d(mask, full_shape):
    """Broadcast a mask to ``full_shape`` = (lead..., Hq, Sq, Sk) and fold the leading dims."""
    shape = (1,) * (len(full_shape) - mask.dim()) + tuple(mask.shape)
    mask = mask.reshape(shape)
    lead_full = full_shape[:-3]
    if all(s == 1 for s in shape[:-3]):
        return mask.reshape((1,) + shape[-3:])
    mask = mask.expand(tuple(lead_full) + shape[-3:])
    return mask.reshape((math.prod(lead_full),) + shape[-3:])


def _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    lead = _lead_shape(query, key, value)
    hq, sq, d = query.shape[-3:]
    hk, sk, dk = key.shape[-3:]
    hv, sv, _ = value.shape[-3:]
    if dk != d:
        _fail("key", f"head dim {dk}", f"the head dim of query, {d}")
    if sv != sk or hv != hk:
        _fail("value", f"shape {tuple(value.shape)}", f"{hk} heads and {sk} positions, as key {tuple(key.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        _fail("key/value", f"dtypes {query.dtype}, {key.dtype}, {value.dtype}", "the dtype of query", TypeError)
    if hq != hk:
        if not enable_gqa:
            _fail("key", f"{hk} heads for {hq} query heads",
                  "as many heads as query, or enable_gqa=True for grouped-query attention")
        if hq % hk:
            _fail("key", f"{hk} heads for {hq} query heads", "a number of kv heads dividing the query heads")
    if not isinstance(is_causal, bool):
        _fail("is_causal", repr(is_causal), "True or False", TypeError)
    if attn_mask is not None:
        if is_causal:
            # torch documents this as an error (its math path raises; its CPU flash kernel silently
            # and-s the two): refuse it so code written here runs on every torch path.
            _fail("attn_mask", "a mask together with is_causal=True",
                  "only one of attn_mask and is_causal (and-ing them: pass the causal pattern inside the mask)")
        if not isinstance(attn_mask, torch.Tensor):
            _fail("attn_mask", type(attn_mask).__name__, "a bool or float tensor", TypeError)
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            _fail("attn_mask", f"dtype {attn_mask.dtype}", f"torch.bool or the query dtype {query.dtype}", TypeError)
        full = lead + (hq, sq, sk)
        try:
            torch.broadcast_shapes(tuple(attn_mask.shape), full)
            ok = attn_mask.dim() <= len(full)
        except RuntimeError:
            ok = False
        if not ok:
            _fail("attn_mask", f"shape {tuple(attn_mask.shape)}", f"a shape broadcastable to {full}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        _fail("dropout_p", repr(dropout_p), "a float in [0, 1)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        _fail("scale", repr(scale), "None or a float", TypeError)
    return lead


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """Drop-in :func:`torch.nn.functional.scaled_dot_product_attention` on tileattn.

    Differences from torch: dropout uses tileattn's counter-based RNG (seeded from torch's default
    generator, so ``torch.manual_seed`` makes it reproducible, but the dropped positions differ from
    torch's). Rows where every key is masked out give 0, as torch 2.13 does (older torch gave NaN).
    Under ``torch.autocast`` the inputs are cast as torch casts its SDPA's (see the module docstring).
    """
    device_type = query.device.type if isinstance(query, torch.Tensor) else None
    cast_to = autocast_dtype(device_type) if device_type is not None else None
    if cast_to is not None:
        query, key, value, attn_mask = autocast_inputs(cast_to, query, key, value, attn_mask)
    lead = _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    q4, k4, v4 = (_to_4d(t, lead) for t in (query, key, value))
    mask = bias = None
    if attn_mask is not None:
        full = lead + (query.shape[-3], query.shape[-2], key.shape[-2])
        m4 = _mask_to_4d(attn_mask, full)
        if m4.dtype == torch.bool:
            mask = m4
        else:
            bias = m4
    with torch.autocast(device_type, enabled=False) if cast_to is not None else contextlib.nullcontext():
        out = flash_attention(q4, k4, v4, causal=is_causal, align="top_left", mask=mask, bias=bias, scale=scale,
                              dropout_p=float(dropout_p))
    return out.reshape(tuple(query.shape[:-1]) + (value.shape[-1],))


_ORIGINAL_STACK = []


@contextlib.contextmanager
def patch_sdpa():
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through tileattn in a ``with`` block.

    The previous function is restored on exit, also when the block raises; nested blocks restore in
    order. Code that imported the function object itself before the block keeps the original.
    """
    _ORIGINAL_STACK.append(F.scaled_dot_product_attention)
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield scaled_dot_product_attention
    finally:
        F.scaled_dot_product_attention = _ORIGINAL_STACK.pop()
