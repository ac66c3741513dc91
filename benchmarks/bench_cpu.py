"""CPU benchmark: tileattn's two CPU engines against PyTorch SDPA and naive attention.

    python benchmarks/bench_cpu.py                 # the whole grid (tens of minutes)
    python benchmarks/bench_cpu.py --only grid     # some sections: grid, lowp, shapes, decode, memory
    python benchmarks/bench_cpu.py --quick         # tiny sizes, seconds (used by the tests)

Providers: ``native`` (the C kernels, ``backend="native"``), ``cpu`` (the PyTorch-ops engine, the
fallback), ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``), ``naive``
(matmul-softmax-matmul in the input dtype) and, in the decode section, ``tileattn`` (a plain
``tileattn.flash_attention`` call: what dispatch picks, the whole call including Python).

Every case is timed **interleaved**: after one warm-up call per provider, each repetition calls every
provider once in turn (round-robin, the starting provider rotating), so a noisy neighbour slows all
providers alike and the ratios stay meaningful even when absolute times drift. Decode steps (tens of
microseconds) are timed as the mean of a few hundred back-to-back calls per sample. Reported per
(case, provider): median latency, spread ((max - min) / median), GFLOP/s of the useful work (visible
(query, key) pairs; backward counted as 2.5x forward) and its share of the machine's measured fp32
FMA peak (threads x the one-core probe of the native library), peak memory and the speed ratios vs
SDPA and vs naive (> 1 = faster than them).

Peak memory is the growth of the resident set (VmHWM - VmRSS before the call) of a fresh subprocess
that builds the inputs and makes exactly one call, so it sees every allocation torch makes (the
high-water mark is reset through /proc/self/clear_refs where the kernel allows it). It includes the
outputs and gradients; the ``extra_mib`` column subtracts them. Timing, statistics, the memory
reading and the machine description all come from :mod:`tileattn.tools.measure`, as in ``tileattn bench``.

Results go to ``benchmarks/results/cpu_<tag>.csv`` and ``.json`` (tag ``full`` or ``quick``); the
JSON's ``meta`` holds the machine, the native build, the FMA peaks, the load average before and after,
and the geometric means of each engine's ratio to SDPA per section, dtype and mode.
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
from tileattn.tools import measure
from tileattn.backends.native import kernels as native_kernels
from tileattn.core.modifiers import Band

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: tileattn's engines, each forced by name: the C kernels and the PyTorch-ops fallback
ENGINES = ("native", "cpu")
PROVIDERS = ENGINES + ("sdpa", "naive")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
FIELDS = ("section", "case", "dtype", "batch", "heads", "heads_kv", "seqlen_q", "seqlen", "head_dim", "causal",
          "window", "mask", "mode", "provider", "reps", "median_ms", "min_ms", "spread_pct", "gflops", "pct_peak",
          "peak_mib", "extra_mib", "vs_sdpa", "vs_naive")
#: decode steps: back-to-back calls per timed sample
DECODE_ITERS = 300


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
    heads_kv: int = 0  # 0: as many as query heads; fewer: GQA
    seqlen_q: int = 0  # 0: seqlen (self-attention); 1: a decode step against seqlen cached keys
    extra: dict = field(default_factory=dict)

    @property
    def kv_heads(self) -> int:
        return self.heads_kv or self.heads

    @property
    def q_len(self) -> int:
        return self.seqlen_q or self.seqlen

    def flops(self) -> float:
        if self.window:
            left, right = self.window - 1, 0
        else:
            left, right = None, (0 if self.causal else None)
        band = Band(left, right) if (left, right) != (None, None) else None
        pairs = self.q_len * self.seqlen if band is None else band.visible_pairs(self.q_len, self.seqlen, 0)
        fwd = 4.0 * self.batch * self.heads * pairs * self.head_dim
        return fwd * (3.5 if self.mode == "fwd+bwd" else 1.0)


# ------------------------------------------------------------------------------------ providers


def make_tensors(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.heads, case.q_len, case.head_dim)
    kv_shape = (case.batch, case.kv_heads, case.seqlen, case.head_dim)
    dt = DTYPES[case.dtype]
    # Drawn in the target dtype: an fp32 staging copy, once freed, would stay resident and hide the
    # low-precision calls' own allocations from the peak-memory measurement.
    q = torch.randn(shape, generator=gen, dtype=dt)
    k, v = (torch.randn(kv_shape, generator=gen, dtype=dt) for _ in range(2))
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
    if provider in ENGINES or provider == "tileattn":
        kw = dict(causal=case.causal) if provider == "tileattn" else dict(backend=provider, causal=case.causal)
        if case.window:
            kw.update(window=(case.window - 1, 0), causal=True)
        elif mask is not None:
            kw.update(mask=mask)
        return lambda: tileattn.flash_attention(q, k, v, **kw)
    if provider == "sdpa":
        gqa = case.kv_heads != case.heads
        if mask is not None:
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)
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
    raise ValueError(f"unknown provider {provider!r}; expected tileattn or one of {PROVIDERS}")


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
    item = DTYPES[case.dtype].itemsize
    n = case.batch * case.heads * case.q_len * case.head_dim * item
    if case.mode != "fwd+bwd":
        return n
    return 2 * n + 2 * case.batch * case.kv_heads * case.seqlen * case.head_dim * item


def run_case(case: Case, reps: int, memory: bool, peak_gflops=None) -> list:
    """One row per provider; ``peak_gflops``: the machine's fp32 FMA peak, for ``pct_peak``."""
    rows = []
    times = {}
    if case.timed:
        iters = DECODE_ITERS if case.section == "decode" else 1
        times = measure.time_interleaved({p: runner(case, p) for p in case.providers}, reps, warmup=1, iters=iters)
    med = {p: measure.median(t) for p, t in times.items()}
    for p in case.providers:
        row = {
            "section": case.section, "case": case.name, "dtype": case.dtype, "batch": case.batch,
            "heads": case.heads, "heads_kv": case.kv_heads, "seqlen_q": case.q_len, "seqlen": case.seqlen,
            "head_dim": case.head_dim, "causal": case.causal,
            "window": case.window, "mask": "block-checkerboard" if case.block_mask else "",
            "mode": case.mode, "provider": p, "reps": len(times.get(p, [])),
            "median_ms": None, "min_ms": None, "spread_pct": None, "gflops": None, "pct_peak": None,
            "peak_mib": None, "extra_mib": None, "vs_sdpa": None, "vs_naive": None,
        }
        if p in times:
            gflops = case.flops() / med[p] / 1e9
            row.update(median_ms=med[p] * 1e3, min_ms=min(times[p]) * 1e3, spread_pct=measure.spread_pct(times[p]),
                       gflops=gflops, pct_peak=100 * gflops / peak_gflops if peak_gflops else None)
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


