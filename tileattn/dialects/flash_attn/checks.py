"""Argument checks shared by the flash-attn dialect's functions (the interface and
flash_attn_with_kvcache), with flash-attn's wording."""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from .errors import FlashAttnTypeError, _describe, _fail


def _as_int(fn, name, value, expected="an int"):
    """``value`` as an int if flash-attn's op schema takes it as one (see the module doc)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool:
            return int(value.item())
    elif not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)  # int, numpy integers, 0-d integer arrays
        except TypeError:
            pass
    _fail(fn, name, _describe(value), f"{expected} (or a one-element integer tensor)", FlashAttnTypeError)


#: The longest window side tileattn takes (a larger one is beyond any sequence: pass -1).
_MAX_WINDOW = 2**62


def _window(fn, window_size):
    """flash-attn's ``window_size`` pair as (left, right) ints; -1 (any negative) = unbounded."""
    expected = "a pair (left, right) of ints, -1 = unbounded"
    if isinstance(window_size, torch.Tensor) and window_size.dim() >= 1:
        sides = list(window_size)
    elif isinstance(window_size, (tuple, list)):
        sides = list(window_size)
    else:
        sides = None
    if sides is None or len(sides) != 2:
        _fail(fn, "window_size", _describe(window_size), expected, FlashAttnTypeError)
    window = tuple(_as_int(fn, "window_size", side, expected) for side in sides)
    if max(window) > _MAX_WINDOW:
        _fail(fn, "window_size", window, "sides up to 2**62 (-1 = unbounded)")
    return window


def _check_rank(fn, name, t, rank, shape):
    if not isinstance(t, torch.Tensor):
        _fail(fn, name, type(t).__name__, f"a torch.Tensor of shape {shape}", FlashAttnTypeError)
    if t.dim() != rank:
        _fail(fn, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}", f"a {rank}-d tensor {shape}")


def _check_qkv(fn, q, k, v):
    """flash-attn's consistency checks on q (..., S, H, D), k (..., Sk, Hk, D), v (..., Sk, Hk, Dv),
    ranks already checked (3-d varlen or 4-d)."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _fail(fn, name, f"dtype {t.dtype}", f"q's dtype {q.dtype}", FlashAttnTypeError)
        if t.device != q.device:
            _fail(fn, name, f"device {t.device}", f"q's device {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        _fail(fn, "q", f"dtype {q.dtype}", "fp16, bf16 (flash-attn), fp32 or fp64", FlashAttnTypeError)
    lead = q.dim() - 3  # the batch dim, if any
    if k.shape[:lead] != q.shape[:lead] or v.shape[:-1] != k.shape[:-1]:
        _fail(fn, "k/v", f"shapes {tuple(k.shape)}, {tuple(v.shape)} for q {tuple(q.shape)}",
              "k and v with q's batch and one (seqlen, nheads_k) between them")
    if k.shape[-1] != q.shape[-1]:
        _fail(fn, "k", f"head dim {k.shape[-1]}", f"q's head dim {q.shape[-1]}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        _fail(fn, "k", f"{k.shape[-2]} heads for {q.shape[-2]} query heads",
              "a number of kv heads dividing the query heads (MQA/GQA)")


def _check_options(fn, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs,
                   return_name="return_attn_probs"):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        _fail(fn, "dropout_p", repr(dropout_p), "a float in [0, 1)")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        _fail(fn, "softmax_scale", repr(softmax_scale), "None (= 1/sqrt(headdim)) or a float", FlashAttnTypeError)
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        _fail(fn, "softmax_scale", repr(softmax_scale), "None (= 1/sqrt(headdim)) or a finite float")
    if not isinstance(causal, bool):
        _fail(fn, "causal", repr(causal), "True or False", FlashAttnTypeError)
    window = _window(fn, window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 <= softcap < math.inf:
        _fail(fn, "softcap", repr(softcap), "a finite float >= 0 (0 = off)")
    for name, flag in (("deterministic", deterministic), (return_name, return_probs)):
        if not isinstance(flag, bool):
            _fail(fn, name, repr(flag), "True or False", FlashAttnTypeError)
    return window


def _check_alibi(fn, alibi_slopes, batch, heads, device):
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        _fail(fn, "alibi_slopes", _describe(alibi_slopes), f"an fp32 tensor ({heads},) or ({batch}, {heads})",
              FlashAttnTypeError)
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        _fail(fn, "alibi_slopes", f"shape {tuple(alibi_slopes.shape)}", f"({heads},) or ({batch}, {heads})")
    if alibi_slopes.device != device:
        _fail(fn, "alibi_slopes", f"device {alibi_slopes.device}", f"q's device {device}")
