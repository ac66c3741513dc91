"""The flash-attn 2.x stand-in (tileattn.compat.flash_attn) against the exact reference."""

import numpy as np
import pytest
import torch

import tileattn
import tileattn.compat.flash_attn as flash_attn
from tileattn.compat.flash_attn import flash_attn_interface
from tileattn.core.testing import check_against_reference

from conftest import rotary_oracle


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _assert_all_ok(verdicts):
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert verdicts, "no verdicts"


def test_package_layout_mirrors_flash_attn():
    assert flash_attn.flash_attn_interface is flash_attn_interface
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"):
        assert getattr(flash_attn, name) is getattr(flash_attn_interface, name)
    assert flash_attn.__version__.startswith("2.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sq,sk", [(6, 6), (3, 9), (9, 4)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1)), (True, (2, -1))])
def test_flash_attn_func_matches_reference(dtype, sq, sk, causal, window):
    q, k, v = _rand(2, sq, 4, 16, dtype=dtype), _rand(2, sk, 2, 16, dtype=dtype, seed=1), _rand(2, sk, 2, 16, dtype=dtype, seed=2)

    def fa(q, k, v, **_):
        return flash_attn.flash_attn_func(q, k, v, causal=causal, window_size=window)

    tile_window = tuple(None if w < 0 else w for w in window)
    _assert_all_ok(check_against_reference(fa, q, k, v, layout="BSND", causal=causal, window=tile_window))


def test_flash_attn_func_softcap_alibi_scale_and_lse():
    q, k, v = _rand(2, 5, 4, 8, dtype=torch.float64), _rand(2, 7, 4, 8, dtype=torch.float64, seed=1), _rand(2, 7, 4, 8, dtype=torch.float64, seed=2)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float32)

    def fa(q, k, v, **_):
        out, lse, _probs = flash_attn.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, softcap=2.0,
                                                      alibi_slopes=slopes, return_attn_probs=True)
        return out, lse

    _assert_all_ok(check_against_reference(fa, q, k, v, layout="BSND", scale=0.3, causal=True, softcap=2.0,
                                           alibi_slopes=slopes, return_lse=True))


def test_return_attn_probs_are_the_softmax():
    q, k, v = _rand(1, 4, 2, 8, dtype=torch.float64), _rand(1, 6, 2, 8, dtype=torch.float64, seed=1), _rand(1, 6, 2, 8, dtype=torch.float64, seed=2)
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs.shape == (1, 2, 4, 6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 4, dtype=probs.dtype))
    # bottom-right causal: query 0 sees keys 0..2 only
    assert probs[0, :, 0, 3:].abs().max() == 0 and probs[0, :, 0, 2].min() > 0
    torch.testing.assert_close(torch.einsum("bhij,bjhd->bihd", probs.double(), v), out)


def test_dropout_is_seeded_by_torch_and_encoded_in_probs():
    q, k, v = _rand(1, 8, 2, 8), _rand(1, 8, 2, 8, seed=1), _rand(1, 8, 2, 8, seed=2)
    torch.manual_seed(3)
    a, _, probs = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    torch.manual_seed(3)
    b = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4)
    torch.manual_seed(4)
    c = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    dropped = (probs < 0).float().mean().item()
    assert 0.2 < dropped < 0.6
    # out = dropout(P) v with kept weights scaled by 1 / (1 - p)
    kept = torch.where(probs > 0, probs, torch.zeros_like(probs)) / 0.6
    torch.testing.assert_close(torch.einsum("bhij,bjhd->bihd", kept, v), a, atol=1e-5, rtol=1e-5)


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_packed_functions_pass_views_and_match(monkeypatch):
    qkv = _rand(2, 6, 3, 4, 8, dtype=torch.float64).requires_grad_(True)
    seen = []
    real = flash_attn_interface.flash_attention

    def spy(q, k, v, **kw):
        seen.append((q, k, v))
        return real(q, k, v, **kw)

    monkeypatch.setattr(flash_attn_interface, "flash_attention", spy)
    out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
    assert all(_storage(t) == _storage(qkv) for t in seen[0])
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_(True) for i in range(3))
    ref = flash_attn.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    (g_packed,) = torch.autograd.grad(out, qkv, dout)
    g_sep = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(g_packed, torch.stack(g_sep, dim=2))

    q2 = _rand(2, 4, 4, 8, dtype=torch.float64, seed=5)
    kv = _rand(2, 6, 2, 2, 8, dtype=torch.float64, seed=6)
    seen.clear()
    out2 = flash_attn.flash_attn_kvpacked_func(q2, kv, window_size=(2, 0))
    assert _storage(seen[0][1]) == _storage(kv) and _storage(seen[0][2]) == _storage(kv)
    torch.testing.assert_close(out2, flash_attn.flash_attn_func(q2, kv[:, :, 0], kv[:, :, 1], window_size=(2, 0)))


