"""Hugging Face decode with tileattn's PagedCache against attn_implementation="sdpa" with a DynamicCache.

    python benchmarks/bench_paged_cache.py                  # -> benchmarks/results/paged_cache.{csv,json}
    python benchmarks/bench_paged_cache.py --keys 2048 --reps 5 --threads 1

A tiny Llama-class model with random weights (bf16; defaults: hidden 512, 4 layers, 8 heads on 8 kv
heads (multi-head, as Llama-2-7B), head dim 64, MLP 1024, vocabulary 1024), one sequence prefilled to
``--keys`` cached tokens, then decode steps timed interleaved: sdpa + DynamicCache (which concatenates
every step) against the "tileattn" implementation reading a PagedCache as stored (bf16, int8, int4),
start rotated each round. Reported: median step time, spread, speedup over sdpa, relative error of
the step's logits against sdpa's (``|a - b| / |a|`` over the vocabulary) and the cache's bytes; the
fp32 check (``dtype=None`` in an fp32 model: greedy tokens identical to sdpa + DynamicCache, padded
batch) and the int8 / bf16 byte ratio. ``/proc/loadavg`` before and after; the CPU from /proc/cpuinfo.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

from tileattn.tools.measure import cpu_flags, cpu_model, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=8192, help="cached tokens before the timed steps")
    p.add_argument("--reps", type=int, default=15, help="timed steps per contender (interleaved)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, nargs=2, default=[8, 8], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", default="bf16,int8,int4", help="PagedCache dtypes timed (bf16, int8, fp8, int4)")
    p.add_argument("--out", default=str(RESULTS / "paged_cache"))
    return p.parse_args(argv)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_name() -> str:
    return cpu_model() + (" (AMX: amx_tile amx_bf16)" if "amx_bf16" in cpu_flags() else "")


def models(transformers, args, dtype):
    import tileattn.integrations.transformers as tt

    tt.register()
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads[0], num_key_value_heads=args.heads[1], head_dim=args.head_dim,
        max_position_embeddings=max(4096, 2 * args.keys), pad_token_id=0)
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval().to(dtype)
    ours = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval().to(dtype)
    ours.load_state_dict(sdpa.state_dict())
    sdpa.set_attn_implementation("sdpa")
    ours.set_attn_implementation("tileattn")
    return sdpa, ours


def fp32_tokens_match(transformers, args) -> bool:
    """dtype=None in an fp32 model: greedy tokens of a left-padded batch equal sdpa + DynamicCache's."""
    import tileattn.integrations.transformers as tt

    sdpa, ours = models(transformers, args, torch.float32)
    ids = torch.randint(1, 1024, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.no_grad():
        a = sdpa.generate(ids, cache=transformers.DynamicCache(config=sdpa.config), **kw)
        b = ours.generate(ids, cache=tt.PagedCache(ours.config, max_batch_size=3, max_cache_len=64), **kw)
    return bool(torch.equal(a, b))


def main(argv=None):
    warnings.filterwarnings("ignore")
    import transformers

    import tileattn.integrations.transformers as tt

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    tokens_equal = fp32_tokens_match(transformers, args)
    sdpa, ours = models(transformers, args, torch.bfloat16)
    names = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": "int4"}
    dtypes = [d for d in args.dtypes.split(",") if d]
    ids = torch.randint(0, 1024, (1, args.keys), generator=torch.Generator().manual_seed(2))
    steps = args.warmup + args.reps
    with torch.no_grad():
        contenders = {"sdpa+DynamicCache": (sdpa, transformers.DynamicCache(config=sdpa.config))}
        for d in dtypes:
            contenders[f"tileattn+PagedCache {d}"] = (
                ours, tt.PagedCache(ours.config, max_batch_size=1, max_cache_len=args.keys + steps + 1,
                                    dtype=names[d]))
        token = None
        for name, (model, cache) in contenders.items():
            logits = model(ids, cache=cache).logits[:, -1]
            token = logits.argmax(-1, keepdim=True) if token is None else token
        times = {n: [] for n in contenders}
        errors = {n: [] for n in contenders}
        order = list(contenders)
        for rnd in range(steps):
            shift = rnd % len(order)
            step_logits = {}
            for name in order[shift:] + order[:shift]:
                model, cache = contenders[name]
                t0 = time.perf_counter()
                step_logits[name] = model(token, cache=cache).logits[:, -1].float()
                if rnd >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
            ref = step_logits["sdpa+DynamicCache"]
            for name in order:
                errors[name].append(float((step_logits[name] - ref).norm() / ref.norm()))
            token = ref.argmax(-1, keepdim=True)
    load_after = loadavg()
    base = statistics.median(times["sdpa+DynamicCache"])
    bf16_bytes = contenders.get("tileattn+PagedCache bf16", (None, None))[1]
    rows = []
    for name, (_, cache) in contenders.items():
        med = statistics.median(times[name])
        nbytes = cache.nbytes if isinstance(cache, tt.PagedCache) else None
        rows.append(dict(contender=name, keys=args.keys, threads=args.threads, reps=args.reps,
                         median_ms=med * 1e3, spread_pct=100 * (max(times[name]) - min(times[name])) / med,
                         speedup_vs_sdpa=base / med, logits_rel_err_vs_sdpa=max(errors[name]),
                         cache_bytes=nbytes,
                         bytes_vs_bf16=(nbytes / bf16_bytes.nbytes) if nbytes and bf16_bytes is not None else None))
    config = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, head_dim=args.head_dim, dtype="bf16")
    meta = dict(cpu=cpu_name(), threads=args.threads, loadavg_before=load_before, loadavg_after=load_after,
                model=config, fp32_greedy_tokens_equal_sdpa=tokens_equal)
    write_results(args.out, rows, meta)
    print(json.dumps(meta))
    for r in rows:
        print(f"{r['contender']:28s} {r['median_ms']:8.2f} ms  spread {r['spread_pct']:5.1f}%  "
              f"x{r['speedup_vs_sdpa']:.2f}  logits err {r['logits_rel_err_vs_sdpa']:.2e}  bytes {r['cache_bytes']}"
              + (f" ({r['bytes_vs_bf16']:.3f} of bf16)" if r["bytes_vs_bf16"] else ""))


if __name__ == "__main__":
    main()
