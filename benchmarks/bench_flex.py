"""Programmable attention on CPU: user functions in the native kernels, against compiled PyTorch Flex,
against the keywords they spell, forward and backward, at decode, and in memory (issue 33's targets).

    python benchmarks/bench_flex.py                     # S 4096, H 8, D 64, fp32 and bf16
    python benchmarks/bench_flex.py --small             # a CI-size run (seconds)
    python benchmarks/bench_flex.py --memory 32768      # also: peak extra memory of a document mask, fwd+bwd
    python benchmarks/bench_flex.py --threads 1         # one thread for every contender (a loaded machine)

Per pattern and dtype, forward: ``flex`` (tileattn.flex_attention, one flash_attention call with the
compiled functions in the native tiles), ``torch_flex`` (torch.compile(PyTorch's flex_attention),
compiled before timing; its eager form where compiling fails) and ``keyword`` (tileattn.flash_attention
with the built-in the function spells: causal=, window=, alibi_slopes=, softcap=, where one exists).
Forward+backward of ``flex`` (PyTorch's CPU Flex has none), for the backward/forward ratio. Decode:
one query row per sequence against a paged cache with a score_mod, against the same call without it.
Writes ``<out>.csv`` / ``<out>.json`` (default ``benchmarks/results/flex``) with the CPU, whether AMX
is exposed, the threads and the load average. Timings are medians of round-robin repetitions
(:func:`tileattn.tools.measure.time_interleaved`) with their spread; ratios are against ``flex``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import tileattn
from tileattn.flex import create_block_mask, examples
from tileattn.tools.measure import cpu_flags, cpu_model, median, peak_memory, spread_pct, time_interleaved

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["pattern", "dtype", "pass", "contender", "median_ms", "spread_pct", "ratio_vs_flex"]


def patterns(length: int, heads: int):
    """name -> (mask_mod, score_mod, keywords of the built-in tileattn.flash_attention call or None).
    Every call is FlexAttention's: q_idx is the row (align="top_left" for the keywords)."""
    docs = torch.arange(length) * 5 // length
    window, prefix = min(256, length // 4), min(1024, length // 4)
    slopes = torch.exp2(-(torch.arange(heads, dtype=torch.float32) + 1) * 8.0 / heads)
    table = torch.randn(heads, 2 * length - 1) * 0.1
    t5 = torch.randn(8, heads) * 0.1

    def alibi(score, b, h, q_idx, kv_idx):  # the keyword's own form: -slope * |i - j|
        return score - slopes[h] * (q_idx - kv_idx).abs()

    top_left = {"align": "top_left"}
    return {
        "document_causal": (examples.document(docs), None, None),
        "causal": (examples.causal, None, dict(top_left, causal=True)),
        "sliding_window": (examples.sliding_window(window), None, dict(top_left, window=(window, 0))),
        "prefix_lm": (examples.prefix_lm(prefix), None, None),
        "alibi": (None, alibi, dict(top_left, alibi_slopes=slopes)),
        "relative_bias": (None, examples.relative_bias(table, length), None),
        "t5_bias": (None, examples.t5_bias(t5), None),
        "softcap": (None, examples.softcap(20.0), {"softcap": 20.0}),
    }


def run(args):
    torch.manual_seed(0)
    length, heads, dim = args.seq, args.heads, args.dim
    rows = []
    for dtype in args.dtypes:
        q, k, v = (torch.randn(1, heads, length, dim).to(dtype) for _ in range(3))
        for name, (mask_mod, score_mod, keywords) in patterns(length, heads).items():
            torch._dynamo.reset()  # each pattern gets its own compiled Flex (no recompile limit reached)
            compiled_flex = torch.compile(torch_flex_attention)
            block_mask = create_block_mask(mask_mod, None, None, length, length) if mask_mod else None
            forward = {
                "flex": lambda: tileattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask),
                "torch_flex": lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
            }
            if keywords is not None:
                forward["keyword"] = lambda: tileattn.flash_attention(q, k, v, **keywords)
            for contender, fn in list(forward.items()):
                try:
                    fn()  # compiles PyTorch's flex and builds tileattn's programs before timing
                except Exception as exc:  # noqa: BLE001 - a contender that cannot run is reported, then its eager form
                    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                    if contender != "torch_flex":
                        raise
                    print(f"{name:16s} torch.compile(flex) failed ({why}); timing its eager form", flush=True)
                    forward[contender] = lambda: torch_flex_attention(q, k, v, score_mod=score_mod,
                                                                      block_mask=block_mask)
            rows += _rows(name, dtype, "forward", time_interleaved(forward, args.reps, args.warmup))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            both = {"flex": lambda: tileattn.flex_attention(*leaves, score_mod=score_mod,
                                                             block_mask=block_mask).sum().backward()}
            if keywords is not None:
                both["keyword"] = lambda: tileattn.flash_attention(*leaves, **keywords).sum().backward()
            rows += _rows(name, dtype, "forward+backward", time_interleaved(both, args.reps, args.warmup))
        rows += _decode(args, dtype)
    memory = _memory(args.memory, dim) if args.memory else None
    return rows, memory


