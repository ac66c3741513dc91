"""Benchmark of the native C kernels against PyTorch SDPA on this CPU.

    python benchmarks/bench_native.py                    # every section (several minutes)
    python benchmarks/bench_native.py --only grid,decode # some sections
    python benchmarks/bench_native.py --reps 9 --out benchmarks/results/native_full   # also CSV + JSON
    python benchmarks/bench_native.py --threads 1 --cpu-time   # one core, CPU time: robust to other jobs
    python benchmarks/bench_native.py --only machine,isa --reps 5 --out benchmarks/results/native_isa

Sections:

* ``machine``: measured fp32 FMA peak (1 core and all threads) and memory bandwidth (1 GiB copy
  and read), the yardsticks of the other sections
* ``grid``: fp32, B=1, H=8, S in {1024, 4096}, D in {64, 128}, causal and not; forward and
  forward+backward
* ``fwd``: the grid's forward half only
* ``isa``: ``machine`` and ``fwd`` again under each build variant this CPU runs (avx512, avx2,
  generic; forced with ``TILEATTN_NATIVE_ISA``), one child process per variant; each row's
  ``pct_of_peak`` is against that variant's own FMA probe (its vector width), the JSON's
  ``info["isa_variants"]`` holds the probes and ``info["isa_skipped"]`` the variants this CPU cannot
  run, with the reason (also a summary line)
* ``lowp``: bf16 and fp16, S=2048, D=128, forward and forward+backward
* ``decode``: one query token against a KV cache (B=1, Hq=8, Hkv=2, D=64) for 128..4096 cached keys:
  the whole call, Python included
* ``cache``: decode at B in {1, 8, 32}, caches of 1k..32k keys, Hq/Hkv = 32/8, D=128, fp32 and bf16:
  tokens/s and the K/V bytes read per second against the measured memory bandwidth
* ``memory``: extra memory of forward+backward at S=16384 (target < 64 MiB)

Timing is interleaved: after a warm-up call of each provider, every repetition calls each provider
once in turn, so a noisy neighbour slows all providers of a repetition alike; the ratio of medians is
what to read. ``native`` is :func:`tileattn.backends.native.checked.forward` / ``backward`` with the
work a backend adds around them (allocating outputs, Delta = rowsum(dO * O)); ``sdpa`` is
``torch.nn.functional.scaled_dot_product_attention`` (forward+backward through autograd; decode with
``enable_gqa=True``). GFLOP/s count 4 * B * H * pairs * D per forward (pairs = visible (query, key)
pairs) and 2.5x that for the backward pass. Spread = (max - min) / median over the repetitions.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tileattn.backends.native import build as native_build
from tileattn.backends.native import checked, kernels as nk
from tileattn.programs import toolchain
from tileattn.tools.measure import peak_memory

SECTIONS = ("machine", "grid", "fwd", "isa", "lowp", "decode", "cache", "memory")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIELDS = ("section", "isa", "case", "dtype", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim",
          "causal", "mode", "provider", "reps", "median_ms", "spread_pct", "gflops", "pct_of_peak", "tokens_per_s",
          "gb_per_s", "vs_sdpa")


# ---------------------------------------------------------------------------------------- providers


def _native_fwd(q, k, v, causal):
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    checked.forward(q, k, v, out, lse, scale=q.shape[-1] ** -0.5, right=0 if causal else -1)
    return out, lse


def native_provider(q, k, v, causal, mode):
    if mode == "fwd":
        return lambda: _native_fwd(q, k, v, causal)
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)

    def run():
        out, lse = _native_fwd(q, k, v, causal)
        delta = (dout.float() * out.float()).sum(-1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        checked.backward(q, k, v, out, dout, lse, delta, dq, dk, dv, scale=q.shape[-1] ** -0.5,
                         right=0 if causal else -1)
        return dq, dk, dv

    return run


def sdpa_provider(q, k, v, causal, mode):
    gqa = q.shape[1] != k.shape[1]
    if mode == "fwd":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)

    def run():
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
        return torch.autograd.grad(out, leaves, dout)

    return run


PROVIDERS = {"native": native_provider, "sdpa": sdpa_provider}


# ------------------------------------------------------------------------------------------ timing


#: wall-clock time by default; --cpu-time (with --threads 1) times the calling thread's CPU time,
#: which other jobs on a shared machine do not inflate
CLOCK = {"fn": time.perf_counter}


def interleaved(fns: dict, reps: int, min_seconds: float = 0.0) -> dict:
    """Per provider, the list of times (s): warm-up, then `reps` round-robin repetitions; calls that
    take less than `min_seconds` are repeated inside one timing and averaged (decode steps)."""
    clock = CLOCK["fn"]
    inner = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        one = time.perf_counter() - t0
        inner[name] = max(1, int(min_seconds / max(one, 1e-7)))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            n = inner[name]
            t0 = clock()
            for _ in range(n):
                fn()
            times[name].append((clock() - t0) / n)
    return times


def summarize(times):
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med * 100


def visible_pairs(sq, sk, causal):
    if not causal:
        return sq * sk
    return sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))


# ----------------------------------------------------------------------------------------- sections


def section_machine(args, rows, info):
    threads = torch.get_num_threads()
    peak1 = nk.fma_peak_gflops(1)
    peakn = nk.fma_peak_gflops(threads)
    n = (1 << 30) // 4
    a = torch.randn(n)
    b = torch.empty_like(a)
    copy = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    read = min(_timed(lambda: a.sum()) for _ in range(5))
    info.update(fma_peak_1core=peak1, fma_peak_all=peakn, threads=threads, copy_gb_s=2 * n * 4 / copy / 1e9,
                read_gb_s=n * 4 / read / 1e9)
    print(f"machine: {threads} threads; fp32 FMA peak {peak1:.0f} GFLOP/s on 1 core, {peakn:.0f} on {threads} "
          f"(nominal {threads * peak1:.0f}); memory: copy {info['copy_gb_s']:.1f} GB/s, read "
          f"{info['read_gb_s']:.1f} GB/s (1 GiB)", flush=True)
    del a, b


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peak(info):
    return info.get("threads", torch.get_num_threads()) * info.get("fma_peak_1core") if "fma_peak_1core" in info \
        else None


def run_prefill(section, cases, args, rows, info):
    for dtype_name, s, d, causal, mode in cases:
        dtype = DTYPES[dtype_name]
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, s, d, generator=g).to(dtype) for _ in range(3))
        fns = {p: PROVIDERS[p](q, k, v, causal, mode) for p in ("native", "sdpa")}
        times = interleaved(fns, args.reps)
        flops = 4.0 * 8 * visible_pairs(s, s, causal) * d * (3.5 if mode == "fwd+bwd" else 1.0)
        base = statistics.median(times["sdpa"])
        for p, ts in times.items():
            med, spread = summarize(ts)
            gf = flops / med / 1e9
            peak = _peak(info)
            rows.append(dict(section=section, isa=info["isa"],
                             case=f"{dtype_name}-s{s}-d{d}{'-causal' if causal else ''}", dtype=dtype_name,
                             batch=1, heads_q=8, heads_kv=8, seqlen_q=s, seqlen_k=s, head_dim=d,
                             causal=causal, mode=mode, provider=p, reps=len(ts), median_ms=med * 1e3,
                             spread_pct=spread, gflops=gf, pct_of_peak=gf / peak * 100 if peak else None,
                             vs_sdpa=base / med))
            _print(rows[-1])


def grid_cases(args, modes):
    if args.quick:
        return [("fp32", 256, 64, c, m) for m in modes for c in (False, True)]
    return [("fp32", s, d, c, m) for m in modes for s in (1024, 4096) for d in (64, 128) for c in (False, True)]


def section_grid(args, rows, info):
    run_prefill("grid", grid_cases(args, ("fwd", "fwd+bwd")), args, rows, info)


def section_fwd(args, rows, info):
    run_prefill("fwd", grid_cases(args, ("fwd",)), args, rows, info)


def section_isa(args, rows, info):
    """The forward grid under each build variant, in child processes (the variant is chosen when the
    library is loaded, once per process)."""
    info["isa_variants"], info["isa_skipped"] = {}, {}
    cc = tuple(native_build.find_compiler())
    for isa in native_build.ISAS:
        refused = toolchain.variant(cc, isa)
        if isinstance(refused, str):  # a variant this CPU cannot run (AVX-512 on a Zen 3): say so, go on
            info["isa_skipped"][isa] = refused
            print(f"isa: {isa} skipped: {refused}", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "isa"
            cmd = [sys.executable, os.path.abspath(__file__), "--only", "machine,fwd", "--reps", str(args.reps),
                   "--out", str(out), "--threads", str(torch.get_num_threads())] + (["--quick"] if args.quick else [])
            print(f"isa: {isa}", flush=True)
            subprocess.run(cmd, env=dict(os.environ, **{native_build.ISA_ENV: isa}), check=True)
            child = json.loads(out.with_suffix(".json").read_text())
        info["isa_variants"][isa] = {k: child["info"].get(k) for k in
                                     ("isa", "flags", "fma_peak_1core", "fma_peak_all", "threads", "load_before")}
        for r in child["rows"]:
            rows.append(dict(r, section="isa", isa=isa))


def section_lowp(args, rows, info):
    s = 256 if args.quick else 2048
    run_prefill("lowp", [(dt, s, 128, False, m) for m in ("fwd", "fwd+bwd") for dt in ("bf16", "fp16")], args,
                rows, info)


def run_decode(section, cases, args, rows, info):
    for dtype_name, b, hq, hkv, sk, d in cases:
        dtype = DTYPES[dtype_name]
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
        k, v = (torch.randn(b, hkv, sk, d, generator=g).to(dtype) for _ in range(2))
        fns = {p: PROVIDERS[p](q, k, v, False, "fwd") for p in ("native", "sdpa")}
        times = interleaved(fns, args.reps, min_seconds=0.02)
        kv_bytes = 2 * b * hkv * sk * d * q.element_size()
        base = statistics.median(times["sdpa"])
        for p, ts in times.items():
            med, spread = summarize(ts)
            rows.append(dict(section=section, isa=info["isa"], case=f"{dtype_name}-b{b}-h{hq}/{hkv}-k{sk}-d{d}",
                             dtype=dtype_name, batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=1, seqlen_k=sk,
                             head_dim=d, causal=False,
                             mode="decode", provider=p, reps=len(ts), median_ms=med * 1e3, spread_pct=spread,
                             tokens_per_s=b / med, gb_per_s=kv_bytes / med / 1e9, vs_sdpa=base / med))
            _print(rows[-1])
        del q, k, v


def section_decode(args, rows, info):
    sks = (128, 512) if args.quick else (128, 512, 1024, 4096)
    run_decode("decode", [("fp32", 1, 8, 2, sk, 64) for sk in sks], args, rows, info)


def section_cache(args, rows, info):
    if args.quick:
        cases = [("fp32", 1, 32, 8, 1024, 128)]
    else:
        # K/V of the largest cases: B=32 x 8 heads x 4k keys x 128 x 4 B x 2 = 1 GiB (fp32)
        cases = [(dt, b, 32, 8, sk, 128) for dt in ("fp32", "bf16") for b in (1, 8, 32)
                 for sk in (1024, 4096, 16384, 32768) if b * sk <= (32768 if dt == "fp32" else 65536) * 4]
    run_decode("cache", cases, args, rows, info)


def section_memory(args, rows, info):
    """Peak memory of one forward+backward at S=16384, D=64 beyond its outputs and gradients, for one
    head (split backward schedule) and four heads (fused schedule: per-thread dK/dV accumulators)."""
    s = 2048 if args.quick else 16384
    for heads in (1, 4):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, s, 64, generator=g) for _ in range(3))
        tiny = [t[:, :, :64] for t in (q, k, v)]
        native_provider(*tiny, False, "fwd+bwd")()  # the library is loaded; its tile buffers are not grown
        _, peak = peak_memory(native_provider(q, k, v, False, "fwd+bwd"), "cpu")
        outputs = 4 * q.numel() * 4 + 2 * heads * s * 4  # out, dq, dk, dv, lse, delta (allocated by the call)
        extra = None if peak is None else (peak - outputs) / 2**20
        info[f"memory_extra_mib_h{heads}"] = extra
        print(f"memory: forward+backward at S={s}, H={heads}, D=64: peak "
              f"{peak / 2**20 if peak else float('nan'):.1f} MiB, "
              f"{extra if extra is not None else float('nan'):.1f} MiB beyond outputs and gradients", flush=True)
        del q, k, v


def _print(r):
    extra = ""
    if r.get("gflops") is not None:
        extra = f"{r['gflops']:7.0f} GF/s" + (f" {r['pct_of_peak']:4.0f}% peak" if r.get("pct_of_peak") else "")
    if r.get("tokens_per_s") is not None:
        extra = f"{r['tokens_per_s']:9.0f} tok/s {r['gb_per_s']:6.1f} GB/s"
    print(f"{r['section']:7} {r['case']:28} {r['mode']:7} {r['provider']:6} {r['median_ms']:9.3f} ms "
          f"±{r['spread_pct']:3.0f}%  {extra}  {r['vs_sdpa']:.2f}x", flush=True)


def geomean(xs):
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(rows, skipped=None):
    lines = []
    for section, mode in (("grid", "fwd"), ("grid", "fwd+bwd"), ("fwd", "fwd"), ("lowp", "fwd"), ("lowp", "fwd+bwd")):
        r = [x["vs_sdpa"] for x in rows if x["section"] == section and x["mode"] == mode and x["provider"] == "native"]
        if r:
            lines.append(f"{section} {mode}: geomean {geomean(r):.2f}x SDPA (min {min(r):.2f}x, max {max(r):.2f}x)")
    for isa, why in (skipped or {}).items():
        lines.append(f"isa {isa} skipped: {why}")
    for isa in native_build.ISAS:
        r = [x for x in rows if x["section"] == "isa" and x["isa"] == isa and x["provider"] == "native"]
        if r:
            lines.append(f"isa {isa} fwd: {min(x['gflops'] for x in r):.0f}-{max(x['gflops'] for x in r):.0f} "
                         f"GFLOP/s, {min(x['pct_of_peak'] for x in r):.0f}-{max(x['pct_of_peak'] for x in r):.0f}% "
                         f"of its FMA peak, geomean {geomean(x['vs_sdpa'] for x in r):.2f}x SDPA")
    for x in rows:
        if x["section"] == "decode" and x["provider"] == "native":
            lines.append(f"decode {x['case']}: {x['vs_sdpa']:.2f}x SDPA ({x['median_ms'] * 1e3:.0f} us)")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", help="write <out>.csv and <out>.json")
    parser.add_argument("--threads", type=int, help="torch and native threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true", help="time thread CPU time (needs --threads 1)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time measures the calling thread only: use it with --threads 1")
        CLOCK["fn"] = time.thread_time
    info = dict(nk.build_info(), python=platform.python_version(), torch=torch.__version__,
                cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                clock="thread CPU time" if args.cpu_time else "wall clock", load_before=os.getloadavg()[0])
    print(f"native kernels: {info['isa']} ({info['compiler_version']}), bf16 dot tiles "
          f"{'on' if info['bf16dot_default'] else 'off'} (vdpbf16ps/FMA rate {info['bf16dot_speedup']}); "
          f"{info['threads']} threads, {info['clock']}, load {info['load_before']:.2f}", flush=True)
    rows = []
    for name in args.only.split(","):
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; expected some of {', '.join(SECTIONS)}")
        globals()[f"section_{name}"](args, rows, info)
    info["load_after"] = os.getloadavg()[0]
    lines = summary(rows, info.get("isa_skipped"))
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow({k: r.get(k) for k in FIELDS})
        out.with_suffix(".json").write_text(json.dumps(dict(info=info, summary=lines, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
