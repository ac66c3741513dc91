"""CPU benchmark: tileattn's CPU engine against PyTorch SDPA and naive attention.

    python benchmarks/bench_cpu.py                 # the whole grid (several minutes)
    python benchmarks/bench_cpu.py --only grid     # one section: grid, lowp, shapes, memory
    python benchmarks/bench_cpu.py --quick         # tiny sizes, seconds (used by the tests)

Every case is timed **interleaved**: after one warm-up call per provider, each repetition calls every
provider once in turn (round-robin, the starting provider rotating), so a noisy neighbour slows all
providers alike and the ratios stay meaningful even when absolute times drift. Reported per (case,
provider): median latency, spread ((max - min) / median), GFLOP/s of the useful work (visible (query, key) pairs; backward
counted as 2.5x forward), peak memory and the speed ratios vs SDPA and vs naive (> 1 = tileattn
faster).

Peak memory is the growth of the resident set (VmHWM - VmRSS before the call) of a fresh subprocess
that builds the inputs and makes exactly one call, so it sees every allocation torch makes (the
high-water mark is reset through /proc/self/clear_refs where the kernel allows it). It includes the
outputs and gradients; the ``extra_mib`` column subtracts them. Timing, statistics, the memory
reading and the machine description all come from :mod:`tileattn.measure`, as in ``tileattn bench``.

Results go to ``benchmarks/results/cpu_<tag>.csv`` and ``.json`` (tag ``full`` or ``quick``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import tileattn
from tileattn import measure
from tileattn.modifiers import Band

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROVIDERS = ("tileattn", "sdpa", "naive")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
FIELDS = ("section", "case", "dtype", "batch", "heads", "seqlen", "head_dim", "causal", "window",
          "mask", "mode", "provider", "reps", "median_ms", "min_ms", "spread_pct", "gflops",
          "peak_mib", "extra_mib", "vs_sdpa", "vs_naive")


@dataclass
class Case:
    section: str
    name: str
    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool = False
    window: int = 0  # > 0: each query sees itself and the window - 1 keys before it (causal band)
    block_mask: int = 0  # > 0: a bool mask hiding every other (block x block) tile, checkerboard
    mode: str = "fwd"  # "fwd" or "fwd+bwd"
    providers: tuple = PROVIDERS
    timed: bool = True  # False: memory only
    extra: dict = field(default_factory=dict)

    def flops(self) -> float:
        if self.window:
            left, right = self.window - 1, 0
        else:
            left, right = None, (0 if self.causal else None)
        band = Band(left, right) if (left, right) != (None, None) else None
        pairs = self.seqlen * self.seqlen if band is None else band.visible_pairs(self.seqlen, self.seqlen, 0)
        fwd = 4.0 * self.batch * self.heads * pairs * self.head_dim
        return fwd * (3.5 if self.mode == "fwd+bwd" else 1.0)


# ------------------------------------------------------------------------------------ providers


def make_tensors(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    dt = DTYPES[case.dtype]
    # Drawn in the target dtype: an fp32 staging copy, once freed, would stay resident and hide the
    # low-precision calls' own allocations from the peak-memory measurement.
    q, k, v = (torch.randn(shape, generator=gen, dtype=dt) for _ in range(3))
    mask = None
    if case.block_mask:
        n = math.ceil(case.seqlen / case.block_mask)
        tiles = (torch.arange(n)[:, None] + torch.arange(n)[None, :]) % 2 == 0
        mask = tiles.repeat_interleave(case.block_mask, 0).repeat_interleave(case.block_mask, 1)
        mask = mask[: case.seqlen, : case.seqlen].contiguous()
    elif case.window:
        i = torch.arange(case.seqlen)
        rel = i[None, :] - i[:, None]
        mask = (rel <= 0) & (rel > -case.window)
    dout = torch.randn(shape, generator=gen, dtype=dt) if case.mode == "fwd+bwd" else None
    return q, k, v, mask, dout


def attention_call(case: Case, provider: str, q, k, v, mask):
    """A zero-argument function computing the case's attention with ``provider``."""
    if provider == "tileattn":
        kw = dict(backend="cpu", causal=case.causal)
        if case.window:
            kw.update(window=(case.window - 1, 0), causal=True)
        elif mask is not None:
            kw.update(mask=mask)
        return lambda: tileattn.flash_attention(q, k, v, **kw)
    if provider == "sdpa":
        if mask is not None:
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    if provider == "naive":
        keep = mask
        if keep is None and case.causal:
            keep = torch.ones(case.seqlen, case.seqlen, dtype=torch.bool).tril_()
        scale = case.head_dim ** -0.5

        def naive():
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            return torch.matmul(torch.softmax(s, dim=-1), v)

        return naive
    raise ValueError(f"unknown provider {provider!r}; expected one of {PROVIDERS}")


