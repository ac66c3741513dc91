"""score_mod= / mask_mod= on tileattn.flash_attention: modifier objects composed with the built-in
ones, judged against the reference (which applies them through their hooks) under the 2x rule;
kernel engines refuse them by name."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.core.dispatch import NoBackendError
from tileattn.flex import examples
from tileattn.flex.modifiers import MaskMod, ScoreMod
from tileattn.core.testing import check_against_reference


def qkv(dtype=torch.float32, layout="BNSD", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in ((2, 4, 37, 16), (2, 2, 45, 16), (2, 2, 45, 16)))
    if layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("layout,dtype", [("BNSD", torch.float32), ("BSND", torch.bfloat16)])
def test_composed_with_builtin_modifiers(layout, dtype):
    q, k, v = qkv(dtype, layout)
    bias = torch.randn(4, 37, 45).to(dtype).requires_grad_()
    found = check_against_reference(
        tileattn.flash_attention, q, k, v, layout=layout, causal=True, softcap=3.0, alibi_slopes=torch.rand(4),
        bias=bias, score_mod=examples.softcap(2.0), mask_mod=examples.dilated_window(20, 2), return_lse=True)
    assert all(v.ok for v in found), "\n".join(map(str, found))
    assert len(found) == 6  # out, lse, dq, dk, dv, dbias


def test_captured_tensor_gradients_and_modifier_objects():
    q, k, v = qkv(torch.float64)
    table = torch.randn(4, 37 + 45 - 1, dtype=torch.float64, requires_grad=True)
    score_mod = examples.relative_bias(table, 45)
    doc = examples.document(torch.arange(45) // 15)
    out = tileattn.flash_attention(q, k, v, modifiers=[ScoreMod(score_mod), MaskMod(doc)], window=(10, None))
    ref = tileattn.reference(q, k, v, score_mod=score_mod, mask_mod=doc, window=(10, None))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    got = torch.autograd.grad(out.sum(), table)[0]
    expected = torch.autograd.grad(ref.sum(), table)[0]
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_engines_refuse_them_and_bad_input_is_named():
    q, k, v = qkv()
    why = tileattn.explain(q, k, v, score_mod=examples.softcap(2.0))
    assert why["native"] == ["modifiers not supported: score_mod"]
    with pytest.raises(NoBackendError, match="mask_mod"):
        tileattn.flash_attention(q, k, v, mask_mod=examples.causal, backend="native")
    with pytest.raises(TypeError, match="'score_mod'"):
        tileattn.flash_attention(q, k, v, score_mod=3)
    with pytest.raises(NotImplementedError, match="dropout"):
        tileattn.flash_attention(q, k, v, score_mod=examples.softcap(2.0), dropout_p=0.1)
