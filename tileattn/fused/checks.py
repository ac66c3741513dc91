"""Validation of :func:`tileattn.fused.norm_qkv`'s and :func:`tileattn.fused.attention_out_proj`'s
arguments, before any compute or write: each error names the argument, what was given and what
would work (tileattn's convention, :func:`tileattn.core.modifiers.fail`).

:func:`check_norm_qkv` returns a :class:`NormQKVCall`: the call's tensors in one normal form (three
weights, three biases, rotary tables of the token rows) and its numbers, which the native path, the
custom ops and the composition all read.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Tuple

import torch

from ..core import plans
from ..core.layouts import LAYOUTS, hidden_batched, token_axes
from ..core.modifiers import fail, tensor_metadata
from ..core.spec import FLOAT_DTYPES, build_spec, tracing

IMPLS = ("auto", "native", "composed")
#: this module's kinds of entry in tileattn's plan memo (:mod:`tileattn.core.plans`): norm_qkv calls
#: that passed every check, and attention_out_proj calls whose w_o passed (value: True)
MEMO_KIND = "fused_norm_qkv"
OUT_MEMO_KIND = "fused_out_proj"
#: the numbers of a norm_qkv call that its memo key holds
_SCALARS = ("eps", "num_heads", "num_kv_heads", "head_dim", "rotary_interleaved", "qk_norm_eps", "layout")


class NormQKVCall(NamedTuple):
    x: torch.Tensor
    norm_weight: Optional[torch.Tensor]
    weights: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]             #: w_q, w_k, w_v: (heads * D, hidden)
    biases: Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]
    cos: Optional[torch.Tensor]                                          #: (S, rot/2), (B|1, S, rot/2) or (T, rot/2)
    sin: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]                                       #: (D,) per-head RMSNorm weights
    k_norm: Optional[torch.Tensor]
    kv_cache: Optional[Tuple[torch.Tensor, torch.Tensor]]
    cache_seqlens: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    ints: Tuple[int, int, int, int, int]                                 #: heads, kv heads, head dim, rot, interleaved
    floats: Tuple[float, float]                                          #: eps, qk_norm_eps
    layout: str

    @property
    def heads(self) -> Tuple[int, int, int]:
        return self.ints[0], self.ints[1], self.ints[1]


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        fail(ValueError if isinstance(value, numbers.Integral) and not isinstance(value, bool) else TypeError,
             name, repr(value), "a positive int")
    return int(value)


def _positive_float(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(TypeError, name, repr(value), "a positive float")
    if not value > 0:
        fail(ValueError, name, repr(value), "a positive float")
    return float(value)


def _tensor(name, t, shape, like, what):
    """A float tensor of ``shape`` on ``like``'s device."""
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, type(t).__name__, f"a tensor of shape {shape}: {what}")
    if t.dtype not in FLOAT_DTYPES:
        fail(TypeError, name, f"dtype {t.dtype}", "a float dtype (fp16, bf16, fp32, fp64)")
    if tuple(t.shape) != tuple(shape):
        fail(ValueError, name, f"shape {tuple(t.shape)}", f"{tuple(shape)}: {what}")
    if t.device != like.device:
        fail(ValueError, name, f"device {t.device}", f"device {like.device}, as x")
    return t


def _split(name, value, widths, hidden, x, noun, optional):
    """(t_q, t_k, t_v) of a packed tensor (rows q, k, v) or of a sequence of three tensors."""
    cols = () if hidden is None else (hidden,)
    what = f"the q, k and v projections' {noun}s stacked by rows"
    if isinstance(value, torch.Tensor):
        _tensor(name, value, (sum(widths),) + cols, x, what)
        return tuple(value.split(list(widths), 0))
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        fail(TypeError, name, type(value).__name__, f"one tensor of shape {(sum(widths),) + cols} or three tensors "
             f"(q, k, v): {what}")
    parts = []
    for part, t, width in zip("qkv", value, widths):
        if t is None and optional:
            parts.append(None)
            continue
        parts.append(_tensor(f"{name}[{'qkv'.index(part)}]", t, (width,) + cols, x, f"the {part} projection's {noun}"))
    return tuple(parts)


