"""Tiny random transformers models with attn_implementation="tileattn" against "eager".

gpt-oss (learnable sinks) and DeepSeek-V3.2 (top-k sparse attention) end to end: prefill logits,
greedy tokens and a training step's gradients. Every row of ``tt.ARCHITECTURES`` is checked: the
architectures said to use tileattn call it and match eager; the others are refused by the mask
builder ``register()`` installs or flagged by :func:`check_model`. A model is judged on the modules
that read the mask (a multimodal model's language model, the decoder ``generate`` builds a static
mask for, OCR models' own vision towers beside a routed decoder). Models are built from configs
(hidden 32-64, 2 layers; nothing is downloaded) with ``initializer_range=0.2`` so that logits are
O(5) and a dropped sink or index moves them by O(1).
"""

import copy
import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'transformers')")

import tileattn.integrations.transformers as tt  # noqa: E402
from transformers.models.auto import modeling_auto as auto_names  # noqa: E402
from conftest import training_step  # noqa: E402

VOCAB = 96
#: fp32 logits: eager and tileattn differ by rounding, observed <= 3e-6 of the largest logit.
LOGITS_RTOL = 2e-5


def _assert_logits_close(got, expected, keep=None):
    """Within LOGITS_RTOL of the largest logit, on the positions that are not padding."""
    keep = torch.ones(got.shape[:2], dtype=torch.bool) if keep is None else keep.bool()
    scale = expected[keep].abs().max().item()
    assert scale > 1.0, "logits too small for the test to tell a dropped argument from rounding"
    diff = (got - expected)[keep].abs().max().item()
    assert diff < LOGITS_RTOL * scale, f"max |diff| {diff:.2e} for logits up to {scale:.2f}"


def _decoder(**extra):
    return dict(dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2), **extra)


def _mla(**extra):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                v_head_dim=12, qk_nope_head_dim=8, first_k_dense_replace=1, max_position_embeddings=64,
                initializer_range=0.2, **extra)


#: Sizes given to the configs of the older architectures (each takes the names it knows).
SMALL = dict(vocab_size=VOCAB, hidden_size=32, d_model=32, n_embd=32, embed_dim=32, num_hidden_layers=2, num_layers=2,
             n_layer=2, encoder_layers=2, decoder_layers=2, num_decoder_layers=2, num_attention_heads=4, n_head=4,
             n_heads=4, encoder_attention_heads=4, decoder_attention_heads=4, num_heads=4, attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, ffn_dim=64, encoder_ffn_dim=64, decoder_ffn_dim=64, d_ff=64,
             d_kv=8, max_position_embeddings=64, n_positions=64, initializer_range=0.2, init_std=0.2, embedding_size=32,
             num_experts=4, attention_window=4, d_inner=64, max_seq_len=64, entity_vocab_size=16, entity_emb_size=16)


def _small(model_type, **extra):
    """The config of ``model_type`` at SMALL sizes, no dropout, every special token id in the vocabulary."""
    cls = transformers.CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    config = cls(**{k: v for k, v in dict(SMALL, **extra).items() if k in params})
    for name in dir(config):
        value = getattr(config, name, None)
        if name.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(config, name, 3)
        if ("dropout" in name or name.endswith("_prob")) and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


