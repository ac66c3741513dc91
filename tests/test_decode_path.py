"""The decode path: a repeated call shape served from the plan memo (with seqused_k and a paged
block_table), and the SDPA dialect on decode shapes, all against the fp64 reference."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.core import plans
from tileattn.sdpa import scaled_dot_product_attention as sdpa
from tileattn.core.testing import judge


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


def _exact(q, k, v, **kwargs):
    return tileattn.reference(q, k, v, compute_dtype=torch.float64, **kwargs)


def _check(got, q, k, v, **kwargs):
    verdict = judge("out", got, _exact(q, k, v, **kwargs), tileattn.reference(q, k, v, **kwargs), q.dtype)
    assert verdict.ok, str(verdict)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_decode_calls_with_seqused_k_are_served_by_the_plan_and_stay_exact(dtype):
    plans.clear()
    k, v = _rand(3, 2, 300, 32, seed=1, dtype=dtype), _rand(3, 2, 300, 32, seed=2, dtype=dtype)
    for step, lengths in enumerate(([5, 300, 0], [6, 1, 299], [300, 300, 300])):
        q = _rand(3, 8, 1, 32, seed=10 + step, dtype=dtype)
        used = torch.tensor(lengths, dtype=torch.int32)
        got = tileattn.flash_attention(q, k, v, seqused_k=used)
        assert plans.count("full") == 1  # one plan for the call shape; the values change every step
        _check(got, q, k, v, seqused_k=used)


def test_a_plan_checks_the_values_of_seqused_k_and_block_table_again():
    plans.clear()
    q, k, v = _rand(2, 4, 1, 16), _rand(2, 2, 64, 16, seed=1), _rand(2, 2, 64, 16, seed=2)
    tileattn.flash_attention(q, k, v, seqused_k=torch.tensor([3, 64], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k"):
        tileattn.flash_attention(q, k, v, seqused_k=torch.tensor([3, 65], dtype=torch.int32))
    pool_k, pool_v = _rand(6, 16, 2, 16, seed=3), _rand(6, 16, 2, 16, seed=4)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    tileattn.flash_attention(q, pool_k, pool_v, block_table=table, seqused_k=torch.tensor([20, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table"):
        tileattn.flash_attention(q, pool_k, pool_v, block_table=torch.tensor([[0, 1], [2, 6]], dtype=torch.int32),
                                 seqused_k=torch.tensor([20, 32], dtype=torch.int32))


def test_repeated_paged_decode_calls_read_each_calls_block_table():
    plans.clear()
    pool_k, pool_v = _rand(8, 16, 2, 16, seed=3), _rand(8, 16, 2, 16, seed=4)
    for step, rows in enumerate(([[0, 1, 2], [3, 4, 5]], [[7, 6, 5], [1, 0, 2]])):
        q = _rand(2, 4, 1, 16, seed=20 + step)
        table = torch.tensor(rows, dtype=torch.int32)
        used = torch.tensor([40, 17 + step], dtype=torch.int32)
        got = tileattn.flash_attention(q, pool_k, pool_v, block_table=table, seqused_k=used)
        for b in range(2):  # the oracle: each sequence's pages gathered into a contiguous cache
            n = int(used[b])
            k = pool_k[table[b]].flatten(0, 1)[:n].transpose(0, 1)[None]
            v = pool_v[table[b]].flatten(0, 1)[:n].transpose(0, 1)[None]
            _check(got[b:b + 1], q[b:b + 1], k, v)
    assert plans.count("full") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_dialect_decode_against_a_long_cache_with_gqa(dtype, is_causal):
    # Sq = 1 against 4096 keys, 8 query heads on 2 kv heads. PyTorch's is_causal is top-left aligned:
    # with Sq != Sk the single query sees key 0 only (not the whole cache, as bottom-right would).
    q, k, v = _rand(2, 8, 1, 64, dtype=dtype), _rand(2, 2, 4096, 64, seed=1, dtype=dtype), \
        _rand(2, 2, 4096, 64, seed=2, dtype=dtype)
    got = sdpa(q, k, v, is_causal=is_causal, enable_gqa=True)
    _check(got, q, k, v, causal=is_causal, align="top_left")
    if is_causal:
        torch.testing.assert_close(got, v[:, :, :1].repeat_interleave(4, dim=1), rtol=0, atol=0)


def test_sdpa_dialect_decode_with_a_padding_mask():
    # the mask transformers builds for a left-padded batch at a decode step: (B, 1, 1, Sk)
    q, k, v = _rand(3, 8, 1, 32), _rand(3, 2, 1000, 32, seed=1), _rand(3, 2, 1000, 32, seed=2)
    mask = torch.ones(3, 1, 1, 1000, dtype=torch.bool)
    mask[0, ..., :300] = False
    mask[2, ..., :999] = False
    got = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    _check(got, q, k, v, mask=mask)
