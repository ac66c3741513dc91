"""The native C kernels (tileattn/backends/native) against the exact reference.

Every accuracy check uses FlashAttention's rule (tileattn.core.testing.check_against_reference: error at
most 2x that of plain same-dtype math, plus a floor) through ``native_attention``, a small autograd
wrapper that turns the reference's user-level keywords into the kernels' low-level interface the
way a backend would (canonical strided views, never copies). Everything runs on whichever variant
this machine builds (AVX-512 here); test_native_build.py runs the AVX2 and generic builds.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import tileattn
from tileattn.core.testing import check_against_reference

from conftest import assert_nonfinite_like_reference, sigint_as_usual

nk = pytest.importorskip("tileattn.backends.native.kernels")
checked = pytest.importorskip("tileattn.backends.native.checked")
if not nk.available()[0]:
    pytest.skip(nk.available()[1], allow_module_level=True)

# ------------------------------------------------------------------------------------------ helpers


def canonical(x, layout, heads):
    """(B, H, S, D) strided view of a padded-layout tensor, (T, H, D) for TND; never a copy."""
    if layout in ("BNSD", "TND"):
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    x4 = x.unflatten(2, (heads, x.shape[2] // heads))
    return x4.transpose(1, 2) if layout == "BSH" else x4.permute(1, 2, 0, 3)


def _bcast4(t, full):
    return None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).expand(full)


def _views(layout, hq, q, k, v):
    """Canonical views of q, k, v and the kv head count."""
    qc = canonical(q, layout, hq)
    hkv = k.shape[-1] // qc.shape[-1] if layout in ("BSH", "SBH") else None
    return qc, canonical(k, layout, hkv), canonical(v, layout, hkv), hkv


class _Native(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, cfg):
        layout, hq, kw = cfg["layout"], cfg["hq"], cfg["kw"]
        qc, kc, vc, _ = _views(layout, hq, q, k, v)
        dv = vc.shape[-1]
        out = q.new_empty(q.shape[:-1] + ((hq * dv,) if layout in ("BSH", "SBH") else (dv,)))
        oc = canonical(out, layout, hq)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.empty((qc.shape[1], qc.shape[0]) if layout == "TND" else qc.shape[:3], dtype=acc)
        full = None if layout == "TND" else (qc.shape[0], qc.shape[1], qc.shape[2], kc.shape[2])
        call = dict(kw, mask=_bcast4(kw.get("mask"), full), bias=_bcast4(bias, full))
        checked.forward(qc, kc, vc, oc, lse, **call)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.cfg, ctx.call = cfg, call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, bias = ctx.saved_tensors
        layout, hq = ctx.cfg["layout"], ctx.cfg["hq"]
        qc, kc, vc, hkv = _views(layout, hq, q, k, v)
        oc, doc = canonical(out, layout, hq), canonical(dout.contiguous(), layout, hq)
        delta = (doc.to(lse.dtype) * oc.to(lse.dtype)).sum(-1)
        if layout == "TND":
            delta = delta.transpose(0, 1).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dbias = None
        if bias is not None and ctx.needs_input_grad[3]:
            dbias = torch.zeros((1,) * (4 - bias.dim()) + tuple(bias.shape), dtype=lse.dtype)
        checked.backward(qc, kc, vc, oc, doc, lse, delta, canonical(dq, layout, hq), canonical(dk, layout, hkv),
                         canonical(dv, layout, hkv), dbias=dbias, **ctx.call)
        return dq, dk, dv, None if dbias is None else dbias.reshape(bias.shape).to(bias.dtype), None


def native_attention(q, k, v, *, layout="BNSD", num_heads=None, scale=None, causal=False, window=None, mask=None,
                     bias=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, cu_seqlens_q=None,
                     cu_seqlens_k=None, return_lse=False, **native):
    """tileattn.flash_attention's user-level meaning, computed by the native kernels."""
    hq = num_heads if layout in ("BSH", "SBH") else q.shape[1]
    d = q.shape[-1] // hq if layout in ("BSH", "SBH") else q.shape[-1]
    left, right = window if window is not None else (None, None)
    left = -1 if left is None or left < 0 else left
    right = -1 if right is None or right < 0 else right
    if causal:
        right = 0 if right < 0 else min(right, 0)
    kw = dict(scale=1 / math.sqrt(d) if scale is None else scale, left=left, right=right, mask=mask,
              alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **native)
    out, lse = _Native.apply(q, k, v, bias, dict(layout=layout, hq=hq, kw=kw))
    return (out, lse) if return_lse else out