def _same_dtype(name, t, x):
    if t is not None and t.dtype != x.dtype:
        fail(TypeError, name, f"dtype {t.dtype}", f"x's dtype {x.dtype}")


def check_impl(impl) -> str:
    if impl not in IMPLS:
        fail(ValueError, "impl", repr(impl), f"one of {', '.join(map(repr, IMPLS))}")
    return impl


def check_norm_qkv(x, norm_weight, w_qkv, *, eps, num_heads, num_kv_heads, head_dim, bias_qkv, rope,
                   rotary_interleaved, q_norm_weight, k_norm_weight, qk_norm_eps, layout, kv_cache, cache_seqlens,
                   block_table) -> NormQKVCall:
    if layout not in LAYOUTS:
        fail(ValueError, "layout", repr(layout), f"one of {', '.join(LAYOUTS)}")
    axes = token_axes(layout)
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", type(x).__name__, "a tensor of hidden states")
    if x.dtype not in FLOAT_DTYPES:
        fail(TypeError, "x", f"dtype {x.dtype}", "fp16, bf16, fp32 or fp64")
    shape_name = {"bs": "(batch, seqlen, hidden)", "sb": "(seqlen, batch, hidden)", "s": "(tokens, hidden)"}[axes]
    if x.dim() != len(axes) + 1:
        fail(ValueError, "x", f"shape {tuple(x.shape)}", f"{shape_name} for layout {layout!r}")
    heads = _positive_int("num_heads", num_heads)
    kv_heads = _positive_int("num_kv_heads", num_kv_heads)
    dim = _positive_int("head_dim", head_dim)
    if heads % kv_heads:
        fail(ValueError, "num_kv_heads", kv_heads, f"a divisor of num_heads={heads} (GQA/MQA)")
    eps = _positive_float("eps", eps)
    qk_eps = eps if qk_norm_eps is None else _positive_float("qk_norm_eps", qk_norm_eps)
    hidden = x.shape[-1]
    widths = (heads * dim, kv_heads * dim, kv_heads * dim)
    if norm_weight is not None:
        _tensor("norm_weight", norm_weight, (hidden,), x, "the RMSNorm weight")
    weights = _split("w_qkv", w_qkv, widths, hidden, x, "weight", optional=False)
    for i, w in enumerate(weights):
        _same_dtype("w_qkv" if isinstance(w_qkv, torch.Tensor) else f"w_qkv[{i}]", w, x)
    biases = (None, None, None) if bias_qkv is None else _split(
        "bias_qkv", bias_qkv, widths, None, x, "bias", optional=True)
    for name, t in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if t is not None:
            _tensor(name, t, (dim,), x, "a per-head RMSNorm weight (Qwen3, Gemma 3)")
    batched = hidden_batched(x, layout)
    batch, seqlen = batched.shape[:2]
    cos = sin = None
    rot = 0
    if rope is not None:
        cos, sin, rot = _check_rope(rope, x, batch, seqlen, dim, axes)
    if not isinstance(rotary_interleaved, bool):
        fail(TypeError, "rotary_interleaved", repr(rotary_interleaved), "True (pairs 2i, 2i+1: GPT-J) or False "
             "(halves i, i + rot/2: GPT-NeoX, Llama)")
    if kv_cache is None:
        for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
            if t is not None:
                fail(ValueError, name, "a tensor without kv_cache", "kv_cache=(k_cache, v_cache) to write into")
    else:
        if len(axes) == 1:
            fail(ValueError, "layout", repr(layout), "a layout with a batch axis (BSND, BNSD, BSH, SBH) to write a "
                 "KV cache: cache_seqlens places each sequence's rows")
        kv_cache = _check_cache(kv_cache, cache_seqlens, block_table, x, batch, seqlen, kv_heads, dim)
        grads = [t for t in (x, norm_weight, *weights, *biases, q_norm_weight, k_norm_weight)
                 if t is not None and t.requires_grad]
        if grads and torch.is_grad_enabled():
            fail(ValueError, "kv_cache", "inputs that require grad", "no gradient: writing a KV cache is for "
                 "inference (run under torch.no_grad(), or leave kv_cache out and write the cache yourself)")
    return NormQKVCall(x, norm_weight, weights, biases, cos, sin, q_norm_weight, k_norm_weight, kv_cache,
                       cache_seqlens, block_table, (heads, kv_heads, dim, rot, int(rotary_interleaved)),
                       (eps, qk_eps), layout)


