"""tileattn.npu.npu_fusion_attention(_grad)(_v2) against the exact reference.

The oracle never uses tileattn's windows or align: it materialises the kept region of every
sparse_mode from torch_npu's own definition (row i = query, column j = key, from the top-left) and
hands it to ``tileattn.reference`` as a plain bool mask, with ``bias = scale * pse``; varlen
oracles loop over sequences in the test, the dialect may not. Results are judged by FlashAttention's
rule (at most 2x the error of same-dtype plain math against fp64, plus a floor).
"""

import math
import warnings

import pytest
import torch

import tileattn
import tileattn.npu as torch_npu
from tileattn.npu import npu_fusion_attention, npu_fusion_attention_grad
from tileattn.core.spec import to_canonical
from tileattn.core.testing import judge

BIG = 2147483647
TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 131 + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def npu_keep(mode, sq, sk, pre=BIG, nxt=BIG, atten_mask=None, prefix=None):
    """The kept region (True = take part) of torch_npu's sparse_mode, materialised, (B|1, N|1, Sq, Sk)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    off = sk - sq
    user = None if atten_mask is None else ~atten_mask.bool().reshape((1,) * (4 - atten_mask.dim()) + tuple(atten_mask.shape))
    if mode == -1:  # no mask: full attention whatever the mode
        return torch.ones(1, 1, sq, sk, dtype=torch.bool)
    if mode == 0:
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


def _judge_all(results, oracle64, baseline, dtype, names=("out", "dq", "dk", "dv", "dpse")):
    verdicts = [judge(name, a, b, c, dtype) for name, a, b, c in zip(names, results, oracle64, baseline)]
    assert len(verdicts) == len(results)
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


def _heads(layout, n, t):
    return n * t.shape[-1] // t.shape[-1] if layout not in ("BSH", "SBH") else None


def check_padded(layout, q, k, v, n, keep, scale, pse=None, **npu_kwargs):
    """npu_fusion_attention vs the reference with the materialised mask: out, grads and softmax stats."""
    dtype = q.dtype
    num_heads = n if layout in ("BSH", "SBH") else None

    def dialect(q, k, v, pse):
        return npu_fusion_attention(q, k, v, n, layout, pse=pse, scale=scale, **npu_kwargs)[0]

    def oracle(cdt):
        def f(q, k, v, pse):
            bias = None if pse is None else scale * pse
            return tileattn.reference(q, k, v, layout=layout, num_heads=num_heads, scale=scale, mask=keep, bias=bias,
                                      compute_dtype=cdt)
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
        qc = to_canonical(q, layout, n).double()
        b, sq = qc.shape[0], qc.shape[2]
        assert smax.shape == (b, n, sq, 8) and ssum.shape == (b, n, sq, 8)
        assert smax.dtype == torch.float32 and ssum.dtype == torch.float32
        assert torch.equal(smax, smax[..., :1].expand_as(smax)) and torch.equal(ssum, ssum[..., :1].expand_as(ssum))
        kc = to_canonical(k, layout, n * k.shape[-1] // q.shape[-1] if layout in ("BSH", "SBH") else None).double()
        kc = kc.repeat_interleave(qc.shape[1] // kc.shape[1], dim=1)
        s = torch.einsum("bhid,bhjd->bhij", qc, kc)
        if pse is not None:
            s = s + pse.double()
        s = (scale * s).masked_fill(~keep, -math.inf)
        kw = dict(layout=layout, num_heads=n if layout in ("BSH", "SBH") else None, scale=scale, mask=keep,
                  bias=None if pse is None else scale * pse, return_lse=True)
        _, lse = tileattn.reference(q, k, v, compute_dtype=torch.float64, **kw)
        _, lse_plain = tileattn.reference(q, k, v, **kw)
        torch.testing.assert_close(smax[..., 0].double(), s.amax(-1), rtol=1e-5, atol=1e-5)
        alive = ~torch.isneginf(lse)
        got = smax[..., 0].double() + torch.log(ssum[..., 0].double())
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
    check_padded(layout, q, k, v, 4, npu_keep(-1, 5, 7), scale=0.35)


MODES = [
    # (mode, pre, next, full mask)
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
    (4, -1, 3, False),
]


@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("mode,pre,nxt,full", MODES)
def test_sparse_modes_match_materialised_mask(mode, pre, nxt, full, sq, sk):
    q, k, v = _layout_tensors("BNSD", 2, 2, 1, sq, sk, 8)
    if full:
        g = torch.Generator().manual_seed(sq * 10 + sk)
        atten_mask = torch.rand(2, 1, sq, sk, generator=g) > 0.7  # True = masked out
    else:
        atten_mask = TRIU
    keep = npu_keep(mode, sq, sk, pre, nxt, atten_mask if full else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_padded("BNSD", q, k, v, 2, keep, scale=0.4, atten_mask=atten_mask, sparse_mode=mode,
                     pre_tockens=pre, next_tockens=nxt)


@pytest.mark.parametrize("mode", [1, 2, 3, 4, 5, 6])
def test_modes_without_atten_mask_compute_full_attention_and_warn_once(mode):
    """torch_npu: 'when atten_mask is None, sparse_mode, pre_tockens and next_tockens do not apply:
    full computation' (MindSpeed's non-causal ring attention passes sparse_mode=1 with no mask)."""
    q, k, v = _layout_tensors("BSND", 2, 2, 2, 5, 7, 8)
    torch_npu.reset_warnings()
    prefix = [3, 4] if mode in (5, 6) else None
    with pytest.warns(UserWarning, match="full attention"):
        out = npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5, sparse_mode=mode, pre_tockens=1, next_tockens=0,
                                   prefix=prefix)[0]
    torch.testing.assert_close(out, tileattn.reference(q, k, v, layout="BSND", scale=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5, sparse_mode=mode, prefix=prefix)


@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9), (9, 4)])
def test_prefix_modes(sq, sk):
    q, k, v = _layout_tensors("BSND", 2, 2, 2, sq, sk, 8)
    prefix = [sk - sq + 1, sk] if sq <= sk else [1, sk - 1]  # the documented ranges
    keep6 = npu_keep(6, sq, sk, prefix=prefix)
    check_padded("BSND", q, k, v, 2, keep6, scale=0.3, sparse_mode=6, prefix=prefix,
                 atten_mask=torch.zeros(3072, 2048, dtype=torch.bool))
    atten_mask = torch.rand(2, 1, sq, sk, generator=torch.Generator().manual_seed(3)) > 0.8
    keep5 = npu_keep(5, sq, sk, atten_mask=atten_mask, prefix=prefix)
    check_padded("BSND", q, k, v, 2, keep5, scale=0.3, sparse_mode=5, prefix=prefix, atten_mask=atten_mask)


@pytest.mark.parametrize("pse_shape", ["BNSS", "BN1S", "1NSS"])
def test_pse_added_before_scaling_with_gradient(pse_shape):
    b, n, sq, sk = 2, 2, 5, 6
    q, k, v = _layout_tensors("BSH", b, n, n, sq, sk, 8)
    shape = {"BNSS": (b, n, sq, sk), "BN1S": (b, n, 1, sk), "1NSS": (1, n, sq, sk)}[pse_shape]
    check_padded("BSH", q, k, v, n, npu_keep(3, sq, sk), scale=0.25, pse=_rand(*shape, seed=7), atten_mask=TRIU,
                 sparse_mode=3)


def test_compressed_alibi_pse_is_expanded_as_documented():
    """pse given as the last 1024 rows of an ALiBi matrix (Sq = Skv > 1024, causal) equals the full pse."""
    n, s, d = 2, 1030, 4
    q, k, v = (_rand(1, n, s, d, seed=i) for i in range(3))
    slopes = torch.tensor([0.5, 0.125])
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    full = (-slopes[:, None, None] * (i - j).abs()).unsqueeze(0)  # (1, N, S, S)
    compressed = full[:, :, -1024:, :].contiguous()
    got = npu_fusion_attention(q, k, v, n, "BNSD", pse=compressed, scale=0.5, atten_mask=TRIU, sparse_mode=3)
    want = npu_fusion_attention(q, k, v, n, "BNSD", pse=full, scale=0.5, atten_mask=TRIU, sparse_mode=3)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_v2_pse_types_and_rope():
    b, n, sq, sk, d = 1, 2, 5, 7, 8
    q, k, v = _layout_tensors("BNSD", b, n, n, sq, sk, d)
    pse = _rand(1, n, sq, sk, seed=4)
    out0 = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BNSD", pse=pse, scale=0.3, pse_type=0)[0]
    torch.testing.assert_close(out0, tileattn.reference(q, k, v, scale=0.3, bias=pse))
    slopes = torch.tensor([0.5, 0.25])
    for pse_type, dist in ((2, lambda x: x), (3, torch.sqrt)):
        out = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BNSD", pse=slopes, scale=0.3, pse_type=pse_type,
                                                q_start_idx=[3], kv_start_idx=[1])[0]
        rel = (torch.arange(sq)[:, None] + 3 - torch.arange(sk)[None, :] - 1).abs().float()
        torch.testing.assert_close(out, tileattn.reference(q, k, v, scale=0.3, bias=-slopes[:, None, None] * dist(rel)))
    q_rope, k_rope = _rand(b, n, sq, 4, seed=5), _rand(b, n, sk, 4, seed=6)
    out = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BNSD", query_rope=q_rope, key_rope=k_rope, scale=0.3)[0]
    torch.testing.assert_close(out, tileattn.reference(torch.cat([q, q_rope], -1), torch.cat([k, k_rope], -1), v,
                                                       scale=0.3))


def test_bf16_causal():
    q, k, v = _layout_tensors("BNSD", 1, 4, 4, 16, 16, 16, dtype=torch.bfloat16)
    check_padded("BNSD", q, k, v, 4, npu_keep(2, 16, 16), scale=0.25, sparse_mode=2, atten_mask=TRIU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_stats_of_every_dtype(dtype, causal):
    """softmax_max/softmax_sum of 40 query rows (16 or more made bf16's max +-inf and its sum 0 while a
    probe scaled the scores by 2**40), with and without a causal mask and a pse."""
    b, n, sq, sk = 1, 2, 40, 48
    q, k, v = _layout_tensors("BSND", b, n, n, sq, sk, 16, dtype=dtype)
    kw = dict(atten_mask=TRIU, sparse_mode=3, pse=_rand(b, n, sq, sk, seed=3).to(dtype)) if causal else {}
    check_padded("BSND", q, k, v, n, npu_keep(3 if causal else -1, sq, sk), scale=0.25, **kw)


# ----- varlen (TND) -------------------------------------------------------------------------------

QLENS, KLENS = [3, 5, 0, 4], [6, 5, 2, 3]


def tnd_oracle(qlens, klens, keep_of, scale, sink=None):
    """Per-sequence reference (the test may loop over sequences; the dialect may not)."""
    def make(cdt, lse=False):
        def f(q, k, v, sinks=None):
            outs, lses, q0, k0 = [], [], 0, 0
            for b, (lq, lk) in enumerate(zip(qlens, klens)):
                if lq:
                    o, l = tileattn.reference(q[q0:q0 + lq][None], k[k0:k0 + lk][None], v[k0:k0 + lk][None],
                                              layout="BSND", scale=scale, mask=keep_of(b, lq, lk), sinks=sinks,
                                              compute_dtype=cdt, return_lse=True)
                    outs.append(o[0])
                    lses.append(l[0])
                q0, k0 = q0 + lq, k0 + lk
            return (torch.cat(outs), torch.cat(lses, 1)) if lse else torch.cat(outs)
        return f
    return make


def _tnd(n=4, nkv=2, d=8, qlens=QLENS, klens=KLENS, dtype=torch.float32):
    return (_rand(sum(qlens), n, d, dtype=dtype), _rand(sum(klens), nkv, d, dtype=dtype, seed=1),
            _rand(sum(klens), nkv, d, dtype=dtype, seed=2))


def _cum(lens):
    return torch.tensor(lens).cumsum(0).tolist()


TND_CASES = [
    # (mode, pre, next, mask kind)
    (-1, BIG, BIG, None),
    (0, BIG, BIG, "ss"),
    (0, 2, 1, "ss"),
    (1, BIG, BIG, "ss"),
    (2, BIG, BIG, "triu"),
    (3, BIG, BIG, "triu"),
    (4, 2, 0, "triu"),
    (4, 3, -1, "triu"),
    (4, -1, 3, "triu"),
    (6, BIG, BIG, "prefix"),
]


@pytest.mark.parametrize("mode,pre,nxt,mask", TND_CASES)
def test_tnd_varlen(mode, pre, nxt, mask):
    n = 4
    q, k, v = _tnd(n)
    prefix = [5, 3, 2, 2]  # in the documented ranges [Skv - Sq, Skv] / [0, Skv]
    ss = torch.rand(max(QLENS), max(KLENS), generator=torch.Generator().manual_seed(1)) > 0.7
    kwargs = dict(actual_seq_qlen=_cum(QLENS), actual_seq_kvlen=_cum(KLENS), sparse_mode=max(mode, 0), pre_tockens=pre,
                  next_tockens=nxt, scale=0.3)
    kwargs["atten_mask"] = {None: None, "ss": ss, "triu": TRIU, "prefix": torch.zeros(3072, 2048, dtype=torch.bool)}[mask]
    if mode == 6:
        kwargs["prefix"] = prefix

    def keep_of(b, lq, lk):
        user = ss[:lq, :lk] if mask == "ss" else None
        return npu_keep(mode, lq, lk, pre, nxt, atten_mask=user, prefix=[prefix[b]])

    oracle = tnd_oracle(QLENS, KLENS, keep_of, 0.3)

    def dialect(q, k, v):
        return npu_fusion_attention(q, k, v, n, "TND", **kwargs)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _judge_all(_run(dialect, [q, k, v], q.dtype), _run(oracle(torch.float64), [q, k, v], torch.float64),
                   _run(oracle(None), [q, k, v], q.dtype), q.dtype)
        res = npu_fusion_attention(q, k, v, n, "TND", **kwargs)
        res_tnd = npu_fusion_attention(q, k, v, n, "TND", softmax_layout="TND", **kwargs)
    _, lse = oracle(torch.float64, lse=True)(q, k, v)
    # softmax_layout="TND": T-major; the default: head-major within each sequence ("NTD").
    got = res_tnd[1][..., 0].double() + torch.log(res_tnd[2][..., 0].double())
    alive = ~torch.isneginf(lse.transpose(0, 1))
    torch.testing.assert_close(got[alive], lse.transpose(0, 1)[alive], rtol=1e-5, atol=1e-5)
    flat = (res[1][..., 0].double() + torch.log(res[2][..., 0].double())).flatten()
    expected, q0 = [], 0
    for lq in QLENS:
        expected.append(lse[:, q0:q0 + lq].flatten())  # (N, lq) of this sequence, head-major
        q0 += lq
    expected = torch.cat(expected)
    alive = ~torch.isneginf(expected)
    torch.testing.assert_close(flat[alive], expected[alive], rtol=1e-5, atol=1e-5)


def test_tnd_trailing_zero_batches_and_numels():
    """'TND supports leaving trailing batches out: pass zeros' ([2, 5, 9, 0, 0]); numels as torch_npu computes it."""
    n = 2
    q, k, v = _tnd(n=n, nkv=2, qlens=[2, 3, 4, 5, 6], klens=[2, 3, 4, 5, 6])
    res = npu_fusion_attention(q, k, v, n, "TND", actual_seq_qlen=[2, 5, 9, 0, 0], actual_seq_kvlen=[2, 5, 9, 0, 0],
                               scale=0.3, atten_mask=TRIU, sparse_mode=3)
    oracle = tnd_oracle([2, 3, 4], [2, 3, 4], lambda b, lq, lk: npu_keep(3, lq, lk), 0.3)
    torch.testing.assert_close(res[0][:9], oracle(torch.float32)(q, k, v))
    assert (res[0][9:] == 0).all() and torch.isneginf(res[1][9:]).all()
    # torch_npu: numels = N * (q[0]*k[0] + sum_i (q[i]-q[i-1]) * (k[i]-k[i-1])) over the lists as passed
    assert res[6] == n * (2 * 2 + 3 * 3 + 4 * 4 + 9 * 9)
    padded = npu_fusion_attention(*_layout_tensors("BSND", 2, 2, 2, 5, 7, 8), 2, "BSND")
    assert padded[6] == 2 * 2 * 5 * 7 and padded[4] == 0 and padded[5] == 0


@pytest.mark.parametrize("mode", [7, 8])
def test_context_parallel_modes_7_and_8_compute_one_ranks_shard(mode):
    """The docs' examples: a varlen batch of mode 3 (7) or 2 (8) is split along the query of one
    sequence across two ranks; each rank's call with its own lists equals its rows of the unsplit call."""
    n = 2
    if mode == 7:  # docs: batch 2 of q 4 x kv 6 split 2 + 2; rank 1: qlen {3,5} kv {3,9}, band (6, -2)
        qlens, klens, split = [3, 4, 4], [3, 6, 4], (5, 9)
        ranks = [dict(actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9], pre_tockens=6, next_tockens=-2),
                 dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[6, 10], sparse_mode=3)]
    else:  # docs: batch 2 of q 5 x kv 4 split 2 + 3; rank 2: band (4, 1) on its first sequence
        qlens, klens, split = [3, 5, 4], [3, 4, 4], (5, 7)
        ranks = [dict(actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 7], sparse_mode=2),
                 dict(actual_seq_qlen=[3, 7], actual_seq_kvlen=[4, 8], pre_tockens=4, next_tockens=1)]
    q, k, v = _tnd(n=n, nkv=n, qlens=qlens, klens=klens)
    whole = npu_fusion_attention(q, k, v, n, "TND", actual_seq_qlen=_cum(qlens), actual_seq_kvlen=_cum(klens),
                                 scale=0.3, atten_mask=TRIU, sparse_mode=3 if mode == 7 else 2)[0]
    rows, keys = split
    parts = [(q[:rows], k[:keys], v[:keys]), (q[rows:], k[3:], v[3:])]
    for r, ((qr, kr, vr), kw) in enumerate(zip(parts, ranks)):
        kw = {"sparse_mode": mode, **kw}
        out = npu_fusion_attention(qr, kr, vr, n, "TND", scale=0.3, atten_mask=TRIU, **kw)[0]
        torch.testing.assert_close(out, whole[:rows] if r == 0 else whole[rows:])


