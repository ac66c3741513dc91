"""Bad input: a clear ValueError/TypeError before any compute, naming the argument.

Each case is a call with one thing wrong. The test asserts the exception type, that the message has
the ``tileattn: argument '<name>'`` form, and that no backend's forward or backward ran.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tileattn
from tileattn.core.dispatch import list_backends

from conftest import make_qkv


def bnsd(b=2, hq=4, hkv=2, sq=8, sk=8, d=16, dtype=torch.float32):
    return make_qkv(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dtype=dtype)


def bsh(b=2, sq=8, sk=8, hq=4, hkv=2, d=16):
    return make_qkv(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, layout="BSH")


def tnd(tq=10, tk=12, hq=4, hkv=2, d=16):
    q, k, v = make_qkv(b=1, hq=hq, hkv=hkv, sq=tq, sk=tk, d=d)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)


I32 = torch.int32
CU_Q = torch.tensor([0, 4, 10], dtype=I32)
CU_K = torch.tensor([0, 5, 12], dtype=I32)


def call(q, k, v, **kwargs):
    return tileattn.flash_attention(q, k, v, **kwargs)


def with_qkv(make, **changes):
    """Build q, k, v from ``make`` and replace some of them by a function of the original."""

    def build():
        t = dict(zip("qkv", make()))
        for name, fn in changes.items():
            t[name] = fn(t[name])
        return t["q"], t["k"], t["v"]

    return build


# (id, builder of (q, k, v), kwargs, exception type, argument named in the message)
CORE_ARGUMENT_CASES = [
    ("q rank for BNSD", with_qkv(bnsd, q=lambda t: t[0]), {}, ValueError, "q"),
    ("k rank for BSND", with_qkv(bnsd, k=lambda t: t.flatten(2)), {"layout": "BSND"}, ValueError, "k"),
    ("v rank for BSH", with_qkv(bsh, v=lambda t: t[..., None]), {"layout": "BSH", "num_heads": 4}, ValueError, "v"),
    ("q rank for TND", bnsd, {"layout": "TND", "cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K}, ValueError, "q"),
    ("batch mismatch", with_qkv(bnsd, k=lambda t: t[:1], v=lambda t: t[:1]), {}, ValueError, "k/v"),
    ("k/v head mismatch", with_qkv(bnsd, v=lambda t: t[:, :1]), {}, ValueError, "v"),
    ("zero query heads", lambda: bnsd(hq=0, hkv=2), {}, ValueError, "q"),
    ("zero kv heads", lambda: bnsd(hq=4, hkv=0), {}, ValueError, "k"),
    ("Hq not divisible by Hkv", lambda: bnsd(hq=4, hkv=3), {}, ValueError, "k"),
    ("head dim mismatch", with_qkv(bnsd, k=lambda t: t[..., :8]), {}, ValueError, "k"),
    ("k/v length mismatch", with_qkv(bnsd, v=lambda t: t[:, :, :5]), {}, ValueError, "v"),
    ("dtype mismatch", with_qkv(bnsd, k=lambda t: t.double()), {}, TypeError, "k/v"),
    ("device mismatch", with_qkv(bnsd, v=lambda t: t.to("meta")), {}, ValueError, "k/v"),
    ("integer q", with_qkv(bnsd, q=lambda t: t.long()), {}, TypeError, "q"),
    ("bool v", with_qkv(bnsd, v=lambda t: t > 0), {}, TypeError, "v"),
    ("complex k", with_qkv(bnsd, k=lambda t: t.to(torch.complex64)), {}, TypeError, "k"),
    ("q not a tensor", with_qkv(bnsd, q=lambda t: t.tolist()), {}, TypeError, "q"),
    ("unknown layout", bnsd, {"layout": "NHWC"}, ValueError, "layout"),
    ("layout not a string", bnsd, {"layout": 4}, TypeError, "layout"),
    ("unknown backend", bnsd, {"backend": "cuda-magic"}, ValueError, "backend"),
    ("backend not a string", bnsd, {"backend": 3}, TypeError, "backend"),
    ("BSH without num_heads", bsh, {"layout": "BSH"}, ValueError, "num_heads"),
    ("SBH without num_heads", bsh, {"layout": "SBH"}, ValueError, "num_heads"),
    ("width not divisible by num_heads", bsh, {"layout": "BSH", "num_heads": 5}, ValueError, "num_heads"),
    ("num_heads not an int", bsh, {"layout": "BSH", "num_heads": 4.0}, TypeError, "num_heads"),
    ("num_heads zero", bsh, {"layout": "BSH", "num_heads": 0}, ValueError, "num_heads"),
    ("num_heads disagrees with BNSD q", bnsd, {"num_heads": 3}, ValueError, "num_heads"),
    ("k width not a multiple of head dim", with_qkv(bsh, k=lambda t: t[..., :20]), {"layout": "BSH", "num_heads": 4},
     ValueError, "k"),
    ("scale not finite", bnsd, {"scale": float("nan")}, ValueError, "scale"),
    ("scale not a number", bnsd, {"scale": "0.1"}, TypeError, "scale"),
    ("causal not a bool", bnsd, {"causal": 1}, TypeError, "causal"),
    ("deterministic not a bool", bnsd, {"deterministic": "yes"}, TypeError, "deterministic"),
]

MODIFIER_ARGUMENT_CASES = [
    ("mask not bool", bnsd, {"mask": torch.ones(8, 8)}, TypeError, "mask"),
    ("mask int", bnsd, {"mask": torch.ones(8, 8, dtype=torch.int32)}, TypeError, "mask"),
    ("mask not a tensor", bnsd, {"mask": [[True] * 8] * 8}, TypeError, "mask"),
    ("mask not broadcastable", bnsd, {"mask": torch.ones(8, 7, dtype=torch.bool)}, ValueError, "mask"),
    ("mask too many dims", bnsd, {"mask": torch.ones(1, 2, 4, 8, 8, dtype=torch.bool)}, ValueError, "mask"),
    ("mask wrong heads", bnsd, {"mask": torch.ones(3, 8, 8, dtype=torch.bool)}, ValueError, "mask"),
    ("mask on another device", bnsd, {"mask": torch.ones(8, 8, dtype=torch.bool, device="meta")}, ValueError, "mask"),
    ("bias not floating", bnsd, {"bias": torch.ones(8, 8, dtype=torch.int64)}, TypeError, "bias"),
    ("bias bool", bnsd, {"bias": torch.ones(8, 8, dtype=torch.bool)}, TypeError, "bias"),
    ("bias not broadcastable", bnsd, {"bias": torch.zeros(2, 4, 8, 9)}, ValueError, "bias"),
    ("bias wrong batch", bnsd, {"bias": torch.zeros(3, 1, 1, 1)}, ValueError, "bias"),
    ("window not a pair", bnsd, {"window": 3}, TypeError, "window"),
    ("window triple", bnsd, {"window": (1, 2, 3)}, TypeError, "window"),
    ("window float", bnsd, {"window": (1.5, 0)}, TypeError, "window"),
    ("window bool", bnsd, {"window": (True, 0)}, TypeError, "window"),
    ("window string", bnsd, {"window": "12"}, TypeError, "window"),
    ("softcap negative", bnsd, {"softcap": -1.0}, ValueError, "softcap"),
    ("softcap infinite", bnsd, {"softcap": float("inf")}, ValueError, "softcap"),
    ("softcap not a number", bnsd, {"softcap": "1"}, TypeError, "softcap"),
    ("softcap bool", bnsd, {"softcap": True}, TypeError, "softcap"),
    ("dropout_p one", bnsd, {"dropout_p": 1.0}, ValueError, "dropout_p"),
    ("dropout_p negative", bnsd, {"dropout_p": -0.1}, ValueError, "dropout_p"),
    ("dropout_p nan", bnsd, {"dropout_p": float("nan")}, ValueError, "dropout_p"),
    ("dropout_p not a number", bnsd, {"dropout_p": None}, TypeError, "dropout_p"),
    ("seed and generator", bnsd, {"dropout_p": 0.1, "seed": 1, "generator": torch.Generator()}, ValueError,
     "seed/generator"),
    ("seed not an int", bnsd, {"dropout_p": 0.1, "seed": 1.5}, TypeError, "seed"),
    ("generator of wrong type", bnsd, {"dropout_p": 0.1, "generator": 7}, TypeError, "generator"),
    ("alibi wrong dtype", bnsd, {"alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes"),
    ("alibi wrong shape", bnsd, {"alibi_slopes": torch.ones(2)}, ValueError, "alibi_slopes"),
    ("alibi wrong batch", bnsd, {"alibi_slopes": torch.ones(3, 4)}, ValueError, "alibi_slopes"),
    ("alibi 3-d", bnsd, {"alibi_slopes": torch.ones(2, 4, 1)}, ValueError, "alibi_slopes"),
    # arrays where tensors go: named, not "the truth value of an array is ambiguous"
    ("alibi a numpy array", bnsd, {"alibi_slopes": np.ones(4, dtype=np.float32)}, TypeError, "alibi_slopes"),
    ("mask a numpy array", bnsd, {"mask": np.ones((8, 8), dtype=bool)}, TypeError, "mask"),
    ("bias a numpy array", bnsd, {"bias": np.zeros((8, 8), dtype=np.float32)}, TypeError, "bias"),
    ("TND without cu_seqlens", tnd, {"layout": "TND"}, ValueError, "cu_seqlens_q"),
    ("TND without cu_seqlens_k", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q}, ValueError, "cu_seqlens_k"),
    ("cu_seqlens int64", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q.long(), "cu_seqlens_k": CU_K}, TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens list", tnd, {"layout": "TND", "cu_seqlens_q": [0, 4, 10], "cu_seqlens_k": CU_K}, TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens not from 0", tnd, {"layout": "TND", "cu_seqlens_q": torch.tensor([1, 4, 10], dtype=I32),
                                    "cu_seqlens_k": CU_K}, ValueError, "cu_seqlens_q"),
    ("cu_seqlens decreasing", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q,
                                    "cu_seqlens_k": torch.tensor([0, 7, 5, 12], dtype=I32)}, ValueError,
     "cu_seqlens_k"),
    ("cu_seqlens last != tokens", tnd, {"layout": "TND", "cu_seqlens_q": torch.tensor([0, 4, 9], dtype=I32),
                                        "cu_seqlens_k": CU_K}, ValueError, "cu_seqlens_q"),
    ("cu_seqlens batch mismatch", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q,
                                        "cu_seqlens_k": torch.tensor([0, 2, 5, 12], dtype=I32)}, ValueError,
     "cu_seqlens_k"),
    ("cu_seqlens 2-d", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q[None], "cu_seqlens_k": CU_K}, ValueError,
     "cu_seqlens_q"),
    ("max_seqlen too small", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
                                   "max_seqlen_q": 5}, ValueError, "max_seqlen_q"),
    ("cu_seqlens with BNSD", bnsd, {"cu_seqlens_q": CU_Q}, ValueError, "cu_seqlens_q"),
    ("max_seqlen with BNSD", bnsd, {"max_seqlen_q": 8}, ValueError, "max_seqlen_q"),
    ("cu_seqlens_k with BSH", bsh, {"layout": "BSH", "num_heads": 4, "cu_seqlens_k": CU_K}, ValueError,
     "cu_seqlens_k"),
    ("mask with TND", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
                            "mask": torch.ones(1, dtype=torch.bool)}, ValueError, "mask"),
    ("bias with TND", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
                            "bias": torch.zeros(1)}, ValueError, "bias"),
    ("window side beyond int64", bnsd, {"window": (2**70, 0)}, ValueError, "window"),
    ("cu_seqlens on another device", tnd, {"layout": "TND", "cu_seqlens_q": CU_Q.to("meta"), "cu_seqlens_k": CU_K},
     ValueError, "cu_seqlens_q"),
    ("sparse mask", bnsd, {"mask": torch.ones(8, 8, dtype=torch.bool).to_sparse()}, TypeError, "mask"),
    ("return_lse not a bool", bnsd, {"return_lse": 1}, TypeError, "return_lse"),
    ("align unknown", bnsd, {"align": "centre"}, ValueError, "align"),
    ("align float", bnsd, {"align": 1.5}, TypeError, "align"),
    ("sinks wrong shape", bnsd, {"sinks": torch.zeros(2)}, ValueError, "sinks"),
    ("sinks not floating", bnsd, {"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, "sinks"),
    ("seqused_k int64", bnsd, {"seqused_k": torch.tensor([8, 8])}, TypeError, "seqused_k"),
    ("seqused_k wrong batch", bnsd, {"seqused_k": torch.tensor([8], dtype=I32)}, ValueError, "seqused_k"),
    ("seqused_k beyond the keys", bnsd, {"seqused_k": torch.tensor([8, 9], dtype=I32)}, ValueError, "seqused_k"),
    ("block_table 1-d", bnsd, {"block_table": torch.zeros(2, dtype=I32)}, ValueError, "k"),
]

DENSE_ONLY_CASES = [
    ("sparse q", with_qkv(bnsd, q=lambda t: t.to_sparse()), {}, TypeError, "q"),
    ("nested q", with_qkv(bnsd, q=lambda t: torch.nested.nested_tensor(list(t))), {}, TypeError, "q"),
    ("BSH q of width 0", with_qkv(bsh, q=lambda t: t[..., :0]), {"layout": "BSH", "num_heads": 4}, ValueError,
     "num_heads"),
]


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if any backend's forward or backward runs."""
    ran = []
    for b in list_backends():
        for method in ("forward", "backward"):
            def spy(*args, _name=f"{b.name}.{method}", **kwargs):
                ran.append(_name)
                raise AssertionError(f"{_name} ran on bad input")

            monkeypatch.setattr(b, method, spy)
    return ran