def assert_native_matches(q, k, v, grad=True, native=None, **kwargs):
    """check_against_reference on native_attention; `native` holds kernel-only keywords."""

    def fn(*tensors, **kw):
        return native_attention(*tensors, **kw, **(native or {}))

    verdicts = check_against_reference(fn, q, k, v, grad=grad, **kwargs)
    failed = [str(v) for v in verdicts if not v.ok]
    assert not failed, " | ".join(failed)
    expected = 1 + bool(kwargs.get("return_lse")) + (3 + (kwargs.get("bias") is not None and
                                                           kwargs["bias"].requires_grad) if grad else 0)
    assert len(verdicts) == expected
    return verdicts


def qkv(b=1, hq=2, hkv=None, sq=8, sk=None, d=16, dv=None, dtype=torch.float32, seed=0, layout="BNSD", scale=1.0):
    hkv, sk, dv = hkv or hq, sk or sq, dv or d
    g = torch.Generator().manual_seed(seed)

    def make(h, s, width):
        shape = {"BNSD": (b, h, s, width), "BSND": (b, s, h, width), "BSH": (b, s, h * width),
                 "SBH": (s, b, h * width)}[layout]
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    return make(hq, sq, d), make(hkv, sk, d), make(hkv, sk, dv)


def raw_forward(q, k, v, **kw):
    """Forward on canonical BNSD tensors; returns (out, lse)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty(q.shape[:3] + (v.shape[-1],))
    lse = torch.empty(q.shape[:3], dtype=acc)
    kw.setdefault("scale", 1 / math.sqrt(q.shape[-1]))
    checked.forward(q, k, v, out, lse, **kw)
    return out, lse


def band_mask(sq, sk, left=-1, right=-1, bottom_right=True, shift=0):
    """The kernels' band as a bool (sq, sk) mask, for the reference's mask= argument."""
    off = shift + (sk - sq if bottom_right else 0)
    rel = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - off
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= rel >= -left
    if right >= 0:
        keep &= rel <= right
    return keep


# ------------------------------------------------------------------------------- forward and backward

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("shape", [
    dict(b=2, hq=4, hkv=2, sq=37, sk=53, d=16),           # odd lengths, GQA, Sq < Sk
    dict(b=1, hq=3, hkv=1, sq=70, sk=29, d=24, dv=8),     # MQA, Sq > Sk, Dv != D
    dict(b=1, hq=2, sq=300, sk=300, d=64),                # several tiles each way
], ids=["gqa-odd", "mqa-sq>sk", "tiles"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_matches_reference(dtype, shape, causal):
    q, k, v = qkv(dtype=dtype, **shape)
    assert_native_matches(q, k, v, causal=causal, return_lse=True)


@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBH"])
def test_layouts_are_read_as_strided_views(layout):
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=45, sk=33, d=16, layout=layout)
    heads = dict(num_heads=4) if layout in ("BSH", "SBH") else {}
    assert_native_matches(q, k, v, layout=layout, causal=True, return_lse=True, **heads)


def test_non_contiguous_views():
    big = torch.randn(2, 5, 40, 48)
    q = big[:, 1:5, :31, 8:24]                                      # 4 heads, every stride unusual
    k = big[:, ::2][:, :2, 3:40, :16]                               # 2 kv heads, head stride 2
    v = big.transpose(1, 2)[:, 3:40, 1:4:2, 24:40].transpose(1, 2)  # through a BSND-style view
    assert q.stride(-1) == 1 and not q.is_contiguous() and not v.is_contiguous()
    assert_native_matches(q, k, v, causal=True)


@pytest.mark.parametrize("bottom_right,shift", [(True, 0), (False, 0), (True, 5), (False, -7)])
@pytest.mark.parametrize("left,right", [(-1, 0), (9, 0), (6, 4), (-1, 3)])
def test_band_alignments_and_shifts(bottom_right, shift, left, right):
    """The kernels get the band as left/right/bottom_right/shift; the reference gets it as a mask."""
    q, k, v = qkv(b=1, hq=2, sq=41, sk=67, d=16, seed=3)

    def fn(*t, mask=None, **kw):
        return native_attention(*t, window=(left, right), bottom_right=bottom_right, shift=shift, **kw)

    keep = band_mask(41, 67, left, right, bottom_right, shift)
    verdicts = check_against_reference(fn, q, k, v, return_lse=True, mask=keep)
    assert len(verdicts) == 5 and all(v.ok for v in verdicts), [str(v) for v in verdicts]


# ------------------------------------------------------------------------------- variable lengths


def packed(lengths_q, lengths_k, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(tk, hkv, d, generator=g).to(dtype)
    v = torch.randn(tk, hkv, dv or d, generator=g).to(dtype)

    def cu(lengths):
        return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)

    return q, k, v, cu(lengths_q), cu(lengths_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, (20, 0), (7, 3)], ids=["full", "w20", "w7-3"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_varlen(dtype, window, causal):
    q, k, v, cu_q, cu_k = packed([1, 37, 0, 150, 9], [4, 37, 5, 130, 1], dtype=dtype)
    assert_native_matches(q, k, v, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
                          window=window, return_lse=True)


def test_varlen_decode_rows():
    """Varlen batches of one query per sequence take the decode path."""
    q, k, v, cu_q, cu_k = packed([1, 1, 1], [700, 3, 1500], hq=8, hkv=2, d=64)
    assert_native_matches(q, k, v, grad=False, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                          return_lse=True)


# -------------------------------------------------------------------------- seqused_k, paged KV


def per_item_reference(q, k, v, used, causal, dtype=torch.float64):
    """Reference (out, lse) of each batch item on its first used[b] keys."""
    outs, lses = [], []
    for b, u in enumerate(used.tolist()):
        o, l = tileattn.reference(q[b:b + 1], k[b:b + 1, :, :u], v[b:b + 1, :, :u], causal=causal,
                                  compute_dtype=dtype, return_lse=True)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("sq", [1, 3, 40], ids=["decode", "spec3", "prefill"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_seqused_k(sq, causal):
    q, k, v = qkv(b=4, hq=8, hkv=2, sq=sq, sk=600, d=32, seed=5)
    used = torch.tensor([600, 17, 0, 333], dtype=torch.int32)
    out, lse = raw_forward(q, k, v, seqused_k=used, right=0 if causal else -1)
    ref, ref_lse = per_item_reference(q, k, v, used, causal)
    base, _ = per_item_reference(q, k, v, used, causal, dtype=torch.float32)
    from tileattn.core.testing import judge
    assert judge("out", out, ref, base, torch.float32).ok
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-5


def test_seqused_k_gradients_are_zero_past_the_used_keys():
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=30, sk=64, d=16, seed=6)
    used = torch.tensor([64, 21], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = native_attention(*leaves, causal=True, seqused_k=used)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b, u in enumerate(used.tolist()):
        ref_leaves = [t[b:b + 1, :, :u if i else None].double().requires_grad_()
                      for i, t in enumerate((q, k, v))]
        ref = tileattn.reference(*ref_leaves, causal=True)
        grads = torch.autograd.grad(ref, ref_leaves, dout[b:b + 1].double())
        for got, want in zip((leaves[0].grad[b:b + 1], leaves[1].grad[b:b + 1, :, :u], leaves[2].grad[b:b + 1, :, :u]),
                             grads):
            assert (got.double() - want).abs().max() < 1e-4
    assert torch.equal(leaves[1].grad[1, :, 21:], torch.zeros(2, 43, 16))
    assert torch.equal(leaves[2].grad[1, :, 21:], torch.zeros(2, 43, 16))


def paginate(k, v, page_size, seed=0):
    """A shuffled page pool holding k, v (B, H, S, D) and its block table."""
    b, h, s, _ = k.shape
    per_seq = -(-s // page_size)
    pages = b * per_seq + 3
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    table = order[:b * per_seq].reshape(b, per_seq).to(torch.int32)
    pad = per_seq * page_size - s

    def pool(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).transpose(1, 2)  # (B, S', H, D)
        p = torch.full((pages, page_size, h, x.shape[-1]), float("nan"), dtype=x.dtype)
        p[table.long().flatten()] = x.reshape(b * per_seq, page_size, h, x.shape[-1])
        return p

    return pool(k), pool(v), table


@pytest.mark.parametrize("sq", [1, 4, 70], ids=["decode", "spec4", "prefill"])
@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_kv_matches_contiguous_bitwise(sq, page_size):
    q, k, v = qkv(b=3, hq=8, hkv=2, sq=sq, sk=900, d=64, seed=7)
    used = torch.tensor([900, 1, 555], dtype=torch.int32)
    kp, vp, table = paginate(k, v, page_size)
    out, lse = raw_forward(q, k, v, seqused_k=used, right=0)
    pout, plse = raw_forward(q, kp, vp, block_table=table, seqused_k=used, right=0)
    assert torch.equal(out, pout) and torch.equal(lse, plse)
    ref, _ = per_item_reference(q, k, v, used, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5


def test_paged_kv_with_varlen_queries():
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=1, sk=300, d=32, seed=8)
    kp, vp, table = paginate(k, v, 16)
    used = torch.tensor([300, 123], dtype=torch.int32)
    qv = q.transpose(1, 2).reshape(2, 4, 32)  # two sequences of one token: (T, H, D)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.empty(2, 4, 32)
    lse = torch.empty(4, 2)
    checked.forward(qv, kp, vp, out, lse, scale=32 ** -0.5, cu_seqlens_q=cu_q, block_table=table, seqused_k=used)
    ref, ref_lse = per_item_reference(q, k, v, used, causal=False)
    assert (out.double() - ref[:, :, 0]).abs().max() < 1e-5
    assert (lse.double() - ref_lse[:, :, 0].T).abs().max() < 1e-5


# ------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("sk", [1, 17, 128, 1000, 5000])
def test_decode_shapes(dtype, sk):
    q, k, v = qkv(b=2, hq=8, hkv=2, sq=1, sk=sk, d=64, dtype=dtype, seed=sk)
    assert_native_matches(q, k, v, grad=sk == 17, causal=True, return_lse=True)


def test_decode_path_agrees_with_prefill_path():
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=2, sk=777, d=48, seed=9)
    dec = raw_forward(q, k, v, right=0, options=nk.FORCE_DECODE)
    pre = raw_forward(q, k, v, right=0, options=nk.FORCE_PREFILL)
    assert (dec[0] - pre[0]).abs().max() < 1e-6 and (dec[1] - pre[1]).abs().max() < 1e-5


# -------------------------------------------------------------------- determinism and invariance


@pytest.mark.parametrize("case", [dict(sq=200, sk=260), dict(sq=1, sk=5000), dict(sq=3, sk=2100)],
                         ids=["prefill", "decode", "spec"])
def test_forward_is_bitwise_identical_for_any_thread_count(case):
    q, k, v = qkv(b=2, hq=8, hkv=2, d=64, seed=10, **case)
    runs = [raw_forward(q, k, v, right=0, num_threads=n) for n in (1, 2, 3)]
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)


def test_backward_is_bitwise_identical_for_any_thread_count_and_schedule():
    q, k, v = qkv(b=1, hq=4, hkv=2, sq=300, sk=520, d=32, seed=11)
    grads = []
    for n, opt in ((1, 0), (2, 0), (3, 0), (2, nk.FORCE_SPLIT), (2, nk.FORCE_FUSED)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = native_attention(*leaves, causal=True, num_threads=n, options=opt)
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_forward_bits_do_not_depend_on_the_query_block(dtype):
    """Tiles start on multiples of block_n whatever the query block (and the block width follows the
    thread count and the L2 size), and each panel visits only the keys it sees: the same bits for
    blocks of 32 to 512 lanes, causal or windowed, GQA."""
    q, k, v = qkv(b=1, hq=8, hkv=2, sq=333, sk=400, d=40, seed=27, dtype=dtype)
    for kw in (dict(right=0), dict(left=50, right=7), dict(left=90, right=-1, bottom_right=False)):
        runs = [raw_forward(q, k, v, block_m=m, block_n=64, **kw) for m in (32, 96, 256, 512)]
        assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs[1:]), kw


@pytest.mark.parametrize("block_m,block_n", [(512, 64), (256, 32), (64, 256)])
def test_wide_blocks_and_panel_key_ranges_match_the_reference(block_m, block_n):
    """Query blocks of many panels against tiles that the causal diagonal or a window cuts: each
    panel's key range, the zeroed rows of P and dS outside it and the lane ranges of dK/dV."""
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=300, sk=345, d=24, dv=40, seed=28)
    native = dict(block_m=block_m, block_n=block_n)
    assert_native_matches(q, k, v, causal=True, return_lse=True, native=native)
    assert_native_matches(q, k, v, window=(60, 20), return_lse=True, native=native)
    assert_native_matches(q, k, v, window=(30, -1), dropout_p=0.2, seed=4, native=native)


