"""tileattn.serving: quantising new keys/values into a paged or contiguous int8/fp8 cache in place,
and attention over what it wrote (against the fp64 reference over the dequantised cache)."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.serving import quantise, store
from tileattn.core.testing import judge


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype,symmetric", [(torch.int8, True), (torch.int8, False), (torch.float8_e4m3fn, True),
                                             (torch.float8_e5m2, True)])
def test_quantise_round_trip_is_within_half_a_step(dtype, symmetric):
    x = torch.randn(5, 2, 16, generator=gen(1)) * 3 + 0.5
    stored, scale, offset = quantise(x, dtype, reduce=(-1,), symmetric=symmetric)
    assert stored.dtype == dtype and scale.shape == (5, 2, 1)
    back = (stored.double() + (0 if offset is None else offset.double())) * scale.double()
    if dtype is torch.int8:
        assert (back - x.double()).abs().max() <= scale.double().max() * 0.5 + 1e-6
    else:  # fp8: relative rounding of the format (3 or 2 mantissa bits), subnormals near 0 absolute
        ulp = 2.0 ** -(3 if dtype is torch.float8_e4m3fn else 2)
        tiny = scale.double() * (2.0 ** -9 if dtype is torch.float8_e4m3fn else 2.0 ** -16)
        assert ((back - x.double()).abs() <= x.double().abs() * ulp / 2 + tiny).all()
    per_channel = quantise(x, dtype, reduce=(0,), symmetric=symmetric)[1]
    assert per_channel.shape == (1, 2, 16)


def test_store_writes_only_the_given_slots_with_their_scales():
    pool = torch.zeros(4, 8, 2, 16, dtype=torch.int8)
    scales = torch.full((4, 8, 2, 1), -1.0)
    new = torch.randn(3, 2, 16, generator=gen(2))
    slots = torch.tensor([5, 17, 30])
    store(pool, slots, new, scale_cache=scales)
    stored, s, _ = quantise(new, torch.int8)
    flat, flat_s = pool.view(32, 2, 16), scales.view(32, 2, 1)
    assert torch.equal(flat[slots], stored) and torch.equal(flat_s[slots], s)
    others = torch.ones(32, dtype=torch.bool)
    others[slots] = False
    assert not flat[others].any() and (flat_s[others] == -1).all()
    channel = torch.rand(1, 2, 16, generator=gen(3)) * 0.05 + 0.01
    fixed = torch.zeros(2, 9, 2, 16, dtype=torch.float8_e4m3fn)  # a contiguous cache (B, S, Hkv, D)
    store(fixed, torch.tensor([9 + 4]), new[:1], scale=channel)
    assert torch.equal(fixed[1, 4].view(torch.uint8), quantise(new[:1], torch.float8_e4m3fn, scale=channel)[0][0]
                       .view(torch.uint8))


def test_store_refuses_bad_arguments_before_writing():
    pool = torch.zeros(2, 4, 2, 8, dtype=torch.int8)
    scales = torch.zeros(2, 4, 2, 1)
    new = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="argument 'slots'.*\\[3, 8\\]"):
        store(pool, torch.tensor([3, 8]), new, scale_cache=scales)
    with pytest.raises(ValueError, match="argument 'scale_cache/scale'.*neither"):
        store(pool, torch.tensor([0, 1]), new)
    with pytest.raises(ValueError, match="argument 'scale'.*float cache"):
        store(torch.zeros(2, 4, 2, 8), torch.tensor([0, 1]), new, scale=torch.ones(1))
    with pytest.raises(ValueError, match="argument 'new'.*3 kv heads"):
        store(pool, torch.tensor([0, 1]), torch.randn(2, 3, 8), scale_cache=scales)
    with pytest.raises(TypeError, match="argument 'dtype'"):
        quantise(new, torch.int16)
    assert not pool.any() and not scales.any()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_attention_over_a_cache_written_token_by_token(dtype):
    """Prefill chunks and decode steps stored with per-token scales into one shuffled pool, then one
    ragged call: within the 2x rule of the fp64 attention over the dequantised cache."""
    g = gen(4)
    hq, hkv, d, page = 4, 2, 32, 8
    k_pool, v_pool = (torch.zeros(12, page, hkv, d, dtype=dtype) for _ in range(2))
    k_scales, v_scales = torch.zeros(12, page, hkv, 1), torch.zeros(12, page, hkv, 1)
    table = torch.randperm(12, generator=g)[:12].view(3, 4).int()
    lengths = [19, 1, 27]
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = table[b, pos // page].long() * page + pos % page
        store(k_pool, slots, torch.randn(n, hkv, d, generator=g), scale_cache=k_scales)
        store(v_pool, slots, torch.randn(n, hkv, d, generator=g), scale_cache=v_scales)
    cu_q = torch.tensor([0, 3, 4, 5], dtype=torch.int32)
    q = torch.randn(5, hq, d, generator=g)
    used = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(layout="TND", cu_seqlens_q=cu_q, block_table=table, seqused_k=used, causal=True)
    out = tileattn.flash_attention(q, k_pool, v_pool, k_scale=k_scales, v_scale=v_scales, **kw)
    kd, vd = k_pool.double() * k_scales.double(), v_pool.double() * v_scales.double()
    oracle = tileattn.reference(q.double(), kd, vd, **kw)
    verdict = judge("out", out, oracle, tileattn.reference(q, kd.float(), vd.float(), **kw), torch.float32)
    assert verdict.ok, str(verdict)