def runner(case: Case, provider: str, seed: int = 0):
    """A zero-argument function making one timed call (forward, or forward and backward)."""
    q, k, v, mask, dout = make_tensors(case, seed)
    if case.mode == "fwd":
        call = attention_call(case, provider, q, k, v, mask)

        def fwd():
            with torch.no_grad():
                call()

        return fwd
    leaves = [t.requires_grad_() for t in (q, k, v)]
    call = attention_call(case, provider, *leaves, mask)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        call().backward(dout)

    return fwd_bwd


# ------------------------------------------------------------------------------------ measuring


def memory_child(case_json: str) -> None:
    """Subprocess body: one call of one provider; prints the resident-set growth in bytes."""
    spec = json.loads(case_json)
    provider = spec.pop("provider")
    case = Case(**spec)
    # Initialise the libraries (thread pools, MKL buffers) on a tiny problem first: they are not
    # the attention's memory.
    tiny = Case(**{**spec, "seqlen": 16, "block_mask": min(case.block_mask, 8),
                   "window": min(case.window, 8)})
    runner(tiny, provider)()
    print(json.dumps({"peak_bytes": measure.peak_memory(runner(case, provider))[1]}))


def measure_memory(case: Case, provider: str, timeout: float = 900.0):
    """Peak resident-set growth (MiB) of one call in a fresh process, or None if it failed."""
    spec = asdict(case)
    spec.pop("extra")
    spec["providers"] = list(spec["providers"])
    spec["provider"] = provider
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", json.dumps(spec)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        line = res.stdout.strip().splitlines()[-1]
        return json.loads(line)["peak_bytes"] / 2**20
    except (subprocess.SubprocessError, IndexError, ValueError, KeyError, TypeError):
        return None


def result_bytes(case: Case) -> int:
    """Bytes of what the call returns: out (and dq, dk, dv for forward+backward)."""
    n = case.batch * case.heads * case.seqlen * case.head_dim * DTYPES[case.dtype].itemsize
    return n * (4 if case.mode == "fwd+bwd" else 1)


def run_case(case: Case, reps: int, memory: bool) -> list:
    rows = []
    times = {}
    if case.timed:
        times = measure.time_interleaved({p: runner(case, p) for p in case.providers}, reps, warmup=1)
    med = {p: measure.median(t) for p, t in times.items()}
    for p in case.providers:
        row = {
            "section": case.section, "case": case.name, "dtype": case.dtype, "batch": case.batch,
            "heads": case.heads, "seqlen": case.seqlen, "head_dim": case.head_dim, "causal": case.causal,
            "window": case.window, "mask": "block-checkerboard" if case.block_mask else "",
            "mode": case.mode, "provider": p, "reps": len(times.get(p, [])),
            "median_ms": None, "min_ms": None, "spread_pct": None, "gflops": None,
            "peak_mib": None, "extra_mib": None, "vs_sdpa": None, "vs_naive": None,
        }
        if p in times:
            row.update(median_ms=med[p] * 1e3, min_ms=min(times[p]) * 1e3, spread_pct=measure.spread_pct(times[p]),
                       gflops=case.flops() / med[p] / 1e9)
            if "sdpa" in med:
                row["vs_sdpa"] = med["sdpa"] / med[p]
            if "naive" in med:
                row["vs_naive"] = med["naive"] / med[p]
        if memory:
            peak = measure_memory(case, p)
            if peak is not None:
                row["peak_mib"] = peak
                row["extra_mib"] = peak - result_bytes(case) / 2**20
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ the grid


