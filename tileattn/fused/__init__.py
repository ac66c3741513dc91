"""The attention block's neighbours, fused: RMSNorm -> Q/K/V projections -> RoPE -> (KV cache) as one
operator, and attention -> output projection as another.

    q, k, v = tileattn.fused.norm_qkv(x, norm_weight, w_qkv, eps=1e-6, num_heads=16, num_kv_heads=8,
                                      head_dim=128, rope=(cos, sin), layout="BSND")
    y = tileattn.fused.attention_out_proj(q, k, v, w_o, layout="BSND", causal=True)

The unfused block is six operators and a dozen passes over the activations (normalise, write, read
for each projection, transpose, rotate, write the attention output, read it); here the norm is
applied while the GEMM's operand is written, RoPE and the layout are the GEMMs' epilogue, and the
GEMMs are the machine's (MKL/oneDNN through PyTorch). On the CPU the passes are C
(:mod:`tileattn.fused.ops`, :mod:`tileattn.fused.native`); elsewhere, or with ``impl="composed"``,
the operators run their exact PyTorch composition (:mod:`tileattn.fused.composed`), which is also
what the tests compare against in fp64. Both are differentiable and ``torch.compile`` traces both
with no graph break. Details and measurements: ``hub/tutorials/18_fused_neighbours.py`` and ``benchmarks/results/fused.csv``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.api import attention_partial, flash_attention
from ..core.layouts import LAYOUT, LAYOUTS, from_canonical, to_canonical, token_axes
from ..core.spec import tracing
from . import composed, native
from .checks import check_impl, layout_of, norm_qkv_call, out_width
from .ops import norm_qkv_cache_op, norm_qkv_op
from .ops import forward as _forward
from .projection import needs_fp32_gemm, out_proj

__all__ = ["norm_qkv", "attention_out_proj", "out_proj", "rotary_tables", "available"]

available = native.available


def rotary_tables(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0, dtype=torch.float32):
    """``(cos, sin)`` of RoPE for integer ``positions`` (any shape), each ``(*positions.shape,
    rotary_dim // 2)``: the half-width tables :func:`norm_qkv` takes (flash-attn's convention;
    frequency i is ``base ** (-2i / rotary_dim)``)."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim))
    angles = positions.to(torch.float64)[..., None] * inv
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _native_serves(x: torch.Tensor, impl: str) -> bool:
    if impl == "composed":
        return False
    if x.device.type != "cpu":
        if impl == "native":
            raise ValueError(f"tileattn: argument 'impl': got 'native' for tensors on {x.device}; expected CPU "
                             "tensors (the C passes run on the CPU) or impl='auto', which composes PyTorch ops there.")
        return False
    ok, why = native.available()
    if impl == "native" and not ok:
        raise RuntimeError(f"tileattn: argument 'impl': got 'native', but {why}; impl='auto' composes PyTorch ops.")
    return ok


