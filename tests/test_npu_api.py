"""tileattn.npu.npu_fusion_attention (torch_npu dialect) against the exact reference.

The oracle never uses tileattn's windows: it materialises the kept region of every sparse_mode from
torch_npu's own definition (row i = query, column j = key, counted from the top-left corner) and
hands it to ``tileattn.reference`` as a plain bool mask, with ``bias = scale * pse``.
"""

import math
import warnings

import pytest
import torch

import tileattn
from tileattn.npu import npu_fusion_attention, npu_fusion_attention_grad
from tileattn.spec import to_canonical
from tileattn.testing import judge

BIG = 2147483647


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 131 + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def npu_keep(mode, sq, sk, pre=BIG, nxt=BIG, atten_mask=None, prefix=None):
    """The kept region (True = take part) of torch_npu's sparse_mode, materialised, (B|1, N|1, Sq, Sk)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    off = sk - sq
    user = None if atten_mask is None else ~atten_mask.bool().reshape((1,) * (4 - atten_mask.dim()) + tuple(atten_mask.shape))
    if mode == 0:
        if user is None:
            return torch.ones(1, 1, sq, sk, dtype=torch.bool)
        return user & ((j - i >= -pre) & (j - i <= nxt))
    if mode == 1:
        return user
    if mode == 2:
        return (j <= i)[None, None]
    if mode == 3:
        return (j <= i + off)[None, None]
    if mode == 4:
        return ((j - i - off >= -pre) & (j - i - off <= nxt))[None, None]
    region = (j <= i + off)[None, None] | (j[None, None] < torch.tensor(prefix)[:, None, None, None])
    return region if mode == 6 else region & user


def _dims(layout, q, n):
    if layout == "BNSD":
        return q.shape[0], q.shape[2]
    if layout in ("BSND", "BSH"):
        return q.shape[0], q.shape[1]
    return q.shape[1], q.shape[0]  # SBH


def _judge_all(results, oracle64, baseline, dtype):
    verdicts = [judge(name, a, b, c, dtype) for name, a, b, c in zip(("out", "dq", "dk", "dv", "dpse"), results,
                                                                      oracle64, baseline)]
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


def _run(fn, tensors, cast, grad=True):
    leaves = [None if t is None else t.detach().to(cast).requires_grad_(grad) for t in tensors]
    out = fn(*leaves)
    present = [t for t in leaves if t is not None]
    if not grad:
        return [out]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float32).to(out.dtype)
    return [out, *torch.autograd.grad(out, present, dout)]


def check_padded(layout, q, k, v, n, keep, scale, pse=None, **npu_kwargs):
    """npu_fusion_attention vs the reference with the materialised mask: out, grads and softmax stats."""
    dtype = q.dtype

    def dialect(q, k, v, pse):
        return npu_fusion_attention(q, k, v, n, layout, pse=pse, scale=scale, **npu_kwargs)[0]

    def oracle(cdt):
        def f(q, k, v, pse):
            bias = None if pse is None else scale * pse
            return tileattn.reference(q, k, v, layout=layout, num_heads=n if layout in ("BSH", "SBH") else None,
                                      scale=scale, mask=keep, bias=bias, compute_dtype=cdt)
        return f

    tensors = [q, k, v, pse]
    _judge_all(_run(dialect, tensors, dtype), _run(oracle(torch.float64), tensors, torch.float64),
               _run(oracle(None), tensors, dtype), dtype)
    check_stats(layout, q, k, v, n, keep, scale, pse, **npu_kwargs)


def check_stats(layout, q, k, v, n, keep, scale, pse=None, **npu_kwargs):
    """softmax_max is the true row max of scale * (q.k^T + pse) under the mask; max + log(sum) == LSE."""
    with torch.no_grad():
        res = npu_fusion_attention(q, k, v, n, layout, pse=pse, scale=scale, **npu_kwargs)
        smax, ssum = res[1], res[2]
        b, sq = _dims(layout, q, n)
        assert smax.shape == (b, n, sq, 8) and ssum.shape == (b, n, sq, 8)
        assert smax.dtype == torch.float32 and ssum.dtype == torch.float32
        assert torch.equal(smax, smax[..., :1].expand_as(smax)) and torch.equal(ssum, ssum[..., :1].expand_as(ssum))
        qc = to_canonical(q, layout, n).double()
        kc = to_canonical(k, layout, n * k.shape[-1] // q.shape[-1] if layout in ("BSH", "SBH") else None).double()
        kc = kc.repeat_interleave(qc.shape[1] // kc.shape[1], dim=1)
        s = torch.einsum("bhid,bhjd->bhij", qc, kc)
        if pse is not None:
            s = s + pse.double()
        s = (scale * s).masked_fill(~keep, -math.inf)
        true_max = s.amax(-1)
        kw = dict(layout=layout, num_heads=n if layout in ("BSH", "SBH") else None, scale=scale, mask=keep,
                  bias=None if pse is None else scale * pse, return_lse=True)
        _, lse = tileattn.reference(q, k, v, compute_dtype=torch.float64, **kw)
        _, lse_plain = tileattn.reference(q, k, v, **kw)
        torch.testing.assert_close(smax[..., 0].double(), true_max, rtol=1e-5, atol=1e-5)
        alive = ~torch.isneginf(lse)
        got = (smax[..., 0].double() + torch.log(ssum[..., 0].double()))
        verdict = judge("max + log(sum)", got[alive], lse[alive], lse_plain[alive], q.dtype)
        assert verdict.ok, str(verdict)
        assert torch.isneginf(smax[..., 0][~alive]).all() and (ssum[..., 0][~alive] == 0).all()


def _layout_tensors(layout, b, n, nkv, sq, sk, d, dtype=torch.float32):
    shapes = {
        "BNSD": lambda h, s: (b, h, s, d),
        "BSND": lambda h, s: (b, s, h, d),
        "BSH": lambda h, s: (b, s, h * d),
        "SBH": lambda h, s: (s, b, h * d),
    }[layout]
    return (_rand(*shapes(n, sq), dtype=dtype), _rand(*shapes(nkv, sk), dtype=dtype, seed=1),
            _rand(*shapes(nkv, sk), dtype=dtype, seed=2))


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_every_padded_layout_with_gqa(layout):
    q, k, v = _layout_tensors(layout, 2, 4, 2, 5, 7, 8)
    check_padded(layout, q, k, v, 4, npu_keep(0, 5, 7), scale=0.35)


MODES = [
    # (mode, pre, next, needs a full mask)
    (0, BIG, BIG, True),
    (0, 2, 1, True),
    (0, 4, -1, True),
    (0, -1, 3, True),
    (1, BIG, BIG, True),
    (2, BIG, BIG, False),
    (3, BIG, BIG, False),
    (4, 2, 0, False),
    (4, 1, 2, False),
    (4, 3, -2, False),
]


@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("mode,pre,nxt,full", MODES)
def test_sparse_modes_match_materialised_mask(mode, pre, nxt, full, sq, sk):
    q, k, v = _layout_tensors("BNSD", 2, 2, 1, sq, sk, 8)
    if full:
        g = torch.Generator().manual_seed(sq * 10 + sk)
        atten_mask = torch.rand(2, 1, sq, sk, generator=g) > 0.7  # True = masked out
    else:
        atten_mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    keep = npu_keep(mode, sq, sk, pre, nxt, atten_mask if full else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_padded("BNSD", q, k, v, 2, keep, scale=0.4, atten_mask=atten_mask, sparse_mode=mode,
                     pre_tockens=pre, next_tockens=nxt)


@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9)])
def test_prefix_modes(sq, sk):
    q, k, v = _layout_tensors("BSND", 2, 2, 2, sq, sk, 8)
    prefix = [2, 5]
    keep6 = npu_keep(6, sq, sk, prefix=prefix)
    check_padded("BSND", q, k, v, 2, keep6, scale=0.3, sparse_mode=6, prefix=prefix,
                 atten_mask=torch.zeros(3072, 2048, dtype=torch.bool))
    atten_mask = ~keep6.expand(2, 1, sq, sk)
    keep5 = npu_keep(5, sq, sk, atten_mask=atten_mask, prefix=prefix)
    check_padded("BSND", q, k, v, 2, keep5, scale=0.3, sparse_mode=5, prefix=prefix, atten_mask=atten_mask)


@pytest.mark.parametrize("pse_shape", ["BNSS", "BN1S", "1NSS"])
def test_pse_added_before_scaling_with_gradient(pse_shape):
    b, n, sq, sk = 2, 2, 5, 6
    q, k, v = _layout_tensors("BSH", b, n, n, sq, sk, 8)
    shape = {"BNSS": (b, n, sq, sk), "BN1S": (b, n, 1, sk), "1NSS": (1, n, sq, sk)}[pse_shape]
    pse = _rand(*shape, seed=7)
    atten_mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    check_padded("BSH", q, k, v, n, npu_keep(3, sq, sk), scale=0.25, pse=pse, atten_mask=atten_mask, sparse_mode=3)


def test_bf16_causal():
    q, k, v = _layout_tensors("BNSD", 1, 4, 4, 16, 16, 16, dtype=torch.bfloat16)
    check_padded("BNSD", q, k, v, 4, npu_keep(2, 16, 16), scale=0.25, sparse_mode=2,
                 atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))


TND_CASES = [
    (0, BIG, BIG),
    (2, BIG, BIG),
    (3, BIG, BIG),
    (4, 2, 0),
    (4, 3, -1),
    (6, BIG, BIG),
]


@pytest.mark.parametrize("mode,pre,nxt", TND_CASES)
def test_tnd_varlen(mode, pre, nxt):
    qlens, klens = [3, 5, 0, 4], [6, 5, 2, 3]
    n, nkv, d = 4, 2, 8
    q = _rand(sum(qlens), n, d)
    k, v = _rand(sum(klens), nkv, d, seed=1), _rand(sum(klens), nkv, d, seed=2)
    cq = list(torch.tensor(qlens).cumsum(0).tolist())
    ck = list(torch.tensor(klens).cumsum(0).tolist())
    prefix = [1, 2, 0, 3]
    kwargs = dict(actual_seq_qlen=cq, actual_seq_kvlen=ck, sparse_mode=mode, pre_tockens=pre, next_tockens=nxt,
                  scale=0.3)
    if mode in (2, 3, 4):
        kwargs["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    if mode == 6:
        kwargs.update(prefix=prefix, atten_mask=torch.zeros(3072, 2048, dtype=torch.bool))

    def dialect(q, k, v):
        return npu_fusion_attention(q, k, v, n, "TND", **kwargs)[0]

    def oracle(cdt):
        def f(q, k, v):
            outs, q0, k0 = [], 0, 0
            for b, (lq, lk) in enumerate(zip(qlens, klens)):
                keep = npu_keep(mode, lq, lk, pre, nxt, prefix=[prefix[b]])
                o = tileattn.reference(q[q0:q0 + lq][None], k[k0:k0 + lk][None], v[k0:k0 + lk][None], layout="BSND",
                                       scale=0.3, mask=keep, compute_dtype=cdt)
                outs.append(o[0])
                q0, k0 = q0 + lq, k0 + lk
            return torch.cat(outs)
        return f

    _judge_all(_run(dialect, [q, k, v], q.dtype), _run(oracle(torch.float64), [q, k, v], torch.float64),
               _run(oracle(None), [q, k, v], q.dtype), q.dtype)
    with torch.no_grad():
        res = npu_fusion_attention(q, k, v, n, "TND", **kwargs)
        assert res[1].shape == (sum(qlens), n, 8) and res[2].shape == (sum(qlens), n, 8)
        lse = []
        q0, k0 = 0, 0
        for b, (lq, lk) in enumerate(zip(qlens, klens)):
            keep = npu_keep(mode, lq, lk, pre, nxt, prefix=[prefix[b]])
            _, l = tileattn.reference(q[q0:q0 + lq][None], k[k0:k0 + lk][None], v[k0:k0 + lk][None], layout="BSND",
                                      scale=0.3, mask=keep, compute_dtype=torch.float64, return_lse=True)
            lse.append(l[0].transpose(0, 1))
            q0, k0 = q0 + lq, k0 + lk
        lse = torch.cat(lse)
        got = res[1][..., 0].double() + torch.log(res[2][..., 0].double())
        alive = ~torch.isneginf(lse)
        torch.testing.assert_close(got[alive], lse[alive], rtol=1e-5, atol=1e-5)


def test_torch_npu_documentation_example():
    """The example of the torch_npu docs: BNSD (1, 8, 256, 128), scale 0.08838, causal triu mask.

    Its golden function adds ``atten_mask * -10000`` to the scaled scores and takes a softmax; modes
    0 (full mask, pre=65536, next=0), 2 and 3 (compressed 2048x2048 template) all give that result.
    """
    q, k, v = (_rand(1, 8, 256, 128, seed=s) for s in range(3))
    scale = 0.08838
    mask = torch.triu(torch.ones(1, 8, 256, 256), diagonal=1)
    golden = torch.softmax(torch.matmul(q, k.transpose(2, 3)).mul(scale) + mask * -10000.0, dim=-1) @ v
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    for mode, atten_mask, pre, nxt in ((0, mask.bool(), 65536, 0), (2, compressed, 65536, 0), (3, compressed, 65536, 0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = npu_fusion_attention(q, k, v, 8, "BNSD", atten_mask=atten_mask, scale=scale, pre_tockens=pre,
                                       next_tockens=nxt, sparse_mode=mode)[0]
        torch.testing.assert_close(out, golden, atol=2e-5, rtol=1e-4)


def test_grad_function_matches_autograd_including_dropout():
    b, n, sq, sk, d = 2, 2, 6, 6, 8
    q, k, v = _layout_tensors("BSND", b, n, n, sq, sk, d, dtype=torch.float64)
    pse = _rand(1, n, sq, sk, dtype=torch.float64, seed=5)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, pse)]
    torch.manual_seed(11)
    out, smax, ssum, _, seed, offset, numels = npu_fusion_attention(
        *leaves[:3], n, "BSND", pse=leaves[3], atten_mask=mask, scale=0.3, keep_prob=0.7, sparse_mode=2)
    assert numels == b * n * sq * sk and offset == 0
    dy = torch.randn_like(out)
    auto = torch.autograd.grad(out, leaves, dy)
    grads = npu_fusion_attention_grad(q, k, v, dy, n, "BSND", pse=pse, atten_mask=mask, softmax_max=smax,
                                      softmax_sum=ssum, attention_in=out.detach(), scale_value=0.3, keep_prob=0.7,
                                      seed=seed, offset=offset, numels=numels, sparse_mode=2)
    for a, g in zip(auto, grads):
        torch.testing.assert_close(g, a)
    # the same seed reproduces the dropout pattern; the reference agrees on it
    again = npu_fusion_attention(q, k, v, n, "BSND", pse=pse, atten_mask=mask, scale=0.3, keep_prob=0.7,
                                 sparse_mode=2)
    assert again[4] != seed
    ref = tileattn.reference(q, k, v, layout="BSND", scale=0.3, bias=0.3 * pse, mask=npu_keep(2, sq, sk),
                             dropout_p=0.3, seed=seed)
    torch.testing.assert_close(out.detach(), ref)
    no_pse = npu_fusion_attention_grad(q, k, v, dy, n, "BSND", scale_value=0.3)
    assert no_pse[3] is None and no_pse[0].shape == q.shape


def test_mode0_without_mask_ignores_band_with_a_warning():
    q, k, v = _layout_tensors("BNSD", 1, 2, 2, 5, 5, 8)
    tileattn.npu._WARNED.clear()
    with pytest.warns(UserWarning, match="full attention"):
        out = npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5, pre_tockens=1, next_tockens=0)[0]
    torch.testing.assert_close(out, tileattn.reference(q, k, v, scale=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5, pre_tockens=1, next_tockens=0)


def test_bad_arguments():
    q, k, v = _layout_tensors("BSH", 1, 4, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="'input_layout'"):
        npu_fusion_attention(q, k, v, 4, "BHS")
    with pytest.raises(ValueError, match="'head_num'.*divisor"):
        npu_fusion_attention(q, k, v, 3, "BSH")
    with pytest.raises(ValueError, match="'sparse_mode'"):
        npu_fusion_attention(q, k, v, 4, "BSH", sparse_mode=9)
    for mode in (7, 8):
        with pytest.raises(NotImplementedError, match="context parallelism"):
            npu_fusion_attention(q, k, v, 4, "BSH", sparse_mode=mode)
    with pytest.raises(ValueError, match="pre_tockens/next_tockens"):
        npu_fusion_attention(q, k, v, 4, "BSH", pre_tockens=-1, next_tockens=-2)
    with pytest.raises(ValueError, match="'atten_mask'.*compressed"):
        npu_fusion_attention(q, k, v, 4, "BSH", sparse_mode=2, atten_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="'atten_mask'"):
        npu_fusion_attention(q, k, v, 4, "BSH", atten_mask=torch.ones(4, 4))
    with pytest.raises(ValueError, match="'atten_mask'"):
        npu_fusion_attention(q, k, v, 4, "BSH", atten_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="'padding_mask'"):
        npu_fusion_attention(q, k, v, 4, "BSH", padding_mask=torch.ones(1))
    with pytest.raises(ValueError, match="'keep_prob'"):
        npu_fusion_attention(q, k, v, 4, "BSH", keep_prob=0.0)
    with pytest.raises(ValueError, match="'pse'"):
        npu_fusion_attention(q, k, v, 4, "BSH", pse=torch.zeros(1, 4, 1024, 4))
    t = _rand(6, 4, 8)
    with pytest.raises(ValueError, match="'actual_seq_qlen'.*cumulative"):
        npu_fusion_attention(t, t, t, 4, "TND", actual_seq_qlen=[4, 2], actual_seq_kvlen=[4, 6])
    with pytest.raises(ValueError, match="'actual_seq_kvlen'.*entries"):
        npu_fusion_attention(t, t, t, 4, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[6])
    with pytest.raises(ValueError, match="'actual_seq_qlen'.*token count"):
        npu_fusion_attention(t, t, t, 4, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 6])
    with pytest.raises(ValueError, match="'actual_seq_qlen/actual_seq_kvlen'"):
        npu_fusion_attention(t, t, t, 4, "TND")
    with pytest.raises(NotImplementedError, match="'atten_mask'"):
        npu_fusion_attention(t, t, t, 4, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6],
                             atten_mask=torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="'head_num'"):
        npu_fusion_attention(t, t, t, 2, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6])
    with pytest.raises(ValueError, match="'query'"):
        npu_fusion_attention(q, k, v, 4, "BNSD")
    with pytest.raises(TypeError, match="'query/key/value'"):
        npu_fusion_attention(q, k.double(), v, 4, "BSH")
    with pytest.raises(ValueError, match="'key'.*dividing head_num"):
        npu_fusion_attention(q, k[..., :24], v[..., :24], 4, "BSH")
    with pytest.raises(TypeError, match="'prefix'"):
        npu_fusion_attention(q, k, v, 4, "BSH", sparse_mode=6, atten_mask=torch.zeros(3072, 2048, dtype=torch.bool))


def test_band_keywords_reproduce_every_top_left_band():
    """_band_kwargs (a window around a diagonal placed by ``align``) == the materialised top-left band."""
    from tileattn.modifiers import Band
    from tileattn.npu import _band_kwargs

    bounds = [None, -7, -3, -1, 0, 1, 2, 5, 8]
    for sq in (1, 3, 5):
        for sk in (1, 4, 6):
            rel = torch.arange(sk)[None, :] - torch.arange(sq)[:, None]
            for lo in bounds:
                for hi in bounds:
                    expected = torch.ones(sq, sk, dtype=torch.bool)
                    if lo is not None:
                        expected &= rel >= lo
                    if hi is not None:
                        expected &= rel <= hi
                    kwargs = _band_kwargs((lo, hi) if (lo, hi) != (None, None) else None, sq, sk, None)
                    if "mask" in kwargs:
                        got = kwargs["mask"]
                    elif kwargs:
                        left, right = kwargs["window"]
                        assert (left is None or left >= 0) and (right is None or right >= 0)
                        got = Band(left, right).keep(torch.arange(sq), torch.arange(sk), kwargs["align"])
                    else:
                        got = torch.ones(sq, sk, dtype=torch.bool)
                    assert torch.equal(got, expected), (sq, sk, lo, hi, kwargs)


def _grad_vs_autograd(q, k, v, n, layout, pse=None, **kw):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([pse.clone().requires_grad_(True)] if pse is not None else [])
    res = npu_fusion_attention(*leaves[:3], n, layout, pse=leaves[3] if pse is not None else None, **kw)
    dy = torch.randn(res[0].shape, generator=torch.Generator().manual_seed(2), dtype=res[0].dtype)
    auto = torch.autograd.grad(res[0], leaves, dy)
    scale = kw.pop("scale")
    for stats in (True, False):
        extra = dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0].detach()) if stats else {}
        grads = npu_fusion_attention_grad(q, k, v, dy, n, layout, pse=pse, scale_value=scale, seed=res[4], **kw,
                                          **extra)
        # the supplied statistics are fp32 (torch_npu's format): fp32-sized tolerance on fp64 gradients
        tol = dict(rtol=1e-5, atol=1e-6) if stats else {}
        for a, g in zip(auto, grads):
            torch.testing.assert_close(g, a, **tol)


def test_grad_with_cut_keys_and_per_sequence_pieces():
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    q, k, v = _layout_tensors("BNSD", 2, 2, 1, 4, 9, 8, dtype=torch.float64)
    pse = _rand(2, 2, 1, 9, dtype=torch.float64, seed=3)
    # top-left causal with Sq < Sk reads only the first 4 keys: dk/dv/dpse of the rest are 0
    _grad_vs_autograd(q, k, v, 2, "BNSD", pse=pse, scale=0.3, sparse_mode=2, atten_mask=compressed)
    t_q, t_k = _rand(7, 2, 8, dtype=torch.float64), _rand(9, 2, 8, dtype=torch.float64, seed=1)
    t_v = _rand(9, 2, 8, dtype=torch.float64, seed=2)
    for mode, pre, nxt in ((3, BIG, BIG), (4, 3, -1), (2, BIG, BIG)):
        _grad_vs_autograd(t_q, t_k, t_v, 2, "TND", scale=0.4, sparse_mode=mode, atten_mask=compressed,
                          pre_tockens=pre, next_tockens=nxt, actual_seq_qlen=[3, 7], actual_seq_kvlen=[5, 9])


def test_grad_uses_supplied_statistics_like_ring_attention():
    """Gradients of one key chunk, computed with the merged statistics and output of the whole
    attention (what ring attention passes), add up to the gradients of the whole attention."""
    q, k, v = _layout_tensors("BSND", 1, 2, 2, 5, 8, 8, dtype=torch.float64)
    full = npu_fusion_attention(q, k, v, 2, "BSND", scale=0.3)
    dy = _rand(*full[0].shape, dtype=torch.float64, seed=4)
    whole = npu_fusion_attention_grad(q, k, v, dy, 2, "BSND", softmax_max=full[1], softmax_sum=full[2],
                                      attention_in=full[0], scale_value=0.3)
    dq = torch.zeros_like(q)
    for lo, hi in ((0, 3), (3, 8)):
        part = npu_fusion_attention_grad(q, k[:, lo:hi], v[:, lo:hi], dy, 2, "BSND", softmax_max=full[1],
                                         softmax_sum=full[2], attention_in=full[0], scale_value=0.3)
        torch.testing.assert_close(part[1], whole[1][:, lo:hi])
        torch.testing.assert_close(part[2], whole[2][:, lo:hi])
        dq += part[0]
    torch.testing.assert_close(dq, whole[0])