@pytest.mark.parametrize("d,dv", [(32, 32), (80, 80), (96, 96), (192, 192), (256, 256), (512, 512), (192, 128),
                                  (576, 512)], ids=lambda x: str(x))
def test_head_dims(d, dv):
    """Every head dim the roofline covers (MLA prefill 192/128 and absorbed 576/512 included): the
    tile sizes that follow from D + Dv, partial register blocks and panels, forward and backward."""
    q, k, v = qkv(b=1, hq=4, hkv=2, sq=97, sk=130, d=d, dv=dv, seed=29)
    assert_native_matches(q, k, v, causal=True, return_lse=True)


@pytest.mark.parametrize("sq", [1, 90], ids=["decode", "prefill"])
def test_batch_invariance(sq):
    """A row's bits do not depend on the other batch items (their number or their key counts)."""
    q, k, v = qkv(b=5, hq=8, hkv=2, sq=sq, sk=3000, d=64, seed=12)
    used = torch.tensor([3000, 2500, 40, 3000, 1], dtype=torch.int32)
    full = raw_forward(q, k, v, seqused_k=used, right=0)
    for b in (0, 2, 4):
        alone = raw_forward(q[b:b + 1], k[b:b + 1], v[b:b + 1], seqused_k=used[b:b + 1], right=0)
        assert torch.equal(alone[0], full[0][b:b + 1]) and torch.equal(alone[1], full[1][b:b + 1])