def norm_qkv(x, norm_weight, w_qkv, *, eps, num_heads, num_kv_heads, head_dim, bias_qkv=None, rope=None,
             rotary_interleaved=False, q_norm_weight=None, k_norm_weight=None, qk_norm_eps=None, layout="BSND",
             kv_cache=None, cache_seqlens=None, block_table=None, impl="auto"):
    """RMSNorm, the q/k/v projections, per-head norms and RoPE of hidden states ``x``: ``(q, k, v)`` in
    the attention kernels' ``layout``, ready for :func:`tileattn.flash_attention`.

    Args:
        x: hidden states (B, S, hidden) for BSND, BNSD and BSH; (S, B, hidden) for SBH; (T, hidden)
            for TND. fp16, bf16, fp32 or fp64.
        norm_weight: (hidden,) RMSNorm weight, or None. Gemma's ``(1 + w)`` convention: pass ``1 + w``.
        w_qkv: the projections' weights (nn.Linear's (out, in)): one tensor
            ((num_heads + 2 * num_kv_heads) * head_dim, hidden) stacked q, k, v, or three tensors.
            x's dtype.
        eps: the RMSNorm epsilon (``variance_epsilon``).
        num_heads, num_kv_heads, head_dim: query heads, key/value heads (GQA/MQA), head dim.
        bias_qkv: None, one stacked bias, or three (each may be None).
        rope: None or ``(cos, sin)``, each (S, rot/2), (B or 1, S, rot/2) or, for TND, (T, rot/2): the
            rotation of the row's position for the first ``rot`` dims (partial rotary when rot <
            head_dim; :func:`rotary_tables` builds them). Applied to q and k after the per-head norms.
        rotary_interleaved: rotate pairs (2i, 2i+1) (GPT-J) instead of (i, i + rot/2) (GPT-NeoX, Llama).
        q_norm_weight, k_norm_weight: (head_dim,) per-head RMSNorm weights before RoPE (Qwen3, Gemma 3),
            with epsilon ``qk_norm_eps`` (default ``eps``).
        layout: of q, k, v: "BSND" (default), "BNSD", "BSH", "SBH" or "TND".
        kv_cache: ``(k_cache, v_cache)`` to write the new keys and values into (inference): (B, cache_len,
            num_kv_heads, head_dim) tensors, or pools (num_blocks, block_size, num_kv_heads, head_dim)
            with ``block_table`` (B, max_blocks) int32. Row s of sequence b goes to position
            ``cache_seqlens[b] + s`` (int32 (B,)), flash_attn_with_kvcache's convention; attend with
            ``seqused_k=cache_seqlens + S``.
        impl: "auto" (the C passes on the CPU, else the composition), "native" or "composed".

    Returns:
        ``(q, k, v)``; with ``kv_cache``, ``(q, k_cache, v_cache)``. Differentiable in x, the weights,
        biases and norm weights (not with ``kv_cache``).

    Raises:
        ValueError / TypeError before any compute or write, naming the argument.
    """
    impl = check_impl(impl)
    call = norm_qkv_call(x, norm_weight, w_qkv, eps=eps, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, bias_qkv=bias_qkv, rope=rope, rotary_interleaved=rotary_interleaved,
                         q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, qk_norm_eps=qk_norm_eps,
                         layout=layout, kv_cache=kv_cache, cache_seqlens=cache_seqlens, block_table=block_table)
    if not _native_serves(x, impl):
        lowp_cpu = needs_fp32_gemm(x.dtype, x.device)
        return composed.norm_qkv(call, torch.float32 if lowp_cpu else None)
    tensors = (call.x, call.norm_weight, *call.weights, *call.biases, call.cos, call.sin, call.q_norm, call.k_norm)
    ints, floats = list(call.ints), list(call.floats)
    direct = not tracing() and all(type(t) is torch.Tensor for t in tensors if t is not None)
    if call.kv_cache is not None:
        if direct:
            q = _forward(call.x, call.norm_weight, call.weights, call.biases, call.cos, call.sin, call.q_norm,
                         call.k_norm, call.ints, call.floats, call.layout,
                         cache=(*call.kv_cache, call.cache_seqlens, call.block_table))[0]
        else:
            q = norm_qkv_cache_op(*tensors, *call.kv_cache, call.cache_seqlens, call.block_table, ints, floats, layout)
        return q, call.kv_cache[0], call.kv_cache[1]
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if direct and not grad:
        return tuple(_forward(call.x, call.norm_weight, call.weights, call.biases, call.cos, call.sin, call.q_norm,
                              call.k_norm, call.ints, call.floats, call.layout)[:3])
    return tuple(norm_qkv_op(*tensors, ints, floats, layout)[:3])


def _token_major(layout: str) -> str:
    """The layout of the same tokens whose rows hold every head (BNSD -> BSND; the others are)."""
    dims = LAYOUT[layout].dims
    if dims.index("h") < dims.index("s"):
        return next(name for name in LAYOUTS if LAYOUT[name].dims == "bshd" and not LAYOUT[name].fused)
    return layout


def attention_out_proj(q, k, v, w_o, bias=None, **kwargs):
    """``flash_attention(q, k, v, **kwargs)`` multiplied by the output projection ``w_o`` (hidden,
    num_heads * head_dim_v) (+ ``bias``): the block's output, (B, S, hidden) for BSND, BNSD and BSH,
    (S, B, hidden) for SBH, (T, hidden) for TND; with ``return_lse=True``, ``(y, lse)``.

    Takes every keyword of :func:`tileattn.flash_attention` (masks, windows, softcap, sinks, dropout,
    varlen, KV caches, score_mod, ``backend``...), validated before any compute. The attention's output
    goes to the projection in the layout the GEMM reads (a BNSD call is attended as its BSND view, so
    heads x head_dim is one row per token with no transpose); in bf16/fp16 on a CPU the attention's
    fp32 result feeds an fp32 GEMM directly (:mod:`tileattn.fused.projection`). On the CPU the
    (tokens, heads * head_dim) intermediate is written once: MKL reads its A operand from memory and
    the backward pass needs it (the attention's and the projection's).
    """
    layout = layout_of(kwargs)
    return_lse = kwargs.pop("return_lse", False)
    flat = _token_major(layout)
    if flat != layout:
        q = from_canonical(to_canonical(q, layout, None), flat)
        if kwargs.get("block_table") is None:  # a paged pool is not in q's layout
            k, v = (from_canonical(to_canonical(t, layout, None), flat) for t in (k, v))
        kwargs["layout"] = flat
    width = out_width(q, k, v, w_o, bias, kwargs)
    tokens = q.shape[:len(token_axes(flat))]
    # a decode step's few rows: rounding them to q's dtype costs nothing and takes the lean call
    if needs_fp32_gemm(q.dtype, q.device) and tokens.numel() > native.GEMV_ROWS:
        out, lse = attention_partial(q, k, v, **kwargs)
    else:
        out, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
    y = out_proj(out.reshape(*tokens, width), w_o, bias, out_dtype=q.dtype)
    return (y, lse) if return_lse else y