def test_ring_merge_of_two_key_halves_from_statistics_alone():
    """MindSpeed's TND ring attention merges partial results through softmax_max/softmax_sum in
    torch_npu's default order (its flatten_softmax reads each sequence head-major). Two key halves,
    merged from the statistics alone, must give full attention for N > 1."""
    n, qlens, klens = 4, [3, 5, 4], [4, 6, 2]
    q, k, v = _tnd(n=n, nkv=2, qlens=qlens, klens=klens)
    full = npu_fusion_attention(q, k, v, n, "TND", actual_seq_qlen=_cum(qlens), actual_seq_kvlen=_cum(klens), scale=0.3)
    halves = []
    for part in (0, 1):
        idx = torch.cat([torch.arange(s, s + lk)[part * (lk // 2): lk if part else lk // 2]
                         for s, lk in zip([0] + _cum(klens)[:-1], klens)])
        lens = [lk - lk // 2 if part else lk // 2 for lk in klens]
        halves.append(npu_fusion_attention(q, k[idx], v[idx], n, "TND", actual_seq_qlen=_cum(qlens),
                                           actual_seq_kvlen=_cum(lens), scale=0.3))

    def flatten_softmax(x, lens):  # MindSpeed's: per sequence, the block of s*N rows is (N, s, 8)
        parts = x.view(-1, 8).split([s * x.shape[1] for s in lens])
        return torch.cat([p.view(x.shape[1], -1, 8).transpose(0, 1) for p in parts])

    (o1, m1, s1), (o2, m2, s2) = [(h[0], flatten_softmax(h[1], qlens), flatten_softmax(h[2], qlens)) for h in halves]
    m = torch.maximum(m1, m2)
    s1, s2 = s1 * torch.exp(m1 - m), s2 * torch.exp(m2 - m)
    merged = o1 * (s1 / (s1 + s2))[..., :1] + o2 * (s2 / (s1 + s2))[..., :1]
    torch.testing.assert_close(merged, full[0], rtol=1e-5, atol=1e-6)
    # the same through npu_ring_attention_update (TND, cumulative offsets from 0)
    out, smax, ssum = torch_npu.npu_ring_attention_update(halves[0][0], halves[0][1], halves[0][2], halves[1][0],
                                                          halves[1][1], halves[1][2], [0] + _cum(qlens), "TND")
    torch.testing.assert_close(out, full[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(smax, full[1])
    torch.testing.assert_close(ssum, full[2], rtol=1e-5, atol=1e-6)


# ----- gradients, sinks, dropout ----------------------------------------------------------------------


def test_grad_function_matches_autograd_including_dropout():
    b, n, sq, sk, d = 2, 2, 6, 6, 8
    q, k, v = _layout_tensors("BSND", b, n, n, sq, sk, d, dtype=torch.float64)
    pse = _rand(1, n, sq, sk, dtype=torch.float64, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, pse)]
    torch.manual_seed(11)
    out, smax, ssum, _, seed, offset, numels = npu_fusion_attention(
        *leaves[:3], n, "BSND", pse=leaves[3], atten_mask=TRIU, scale=0.3, keep_prob=0.7, sparse_mode=2)
    assert numels == b * n * sq * sk and offset == 0 and seed != 0
    dy = torch.randn_like(out)
    auto = torch.autograd.grad(out, leaves, dy)
    grads = npu_fusion_attention_grad(q, k, v, dy, n, "BSND", pse=pse, atten_mask=TRIU, softmax_max=smax,
                                      softmax_sum=ssum, attention_in=out.detach(), scale_value=0.3, keep_prob=0.7,
                                      seed=seed, offset=offset, numels=numels, sparse_mode=2)
    assert len(grads) == 4
    for a, g in zip(auto, grads):
        torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-6)  # the statistics are fp32
    ref = tileattn.reference(q, k, v, layout="BSND", scale=0.3, bias=0.3 * pse, mask=npu_keep(2, sq, sk),
                             dropout_p=0.3, seed=seed)
    torch.testing.assert_close(out.detach(), ref)
    assert npu_fusion_attention(q, k, v, n, "BSND", scale=0.3, keep_prob=0.7)[4] != seed
    # v2: a given (seed, offset) pair fixes the pattern and comes back
    a = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BSND", scale=0.3, keep_prob=0.7, seed=5, offset=3)
    bb = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BSND", scale=0.3, keep_prob=0.7, seed=5, offset=3)
    assert torch.equal(a[0], bb[0]) and (a[4], a[5]) == (5, 3)
    no_pse = npu_fusion_attention_grad(q, k, v, dy, n, "BSND", scale_value=0.3)
    assert no_pse[3] is None and no_pse[0].shape == q.shape


def test_sink_forward_gradient_and_dsink():
    """torch_npu's learnable ``sink``: one logit per head in each row's denominator; the grad op
    then returns a fifth output, dsink."""
    b, n, s, d = 1, 2, 5, 8
    q, k, v = _layout_tensors("BNSD", b, n, n, s, s, d, dtype=torch.float64)
    sink = torch.tensor([0.5, -1.0], dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    res = npu_fusion_attention(*leaves[:3], n, "BNSD", scale=0.3, atten_mask=TRIU, sparse_mode=3, sink=leaves[3])
    ref, ref_lse = tileattn.reference(q, k, v, scale=0.3, causal=True, sinks=sink, return_lse=True)
    torch.testing.assert_close(res[0], ref)
    torch.testing.assert_close(res[1][..., 0].double() + torch.log(res[2][..., 0].double()), ref_lse,
                               rtol=1e-6, atol=1e-6)
    dy = _rand(*res[0].shape, dtype=torch.float64, seed=3)
    auto = torch.autograd.grad(res[0], leaves, dy)
    grads = npu_fusion_attention_grad(q, k, v, dy, n, "BNSD", scale_value=0.3, atten_mask=TRIU, sparse_mode=3,
                                      sink=sink, softmax_max=res[1], softmax_sum=res[2], attention_in=res[0].detach())
    assert len(grads) == 5 and grads[3] is None
    for a, g in zip(auto[:3] + auto[3:], grads[:3] + grads[4:]):
        torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-6)


def test_grad_with_cut_keys_and_varlen_pieces():
    q, k, v = _layout_tensors("BNSD", 2, 2, 1, 4, 9, 8, dtype=torch.float64)
    pse = _rand(2, 2, 1, 9, dtype=torch.float64, seed=3)
    _grad_vs_autograd(q, k, v, 2, "BNSD", pse=pse, scale=0.3, sparse_mode=2, atten_mask=TRIU)
    t_q, t_k, t_v = _tnd(n=2, nkv=2, qlens=[3, 4], klens=[5, 4], dtype=torch.float64)
    ss = torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) > 0.7
    for mode, pre, nxt, mask in ((3, BIG, BIG, TRIU), (4, 3, -1, TRIU), (4, -1, 2, TRIU), (2, BIG, BIG, TRIU),
                                 (0, BIG, BIG, ss), (7, 5, -1, TRIU), (8, 5, 1, TRIU)):
        _grad_vs_autograd(t_q, t_k, t_v, 2, "TND", scale=0.4, sparse_mode=mode, atten_mask=mask, pre_tockens=pre,
                          next_tockens=nxt, actual_seq_qlen=[3, 7], actual_seq_kvlen=[5, 9])


def _grad_vs_autograd(q, k, v, n, layout, pse=None, **kw):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([pse.clone().requires_grad_(True)]
                                                                     if pse is not None else [])
    res = npu_fusion_attention(*leaves[:3], n, layout, pse=leaves[3] if pse is not None else None, **kw)
    dy = torch.randn(res[0].shape, generator=torch.Generator().manual_seed(2), dtype=res[0].dtype)
    auto = torch.autograd.grad(res[0], leaves, dy)
    scale = kw.pop("scale")
    for stats in (True, False):
        extra = dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0].detach()) if stats else {}
        grads = npu_fusion_attention_grad(q, k, v, dy, n, layout, pse=pse, scale_value=scale, seed=res[4], **kw,
                                          **extra)
        tol = dict(rtol=1e-5, atol=1e-6) if stats else {}  # supplied statistics are fp32
        for a, g in zip(auto, grads):
            torch.testing.assert_close(g, a, **tol)


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