# ---------------------------------------------------------------------------------- modifiers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
def test_softcap_and_alibi(dtype):
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=70, sk=90, d=16, dtype=dtype, seed=13, scale=3.0)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) * 0.5
    assert_native_matches(q, k, v, softcap=5.0, alibi_slopes=slopes, causal=True, return_lse=True)
    assert_native_matches(q, k, v, alibi_slopes=slopes[0], window=(30, 10), return_lse=True)


@pytest.mark.parametrize("shape", [(70, 90), (2, 1, 70, 90), (1, 4, 1, 90), (2, 4, 70, 1)],
                         ids=["SqSk", "B1SqSk", "1H1Sk", "BHSq1"])
def test_bias_and_its_gradient(shape):
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=70, sk=90, d=16, seed=14)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
    assert_native_matches(q, k, v, bias=bias, causal=True, return_lse=True)


def test_bias_gradient_is_bitwise_identical_for_any_thread_count():
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=300, sk=300, d=16, seed=15)
    bias0 = torch.randn(1, 4, 300, 300)
    grads = []
    for n, opt in ((1, 0), (2, 0), (3, nk.FORCE_SPLIT)):
        bias = bias0.clone().requires_grad_()
        out = native_attention(q, k, v, bias=bias, num_threads=n, options=opt)
        out.backward(torch.ones_like(out))
        grads.append(bias.grad)
    assert all(torch.equal(g, grads[0]) for g in grads)