SECTIONS = ("grid", "lowp", "shapes", "decode", "memory")


def cases(quick: bool, sections) -> list:
    out = []

    def add(section, *args, **kw):
        if section in sections:
            out.append(Case(section, *args, **kw))

    decode = dict(heads_kv=2, seqlen_q=1, providers=("tileattn",) + ENGINES + ("sdpa",))
    if quick:
        for mode in ("fwd", "fwd+bwd"):
            add("grid", "quick", "fp32", 1, 2, 256, 32, causal=True, mode=mode)
        add("lowp", "quick-fp16", "fp16", 1, 2, 256, 32, mode="fwd")
        add("shapes", "quick-mask", "fp32", 1, 2, 256, 32, block_mask=64, mode="fwd")
        add("decode", "decode-k128", "fp32", 1, 8, 128, 64, **decode)
        add("memory", "quick-memory", "fp32", 1, 1, 512, 32, mode="fwd+bwd", providers=("native",),
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
    # Causal takes about half of dense; a window's time scales with the window; a bool block mask
    # hiding half the tiles takes about half. Naive would need 1 GiB of scores per head group here
    # and is left out.
    big = dict(providers=ENGINES + ("sdpa",))
    add("shapes", "dense-8192", "fp32", 1, 4, 8192, 64, mode="fwd", **big)
    add("shapes", "causal-8192", "fp32", 1, 4, 8192, 64, causal=True, mode="fwd", **big)
    add("shapes", "window512-8192", "fp32", 1, 4, 8192, 64, window=512, mode="fwd", **big)
    add("shapes", "window2048-8192", "fp32", 1, 4, 8192, 64, window=2048, mode="fwd", **big)
    add("shapes", "blockmask-half-8192", "fp32", 1, 4, 8192, 64, block_mask=256, mode="fwd", **big)
    # One new token per sequence against a KV cache: B=1, Hq=8, Hkv=2, D=64.
    for keys in (128, 512, 1024, 4096):
        add("decode", f"decode-k{keys}", "fp32", 1, 8, keys, 64, **decode)
    add("memory", "memory-16384", "fp32", 1, 1, 16384, 64, mode="fwd+bwd", providers=ENGINES + ("sdpa",),
        timed=False)
    return out


def fmt(x, spec):
    """``format(x, spec)``; a missing value is '-', as wide as the spec's width."""
    return "-".rjust(int(spec.split(".")[0] or 0)) if x is None else format(x, spec)


def print_table(rows: list) -> None:
    head = (f"{'case':<20} {'dtype':<5} {'S':>6} {'D':>4} {'caus':>4} {'mode':<8} {'provider':<9} "
            f"{'median ms':>10} {'spread':>7} {'GFLOP/s':>8} {'% peak':>6} {'peak MiB':>9} {'extra':>7} "
            f"{'vs sdpa':>8} {'vs naive':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        causal = "y" if r["causal"] else "n"
        print(f"{r['case']:<20} {r['dtype']:<5} {r['seqlen']:>6} {r['head_dim']:>4} {causal:>4} "
              f"{r['mode']:<8} {r['provider']:<9} {fmt(r['median_ms'], '10.3f')} "
              f"{fmt(r['spread_pct'], '6.1f')}% "
              f"{fmt(r['gflops'], '8.1f')} {fmt(r['pct_peak'], '6.0f')} {fmt(r['peak_mib'], '9.1f')} "
              f"{fmt(r['extra_mib'], '7.1f')} {fmt(r['vs_sdpa'], '8.2f')} "
              f"{fmt(r['vs_naive'], '8.2f')}", flush=True)


def geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(rows: list) -> dict:
    """Geometric means of each tileattn provider's speed ratio to SDPA per section, dtype and mode
    (``grid/fp32/fwd/native``: the targets' terms), with the lowest ratio of each group."""
    groups = {}
    for r in rows:
        if r["provider"] in ("sdpa", "naive") or r["vs_sdpa"] is None:
            continue
        key = f"{r['section']}/{r['dtype']}/{r['mode']}/{r['provider']}"
        groups.setdefault(key, []).append(r["vs_sdpa"])
    return {k: {"geomean": geomean(v), "min": min(v), "n": len(v)} for k, v in groups.items()}


def native_build() -> dict:
    """The native library's build, or why there is none (the native rows then report errors)."""
    ok, why = native_kernels.available()
    return native_kernels.build_info() if ok else {"unavailable": why}


def fma_peak() -> dict:
    """The native library's fp32 FMA probe (GFLOP/s): best of three on one core, and all threads at
    once; ``nominal`` = threads x one core, the yardstick of ``pct_peak``."""
    if not native_kernels.available()[0]:
        return {}
    threads = torch.get_num_threads()
    one = max(native_kernels.fma_peak_gflops(1) for _ in range(3))
    return {"one_core": one, "all_threads": native_kernels.fma_peak_gflops(threads), "threads": threads,
            "nominal": threads * one}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
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
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; expected {', '.join(SECTIONS)}")
    reps = args.reps or (3 if args.quick else 5)
    tag = args.tag or ("quick" if args.quick else "full")
    meta = {
        "machine": measure.cpu_model(), "cpu_count": measure.usable_cores(), "simd": measure.cpu_flags(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "reps": reps,
        "native": native_build(), "fma_peak_gflops": fma_peak(), "load_before": os.getloadavg(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    peak = meta["fma_peak_gflops"].get("nominal")
    print(f"{meta['machine']}, {meta['threads']} threads; native: {meta['native'].get('isa', 'unavailable')}; "
          f"fp32 FMA peak {fmt(peak, '.0f')} GFLOP/s; load {meta['load_before'][0]:.2f}", flush=True)
    rows = []
    started = time.time()
    for case in cases(args.quick, sections):
        # The memory section always measures memory; the prefill sections do in full runs (one
        # subprocess per row, which --quick skips to stay within seconds).
        per_row_memory = not (args.no_memory or args.quick) and case.section != "decode"
        case_rows = run_case(case, reps, memory=per_row_memory or case.section == "memory", peak_gflops=peak)
        print_table(case_rows)
        rows.extend(case_rows)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"cpu_{tag}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    meta.update(seconds=round(time.time() - started, 1), load_after=os.getloadavg(), geomean_vs_sdpa=summary(rows))
    with open(out_dir / f"cpu_{tag}.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("speed-up vs SDPA (geometric mean, lowest):")
    for key, g in meta["geomean_vs_sdpa"].items():
        print(f"  {key:<32} {g['geomean']:.2f}x (min {g['min']:.2f}x over {g['n']})")
    print(f"wrote {out_dir / f'cpu_{tag}.csv'} and .json in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
