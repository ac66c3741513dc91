"""The attention operator as ``torch.library`` custom ops, with autograd.

``tileattn::attention_forward`` and ``tileattn::attention_backward`` are opaque to ``torch.compile``
(fake implementations give their output shapes), so a compiled graph calls them as single nodes with
no graph break. Autograd is registered on the forward op: it saves only q, k, v, out and the LSE (the
dropout mask is regenerated from the seed, never stored) and calls the backward op, whose own
autograd raises a clear error (no double backward).

Arguments travel as tensors and plain scalars; the chosen backend's name travels too, so dispatch
happens once, in Python, before anything is traced or computed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .dispatch import get_backend
from .spec import make_inputs, user_shape

_UNBOUNDED = -1


def _rebuild(q, k, v, mask, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, layout, num_heads,
             scale, causal, window_left, window_right, softcap, dropout_p, seed, deterministic):
    return make_inputs(
        q, k, v, layout=layout, num_heads=num_heads if num_heads > 0 else None, scale=scale,
        causal=causal, window=(window_left, window_right), mask=mask, bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic,
    )


@torch.library.custom_op("tileattn::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
    alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    layout: str, num_heads: int, scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, dropout_p: float, seed: int, deterministic: bool, backend: str,
) -> Tuple[Tensor, Tensor]:
    inp = _rebuild(q, k, v, mask, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, layout, num_heads,
                   scale, causal, window_left, window_right, softcap, dropout_p, seed, deterministic)
    out, lse = get_backend(backend).forward(inp)
    return out.contiguous(), lse.contiguous()  # the layout the fake implementation promises


def _forward_shapes(q, k, v, layout, num_heads):
    """(out shape, lse shape) from the raw tensors, without touching data (for fake tensors)."""
    if layout == "TND":
        hq, dv = q.shape[1], v.shape[2]
        return (q.shape[0], hq, dv), (hq, q.shape[0])
    if layout in ("BSH", "SBH"):
        d = q.shape[2] // num_heads
        hkv = k.shape[2] // d
        hq, dv = num_heads, v.shape[2] // hkv
        b, s = (q.shape[0], q.shape[1]) if layout == "BSH" else (q.shape[1], q.shape[0])
    elif layout == "BSND":
        b, s, hq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    else:
        b, hq, s, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    return user_shape(layout, b, hq, s, dv), (b, hq, s)


@attention_forward.register_fake
def _(q, k, v, mask, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, layout, num_heads, scale,
      causal, window_left, window_right, softcap, dropout_p, seed, deterministic, backend):
    out_shape, lse_shape = _forward_shapes(q, k, v, layout, num_heads)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=lse_dtype)


@torch.library.custom_op("tileattn::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Optional[Tensor],
    bias: Optional[Tensor], alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], layout: str, num_heads: int, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, dropout_p: float, seed: int,
    deterministic: bool, backend: str, need_dbias: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    inp = _rebuild(q, k, v, mask, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, layout, num_heads,
                   scale, causal, window_left, window_right, softcap, dropout_p, seed, deterministic)
    dq, dk, dv, dbias = get_backend(backend).backward(inp, out, lse, dout, need_dbias)
    if dbias is None:
        dbias = q.new_empty((0,))
    # Contiguous whatever the engine or the inputs' strides: the fake implementation promises it,
    # and compiled graphs check real strides against the fake ones.
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias.contiguous()


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, layout,
      num_heads, scale, causal, window_left, window_right, softcap, dropout_p, seed, deterministic,
      backend, need_dbias):
    dbias = bias.new_empty(bias.shape) if need_dbias else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


_TENSOR_ARGS = ("q", "k", "v", "mask", "bias", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")
_SCALAR_ARGS = ("layout", "num_heads", "scale", "causal", "window_left", "window_right", "softcap",
                "dropout_p", "seed", "deterministic", "backend")


def _setup_context(ctx, inputs, output):
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.tensor_slots = [i for i, t in enumerate(inputs[:8]) if t is not None]
    ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_slots), out, lse)
    ctx.scalars = inputs[8:]


def _backward(ctx, dout, _dlse):
    saved = ctx.saved_tensors
    tensors = [None] * 8
    for slot, t in zip(ctx.tensor_slots, saved[:-2]):
        tensors[slot] = t
    out, lse = saved[-2:]
    q, k, v, mask, bias, alibi, cu_q, cu_k = tensors
    need_dbias = bias is not None and ctx.needs_input_grad[4]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, dbias = attention_backward(
        dout, q, k, v, out, lse, mask, bias, alibi, cu_q, cu_k, *ctx.scalars, need_dbias
    )
    return (dq, dk, dv, None, dbias if need_dbias else None) + (None,) * 14


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "tileattn: double backward (gradients of gradients) through flash_attention is not supported; "
        "use tileattn.reference for higher-order derivatives."
    )


def _setup_bwd_context(ctx, inputs, output):
    pass


attention_backward.register_autograd(_no_double_backward, setup_context=_setup_bwd_context)
