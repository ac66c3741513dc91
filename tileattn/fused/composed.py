"""The unfused composition of :func:`tileattn.fused.norm_qkv`, in PyTorch operators: what the fused
operator computes, written the way a model writes it (RMSNorm, three projections, the per-head norm,
RoPE, the layout, the cache write). It is the oracle of the tests (in fp64) and the exact fallback on
any device or engine where the C passes do not run; autograd differentiates it as it stands.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..core.layouts import from_canonical, hidden_batched, token_axes
from .checks import NormQKVCall


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (Llama's RMSNorm in x's dtype)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of the first ``2 * cos.shape[-1]`` dims of ``y`` (..., tokens, heads, D); cos/sin broadcast
    against (..., tokens, rot/2). Pairs (2i, 2i+1) when interleaved, else (i, i + rot/2)."""
    rot = 2 * cos.shape[-1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    part, rest = y[..., :rot], y[..., rot:]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
    else:
        a, b = part[..., :rot // 2], part[..., rot // 2:]
        turned = torch.cat((a * c - b * s, b * c + a * s), -1)
    return torch.cat((turned, rest), -1)


def norm_qkv(call: NormQKVCall, compute_dtype: Optional[torch.dtype] = None):
    """(q, k, v) of a validated call, each op in ``compute_dtype`` (default: x's dtype), rounded to
    x's dtype at the end; with a KV cache, (q, k_cache, v_cache) after writing the new rows."""
    x = call.x
    cd = compute_dtype or x.dtype
    heads, kv_heads, dim, _, interleaved = call.ints
    eps, qk_eps = call.floats
    tokens = hidden_batched(x, call.layout).to(cd)                     # (B, S, hidden)
    h = rms_norm(tokens, None if call.norm_weight is None else call.norm_weight.to(cd), eps)
    outs = []
    for w, b, n, norm, roped in zip(call.weights, call.biases, call.heads, (call.q_norm, call.k_norm, None),
                                    (True, True, False)):
        y = F.linear(h, w.to(cd), None if b is None else b.to(cd)).unflatten(-1, (n, dim))   # (B, S, n, D)
        if norm is not None:
            y = rms_norm(y, norm.to(cd), qk_eps)
        if roped and call.cos is not None:
            y = rotate(y, call.cos.to(cd), call.sin.to(cd), bool(interleaved))
        outs.append(y.to(x.dtype))
    if call.kv_cache is not None:
        _write_cache(call, outs[1], outs[2])
        return _in_layout(outs[0], call.layout), call.kv_cache[0], call.kv_cache[1]
    return tuple(_in_layout(t, call.layout) for t in outs)


def _in_layout(tokens: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, S, n, D) token rows -> a tensor in ``layout`` (TND: B = 1)."""
    if len(token_axes(layout)) == 1:                                  # packed: (T, n, D)
        return tokens[0]
    return from_canonical(tokens.transpose(1, 2), layout)


def _write_cache(call: NormQKVCall, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows (b, s) of k, v (B, S, Hkv, D) to position cache_seqlens[b] + s of sequence b."""
    batch, seqlen = k.shape[:2]
    k_cache, v_cache = call.kv_cache
    pos = call.cache_seqlens.long()[:, None] + torch.arange(seqlen, device=k.device)    # (B, S)
    if call.block_table is None:
        where = (torch.arange(batch, device=k.device)[:, None].expand(batch, seqlen), pos)
    else:
        size = k_cache.shape[1]
        where = (call.block_table.long().gather(1, pos // size), pos % size)
    k_cache[where] = k
    v_cache[where] = v