def _rows(name, dtype, what, samples):
    flex = median(samples["flex"])
    found = []
    for contender, times in samples.items():
        row = dict(pattern=name, dtype=str(dtype).replace("torch.", ""), contender=contender,
                   median_ms=1e3 * median(times), spread_pct=spread_pct(times), ratio_vs_flex=median(times) / flex)
        row["pass"] = what
        found.append(row)
        print(f"{name:16s} {row['dtype']:8s} {what:17s} {contender:10s} {row['median_ms']:9.2f} ms  "
              f"x{row['ratio_vs_flex']:.2f} of flex (spread {row['spread_pct'] or 0:.0f}%)", flush=True)
    return found


def _decode(args, dtype):
    """Decode with a score_mod over a paged cache against the same decode without it."""
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, dim, keys, page = 4, args.heads, max(1, args.heads // 4), 128, args.decode_keys, 16
    q = torch.randn(batch, heads, 1, dim, generator=gen).to(dtype)
    pages = batch * keys // page
    pool_k, pool_v = (torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(pages, generator=gen).view(batch, keys // page).to(torch.int32)
    used = torch.full((batch,), keys, dtype=torch.int32)
    slopes = torch.rand(heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    calls = {"flex": lambda: tileattn.flash_attention(q, pool_k, pool_v, block_table=table, seqused_k=used,
                                                      score_mod=alibi),
             "plain": lambda: tileattn.flash_attention(q, pool_k, pool_v, block_table=table, seqused_k=used)}
    return _rows(f"decode_{keys}", dtype, "forward", time_interleaved(calls, 5 * args.reps, args.warmup))


def _memory(length, dim):
    docs = torch.arange(length) * 5 // length
    block_mask = create_block_mask(examples.document(docs), None, None, length, length)
    q, k, v = (torch.randn(1, 1, length, dim, requires_grad=True) for _ in range(3))
    inputs = 3 * q.numel() * 4

    def step():
        tileattn.flex_attention(q, k, v, block_mask=block_mask).sum().backward()

    step()  # programs built, buffers grown: what is measured is a step in steady state
    for t in (q, k, v):
        t.grad = None
    _, peak = peak_memory(step)
    print(f"S {length} document mask, H 1, D {dim}, fwd+bwd: peak extra {peak / 2**20:.0f} MiB "
          f"(inputs {inputs / 2**20:.0f} MiB, their gradients as much again)", flush=True)
    return {"seq": length, "heads": 1, "dim": dim, "peak_extra_mib": peak / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--decode-keys", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--memory", type=int, default=0, help="sequence length of the memory check (0: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for every contender (0: torch's)")
    parser.add_argument("--small", action="store_true", help="S 256, H 2, 2 repetitions, 512 decode keys")
    parser.add_argument("--out", type=Path, default=RESULTS / "flex")
    args = parser.parse_args(argv)
    if args.small:
        args.seq, args.heads, args.reps, args.decode_keys = 256, 2, 2, 512
    args.dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16],
                   "both": [torch.float32, torch.bfloat16]}[args.dtype]
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    rows, memory = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    meta = dict(cpu=cpu_model(), amx="amx_tile" in cpu_flags(), threads=torch.get_num_threads(), seq=args.seq,
                heads=args.heads, dim=args.dim, reps=args.reps, load_before=load, load_after=os.getloadavg()[0],
                memory=memory)
    args.out.with_suffix(".json").write_text(json.dumps(dict(meta, results=rows), indent=1, default=str) + "\n")
    print(f"load average {load:.2f} before, {meta['load_after']:.2f} after; results written to "
          f"{args.out.with_suffix('.csv')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
