"""tileattn.scaled_dot_product_attention and patch_sdpa against torch's own SDPA."""

import pytest
import torch
import torch.nn.functional as F

import tileattn
from tileattn.sdpa import SdpaArgumentError, scaled_dot_product_attention as sdpa
from tileattn.core.testing import judge


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _compare_with_torch(tensors, grad=True, **kwargs):
    """Our SDPA vs torch's: torch in fp64 is the oracle, torch in the inputs' dtype the baseline."""
    dtype = tensors[0].dtype

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(grad and t.is_floating_point()) for t in tensors]
        kw = dict(kwargs)
        if isinstance(kw.get("attn_mask"), torch.Tensor) and kw["attn_mask"].is_floating_point():
            kw["attn_mask"] = kw["attn_mask"].to(cast)
        out = fn(*leaves, **kw)
        grads = ()
        if grad:
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
            grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        return out, grads

    out, grads = run(sdpa, dtype)
    o64, g64 = run(F.scaled_dot_product_attention, torch.float64)
    ob, gb = run(F.scaled_dot_product_attention, dtype)
    verdicts = [judge("out", out, o64, ob, dtype)]
    verdicts += [judge(n, a, b, c, dtype) for n, a, b, c in zip(("dq", "dk", "dv"), grads, g64, gb)]
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 10), (10, 3), (1, 6)])
def test_top_left_causal_matches_torch(dtype, sq, sk):
    _compare_with_torch([_rand(2, 3, sq, 16, dtype=dtype), _rand(2, 3, sk, 16, dtype=dtype, seed=1),
                         _rand(2, 3, sk, 16, dtype=dtype, seed=2)], is_causal=True)


@pytest.mark.parametrize("sq,sk", [(5, 5), (4, 9)])
def test_masks_match_torch(sq, sk):
    q, k, v = _rand(2, 4, sq, 8), _rand(2, 4, sk, 8, seed=1), _rand(2, 4, sk, 8, seed=2)
    g = torch.Generator().manual_seed(5)
    bool_mask = torch.rand(2, 1, sq, sk, generator=g) > 0.3
    bool_mask[..., 0] = False
    bool_mask[0, 0, 1] = False  # an empty row: 0 in torch >= 2.5 and in tileattn
    _compare_with_torch([q, k, v], attn_mask=bool_mask)
    float_mask = torch.randn(sq, sk, generator=g)
    _compare_with_torch([q, k, v], attn_mask=float_mask, scale=0.2)


def test_top_left_causal_with_a_mask_broadcast_over_keys():
    # Sq < Sk: top-left causal hides the last keys from every row; a mask with last dim 1 still applies
    q, k, v = _rand(1, 2, 4, 8), _rand(1, 2, 7, 8, seed=1), _rand(1, 2, 7, 8, seed=2)
    row_mask = torch.ones(1, 2, 4, 1, dtype=torch.bool)
    row_mask[0, 1, 2] = False
    causal = torch.ones(4, 7, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=row_mask & causal)
    got = tileattn.flash_attention(q, k, v, causal=True, align="top_left", mask=row_mask)
    torch.testing.assert_close(got, expected)
    assert got[0, 1, 2].abs().max() == 0


def test_gqa_leading_dims_and_3d_inputs():
    _compare_with_torch([_rand(2, 8, 5, 8), _rand(2, 2, 6, 8, seed=1), _rand(2, 2, 6, 4, seed=2)],
                        is_causal=True, enable_gqa=True)
    # extra leading batch dims (torch accepts (N, ..., H, L, E)) with a broadcast mask
    mask = _rand(1, 3, 1, 5, 6, seed=3) > -0.5
    mask[..., 0] = True
    _compare_with_torch([_rand(2, 3, 2, 5, 8), _rand(2, 3, 2, 6, 8, seed=1), _rand(2, 3, 2, 6, 8, seed=2)],
                        attn_mask=mask)
    _compare_with_torch([_rand(4, 5, 8), _rand(4, 7, 8, seed=1), _rand(4, 7, 8, seed=2)], is_causal=True)


def test_dropout_reproducible_with_torch_seed():
    q, k, v = _rand(1, 2, 16, 8), _rand(1, 2, 16, 8, seed=1), _rand(1, 2, 16, 8, seed=2)
    torch.manual_seed(0)
    a = sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = sdpa(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, sdpa(q, k, v))
    # in expectation dropout keeps the output: average over many seeds
    mean = torch.stack([sdpa(q, k, v, dropout_p=0.5) for _ in range(200)]).mean(0)
    assert (mean - sdpa(q, k, v)).abs().mean() < 0.1


def test_contradictory_arguments_raise_like_torch():
    q = _rand(1, 4, 3, 8)
    kv = _rand(1, 2, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool)
    for fn in (F.scaled_dot_product_attention, sdpa):
        with pytest.raises(RuntimeError):
            fn(q, kv, kv)  # GQA without enable_gqa
        with pytest.raises(RuntimeError):  # torch's math path (a mask that needs a gradient) raises too
            fn(q, q, q, attn_mask=torch.zeros(3, 3, requires_grad=True), is_causal=True)
    with pytest.raises(SdpaArgumentError, match="'attn_mask'.*is_causal"):
        sdpa(q, q, q, attn_mask=mask, is_causal=True)
    with pytest.raises(SdpaArgumentError, match="enable_gqa"):
        sdpa(q, kv, kv)
    with pytest.raises(ValueError, match="dividing"):
        sdpa(q, _rand(1, 3, 3, 8), _rand(1, 3, 3, 8), enable_gqa=True)
    with pytest.raises(TypeError, match="'attn_mask'"):
        sdpa(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="'attn_mask'"):
        sdpa(q, q, q, attn_mask=torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="'dropout_p'"):
        sdpa(q, q, q, dropout_p=1.5)


def test_patch_sdpa_routes_restores_and_nests(monkeypatch):
    original = F.scaled_dot_product_attention
    calls = []
    real = tileattn.sdpa.flash_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tileattn.sdpa, "flash_attention", spy)
    q = _rand(1, 2, 4, 8)
    with tileattn.patch_sdpa():
        assert F.scaled_dot_product_attention is tileattn.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        with tileattn.patch_sdpa():
            F.scaled_dot_product_attention(q, q, q)
        assert F.scaled_dot_product_attention is tileattn.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is original
    assert len(calls) == 2
    with pytest.raises(KeyError):
        with tileattn.patch_sdpa():
            raise KeyError("boom")
    assert F.scaled_dot_product_attention is original
    F.scaled_dot_product_attention(q, q, q)
    assert len(calls) == 2


def test_float_mask_gradient_matches_torch():
    q, k, v = (_rand(2, 2, 5, 8, dtype=torch.float64, seed=s) for s in range(3))
    grads = []
    for fn in (sdpa, F.scaled_dot_product_attention):
        bias = _rand(1, 2, 5, 5, dtype=torch.float64, seed=7).requires_grad_(True)
        out = fn(q, k, v, attn_mask=bias)
        (g,) = torch.autograd.grad(out, bias, torch.ones_like(out))
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().max() > 0


def test_sdpa_compiles_fullgraph():
    torch._dynamo.reset()
    q, k, v = _rand(1, 4, 6, 8), _rand(1, 2, 9, 8, seed=1), _rand(1, 2, 9, 8, seed=2)
    compiled = torch.compile(lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