SLIDING = ["sliding_attention", "full_attention"]
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_decoder()),
    "mistral": lambda: transformers.MistralConfig(**_decoder(sliding_window=4)),
    "qwen2": lambda: transformers.Qwen2Config(**_decoder()),
    "qwen3": lambda: transformers.Qwen3Config(**_decoder(head_dim=16)),
    "gemma2": lambda: transformers.Gemma2Config(**_decoder(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                                           attn_logit_softcapping=5.0)),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_decoder(head_dim=16, sliding_window=4,
                                                                    query_pre_attn_scalar=16, layer_types=SLIDING)),
    "gpt_oss": lambda: transformers.GptOssConfig(**_decoder(head_dim=16, sliding_window=4, num_local_experts=4,
                                                            num_experts_per_tok=2, layer_types=SLIDING)),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**_mla()),
    "deepseek_v32": lambda: transformers.DeepseekV32Config(**_mla(index_topk=4, index_head_dim=16, index_n_heads=2)),
    "minimax_m3_vl_text": lambda: transformers.MiniMaxM3VLTextConfig(**_decoder(
        head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2, dense_intermediate_size=96,
        shared_intermediate_size=32, layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "dense"], index_n_heads=2, index_head_dim=16, index_block_size=2,
        index_topk_blocks=2, index_local_blocks=1)),
    "granite_swa": lambda: transformers.GraniteSWAConfig(**_decoder(sliding_window=4, layer_types=SLIDING)),
    "t5": lambda: transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                        dropout_rate=0.0, initializer_factor=5.0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            initializer_range=0.2),
    "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                                 attention_types=[[["global", "local"], 1]],
                                                 max_position_embeddings=64, initializer_range=0.2),
    "falcon": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, initializer_range=0.2),
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                              initializer_range=0.2),
    "xglm": lambda: transformers.XGLMConfig(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                            init_std=0.2),
}
CONFIGS = {row.model_type: CONFIGS.get(row.model_type, lambda t=row.model_type: _small(t)) for row in tt.ARCHITECTURES}


def _auto(model_type):
    """The Auto class of the model's language-model head (the base model when it has none)."""
    for mapping, auto in ((auto_names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM),
                          (auto_names.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForSeq2SeqLM),
                          (auto_names.MODEL_FOR_MASKED_LM_MAPPING_NAMES, transformers.AutoModelForMaskedLM)):
        if model_type in mapping:
            return auto
    return transformers.AutoModel


def _build(model_type, implementation, config=None):
    config = copy.deepcopy(config) if config is not None else CONFIGS[model_type]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _auto(config.model_type).from_config(config, attn_implementation=implementation).eval()


def _pair(model_type, config=None):
    """(eager, tileattn) models with the same weights."""
    tt.register()
    torch.manual_seed(0)
    eager = _build(model_type, "eager", config)
    ours = _build(model_type, "tileattn", config)
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def _batch(batch=2, length=10):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0  # left padding
    return ids, attention_mask


def _logits(model, ids, attention_mask, **kwargs):
    """The logits (the last hidden state of a model without a language-model head)."""
    if model.config.is_encoder_decoder and _auto(model.config.model_type) is transformers.AutoModelForSeq2SeqLM:
        kwargs.setdefault("decoder_input_ids", ids[:, :4])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention_mask, **kwargs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _compared(model, attention_mask):
    """Positions whose outputs are compared: all but left-padded queries (eager averages the values
    there, tileattn outputs 0, as sdpa); encoder-decoder logits are the decoder's, all compared."""
    return None if model.config.is_encoder_decoder or attention_mask is None else attention_mask


class _Counting:
    """Counts calls of the registered tileattn function (wraps it in AttentionInterface)."""

    def __enter__(self):
        self.calls = 0

        def counting(*args, **kwargs):
            self.calls += 1
            return tt.tileattn_attention_forward(*args, **kwargs)

        transformers.AttentionInterface.register(tt.NAME, counting)
        return self

    def __exit__(self, *exc):
        tt.register()


def test_every_architecture_row_has_a_tiny_config():
    assert [row.model_type for row in tt.ARCHITECTURES] == list(CONFIGS)


def _rows(*handlings):
    return [r for r in tt.ARCHITECTURES if r.handling in handlings]


@pytest.mark.parametrize("row", _rows("routed", "routed, eager mask"), ids=lambda r: r.model_type)
def test_architecture_that_uses_tileattn_calls_it_and_matches_eager(row):
    eager, ours = _pair(row.model_type)
    ids, attention_mask = _batch()
    with _Counting() as counter, warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning from the mask builder or check_model
        if row.handling == "routed":
            assert tt.check_model(ours).ok
        got = _logits(ours, ids, attention_mask)
        unpadded = _logits(ours, ids, None)
    assert counter.calls >= 2, f"{row.name}: tileattn ran {counter.calls} times for 2 layers"
    _assert_logits_close(got, _logits(eager, ids, attention_mask), _compared(eager, attention_mask))
    # Without padding (causal models then get no mask at all): FlashAttention's rule at the model's
    # output, eager in fp64 the oracle (T5's unscaled scores make fp32 logits differ by 6e-5 there).
    in_fp64 = copy.deepcopy(eager).double()
    if in_fp64._can_set_experts_implementation():
        in_fp64.set_experts_implementation("eager")  # grouped_mm has no fp64
    oracle = _logits(in_fp64, ids, None)
    error, yardstick = (unpadded.double() - oracle).abs().max(), (_logits(eager, ids, None).double() - oracle).abs().max()
    assert error <= 2 * yardstick + 1e-6 * oracle.abs().max(), (error.item(), yardstick.item())


