"""PagedCache with rows at different lengths (continuous batching): every row's window and chunks are
its own. The oracle is each row alone: the same weights under attn_implementation="eager", no cache,
over the row's whole sequence."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'transformers')")

import tileattn.integrations.transformers as tt  # noqa: E402

VOCAB = 96
WINDOW = 8
SLIDING = ["sliding_attention", "full_attention"]


def _decoder(**extra):
    return dict(dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2), **extra)


#: Every windowed or chunked architecture the integration routes, at a window (chunk) of 8.
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**_decoder(sliding_window=WINDOW)),
    "mixtral": lambda: transformers.MixtralConfig(**_decoder(sliding_window=WINDOW, num_local_experts=2)),
    "qwen2": lambda: transformers.Qwen2Config(**_decoder(sliding_window=WINDOW, use_sliding_window=True,
                                                         max_window_layers=0, layer_types=SLIDING)),
    "qwen3": lambda: transformers.Qwen3Config(**_decoder(sliding_window=WINDOW, use_sliding_window=True,
                                                         layer_types=SLIDING)),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_decoder(
        sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0, layer_types=SLIDING, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "ministral": lambda: transformers.MinistralConfig(**_decoder(sliding_window=WINDOW, layer_types=SLIDING)),
    "exaone4": lambda: transformers.Exaone4Config(**_decoder(sliding_window=WINDOW, layer_types=SLIDING)),
    "olmo3": lambda: transformers.Olmo3Config(**_decoder(sliding_window=WINDOW, layer_types=SLIDING)),
    "phi3": lambda: transformers.Phi3Config(**_decoder(sliding_window=WINDOW, pad_token_id=0)),
    "starcoder2": lambda: transformers.Starcoder2Config(**_decoder(sliding_window=WINDOW)),
    "phimoe": lambda: transformers.PhimoeConfig(**_decoder(sliding_window=WINDOW, num_local_experts=2)),
    "gemma2": lambda: transformers.Gemma2Config(**_decoder(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                           attn_logit_softcapping=5.0)),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_decoder(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                                    layer_types=SLIDING)),
    "cohere2": lambda: transformers.Cohere2Config(**_decoder(sliding_window=WINDOW, layer_types=SLIDING)),
    "gpt_oss": lambda: transformers.GptOssConfig(**_decoder(sliding_window=WINDOW, num_local_experts=4,
                                                            num_experts_per_tok=2, layer_types=SLIDING)),
    "granite_swa": lambda: transformers.GraniteSWAConfig(**_decoder(sliding_window=WINDOW, layer_types=SLIDING)),
    "llama4_text": lambda: transformers.Llama4TextConfig(**_decoder(
        attention_chunk_size=WINDOW, layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
        intermediate_size_mlp=96, num_local_experts=2, interleave_moe_layer_step=2)),
}


def _models(model_type, **overrides):
    tt.register()
    config = CONFIGS[model_type]()
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
        ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tileattn")
    ours.load_state_dict(eager.state_dict())
    return eager.eval(), ours.eval()


def _alone(eager, ids):
    """The oracle: the row's last logits from its whole sequence, alone, under eager, without a cache."""
    return eager(ids, use_cache=False).logits[0, -1]


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_rows_at_different_lengths_give_each_row_its_own_window(model_type):
    """Rows of 20, 5 and 13 tokens in one cache, decoded together with per-row position_ids and no
    mask, then a step of three tokens each: every row's logits are those of the row alone (the
    window built from the longest row hid every key of the 5-token row from it before)."""
    eager, ours = _models(model_type)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (20, 5, 13)]
    cache = tt.PagedCache(ours.config, max_batch_size=4, max_cache_len=40, page_size=4)
    worst = 0.0
    with torch.no_grad():
        sequences = cache.add(3)
        for s, ids in zip(sequences, rows):
            cache.select([s])
            ours(ids, cache=cache)
        cache.select(sequences)
        for width in (1, 3, 1):
            new = torch.randint(3, VOCAB, (3, width), generator=g)
            positions = torch.stack([torch.arange(r.shape[1], r.shape[1] + width) for r in rows])
            logits = ours(new, cache=cache, position_ids=positions).logits[:, -1]
            rows = [torch.cat([r, n[None]], 1) for r, n in zip(rows, new)]
            for row, got in zip(rows, logits):
                expected = _alone(eager, row)
                worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
    assert cache.lengths() == [25, 10, 18]
    assert worst < 1e-4, worst


