"""``norm_qkv`` on the CPU: the C passes around PyTorch's GEMMs, and the custom ops that carry them
through autograd, ``torch.compile`` and ``torch.export``.

Forward, per call (x: M token rows of ``hidden`` values):

1. one pass over x: each row's 1/rms, and the GEMM's A operand ``xhat = x * rstd * weight`` in the
   compute dtype (fp32; fp64 for fp64): the norm is applied while the operand is written, so the
   normalised activations are never written in x's dtype and read back to be converted;
2. the projections: MKL/oneDNN through ``torch.mm`` (a bf16/fp16 weight is converted for it, as this
   CPU has no bf16 GEMM that beats fp32; a decode step's few rows read it as stored instead,
   :func:`tileattn.fused.native.gemm_lowp`);
3. one pass per projection over its output: bias, per-head RMSNorm, RoPE, and the store in the
   attention kernels' layout (or a KV cache's slots) in x's dtype.

Backward recomputes ``xhat`` from x and the saved ``rstd`` (one pass), undoes RoPE and the per-head
norm in one pass per projection, and runs the GEMMs ``dW = dY^T xhat`` and ``dxhat = sum dY W``
(accumulated in place), then the norm's backward pass. It saves x, the 1/rms of each row and, with a
per-head norm only, the projections' output before it: no normalised activations, no rotated copies.

``tileattn::norm_qkv`` and ``tileattn::norm_qkv_backward`` are opaque custom ops with fake kernels
(one node each in a compiled graph); ``tileattn::norm_qkv_cache`` writes k and v into a KV cache
(``mutates_args``) and has no backward. A call that needs no autograd and is not traced runs the
same implementation without the op's dispatch (a decode step's few microseconds).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..core.layouts import hidden_batched, output_strides, to_batched, token_axes, user_shape
from . import native

_LOWP = (torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of the passes and GEMMs: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _vector(t: Optional[Tensor], acc: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.detach().to(acc).contiguous()


def _rows(x: Tensor, layout: str) -> Tensor:
    """x as (B, S, hidden) with unit-stride rows."""
    x3 = hidden_batched(x.detach(), layout)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _rope(cos: Optional[Tensor], sin: Optional[Tensor], acc: torch.dtype):
    """(cos, sin, (batch stride, row stride), rot) for the C passes, or None."""
    if cos is None:
        return None
    c, s = cos.detach().to(acc), sin.detach().to(acc)
    if c.stride() != s.stride() or c.stride(-1) != 1:
        c, s = c.contiguous(), s.contiguous()
    strides = (0, c.stride(0)) if c.dim() == 2 else (c.stride(0) if c.shape[0] > 1 else 0, c.stride(1))
    return c, s, strides, 2 * c.shape[-1]


def _new_strides(layout: str, batch: int, heads: int, seqlen: int, dim: int) -> Tuple[int, int, int]:
    """(batch, row, head) strides of a new contiguous tensor in ``layout`` (:func:`_token_strides`
    without making one: a decode step's few microseconds)."""
    if len(token_axes(layout)) == 1:                        # packed (T, heads, D)
        return 0, heads * dim, dim
    b, h, s = output_strides(layout, batch, heads, seqlen, dim)
    return b, s, h


def _token_strides(t: Tensor, layout: str, heads: int) -> Tuple[int, int, int]:
    """(batch, row, head) strides of a tensor in ``layout`` (its head dim is unit-stride)."""
    st = to_batched(t, layout, heads).stride()
    return st[0], st[2], st[1]


def project(xhat: Tensor, w: Tensor) -> Tensor:
    """``xhat @ w.T`` in xhat's dtype (the compute dtype) for a weight of any float dtype."""
    if w.dtype == xhat.dtype:
        return torch.mm(xhat, w.detach().t())
    if xhat.shape[0] <= native.GEMV_ROWS and w.stride(1) == 1 and w.dtype in _LOWP:
        return native.gemm_lowp(xhat, w.detach())
    return torch.mm(xhat, w.detach().t().to(xhat.dtype))


#: rows (or columns) of a bf16/fp16 weight converted at a time for a GEMM in the compute dtype: the
#: fp32 copy alive during a backward GEMM is this many rows, not the whole weight (the backward's peak)
WEIGHT_CHUNK = 256


def times_weight(a: Tensor, w: Tensor, out: Tensor, accumulate: bool) -> None:
    """``out (+)= a @ w`` in out's dtype for a weight ``w`` (N, K) of any float dtype, converted
    WEIGHT_CHUNK columns at a time."""
    if w.dtype == out.dtype:
        out.addmm_(a, w) if accumulate else torch.mm(a, w, out=out)
        return
    for c0 in range(0, w.shape[1], WEIGHT_CHUNK):
        part = w[:, c0:c0 + WEIGHT_CHUNK].to(out.dtype)
        if accumulate:
            out[:, c0:c0 + WEIGHT_CHUNK].addmm_(a, part)
        else:
            out[:, c0:c0 + WEIGHT_CHUNK] = torch.mm(a, part)


def weight_grad(dy: Tensor, a: Tensor, dtype: torch.dtype) -> Tensor:
    """``dy.T @ a`` (N, K) rounded to ``dtype``, computed WEIGHT_CHUNK rows at a time when that
    rounds (no full-size copy in the compute dtype)."""
    if dtype == dy.dtype:
        return torch.mm(dy.t(), a)
    out = torch.empty(dy.shape[1], a.shape[1], dtype=dtype)
    for r0 in range(0, dy.shape[1], WEIGHT_CHUNK):
        out[r0:r0 + WEIGHT_CHUNK] = torch.mm(dy[:, r0:r0 + WEIGHT_CHUNK].t(), a)
    return out


def forward(x, norm_weight, weights, biases, cos, sin, q_norm, k_norm, ints, floats, layout, cache=None):
    """(q, k, v, rstd, pre_q, pre_k): q, k, v in ``layout`` (with ``cache`` = (k_cache, v_cache,
    cache_seqlens, block_table): k, v written there and returned as the caches); pre_* the
    projections' output before a per-head norm (None without one)."""
    heads, kv_heads, dim, _, interleaved = ints
    eps, qk_eps = floats
    acc = acc_dtype(x.dtype)
    x3 = _rows(x, layout)
    batch, seqlen, hidden = x3.shape
    rows = batch * seqlen
    rstd = torch.empty(rows, dtype=acc)
    xhat = torch.empty(rows, hidden, dtype=acc)
    native.rms(x3, _vector(norm_weight, acc), eps, rstd, False, xhat)
    rope = _rope(cos, sin, acc)
    parts, pres = [], []
    for i, (w, b, n, norm) in enumerate(zip(weights, biases, (heads, kv_heads, kv_heads), (q_norm, k_norm, None))):
        y = project(xhat, w)
        bias = _vector(b, acc)
        if norm is not None and bias is not None:  # the per-head norm's backward reads its input
            y += bias
            bias = None
        pres.append(y if norm is not None else None)
        if cache is not None and i > 0:
            dst = cache[i - 1]
            st = dst.stride()
            strides, slots = (st[0], st[1], st[2]), (cache[2], cache[3], dst.shape[1])
        else:
            dst = torch.empty(user_shape(layout, batch, n, seqlen, dim), dtype=x.dtype)
            strides, slots = _new_strides(layout, batch, n, seqlen, dim), None
        parts.append(native.Part(y, n, bias, _vector(norm, acc), i < 2 and rope is not None, dst, strides, slots))
    native.epilogues(parts, (batch, seqlen), dim, rope, bool(interleaved), qk_eps)
    results = [p.dst for p in parts]
    return (*results, rstd, pres[0], pres[1])


def backward(dq, dk, dv, x, norm_weight, weights, biases, cos, sin, q_norm, k_norm, rstd, pres, ints, floats,
             layout, needs) -> List[Optional[Tensor]]:
    """Gradients [dx, dnorm_weight, dw_q, dw_k, dw_v, db_q, db_k, db_v, dq_norm, dk_norm] (None where
    ``needs``, the same ten flags, says no) of :func:`forward`'s q, k, v."""
    heads, kv_heads, dim, _, interleaved = ints
    eps, qk_eps = floats
    acc = acc_dtype(x.dtype)
    x3 = _rows(x, layout)
    batch, seqlen, hidden = x3.shape
    rows = batch * seqlen
    blocks = -(-rows // native.BLOCK)
    nw = _vector(norm_weight, acc)
    xhat = torch.empty(rows, hidden, dtype=acc)
    native.rms(x3, nw, eps, rstd, True, xhat)
    rope = _rope(cos, sin, acc)
    dxhat = None
    grads: List[Optional[Tensor]] = [None] * 10
    parts = zip(range(3), (dq, dk, dv), weights, biases, (heads, kv_heads, kv_heads), (q_norm, k_norm, None), pres)
    for i, g, w, b, n, norm, pre in parts:
        if g is None:
            continue
        if to_batched(g, layout, n).stride(-1) != 1:
            g = g.contiguous()
        dy = torch.empty(rows, n * dim, dtype=acc)
        dnorm = torch.empty(blocks, dim, dtype=acc) if norm is not None and needs[8 + i] else None
        native.epilogue_backward(g, _token_strides(g, layout, n), (batch, seqlen, n, dim), pre,
                                 None if norm is None else (_vector(norm, acc), qk_eps), dnorm,
                                 rope if i < 2 else None, interleaved, dy)
        if dnorm is not None:
            grads[8 + i] = dnorm.sum(0).to(norm.dtype)
        if needs[2 + i]:
            grads[2 + i] = weight_grad(dy, xhat, w.dtype)
        if b is not None and needs[5 + i]:
            grads[5 + i] = dy.sum(0).to(b.dtype)
        if needs[0] or needs[1]:
            first = dxhat is None
            if first:
                dxhat = torch.empty(rows, hidden, dtype=acc)
            times_weight(dy, w.detach(), dxhat, accumulate=not first)
    if dxhat is None:
        dxhat = torch.zeros(rows, hidden, dtype=acc)
    if needs[0] or needs[1]:
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dw = torch.empty(blocks, hidden, dtype=acc) if norm_weight is not None and needs[1] else None
        native.rms_backward(x3, nw, rstd, dxhat, hidden_batched(dx, layout), dw)
        grads[0] = dx if needs[0] else None
        if dw is not None:
            grads[1] = dw.sum(0).to(norm_weight.dtype)
    return grads


# ---------------------------------------------------------------------------------------- custom ops

def _empty(x: Tensor) -> Tensor:
    return x.new_empty((0,))


@torch.library.custom_op("tileattn::norm_qkv", mutates_args=())
def norm_qkv_op(x: Tensor, norm_weight: Optional[Tensor], w_q: Tensor, w_k: Tensor, w_v: Tensor,
                b_q: Optional[Tensor], b_k: Optional[Tensor], b_v: Optional[Tensor], cos: Optional[Tensor],
                sin: Optional[Tensor], q_norm: Optional[Tensor], k_norm: Optional[Tensor], ints: List[int],
                floats: List[float], layout: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, rstd, pre_q, pre_k = forward(x, norm_weight, (w_q, w_k, w_v), (b_q, b_k, b_v), cos, sin, q_norm, k_norm,
                                          ints, floats, layout)
    return q, k, v, rstd, _empty(x) if pre_q is None else pre_q, _empty(x) if pre_k is None else pre_k


def _fake_outputs(x, ints, layout, q_norm, k_norm):
    heads, kv_heads, dim = ints[:3]
    batch, seqlen = hidden_batched(x, layout).shape[:2]
    acc = acc_dtype(x.dtype)
    q, k, v = (x.new_empty(user_shape(layout, batch, n, seqlen, dim)) for n in (heads, kv_heads, kv_heads))
    rows = batch * seqlen
    pre = [x.new_empty((rows, n * dim), dtype=acc) if norm is not None else _empty(x)
           for n, norm in ((heads, q_norm), (kv_heads, k_norm))]
    return q, k, v, x.new_empty((rows,), dtype=acc), *pre


@norm_qkv_op.register_fake
def _(x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, q_norm, k_norm, ints, floats, layout):
    return _fake_outputs(x, ints, layout, q_norm, k_norm)


@torch.library.custom_op("tileattn::norm_qkv_backward", mutates_args=())
def norm_qkv_backward_op(dq: Tensor, dk: Tensor, dv: Tensor, x: Tensor, norm_weight: Optional[Tensor], w_q: Tensor,
                         w_k: Tensor, w_v: Tensor, b_q: Optional[Tensor], b_k: Optional[Tensor],
                         b_v: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                         q_norm: Optional[Tensor], k_norm: Optional[Tensor], rstd: Tensor, pre_q: Tensor,
                         pre_k: Tensor, ints: List[int], floats: List[float], layout: str,
                         needs: List[bool]) -> List[Tensor]:
    pres = (pre_q if q_norm is not None else None, pre_k if k_norm is not None else None, None)
    grads = backward(dq, dk, dv, x, norm_weight, (w_q, w_k, w_v), (b_q, b_k, b_v), cos, sin, q_norm, k_norm, rstd,
                     pres, ints, floats, layout, needs)
    return [_empty(x) if g is None else g for g in grads]


@norm_qkv_backward_op.register_fake
def _(dq, dk, dv, x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, q_norm, k_norm, rstd, pre_q, pre_k, ints,
      floats, layout, needs):
    like = (x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, q_norm, k_norm)
    return [t.new_empty(t.shape) if need and t is not None else _empty(x) for t, need in zip(like, needs)]


#: the op's inputs that may take a gradient, in order, and their place in ``backward``'s list
_GRAD_INPUTS = (0, 1, 2, 3, 4, 5, 6, 7, 10, 11)


def _setup_context(ctx, inputs, output):
    x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, q_norm, k_norm, ints, floats, layout = inputs
    _, _, _, rstd, pre_q, pre_k = output
    ctx.mark_non_differentiable(rstd, pre_q, pre_k)
    ctx.save_for_backward(x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, q_norm, k_norm, rstd, pre_q, pre_k)
    ctx.ints, ctx.floats, ctx.layout = ints, floats, layout


def _backward(ctx, dq, dk, dv, *unused):
    saved = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[i]) for i in _GRAD_INPUTS]
    grads = norm_qkv_backward_op(dq, dk, dv, *saved, ctx.ints, ctx.floats, ctx.layout, needs)
    out = [None] * 15
    for slot, g, need in zip(_GRAD_INPUTS, grads, needs):
        out[slot] = g if need else None
    return tuple(out)


norm_qkv_op.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("tileattn.fused: double backward (gradients of gradients) through norm_qkv is not supported; "
                       "use impl='composed' for higher-order derivatives.")


norm_qkv_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("tileattn::norm_qkv_cache", mutates_args=("k_cache", "v_cache"))
def norm_qkv_cache_op(x: Tensor, norm_weight: Optional[Tensor], w_q: Tensor, w_k: Tensor, w_v: Tensor,
                      b_q: Optional[Tensor], b_k: Optional[Tensor], b_v: Optional[Tensor], cos: Optional[Tensor],
                      sin: Optional[Tensor], q_norm: Optional[Tensor], k_norm: Optional[Tensor], k_cache: Tensor,
                      v_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor], ints: List[int],
                      floats: List[float], layout: str) -> Tensor:
    q = forward(x, norm_weight, (w_q, w_k, w_v), (b_q, b_k, b_v), cos, sin, q_norm, k_norm, ints, floats, layout,
                cache=(k_cache, v_cache, cache_seqlens, block_table))[0]
    return q


@norm_qkv_cache_op.register_fake
def _(x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, q_norm, k_norm, k_cache, v_cache, cache_seqlens,
      block_table, ints, floats, layout):
    return _fake_outputs(x, ints, layout, None, None)[0]