@pytest.mark.parametrize("row", _rows("refused"), ids=lambda r: r.model_type)
def test_architecture_that_computes_attention_itself_is_refused_at_its_first_forward(row, monkeypatch):
    """Built with "tileattn" it would never call tileattn and would misread the SDPA-style mask: its
    first forward raises, naming it and what to use instead. With the opt-out (keyword or environment)
    it runs on its own attention with eager's mask: exactly eager's results, tileattn never called."""
    eager, ours = _pair(row.model_type)
    ids, attention_mask = _batch()
    with pytest.raises(tt.UnsupportedModelError, match=rf"\('{row.model_type}'\) computes attention itself .*"
                                                       r"Use attn_implementation='eager'.*allow_bypass=True"):
        _logits(ours, ids, attention_mask)
    with pytest.raises(tt.UnsupportedModelError):
        _logits(ours, ids, None)  # whatever the mask
    expected = [_logits(eager, ids, attention_mask), _logits(eager, ids, None)]
    try:
        for opt_out in ("keyword", "environment"):
            if opt_out == "keyword":
                tt.register(allow_bypass=True)
            else:
                tt.register()
                monkeypatch.setenv(tt.ALLOW_BYPASS_ENV, "1")
            with _Counting() as counter, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the opt-out warns once per model class
                got = [_logits(ours, ids, attention_mask), _logits(ours, ids, None)]
            assert counter.calls == 0
            _assert_logits_close(got[0], expected[0], _compared(eager, attention_mask))
            _assert_logits_close(got[1], expected[1])
            monkeypatch.delenv(tt.ALLOW_BYPASS_ENV, raising=False)
    finally:
        tt.register()
    with pytest.warns(UserWarning, match="computes attention itself"):
        assert not tt.check_model(ours).ok


@pytest.mark.parametrize("row", _rows("unaffected"), ids=lambda r: r.model_type)
def test_architecture_that_never_reads_the_implementation_computes_eagers_result(row):
    """Nothing of tileattn runs in it (no interface, no mask builder), so nothing can refuse it at its
    forward: its result is eager's, and check_model reports that it never calls tileattn."""
    eager, ours = _pair(row.model_type)
    ids, attention_mask = _batch()
    with _Counting() as counter:
        got = _logits(ours, ids, attention_mask)
    assert counter.calls == 0
    _assert_logits_close(got, _logits(eager, ids, attention_mask), _compared(eager, attention_mask))
    with pytest.warns(UserWarning, match="computes attention itself"):
        check = tt.check_model(ours)
    assert not check.ok and check.routed == () and check.bypassing


# --- an architecture no table knows (what a newer transformers may bring) ----------------------


class _NewConfig(transformers.PretrainedConfig):
    model_type = "tileattn_test_new_architecture"

    def __init__(self, hidden_size=16, num_attention_heads=2, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads


class _OwnAttention(torch.nn.Module):
    """Computes attention itself, adding the mask transformers built as eager's float bias."""

    def __init__(self, config):
        super().__init__()
        self.config, self.heads, self.num_key_value_groups = config, config.num_attention_heads, 1
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def project(self, x):
        return (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))

    def forward(self, x, mask):
        q, k, v = self.project(x)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        scores = scores if mask is None else scores + mask
        return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


class _RoutedAttention(_OwnAttention):
    """Looks the implementation up in transformers' AttentionInterface."""

    def forward(self, x, mask):
        q, k, v = self.project(x)
        attention = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, transformers.models.llama.modeling_llama.eager_attention_forward)
        return attention(self, q, k, v, mask, scaling=q.shape[-1] ** -0.5, dropout=0.0)[0].flatten(2)