@pytest.mark.parametrize("shape", [(2, 1, 70, 90), (90,), (70, 1)], ids=["B1SqSk", "keys", "rows"])
def test_bool_mask(shape):
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=70, sk=90, d=16, seed=16)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.3
    assert_native_matches(q, k, v, mask=mask, causal=True, return_lse=True)


def test_mask_hiding_whole_tiles_skips_them():
    """NaN values in V under fully hidden key tiles never reach the output (the tiles are skipped)."""
    q, k, v = qkv(b=1, hq=2, sq=300, sk=1024, d=16, seed=17)
    mask = torch.ones(1024, dtype=torch.bool)
    mask[256:768] = False  # key tiles 1 and 2 of 256
    v[:, :, 256:768] = float("nan")
    out = native_attention(q, k, v, mask=mask)
    assert torch.isfinite(out).all()
    ref = tileattn.reference(q, k[:, :, mask], v[:, :, mask], compute_dtype=torch.float64)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dropout(dtype):
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=70, sk=90, d=16, dtype=dtype, seed=18)
    assert_native_matches(q, k, v, dropout_p=0.3, seed=1234, causal=True)
    a = native_attention(q, k, v, dropout_p=0.3, seed=99)
    b = native_attention(q, k, v, dropout_p=0.3, seed=99, num_threads=1, block_n=64)
    c = native_attention(q, k, v, dropout_p=0.3, seed=98)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # another tiling rounds P (bf16) differently
    assert (a.float() - b.float()).abs().max() < tol and not torch.allclose(a, c)


def test_dropout_decode_path():
    q, k, v = qkv(b=2, hq=8, hkv=2, sq=1, sk=700, d=32, seed=19)
    assert_native_matches(q, k, v, grad=False, dropout_p=0.25, seed=7)


# ------------------------------------------------------------------------------ edge values


def test_rows_that_see_nothing():
    q, k, v = qkv(b=1, hq=2, sq=5, sk=2, d=8, seed=20)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = native_attention(*leaves, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :3], torch.zeros(1, 2, 3, 8)) and torch.isneginf(lse[:, :, :3]).all()
    out.sum().backward()
    assert torch.equal(leaves[0].grad[:, :, :3], torch.zeros(1, 2, 3, 8))
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    mask = torch.rand(2, 1, 40, 60, generator=torch.Generator().manual_seed(4)) > 0.5
    mask[0, 0, 3] = False
    q, k, v = qkv(b=2, hq=2, sq=40, sk=60, d=8, seed=21)
    assert_native_matches(q, k, v, mask=mask, return_lse=True)