def _varlen_inputs(dtype=torch.float64):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 10], dtype=torch.int32)
    return (_rand(8, 4, 8, dtype=dtype), _rand(10, 2, 8, dtype=dtype, seed=1), _rand(10, 2, 8, dtype=dtype, seed=2),
            cu_q, cu_k)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (1, -1))])
def test_varlen_matches_reference(causal, window):
    q, k, v, cu_q, cu_k = _varlen_inputs(torch.float32)

    def fa(q, k, v, **_):
        return flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=causal, window_size=window,
                                                 return_attn_probs=True)[:2]

    tile_window = tuple(None if w < 0 else w for w in window)
    _assert_all_ok(check_against_reference(fa, q, k, v, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                           causal=causal, window=tile_window, return_lse=True))


def test_varlen_packed_variants_and_probs():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qkv = _rand(9, 3, 2, 8, dtype=torch.float64)
    out, lse, probs = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True, return_attn_probs=True)
    ref = flash_attn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, ref)
    assert lse.shape == (2, 9) and probs.shape == (2, 2, 5, 5)
    torch.testing.assert_close(probs[0, :, :4, :4].sum(-1), torch.ones(2, 4, dtype=probs.dtype))
    assert probs[0, :, 4].abs().max() == 0  # sequence 0 has 4 queries: row 4 is padding
    q = _rand(9, 2, 8, dtype=torch.float64, seed=3)
    kv = qkv[:, 1:]
    out2 = flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 5, 5)
    torch.testing.assert_close(out2, flash_attn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 5, 5))


def test_kvcache_appends_in_place_and_matches_full_attention():
    b, cap, hk, d = 3, 12, 2, 8
    k_cache, v_cache = _rand(b, cap, hk, d, dtype=torch.float64), _rand(b, cap, hk, d, dtype=torch.float64, seed=1)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = _rand(b, 2, 4, d, dtype=torch.float64, seed=2)
    k_new, v_new = _rand(b, 2, hk, d, dtype=torch.float64, seed=3), _rand(b, 2, hk, d, dtype=torch.float64, seed=4)
    lens = torch.tensor([3, 7, 0], dtype=torch.int32)
    slopes = torch.tensor([0.3, 0.2, 0.1, 0.05])
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                                  window_size=(4, -1), softcap=3.0, alibi_slopes=slopes,
                                                  return_softmax_lse=True)
    assert out.shape == (b, 2, 4, d) and lse.shape == (b, 4, 2)
    for i, n in enumerate(lens.tolist()):
        torch.testing.assert_close(k_cache[i, n:n + 2], k_new[i])
        torch.testing.assert_close(v_cache[i, n:n + 2], v_new[i])
        torch.testing.assert_close(k_cache[i, n + 2:], k_before[i, n + 2:])
        torch.testing.assert_close(k_cache[i, :n], k_before[i, :n])
        keys = torch.cat([k_before[i, :n], k_new[i]])[None]
        vals = torch.cat([v_before[i, :n], v_new[i]])[None]
        ro, rl = tileattn.reference(q[i:i + 1], keys, vals, layout="BSND", causal=True, window=(4, None), softcap=3.0,
                                    alibi_slopes=slopes, return_lse=True)
        torch.testing.assert_close(out[i:i + 1], ro)
        torch.testing.assert_close(lse[i:i + 1], rl)
    # without k/v nothing is written
    snapshot = k_cache.clone()
    out_eq = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, causal=True)
    assert torch.equal(k_cache, snapshot)
    torch.testing.assert_close(out_eq, tileattn.reference(q, k_cache[:, :5], v_cache[:, :5], layout="BSND", causal=True))


