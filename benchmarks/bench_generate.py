"""End-to-end greedy generation of a tiny random-weight Hugging Face Llama: tileattn vs sdpa vs eager.

    python benchmarks/bench_generate.py            # prompt 128, 64 new tokens, batch 1 and 4
    python benchmarks/bench_generate.py --small    # a CI-size run
    python benchmarks/bench_generate.py --prompt 512 --new-tokens 128 --batches 1 --caches dynamic --lean
                                                   # issue 23's target; --lean adds tileattn_full

The model (4 layers, hidden 256, 8 query heads on 2 kv heads) is built once per attention
implementation from one state dict. For each batch size and cache (transformers' DynamicCache, and
``cache_implementation="static"``), the implementations run round-robin
(:func:`tileattn.tools.measure.time_interleaved`); tokens/s = batch * new tokens / median seconds. Every
implementation's tokens must equal eager's, or the script fails. Writes ``<out>.csv`` and ``<out>.json``.
With ``--lean``, ``tileattn_full`` is the tileattn model with the lean call bypassed
(:mod:`tileattn.core.lean`: every attention call validated and dispatched in full, as before it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import sys
import time
from pathlib import Path

import torch

from tileattn.tools.measure import cpu_model, median, spread_pct, time_interleaved, usable_cores

RESULTS = Path(__file__).resolve().parent / "results"
IMPLEMENTATIONS = ("tileattn", "sdpa", "eager")
CACHES = ("dynamic", "static")
FIELDS = ["implementation", "cache", "batch", "prompt", "new_tokens", "reps", "median_s", "min_s", "max_s",
          "spread_pct", "tokens_per_s", "vs_sdpa", "vs_eager", "same_tokens_as_eager", "clock"]


def build_models(layers=4, hidden=256, heads=8, kv_heads=2, vocab=1000, max_positions=512, seed=0):
    """{implementation: model}, all with the same random weights, in eval mode."""
    import transformers

    import tileattn.integrations.transformers as tt

    tt.register()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    models = {}
    for name in IMPLEMENTATIONS:
        models[name] = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                     attn_implementation=name).eval()
    state = models["eager"].state_dict()
    for model in models.values():
        model.load_state_dict(state)
    return models


def generate(model, ids, new_tokens, cache, full_path=False):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    from tileattn.core import lean

    with torch.inference_mode(), lean.bypassed() if full_path else contextlib.nullcontext():
        return model.generate(ids, **kwargs)


def run(models, batches, prompt, new_tokens, reps, warmup, caches=CACHES, vocab=1000, lean=False,
        clock=time.perf_counter):
    rows = []
    runs = {name: (m, False) for name, m in models.items()}
    if lean:
        runs["tileattn_full"] = (models["tileattn"], True)
    for batch in batches:
        ids = torch.randint(1, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch))
        for cache in caches:
            tokens = {name: generate(m, ids, new_tokens, cache, full) for name, (m, full) in runs.items()}
            same = {name: bool(torch.equal(t, tokens["eager"])) for name, t in tokens.items()}
            calls = {name: (lambda m=m, full=full: generate(m, ids, new_tokens, cache, full))
                     for name, (m, full) in runs.items()}
            samples = time_interleaved(calls, reps=reps, warmup=warmup, clock=clock)
            sec = {name: median(s) for name, s in samples.items()}
            for name, s in samples.items():
                rows.append(dict(implementation=name, cache=cache, batch=batch, prompt=prompt, new_tokens=new_tokens,
                                 reps=reps, median_s=sec[name], min_s=min(s), max_s=max(s), spread_pct=spread_pct(s),
                                 tokens_per_s=batch * new_tokens / sec[name], vs_sdpa=sec["sdpa"] / sec[name],
                                 vs_eager=sec["eager"] / sec[name], same_tokens_as_eager=same[name],
                                 clock="thread" if clock is time.thread_time else "wall"))
    return rows


def render(rows) -> str:
    head = ["batch", "cache", "implementation", "median s", "spread", "tokens/s", "vs sdpa", "vs eager", "same tokens"]
    lines = [head] + [[str(r["batch"]), r["cache"], r["implementation"], f"{r['median_s']:.3f}",
                       "-" if r["spread_pct"] is None else f"{r['spread_pct']:.0f}%", f"{r['tokens_per_s']:.1f}",
                       f"{r['vs_sdpa']:.2f}x",
                       f"{r['vs_eager']:.2f}x", "yes" if r["same_tokens_as_eager"] else "NO"] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="2 layers, hidden 64, prompt 16, 8 new tokens, 1 rep")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--reps", type=int, help="timed repetitions (default 5; --small 1)")
    p.add_argument("--threads", type=int, default=usable_cores(), help="torch threads (default: every usable core)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--caches", default=",".join(CACHES), help="comma-separated subset of dynamic, static")
    p.add_argument("--lean", action="store_true", help="also time tileattn with the lean call bypassed")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall time, or this thread's CPU time (with --threads 1 on a shared machine)")
    p.add_argument("--out", help="output path without suffix (default benchmarks/results/generate[_small])")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.small:
        models = build_models(layers=2, hidden=64, heads=4, kv_heads=2, vocab=96, max_positions=64)
        rows = run(models, batches, prompt=16, new_tokens=8, reps=args.reps or 1, warmup=0, vocab=96)
    else:
        if args.clock == "thread" and args.threads != 1:
            p.error("--clock thread counts one thread's CPU time: use it with --threads 1")
        models = build_models(max_positions=max(512, args.prompt + args.new_tokens))
        rows = run(models, batches, prompt=args.prompt, new_tokens=args.new_tokens, reps=args.reps or 5, warmup=1,
                   caches=args.caches.split(","), lean=args.lean,
                   clock=time.thread_time if args.clock == "thread" else time.perf_counter)
    print(f"greedy generate, tiny Llama, {args.threads} threads, {cpu_model()}")
    print(render(rows))
    out = Path(args.out) if args.out else RESULTS / ("generate_small" if args.small else "generate")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    import transformers

    out.with_suffix(".json").write_text(json.dumps(dict(cpu=cpu_model(), threads=args.threads, torch=torch.__version__,
                                                        transformers=transformers.__version__, results=rows),
                                                   indent=1) + "\n")
    differ = [f"{r['implementation']} ({r['cache']}, B={r['batch']})" for r in rows if not r["same_tokens_as_eager"]]
    if differ:
        sys.exit("tokens differ from eager: " + ", ".join(differ))
    return rows


if __name__ == "__main__":
    main()