def _new_model(attention_class, supports_sdpa):
    class NewModel(transformers.PreTrainedModel):
        config_class = _NewConfig
        _supports_sdpa = supports_sdpa

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(VOCAB, config.hidden_size)
            self.attention = attention_class(config)
            self.is_causal = True
            self.post_init()

        def forward(self, input_ids, attention_mask=None):
            x = self.embed(input_ids)
            positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
            mask = transformers.masking_utils.create_causal_mask(
                config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=None,
                position_ids=positions)
            return self.attention(x, mask)

    torch.manual_seed(0)
    return NewModel(_NewConfig(attn_implementation="tileattn")).eval()


def test_an_unknown_architecture_computing_attention_itself_is_refused():
    """Judged from its modules, not from a list: a model class no transformers release has."""
    tt.register()
    ids, attention_mask = _batch()
    with pytest.raises(tt.UnsupportedModelError, match=r"NewModel \('tileattn_test_new_architecture'\) computes "
                                                       r"attention itself \(_OwnAttention never call"):
        _new_model(_OwnAttention, supports_sdpa=True)(ids, attention_mask)


@pytest.mark.parametrize("supports_sdpa", [True, False])
def test_an_unknown_architecture_that_calls_the_interface_runs_on_the_mask_it_declares(supports_sdpa):
    """SDPA's bool mask for a model that declares SDPA support, eager's float mask for one that does
    not (it may rely on it); both give the model's eager result."""
    tt.register()
    ids, attention_mask = _batch()
    model = _new_model(_RoutedAttention, supports_sdpa)
    masks = []

    def spying(module, query, key, value, mask, **kwargs):
        masks.append(mask)
        return tt.tileattn_attention_forward(module, query, key, value, mask, **kwargs)

    transformers.AttentionInterface.register(tt.NAME, spying)
    try:
        with torch.no_grad():
            got = model(ids, attention_mask)
    finally:
        tt.register()
    assert masks[0].dtype == (torch.bool if supports_sdpa else torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        expected = model(ids, attention_mask)
    keep = attention_mask.bool()  # left-padded queries: eager averages the values, tileattn gives 0
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-6)


def test_every_row_is_routed_refused_or_said_why_not():
    assert {row.handling for row in tt.ARCHITECTURES} <= set(tt.HANDLING)
    assert all(row.uses_tileattn == row.handling.startswith("routed") for row in tt.ARCHITECTURES)


