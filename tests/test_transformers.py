"""The "tileattn" attention implementation in Hugging Face transformers vs attn_implementation="sdpa"."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'transformers')")

import tileattn.integrations.transformers as tt  # noqa: E402
from conftest import training_step  # noqa: E402

VOCAB = 96


def _configs():
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    # GQA (4 query heads on 2 kv heads) and a sliding window shorter than the prompt
    mistral = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         sliding_window=4)
    return {"llama": llama, "mistral": mistral}


def _pair(name):
    tt.register()
    config = _configs()[name]
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tileattn")
    ours.load_state_dict(sdpa.state_dict())
    assert ours.config._attn_implementation == "tileattn" and sdpa.config._attn_implementation == "sdpa"
    return sdpa, ours


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 10), generator=g)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[0, :4] = 0  # left padding
    attention_mask[2, :1] = 0
    return ids, attention_mask


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_prefill_logits_and_greedy_generation_match_sdpa(name, monkeypatch):
    sdpa, ours = _pair(name)
    calls = []
    real = tt.tileattn_attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    transformers.AttentionInterface.register("tileattn", counting)
    try:
        ids, attention_mask = _batch()
        with torch.no_grad():
            expected = sdpa(input_ids=ids, attention_mask=attention_mask).logits
            got = ours(input_ids=ids, attention_mask=attention_mask).logits
        assert calls, "the tileattn attention function was never called"
        keep = attention_mask.bool()
        assert (got - expected)[keep].abs().max() < 1e-4
        kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, use_cache=True,
                      pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
    finally:
        tt.register()


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_training_step_matches_sdpa(name):
    sdpa, ours = _pair(name)
    ids, attention_mask = _batch()
    labels = ids.masked_fill(attention_mask == 0, -100)
    losses, grads = training_step((sdpa, ours), ids, attention_mask, labels)
    assert abs(losses[0] - losses[1]) < 1e-5
    assert grads[0].keys() == grads[1].keys() and grads[0]
    worst = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    assert worst < 1e-4


def test_softcap_and_unsupported_options():
    q = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    out, weights = tt.tileattn_attention_forward(module, q, q, q, None, scaling=0.5, softcap=3.0)
    assert weights is None and out.shape == (1, 5, 2, 8)
    s = torch.tanh(0.5 * q @ q.transpose(-1, -2) / 3.0) * 3.0
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, (torch.softmax(s, -1) @ q).transpose(1, 2), atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        tt.tileattn_attention_forward(module, q, q, q, None, output_attentions=True)


def test_patch_sdpa_inside_a_transformers_model():
    sdpa, _ = _pair("mistral")
    ids, attention_mask = _batch()
    import tileattn

    with torch.no_grad():
        expected = sdpa(input_ids=ids, attention_mask=attention_mask).logits
        with tileattn.patch_sdpa():
            patched = sdpa(input_ids=ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert (patched - expected)[keep].abs().max() < 1e-4


def _eager_and_ours(name):
    tt.register()
    config = _configs()[name]
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tileattn")
    ours.load_state_dict(eager.state_dict())
    return eager.eval(), ours.eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_tokens_match_eager_with_dynamic_and_static_caches(name, cache):
    # decode steps: one query against the cache (a static cache: its full length, the mask hides the rest)
    eager, ours = _eager_and_ours(name)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                  pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_continuous_batching_is_refused_naming_it():
    eager, ours = _eager_and_ours("llama")
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(ValueError, match="tileattn is not supported for continuous batching"):
        ours.generate_batch(inputs=[[1, 2, 3]], generation_config=config)
    # were it reached (under a name transformers lets through), the paged cache's keywords are refused
    q = torch.randn(1, 4, 1, 16)
    kv = torch.randn(1, 4, 3, 16)
    with pytest.raises(NotImplementedError, match="continuous batching.*generate_batch"):
        tt.tileattn_attention_forward(ours.model.layers[0].self_attn, q, kv, kv, None, block_table=torch.zeros(1, 1))