def _metadata(*tensors) -> Optional[tuple]:
    """What validation read of these tensors (None entries kept), or None when one is not plain."""
    found = []
    for t in tensors:
        if t is None:
            found.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            return None
        meta = tensor_metadata(t)
        if meta is None:
            return None
        found.append(meta)
    return tuple(found)


def _parts(value) -> tuple:
    return value if isinstance(value, (tuple, list)) else (value,)


def norm_qkv_call(x, norm_weight, w_qkv, *, eps, num_heads, num_kv_heads, head_dim, bias_qkv, rope,
                  rotary_interleaved, q_norm_weight, k_norm_weight, qk_norm_eps, layout, kv_cache, cache_seqlens,
                  block_table) -> NormQKVCall:
    """:func:`check_norm_qkv`, whose verdict is kept in tileattn's plan memo for the calls that repeat
    a call's shapes, dtypes, strides and numbers (a decode loop): those are put in normal form with no
    check but the values of ``cache_seqlens`` and ``block_table``, which change every step."""
    kwargs = dict(eps=eps, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias_qkv=bias_qkv,
                  rope=rope, rotary_interleaved=rotary_interleaved, q_norm_weight=q_norm_weight,
                  k_norm_weight=k_norm_weight, qk_norm_eps=qk_norm_eps, layout=layout, kv_cache=kv_cache,
                  cache_seqlens=cache_seqlens, block_table=block_table)
    key = None
    # traced calls are checked as they are traced (a plan memo is host state a graph must not read)
    if not tracing() and isinstance(w_qkv, (torch.Tensor, tuple, list)) and (bias_qkv is None or isinstance(
            bias_qkv, (torch.Tensor, tuple, list))) and (rope is None or isinstance(rope, tuple)) \
            and (kv_cache is None or isinstance(kv_cache, tuple)):
        meta = _metadata(x, norm_weight, *_parts(w_qkv), *(() if bias_qkv is None else _parts(bias_qkv)),
                         *(rope or ()), q_norm_weight, k_norm_weight, *(kv_cache or ()), cache_seqlens, block_table)
        if meta is not None:
            key = (MEMO_KIND, meta, isinstance(w_qkv, torch.Tensor), bias_qkv is None or isinstance(
                bias_qkv, torch.Tensor), rope is None, kv_cache is None, torch.is_grad_enabled(),
                *(kwargs[name] for name in _SCALARS))
    try:
        seen = key is not None and plans.get(key) is not None
    except TypeError:  # an unhashable number: no memo
        key, seen = None, False
    if not seen:
        call = check_norm_qkv(x, norm_weight, w_qkv, **kwargs)
        if key is not None:
            plans.put(key, True)
        return call
    heads, kv_heads, dim = int(num_heads), int(num_kv_heads), int(head_dim)
    widths = [heads * dim, kv_heads * dim, kv_heads * dim]
    weights = tuple(w_qkv.split(widths)) if isinstance(w_qkv, torch.Tensor) else tuple(w_qkv)
    biases = (None, None, None) if bias_qkv is None else (
        tuple(bias_qkv.split(widths)) if isinstance(bias_qkv, torch.Tensor) else tuple(bias_qkv))
    cos, sin = rope if rope is not None else (None, None)
    if kv_cache is not None and not tracing():
        seqlen = hidden_batched(x, layout).shape[1]
        _check_cache_values(cache_seqlens, block_table, seqlen, kv_cache[0].shape[:2])
    return NormQKVCall(x, norm_weight, weights, biases, cos, sin, q_norm_weight, k_norm_weight, kv_cache,
                       cache_seqlens, block_table, (heads, kv_heads, dim, 0 if cos is None else 2 * cos.shape[-1],
                                                    int(rotary_interleaved)),
                       (float(eps), float(eps if qk_norm_eps is None else qk_norm_eps)), layout)