def test_kvcache_refuses_paged_leftpad_and_orphan_rotary():
    q, kc, vc = _rand(1, 1, 2, 8), _rand(1, 4, 2, 8), _rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="'cache_leftpad'.*paged") as info:  # flash-attn refuses it too
        flash_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, cache_leftpad=torch.zeros(1, dtype=torch.int32),
                                           block_table=torch.zeros(1, 1, dtype=torch.int32))
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin"):
        flash_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, rotary_cos=torch.ones(8, 2),
                                           rotary_sin=torch.zeros(8, 2))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_rotary_matches_explicit_rotation(interleaved, causal):
    b, cap, h, hk, d, rd = 2, 10, 4, 2, 8, 6
    k_cache, v_cache = _rand(b, cap, hk, d, dtype=torch.float64), _rand(b, cap, hk, d, dtype=torch.float64, seed=1)
    before = k_cache.clone()
    q, k_new = _rand(b, 3, h, d, dtype=torch.float64, seed=2), _rand(b, 3, hk, d, dtype=torch.float64, seed=3)
    v_new = _rand(b, 3, hk, d, dtype=torch.float64, seed=4)
    angles = torch.arange(12, dtype=torch.float64)[:, None] * torch.tensor([0.5, 0.1, 0.02], dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    lens = torch.tensor([2, 5], dtype=torch.int32)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved)
    for i, n in enumerate(lens.tolist()):
        k_rot = rotary_oracle(k_new[i], torch.arange(n, n + 3), cos, sin, interleaved)
        torch.testing.assert_close(k_cache[i, n:n + 3], k_rot)
        q_pos = torch.arange(n, n + 3) if causal else torch.full((3,), n)
        q_rot = rotary_oracle(q[i], q_pos, cos, sin, interleaved)
        keys = torch.cat([before[i, :n], k_rot])[None]
        vals = torch.cat([v_cache[i, :n], v_new[i]])[None]
        torch.testing.assert_close(out[i:i + 1], tileattn.reference(q_rot[None], keys, vals, layout="BSND", causal=causal))


def test_kvcache_paged_and_batch_indexed_caches():
    b, h, hk, d, page = 2, 4, 2, 8, 4
    lens = torch.tensor([3, 6], dtype=torch.int32)
    contiguous_k = _rand(b, 12, hk, d, dtype=torch.float64)
    contiguous_v = _rand(b, 12, hk, d, dtype=torch.float64, seed=1)
    q = _rand(b, 2, h, d, dtype=torch.float64, seed=2)
    k_new, v_new = _rand(b, 2, hk, d, dtype=torch.float64, seed=3), _rand(b, 2, hk, d, dtype=torch.float64, seed=4)
    expected = flash_attn.flash_attn_with_kvcache(q, contiguous_k.clone(), contiguous_v.clone(), k_new, v_new,
                                                  cache_seqlens=lens, causal=True)
    # paged: sequence b's 3 pages of 4 slots are scattered over a pool of 7 pages
    block_table = torch.tensor([[5, 0, 3], [2, 6, 1]], dtype=torch.int32)
    pool_k = torch.zeros(7, page, hk, d, dtype=torch.float64)
    pool_v = torch.zeros(7, page, hk, d, dtype=torch.float64)
    for i in range(b):
        for j, p in enumerate(block_table[i].tolist()):
            pool_k[p] = contiguous_k[i, j * page:(j + 1) * page]
            pool_v[p] = contiguous_v[i, j * page:(j + 1) * page]
    out = flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, cache_seqlens=lens,
                                             block_table=block_table, causal=True)
    torch.testing.assert_close(out, expected)
    # the new keys of sequence 1 (positions 6, 7) landed in its second page (pool page 6), slots 2 and 3
    torch.testing.assert_close(pool_k[6, 2:4], k_new[1])
    # cache_batch_idx: sequence b reads cache entry idx[b]
    idx = torch.tensor([2, 0], dtype=torch.int32)
    big_k = torch.zeros(3, 12, hk, d, dtype=torch.float64)
    big_v = torch.zeros(3, 12, hk, d, dtype=torch.float64)
    big_k[2], big_k[0] = contiguous_k[0], contiguous_k[1]
    big_v[2], big_v[0] = contiguous_v[0], contiguous_v[1]
    out2 = flash_attn.flash_attn_with_kvcache(q, big_k, big_v, k_new, v_new, cache_seqlens=lens,
                                              cache_batch_idx=idx, causal=True)
    torch.testing.assert_close(out2, expected)
    torch.testing.assert_close(big_k[0, 6:8], k_new[1])
    with pytest.raises(ValueError, match="'block_table'"):
        flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                           block_table=torch.tensor([[9, 0, 3], [2, 6, 1]], dtype=torch.int32))


