"""attention-gym's patterns as ``mask_mod`` / ``score_mod`` functions for :func:`tileattn.flex_attention`.

Masks: :func:`causal`, :func:`sliding_window`, :func:`prefix_lm`, :func:`document` (packed sequences),
:func:`dilated_window`, :func:`natten` (2-D neighbourhood), :func:`sink_tokens`, :func:`padding`.
Score mods: :func:`alibi`, :func:`softcap` (tanh), :func:`relative_bias` (a learned table indexed by
the relative position), :func:`head_scales`, :func:`t5_bias` (bucketed, learned).

Each maker takes what the pattern needs and returns a fresh function, as attention-gym's generators
do; captured tensors (document ids, bias tables, per-head scales) are arguments, so they may require
grad and receive gradients. :data:`MASKS` and :func:`score_mods` build every pattern for given lengths
(the tests run each one forward and backward against the fp64 reference)::

    from tileattn.flex import create_block_mask, examples
    block_mask = create_block_mask(examples.document(doc_ids), None, None, S, S)
    out = tileattn.flex_attention(q, k, v, score_mod=examples.alibi(H), block_mask=block_mask)
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import and_masks, or_masks


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window):
    def window_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window
    return and_masks(window_mask, causal)


def prefix_lm(prefix):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix
    return or_masks(prefix_mask, causal)


def document(doc_ids):
    """Packed sequences: a query sees the earlier keys of its own document."""
    def doc_mask(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)
    return doc_mask


def dilated_window(window, dilation):
    def dilated(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        return (diff <= window) & (diff % dilation == 0)
    return dilated


def natten(width, height, kernel_w, kernel_h):
    """2-D neighbourhood attention on a width x height canvas (kernel clamped at the edges)."""
    def natten_mask(b, h, q_idx, kv_idx):
        q_x, q_y = q_idx // width, q_idx % width
        kv_x, kv_y = kv_idx // width, kv_idx % width
        center_x = q_x.clamp(kernel_h // 2, (height - 1) - kernel_h // 2)
        center_y = q_y.clamp(kernel_w // 2, (width - 1) - kernel_w // 2)
        return ((center_x - kv_x).abs() <= kernel_h // 2) & ((center_y - kv_y).abs() <= kernel_w // 2)
    return natten_mask


def sink_tokens(sinks, window):
    """StreamingLLM: the first ``sinks`` keys stay visible to every query, plus a causal window."""
    def sink_mask(b, h, q_idx, kv_idx):
        return kv_idx < sinks
    return and_masks(or_masks(sink_mask, sliding_window(window)), causal)


def padding(lengths):
    """Per-sequence key lengths (a padded batch): reads ``b``."""
    def pad_mask(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]
    return pad_mask


def alibi(heads):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / heads))
        return score + (kv_idx - q_idx) * scale
    return alibi_mod


def softcap(cap):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return tanh_softcap


def relative_bias(table, kv_len):
    """A learned (H, q_len + kv_len - 1) bias indexed by the relative position."""
    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + kv_len - 1]
    return rel_bias


def head_scales(scales):
    def scaled(score, b, h, q_idx, kv_idx):
        return score * scales[h]
    return scaled


def t5_bias(table, buckets=8, max_distance=32):
    """T5's bucketed relative position bias (bidirectional), from a learned (buckets, H) table."""
    half = buckets // 2
    exact = half // 2

    def t5(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        side = (rel > 0).to(torch.int64) * half
        dist = torch.abs(rel)
        far = exact + (torch.log(dist.float() / exact + 1e-6) / math.log(max_distance / exact)
                       * (half - exact)).to(torch.int64)
        far = torch.minimum(far, torch.full_like(far, half - 1))
        bucket = side + torch.where(dist < exact, dist.to(torch.int64), far)
        return score + table[bucket, h]
    return t5


MASKS = {
    "causal": lambda L, S: causal,
    "sliding_window": lambda L, S: sliding_window(max(3, S // 5)),
    "prefix_lm": lambda L, S: prefix_lm(max(2, S // 4)),
    "document": lambda L, S: document(torch.arange(max(L, S)) * 4 // max(L, S)),
    "dilated_window": lambda L, S: dilated_window(max(4, S // 3), 3),
    "natten": lambda L, S: natten(8, -(-max(L, S) // 8), 3, 3),
    "sink_tokens": lambda L, S: sink_tokens(2, max(3, S // 6)),
}


def score_mods(heads, q_len, kv_len, dtype=torch.float32, requires_grad=False):
    """name -> (score_mod, captured tensors that may receive gradients)."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(heads, q_len + kv_len - 1, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    scales = (torch.rand(heads, generator=gen, dtype=dtype) + 0.5).requires_grad_(requires_grad)
    t5 = torch.randn(8, heads, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    return {"alibi": (alibi(heads), ()), "softcap": (softcap(4.0), ()),
            "relative_bias": (relative_bias(table, kv_len), (table,)), "head_scales": (head_scales(scales), (scales,)),
            "t5_bias": (t5_bias(t5), (t5,))}
