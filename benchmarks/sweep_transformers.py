"""Every language-model architecture of the installed transformers, tiny and random, with
attn_implementation="tileattn" against "eager": does it call tileattn, match eager, or get refused?

    python benchmarks/sweep_transformers.py                 # all causal / masked / seq2seq LMs, 20-40 min
    python benchmarks/sweep_transformers.py llama bloom     # some model types

Each model type's default config is shrunk (hidden 64, 2 layers, 4 heads, vocabulary 256; the
names each config knows), built twice with the same weights, and run on a batch of 2 x 10 tokens
with and without left padding. A row says how many times tileattn ran, whether the mask builder
refused the model (``UnsupportedModelError``), and the largest logit difference relative to the
largest logit, over the positions that are not padding. Configs that do not accept the generic
sizes, and models that fail under eager too, are reported as such: they say nothing about tileattn.
Results: ``benchmarks/results/transformers_sweep.csv``.
"""

from __future__ import annotations

import copy
import csv
import inspect
import signal
import sys
import warnings
from pathlib import Path

import torch
import transformers
from transformers.models.auto import modeling_auto as auto_names
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import tileattn.integrations.transformers as tt

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, d_model=64, n_embd=64, embed_dim=64, dim=64, hidden_dim=96, n_embed=64,
             num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, encoder_layers=2, decoder_layers=2,
             num_decoder_layers=2, num_encoder_layers=2, num_attention_heads=4, n_head=4, n_heads=4,
             encoder_attention_heads=4, decoder_attention_heads=4, num_heads=4, attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, ffn_dim=96, encoder_ffn_dim=96, decoder_ffn_dim=96, d_ff=96,
             n_inner=96, max_position_embeddings=128, n_positions=128, initializer_range=0.2, init_std=0.2,
             moe_intermediate_size=32, num_local_experts=4, n_routed_experts=4, num_experts=4, num_experts_per_tok=2,
             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
             n_group=1, topk_group=1, d_kv=16, head_dim=16, embedding_size=64, entity_vocab_size=16, entity_emb_size=16)
HEADS = ((auto_names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM),
         (auto_names.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForSeq2SeqLM),
         (auto_names.MODEL_FOR_MASKED_LM_MAPPING_NAMES, transformers.AutoModelForMaskedLM))
FIELDS = ("model_type", "status", "tileattn_calls", "rel_error_unpadded", "rel_error_padded", "detail")
SECONDS_PER_MODEL = 120
#: A config the generic sizes leave bigger than this (parameters, counted on the meta device) is
#: skipped: some (speech, vision towers) have sizes of their own the sweep does not know.
MAX_PARAMETERS = 20_000_000


def tiny_config(model_type):
    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    config = cls(**{k: v for k, v in SMALL.items() if k in params})
    for name in dir(config):
        value = getattr(config, name, None)
        if name.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(config, name, 3)
        if ("dropout" in name or name.endswith("_prob")) and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def head(model_type):
    """The Auto class of the model's language-model head (the base model when it has none)."""
    return next((auto for mapping, auto in HEADS if model_type in mapping), transformers.AutoModel)


class _Counting:
    calls = 0

    @classmethod
    def forward(cls, *args, **kwargs):
        cls.calls += 1
        return tt.tileattn_attention_forward(*args, **kwargs)


def _outputs(model, auto, ids, attention_mask):
    kwargs = dict(input_ids=ids, attention_mask=attention_mask)
    if auto is transformers.AutoModelForSeq2SeqLM:
        kwargs["decoder_input_ids"] = ids[:, :4]
    with torch.no_grad():
        out = model(**kwargs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _row(model_type):
    auto = head(model_type)
    try:
        config = tiny_config(model_type)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                size = sum(p.numel() for p in auto.from_config(copy.deepcopy(config)).parameters())
            if size > MAX_PARAMETERS:
                return dict(status="no tiny config", detail=f"{size / 1e6:.0f}M parameters at the generic sizes")
            torch.manual_seed(0)
            eager = auto.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    except TimeoutError:
        raise
    except Exception as exc:  # the generic sizes do not fit this config: nothing to learn about tileattn
        return dict(status="no tiny config", detail=f"{type(exc).__name__}: {exc}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = auto.from_config(copy.deepcopy(config), attn_implementation="tileattn").eval()
    except TimeoutError:
        raise
    except Exception as exc:
        return dict(status="fails to build", detail=f"{type(exc).__name__}: {exc}")
    ours.load_state_dict(eager.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (2, 10), generator=gen)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    row = dict(status="routed", tileattn_calls=0)
    for name, mask in (("unpadded", None), ("padded", padded)):
        try:
            expected = _outputs(eager, auto, ids, mask)
        except Exception as exc:
            return dict(status="fails under eager", detail=f"{type(exc).__name__}: {exc}")
        _Counting.calls = 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = _outputs(ours, auto, ids, mask)
        except tt.UnsupportedModelError as exc:
            return dict(status="refused", detail=str(exc))
        except Exception as exc:
            return dict(status="error", detail=f"{type(exc).__name__}: {exc}")
        keep = torch.ones(got.shape[:2], dtype=torch.bool)
        if mask is not None and auto is not transformers.AutoModelForSeq2SeqLM:
            keep = mask.bool()  # eager averages the values for a query that sees no key, tileattn gives 0
        row[f"rel_error_{name}"] = float((got - expected)[keep].abs().max() / expected[keep].abs().max())
        row["tileattn_calls"] += _Counting.calls
    if not row["tileattn_calls"]:
        row["status"] = "unaffected" if max(row["rel_error_unpadded"], row["rel_error_padded"]) == 0 else "WRONG"
    elif max(row["rel_error_unpadded"], row["rel_error_padded"]) > 1e-4:
        row["status"] = "WRONG"
    return row


def main(argv=None):
    types = (argv if argv is not None else sys.argv[1:]) or sorted({t for mapping, _ in HEADS for t in mapping})
    tt.register()
    transformers.AttentionInterface.register(tt.NAME, _Counting.forward)

    def give_up(*_):
        raise TimeoutError(f"more than {SECONDS_PER_MODEL} s")

    signal.signal(signal.SIGALRM, give_up)
    rows = []
    for model_type in types:
        signal.alarm(SECONDS_PER_MODEL)
        try:
            row = _row(model_type)
        except TimeoutError as exc:
            row = dict(status="timeout", detail=str(exc))
        finally:
            signal.alarm(0)
        row = dict(model_type=model_type, **row)
        row["detail"] = " ".join(str(row.get("detail", "")).split())[:200]
        rows.append(row)
        print(" ".join(f"{k}={row.get(k, '')}" for k in FIELDS), flush=True)
    if argv is None and not sys.argv[1:]:
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "transformers_sweep.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        counts = {}
        for row in rows:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        print(f"transformers {transformers.__version__}: {counts}; wrote {RESULTS / 'transformers_sweep.csv'}")


if __name__ == "__main__":
    main()