def test_kvcache_rejects_overflowing_append():
    q, kc, vc = _rand(1, 1, 2, 8), _rand(1, 4, 2, 8), _rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn.flash_attn_with_kvcache(q, kc, vc, _rand(1, 2, 2, 8), _rand(1, 2, 2, 8), cache_seqlens=3)


def test_bad_arguments_name_the_flash_attn_argument():
    q = _rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="'qkv'.*size 3"):
        flash_attn.flash_attn_qkvpacked_func(_rand(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="'kv'"):
        flash_attn.flash_attn_kvpacked_func(q, _rand(1, 4, 3, 2, 8))
    with pytest.raises(TypeError, match="'window_size'"):
        flash_attn.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(ValueError, match="'dropout_p'"):
        flash_attn.flash_attn_func(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="'q'"):
        flash_attn.flash_attn_func(q[0], q, q)
    with pytest.raises(TypeError, match="'cu_seqlens_q'"):
        flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4]), torch.tensor([0, 4], dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="'k'.*block_table is given"):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, block_table=cu)


def test_flash_attn_func_compiles_fullgraph():
    torch._dynamo.reset()
    q, k, v = (_rand(2, 8, 4 if i == 0 else 2, 16, seed=i).requires_grad_(True) for i in range(3))
    compiled = torch.compile(lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True, softcap=5.0),
                             fullgraph=True)
    out = compiled(q, k, v)
    eager = flash_attn.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    torch.testing.assert_close(out, eager)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(eager, (q, k, v), dout)):
        torch.testing.assert_close(a, b)


# --- Integer arguments given as tensors (flash-attn's own tests pass torch.randint(0, s, (2,))) ---

def _entry_points():
    """Each of the seven functions on a small problem, as ``call(window_size) -> out``."""
    q, k, v = _rand(2, 6, 4, 8), _rand(2, 6, 2, 8, seed=1), _rand(2, 6, 2, 8, seed=2)
    qkv = torch.stack([_rand(2, 6, 2, 8, seed=i) for i in range(3)], dim=2)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    return {
        "flash_attn_func": lambda w: flash_attn.flash_attn_func(q, k, v, window_size=w),
        "flash_attn_qkvpacked_func": lambda w: flash_attn.flash_attn_qkvpacked_func(qkv, window_size=w),
        "flash_attn_kvpacked_func": lambda w: flash_attn.flash_attn_kvpacked_func(
            q, torch.stack([k, v], dim=2), window_size=w),
        "flash_attn_varlen_func": lambda w: flash_attn.flash_attn_varlen_func(*flat, cu, cu, 6, 6, window_size=w),
        "flash_attn_varlen_qkvpacked_func": lambda w: flash_attn.flash_attn_varlen_qkvpacked_func(
            qkv.flatten(0, 1), cu, 6, window_size=w),
        "flash_attn_varlen_kvpacked_func": lambda w: flash_attn.flash_attn_varlen_kvpacked_func(
            flat[0], torch.stack(flat[1:], dim=1), cu, cu, 6, 6, window_size=w),
        "flash_attn_with_kvcache": lambda w: flash_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=5,
                                                                             window_size=w),
    }


