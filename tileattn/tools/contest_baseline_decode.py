"""Decode-track baseline: deliberately simple, correct attention for one decoding step. Beat it.

One query token per sequence against a KV cache. It handles one sequence at a time, and it copies
each kv head's keys and values once per query head that reads it (grouped-query attention done by
``repeat_interleave``, as many model implementations do), so it moves several times the bytes of
the cache through memory for every token. Rules: ``hub/contest/RULES.md``, decode track.

It is part of the package, not of the hub, because ``tileattn contest score --track decode`` times
every submission against it and must find it in an installed tileattn.
"""

import torch


def attention(q, k_cache, v_cache, cache_seqlens):
    """softmax(q k^T / sqrt(D)) v over the first ``cache_seqlens[b]`` cache positions of sequence ``b``.

    q: (B, Hq, 1, D); k_cache, v_cache: (B, Hkv, L, D) with Hq % Hkv == 0; cache_seqlens: (B,) int32.
    """
    batch, heads_q, _, head_dim = q.shape
    group = heads_q // k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(batch):
        used = int(cache_seqlens[b])
        k = k_cache[b, :, :used].repeat_interleave(group, dim=0)  # (Hq, used, D)
        v = v_cache[b, :, :used].repeat_interleave(group, dim=0)
        scores = (q[b] @ k.transpose(-1, -2)) * head_dim ** -0.5  # (Hq, 1, used)
        out[b] = scores.softmax(-1) @ v
    return out