@pytest.mark.parametrize("case", CORE_ARGUMENT_CASES + MODIFIER_ARGUMENT_CASES + DENSE_ONLY_CASES,
                         ids=lambda c: c[0])
def test_bad_input_is_rejected_before_compute(case, no_compute):
    _, build, kwargs, exc, argument = case
    q, k, v = build()
    with pytest.raises(exc) as info:
        call(q, k, v, **kwargs)
    assert type(info.value) is exc, f"raised {type(info.value).__name__}, expected {exc.__name__}"
    message = str(info.value)
    assert re.match(rf"tileattn: argument '{re.escape(argument)}': got .+; expected .+", message), message
    assert no_compute == []


@pytest.mark.parametrize(
    "case", [c for c in CORE_ARGUMENT_CASES + MODIFIER_ARGUMENT_CASES if "backend" not in c[2]], ids=lambda c: c[0]
)
def test_reference_and_explain_reject_the_same_input(case):
    """The oracle and explain() validate through the same spec: same exception type."""
    _, build, kwargs, exc, _ = case
    q, k, v = build()
    with pytest.raises(exc):
        tileattn.reference(q, k, v, **kwargs)
    with pytest.raises(exc):
        tileattn.explain(q, k, v, **kwargs)


def test_valid_versions_of_the_bad_calls_run():
    """Each builder is fine on its own: the cases above fail for the one thing they change."""
    q, k, v = bnsd()
    assert tileattn.flash_attention(q, k, v, mask=torch.ones(8, 8, dtype=torch.bool), window=(2, 0),
                                    softcap=1.0, alibi_slopes=torch.ones(2, 4), bias=torch.zeros(8),
                                    dropout_p=0.5, seed=3).shape == (2, 4, 8, 16)
    q, k, v = bsh()
    assert tileattn.flash_attention(q, k, v, layout="BSH", num_heads=4).shape == (2, 8, 64)
    assert tileattn.flash_attention(q, k, v, layout="SBH", num_heads=4).shape == (2, 8, 64)
    q, k, v = tnd()
    out = tileattn.flash_attention(q, k, v, layout="TND", cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=6)
    assert out.shape == (10, 4, 16)