def test_grad_v2_returns_seven_values_with_rope_gradients():
    b, n, s, d, dr = 1, 2, 4, 8, 4
    q, k, v = _layout_tensors("BSND", b, n, n, s, s, d, dtype=torch.float64)
    qr, kr = _rand(b, s, n, dr, dtype=torch.float64, seed=7), _rand(b, s, n, dr, dtype=torch.float64, seed=8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, qr, kr)]
    res = torch_npu.npu_fusion_attention_v2(leaves[0], leaves[1], leaves[2], n, "BSND", query_rope=leaves[3],
                                            key_rope=leaves[4], scale=0.3)
    dy = _rand(*res[0].shape, dtype=torch.float64, seed=1)
    auto = torch.autograd.grad(res[0], leaves, dy)
    grads = torch_npu.npu_fusion_attention_grad_v2(q, k, v, dy, n, "BSND", query_rope=qr, key_rope=kr,
                                                   scale_value=0.3)
    assert len(grads) == 7 and grads[3] is None and grads[6] is None
    for a, g in zip(auto, (grads[0], grads[1], grads[2], grads[4], grads[5])):
        torch.testing.assert_close(g, a)


def test_torch_npu_documentation_example():
    """The example of the torch_npu docs: BNSD (1, 8, 256, 128), scale 0.08838, causal triu mask.

    Its golden function adds ``atten_mask * -10000`` to the scaled scores and takes a softmax; modes
    0 (full mask, pre=65536, next=0), 2 and 3 (compressed 2048x2048 template) all give that result.
    """
    q, k, v = (_rand(1, 8, 256, 128, seed=s) for s in range(3))
    scale = 0.08838
    mask = torch.triu(torch.ones(1, 8, 256, 256), diagonal=1)
    golden = torch.softmax(torch.matmul(q, k.transpose(2, 3)).mul(scale) + mask * -10000.0, dim=-1) @ v
    for mode, atten_mask, pre, nxt in ((0, mask.bool(), 65536, 0), (2, TRIU, 65536, 0), (3, TRIU, 65536, 0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = npu_fusion_attention(q, k, v, 8, "bnsd", atten_mask=atten_mask, scale=scale, pre_tockens=pre,
                                       next_tockens=nxt, sparse_mode=mode)[0]
        torch.testing.assert_close(out, golden, atol=2e-5, rtol=1e-4)


# ----- bad input ------------------------------------------------------------------------------------


def test_bad_arguments_are_runtime_errors_naming_the_argument():
    q, k, v = _layout_tensors("BSH", 1, 4, 4, 4, 4, 8)
    t = _rand(6, 4, 8)
    cases = [
        (ValueError, "'input_layout'", lambda: npu_fusion_attention(q, k, v, 4, "BHS")),
        (TypeError, "'input_layout'", lambda: npu_fusion_attention(q, k, v, 4, 3)),
        (ValueError, "'head_num'.*divisor", lambda: npu_fusion_attention(q, k, v, 3, "BSH")),
        (ValueError, "'sparse_mode'.*0-6", lambda: npu_fusion_attention(q, k, v, 4, "BSH", sparse_mode=7)),
        (ValueError, "'sparse_mode'.*TND", lambda: npu_fusion_attention(t, t, t, 4, "TND", actual_seq_qlen=[6],
                                                                        actual_seq_kvlen=[6], sparse_mode=5)),
        (ValueError, "pre_tockens/next_tockens", lambda: npu_fusion_attention(q, k, v, 4, "BSH", pre_tockens=-1,
                                                                              next_tockens=-2, sparse_mode=4,
                                                                              atten_mask=TRIU)),
        (ValueError, "'atten_mask'.*compressed", lambda: npu_fusion_attention(
            q, k, v, 4, "BSH", sparse_mode=2, atten_mask=torch.ones(4, 4, dtype=torch.bool))),
        (TypeError, "'atten_mask'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", atten_mask=torch.ones(4, 4))),
        (ValueError, "'atten_mask'", lambda: npu_fusion_attention(q, k, v, 4, "BSH",
                                                                  atten_mask=torch.ones(3, 4, dtype=torch.bool))),
        (NotImplementedError, "'padding_mask'", lambda: npu_fusion_attention(q, k, v, 4, "BSH",
                                                                            padding_mask=torch.ones(1))),
        (ValueError, "'keep_prob'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", keep_prob=0.0)),
        (ValueError, "'pse'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", pse=torch.zeros(1, 4, 3, 4))),
        (TypeError, "'pse'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", pse=torch.zeros(1, 4, 4, 4).double())),
        (NotImplementedError, "'pse' with input_layout='TND'", lambda: npu_fusion_attention(
            t, t, t, 4, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6], pse=torch.zeros(1, 4, 1024, 6))),
        (ValueError, "'actual_seq_qlen'.*cumulative", lambda: npu_fusion_attention(
            t, t, t, 4, "TND", actual_seq_qlen=[4, 2], actual_seq_kvlen=[4, 6])),
        (ValueError, "'actual_seq_kvlen'.*entries", lambda: npu_fusion_attention(
            t, t, t, 4, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[6])),
        (ValueError, "'actual_seq_qlen'.*at most", lambda: npu_fusion_attention(
            t, t, t, 4, "TND", actual_seq_qlen=[2, 7], actual_seq_kvlen=[2, 6])),
        (ValueError, "'actual_seq_qlen/actual_seq_kvlen'", lambda: npu_fusion_attention(t, t, t, 4, "TND")),
        (ValueError, "'actual_seq_qlen'.*None", lambda: npu_fusion_attention(q, k, v, 4, "BSH", actual_seq_qlen=[4])),
        (ValueError, "'atten_mask'.*maxSq", lambda: npu_fusion_attention(
            t, t, t, 4, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6], atten_mask=torch.ones(5, 6, dtype=torch.bool))),
        (ValueError, "'head_num'", lambda: npu_fusion_attention(t, t, t, 2, "TND", actual_seq_qlen=[6],
                                                                actual_seq_kvlen=[6])),
        (ValueError, "'query'", lambda: npu_fusion_attention(q, k, v, 4, "BNSD")),
        (TypeError, "'query/key/value'", lambda: npu_fusion_attention(q, k.double(), v, 4, "BSH")),
        (ValueError, "'key'.*dividing head_num", lambda: npu_fusion_attention(q, k[..., :24], v[..., :24], 4, "BSH")),
        (TypeError, "'prefix'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", sparse_mode=6,
                                                             atten_mask=torch.zeros(3072, 2048, dtype=torch.bool))),
        (ValueError, "'prefix'.*documented|prefix\\[0\\]", lambda: npu_fusion_attention(
            q, k, v, 4, "BSH", sparse_mode=6, prefix=[5], atten_mask=torch.zeros(3072, 2048, dtype=torch.bool))),
        (ValueError, "'softmax_layout'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", softmax_layout="NTD")),
        (ValueError, "'sink'", lambda: npu_fusion_attention(q, k, v, 4, "BSH", sink=torch.zeros(3))),
        (NotImplementedError, "'dropout_mask'", lambda: torch_npu.npu_fusion_attention_v2(
            q, k, v, 4, "BSH", dropout_mask=torch.zeros(8, dtype=torch.uint8))),
        (ValueError, "'pse_type'", lambda: torch_npu.npu_fusion_attention_v2(q, k, v, 4, "BSH", pse_type=5)),
        (ValueError, "'dy'", lambda: npu_fusion_attention_grad(q, k, v, q[:, :2], 4, "BSH")),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match) as info:
            call()
        assert isinstance(info.value, RuntimeError), (match, type(info.value))
    with pytest.raises(AttributeError, match="does not provide 'npu_rms_norm'"):
        torch_npu.npu_rms_norm  # noqa: B018
