"""One decode step of ``flash_attn_with_kvcache`` (new key and value appended in place, then attention
over the cache) against the same step with PyTorch: ``index_copy_`` of the new key and value into a
preallocated cache and SDPA with ``enable_gqa`` over its used part.

    python benchmarks/bench_kvcache_step.py                 # -> benchmarks/results/kvcache_step.{csv,json}
    python benchmarks/bench_kvcache_step.py --threads 1 --keys 128,1024

Defaults: B 1, 32 / 8 heads, D 128, cached keys 16, 128 and 1024 (capacity twice that), fp32 and
bf16. Each sample is the mean of ``--iters`` back-to-back steps, the contenders interleaved
(start rotated each round); the median and the minimum of ``--reps`` samples are reported with
``/proc/loadavg`` before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tileattn.compat.flash_attn import flash_attn_with_kvcache
from tileattn.tools.measure import cpu_model, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="16,128,1024")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=str(RESULTS / "kvcache_step"))
    return p.parse_args(argv)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    rows = []
    for dname in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
        for keys in (int(x) for x in args.keys.split(",")):
            g = torch.Generator().manual_seed(keys)
            b, hq, hkv, d, cap = 1, 32, 8, 128, 2 * keys
            q = torch.randn(b, 1, hq, d, generator=g).to(dtype)
            k_cache, v_cache = (torch.randn(b, cap, hkv, d, generator=g).to(dtype) for _ in range(2))
            k_new, v_new = (torch.randn(b, 1, hkv, d, generator=g).to(dtype) for _ in range(2))
            lengths = torch.full((b,), keys - 1, dtype=torch.int32)
            kt, vt, qt = k_cache.transpose(1, 2), v_cache.transpose(1, 2), q.transpose(1, 2)
            at = torch.tensor([keys - 1])

            def ours():
                flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)

            def sdpa():
                kt.index_copy_(2, at, k_new.transpose(1, 2))
                vt.index_copy_(2, at, v_new.transpose(1, 2))
                F.scaled_dot_product_attention(qt, kt[:, :, :keys], vt[:, :, :keys], enable_gqa=True)

            calls = {"flash_attn_with_kvcache": ours, "index_copy_+sdpa_gqa": sdpa}
            samples = {n: [] for n in calls}
            names = list(calls)
            for rnd in range(args.reps + 1):
                for name in names[rnd % 2:] + names[:rnd % 2]:
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        calls[name]()
                    if rnd:
                        samples[name].append((time.perf_counter() - t0) / args.iters)
            med = {n: statistics.median(s) for n, s in samples.items()}
            for name in names:
                rows.append(dict(dtype=dname, keys=keys, contender=name, median_us=med[name] * 1e6,
                                 min_us=min(samples[name]) * 1e6,
                                 speedup_vs_sdpa=med["index_copy_+sdpa_gqa"] / med[name]))
    meta = dict(cpu=cpu_model(), threads=args.threads, loadavg_before=load_before, loadavg_after=loadavg())
    write_results(args.out, rows, meta)
    print(json.dumps(meta))
    for r in rows:
        print(f"{r['dtype']}  {r['keys']:5d}  {r['contender']:24s} {r['median_us']:8.1f} us  (min {r['min_us']:.1f})  "
              f"x{r['speedup_vs_sdpa']:.2f}")


if __name__ == "__main__":
    main()
