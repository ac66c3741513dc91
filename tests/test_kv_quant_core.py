"""Quantised K/V caches and ragged batches in the core API (tileattn.flash_attention and
attention_partial): the KVQuant representation, its validation, its lowering to the native kernels
and the dequantising engines (cpu, reference).

Oracle: tileattn.reference in fp64 over the cache dequantised *here* (``(x.double() + offset) *
scale``, q_scale folded into q in fp64); baseline of the 2x rule: plain math in q's dtype over that
cache rounded to q's dtype.
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.core.kvquant import pack_int4, unpack_int4
from tileattn.core.testing import judge

FORMATS = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int4": torch.uint8}
BACKENDS = ["native", "cpu"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def quantised(shape, fmt, g):
    """A stored cache of logical shape ``shape`` (int4: packed two values a byte)."""
    if fmt is torch.int8:
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    if fmt is torch.uint8:
        return pack_int4(torch.randint(-8, 8, shape, generator=g))
    return (torch.randn(shape, generator=g) * 24).to(fmt)


def spread(t, width):
    return t.double().repeat_interleave(width // t.shape[-1], -1)


def deq(x, scale, offset=None):
    y = (unpack_int4(x) if x.dtype is torch.uint8 else x).double()
    if offset is not None:
        y = y + spread(offset, y.shape[-1])
    return y * spread(scale, y.shape[-1]) if scale is not None else y


def need(backend):
    if backend == "native":
        from tileattn.backends.native import kernels
        if not kernels.available()[0]:
            pytest.skip("native kernels unavailable")


def check(out, oracle, baseline, dtype, name="out"):
    verdict = judge(name, out, oracle, baseline, dtype)
    assert verdict.ok, str(verdict)


# BSND cache (B, S, Hkv, D): scale shapes (last dim = channel groups)
GRANULARITY = {
    "tensor": lambda b, s, h, d: (1, 1, 1, 1),
    "head": lambda b, s, h, d: (1, 1, h, 1),
    "channel": lambda b, s, h, d: (1, 1, h, d),
    "token": lambda b, s, h, d: (b, s, h, 1),
    "token_group": lambda b, s, h, d: (b, s, 1, d // 8),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,gran,offset", [("int8", "channel", True), ("int8", "token", False),
                                             ("int8", "tensor", True), ("e4m3", "head", False),
                                             ("e5m2", "token_group", False), ("e4m3", "channel", False),
                                             ("int4", "token_group", True), ("int4", "token", False)])
def test_quantised_cache_matches_the_fp64_reference(backend, fmt, gran, offset):
    dtype = torch.bfloat16 if gran in ("channel", "token_group") else torch.float32
    need(backend)
    g = gen(hash((fmt, gran)) % 1000)
    b, sq, sk, hq, hkv, d = 2, 3, 37, 4, 2, 32
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k, v = quantised((b, sk, hkv, d), FORMATS[fmt], g), quantised((b, sk, hkv, d), FORMATS[fmt], g)
    shape = GRANULARITY[gran](b, sk, hkv, d)
    ks, vs = torch.rand(shape, generator=g) * 0.05 + 0.01, torch.rand(shape, generator=g) * 0.05 + 0.01
    ko = torch.randint(-5, 6, shape, generator=g).float() if offset else None
    vo = torch.randint(-5, 6, shape, generator=g).float() if offset else None
    lengths = torch.tensor([sk, 20], dtype=torch.int32)
    out = tileattn.flash_attention(q, k, v, layout="BSND", causal=True, seqused_k=lengths, k_scale=ks, k_offset=ko,
                                   v_scale=vs, v_offset=vo, backend=backend)
    kd, vd = deq(k, ks, ko), deq(v, vs, vo)
    kw = dict(layout="BSND", causal=True, seqused_k=lengths)
    oracle = tileattn.reference(q.double(), kd, vd, **kw)
    baseline = tileattn.reference(q, kd.to(dtype), vd.to(dtype), **kw)
    check(out, oracle, baseline, dtype)
    # the reference's own reading of the keywords (the oracle of the dialects) agrees with this one
    ref = tileattn.reference(q.double(), k, v, k_scale=ks, k_offset=ko, v_scale=vs, v_offset=vo, compute_dtype=torch.float64, **kw)
    assert torch.allclose(ref, oracle, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_descaled_bf16_cache_bnsd_with_q_scale(backend):
    """FlashAttention-3's descales on a cache of q's dtype: (B, Hkv) per sequence and kv head."""
    need(backend)
    g = gen(3)
    b, sq, sk, hq, hkv, d = 2, 5, 29, 6, 2, 16
    q = torch.randn(b, hq, sq, d, generator=g).bfloat16()
    k, v = (torch.randn(b, hkv, sk, d, generator=g).bfloat16() for _ in range(2))
    qs, ks, vs = (torch.rand(b, hkv, generator=g) + 0.5 for _ in range(3))
    out = tileattn.flash_attention(q, k, v, causal=True, q_scale=qs, k_scale=ks[:, :, None, None],
                                   v_scale=vs[:, :, None, None], backend=backend)
    kd, vd = k.double() * ks[:, :, None, None].double(), v.double() * vs[:, :, None, None].double()
    qd = q.double() * qs.double().repeat_interleave(hq // hkv, 1)[:, :, None, None]
    oracle = tileattn.reference(qd, kd, vd, causal=True)
    baseline = tileattn.reference(qd.bfloat16(), kd.bfloat16(), vd.bfloat16(), causal=True)
    check(out, oracle, baseline, torch.bfloat16)


def ragged_batch(fmt, g, per_sequence_scales):
    """Decode rows and prefill chunks over one shuffled paged pool: (q, pools, table, used, cu_q, scales)."""
    hq, hkv, d, page = 4, 2, 32, 8
    q_lens, k_lens = [1, 7, 1, 12, 1], [19, 30, 1, 12, 44]
    pages_of = [-(-n // page) for n in k_lens]
    total = sum(pages_of) + 3
    perm = torch.randperm(total, generator=g)
    table = torch.zeros(len(k_lens), max(pages_of), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages_of):
        table[i, :n] = perm[at:at + n].int()
        at += n
    k, v = quantised((total, page, hkv, d), fmt, g), quantised((total, page, hkv, d), fmt, g)
    shape = (len(k_lens), 1, 1, hkv, 1) if per_sequence_scales else (1, page, hkv, d)
    ks, vs = torch.rand(shape, generator=g) * 0.05 + 0.01, torch.rand(shape, generator=g) * 0.05 + 0.01
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g)
    return q, k, v, table, torch.tensor(k_lens, dtype=torch.int32), cu_q, ks, vs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,per_sequence", [("int8", True), ("e4m3", False), ("int4", False)])
def test_ragged_batch_over_a_quantised_paged_pool(backend, fmt, per_sequence):
    need(backend)
    q, k, v, table, used, cu_q, ks, vs = ragged_batch(FORMATS[fmt], gen(7), per_sequence)
    kw = dict(layout="TND", cu_seqlens_q=cu_q, block_table=table, seqused_k=used, causal=True)
    out = tileattn.flash_attention(q, k, v, k_scale=ks, v_scale=vs, backend=backend, **kw)
    # oracle: each sequence's keys dequantised here with its own scales, as a contiguous cache
    cols = []
    for b in range(len(used)):
        pages = table[b].long()
        sks, svs = (s[b] if per_sequence else s for s in (ks, vs))
        kd = deq(k, sks.expand(k.shape[0], *sks.shape[1:]) if per_sequence else sks)[pages].flatten(0, 1)
        vd = deq(v, svs.expand(v.shape[0], *svs.shape[1:]) if per_sequence else svs)[pages].flatten(0, 1)
        cols.append((kd, vd))
    width = max(c[0].shape[0] for c in cols)
    kd = torch.stack([torch.nn.functional.pad(c[0], (0, 0, 0, 0, 0, width - c[0].shape[0])) for c in cols])
    vd = torch.stack([torch.nn.functional.pad(c[1], (0, 0, 0, 0, 0, width - c[1].shape[0])) for c in cols])
    kw64 = dict(layout="TND", cu_seqlens_q=cu_q, seqused_k=used, causal=True)  # TND q over a (B, S, H, D) cache
    oracle = tileattn.reference(q.double(), kd, vd, **kw64)
    baseline = tileattn.reference(q, kd.float(), vd.float(), **kw64)
    check(out, oracle, baseline, torch.float32)


def test_ragged_batch_is_bitwise_invariant_to_the_rest_of_the_batch():
    """Each sequence of a ragged call (decode rows and prefill chunks) gets the bits it gets alone."""
    need("native")
    q, k, v, table, used, cu_q, ks, vs = ragged_batch(torch.int8, gen(11), True)
    kw = dict(layout="TND", causal=True, backend="native")
    out = tileattn.flash_attention(q, k, v, cu_seqlens_q=cu_q, block_table=table, seqused_k=used, k_scale=ks,
                                   v_scale=vs, **kw)
    for b in range(len(used)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        alone = tileattn.flash_attention(q[rows], k, v, cu_seqlens_q=torch.tensor([0, rows.stop - rows.start],
                                                                                   dtype=torch.int32),
                                         block_table=table[b:b + 1], seqused_k=used[b:b + 1], k_scale=ks[b:b + 1],
                                         v_scale=vs[b:b + 1], **kw)
        assert torch.equal(out[rows], alone), f"sequence {b}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_queries_over_a_contiguous_cache_with_seqused_k(backend):
    """A ragged batch over a (B, S, Hkv, D) cache: the same as that cache read as B pages."""
    need(backend)
    g = gen(5)
    cache_k, cache_v = torch.randn(3, 24, 2, 16, generator=g), torch.randn(3, 24, 2, 16, generator=g)
    cu_q = torch.tensor([0, 1, 9, 10], dtype=torch.int32)
    used = torch.tensor([5, 24, 13], dtype=torch.int32)
    q = torch.randn(10, 4, 16, generator=g)
    kw = dict(layout="TND", cu_seqlens_q=cu_q, seqused_k=used, causal=True)
    out = tileattn.flash_attention(q, cache_k, cache_v, backend=backend, **kw)
    paged = tileattn.flash_attention(q, cache_k, cache_v, block_table=torch.arange(3, dtype=torch.int32)[:, None],
                                     backend=backend, **kw)
    assert torch.equal(out, paged)
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        n = int(used[b])
        oracle = tileattn.reference(q[rows].double().transpose(0, 1)[None], cache_k[b, :n].double().transpose(0, 1)[None],
                                    cache_v[b, :n].double().transpose(0, 1)[None], causal=True)
        assert torch.allclose(out[rows], oracle[0].transpose(0, 1).float(), atol=2e-5)
    with pytest.raises(ValueError, match="argument 'k'.*2 sequences|argument 'k'.*3 sequences"):
        tileattn.flash_attention(q[:9], cache_k, cache_v, layout="TND", cu_seqlens_q=cu_q[:3], seqused_k=used[:2])


def test_bad_scales_are_refused_before_compute_naming_the_argument():
    g = gen(1)
    q = torch.randn(1, 4, 2, 16, generator=g)
    k = quantised((1, 9, 2, 16), torch.int8, g)
    s = torch.ones(1, 1, 2, 1)
    kw = dict(layout="BSND", backend="native")
    with pytest.raises(TypeError, match="argument 'k_scale'.*float16.*fp32"):
        tileattn.flash_attention(q, k, k, k_scale=s.half(), **kw)
    with pytest.raises(ValueError, match="argument 'v_scale'.*shape \\(1, 1, 3, 1\\)"):
        tileattn.flash_attention(q, k, k, v_scale=torch.ones(1, 1, 3, 1), **kw)
    with pytest.raises(ValueError, match="argument 'k_offset'.*dividing the head dim 16"):
        tileattn.flash_attention(q, k, k, k_offset=torch.ones(1, 1, 2, 5), **kw)
    with pytest.raises(ValueError, match="argument 'k_scale'"):  # a batch axis needs a paged or packed cache
        tileattn.flash_attention(q, k, k, k_scale=torch.ones(1, 1, 1, 2, 1), **kw)
    with pytest.raises(ValueError, match="argument 'q_scale'.*\\(1, 2\\)"):
        tileattn.flash_attention(q, k, k, q_scale=torch.ones(1, 4), **kw)
    with pytest.raises(TypeError, match="argument 'k/v'.*int8"):
        tileattn.flash_attention(q, k, k.to(torch.float8_e4m3fn), k_scale=s, **kw)
    with pytest.raises(TypeError, match="argument 'k'.*int16"):
        tileattn.flash_attention(q, k.short(), k.short(), **kw)
    with pytest.raises(ValueError, match="argument 'k_scale'.*layout='BSH'"):
        tileattn.flash_attention(q.flatten(2), k.flatten(2), k.flatten(2), layout="BSH", num_heads=2, k_scale=s)


def test_quantised_caches_are_forward_only():
    g = gen(2)
    q = torch.randn(1, 4, 2, 16, generator=g, requires_grad=True)
    k = quantised((1, 9, 2, 16), torch.int8, g)
    s = torch.ones(1, 1, 2, 1)
    with pytest.raises(ValueError, match="argument 'k_scale'.*forward only"):
        tileattn.flash_attention(q, k, k, layout="BSND", k_scale=s)
    with torch.no_grad():
        out = tileattn.flash_attention(q, k, k, layout="BSND", k_scale=s)
    dout = torch.ones_like(out)
    with pytest.raises(tileattn.NoBackendError, match="quantised"):
        tileattn.attention_backward(dout, q.detach(), k, k, out, torch.zeros(1, 2, 4), layout="BSND", k_scale=s)


def test_scales_that_require_grad_are_refused_not_detached():
    """No gradient reaches a quantised cache's scales: one that requires grad is refused, naming it
    (under torch.no_grad() it is read as data)."""
    g = gen(5)
    q = torch.randn(1, 4, 2, 16, generator=g)
    k = quantised((1, 9, 2, 16), torch.int8, g)
    for name in ("k_scale", "v_offset", "q_scale"):
        t = torch.ones((1, 2) if name == "q_scale" else (1, 1, 2, 1), requires_grad=True)
        with pytest.raises(ValueError, match=f"argument '{name}'.*requires grad"):
            tileattn.flash_attention(q, k, k, layout="BSND", **{name: t})
    with torch.no_grad():
        out = tileattn.flash_attention(q, k, k, layout="BSND", k_scale=torch.ones(1, 1, 2, 1, requires_grad=True))
    assert torch.equal(out, tileattn.flash_attention(q, k, k, layout="BSND", k_scale=torch.ones(1, 1, 2, 1)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gran,sq", [("tensor", 1), ("head", 3), ("token", 1), ("token", 5)])
def test_an_infinite_k_scale_gives_the_references_nan_pattern(backend, gran, sq):
    """A non-finite K scale dequantises to +-inf channels, which the reference sums into NaN for every
    row that sees the key (a masked row stays finite); an engine that folds the scale in after q.k
    (which gives +-inf, and -inf drops the key) must not answer otherwise."""
    need(backend)
    g = gen(6)
    b, sk, hq, hkv, d = 2, 11, 4, 2, 16
    q = torch.randn(b, sq, hq, d, generator=g)
    k, v = quantised((b, sk, hkv, d), torch.int8, g), quantised((b, sk, hkv, d), torch.int8, g)
    ks = torch.rand(GRANULARITY[gran](b, sk, hkv, d), generator=g) * 0.05 + 0.01
    ks[(0,) * 3 if gran == "tensor" else (0, 0, 1) if gran == "head" else (0, sk - 3, 1)] = float("inf")
    kw = dict(layout="BSND", causal=True, k_scale=ks, v_scale=torch.full((1, 1, 1, 1), 0.02))
    out = tileattn.flash_attention(q, k, v, backend=backend, **kw)
    want = tileattn.reference(q, k, v, compute_dtype=torch.float64, **kw)
    assert torch.isnan(want).any() and (gran == "tensor" or not torch.isnan(want).all())
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    finite = ~torch.isnan(want)
    torch.testing.assert_close(out.double()[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_a_quantised_cache_without_scales_reads_unit_scales_and_partial_attention_takes_scales():
    need("native")
    g = gen(4)
    q = torch.randn(2, 3, 4, 16, generator=g)
    k, v = (quantised((2, 11, 2, 16), torch.float8_e5m2, g) for _ in range(2))
    out = tileattn.flash_attention(q, k, v, layout="BSND")
    oracle = tileattn.reference(q.double(), k.double(), v.double(), layout="BSND")
    baseline = tileattn.reference(q, k.float(), v.float(), layout="BSND")
    check(out, oracle, baseline, torch.float32)
    ks = torch.rand(1, 1, 2, 16, generator=g) * 0.1
    part, lse = tileattn.attention_partial(q, k, v, layout="BSND", k_scale=ks)
    _, lse64 = tileattn.reference(q.double(), deq(k, ks), v.double(), layout="BSND", return_lse=True)
    check(lse, lse64, tileattn.reference(q, deq(k, ks).float(), v.float(), layout="BSND", return_lse=True)[1],
          torch.float32, "lse")