def cases(quick: bool, sections) -> list:
    out = []

    def add(section, *args, **kw):
        if section in sections:
            out.append(Case(section, *args, **kw))

    if quick:
        for mode in ("fwd", "fwd+bwd"):
            add("grid", "quick", "fp32", 1, 2, 256, 32, causal=True, mode=mode)
        add("lowp", "quick-fp16", "fp16", 1, 2, 256, 32, mode="fwd")
        add("shapes", "quick-mask", "fp32", 1, 2, 256, 32, block_mask=64, mode="fwd")
        add("memory", "quick-memory", "fp32", 1, 1, 512, 32, mode="fwd+bwd", providers=("tileattn",),
            timed=False)
        return out
    for mode in ("fwd", "fwd+bwd"):
        for s in (1024, 4096):
            for d in (64, 128):
                for causal in (False, True):
                    add("grid", "fp32-grid", "fp32", 1, 8, s, d, causal=causal, mode=mode)
    for mode in ("fwd", "fwd+bwd"):
        for dt in ("bf16", "fp16"):
            add("lowp", "lowp-2048", dt, 1, 8, 2048, 128, mode=mode)
    for dt in ("fp32", "bf16", "fp16"):
        add("lowp", "vs-naive-4096", dt, 1, 8, 4096, 64, mode="fwd")
    # Issue #3: causal takes about half of dense; a window's time scales with the window; a bool
    # block mask hiding half the tiles takes about half. Naive would need 1 GiB of scores per head
    # group here and is left out.
    big = dict(providers=("tileattn", "sdpa"))
    add("shapes", "dense-8192", "fp32", 1, 4, 8192, 64, mode="fwd", **big)
    add("shapes", "causal-8192", "fp32", 1, 4, 8192, 64, causal=True, mode="fwd", **big)
    add("shapes", "window512-8192", "fp32", 1, 4, 8192, 64, window=512, mode="fwd", **big)
    add("shapes", "window2048-8192", "fp32", 1, 4, 8192, 64, window=2048, mode="fwd", **big)
    add("shapes", "blockmask-half-8192", "fp32", 1, 4, 8192, 64, block_mask=256, mode="fwd", **big)
    add("memory", "memory-16384", "fp32", 1, 1, 16384, 64, mode="fwd+bwd", providers=("tileattn", "sdpa"),
        timed=False)
    return out


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rows: list) -> None:
    head = (f"{'case':<20} {'dtype':<5} {'S':>6} {'D':>4} {'caus':>4} {'mode':<8} {'provider':<9} "
            f"{'median ms':>10} {'spread':>7} {'GFLOP/s':>8} {'peak MiB':>9} {'extra':>7} {'vs sdpa':>8} "
            f"{'vs naive':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        causal = "y" if r["causal"] else "n"
        print(f"{r['case']:<20} {r['dtype']:<5} {r['seqlen']:>6} {r['head_dim']:>4} {causal:>4} "
              f"{r['mode']:<8} {r['provider']:<9} {fmt(r['median_ms'], '10.2f')} "
              f"{fmt(r['spread_pct'], '6.1f')}% "
              f"{fmt(r['gflops'], '8.1f')} {fmt(r['peak_mib'], '9.1f')} {fmt(r['extra_mib'], '7.1f')} "
              f"{fmt(r['vs_sdpa'], '8.2f')} "
              f"{fmt(r['vs_naive'], '8.2f')}", flush=True)


def summary(rows: list) -> dict:
    """Geometric means of tileattn's speed ratios per section and mode (the targets' terms)."""
    groups = {}
    for r in rows:
        if r["provider"] != "tileattn" or r["vs_sdpa"] is None:
            continue
        key = f"{r['section']}/{r['dtype']}/{r['mode']}"
        groups.setdefault(key, []).append(r["vs_sdpa"])
    return {k: math.exp(sum(math.log(x) for x in v) / len(v)) for k, v in groups.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--only", default="grid,lowp,shapes,memory",
                        help="comma-separated sections: grid, lowp, shapes, memory")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per provider")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the per-row memory subprocesses (the memory section still runs)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--tag", default=None, help="output file stem suffix (default: full/quick)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child)
        return 0
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - {"grid", "lowp", "shapes", "memory"}
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; expected grid, lowp, shapes, memory")
    reps = args.reps or (3 if args.quick else 5)
    tag = args.tag or ("quick" if args.quick else "full")
    rows = []
    started = time.time()
    for case in cases(args.quick, sections):
        # The memory section always measures memory; the others do in full runs (one subprocess per
        # row, which --quick skips to stay within seconds).
        per_row_memory = not (args.no_memory or args.quick)
        case_rows = run_case(case, reps, memory=per_row_memory or case.section == "memory")
        print_table(case_rows)
        rows.extend(case_rows)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"cpu_{tag}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    meta = {
        "machine": measure.cpu_model(), "cpu_count": measure.usable_cores(), "simd": measure.cpu_flags(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "reps": reps,
        "seconds": round(time.time() - started, 1),
        "geomean_vs_sdpa": summary(rows),
    }
    with open(out_dir / f"cpu_{tag}.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("geometric mean speed-up vs SDPA:", json.dumps(meta["geomean_vs_sdpa"], indent=1))
    print(f"wrote {out_dir / f'cpu_{tag}.csv'} and .json in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
