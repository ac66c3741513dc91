"""The oracle itself, against an implementation it shares no code with.

Every engine is judged against ``tileattn.reference`` in fp64, so the reference must be right on its
own: here it is compared, modifier by modifier, with a scalar loop over (batch, head, row, key) in
Python floats that reads the README's semantics literally (and nothing of ``tileattn`` but the
dropout hash, which *defines* the dropout pattern). The reference backend's explicit backward
formulas are checked against autograd through the reference forward, and that against finite
differences (gradcheck).
"""

from __future__ import annotations

import math

import pytest
import torch

import tileattn
import tileattn.core.reference as reference_module
from tileattn.core.modifiers import Dropout

from conftest import make_qkv


def naive(q, k, v, *, scale=None, causal=False, window=(None, None), align="bottom_right", mask=None, bias=None,
          alibi=None, softcap=0.0, sinks=None, dropout=None, seqused_k=None, row_max=False):
    """Attention of BNSD tensors by loops over scalars; returns (out, lse), or with ``row_max`` the
    maximum of every row's logits (sinks included; -inf for a row that sees nothing)."""
    b_n, hq, sq, d = q.shape
    hkv, sk_full, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    out = [[[[0.0] * dv for _ in range(sq)] for _ in range(hq)] for _ in range(b_n)]
    lse = [[[0.0] * sq for _ in range(hq)] for _ in range(b_n)]
    maxima = [[[-math.inf] * sq for _ in range(hq)] for _ in range(b_n)]
    for b in range(b_n):
        sk = sk_full if seqused_k is None else int(seqused_k[b])
        off = {"bottom_right": sk - sq, "top_left": 0}.get(align, align)
        for h in range(hq):
            kh = h // (hq // hkv)
            keep_drop = None
            if dropout is not None:
                keep_drop = dropout.keep(b, torch.tensor([h]), torch.arange(sq), torch.arange(sk))[0]
            for i in range(sq):
                logits = {}
                for j in range(sk):
                    rel = j - i - off
                    if left is not None and rel < -left:
                        continue
                    if right is not None and rel > right:
                        continue
                    if mask is not None and not bool(mask.expand(b_n, hq, sq, sk_full)[b, h, i, j]):
                        continue
                    s = scale * sum(float(q[b, h, i, t]) * float(k[b, kh, j, t]) for t in range(d))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        s -= float(alibi[h]) * abs(i + off - j)
                    if bias is not None:
                        s += float(bias.expand(b_n, hq, sq, sk_full)[b, h, i, j])
                    logits[j] = s
                terms = list(logits.values()) + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    lse[b][h][i] = -math.inf
                    continue
                top = maxima[b][h][i] = max(terms)
                total = top + math.log(sum(math.exp(t - top) for t in terms))
                lse[b][h][i] = total
                for j, s in logits.items():
                    p = math.exp(s - total)
                    if keep_drop is not None:
                        p = p / (1 - dropout.p) if keep_drop[i, j] else 0.0
                    for t in range(dv):
                        out[b][h][i][t] += p * float(v[b, kh, j, t])
    if row_max:
        return torch.tensor(maxima, dtype=torch.float64)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def _inputs(seed=0, sq=5, sk=7):
    return make_qkv(b=2, hq=4, hkv=2, sq=sq, sk=sk, d=3, dv=2, dtype=torch.float64, seed=seed)


CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal top-left": dict(causal=True, align="top_left"),
    "window with offset": dict(window=(1, 2), align=-1),
    "window bottom-right": dict(window=(2, 0)),
    "softcap": dict(softcap=1.5),
    "scale": dict(scale=0.7),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 1.0, 2.0])),
    "bias": dict(bias=torch.randn(1, 4, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))),
    "mask": dict(mask=torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(4)) > 0.4),
    "sinks": dict(sinks=torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64), causal=True),
    "dropout": dict(dropout_p=0.3, seed=11),
    "seqused_k": dict(seqused_k=torch.tensor([3, 7], dtype=torch.int32)),
    "seqused_k causal": dict(seqused_k=torch.tensor([3, 7], dtype=torch.int32), causal=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_a_scalar_loop(name):
    q, k, v = _inputs()
    kwargs = dict(CASES[name])
    out, lse = tileattn.reference(q, k, v, return_lse=True, **kwargs)
    naive_kwargs = {("alibi" if key == "alibi_slopes" else key): val for key, val in kwargs.items()
                    if key not in ("dropout_p", "seed")}
    if "dropout_p" in kwargs:
        naive_kwargs["dropout"] = Dropout(kwargs["dropout_p"], kwargs["seed"])
    want_out, want_lse = naive(q, k, v, **naive_kwargs)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert out.abs().max() > 0


@pytest.mark.parametrize("name", list(CASES))
def test_row_max_matches_a_scalar_loop(name, monkeypatch):
    """tileattn.core.reference.row_max (torch_npu's softmax_max) in fp64, one query row per block
    (keys cut to the band's range); cases whose tensors do not fix the shape also run 16 rows by 3
    keys (rows that see nothing under causal)."""
    monkeypatch.setattr(reference_module, "_ROW_MAX_BLOCK", 1)
    kwargs = CASES[name]
    naive_kwargs = {("alibi" if key == "alibi_slopes" else key): val for key, val in kwargs.items()
                    if key not in ("dropout_p", "seed")}
    shaped = any(key in kwargs for key in ("bias", "mask", "seqused_k"))
    for sq, sk in ((5, 7),) if shaped else ((5, 7), (16, 3)):
        q, k, v = _inputs(sq=sq, sk=sk)
        got = reference_module.row_max(q, k, v, compute_dtype=torch.float64, **kwargs)
        torch.testing.assert_close(got, naive(q, k, v, row_max=True, **naive_kwargs), rtol=1e-12, atol=1e-12)


def test_reference_rows_that_see_nothing():
    q, k, v = _inputs(sq=7, sk=3)
    out, lse = tileattn.reference(q, k, v, causal=True, return_lse=True)
    want_out, want_lse = naive(q, k, v, causal=True)
    assert torch.isneginf(lse[:, :, :4]).all() and (out[:, :, :4] == 0).all()
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["plain", "causal top-left", "softcap", "alibi", "bias", "sinks", "dropout",
                                  "seqused_k"])
def test_reference_gradients_pass_gradcheck(name):
    q, k, v = (t.requires_grad_() for t in _inputs(seed=1))
    kwargs = dict(CASES[name])
    extra = [kwargs[key].requires_grad_() for key in ("bias", "sinks") if key in kwargs]

    def f(q, k, v, *extra_leaves):
        kw = dict(kwargs)
        for key, leaf in zip([key for key in ("bias", "sinks") if key in kwargs], extra_leaves):
            kw[key] = leaf
        out, lse = tileattn.reference(q, k, v, return_lse=True, **kw)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, *extra))


@pytest.mark.parametrize("name", ["plain", "causal", "window with offset", "softcap", "alibi", "bias", "mask",
                                  "sinks", "dropout", "seqused_k"])
def test_reference_backend_backward_formulas_match_autograd(name):
    """The written-out backward (used with given statistics) == autograd through the forward,
    including a gradient flowing into the LSE."""
    q, k, v = (t.requires_grad_() for t in _inputs(seed=2))
    kwargs = dict(CASES[name])
    diff_keys = [key for key in ("bias", "sinks") if key in kwargs]
    extra = [kwargs[key].clone().requires_grad_() for key in diff_keys]
    gen = torch.Generator().manual_seed(5)

    def grads(fn):
        kw = dict(kwargs, **dict(zip(diff_keys, extra)))
        out, lse = fn(q, k, v, return_lse=True, **kw)
        dout = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        dlse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype).masked_fill(torch.isinf(lse), 0)
        return torch.autograd.grad((out, lse), [q, k, v, *extra], (dout, dlse))

    gen.manual_seed(5)
    auto = grads(lambda *a, **kw: tileattn.reference(*a, **kw))
    gen.manual_seed(5)
    formulas = grads(lambda *a, **kw: tileattn.flash_attention(*a, backend="reference", **kw))
    for name_, a, f in zip(["dq", "dk", "dv"] + [f"d{key}" for key in diff_keys], auto, formulas):
        torch.testing.assert_close(f, a, rtol=1e-10, atol=1e-10, msg=lambda m, n=name_: f"{n}: {m}")
