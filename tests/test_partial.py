"""The partial-attention layer and what stands on it: shards merged by LSE, backward from global
statistics, a differentiable LSE, learnable sinks, ragged (seqused_k) and paged KV caches, and
diagonal alignment. Every engine that runs on CPU, judged against the fp64 reference (2x rule)."""

from __future__ import annotations

import math

import pytest
import torch

import tileattn
from tileattn.core.testing import judge

from conftest import make_qkv, skip_unless_supported


def _judged(results, oracle, baseline, dtype):
    failed = [str(v) for v in (judge(n, results[n], oracle[n], baseline[n], dtype) for n in results) if not v.ok]
    assert not failed, " | ".join(failed)


def _shards(sk, cuts):
    edges = [0, *cuts, sk]
    return list(zip(edges, edges[1:]))


def _reference_run(q, k, v, dtype, grad_out=None, grad_lse=None, **kwargs):
    """(out, lse, dq, dk, dv) of the reference in ``dtype`` (None = the inputs' own)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = tileattn.reference(*leaves, compute_dtype=dtype, return_lse=True, **kwargs)
    outputs, grads_in = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        outputs.append(lse)
        grads_in.append(grad_lse.to(lse.dtype))
    grads = torch.autograd.grad(outputs, leaves, grads_in)
    return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_shards_merge_to_full_attention(backend, causal, dtype):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=19, sk=53, d=16, dtype=dtype, seed=1)
    sq, sk = q.shape[2], k.shape[2]
    skip_unless_supported(backend, q, k, v, grad=True, causal=causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    # Uneven shards; with causal the last shard is hidden from the first rows (-inf there).
    for a, b in _shards(sk, [20, 41]):
        o, l = tileattn.attention_partial(leaves[0], leaves[1][:, :, a:b], leaves[2][:, :, a:b], causal=causal,
                                          align=(sk - sq) - a, backend=backend)
        assert o.dtype == torch.float32 and l.dtype == torch.float32
        outs.append(o)
        lses.append(l)
    out, lse = tileattn.merge_attentions(outs, lses, out_dtype=dtype)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    got = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    oracle = _reference_run(q, k, v, torch.float64, dout, causal=causal)
    baseline = _reference_run(q, k, v, None, dout, causal=causal)
    _judged(got, oracle, baseline, dtype)


def test_backward_from_global_statistics_gives_each_shard_its_share(backend):
    """Ring attention's backward: every shard's gradients computed from the *full* out and LSE add up
    to the full gradients (dq summed over shards, dk/dv concatenated)."""
    q, k, v = make_qkv(b=1, hq=4, hkv=1, sq=24, sk=40, d=8, seed=3)
    skip_unless_supported(backend, q, k, v, grad=True, causal=True)
    out, lse = tileattn.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
    gen = torch.Generator().manual_seed(4)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b in _shards(40, [16, 31]):
        g = tileattn.attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, dlse=dlse, causal=True,
                                        align=(40 - 24) - a, backend=backend)
        assert g.dbias is None and g.dsinks is None
        dq += g.dq
        dks.append(g.dk)
        dvs.append(g.dv)
    got = dict(dq=dq, dk=torch.cat(dks, 2), dv=torch.cat(dvs, 2))
    oracle = _reference_run(q, k, v, torch.float64, dout, dlse, causal=True)
    baseline = _reference_run(q, k, v, None, dout, dlse, causal=True)
    _judged(got, {n: oracle[n] for n in got}, {n: baseline[n] for n in got}, torch.float32)


def test_backward_of_query_row_slices_of_one_head(backend):
    """Context parallelism computes the backward a chunk of query rows at a time, passing row views
    of the global out and LSE: with one head, the LSE view keeps the whole tensor's strides on its
    size-1 dims, which must not matter. dq is the rows' own; dk/dv add up over the chunks."""
    q, k, v = make_qkv(b=1, hq=1, hkv=1, sq=48, sk=48, d=8, seed=5)
    skip_unless_supported(backend, q, k, v, grad=True, causal=True)
    out, lse = tileattn.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for a, b in _shards(48, [20]):
        rows = slice(a, b)
        g = tileattn.attention_backward(dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows],
                                        causal=True, align=a, backend=backend)
        dqs.append(g.dq)
        dk += g.dk
        dv += g.dv
    got = dict(dq=torch.cat(dqs, 2), dk=dk, dv=dv)
    oracle = _reference_run(q, k, v, torch.float64, dout, causal=True)
    baseline = _reference_run(q, k, v, None, dout, causal=True)
    _judged(got, {n: oracle[n] for n in got}, {n: baseline[n] for n in got}, torch.float32)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(5, 3), softcap=4.0),
                                    dict(alibi_slopes=torch.tensor([0.3, 0.6, 0.9, 1.2]))],
                         ids=["causal", "window+softcap", "alibi"])