def _check_rope(rope, x, batch, seqlen, dim, axes):
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        fail(TypeError, "rope", type(rope).__name__, "(cos, sin) or None")
    cos, sin = rope
    packed = len(axes) == 1
    shapes = "(tokens, rot/2)" if packed else "(seqlen, rot/2) or (batch or 1, seqlen, rot/2)"
    for name, t in (("rope[0] (cos)", cos), ("rope[1] (sin)", sin)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            fail(TypeError, name, type(t).__name__ if not isinstance(t, torch.Tensor) else f"dtype {t.dtype}",
                 f"a float tensor of shape {shapes}")
        if t.device != x.device:
            fail(ValueError, name, f"device {t.device}", f"device {x.device}, as x")
        ok = (t.dim() == 2 and t.shape[0] == seqlen) or (
            not packed and t.dim() == 3 and t.shape[0] in (1, batch) and t.shape[1] == seqlen)
        if not ok or t.shape[-1] < 1 or 2 * t.shape[-1] > dim:
            fail(ValueError, name, f"shape {tuple(t.shape)}", f"{shapes} for {seqlen} rows, with 1 <= rot/2 <= "
                 f"head_dim/2 = {dim // 2} (the rotated dims' frequencies: flash-attn's half-width tables)")
        if t.requires_grad and torch.is_grad_enabled():
            fail(ValueError, name, "a tensor that requires grad", "rotary tables without gradient (detach them)")
    if cos.shape != sin.shape:
        fail(ValueError, "rope", f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)}", "tables of one shape")
    return cos, sin, 2 * cos.shape[-1]


def _check_cache(kv_cache, cache_seqlens, block_table, x, batch, seqlen, kv_heads, dim):
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        fail(TypeError, "kv_cache", type(kv_cache).__name__, "(k_cache, v_cache)")
    paged = block_table is not None
    shape_name = "(num_blocks, block_size, kv_heads, head_dim) pools" if paged else \
        "(batch, cache_len, kv_heads, head_dim) tensors"
    for name, t in (("kv_cache[0] (k_cache)", kv_cache[0]), ("kv_cache[1] (v_cache)", kv_cache[1])):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, type(t).__name__, shape_name)
        if t.dtype != x.dtype:
            fail(TypeError, name, f"dtype {t.dtype}", f"x's dtype {x.dtype}")
        if t.device != x.device:
            fail(ValueError, name, f"device {t.device}", f"device {x.device}, as x")
        if t.dim() != 4 or tuple(t.shape[2:]) != (kv_heads, dim) or (not paged and t.shape[0] != batch):
            fail(ValueError, name, f"shape {tuple(t.shape)}", f"{shape_name} with kv_heads={kv_heads}, head_dim={dim}"
                 + ("" if paged else f", batch={batch}"))
        if t.stride(-1) != 1 and dim > 1:
            fail(ValueError, name, f"strides {t.stride()}", "a unit-stride head dim")
    if kv_cache[0].shape != kv_cache[1].shape:
        fail(ValueError, "kv_cache", f"shapes {tuple(kv_cache[0].shape)} and {tuple(kv_cache[1].shape)}",
             "k and v caches of one shape")
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
            or tuple(cache_seqlens.shape) != (batch,):
        given = type(cache_seqlens).__name__ if not isinstance(cache_seqlens, torch.Tensor) else \
            f"{cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}"
        fail(TypeError, "cache_seqlens", given, f"an int32 tensor of shape ({batch},): the tokens each sequence "
             "already holds (its new rows go after them)")
    if cache_seqlens.device != x.device:
        fail(ValueError, "cache_seqlens", f"device {cache_seqlens.device}", f"device {x.device}, as x")
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch:
            given = type(block_table).__name__ if not isinstance(block_table, torch.Tensor) else \
                f"{block_table.dtype} of shape {tuple(block_table.shape)}"
            fail(TypeError, "block_table", given, f"an int32 tensor of shape ({batch}, max_blocks)")
        if block_table.device != x.device:
            fail(ValueError, "block_table", f"device {block_table.device}", f"device {x.device}, as x")
    if not tracing():
        _check_cache_values(cache_seqlens, block_table, seqlen, kv_cache[0].shape[:2])
    return tuple(kv_cache)