@pytest.mark.parametrize("window", [
    torch.tensor([2, 1]),                                   # flash-attn's tests: torch.randint(0, s, (2,))
    (torch.tensor(2), torch.tensor(1, dtype=torch.int32)),  # 0-d tensors
    [torch.tensor([2]), 1],                                 # one-element tensors, a list
    (np.int64(2), np.array(1)),                             # numpy integers
], ids=["1d-tensor", "0d-tensors", "1-element", "numpy"])
def test_window_size_accepts_integer_tensors_in_every_entry_point(window):
    for name, call in _entry_points().items():
        assert torch.equal(call(window), call((2, 1))), name


@pytest.mark.parametrize("window,why", [
    ((2.0, 1), "float"),
    ((torch.tensor([2, 3]), 1), r"shape \(2,\)"),
    (torch.tensor([2, 1, 0]), "3"),
    ((torch.tensor(2.5), 1), "float32|float"),
    ((True, 0), "bool"),
    ("2,1", "str"),
])
def test_window_size_rejects_what_flash_attn_rejects(window, why):
    for name, call in _entry_points().items():
        with pytest.raises(TypeError, match=f"'window_size'.*({why})") as info:
            call(window)
        assert isinstance(info.value, RuntimeError), f"{name}: flash-attn raises RuntimeError here"


def test_max_seqlen_accepts_integer_tensors():
    q, k, v, cu_q, cu_k = _varlen_inputs()
    expected = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    got = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(5), torch.tensor([5]), causal=True)
    assert torch.equal(got, expected)
    with pytest.raises(TypeError, match="'max_seqlen_q'"):
        flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5.0, 5)


# --- flash_attn_with_kvcache: flash-attn's rules for rotary tables and paged caches ---

def test_kvcache_rotary_table_length_is_flash_attns_rule():
    """flash-attn requires cos/sin to cover the cache (seqlen_ro >= seqlen_k, the cache capacity),
    nothing about seqlen_q: non-causal queries are all rotated at cache_seqlens."""
    b, cap, h, d = 2, 8, 2, 8
    k_cache, v_cache = _rand(b, cap, h, d, dtype=torch.float64), _rand(b, cap, h, d, dtype=torch.float64, seed=1)
    before = k_cache.clone()
    q = _rand(b, 4, h, d, dtype=torch.float64, seed=2)  # seqlen_q 4 > seqlen_new 1
    k_new, v_new = _rand(b, 1, h, d, dtype=torch.float64, seed=3), _rand(b, 1, h, d, dtype=torch.float64, seed=4)
    angles = torch.arange(cap, dtype=torch.float64)[:, None] * torch.tensor([0.3, 0.05], dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    lens = torch.tensor([7, 3], dtype=torch.int32)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=lens)
    for i, n in enumerate(lens.tolist()):
        k_rot = rotary_oracle(k_new[i], torch.arange(n, n + 1), cos, sin, True)
        q_rot = rotary_oracle(q[i], torch.full((4,), n), cos, sin, True)
        keys = torch.cat([before[i, :n], k_rot])[None]
        torch.testing.assert_close(out[i:i + 1], tileattn.reference(q_rot[None], keys, v_cache[i:i + 1, :n + 1],
                                                                    layout="BSND"))
    with pytest.raises(ValueError, match="'rotary_cos'.*7 positions.*8") as info:
        flash_attn.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, rotary_cos=cos[:7],
                                           rotary_sin=sin[:7], cache_seqlens=torch.tensor([2, 3], dtype=torch.int32))
    assert isinstance(info.value, RuntimeError)
    # Causal: query i is rotated at cache_seqlens + i, which must exist in the table.
    with pytest.raises(ValueError, match="'rotary_cos'.*causal"):
        flash_attn.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, rotary_cos=cos,
                                           rotary_sin=sin, cache_seqlens=lens, causal=True)


