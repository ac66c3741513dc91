"""The serving forms of the flash-attn dialect: ``flash_attn_varlen_func(..., block_table=)`` (on
flash-attn's own test pattern, test_flash_attn_varlen_causal with paged_kv_block_size) and
FlashAttention-3's fp8 inputs with ``q_descale``/``k_descale``/``v_descale`` on ``flash_attn_func``
and ``flash_attn_with_kvcache``. Oracle: tileattn.reference in fp64 over the dequantised cache (the
dequantisation written out here); the 2x rule against plain math in q's dtype.
"""

from __future__ import annotations

import pytest
import torch

import tileattn
import tileattn.compat.flash_attn as flash_attn
from tileattn.core.testing import judge

E4M3 = torch.float8_e4m3fn


def gen(seed):
    return torch.Generator().manual_seed(seed)


def check(out, oracle, baseline, dtype):
    verdict = judge("out", out, oracle, baseline, dtype)
    assert verdict.ok, str(verdict)


def paged_copy(k, cu_k, page, g):
    """flash-attn's test: the packed keys of every sequence scattered over a shuffled pool of pages."""
    lengths = cu_k.diff().tolist()
    pages_of = [max(1, -(-n // page)) for n in lengths]
    total = sum(pages_of) + 2
    perm = torch.randperm(total, generator=g)
    table = torch.full((len(lengths), max(pages_of) + 1), -1, dtype=torch.int32)  # -1: never read
    pool = torch.randn((total, page) + tuple(k.shape[1:]), generator=g).to(k.dtype)
    at = 0
    for b, n in enumerate(lengths):
        table[b, :pages_of[b]] = perm[at:at + pages_of[b]].int()
        at += pages_of[b]
        for j in range(pages_of[b]):
            rows = k[int(cu_k[b]) + j * page:int(cu_k[b]) + min(n, (j + 1) * page)]
            pool[int(table[b, j]), :rows.shape[0]] = rows
    return pool, table


@pytest.mark.parametrize("page,dtype", [(16, torch.float16), (256, torch.bfloat16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (3, 799), (113, 203), (108, 256)])
def test_flash_attn_varlen_func_with_block_table(dtype, page, causal, seqlen_q, seqlen_k):
    g = gen(seqlen_q * 1000 + seqlen_k + page)
    b, h, hk, d = 2, 4, 2, 16
    q_lens = torch.randint(max(1, seqlen_q // 2), seqlen_q + 1, (b,), generator=g)
    k_lens = torch.randint(max(1, seqlen_k // 2), seqlen_k + 1, (b,), generator=g)
    if causal:
        k_lens = torch.maximum(k_lens, q_lens)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).int()
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), k_lens.cumsum(0)]).int()
    q = torch.randn(int(cu_q[-1]), h, d, generator=g).to(dtype).requires_grad_(True)  # as flash-attn's test
    k, v = (torch.randn(int(cu_k[-1]), hk, d, generator=g).to(dtype) for _ in range(2))
    pool_k, table = paged_copy(k, cu_k, page, g)
    pool_v, _ = paged_copy(v, cu_k, page, gen(0))
    pool_v.zero_()
    for bb in range(b):  # the same pages for v
        n = int(k_lens[bb])
        for j in range(-(-n // page)):
            rows = v[int(cu_k[bb]) + j * page:int(cu_k[bb]) + min(n, (j + 1) * page)]
            pool_v[int(table[bb, j]), :rows.shape[0]] = rows
    out = flash_attn.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, int(q_lens.max()), int(k_lens.max()),
                                            causal=causal, block_table=table)
    kw = dict(layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal)
    q = q.detach()
    oracle = tileattn.reference(q.double(), k.double(), v.double(), **kw)
    check(out, oracle, tileattn.reference(q, k, v, **kw), dtype)


def test_flash_attn_varlen_block_table_backward_names_block_table():
    """The paged varlen call is forward only (flash-attn's too): with q, k, v requiring grad the forward
    runs, and a backward raises a RuntimeError (flash-attn's class) that is a ValueError naming
    block_table; nothing reaches the inputs' .grad."""
    g = gen(5)
    q = torch.randn(5, 2, 8, generator=g).requires_grad_(True)
    pool_k, pool_v = (torch.randn(4, 4, 2, 8, generator=g).requires_grad_(True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    table = torch.tensor([[3, 0, -1], [1, 2, -1]], dtype=torch.int32)
    out = flash_attn.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 3, 6, causal=True, block_table=table)
    assert out.requires_grad
    k = torch.cat([pool_k[[3, 0]].flatten(0, 1)[:6], pool_k[[1, 2]].flatten(0, 1)[:3]]).detach()
    v = torch.cat([pool_v[[3, 0]].flatten(0, 1)[:6], pool_v[[1, 2]].flatten(0, 1)[:3]]).detach()
    want = tileattn.reference(q.detach(), k, v, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    torch.testing.assert_close(out.detach(), want)
    with pytest.raises(RuntimeError, match="argument 'block_table'.*backward.*cu_seqlens_k") as info:
        out.sum().backward()
    assert isinstance(info.value, ValueError)
    assert q.grad is None and pool_k.grad is None and pool_v.grad is None


def test_flash_attn_varlen_block_table_errors_name_the_argument():
    q, pool = torch.randn(4, 2, 8), torch.randn(3, 4, 2, 8)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="'block_table'.*block_table\\[0\\]\\[1\\] = 7") as info:
        flash_attn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 6, block_table=torch.tensor([[0, 7]]).int())
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="'block_table'.*6 keys of sequence 0"):
        flash_attn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 6, block_table=torch.tensor([[0]]).int())
    with pytest.raises(TypeError, match="'block_table'"):
        flash_attn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 6, block_table=torch.tensor([[0, 1]]))


def fp8(shape, g):
    return (torch.randn(shape, generator=g) * 8).to(E4M3)


@pytest.mark.parametrize("q_fp8", [True, False])
def test_fa3_flash_attn_func_fp8_with_descales(q_fp8):
    g = gen(21)
    b, sq, sk, h, hk, d = 2, 5, 33, 4, 2, 32
    q = fp8((b, sq, h, d), g) if q_fp8 else torch.randn(b, sq, h, d, generator=g).bfloat16()
    k, v = fp8((b, sk, hk, d), g), fp8((b, sk, hk, d), g)
    qd, kd, vd = (torch.rand(b, hk, generator=g) * 0.2 + 0.05 for _ in range(3))
    out = flash_attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, d)
    q64 = q.double() * qd.double().repeat_interleave(h // hk, 1)[:, None, :, None]
    k64, v64 = k.double() * kd.double()[:, None, :, None], v.double() * vd.double()[:, None, :, None]
    oracle = tileattn.reference(q64, k64, v64, layout="BSND", causal=True)
    baseline = tileattn.reference(q64.bfloat16(), k64.bfloat16(), v64.bfloat16(), layout="BSND", causal=True)
    check(out, oracle, baseline, torch.bfloat16)


@pytest.mark.parametrize("paged", [False, True])
def test_fa3_kvcache_fp8_cache_with_descales_and_appended_keys(paged):
    g = gen(22)
    b, h, hk, d, cap, page = 2, 4, 2, 16, 24, 8
    q = torch.randn(b, 1, h, d, generator=g).bfloat16()
    k_cache, v_cache = fp8((b, cap, hk, d), g), fp8((b, cap, hk, d), g)
    k_new, v_new = fp8((b, 1, hk, d), g), fp8((b, 1, hk, d), g)
    lens = torch.tensor([9, 17], dtype=torch.int32)
    kd, vd = (torch.rand(b, hk, generator=g) * 0.2 + 0.05 for _ in range(2))
    expected_k = k_cache.clone()
    expected_k[torch.arange(b), lens.long()] = k_new[:, 0]
    expected_v = v_cache.clone()
    expected_v[torch.arange(b), lens.long()] = v_new[:, 0]
    if paged:  # sequence b's pages are b * 3 .. b * 3 + 2 of a pool, in reverse order
        table = torch.tensor([[2, 1, 0], [5, 4, 3]], dtype=torch.int32)
        pool_k, pool_v = torch.empty(6, page, hk, d, dtype=E4M3), torch.empty(6, page, hk, d, dtype=E4M3)
        for bb in range(b):
            for j in range(3):
                pool_k[table[bb, j]] = k_cache[bb, j * page:(j + 1) * page]
                pool_v[table[bb, j]] = v_cache[bb, j * page:(j + 1) * page]
        out = flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                 causal=True, k_descale=kd, v_descale=vd)
        assert torch.equal(pool_k[table[1, 2], 17 - 16].view(torch.uint8), k_new[1, 0].view(torch.uint8))
    else:
        out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                                 k_descale=kd, v_descale=vd)
        assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    used = lens + 1
    k64 = expected_k.double() * kd.double()[:, None, :, None]
    v64 = expected_v.double() * vd.double()[:, None, :, None]
    kw = dict(layout="BSND", causal=True, seqused_k=used)
    oracle = tileattn.reference(q.double(), k64, v64, **kw)
    check(out, oracle, tileattn.reference(q, k64.bfloat16(), v64.bfloat16(), **kw), torch.bfloat16)


def test_fa3_descale_errors_name_the_argument():
    g = gen(23)
    q, k = fp8((2, 3, 4, 16), g), fp8((2, 7, 2, 16), g)
    with pytest.raises(ValueError, match="'k_descale'.*\\(batch=2, nheads_k=2\\)") as info:
        flash_attn.flash_attn_func(q, k, k, k_descale=torch.ones(2, 4))
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(TypeError, match="'v_descale'.*float64"):
        flash_attn.flash_attn_func(q, k, k, v_descale=torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match="'q'.*fp8 q with an fp8 cache"):
        flash_attn.flash_attn_func(q, k.bfloat16(), k.bfloat16())
    with pytest.raises(ValueError, match="'dropout_p'"):
        flash_attn.flash_attn_func(q, k, k, dropout_p=0.1)
    with pytest.raises(TypeError, match="'k'.*the cache's dtype"):
        flash_attn.flash_attn_with_kvcache(q[:, :1], k.clone(), k.clone(), k[:, :1].bfloat16(), k[:, :1].bfloat16(),
                                           cache_seqlens=2)
