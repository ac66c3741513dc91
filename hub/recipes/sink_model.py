"""Recipe: run a model with learnable attention sinks (gpt-oss) from Hugging Face with tileattn.

gpt-oss adds one learnable logit per head to every softmax denominator (a "sink" that soaks up
attention and carries no value). transformers hands it to the attention function as ``s_aux=``;
tileattn applies it natively (``tileattn.flash_attention(..., sinks=)``), forward and backward.
A small gpt-oss is built from a config with random weights (nothing is downloaded) and its sinks are
set to trained-looking values. The recipe checks that:

* ``check_model`` confirms the model will call tileattn;
* the prefill logits match eager attention within fp32 rounding, and greedy generation gives the
  same tokens;
* the sinks matter: the same model with its sinks removed moves the logits by O(1), which is what an
  integration that ignored ``s_aux`` would silently return;
* a training step gives the sinks the same gradient as eager attention does.

    python hub/recipes/sink_model.py
    TILEATTN_SMALL=1 python hub/recipes/sink_model.py
"""

import os
import time

import torch

try:
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.utils import logging as hf_logging
except ImportError as exc:
    raise SystemExit(f"this recipe needs transformers: pip install 'tileattn[transformers]' ({exc})")

import tileattn.integrations.transformers as tileattn_hf

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
BATCH, PROMPT, NEW_TOKENS = (2, 24, 4) if SMALL else (4, 256, 16)


def main():
    hf_logging.set_verbosity_error()
    tileattn_hf.register()  # makes attn_implementation="tileattn" available
    config = GptOssConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=1024, initializer_range=0.2)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # trained gpt-oss sinks are O(1); the random init gives O(0.2)
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 4.0, config.num_attention_heads))
    ids = torch.randint(0, config.vocab_size, (BATCH, PROMPT))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, : PROMPT // 4] = 0  # left padding

    logits, tokens = {}, {}
    for impl in ("eager", "tileattn"):
        model.set_attn_implementation(impl)
        if impl == "tileattn" and not tileattn_hf.check_model(model).ok:
            raise SystemExit("check_model says this gpt-oss will not call tileattn")
        with torch.no_grad():
            model(ids[:, :8])  # warm-up
            t0 = time.perf_counter()
            logits[impl] = model(ids, attention_mask=attention_mask).logits
            prefill = time.perf_counter() - t0
            tokens[impl] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                          do_sample=False, pad_token_id=0)
        print(f"{impl:>9}: prefill {BATCH * PROMPT / prefill:8.0f} tokens/s")

    keep = attention_mask.bool()
    scale = logits["eager"][keep].abs().max().item()
    diff = (logits["tileattn"] - logits["eager"])[keep].abs().max().item()
    print(f"max |logits(tileattn) - logits(eager)| = {diff:.2e} (logits up to {scale:.2f})")
    if diff > 2e-5 * max(scale, 1.0):
        raise SystemExit("tileattn logits disagree with eager attention")
    if not torch.equal(tokens["tileattn"], tokens["eager"]):
        raise SystemExit("greedy generation with tileattn produced different tokens from eager attention")

    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-30.0)  # a sink of -30 takes no weight (e^-30): no sink at all
        sinkless = model(ids, attention_mask=attention_mask).logits
        for layer, sinks in zip(model.model.layers, saved):
            layer.self_attn.sinks.copy_(sinks)
    moved = (sinkless - logits["eager"])[keep].abs().max().item()
    print(f"without the sinks the logits move by up to {moved:.2f}: what dropping s_aux would return")
    if not moved > 0.1:
        raise SystemExit("the sinks should change this model's logits")

    grads = {}
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[0, PROMPT // 4] = -100  # predicted from a padded position, where eager and tileattn differ
    for impl in ("eager", "tileattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads[impl] = torch.stack([layer.self_attn.sinks.grad for layer in model.model.layers])
    gdiff = (grads["tileattn"] - grads["eager"]).abs().max().item()
    print(f"sink gradients: max |tileattn - eager| = {gdiff:.2e} (gradients up to {grads['eager'].abs().max():.2e})")
    if gdiff > 1e-4 * max(grads["eager"].abs().max().item(), 1.0):
        raise SystemExit("tileattn's sink gradients disagree with eager attention")
    print("sink model recipe passed: same logits, tokens and sink gradients as eager attention")


if __name__ == "__main__":
    main()
