"""Contest baseline: deliberately simple, correct attention. Beat it.

It materialises the full (S, S) score matrix of one (batch, head) at a time in fp32, so it is exact
to fp32 rounding but slow and memory hungry for long sequences. Rules: ``hub/contest/RULES.md``.

It is part of the package, not of the hub, because ``tileattn contest score`` times every
submission against it and must find it in an installed tileattn.
"""

import torch


def attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(D)) v for (B, H, S, D) tensors; ``causal``: query i sees keys j <= i."""
    batch, heads, seqlen, head_dim = q.shape
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    hidden = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1) if causal else None
    for b in range(batch):
        for h in range(heads):
            scores = (q[b, h].float() @ k[b, h].float().T) * scale
            if hidden is not None:
                scores = scores.masked_fill(hidden, float("-inf"))
            out[b, h] = (scores.softmax(-1) @ v[b, h].float()).to(q.dtype)
    return out
