"""The output projection of :func:`tileattn.fused.attention_out_proj`: ``y = a @ w_o.T + bias`` with
the GEMM in fp32 (fp64 for fp64) whatever the operands' dtype.

On a CPU without bf16/fp16 GEMM instructions torch's low-precision GEMM runs at a fraction of the
fp32 rate, so a bf16 block multiplies in fp32: the attention output arrives in fp32 already (the
attention's partial result, never rounded to bf16 and converted back), the weight is converted per
call, and the result is rounded once. Backward saves the operands as given (no fp32 copy of the
weight is kept alive between forward and backward) and converts the weight again a slice at a time
(:func:`tileattn.fused.ops.times_weight`, :func:`~tileattn.fused.ops.weight_grad`). A decode step's few rows with
a bf16/fp16 weight, outside autograd, read the weight as stored (:func:`tileattn.fused.native.gemm_lowp`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.spec import tracing
from . import native
from .ops import acc_dtype, project, times_weight, weight_grad


class _Linear32(torch.autograd.Function):
    """``a @ w.T + bias`` in the compute dtype, rounded to ``out_dtype``; a (..., K), w (N, K)."""

    @staticmethod
    def forward(ctx, a, w, bias, out_dtype):
        acc = acc_dtype(out_dtype)
        y = torch.mm(a.reshape(-1, a.shape[-1]).to(acc), w.to(acc).t())
        if bias is not None:
            y += bias.to(acc)
        ctx.save_for_backward(a, w)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(out_dtype).reshape(*a.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        a, w = ctx.saved_tensors
        acc = acc_dtype(dy.dtype)
        dy2 = dy.reshape(-1, w.shape[0]).to(acc)
        da = dw = db = None
        if ctx.needs_input_grad[0]:
            da = torch.empty(dy2.shape[0], w.shape[1], dtype=acc)
            times_weight(dy2, w, da, accumulate=False)
            da = da.to(a.dtype).reshape(a.shape)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy2, a.reshape(-1, a.shape[-1]).to(acc), w.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(ctx.bias_dtype)
        return da, dw, db, None


def needs_fp32_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GEMM of this dtype runs in fp32 here: bf16/fp16 on a CPU."""
    return dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"


def out_proj(a: Tensor, w_o: Tensor, bias: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``a @ w_o.T + bias`` rounded to ``out_dtype`` (default w_o's dtype); ``a`` (..., K) in w_o's dtype
    or in fp32 (an attention's partial result)."""
    out_dtype = out_dtype or w_o.dtype
    if not needs_fp32_gemm(out_dtype, w_o.device):
        return F.linear(a.to(out_dtype), w_o, bias)
    rows = a.reshape(-1, a.shape[-1])
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, w_o, bias))
    if not grad and not tracing() and rows.shape[0] <= native.GEMV_ROWS and native.available()[0]:
        y = project(rows.to(torch.float32).contiguous(), w_o)
        if bias is not None:
            y += bias.to(torch.float32)
        return y.to(out_dtype).reshape(*a.shape[:-1], w_o.shape[0])
    return _Linear32.apply(a, w_o, bias, out_dtype)
