"""Recipe: continuous batching of a Hugging Face model over one tileattn PagedCache.

A tiny Llama-class model (random weights, greedy decoding; no download) serves requests of mixed
prompt and output lengths through ``tileattn.integrations.transformers.PagedCache``, the cache that
the ``"tileattn"`` attention implementation reads as stored (no concatenation, no dequantised copy):

* a request joins: ``cache.add()`` claims a sequence, ``cache.select([seq])`` makes it the forward's
  one row, and ``model(prompt, cache=cache)`` prefills it; its pages come from the shared pool;
* every step, ``cache.select(running)`` says which sequence each row is, and one forward with one
  token per row (each with its own ``position_ids``) decodes them all: the rows hold different
  lengths, each row causal at its own end;
* a request leaves: ``cache.release([seq])`` gives its pages back, and a waiting request takes them.

It checks, with ``dtype=None`` in fp32, that every request's tokens equal those of generating it
alone with ``attn_implementation="sdpa"`` and a ``DynamicCache``; then it serves the same requests
from an int8 cache and reports tokens/s and the cache's bytes against the bf16 cache's (the speed
depends on the machine and is not checked).

    python hub/recipes/paged_cache_continuous_batching.py
"""

import copy
import os
import time
import warnings

import torch
import transformers

import tileattn.integrations.transformers as tt

warnings.filterwarnings("ignore", category=FutureWarning)
SMALL = os.environ.get("TILEATTN_SMALL") == "1"
REQUESTS, RUNNING = (6, 3) if SMALL else (16, 6)
PROMPTS, OUTPUTS = ((3, 24), (2, 10)) if SMALL else ((8, 200), (4, 40))
MAX_LEN = PROMPTS[1] + OUTPUTS[1]


def model_pair():
    tt.register()
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tileattn")
    ours.load_state_dict(sdpa.state_dict())
    return sdpa.eval(), ours.eval()


def requests():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(REQUESTS):
        n = int(torch.randint(*PROMPTS, (1,), generator=g))
        out.append((torch.randint(1, 256, (1, n), generator=g), int(torch.randint(*OUTPUTS, (1,), generator=g))))
    return out


def serve(model, cache, work):
    """Continuous batching: at most RUNNING sequences at once; returns each request's tokens."""
    waiting, running, done = list(range(len(work))), {}, {}
    while waiting or running:
        while waiting and len(running) < RUNNING:  # join: prefill alone, in pages from the shared pool
            r = waiting.pop(0)
            (seq,) = cache.add()
            cache.select([seq])
            logits = model(work[r][0], cache=cache).logits[:, -1]
            running[r] = (seq, [int(logits.argmax())])
        order = list(running)
        cache.select([running[r][0] for r in order])
        last = torch.tensor([[running[r][1][-1]] for r in order])
        position = torch.tensor([[work[r][0].shape[1] + len(running[r][1]) - 1] for r in order])
        logits = model(last, cache=cache, position_ids=position).logits[:, -1]
        for r, token in zip(order, logits.argmax(-1).tolist()):
            running[r][1].append(token)
            if len(running[r][1]) == work[r][1]:  # leave: the pages go back to the pool
                cache.release([running[r][0]])
                done[r] = running.pop(r)[1]
    return [done[r] for r in range(len(work))]


def main():
    sdpa, ours = model_pair()
    work = requests()
    with torch.no_grad():
        alone = [sdpa.generate(p, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               cache=transformers.DynamicCache(config=sdpa.config))[0, p.shape[1]:].tolist()
                 for p, n in work]
        # a pool smaller than RUNNING full-length sequences: it holds the running requests, not all of them
        pages = RUNNING * -(-MAX_LEN // 16) // 2 + 4
        cache = tt.PagedCache(ours.config, max_batch_size=RUNNING, max_cache_len=MAX_LEN, num_pages=pages)
        assert serve(ours, cache, work) == alone, "continuous batching changed a request's tokens"
        assert cache.sequences == [] and int(cache.free_count[0]) == pages
        print(f"fp32, dtype=None: {REQUESTS} requests, tokens identical to each served alone by sdpa + DynamicCache")
        report = {}
        for dtype in (torch.bfloat16, torch.int8):
            cache = tt.PagedCache(ours.config, max_batch_size=RUNNING, max_cache_len=MAX_LEN, dtype=dtype,
                                  num_pages=pages)
            t0 = time.perf_counter()
            tokens = serve(ours, cache, work)
            seconds = time.perf_counter() - t0
            report[dtype] = cache.nbytes
            agree = sum(a == b for out, ref in zip(tokens, alone) for a, b in zip(out, ref)) / sum(map(len, alone))
            print(f"{str(dtype):15s} cache: {cache.nbytes / 2**20:.2f} MiB (pools and scales), "
                  f"{sum(map(len, tokens)) / seconds:.1f} tokens/s, {100 * agree:.0f}% of the fp32 tokens")
    ratio = report[torch.int8] / report[torch.bfloat16]
    assert ratio <= 0.55, ratio
    print(f"int8 / bf16 bytes: {ratio:.3f}")
    print("paged_cache_continuous_batching passed")


if __name__ == "__main__":
    main()
