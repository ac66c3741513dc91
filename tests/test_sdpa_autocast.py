"""tileattn's dialects under ``torch.autocast("cpu", dtype=torch.bfloat16)``, side by side with torch.

What torch does (2.13, CPU; checked in the first test): ``scaled_dot_product_attention`` is on
autocast's lower-precision list, so every floating input other than fp64 (query, key, value, a float
``attn_mask``) is cast to the autocast dtype: mixed fp32/bf16 inputs are accepted, the output has the
autocast dtype, fp64 inputs are left alone (and fp64 mixed with fp32 still raises); gradients come
back in the inputs' dtypes. flash-attn registers no autocast rule: it computes on what it is given.
"""

import pytest
import torch
import torch.nn.functional as F

import tileattn
from tileattn.compat.flash_attn import flash_attn_func

BF16 = torch.bfloat16
#: bf16 outputs of O(1) from two implementations rounding differently: a few bf16 ulps.
BF16_ATOL = 2e-2


def _qkv(dtypes=(torch.float32,) * 3, shape=(2, 4, 9, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dt) for dt in dtypes)


CASES = {
    "fp32": dict(dtypes=(torch.float32,) * 3),
    "fp32 q, bf16 k/v": dict(dtypes=(torch.float32, BF16, BF16)),
    "bf16 q, fp32 k/v": dict(dtypes=(BF16, torch.float32, torch.float32)),
    "fp16 q, bf16 k, fp32 v": dict(dtypes=(torch.float16, BF16, torch.float32)),
    "bf16": dict(dtypes=(BF16,) * 3),
    "fp32, causal": dict(dtypes=(torch.float32,) * 3, is_causal=True),
    "fp32, fp32 float mask": dict(dtypes=(torch.float32,) * 3, mask=torch.float32),
    "bf16, fp32 float mask": dict(dtypes=(BF16,) * 3, mask=torch.float32),
    "fp32, bool mask": dict(dtypes=(torch.float32,) * 3, mask=torch.bool),
}


def _mask(dtype):
    if dtype is None:
        return None
    keep = torch.rand(9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    keep |= torch.eye(9, dtype=torch.bool)
    if dtype == torch.bool:
        return keep
    return torch.zeros(9, 9, dtype=dtype).masked_fill(~keep, -1e4)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_sdpa_under_autocast_behaves_as_torch_sdpa(case):
    spec = CASES[case]
    q, k, v = _qkv(spec["dtypes"])
    kwargs = dict(attn_mask=_mask(spec.get("mask")), is_causal=spec.get("is_causal", False))
    with torch.autocast("cpu", dtype=BF16):
        expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
        got = tileattn.scaled_dot_product_attention(q, k, v, **kwargs)
    assert expected.dtype == BF16 and got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=BF16_ATOL, rtol=0)
    # Exactly the cast autocast makes: the same as casting by hand outside autocast.
    cast = lambda t: t.to(BF16) if t is not None and t.dtype != torch.bool else t  # noqa: E731
    by_hand = tileattn.scaled_dot_product_attention(cast(q), cast(k), cast(v), attn_mask=cast(kwargs["attn_mask"]),
                                                    is_causal=kwargs["is_causal"])
    assert torch.equal(got, by_hand)


def test_sdpa_under_autocast_leaves_fp64_alone_and_still_refuses_fp64_mixed_with_fp32():
    q, k, v = _qkv((torch.float64,) * 3)
    with torch.autocast("cpu", dtype=BF16):
        expected = F.scaled_dot_product_attention(q, k, v)
        got = tileattn.scaled_dot_product_attention(q, k, v)
        assert got.dtype == expected.dtype == torch.float64
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k.float(), v.float())
        with pytest.raises(TypeError, match=r"argument 'key/value': got dtypes torch.float64, torch.bfloat16"):
            tileattn.scaled_dot_product_attention(q, k.float(), v.float())


def test_sdpa_under_fp16_autocast_and_outside_autocast():
    q, k, v = _qkv((torch.float32, BF16, BF16))
    with torch.autocast("cpu", dtype=torch.float16):
        expected = F.scaled_dot_product_attention(q, k, v)
        got = tileattn.scaled_dot_product_attention(q, k, v)
    assert got.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected.float(), atol=5e-3, rtol=0)
    with pytest.raises(TypeError, match="argument 'key/value'"):  # no autocast: mixed dtypes stay an error
        tileattn.scaled_dot_product_attention(q, k, v)


def test_sdpa_gradients_under_autocast_match_torch():
    leaves = [t.requires_grad_() for t in _qkv()]
    grads = []
    for fn in (F.scaled_dot_product_attention, tileattn.scaled_dot_product_attention):
        with torch.autocast("cpu", dtype=BF16):
            out = fn(*leaves, is_causal=True)
        assert out.dtype == BF16
        out.float().square().sum().backward()
        grads.append([t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
    for ours, theirs in zip(grads[1], grads[0]):
        assert ours.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=5e-2, rtol=5e-2)


def test_patch_sdpa_under_autocast():
    q, k, v = _qkv((torch.float32, BF16, BF16))
    with torch.autocast("cpu", dtype=BF16):
        expected = F.scaled_dot_product_attention(q, k, v)
        with tileattn.patch_sdpa():
            got = F.scaled_dot_product_attention(q, k, v)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), expected.float(), atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_flash_attn_func_is_autocast_neutral_like_flash_attn(dtype):
    """flash-attn has no autocast rule: the dialect computes on the inputs as given (fp32 stays fp32,
    exactly as outside autocast), and mixed dtypes are an error as in flash-attn."""
    q, k, v = (t.transpose(1, 2).to(dtype) for t in _qkv())
    outside = flash_attn_func(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=BF16):
        inside = flash_attn_func(q, k, v, causal=True)
        with pytest.raises(TypeError, match="argument 'k'"):
            flash_attn_func(q.float(), k.to(BF16), v.to(BF16))
    assert inside.dtype == dtype and torch.equal(inside, outside)


def test_transformers_llama_under_autocast_matches_sdpa():
    """A Llama under autocast: the rotary embedding gives fp32 q/k next to a bf16 v, which transformers'
    sdpa path hands to torch's SDPA (which casts); tileattn must do the same."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import tileattn.integrations.transformers as tt

    tt.register()
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="tileattn").eval()
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        expected = sdpa(input_ids=ids, attention_mask=attention_mask).logits
        got = ours(input_ids=ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert got.dtype == expected.dtype
    scale = expected[keep].abs().max().item()
    # Both run the layers in bf16 and attention on bf16 inputs; they may differ by the rounding of
    # attention's bf16 output, carried through the layers (observed: identical here).
    diff = (got - expected)[keep].float().abs().max().item()
    assert diff < 1e-2 * scale, (diff, scale)


def test_core_backends_agree_under_autocast():
    q, k, v = _qkv(shape=(1, 2, 64, 16))
    exact = tileattn.reference(q.double(), k.double(), v.double(), causal=True)
    with torch.autocast("cpu", dtype=BF16):
        for backend in ("cpu", "reference"):
            out = tileattn.flash_attention(q, k, v, causal=True, backend=backend)
            assert out.dtype == torch.float32
            assert (out.double() - exact).abs().max() < 1e-5, backend
