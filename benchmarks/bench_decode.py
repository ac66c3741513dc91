"""Decode benchmark: one query token per sequence against a KV cache, tileattn vs SDPA and naive.

    python benchmarks/bench_decode.py              # B {1,8,32} x cache {1k..32k}, Hq/Hkv 32/8, D 128, fp32+bf16
    python benchmarks/bench_decode.py --small      # a CI-size grid (seconds)
    python benchmarks/bench_decode.py --overhead   # per-call overhead of a decode-sized call, layer by layer
    python benchmarks/bench_decode.py --small-calls  # B=1, 8/2 heads, D 64, 128-1024 keys: lean vs full path vs SDPA

Writes ``<out>.csv`` and ``<out>.json`` (default ``benchmarks/results/decode`` or
``decode_overhead``) and, with ``--plot``, a PNG. What each contender is (tileattn as dispatch runs
it with ``seqused_k``; SDPA with the K/V repeat inside or outside the timed region; SDPA with
``enable_gqa``; naive) and why K/V GB/s is the figure to read: :mod:`tileattn.tools.decode_bench`.
Shapes whose K/V exceed the memory budget (a fraction of the memory available at the start) are
skipped and say so; a contender whose repeated K/V copy would not fit is skipped alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import torch

from tileattn.tools import decode_bench as D
from tileattn.tools.measure import cpu_model, memory_bandwidth, usable_cores

RESULTS = Path(__file__).resolve().parent / "results"
FULL = dict(batches=[1, 8, 32], caches=[1024, 4096, 8192, 16384, 32768], dtypes=["fp32", "bf16"], heads_q=32,
            heads_kv=8, head_dim=128, reps=5, warmup=1)
SMALL = dict(batches=[1, 2], caches=[256, 1024], dtypes=["fp32", "bf16"], heads_q=8, heads_kv=2, head_dim=64, reps=2,
             warmup=1)
#: Calls of a few microseconds (issue 23's targets): the lean path, the full path and SDPA with GQA,
#: each sample the mean of 20 back-to-back calls.
SMALL_CALLS = dict(batches=[1], caches=[128, 512, 1024], dtypes=["fp32", "bf16"], heads_q=8, heads_kv=2, head_dim=64,
                   reps=101, warmup=5, iters=20, providers=["tileattn", "tileattn_full", "sdpa_gqa"])
OVERHEAD_FIELDS = ["layer", "cache", "dtype", "median_us", "min_us", "spread_pct"]


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CI-size grid")
    p.add_argument("--overhead", action="store_true", help="per-call overhead breakdown instead of the grid")
    p.add_argument("--small-calls", action="store_true", help="decode calls of a few microseconds (B=1, 8/2 heads, "
                   "D 64, 128-1024 keys): tileattn's lean and full paths vs SDPA")
    p.add_argument("--batches", type=_ints, help="comma-separated batch sizes")
    p.add_argument("--caches", type=_ints, help="comma-separated cache lengths")
    p.add_argument("--dtypes", help="comma-separated subset of fp32, bf16, fp16")
    p.add_argument("--providers", help=f"comma-separated subset of {', '.join(D.PROVIDERS)}")
    p.add_argument("--reps", type=int, help="timed repetitions per contender and shape")
    p.add_argument("--warmup", type=int, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=usable_cores(), help="torch threads (default: every usable core)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall time, or this thread's CPU time (with --threads 1 on a shared machine)")
    p.add_argument("--memory-fraction", type=float, default=0.4, help="share of available memory the run may hold")
    p.add_argument("--out", help="output path without suffix (default benchmarks/results/decode[_overhead])")
    p.add_argument("--plot", action="store_true", help="also write <out>.png (needs matplotlib)")
    args = p.parse_args(argv)
    settings = dict(SMALL_CALLS if args.small_calls else SMALL if args.small else FULL)
    settings.setdefault("iters", 1)
    for name in ("batches", "caches", "reps", "warmup"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.dtypes:
        settings["dtypes"] = args.dtypes.split(",")
    unknown = [d for d in settings["dtypes"] if d not in D.DTYPES]
    if unknown:
        p.error(f"--dtypes: unknown {unknown}; expected a subset of {', '.join(D.DTYPES)}")
    settings["providers"] = args.providers.split(",") if args.providers else settings.get("providers",
                                                                                           list(D.PROVIDERS))
    if "tileattn" not in settings["providers"] or not set(settings["providers"]) <= set(D.PROVIDERS):
        p.error(f"--providers: expected tileattn and a subset of {', '.join(D.PROVIDERS)}")
    return args, settings


def _clock(args):
    if args.clock == "thread" and args.threads != 1:
        raise SystemExit("--clock thread counts one thread's CPU time: use it with --threads 1")
    return time.thread_time if args.clock == "thread" else time.perf_counter


def _fmt(x, digits=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def render(rows) -> str:
    head = ["dtype", "B", "cache", "provider", "median ms", "spread", "tok/s", "KV GB/s", "% BW", "vs sdpa_repeat",
            "vs sdpa_gqa", "vs tileattn_full", "note"]
    lines = [head]
    for r in rows:
        lines.append([r["dtype"], str(r["batch"]), str(r["cache"]), r["provider"] + (f" ({r['engine']})" if r["engine"] else ""),
                      _fmt(r.get("median_ms")), "-" if r.get("spread_pct") is None else f"{r['spread_pct']:.0f}%",
                      _fmt(r.get("tokens_per_s")), _fmt(r.get("kv_gb_per_s")), _fmt(r.get("pct_bandwidth"), 2),
                      _fmt(r.get("vs_sdpa_repeat")), _fmt(r.get("vs_sdpa_gqa")), _fmt(r.get("vs_tileattn_full")),
                      "" if r["status"] == "ok" else f"{r['status']}: {r['note']}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def summary(rows) -> list:
    """Target lines: tileattn vs SDPA at every shape, geomean at B=1 with caches >= 8k, % bandwidth."""
    ours = [r for r in rows if r["provider"] == "tileattn" and r.get("median_ms")]
    lines = []
    for ref in ("sdpa_repeat", "sdpa_gqa"):
        ratios = [r[f"vs_{ref}"] for r in ours if r.get(f"vs_{ref}")]
        if ratios:
            long_b1 = [r[f"vs_{ref}"] for r in ours if r.get(f"vs_{ref}") and r["batch"] == 1 and r["cache"] >= 8192]
            geo = math.exp(sum(map(math.log, long_b1)) / len(long_b1)) if long_b1 else None
            lines.append(f"tileattn vs {ref}: min {min(ratios):.2f}x over {len(ratios)} shapes"
                         + (f"; geomean at B=1, cache >= 8k: {geo:.2f}x" if geo else ""))
    long = [r["pct_bandwidth"] for r in ours if r["cache"] >= 8192]
    if long:
        lines.append(f"tileattn at cache >= 8k: {min(long):.0f}%..{max(long):.0f}% of measured bandwidth "
                     f"(median {sorted(long)[len(long) // 2]:.0f}%)")
    return lines


def _write(out: Path, rows, fields, meta):
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".json").write_text(json.dumps(dict(meta, results=rows), indent=1, default=str) + "\n")


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (dtype, batch) in zip(axes[0], panels):
        for name in dict.fromkeys(r["provider"] for r in rows):
            pts = sorted((r["cache"], r["kv_gb_per_s"]) for r in rows
                         if (r["dtype"], r["batch"], r["provider"]) == (dtype, batch, name) and r.get("kv_gb_per_s"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.axhline(rows[0]["bandwidth_gb_per_s"], color="grey", linestyle="--", label="measured bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype}, B={batch}")
        ax.set_xlabel("cached keys")
        ax.set_ylabel("K/V GB/s")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args, s = parse_args(argv)
    meta = dict(cpu=cpu_model(), threads=args.threads, clock=args.clock, torch=torch.__version__,
                bandwidth_gb_per_s=memory_bandwidth(args.threads))
    if args.overhead:
        out = Path(args.out) if args.out else RESULTS / "decode_overhead"
        torch.set_num_threads(args.threads)
        rows = [row for dtype in (torch.float32, torch.bfloat16) for cache in (128, 4096)
                for row in D.overhead(cache=cache, iters=200 if args.small else 2000, reps=3 if args.small else 7,
                                      dtype=dtype, clock=_clock(args))]
        for r in rows:
            print(f"{r['dtype']} cache {r['cache']:5d}  {r['layer']:62s} {r['median_us']:10.1f} us  "
                  f"(min {r['min_us']:.1f}, spread {r['spread_pct']:.0f}%)")
        _write(out, rows, OVERHEAD_FIELDS, meta)
        return rows
    out = Path(args.out) if args.out else RESULTS / ("decode_small_calls" if args.small_calls else
                                                     "decode_small" if args.small else "decode")
    cases = D.grid(s["batches"], s["caches"], s["dtypes"], s["heads_q"], s["heads_kv"], s["head_dim"])
    rows = D.run_grid(cases, s["providers"], s["reps"], s["warmup"],
                      budget_bytes=D.memory_budget(args.memory_fraction), threads=args.threads, iters=s["iters"],
                      clock=_clock(args),
                      on_case=lambda c: print(f"{c.dtype_name} B={c.batch} cache={c.cache}", file=sys.stderr))
    print(f"decode: Hq/Hkv {s['heads_q']}/{s['heads_kv']}, D {s['head_dim']}, {s['reps']} reps (+{s['warmup']}), "
          f"{args.threads} threads, {meta['cpu']}, measured bandwidth {meta['bandwidth_gb_per_s']:.1f} GB/s")
    print(render(rows))
    lines = summary(rows)
    print("\n".join(lines))
    _write(out, rows, D.FIELDS, dict(meta, settings=s, summary=lines))
    if args.plot:
        plot(rows, out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
