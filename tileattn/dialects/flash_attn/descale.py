"""FlashAttention-3's fp8 inputs and ``q_descale`` / ``k_descale`` / ``v_descale`` on
``flash_attn_func`` and ``flash_attn_with_kvcache``, lowered onto the core's quantised cache
(:mod:`tileattn.core.kvquant`).

FA3 semantics: q, k, v may be float8 (e4m3; e5m2 is read too); each descale is an fp32 tensor of shape
(batch, nheads_k) (or None = 1); the attention is that of ``q * q_descale``, ``k * k_descale``,
``v * v_descale`` (per sequence and kv head, the query heads of a kv head sharing its q_descale), and
the output of fp8 inputs is bf16. Here fp8 queries are widened to bf16 (exact: every e4m3 and e5m2
value is a bf16 value), the cache is read as stored (the native kernels dequantise in their tile
loop), and the descales become the core's per-sequence scales. Forward only.
"""

from __future__ import annotations

import torch

from .errors import FlashAttnTypeError, _describe, _fail

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NAMES = ("q_descale", "k_descale", "v_descale")


def wanted(q, k, v, descales) -> bool:
    """Whether the call is an FA3 fp8 / descaled call."""
    return any(d is not None for d in descales) or any(getattr(t, "dtype", None) in FP8 for t in (q, k, v))


def lower(fn, q, k, v, descales, batch, heads_k, per_sequence_axis):
    """(q as the core reads it, the core's scale keywords). ``per_sequence_axis``: the cache is a paged
    pool or packed (the scales get a leading batch axis) rather than a padded (B, S, Hk, D) cache."""
    if k.dtype != v.dtype:
        _fail(fn, "v", f"dtype {v.dtype}", f"k's dtype {k.dtype}", FlashAttnTypeError)
    if q.dtype in FP8:
        if k.dtype not in FP8:
            _fail(fn, "q", f"dtype {q.dtype} with k of dtype {k.dtype}", "fp8 q with an fp8 cache", FlashAttnTypeError)
        q = q.to(torch.bfloat16)  # exact
    elif q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _fail(fn, "q", f"dtype {q.dtype} with descales or an fp8 cache", "fp8, bf16, fp16 or fp32", FlashAttnTypeError)
    if k.dtype not in FP8 and k.dtype != q.dtype:
        _fail(fn, "k", f"dtype {k.dtype}", f"an fp8 dtype or q's dtype {q.dtype}", FlashAttnTypeError)
    checked = []
    for name, d in zip(_NAMES, descales):
        if d is None:
            checked.append(None)
            continue
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            _fail(fn, name, _describe(d), f"an fp32 tensor of shape (batch={batch}, nheads_k={heads_k})",
                  FlashAttnTypeError)
        if tuple(d.shape) != (batch, heads_k):
            _fail(fn, name, f"shape {tuple(d.shape)}", f"(batch={batch}, nheads_k={heads_k})")
        if d.device != q.device:
            _fail(fn, name, f"device {d.device}", f"q's device {q.device}")
        checked.append(d)
    q_d, k_d, v_d = checked
    kv_shape = (batch, 1, 1, heads_k, 1) if per_sequence_axis else (batch, 1, heads_k, 1)
    return q, dict(q_scale=q_d, k_scale=None if k_d is None else k_d.reshape(kv_shape),
                   v_scale=None if v_d is None else v_d.reshape(kv_shape))


def refuse_training(fn, dropout_p, return_attn_probs):
    """fp8 / descaled calls are inference only, as in FlashAttention-3's fp8 path."""
    if dropout_p:
        _fail(fn, "dropout_p", repr(dropout_p), "0 with fp8 inputs or descales (inference only)")
    if return_attn_probs:
        _fail(fn, "return_attn_probs", True, "False with fp8 inputs or descales")
