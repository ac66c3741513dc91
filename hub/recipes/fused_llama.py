"""Recipe: fuse a Llama's attention blocks (``tileattn.integrations.transformers.fuse``) and time it.

A Llama-class model with random weights (nothing is downloaded) is built three times with the same
weights: ``attn_implementation="sdpa"``, ``"tileattn"``, and ``"tileattn"`` with ``fuse(model)``, which
turns each layer's RMSNorm + q/k/v projections + RoPE into one ``tileattn.fused.norm_qkv`` call and
the output projection into ``tileattn.fused.out_proj``. The recipe checks that the fused model
generates the same greedy tokens as the unfused one and that its training step's loss and gradients
match, then prints prefill tokens/s, the time of a decode step and of a training step for all three
(one thread, thread CPU time, the three interleaved).

    python hub/recipes/fused_llama.py
    TILEATTN_SMALL=1 python hub/recipes/fused_llama.py
"""

import os
import statistics
import time

import torch

try:
    import transformers
    from transformers.utils import logging as hf_logging
except ImportError as exc:
    raise SystemExit(f"this recipe needs transformers: pip install 'tileattn[transformers]' ({exc})")

import tileattn.integrations.transformers as tt
from tileattn.tools.measure import cpu_model, time_interleaved

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
HIDDEN, LAYERS, PROMPT, NEW, REPS = (128, 2, 64, 4, 2) if SMALL else (1024, 8, 512, 16, 5)


def build():
    config = transformers.LlamaConfig(vocab_size=4096 if SMALL else 32000, hidden_size=HIDDEN,
                                      intermediate_size=int(HIDDEN * 2.75), num_hidden_layers=LAYERS,
                                      num_attention_heads=HIDDEN // 64, num_key_value_heads=HIDDEN // 128,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    models = {}
    for name, impl in (("sdpa", "sdpa"), ("tileattn", "tileattn"), ("tileattn + fuse", "tileattn")):
        model = transformers.LlamaForCausalLM(config).eval()
        model.set_attn_implementation(impl)
        if models:
            model.load_state_dict(models["sdpa"].state_dict())
        models[name] = model
    tt.fuse(models["tileattn + fuse"])            # <- the one line
    return config, models


def main():
    hf_logging.set_verbosity_error()
    tt.register()
    torch.set_num_threads(1)
    config, models = build()
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        tokens = {n: m.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0) for n, m in models.items()}
    assert torch.equal(tokens["tileattn + fuse"], tokens["tileattn"]), "the fused model changed the greedy tokens"

    grads = {}
    for name in ("tileattn", "tileattn + fuse"):
        model = models[name]
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
        model.eval()
    (loss_a, ga), (loss_b, gb) = grads["tileattn"], grads["tileattn + fuse"]
    assert abs(loss_a - loss_b) < 1e-5 * abs(loss_a), (loss_a, loss_b)
    worst = max(((ga[n] - gb[n]).abs().max() / ga[n].abs().max().clamp_min(1e-30)).item() for n in ga)
    assert worst < 1e-3, f"gradients differ by {worst:.2e} of their largest value"

    def prefill(m):
        return lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1)

    def generate(m):
        return lambda: m.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)

    def train(m):
        def step():
            m.train()
            m(input_ids=ids[:, :PROMPT // 2], labels=ids[:, :PROMPT // 2]).loss.backward()
            m.zero_grad(set_to_none=True)
            m.eval()
        return step

    print(f"Llama hidden {HIDDEN}, {LAYERS} layers, prompt {PROMPT}; {cpu_model()}, 1 thread")
    with torch.no_grad():
        pre = time_interleaved({n: prefill(m) for n, m in models.items()}, reps=REPS, warmup=1, clock=time.thread_time)
        gen = time_interleaved({n: generate(m) for n, m in models.items()}, reps=REPS, warmup=1, clock=time.thread_time)
    trn = time_interleaved({n: train(m) for n, m in models.items()}, reps=REPS, warmup=1, clock=time.thread_time)
    print(f"  {'':18s} {'prefill tok/s':>14s} {'decode step ms':>15s} {'train step s':>13s}")
    for name in models:
        step = statistics.median((g - p) / NEW for g, p in zip(gen[name], pre[name]))
        print(f"  {name:18s} {PROMPT / statistics.median(pre[name]):14.1f} {step * 1e3:15.2f} "
              f"{statistics.median(trn[name]):13.3f}")
    print("fused Llama: same greedy tokens and gradients as unfused; passed")


if __name__ == "__main__":
    main()