def test_register_with_a_model_switches_and_checks_it():
    model = _build("llama", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tt.register(model=model) == tt.NAME
    assert model.config._attn_implementation == tt.NAME
    with pytest.warns(UserWarning, match="BloomForCausalLM computes attention itself"):
        tt.register(model=_build("bloom", "eager"))
    tt.register()


def test_check_model_watches_the_first_forward():
    """A model whose registered name no longer leads to tileattn (here: replaced by sdpa) is caught at
    its first forward, which a static look at the modeling code cannot see."""
    tt.register()
    model = _build("llama", "tileattn")
    ids, attention_mask = _batch()
    assert tt.check_model(model).ok
    transformers.AttentionInterface.register(tt.NAME, transformers.integrations.sdpa_attention.sdpa_attention_forward)
    try:
        with pytest.warns(UserWarning, match="ran a forward with attn_implementation='tileattn' without calling"):
            _logits(model, ids, attention_mask)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            _logits(model, ids, attention_mask)
    finally:
        tt.register()


def test_check_model_reports_an_unregistered_name_and_another_implementation():
    model = _build("llama", "sdpa")
    with pytest.warns(UserWarning, match=r"'nope' is not registered.*implementation is \('sdpa',\), not 'nope'"):
        check = tt.check_model(model, name="nope")
    assert check.routed == ("LlamaAttention",) and not check.ok
    assert not tt.integration_report(name="nope")["registered"] and tt.integration_report()["registered"]


# --- judged on the path the mask is for -----------------------------------------------------------


def _pair_of(auto, config):
    """(eager, tileattn) models of ``auto`` with the same weights, each built from its own copy of ``config``."""
    tt.register()
    models = []
    for implementation in ("eager", "tileattn"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models.append(auto.from_config(copy.deepcopy(config), attn_implementation=implementation).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def _same_generation(eager, ours, **inputs):
    """Greedy tokens with a static cache (whose mask generate builds above the model) equal eager's."""
    kwargs = dict(inputs, max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0)
    with _Counting() as counter, torch.no_grad():
        tokens = ours.generate(**kwargs)
    assert counter.calls > 0
    with torch.no_grad():
        assert torch.equal(tokens, eager.generate(**kwargs))


def test_a_multimodal_model_on_text_is_judged_on_its_language_model():
    """Gemma 4 with an audio tower, text only: the mask is built for the text config, so only the
    language model's attention is judged, not the audio tower's own (which reads no such mask)."""
    text = dict(_decoder(hidden_size=32, head_dim=8, sliding_window=4, layer_types=SLIDING),
                vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 8],
                 output_proj_dims=32)
    eager, ours = _pair_of(transformers.AutoModelForImageTextToText,
                           transformers.Gemma4Config(text_config=text, audio_config=audio))
    assert "Gemma4AudioAttention" in tt.attention_classes(ours)[1]
    ids, attention_mask = _batch()
    _assert_logits_close(_logits(ours, ids, attention_mask), _logits(eager, ids, attention_mask), attention_mask)
    _same_generation(eager, ours, input_ids=ids, attention_mask=attention_mask)


@pytest.mark.parametrize("model_type", ["longt5", "pegasus_x"])
def test_encoder_decoder_generate_with_a_static_cache_is_judged_on_its_decoder(model_type):
    """generate builds the decoder's mask above the encoder and decoder: the encoder's own attention
    (LongT5's local, PEGASUS-X's global-local; they build their own masks) is not judged."""
    config = CONFIGS[model_type]()
    config.decoder_start_token_id = 0
    eager, ours = _pair(model_type, config)
    ids, attention_mask = _batch()
    _same_generation(eager, ours, input_ids=ids, attention_mask=attention_mask)


def test_a_decoder_that_computes_attention_itself_is_refused_in_generate_too():
    eager, ours = _pair("mvp")
    ids, attention_mask = _batch()
    with pytest.raises(tt.UnsupportedModelError, match=r"MvpAttention never calls"):
        ours.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=2, cache_implementation="static")


def _ocr_config(model_type):
    """Tiny Unlimited-OCR / PP-FormulaNet: SAM-like vision towers that pick their attention class by
    implementation name and compute it themselves, and a language model (decoder) that routes."""
    base = transformers.CONFIG_MAPPING[model_type]()
    sam = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, image_size=64, window_size=2,
               global_attn_indexes=[1])
    if model_type == "pp_formulanet":
        vision = dict(sam, output_channels=32, post_conv_in_channels=32, post_conv_out_channels=64,
                      post_conv_mid_channels=32, decoder_hidden_size=32)
        text = dict(vocab_size=VOCAB, max_position_embeddings=64, decoder_layers=2, decoder_ffn_dim=64,
                    decoder_attention_heads=2, d_model=32, dropout=0.0, init_std=0.2, pad_token_id=1, bos_token_id=0,
                    eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
        return type(base)(vision_config=vision, text_config=text)
    text = dict(_decoder(hidden_size=32, num_attention_heads=2, head_dim=16, sliding_window=4), n_routed_experts=2,
                n_shared_experts=1, num_experts_per_tok=1, moe_intermediate_size=16, mlp_layer_types=["dense"] * 2,
                layer_types=["reference_sliding_attention"] * 2)
    vision = dict(sam_config=sam, encoder_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2))
    config = type(base)(text_config=text, vision_config=vision)
    for owner in (config, config.text_config):
        for name in dir(owner):
            value = getattr(owner, name, None)
            if name.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
                setattr(owner, name, 3)
    return config


