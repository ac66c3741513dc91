"""Example decode-track entry: grouped-query attention without copying the cache.

The baseline repeats each kv head's keys and values once per query head that reads them: for 32
query heads over 8 kv heads it writes four copies of the cache before reading them again. Here the
query heads of a group are stacked instead, ``q`` of one sequence viewed as (Hkv, group, D), so one
batched matrix product per sequence reads every cached key exactly once and scores the whole group
against it (the first idea in RULES.md; the cache is never copied). Score it with
``tileattn contest score hub/contest/examples/decode_grouped.py --track decode``.
"""

import torch


def attention(q, k_cache, v_cache, cache_seqlens):
    batch, heads_q, _, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, used in enumerate(cache_seqlens.tolist()):
        group = q[b].reshape(heads_kv, heads_q // heads_kv, head_dim) * head_dim ** -0.5  # (Hkv, G, D)
        scores = group @ k_cache[b, :, :used].transpose(-1, -2)  # (Hkv, G, used): K read in place
        out[b] = (scores.softmax(-1) @ v_cache[b, :, :used]).reshape(heads_q, 1, head_dim)
    return out
