"""FlexAttention on CPU: tileattn.flex_attention against compiled PyTorch Flex, tileattn's built-in
modifiers and SDPA with a dense mask, one interleaved run per pattern (issue 24's targets).

    python benchmarks/bench_flex.py                 # S 4096, H 8, D 64, fp32 (the issue's shape)
    python benchmarks/bench_flex.py --small         # a CI-size run (seconds)
    python benchmarks/bench_flex.py --memory 32768  # also: peak extra memory of a document mask, fwd+bwd
    python benchmarks/bench_flex.py --threads 1     # one thread for every contender (a loaded machine)

Per pattern, forward: ``flex`` (tileattn.flex_attention), ``torch_flex`` (torch.compile(PyTorch's
flex_attention); compiled once, before timing), ``builtin`` (tileattn.flash_attention with the
equivalent built-in modifier: window=, alibi_slopes=, softcap=, or a dense bool mask), ``sdpa_mask``
(SDPA with the dense mask, mask-only patterns). Forward+backward (PyTorch's CPU Flex has none):
``flex`` and ``sdpa_mask``. Also the first call of a never-seen score_mod (trace + C build) and of a
seen one. Writes ``<out>.csv`` / ``<out>.json`` (default ``benchmarks/results/flex``). Timings are
medians of round-robin repetitions (:func:`tileattn.tools.measure.time_interleaved`) with their spread.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import tileattn
from tileattn.flex import create_block_mask, examples
from tileattn.flex.blocks import classify
from tileattn.tools.measure import cpu_flags, cpu_model, median, peak_memory, spread_pct, time_interleaved

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["pattern", "kind", "pass", "contender", "median_ms", "spread_pct", "ratio_vs_flex"]


def patterns(length: int, heads: int):
    """name -> (kind, mask_mod, score_mod, built-in keywords of tileattn.flash_attention or None)."""
    docs = torch.arange(length) * 5 // length
    window, prefix = min(256, length // 4), min(1024, length // 4)
    table = torch.randn(heads, 2 * length - 1) * 0.1
    return {
        "document_causal": ("mask", examples.document(docs), None, None),
        "sliding_window": ("mask", examples.sliding_window(window), None, {"window": (window, 0)}),
        "prefix_lm": ("mask", examples.prefix_lm(prefix), None, None),
        "alibi": ("score", None, examples.alibi(heads), {"alibi_slopes": _alibi_slopes(heads), "align": "top_left"}),
        "softcap": ("score", None, examples.softcap(20.0), {"softcap": 20.0}),
        "relative_bias": ("score", None, examples.relative_bias(table, length), None),
    }


def _alibi_slopes(heads):
    """The slopes of examples.alibi as tileattn's ALiBi takes them (it subtracts slope * |i - j|; the
    example adds slope * (j - i), the same under no mask only where j <= i: so the comparison is of
    speed, with equal work)."""
    return torch.exp2(-(torch.arange(heads, dtype=torch.float32) + 1) * 8.0 / heads)


def dense_mask(mask_mod, length):
    q = torch.arange(length)[:, None]
    return mask_mod(torch.zeros(()), torch.zeros(()), q, torch.arange(length)[None, :])


def run(args):
    torch.manual_seed(0)
    length, heads, dim = args.seq, args.heads, args.dim
    q, k, v = (torch.randn(1, heads, length, dim) for _ in range(3))
    compiled_flex = torch.compile(torch_flex_attention)
    rows = []
    for name, (kind, mask_mod, score_mod, builtin) in patterns(length, heads).items():
        block_mask = create_block_mask(mask_mod, None, None, length, length) if mask_mod else None
        counts = classify(block_mask, 1, heads).counts() if block_mask else None
        forward = {
            "flex": lambda: tileattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask),
            "torch_flex": lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
        }
        dense = dense_mask(mask_mod, length) if mask_mod else None
        if builtin is not None:
            forward["builtin"] = lambda: tileattn.flash_attention(q, k, v, **builtin)
        elif dense is not None:
            forward["builtin"] = lambda: tileattn.flash_attention(q, k, v, mask=dense)
        if dense is not None:
            forward["sdpa_mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        for contender, fn in list(forward.items()):
            try:
                fn()  # compiles PyTorch's flex and builds tileattn's programs before timing
            except Exception as exc:  # noqa: BLE001 - a contender that cannot run this pattern is reported
                print(f"{name:16s} {contender}: cannot run ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
                rows.append(dict(pattern=name, kind=kind, contender=contender, median_ms=None, spread_pct=None,
                                 ratio_vs_flex=None, **{"pass": "forward: " + type(exc).__name__}))
                del forward[contender]
        rows += _rows(name, kind, "forward", time_interleaved(forward, args.reps, args.warmup))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        both = {"flex": lambda: tileattn.flex_attention(*leaves, score_mod=score_mod,
                                                         block_mask=block_mask).sum().backward()}
        if dense is not None:
            both["sdpa_mask"] = lambda: F.scaled_dot_product_attention(*leaves, attn_mask=dense).sum().backward()
        rows += _rows(name, kind, "forward+backward", time_interleaved(both, args.reps, args.warmup))
        if counts:
            print(f"  {name}: blocks {counts}", flush=True)
    first = _first_calls(q, k, v)
    memory = _memory(args.memory, dim) if args.memory else None
    return rows, first, memory


def _rows(name, kind, what, samples):
    flex = median(samples["flex"])
    found = []
    for contender, times in samples.items():
        row = dict(pattern=name, kind=kind, contender=contender, median_ms=1e3 * median(times),
                   spread_pct=spread_pct(times), ratio_vs_flex=median(times) / flex)
        row["pass"] = what
        found.append(row)
        print(f"{name:16s} {what:17s} {contender:10s} {row['median_ms']:9.1f} ms  x{row['ratio_vs_flex']:.2f} "
              f"of flex (spread {row['spread_pct'] or 0:.0f}%)", flush=True)
    return found


def _first_calls(q, k, v):
    """Seconds of the first call of a score_mod never seen (its constant makes new code: trace and C
    build, or a disk hit when an earlier run built it), and of a second closure of the same code."""
    cap = 10.0 + random.random()  # a new constant: new code, so the first call traces and builds

    def make(c):
        def capped(score, b, h, q_idx, kv_idx):
            return c * torch.tanh(score / c) + (kv_idx - q_idx) * 0.01
        return capped

    small = [t[:, :, :256] for t in (q, k, v)]
    start = time.perf_counter()
    tileattn.flex_attention(*small, score_mod=make(cap))
    first = time.perf_counter() - start
    start = time.perf_counter()
    tileattn.flex_attention(*small, score_mod=make(cap))
    again = time.perf_counter() - start
    print(f"first call of a new score_mod {first:.2f} s; a new closure of it {1e3 * again:.1f} ms", flush=True)
    return {"first_call_s": first, "new_closure_s": again}


def _memory(length, dim):
    docs = torch.arange(length) * 5 // length
    block_mask = create_block_mask(examples.document(docs), None, None, length, length)
    q, k, v = (torch.randn(1, 1, length, dim, requires_grad=True) for _ in range(3))
    inputs = 3 * q.numel() * 4

    def step():
        tileattn.flex_attention(q, k, v, block_mask=block_mask).sum().backward()

    _, peak = peak_memory(step)
    print(f"S {length} document mask, H 1, D {dim}, fwd+bwd: peak extra {peak / 2**20:.0f} MiB "
          f"(inputs {inputs / 2**20:.0f} MiB, their gradients as much again)", flush=True)
    return {"seq": length, "heads": 1, "dim": dim, "peak_extra_mib": peak / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--memory", type=int, default=0, help="sequence length of the memory check (0: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for every contender (0: torch's)")
    parser.add_argument("--small", action="store_true", help="S 256, H 2, 2 repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS / "flex")
    args = parser.parse_args(argv)
    if args.small:
        args.seq, args.heads, args.reps = 256, 2, 2
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, first, memory = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    meta = dict(cpu=cpu_model(), amx="amx_tile" in cpu_flags(), threads=torch.get_num_threads(), seq=args.seq,
                heads=args.heads, dim=args.dim, dtype="fp32", reps=args.reps, first_calls=first, memory=memory)
    args.out.with_suffix(".json").write_text(json.dumps(dict(meta, results=rows), indent=1, default=str) + "\n")
    print(f"results written to {args.out.with_suffix('.csv')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