def test_huge_scores_give_finite_gradients():
    """|q.k| ~ 1e9 in fp32: the LSE carries ~64 units of rounding, yet P stays <= 1."""
    q, k, v = qkv(b=1, hq=2, sq=300, sk=300, d=64, seed=22)
    q, k = q * 4e3, k * 4e3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = native_attention(*leaves, scale=1.0, causal=True)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in leaves)
    ref = tileattn.reference(q, k, v, scale=1.0, causal=True, compute_dtype=torch.float64)
    assert (out.double() - ref).abs().max() < 1e-3


@pytest.mark.parametrize("where", ["q", "k", "v", "bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("s", [40, 300], ids=["one-tile", "tiles"])
def test_nan_and_inf_reach_the_output_like_the_reference(where, value, s):
    """Every row that sees the bad value is non-finite where the reference is; the rows that do not
    see it are the clean input's result where finite (conftest.assert_nonfinite_like_reference)."""
    q, k, v = qkv(b=1, hq=2, sq=s, sk=s, d=8, seed=23)
    bias = torch.zeros(s, s)
    clean_ref = tileattn.reference(q, k, v, bias=bias, causal=True, compute_dtype=torch.float64)
    {"q": q, "k": k, "v": v, "bias": bias}[where][..., s // 2, 3] = value
    out = native_attention(q, k, v, bias=bias, causal=True)
    ref = tileattn.reference(q, k, v, bias=bias, causal=True, compute_dtype=torch.float64)
    rows = torch.arange(s)
    # a query row or a bias row is seen by its own row; a key by every row at or after it
    sees = (rows == s // 2) if where in ("q", "bias") else (rows >= s // 2)
    assert_nonfinite_like_reference(out, ref, clean_ref, sees.expand(1, 2, s))


# ------------------------------------------------------------------------------- bad input


def _call_ok():
    q, k, v = qkv(b=1, hq=2, sq=4, sk=6, d=8)
    return q, k, v, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4)


@pytest.mark.parametrize("change,exc,words", [
    (lambda a: a.update(q=a["q"].double()), TypeError, "dtype"),
    (lambda a: a.update(k=a["k"][:, :, :, :4]), ValueError, "head dim"),
    (lambda a: a.update(v=a["v"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "unit stride"),
    (lambda a: a.update(out=a["out"][:, :1]), ValueError, "'out'"),
    (lambda a: a.update(lse=a["lse"].double()), TypeError, "'lse'"),
    (lambda a: a.update(q=a["q"][:, :1]), ValueError, "kv heads dividing"),
    (lambda a: a["kw"].update(seqused_k=torch.tensor([7], dtype=torch.int32)), ValueError, "seqused_k"),
    (lambda a: a["kw"].update(seqused_k=torch.tensor([3])), TypeError, "seqused_k"),
    (lambda a: a["kw"].update(dropout_p=1.0), ValueError, "dropout_p"),
    (lambda a: a["kw"].update(cancel=True), TypeError, "cancel"),
    (lambda a: a["kw"].update(typo=1), TypeError, "typo"),
], ids=["dtype", "headdim", "stride", "out-shape", "lse-dtype", "heads", "seqused-range", "seqused-dtype",
        "dropout", "cancel", "keyword"])
def test_bad_input_raises_before_compute(change, exc, words):
    q, k, v, out, lse = _call_ok()
    args = dict(q=q, k=k, v=v, out=out, lse=lse, kw={})
    change(args)
    with pytest.raises(exc, match=words):
        checked.forward(args["q"], args["k"], args["v"], args["out"], args["lse"], scale=1.0, **args["kw"])
    assert torch.equal(out, torch.zeros(1, 2, 4, 8))


def test_bad_index_data_is_caught_in_c_before_compute():
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 6])
    out, lse = torch.zeros(7, 4, 16), torch.zeros(4, 7)
    bad = cu_k.clone()
    bad[1] = 12  # [0, 12, 11]
    with pytest.raises(ValueError, match="cu_seqlens_k decreases"):
        checked.forward(q, k, v, out, lse, scale=1.0, cu_seqlens_q=cu_q, cu_seqlens_k=bad)
    q, k, v = qkv(b=1, hq=2, sq=1, sk=32, d=16)
    kp, vp, table = paginate(k, v, 16)
    table[0, 1] = 1000
    with pytest.raises(ValueError, match="block_table"):
        raw_forward(q, kp, vp, block_table=table)
    assert torch.equal(out, torch.zeros(7, 4, 16))


# ------------------------------------------------------------------------ threads, cancellation


def test_one_openmp_runtime_and_caller_settings_untouched():
    threads = torch.get_num_threads()
    q, k, v = qkv(b=2, hq=8, sq=300, d=64)
    raw_forward(q, k, v, num_threads=3)
    assert torch.get_num_threads() == threads
    maps = open("/proc/self/maps").read()
    runtimes = {m for m in re.findall(r"\S*lib(?:g|i)omp\S*\.so\S*", maps)}
    assert len(runtimes) == 1, runtimes


def test_cancel_flag_set_before_the_call():
    flag = nk.CancelFlag()
    flag.set()
    q, k, v = qkv(b=1, hq=2, sq=300, d=64)
    with pytest.raises(nk.Cancelled):
        raw_forward(q, k, v, cancel=flag)
    flag.clear()
    raw_forward(q, k, v, cancel=flag)


def test_cancel_flag_stops_a_long_call_from_another_thread():
    import threading
    import time
    q, k, v = qkv(b=1, hq=16, sq=4096, d=64)
    flag = nk.CancelFlag()
    timer = threading.Timer(0.05, flag.set)
    start = time.perf_counter()
    timer.start()
    with pytest.raises(nk.Cancelled):
        raw_forward(q, k, v, cancel=flag, num_threads=1)
    assert time.perf_counter() - start < 1.0  # the whole call takes several seconds on one thread


def test_sigint_interrupts_a_long_call():
    script = textwrap.dedent("""
        import os, signal, threading, time, torch
        from tileattn.backends.native import checked, kernels as nk
        q = torch.randn(1, 16, 4096, 64); out = torch.empty_like(q); lse = torch.empty(1, 16, 4096)
        nk.load()
        flag = nk.CancelFlag()
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        start = time.perf_counter()
        try:
            with flag.on_sigint():
                checked.forward(q, q, q, out, lse, scale=0.125, cancel=flag, num_threads=1)
        except KeyboardInterrupt:
            print("interrupted", flag.by_sigint, round(time.perf_counter() - start, 1))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ), preexec_fn=sigint_as_usual)
    words = res.stdout.split()
    assert words[:2] == ["interrupted", "True"], res.stdout + res.stderr
    assert float(words[2]) < 1.5


def test_probes_measure_the_machine():
    """The roofline's yardsticks: FMA peak, exp2 rate (the softmax's roof) and, where present, AMX."""
    assert nk.fma_peak_gflops(1) > 1 and nk.exp2_rate() > 1e7
    amx = nk.amx_peak_gflops()
    assert (amx > nk.fma_peak_gflops(1)) if nk.build_info()["amx"] else amx == 0
    if os.environ.get("TILEATTN_NATIVE_PROFILE") != "1":
        assert nk.profile() is None  # counters exist only in the profiling build (test_native_build.py)


_SIGINT_DISPOSITIONS = """
import os, signal, threading, time, torch, tileattn
torch.set_num_threads(1)
q = torch.randn(1, 16, 4096, 64)
expected = tileattn.flash_attention(q[:, :1], q[:, :1], q[:, :1], backend="native")
handled = []

def call_with_sigint(delay):
    # The signal is sent while the main thread is inside the C call (its only work between the
    # event and the return); the script prints when it was sent relative to the call's end.
    started = threading.Event()
    sent = []
    def send():
        started.wait()
        time.sleep(delay)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=send).start()
    started.set()
    try:
        out = tileattn.flash_attention(q, q, q, backend="native")
        outcome = "completed" if torch.equal(out[:, :1], expected) else "wrong"
    except KeyboardInterrupt:
        outcome = "interrupted"
    end = time.perf_counter()
    time.sleep(0.05)  # a Python-level handler runs at the next bytecode boundary
    return outcome, sent[0] < end

print("default", *call_with_sigint(0.05))
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ignored", *call_with_sigint(0.05))
signal.signal(signal.SIGINT, lambda signum, frame: handled.append(signum))
print("handler", *call_with_sigint(0.05), handled == [signal.SIGINT])
"""


def test_ctrl_c_cancels_only_under_pythons_default_sigint_handler():
    """A long native call from the main thread: Ctrl-C (SIGINT sent while the C code runs) cancels it
    with KeyboardInterrupt under Python's default handler; under SIG_IGN the call completes and
    nothing is raised; under the program's own handler the call completes, that handler runs (once)
    and no KeyboardInterrupt comes from tileattn."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_SIGINT_DISPOSITIONS)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ), preexec_fn=sigint_as_usual)
    lines = res.stdout.splitlines()
    # "True": the signal was sent before the call returned, so each case tests what it claims.
    assert lines == ["default interrupted True", "ignored completed True", "handler completed True True"], \
        res.stdout + res.stderr[-3000:]


def test_active_isa_is_the_requested_one():
    info = nk.build_info()
    assert info["isa"] == os.environ.get("TILEATTN_NATIVE_ISA", info["isa"])
    assert os.path.isfile(info["path"])
    # OpenMP wherever the compiler links it (the wheel's libraries always); else the thread pool
    if info["source"] == "compiled":
        from tileattn.programs import toolchain

        assert info["openmp"] == toolchain.openmp_links(tuple(toolchain.find_compiler()), ())
    else:
        assert info["openmp"]


@pytest.mark.skipif(not nk.build_info()["bf16dot"], reason="the CPU/compiler has no AVX512_BF16")
@pytest.mark.parametrize("shape", [dict(sq=300, sk=300, d=64), dict(sq=70, sk=91, d=33, dv=20)], ids=["tiles", "odd"])
def test_bf16_dot_product_tiles(shape):
    """vdpbf16ps tiles (P rounded to bf16 for P.V, as GPU FlashAttention) where the probe or the
    caller turns them on; bitwise different from the fp32 tiles, both within the rule."""
    q, k, v = qkv(b=2, hq=8, hkv=2, dtype=torch.bfloat16, seed=24, **shape)
    dot = dict(options=nk.BF16DOT | nk.NO_AMX)
    assert_native_matches(q, k, v, causal=True, return_lse=True, native=dot)
    assert_native_matches(q, k, v, grad=False, window=(40, 7), native=dot)
    fp32_tiles = raw_forward(q, k, v, options=nk.NO_BF16DOT | nk.NO_AMX)[0]
    assert not torch.equal(raw_forward(q, k, v, **dot)[0], fp32_tiles)


@pytest.mark.skipif(not nk.build_info()["amx"], reason="no AMX on this CPU/OS")
@pytest.mark.parametrize("shape", [dict(sq=300, sk=300, d=64), dict(sq=70, sk=91, d=33, dv=20),
                                   dict(sq=257, sk=1000, d=128, hq=4)], ids=["tiles", "odd", "d128"])
def test_amx_tiles(shape):
    """AMX tiles are the bf16 default where the CPU and the OS allow them; NO_AMX falls back."""
    shape = dict(dict(b=2, hq=8, hkv=2), **shape)
    q, k, v = qkv(dtype=torch.bfloat16, seed=25, **shape)
    assert_native_matches(q, k, v, causal=True, return_lse=True)
    assert_native_matches(q, k, v, grad=False, window=(40, 7), return_lse=True)
    amx = raw_forward(q, k, v, right=0)[0]
    assert not torch.equal(amx, raw_forward(q, k, v, right=0, options=nk.NO_AMX)[0])
    for n in (2, 3):  # AMX tasks group query blocks by the thread count: no bit may change
        assert torch.equal(amx, raw_forward(q, k, v, right=0, num_threads=n)[0])


@pytest.mark.skipif(not nk.build_info()["amx"], reason="no AMX on this CPU/OS")
def test_amx_modifiers_and_schedules():
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=150, sk=333, d=48, dtype=torch.bfloat16, seed=26)
    bias = torch.randn(2, 1, 150, 333, generator=torch.Generator().manual_seed(6)).requires_grad_()
    mask = torch.rand(150, 333, generator=torch.Generator().manual_seed(7)) > 0.2
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(8))
    assert_native_matches(q, k, v, bias=bias, mask=mask, softcap=4.0, alibi_slopes=slopes, causal=True,
                          dropout_p=0.1, seed=3, return_lse=True)
    grads = []
    for n, opt in ((1, 0), (2, nk.FORCE_SPLIT), (3, nk.FORCE_FUSED)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = native_attention(*leaves, causal=True, num_threads=n, options=opt)
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))


@pytest.mark.parametrize("b,sq,sk", [(0, 4, 4), (1, 0, 4), (1, 4, 0), (2, 1, 0)])
def test_empty_problems(b, sq, sk):
    q, k, v = torch.randn(b, 4, sq, 16), torch.randn(b, 2, sk, 16), torch.randn(b, 2, sk, 16)
    out, lse = torch.full((b, 4, sq, 16), 7.0), torch.empty(b, 4, sq)
    checked.forward(q, k, v, out, lse, scale=0.25)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    dq, dk, dv = torch.full_like(q, 5.0), torch.full_like(k, 5.0), torch.full_like(v, 5.0)
    checked.backward(q, k, v, out, torch.randn_like(out), lse, torch.zeros_like(lse), dq, dk, dv, scale=0.25)
    assert not dq.any() and not dk.any() and not dv.any()
