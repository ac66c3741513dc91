"""tileattn.serving: quantising new keys/values into a paged or contiguous int8/fp8 cache in place,
and attention over what it wrote (against the fp64 reference over the dequantised cache)."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.core.kvquant import pack_int4, unpack_int4
from tileattn.serving import quantise, store
from tileattn.core.testing import judge


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype,symmetric", [(torch.int8, True), (torch.int8, False), (torch.float8_e4m3fn, True),
                                             (torch.float8_e5m2, True), ("int4", True), ("int4", False)])
def test_quantise_round_trip_is_within_half_a_step(dtype, symmetric):
    x = torch.randn(5, 2, 16, generator=gen(1)) * 3 + 0.5
    stored, scale, offset = quantise(x, dtype, reduce=(-1,), symmetric=symmetric)
    assert stored.dtype == (torch.uint8 if dtype == "int4" else dtype) and scale.shape == (5, 2, 1)
    assert stored.shape == (5, 2, 8 if dtype == "int4" else 16)
    values = unpack_int4(stored) if dtype == "int4" else stored
    back = (values.double() + (0 if offset is None else offset.double())) * scale.double()
    if dtype in (torch.int8, "int4"):
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


def test_store_refuses_duplicate_slots_bad_scales_and_caches_before_writing():
    pool = torch.zeros(2, 4, 2, 8, dtype=torch.int8)
    scales = torch.zeros(2, 4, 2, 1)
    new = torch.randn(3, 2, 8, generator=gen(5))
    with pytest.raises(ValueError, match="argument 'slots'.*slot 5 given 2 times"):
        store(pool, torch.tensor([5, 1, 5]), new, scale_cache=scales)
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        scale = torch.full((1, 1, 2, 8), 0.05)
        scale[0, 0, 1, 3] = bad
        with pytest.raises(ValueError, match="argument 'scale'.*finite positive"):
            store(pool, torch.tensor([0, 1, 2]), new, scale=scale)
        with pytest.raises(ValueError, match="argument 'scale'.*finite positive"):
            quantise(new, torch.int8, scale=scale[0])
    with pytest.raises(ValueError, match="argument 'scale'.*requires grad"):
        store(pool, torch.tensor([0, 1, 2]), new, scale=torch.full((1, 1, 2, 8), 0.05, requires_grad=True))
    with pytest.raises(ValueError, match="argument 'scale'.*one scale for every token"):
        store(pool, torch.tensor([0, 1, 2]), new, scale=torch.full((3, 2, 8), 0.05))
    for dtype in (torch.int32, torch.bool):
        cache = torch.zeros(2, 4, 2, 8, dtype=dtype)
        with pytest.raises(TypeError, match=f"argument 'cache'.*{dtype}"):
            store(cache, torch.tensor([0, 1, 2]), new)
        assert not cache.any()
    for reduce in ((3,), (-4,), (True,)):
        with pytest.raises(ValueError, match=r"argument 'reduce'.*\[-3, 2\]"):
            quantise(new, torch.int8, reduce=reduce)
    assert not pool.any() and not scales.any()


@pytest.mark.parametrize("groups", [8, 4, 1])
def test_store_takes_the_fixed_scale_flash_attention_reads(groups):
    """A fixed scale in the form the reader takes, (1, 1, Hkv, G) (per channel, per group of channels,
    per head): the cache is stored with it and flash_attention with k_scale = that scale gives the
    attention over the tokens as quantised."""
    g = gen(6)
    pool = torch.zeros(3, 4, 2, 8, dtype=torch.int8)
    k = torch.randn(9, 2, 8, generator=g)
    scale = torch.rand(1, 1, 2, groups, generator=g) * 0.02 + 0.02
    store(pool, torch.arange(9), k, scale=scale)
    spread = scale[0].repeat_interleave(8 // groups, dim=-1)
    assert torch.equal(pool.view(12, 2, 8)[:9], quantise(k, torch.int8, scale=spread)[0])
    q = torch.randn(1, 2, 4, 8, generator=g)
    table, used = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    kw = dict(layout="BSND", block_table=table, seqused_k=used)
    out = tileattn.flash_attention(q, pool, pool, k_scale=scale, v_scale=scale, **kw)
    deq = pool.double() * scale.double().repeat_interleave(8 // groups, dim=-1)
    verdict = judge("out", out, tileattn.reference(q.double(), deq, deq, **kw),
                    tileattn.reference(q, deq.float(), deq.float(), **kw), torch.float32)
    assert verdict.ok, str(verdict)


def test_store_reads_new_as_data_outside_autograd():
    """Keys that require grad (a model's activations) are stored as values: no cache joins a graph."""
    pool, scales = torch.zeros(2, 4, 2, 8, dtype=torch.int8), torch.zeros(2, 4, 2, 1)
    new = torch.randn(2, 2, 8, generator=gen(7), requires_grad=True)
    store(pool, torch.tensor([3, 6]), new, scale_cache=scales)
    assert scales.grad_fn is None and not scales.requires_grad
    assert torch.equal(scales.view(8, 2, 1)[[3, 6]], quantise(new.detach(), torch.int8)[1])


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


def test_int4_packs_two_values_a_byte_low_nibble_first():
    """The documented layout: byte c holds channel 2c in its low nibble, 2c + 1 in its high one, two's
    complement; per-group scales span groups of channels of each token."""
    values = torch.tensor([[-8, 7, 0, -1, 3, -3]])
    packed = pack_int4(values)
    assert packed.tolist() == [[0x78, 0xF0, 0xD3]] and torch.equal(unpack_int4(packed), values.to(torch.int8))
    x = torch.randn(4, 2, 64, generator=gen(11))
    x[0, 0, :32] *= 100  # one group of one token far larger: the other groups keep their precision
    stored, scale, offset = quantise(x, "int4", group_size=32)
    assert stored.shape == (4, 2, 32) and scale.shape == (4, 2, 2) and offset is None
    back = unpack_int4(stored).double() * scale.double().repeat_interleave(32, dim=-1)
    assert (back - x.double()).abs()[0, 0, 32:].max() <= scale[0, 0, 1] * 0.5 + 1e-6
    assert float(scale[0, 0, 1]) < float(scale[0, 0, 0]) / 20
    with pytest.raises(ValueError, match="argument 'group_size'.*5.*divisor of the last dim 64"):
        quantise(x, "int4", group_size=5)
    with pytest.raises(ValueError, match="argument 'x'.*even last dim"):
        quantise(torch.randn(3, 5), "int4")


@pytest.mark.parametrize("symmetric", [True, False])
def test_store_writes_int4_with_per_group_scales_and_flash_attention_reads_it(symmetric):
    g = gen(12)
    hq, hkv, d, page = 4, 2, 64, 4
    k_pool, v_pool = (torch.zeros(6, page, hkv, d // 2, dtype=torch.uint8) for _ in range(2))
    k_s, v_s = (torch.zeros(6, page, hkv, d // 32) for _ in range(2))
    k_o, v_o = (None, None) if symmetric else (torch.zeros(6, page, hkv, d // 32) for _ in range(2))
    table = torch.tensor([[4, 1, 5], [0, 2, 3]], dtype=torch.int32)
    lengths = [11, 6]
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = table[b, pos // page].long() * page + pos % page
        k_new, v_new = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        store(k_pool, slots, k_new, scale_cache=k_s, offset_cache=k_o)
        store(v_pool, slots, v_new, scale_cache=v_s, offset_cache=v_o)
        stored, s, o = quantise(k_new, "int4", group_size=32, symmetric=symmetric)
        assert torch.equal(k_pool.view(-1, hkv, d // 2)[slots], stored) and torch.equal(k_s.view(-1, hkv, 2)[slots], s)
    q = torch.randn(2, 1, hq, d, generator=g)
    kw = dict(layout="BSND", block_table=table, seqused_k=torch.tensor(lengths, dtype=torch.int32), causal=True)
    out = tileattn.flash_attention(q, k_pool, v_pool, k_scale=k_s, k_offset=k_o, v_scale=v_s, v_offset=v_o, **kw)

    def deq(pool, s, o):
        x = unpack_int4(pool).double() + (0 if o is None else o.double().repeat_interleave(32, -1))
        return x * s.double().repeat_interleave(32, -1)

    kd, vd = deq(k_pool, k_s, k_o), deq(v_pool, v_s, v_o)
    verdict = judge("out", out, tileattn.reference(q.double(), kd, vd, **kw),
                    tileattn.reference(q, kd.float(), vd.float(), **kw), torch.float32)
    assert verdict.ok, str(verdict)


def test_store_refuses_bad_int4_and_group_arguments_before_writing():
    pool = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)  # int4, head dim 32
    scales = torch.zeros(2, 4, 2, 2)
    new = torch.randn(2, 2, 32, generator=gen(13))
    with pytest.raises(ValueError, match="argument 'cache'.*last dim 16 \\(int4.*expected 8 bytes for head dim 16"):
        store(pool, torch.tensor([0, 1]), torch.randn(2, 2, 16), scale_cache=scales)
    with pytest.raises(ValueError, match="argument 'scale_cache'.*G dividing the head dim 32"):
        store(pool, torch.tensor([0, 1]), new, scale_cache=torch.zeros(2, 4, 2, 3))
    with pytest.raises(ValueError, match="argument 'offset_cache'.*float8_e4m3fn"):
        store(torch.zeros(2, 4, 2, 32, dtype=torch.float8_e4m3fn), torch.tensor([0, 1]), new, scale_cache=scales,
              offset_cache=torch.zeros(2, 4, 2, 2))
    assert not pool.any() and not scales.any()