def _check_cache_values(cache_seqlens, block_table, seqlen, pool):
    """Every new row lands inside its sequence's cache (and, paged, on a page of the pool)."""
    blocks, block_size = pool
    capacity = block_size if block_table is None else block_table.shape[1] * block_size
    lengths = cache_seqlens.tolist()
    if min(lengths, default=0) < 0 or max(lengths, default=0) + seqlen > capacity:
        fail(ValueError, "cache_seqlens", lengths, f"lengths >= 0 leaving room for {seqlen} new rows in a cache "
             f"of {capacity} positions per sequence")
    if block_table is not None and seqlen:
        # only the pages the new rows land in are read
        for b, used in enumerate(lengths):
            pages = block_table[b, used // block_size:(used + seqlen - 1) // block_size + 1].tolist()
            if min(pages) < 0 or max(pages) >= blocks:
                fail(ValueError, "block_table", f"pages {pages} for sequence {b}", f"indices in [0, {blocks})")


def check_out_proj(out_width: int, w_o, bias, like: torch.Tensor):
    """``w_o`` (hidden, heads * Dv) of the attention output's dtype and its optional bias (hidden,)."""
    if not isinstance(w_o, torch.Tensor) or w_o.dim() != 2:
        fail(TypeError if not isinstance(w_o, torch.Tensor) else ValueError, "w_o",
             type(w_o).__name__ if not isinstance(w_o, torch.Tensor) else f"shape {tuple(w_o.shape)}",
             f"a (hidden, {out_width}) tensor: the output projection's weight")
    _tensor("w_o", w_o, (w_o.shape[0], out_width), like, "the output projection's weight (hidden, heads * head_dim_v)")
    if w_o.dtype != like.dtype:
        fail(TypeError, "w_o", f"dtype {w_o.dtype}", f"q's dtype {like.dtype}")
    if bias is not None:
        _tensor("bias", bias, (w_o.shape[0],), like, "the output projection's bias")


def out_width(q, k, v, w_o, bias, kwargs) -> int:
    """heads * head_dim_v of the attention ``flash_attention(q, k, v, **kwargs)`` computes, after
    checking its arguments and that ``w_o`` (and ``bias``) project it; kept in the plan memo for the
    calls that repeat the shapes (the attention's own keywords are checked by the attention itself)."""
    meta = None if tracing() else _metadata(q, k, v, w_o, bias)
    key = None if meta is None else (OUT_MEMO_KIND, meta, kwargs.get("layout"), kwargs.get("num_heads"),
                                     kwargs.get("block_table") is None)
    try:
        width = plans.get(key) if key is not None else None
    except TypeError:  # an unhashable num_heads: the checks say what is wrong with it
        key, width = None, None
    if width is None:
        spec = build_spec(q, k, v, **{name: value for name, value in kwargs.items() if name != "backend"})
        width = spec.heads_q * spec.head_dim_v
        check_out_proj(width, w_o, bias, q)
        if key is not None:
            plans.put(key, width)
    return width


def layout_of(kwargs) -> str:
    layout = kwargs.get("layout", "BNSD")
    if layout not in LAYOUTS:
        fail(ValueError, "layout", repr(layout), f"one of {', '.join(LAYOUTS)}")
    return layout