def test_lse_is_differentiable(backend, kwargs):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=21, sk=30, d=16, seed=5)
    skip_unless_supported(backend, q, k, v, grad=True, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tileattn.flash_attention(*leaves, return_lse=True, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(6)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    got = dict(dq=grads[0], dk=grads[1], dv=grads[2])
    oracle = _reference_run(q, k, v, torch.float64, dout, dlse, **kwargs)
    baseline = _reference_run(q, k, v, None, dout, dlse, **kwargs)
    _judged(got, {n: oracle[n] for n in got}, {n: baseline[n] for n in got}, torch.float32)
    # The LSE term matters: without it the gradients differ.
    plain = torch.autograd.grad(tileattn.flash_attention(*leaves, backend=backend, **kwargs), leaves, dout)
    assert (plain[0] - grads[0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sinks_forward_backward_and_rows_without_keys(backend, dtype):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=13, sk=9, d=16, dtype=dtype, seed=7)
    sinks = torch.tensor([0.5, -2.0, 3.0, 0.0])
    skip_unless_supported(backend, q, k, v, grad=True, causal=True, sinks=sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out, lse = tileattn.flash_attention(*leaves[:3], sinks=leaves[3], causal=True, return_lse=True,
                                        backend=backend)
    assert out.dtype == dtype
    # Sq > Sk, bottom-right causal: the first 4 rows see no key. They output 0 and their LSE is the sink.
    assert (out[:, :, :4] == 0).all()
    torch.testing.assert_close(lse[:, :, :4], sinks.view(1, 4, 1).expand(2, 4, 4))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    got = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2], dsinks=grads[3])

    def run(cdt):
        ls = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        o, l = tileattn.reference(*ls[:3], sinks=ls[3], causal=True, return_lse=True, compute_dtype=cdt)
        g = torch.autograd.grad(o, ls, dout.to(o.dtype))
        return dict(out=o, lse=l, dq=g[0], dk=g[1], dv=g[2], dsinks=g[3])

    _judged(got, run(torch.float64), run(None), dtype)
    assert grads[3].abs().min() > 0


def test_seqused_k_equals_cutting_each_cache(backend):
    q, k, v = make_qkv(b=3, hq=4, hkv=2, sq=3, sk=40, d=16, seed=9)
    used = torch.tensor([40, 17, 1], dtype=torch.int32)
    skip_unless_supported(backend, q, k, v, seqused_k=used, causal=True)
    out, lse = tileattn.flash_attention(q, k, v, seqused_k=used, causal=True, return_lse=True, backend=backend)
    for b, n in enumerate(used.tolist()):
        o, l = tileattn.reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=True, return_lse=True,
                                  compute_dtype=torch.float64)
        torch.testing.assert_close(out[b:b + 1].double(), o, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(lse[b:b + 1].double(), l, rtol=2e-5, atol=2e-6)


def test_paged_kv_equals_the_contiguous_cache(backend):
    gen = torch.Generator().manual_seed(10)
    batch, hkv, block, blocks_per_seq, d = 3, 2, 8, 5, 16
    q = torch.randn(batch, 2, 8, d, generator=gen)  # BSND, 2 new tokens, 8 query heads
    k_cache = torch.randn(batch, blocks_per_seq * block, hkv, d, generator=gen)
    v_cache = torch.randn(batch, blocks_per_seq * block, hkv, d, generator=gen)
    used = torch.tensor([40, 13, 2], dtype=torch.int32)
    # Scatter the caches into a shuffled pool of blocks.
    table = torch.randperm(batch * blocks_per_seq + 4, generator=gen)[: batch * blocks_per_seq].view(batch, -1)
    table = table.to(torch.int32)
    k_pool = torch.zeros(batch * blocks_per_seq + 4, block, hkv, d)
    v_pool = torch.zeros_like(k_pool)
    k_pool[table.long()] = k_cache.view(batch, blocks_per_seq, block, hkv, d)
    v_pool[table.long()] = v_cache.view(batch, blocks_per_seq, block, hkv, d)
    kwargs = dict(layout="BSND", seqused_k=used, causal=True, return_lse=True)
    skip_unless_supported(backend, q, k_pool, v_pool, block_table=table, **kwargs)
    out, lse = tileattn.flash_attention(q, k_pool, v_pool, block_table=table, backend=backend, **kwargs)
    want_out, want_lse = tileattn.reference(q, k_cache, v_cache, compute_dtype=torch.float64, **kwargs)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="'block_table'"):
        tileattn.flash_attention(q, k_pool, v_pool, block_table=table + 100, backend=backend, **kwargs)


@pytest.mark.parametrize("align", ["top_left", 0, 5, -4, "bottom_right"])
@pytest.mark.parametrize("sq, sk", [(9, 14), (14, 9)])
def test_align_places_the_diagonal(backend, align, sq, sk):
    """A causal call aligned any way == the same call with the explicit mask ``j <= i + off``."""
    q, k, v = make_qkv(b=1, hq=2, sq=sq, sk=sk, d=8, seed=11)
    off = {"top_left": 0, "bottom_right": sk - sq}.get(align, align)
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(off)
    skip_unless_supported(backend, q, k, v, causal=True, align=align)
    got, got_lse = tileattn.flash_attention(q, k, v, causal=True, align=align, return_lse=True, backend=backend)
    want, want_lse = tileattn.reference(q, k, v, mask=mask, return_lse=True, compute_dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=2e-5, atol=2e-6)


def test_merge_is_exact_stable_and_safe_on_empty_rows():
    gen = torch.Generator().manual_seed(12)
    outs = [torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3)]
    lses = [torch.tensor([[[1e4, -math.inf, 0.0], [3.0, -math.inf, 80.0]]]) for _ in range(2)]
    lses.append(torch.tensor([[[1e4 - 1.0, -math.inf, -math.inf], [-math.inf, -math.inf, 90.0]]]))
    lses = [l.requires_grad_() for l in lses]
    outs = [o.requires_grad_() for o in outs]
    out, lse = tileattn.merge_attentions(outs, lses)
    assert torch.isneginf(lse[0, :, 1]).all() and (out[0, :, 1] == 0).all()
    assert torch.isfinite(out).all()
    w = torch.exp(torch.stack([l.detach() for l in lses]) - lse.detach().masked_fill(torch.isinf(lse), 0.0))
    torch.testing.assert_close(out.detach(), sum(wi[..., None] * o.detach() for wi, o in zip(w, outs)))
    grads = torch.autograd.grad((out.sum() + lse[torch.isfinite(lse)].sum()), outs + lses)
    assert all(torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="'lses'"):
        tileattn.merge_attentions(outs, lses[:2])
    # Other layouts: the weights follow the heads and rows of each layout.
    bsh = [o.detach().transpose(1, 2).flatten(2) for o in outs]
    merged_bsh, _ = tileattn.merge_attentions(bsh, [l.detach() for l in lses], layout="BSH")
    torch.testing.assert_close(merged_bsh, out.detach().transpose(1, 2).flatten(2))