def test_the_windowed_layers_drop_the_mask_and_pass_each_rows_window_to_the_kernel(monkeypatch):
    """What the kernel gets on a Gemma 2 decode step of rows at different lengths: no mask, and the
    window (w - 1, 0) bottom-right at each row's own length (seqused_k) on the sliding layer."""
    from tileattn.dialects import transformers_cache

    _, ours = _models("gemma2")
    calls = []
    real = transformers_cache.flash_attention

    def spy(q, k, v, **kwargs):
        calls.append((kwargs["window"], kwargs["mask"], kwargs["seqused_k"].tolist()))
        return real(q, k, v, **kwargs)

    cache = tt.PagedCache(ours.config, max_batch_size=2, max_cache_len=32)
    with torch.no_grad():
        for s, n in zip(cache.add(2), (20, 5)):
            cache.select([s])
            ours(torch.randint(3, VOCAB, (1, n)), cache=cache)
        cache.select([0, 1])
        monkeypatch.setattr(transformers_cache, "flash_attention", spy)
        ours(torch.randint(3, VOCAB, (2, 1)), cache=cache, position_ids=torch.tensor([[20], [5]]))
    assert calls == [((WINDOW - 1, 0), None, [21, 6]), (None, None, [21, 6])]


def test_a_padding_mask_with_rows_at_different_lengths_is_refused_on_a_windowed_layer_and_nothing_stays():
    """Padding cannot be told from the longest row's window for the other rows: refused, naming
    attention_mask, and the forward's tokens are taken out of the cache again."""
    _, ours = _models("mistral")
    cache = tt.PagedCache(ours.config, max_batch_size=2, max_cache_len=32, page_size=4)
    with torch.no_grad():
        for s, n in zip(cache.add(2), (20, 5)):
            cache.select([s])
            ours(torch.randint(3, VOCAB, (1, n)), cache=cache)
        cache.select([0, 1])
        free = int(cache.free_count[0])
        mask = torch.ones(2, 21, dtype=torch.long)
        mask[1, :2] = 0
        refused = "argument 'attention_mask'.*padding, on a layer with window 8.*\\[21, 6\\]"
        with pytest.raises(ValueError, match=refused):
            ours(torch.randint(3, VOCAB, (2, 1)), cache=cache, attention_mask=mask,
                 position_ids=torch.tensor([[20], [5]]))
        assert cache.lengths() == [20, 5] and int(cache.free_count[0]) == free
        ours(torch.randint(3, VOCAB, (2, 1)), cache=cache, position_ids=torch.tensor([[20], [5]]))
    assert cache.lengths() == [21, 6]


@pytest.mark.parametrize("model_type", ["gemma2", "llama4_text"])
def test_compiled_decode_steps_give_each_row_its_own_window(model_type):
    """The same under torch.compile (fullgraph), where no length can be read: the shorter rows drop
    transformers' mask on the windowed (chunked) layers, the kernel applies each row's window and the
    chunk mask is built from each row's length. Decode steps of one token; oracle: each row alone."""
    eager, ours = _models(model_type)
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (20, 5, 13)]
    cache = tt.PagedCache(ours.config, max_batch_size=3, max_cache_len=32, page_size=4)
    forward = torch.compile(ours.forward, fullgraph=True)
    worst = 0.0
    with torch.no_grad():
        for s, ids in zip(cache.add(3), rows):
            cache.select([s])
            ours(ids, cache=cache)
        cache.select([0, 1, 2])
        for _ in range(3):
            new = torch.randint(3, VOCAB, (3, 1), generator=g)
            positions = torch.tensor([[r.shape[1]] for r in rows])
            logits = forward(new, cache=cache, position_ids=positions).logits[:, -1]
            rows = [torch.cat([r, n[None]], 1) for r, n in zip(rows, new)]
            for row, got in zip(rows, logits):
                expected = _alone(eager, row)
                worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
    assert cache.lengths() == [23, 8, 16]
    assert worst < 1e-4, worst


@pytest.mark.parametrize("compiled", [False, True])
def test_llama4_layers_without_rope_take_the_temperature_of_the_tokens_before_the_forward(compiled):
    """Llama-4's layers without RoPE scale their queries by a temperature of the position, from the
    cache's length of their layer: the lengths are shared and advanced by layer 0's write, so those
    layers once read the length after the forward (a prefill's positions counted from its end; 0.8 %
    off at a floor_scale of 4). One row, a prefill and decode steps of 1 and 3 tokens; oracle: eager
    over the whole sequence."""
    eager, ours = _models("llama4_text", floor_scale=4, attn_temperature_tuning=True)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, VOCAB, (1, 10), generator=g)
    cache = tt.PagedCache(ours.config, max_batch_size=1, max_cache_len=32, page_size=4)
    forward = torch.compile(ours.forward, fullgraph=True) if compiled else ours.forward
    with torch.no_grad():
        got = [ours(ids, cache=cache).logits[0, -1]]
        expected = [_alone(eager, ids)]
        for width in (1, 1, 3, 1) if not compiled else (1, 1, 1):
            new = torch.randint(3, VOCAB, (1, width), generator=g)
            got.append(forward(new, cache=cache).logits[0, -1])
            ids = torch.cat([ids, new], 1)
            expected.append(_alone(eager, ids))
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected))
    assert worst < 1e-5, worst