def test_kvcache_paged_rotary_covers_the_pages_of_a_sequence():
    """With a block table the cache seen by a sequence is max_blocks * page_size long."""
    q, k_new, v_new = _rand(1, 1, 2, 8), _rand(1, 1, 2, 8, seed=1), _rand(1, 1, 2, 8, seed=2)
    pool_k, pool_v = _rand(5, 4, 2, 8, seed=3), _rand(5, 4, 2, 8, seed=4)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    angles = torch.arange(8, dtype=torch.float32)[:, None] * torch.tensor([0.3, 0.05])
    kwargs = dict(cache_seqlens=2, block_table=table)
    flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, rotary_cos=angles.cos(),
                                       rotary_sin=angles.sin(), **kwargs)
    with pytest.raises(ValueError, match="'rotary_cos'"):
        flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, rotary_cos=angles[:7].cos(),
                                           rotary_sin=angles[:7].sin(), **kwargs)


def test_kvcache_block_table_errors_name_block_table_and_are_runtime_errors():
    q, pool_k, pool_v = _rand(2, 1, 2, 8), _rand(4, 4, 2, 8, seed=1), _rand(4, 4, 2, 8, seed=2)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    for table in ([[0, 1], [1, 5]], [[0, 1], [-1, 2]]):  # sequence 1 reads both of its pages
        bad = torch.tensor(table, dtype=torch.int32)
        with pytest.raises(ValueError, match="'block_table'") as info:
            flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=bad)
        assert isinstance(info.value, RuntimeError)
    # Entries past a sequence's last page are never read (flash-attn ignores them too).
    padded = torch.tensor([[0, 9], [1, 2]], dtype=torch.int32)
    out = flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=padded)
    same = flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                              block_table=torch.tensor([[0, 3], [1, 2]], dtype=torch.int32))
    assert torch.equal(out, same)
    with pytest.raises(TypeError, match="'block_table'") as info:
        flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=padded.long())
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("append", [False, True])
def test_kvcache_lengths_beyond_what_the_block_table_addresses_name_block_table(append):
    """flash-attn's tests expect an error naming block_table when cache_seqlens (+ the new keys) go
    past the pages a sequence's row of the block table addresses."""
    q, pool_k, pool_v = _rand(2, 1, 2, 8), _rand(6, 4, 2, 8, seed=1), _rand(6, 4, 2, 8, seed=2)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # 8 keys per sequence
    new = dict(k=_rand(2, 1, 2, 8, seed=3), v=_rand(2, 1, 2, 8, seed=4)) if append else {}
    fits = torch.tensor([3, 7 if append else 8], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, pool_k.clone(), pool_v.clone(), cache_seqlens=fits, block_table=table,
                                       **new)
    with pytest.raises(ValueError, match="argument 'block_table'.*8 keys.*cache_seqlens\\[1\\]") as info:
        flash_attn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=fits + 1, block_table=table, **new)
    assert isinstance(info.value, RuntimeError)


def test_flash_attn_errors_are_also_runtime_errors():
    """flash-attn's checks are TORCH_CHECKs (RuntimeError): callers catch either category."""
    q = _rand(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for call in (lambda: flash_attn.flash_attn_func(q, q, q, dropout_p=1.0),
                 lambda: flash_attn.flash_attn_func(q[0], q, q),
                 lambda: flash_attn.flash_attn_func(q, _rand(1, 4, 3, 8), _rand(1, 4, 3, 8)),
                 lambda: flash_attn.flash_attn_func(q, q.double(), q),
                 lambda: flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], cu.long(), cu, 4, 4)):
        with pytest.raises(RuntimeError) as info:
            call()
        assert isinstance(info.value, (ValueError, TypeError))
        assert "tileattn.compat.flash_attn" in str(info.value)


