"""tileattn.patch_flex: PyTorch's flex_attention (and create_block_mask) on CPU tensors routed to
tileattn, so Flex code trains on CPU; a Hugging Face attn_implementation="flex_attention" model runs
through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import tileattn
from tileattn.flex import examples, install, uninstall
from tileattn.flex.semantics import flex_reference


def test_routes_cpu_calls_with_backward_and_restores():
    original, original_cbm = torch_flex.flex_attention, torch_flex.create_block_mask
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with tileattn.patch_flex():
        block_mask = torch_flex.create_block_mask(examples.causal, None, None, 50, 50, device="cpu", BLOCK_SIZE=16)
        out = torch_flex.flex_attention(q, k, v, score_mod=examples.alibi(2), block_mask=block_mask)
        grads = torch.autograd.grad(out.sum(), (q, k, v))  # PyTorch's CPU flex has no backward
    assert torch_flex.flex_attention is original and torch_flex.create_block_mask is original_cbm
    ref = flex_reference(q, k, v, score_mod=examples.alibi(2), block_mask=block_mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for got, expected in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    install()
    install()
    uninstall()
    assert torch_flex.flex_attention is not original  # installs stack
    uninstall()
    uninstall()  # nothing left to undo: no error
    assert torch_flex.flex_attention is original
    with pytest.raises(RuntimeError, match="boom"), tileattn.patch_flex():
        raise RuntimeError("boom")
    assert torch_flex.flex_attention is original


def test_hugging_face_flex_model_trains_on_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      max_position_embeddings=64)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 40, dtype=torch.long)
    attention_mask[1, :7] = 0  # left padding: a BlockMask reading b
    kept = attention_mask.bool()
    results = {}
    for implementation in ("sdpa", "flex_attention"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation,
                                                           dtype=torch.float64)
        with tileattn.patch_flex():
            logits = model(input_ids=ids, attention_mask=attention_mask).logits
            (logits[kept] ** 2).mean().backward()
        results[implementation] = (logits, [p.grad for p in model.parameters()])
    (expected, expected_grads), (got, got_grads) = results["sdpa"], results["flex_attention"]
    torch.testing.assert_close(got[kept], expected[kept], atol=1e-10, rtol=0)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)