@pytest.mark.parametrize("model_type", ["unlimited_ocr", "pp_formulanet"])
def test_ocr_models_with_vision_towers_of_their_own_build_and_run(model_type):
    """Their SAM vision attention is looked up in a table keyed by implementation name (KeyError('tileattn')
    before register() gave the name eager's class there); it reads no transformers mask, the language
    model routes: logits and greedy tokens match eager."""
    eager, ours = _pair_of(transformers.AutoModelForImageTextToText, _ocr_config(model_type))
    assert tt.attention_classes(ours)[1]  # the tower computes attention itself
    ids, attention_mask = _batch()
    if model_type == "pp_formulanet":  # image to formula: the decoder reads the image's encoding
        with torch.no_grad():  # logits O(5), as the other tiny models' (its head's init gives O(0.3))
            eager.get_output_embeddings().weight.mul_(16)
        ours.load_state_dict(eager.state_dict())
        inputs = dict(pixel_values=torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3)))
        with torch.no_grad():
            got, expected = (m(**inputs, decoder_input_ids=ids[:, :4]).logits for m in (ours, eager))
        _assert_logits_close(got, expected)
    else:
        inputs = dict(input_ids=ids, attention_mask=attention_mask)
        _assert_logits_close(_logits(ours, ids, attention_mask), _logits(eager, ids, attention_mask), attention_mask)
    _same_generation(eager, ours, **inputs)


# --- gpt-oss (sinks) and DeepSeek-V3.2 (sparse indices) end to end ------------------------------


def _sink_heavy(model):
    """gpt-oss's trained sinks are O(1-5); the random init gives O(0.2)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 4.0, layer.self_attn.sinks.numel()))
    return model


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v32"])
def test_sparse_and_sink_models_match_eager_logits_and_greedy_tokens(model_type):
    eager, ours = _pair(model_type)
    if model_type == "gpt_oss":
        _sink_heavy(eager)
        ours.load_state_dict(eager.state_dict())
    ids, attention_mask = _batch()
    _assert_logits_close(_logits(ours, ids, attention_mask), _logits(eager, ids, attention_mask), attention_mask)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v32"])
def test_sparse_and_sink_models_training_step_matches_eager(model_type):
    eager, ours = _pair(model_type)
    if model_type == "gpt_oss":
        _sink_heavy(eager)
        ours.load_state_dict(eager.state_dict())
    ids, attention_mask = _batch()
    # A padded query sees no key: eager outputs the mean of the values there, tileattn 0 (as sdpa).
    # Nothing reads those rows except the loss term predicting the first real token: leave it out.
    predicted_from_padding = torch.nn.functional.pad(attention_mask[:, :-1] == 0, (1, 0))
    labels = ids.masked_fill((attention_mask == 0) | predicted_from_padding, -100)
    losses, grads = training_step((eager, ours), ids, attention_mask, labels)
    assert abs(losses[0] - losses[1]) < 1e-5
    assert grads[0].keys() == grads[1].keys()
    if model_type == "gpt_oss":
        assert any(name.endswith("sinks") for name in grads[1])
    scale = max(g.abs().max().item() for g in grads[0].values())
    worst = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    assert worst < 1e-4 * max(scale, 1.0), (worst, scale)


def test_packed_sequences_with_cu_seq_lens_match_separate_sequences():
    """Padding-free batches (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): one row of
    packed sequences with position_ids and cu_seq_lens. With a cache transformers does not split the
    sequences in the mask, so only cu_seq_lens keeps them apart; each must match its own eager run."""
    eager, ours = _pair("llama")
    g = torch.Generator().manual_seed(2)
    lengths = [4, 6, 3]
    seqs = [torch.randint(1, VOCAB, (1, n), generator=g) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    with torch.no_grad():
        got = ours(input_ids=packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=max(lengths), max_length_k=max(lengths), use_cache=True).logits
        expected = torch.cat([eager(input_ids=s).logits for s in seqs], dim=1)
    _assert_logits_close(got, expected)


# --- inference mode ------------------------------------------------------------------------------


def test_inference_mode_without_padding():
    eager, ours = _pair("llama")
    ids, _ = _batch()
    with torch.inference_mode():
        got = ours(input_ids=ids).logits
        tokens = ours.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    _assert_logits_close(got, _logits(eager, ids, None))
    assert torch.equal(tokens, eager.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))


def test_inference_mode_with_padding():
    eager, ours = _pair("llama")
    ids, attention_mask = _batch()
    with torch.inference_mode():
        got = ours(input_ids=ids, attention_mask=attention_mask).logits
    _assert_logits_close(got, _logits(eager, ids, attention_mask), attention_mask)