def test_core_errors_under_a_dialect_call_are_runtime_errors(monkeypatch):
    """What tileattn's core raises under a flash-attn call leaves it as a RuntimeError (flash-attn's
    class) that is still what tileattn's callers catch: NoBackendError, ValueError."""
    q = _rand(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func: tileattn: argument 'max_seqlen_q'") as info:
        flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 3, 4)
    assert isinstance(info.value, ValueError)
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")  # refuses bf16 CPU tensors, interpreter or not
    qb = q.bfloat16()
    for call in (lambda: flash_attn.flash_attn_func(qb, qb, qb),
                 lambda: flash_attn.flash_attn_with_kvcache(qb, qb, qb)):
        with pytest.raises(RuntimeError, match="tileattn.compat.flash_attn.*backend 'triton'") as info:
            call()
        assert isinstance(info.value, tileattn.NoBackendError)


# --- return_attn_probs: S_dmask ---

def _reference_probs(q, k, **kwargs):
    """(B, H, Sq, Sk) softmax probabilities from the fp64 reference (attending with v = identity)."""
    sk = k.shape[1]
    eye = torch.eye(sk, dtype=torch.float64)[None, :, None, :].expand(k.shape[0], sk, k.shape[2], sk)
    probs = tileattn.reference(q.double(), k.double(), eye, layout="BSND", compute_dtype=torch.float64, **kwargs)
    return probs.permute(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attn_probs_are_the_softmax_in_the_input_dtype(dtype):
    q, k, v = (_rand(2, s, h, 8, dtype=dtype, seed=i) for i, (s, h) in enumerate([(5, 4), (9, 2), (9, 2)]))
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.05])
    _, _, probs = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=2.0,
                                             alibi_slopes=slopes, return_attn_probs=True)
    assert probs.dtype == dtype and probs.shape == (2, 4, 5, 9)
    expected = _reference_probs(q, k, causal=True, window=(4, None), softcap=2.0, alibi_slopes=slopes)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(probs.double(), expected, atol=tol, rtol=tol)
    assert (probs[:, :, 0, 6:] == 0).all()  # causal, bottom-right: query 0 sees keys 0..4


def test_attn_probs_with_dropout_negate_the_dropped_entries():
    q, k, v = _rand(1, 6, 2, 8), _rand(1, 7, 2, 8, seed=1), _rand(1, 7, 2, 8, seed=2)
    torch.manual_seed(11)
    out, _, probs = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    expected = _reference_probs(q, k)
    torch.testing.assert_close(probs.abs().double(), expected, atol=1e-6, rtol=1e-6)
    dropped = probs < 0
    assert 0.1 < dropped.float().mean() < 0.5
    kept = torch.where(dropped, 0.0, probs) / 0.7
    torch.testing.assert_close(torch.einsum("bhij,bjhd->bihd", kept, v), out, atol=1e-5, rtol=1e-5)


def test_varlen_attn_probs_are_padded_to_the_given_max_seqlens():
    q, k, v, cu_q, cu_k = _varlen_inputs(torch.float32)
    _, _, probs = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True, return_attn_probs=True)
    assert probs.shape == (3, 4, 7, 9) and probs.dtype == torch.float32
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])):
        expected = _reference_probs(q[None, q0:q1], k[None, k0:k1], causal=True)[0]
        torch.testing.assert_close(probs[b, :, :q1 - q0, :k1 - k0].double(), expected, atol=1e-6, rtol=1e-6)
        assert probs[b, :, q1 - q0:].abs().max() == 0 and probs[b, :, :, k1 - k0:].abs().max() == 0


def test_attn_probs_cost_about_one_score_matrix():
    """Materialising S_dmask used to attend with v = identity: ~Sk times the work and ~10x the score
    matrix in memory. Now: the probabilities themselves plus one chunk of fp32 scores at a time.
    (Memory is measured; time is a benchmark's business, not a test's.)"""
    from tileattn.tools.measure import peak_memory

    s, h = 2048, 2
    q, k, v = (_rand(1, s, h, 64, dtype=torch.bfloat16, seed=i) for i in range(3))
    score_bytes = s * s * h * 2
    peaks = {}
    for flag in (False, True, False, True):
        _, peaks[flag] = peak_memory(lambda: flash_attn.flash_attn_func(q, k, v, return_attn_probs=flag), "cpu")
    if peaks[True] is not None:
        assert peaks[True] - peaks[False] < 2 * score_bytes, (peaks, score_bytes)
