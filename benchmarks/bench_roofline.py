"""The native kernels against the machine's roofline and against PyTorch SDPA (issue 26), one command:

    python benchmarks/bench_roofline.py --out benchmarks/results/roofline   # every section, ~20-30 min
    python benchmarks/bench_roofline.py --only machine,roofline,profile     # some sections
    python benchmarks/bench_roofline.py --quick                             # tiny shapes, seconds (the test)
    python benchmarks/bench_roofline.py --only targets --cpu-time           # vs SDPA on 1 thread, CPU time

It ends with the target table (wanted, measured, met). Sections:

* ``machine``: CPU model, whether AVX-512 / AVX512_BF16 / AMX are exposed, the engine's own probes:
  fp32 FMA peak (1 thread and all), exp2 rate (the softmax's roof: exp2 runs on the FMA ports), AMX
  bf16 peak
* ``roofline``: 1 thread, thread CPU time (other jobs on the machine barely move it), forward and
  backward, fp32 / bf16 / fp16: GFLOP/s against the FMA peak, the AMX peak (bf16) and the attention
  bound F / (F / peak + E / exp2 rate) (F FLOPs, E exponentials, both on the same ports)
* ``profile``: the same cases in a child process with the profiling build (TILEATTN_NATIVE_PROFILE=1):
  the share of each phase (GEMMs, softmax, packing, ...) and, on all threads, the idle share
* ``headdim``: D in {32, 64, 80, 96, 128, 192, 256, 512} and Dv != D (MLA 192/128), 1 thread
* ``targets``: all threads, wall clock, interleaved against SDPA: the fp32 grid (B=1, H=8,
  S 1024/4096 x D 64/128 x dense/causal) forward and forward+backward; D 256/512 fp32 and bf16
  (S=1024, causal); MLA prefill (D=192, Dv=128, H=16, S=2048, causal)
* ``isa``: the avx2 and generic builds (loaded side by side) against SDPA with PyTorch restricted to
  AVX2, in child processes: ATEN_CPU_CAPABILITY=avx2 alone (MKL's sgemm, which SDPA's GEMMs call,
  still uses AVX-512) and with MKL_ENABLE_INSTRUCTIONS=AVX2 too (what an AVX2-only CPU runs);
  forward grid, 1 thread, CPU time
* ``threads``: 1 against all threads, wall clock, S >= 2048
* ``schedule``: the forward's and backward's task lists for 2-64 threads
  (tileattn/backends/native/schedule.py), simulated (longest task first to the thread that frees up
  first, as the dynamic schedule does): imbalance per thread count

GFLOP/s count useful work: 2 * B * H * visible pairs * (D + Dv) for the forward, 2.5x that for the
backward. Timing interleaves the providers within each repetition (medians, or minima of thread CPU
time for one thread); spread = (max - min) / median. The load average goes into the JSON.
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
from tileattn.backends.native.schedule import backward_tasks, forward_tasks, simulate

SECTIONS = ("machine", "roofline", "profile", "headdim", "targets", "isa", "threads", "schedule")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIELDS = ("section", "variant", "case", "dtype", "mode", "heads", "seqlen", "head_dim", "head_dim_v", "causal",
          "threads", "provider", "reps", "time_ms", "spread_pct", "gflops", "pct_fma_peak", "pct_amx_peak",
          "pct_bound", "vs_sdpa", "speedup")
PHASES = ("pack", "scores", "dp", "mods", "softmax", "probs", "pv", "dv", "dk", "dq", "finish", "store", "kv_convert")


# --------------------------------------------------------------------------------------------- cases


class Case:
    def __init__(self, dtype="fp32", s=1024, d=64, dv=None, causal=False, heads=8, mode="fwd"):
        self.dtype, self.s, self.d, self.dv, self.causal, self.heads, self.mode = \
            dtype, s, d, dv or d, causal, heads, mode

    @property
    def name(self):
        dv = f"/{self.dv}" if self.dv != self.d else ""
        return f"{self.dtype}-h{self.heads}-s{self.s}-d{self.d}{dv}{'-causal' if self.causal else ''}"

    def pairs(self):
        return self.s * (self.s + 1) // 2 if self.causal else self.s * self.s

    def flops(self, mode=None):
        fwd = 2.0 * self.heads * self.pairs() * (self.d + self.dv)
        return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode or self.mode]

    def exps(self, mode=None):
        return self.heads * self.pairs() * {"fwd": 1, "bwd": 1, "fwd+bwd": 2}[mode or self.mode]

    def tensors(self):
        g = torch.Generator().manual_seed(0)
        dt = DTYPES[self.dtype]
        q = torch.randn(1, self.heads, self.s, self.d, generator=g).to(dt)
        k = torch.randn(1, self.heads, self.s, self.d, generator=g).to(dt)
        v = torch.randn(1, self.heads, self.s, self.dv, generator=g).to(dt)
        return q, k, v

    def row(self, **kw):
        return dict(case=self.name, dtype=self.dtype, mode=self.mode, heads=self.heads, seqlen=self.s, head_dim=self.d,
                    head_dim_v=self.dv, causal=self.causal, **kw)


def native_fns(case, threads):
    """fwd, bwd (the kernel calls alone) and fwd+bwd (with what a backend adds: outputs, Delta)."""
    q, k, v = case.tensors()
    kw = dict(scale=case.d ** -0.5, right=0 if case.causal else -1, num_threads=threads)
    out = torch.empty(q.shape[:3] + (case.dv,), dtype=q.dtype)
    lse = torch.empty(q.shape[:3])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    checked.forward(q, k, v, out, lse, **kw)
    delta = (dout.float() * out.float()).sum(-1)

    def fwd():
        checked.forward(q, k, v, out, lse, **kw)

    def bwd():
        checked.backward(q, k, v, out, dout, lse, delta, dq, dk, dv, **kw)

    def both():
        o = torch.empty_like(out)
        ls = torch.empty_like(lse)
        checked.forward(q, k, v, o, ls, **kw)
        dl = (dout.float() * o.float()).sum(-1)
        checked.backward(q, k, v, o, dout, ls, dl, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                         **kw)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


def sdpa_fns(case):
    q, k, v = case.tensors()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape[:3] + (case.dv,), generator=torch.Generator().manual_seed(1)).to(q.dtype)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    def both():
        out = F.scaled_dot_product_attention(*leaves, is_causal=case.causal)
        torch.autograd.grad(out, leaves, dout)

    return {"fwd": fwd, "fwd+bwd": both}


# -------------------------------------------------------------------------------------------- timing


def interleaved(fns, reps, clock):
    """Per provider, the times of `reps` round-robin repetitions (after one warm-up call each; the
    starting provider rotates)."""
    names = list(fns)
    for n in names:
        fns[n]()
    times = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            fns[n]()
            times[n].append(clock() - t0)
    return times


def spread(ts):
    return (max(ts) - min(ts)) / statistics.median(ts) * 100


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def peak(info, threads=1):
    return info["fma_peak_1"] * threads


# ------------------------------------------------------------------------------------------ sections


def section_machine(args, rows, info):
    flags = set()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    threads = torch.get_num_threads()
    info.update(cpu=model, threads=threads, l2_bytes=nk.l2_bytes(), avx512=("avx512f" in flags), avx512_bf16=("avx512_bf16" in flags),
                amx=("amx_bf16" in flags and "amx_tile" in flags), amx_usable=nk.build_info()["amx"],
                fma_peak_1=max(nk.fma_peak_gflops(1) for _ in range(5)),
                fma_peak_all=max(nk.fma_peak_gflops(threads) for _ in range(5)),
                exp2_per_s=max(nk.exp2_rate() for _ in range(3)), amx_peak_1=nk.amx_peak_gflops())
    print(f"machine: {model}; AVX-512 {info['avx512']}, AVX512_BF16 {info['avx512_bf16']}, AMX exposed "
          f"{info['amx']} (usable {info['amx_usable']}); {threads} threads; fp32 FMA peak {info['fma_peak_1']:.0f} "
          f"GFLOP/s on 1 thread, {info['fma_peak_all']:.0f} on {threads}; exp2 {info['exp2_per_s'] / 1e9:.2f} G/s; "
          f"AMX bf16 {info['amx_peak_1']:.0f} GFLOP/s; load {os.getloadavg()[0]:.1f}", flush=True)


def _ensure_machine(args, rows, info):
    if "fma_peak_1" not in info:
        section_machine(args, rows, info)


def roofline_cases(args):
    if args.quick:
        return [Case("fp32", 256, 64, causal=c, mode=m) for m in ("fwd", "bwd") for c in (False, True)] + \
            [Case("bf16", 256, 64, mode=m) for m in ("fwd", "bwd")]
    grid = [Case("fp32", s, d, causal=c, mode=m) for m in ("fwd", "bwd") for s in (1024, 4096) for d in (64, 128)
            for c in (False, True)]
    lowp = [Case(dt, 2048, 128, causal=c, mode=m) for dt in ("bf16", "fp16") for m in ("fwd", "bwd")
            for c in (False, True)]
    return grid + lowp


def _roof_row(section, case, ts, info, threads=1):
    t = min(ts)
    gflops = case.flops() / t / 1e9
    fma = peak(info, threads)
    amx = info.get("amx_peak_1", 0) * threads if case.dtype == "bf16" and info.get("amx_usable") else 0
    rate = amx or fma  # the matrix engine the kernel uses
    bound = case.flops() / (case.flops() / (rate * 1e9) + case.exps() / (info["exp2_per_s"] * threads)) / 1e9
    return case.row(section=section, threads=threads, provider="native", reps=len(ts), time_ms=t * 1e3,
                    spread_pct=spread(ts), gflops=gflops, pct_fma_peak=gflops / fma * 100,
                    pct_amx_peak=gflops / amx * 100 if amx else None, pct_bound=gflops / bound * 100)


def _print_roof(r):
    amx = f" {r['pct_amx_peak']:5.1f}% AMX" if r.get("pct_amx_peak") else ""
    print(f"{r['section']:9} {r['case']:32} {r['mode']:4} {r['time_ms']:9.1f} ms ±{r['spread_pct']:3.0f}% "
          f"{r['gflops']:7.1f} GF/s {r['pct_fma_peak']:5.1f}% FMA{amx} {r['pct_bound']:5.1f}% of bound", flush=True)


def run_roofline(section, cases, args, rows, info):
    """1 thread, thread CPU time, minimum over the repetitions."""
    torch.set_num_threads(1)
    try:
        for case in cases:
            fn = native_fns(case, 1)[case.mode]
            ts = interleaved({"native": fn}, args.reps, time.thread_time)["native"]
            rows.append(_roof_row(section, case, ts, info))
            _print_roof(rows[-1])
    finally:
        torch.set_num_threads(info["threads"])


def section_roofline(args, rows, info):
    _ensure_machine(args, rows, info)
    run_roofline("roofline", roofline_cases(args), args, rows, info)


def headdim_cases(args):
    if args.quick:
        return [Case("fp32", 128, d, dv, mode=m) for m in ("fwd", "bwd") for d, dv in ((32, 32), (80, 80), (192, 128))]
    dims = [(d, d) for d in (32, 64, 80, 96, 128, 192, 256, 512)] + [(192, 128)]
    return [Case("fp32", 1024 if d >= 512 else 2048, d, dv, mode=m) for m in ("fwd", "bwd") for d, dv in dims]


def section_headdim(args, rows, info):
    _ensure_machine(args, rows, info)
    run_roofline("headdim", headdim_cases(args), args, rows, info)


def section_profile(args, rows, info):
    """The roofline cases again in a child process built with per-phase counters."""
    _ensure_machine(args, rows, info)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--profile-child", str(out), "--reps", str(args.reps)]
        subprocess.run(cmd + (["--quick"] if args.quick else []), check=True,
                       env=dict(os.environ, **{native_build.PROFILE_ENV: "1"}))
        child = json.loads(out.read_text())
    info["profile"] = child
    for entry in child:
        shares = "  ".join(f"{k} {v:4.1f}%" for k, v in entry["shares"].items() if v >= 0.5)
        print(f"profile   {entry['case']:32} {entry['mode']:4} t={entry['threads']}  {shares}  "
              f"idle {entry['idle_pct']:.1f}%", flush=True)


def profile_child(path, args):
    """Runs inside the profiling build: shares of each phase per case, on 1 thread and all threads."""
    entries = []
    threads = torch.get_num_threads()
    cases = roofline_cases(args) + ([] if args.quick else [Case("fp32", 4096, 128, causal=c, mode=m)
                                                          for m in ("fwd", "bwd") for c in (False, True)])
    for case in cases:
        for t in ((1,) if case.s < 4096 or args.quick else (1, threads)):
            fn = native_fns(case, t)[case.mode]
            fn()
            nk.profile()
            start = time.perf_counter()  # a second or more of calls, so preemption spreads evenly
            while time.perf_counter() - start < (0.3 if args.quick else 1.5):
                fn()
            p = nk.profile()
            prefix = "fwd_" if case.mode == "fwd" else "bwd_"
            shares = {k[4:]: v / max(p["task"], 1) * 100 for k, v in p.items() if k.startswith(prefix)}
            shares = {k: shares[k] for k in PHASES if k in shares}
            shares["other"] = max(0.0, 100 - sum(shares.values()))
            entries.append(dict(case=case.name, mode=case.mode, threads=t, shares=shares, tasks=p["tasks"],
                                preempted=p["preempted"],
                                idle_pct=(1 - p["task_all"] / p["region"]) * 100 if p["region"] else 0.0))
    Path(path).write_text(json.dumps(entries))


def target_cases(args):
    if args.quick:
        return [Case("fp32", 256, 64, causal=c, mode=m) for m in ("fwd", "fwd+bwd") for c in (False, True)]
    grid = [Case("fp32", s, d, causal=c, mode=m) for m in ("fwd", "fwd+bwd") for s in (1024, 4096) for d in (64, 128)
            for c in (False, True)]
    wide = [Case(dt, 1024, d, causal=True, mode=m) for dt in ("fp32", "bf16") for d in (256, 512)
            for m in ("fwd", "fwd+bwd")]
    mla = [Case("fp32", 2048, 192, 128, causal=True, heads=16, mode=m) for m in ("fwd", "fwd+bwd")]
    return grid + wide + mla


def section_targets(args, rows, info):
    """All threads, wall clock; with --cpu-time one thread, thread CPU time (what other jobs on a
    shared machine disturb least)."""
    _ensure_machine(args, rows, info)
    threads = 1 if args.cpu_time else info["threads"]
    torch.set_num_threads(threads)
    for case in target_cases(args):
        fns = {"native": native_fns(case, threads)[case.mode], "sdpa": sdpa_fns(case)[case.mode]}
        times = interleaved(fns, args.reps, time.thread_time if args.cpu_time else time.perf_counter)
        base = statistics.median(times["sdpa"])
        for p, ts in times.items():
            med = statistics.median(ts)
            gflops = case.flops() / med / 1e9
            rows.append(case.row(section="targets", threads=threads, provider=p, reps=len(ts), time_ms=med * 1e3,
                                 spread_pct=spread(ts), gflops=gflops, pct_fma_peak=gflops / peak(info, threads) * 100,
                                 vs_sdpa=base / med))
        r = rows[-2]
        print(f"targets   {case.name:32} {case.mode:7} native {r['time_ms']:9.1f} ms ±{r['spread_pct']:3.0f}% "
              f"sdpa {rows[-1]['time_ms']:9.1f} ms ±{rows[-1]['spread_pct']:3.0f}%  {r['gflops']:6.1f} GF/s "
              f"{r['pct_fma_peak']:5.1f}% peak  {r['vs_sdpa']:.2f}x SDPA", flush=True)
    torch.set_num_threads(info["threads"])


def isa_child(path, args):
    """Inside a child whose PyTorch is restricted to AVX2: the avx2 and generic builds side by side
    (one library each) against SDPA, forward grid, 1 thread, thread CPU time."""
    torch.set_num_threads(1)
    libs = {isa: nk._Library(native_build.build(isa=isa)) for isa in ("avx2", "generic")}
    out = []
    cases = [Case("fp32", 256 if args.quick else s, d, causal=c) for s in (1024, 4096) for d in (64, 128)
             for c in (False, True)][:2 if args.quick else 8]
    for case in cases:
        fns = {}
        for isa, lib in libs.items():
            nk._state["lib"] = lib
            fn = native_fns(case, 1)["fwd"]
            fns[isa] = (lambda f=fn, lib=lib: (nk._state.__setitem__("lib", lib), f()))
        fns["sdpa"] = sdpa_fns(case)["fwd"]
        times = interleaved(fns, args.reps, time.thread_time)
        out.append(dict(case=case.name, **{k: min(v) for k, v in times.items()},
                        peaks={isa: lib.lib.ta_probe_fma_gflops(1) for isa, lib in libs.items()}))
    Path(path).write_text(json.dumps(dict(cases=out, capability=torch.backends.cpu.get_cpu_capability(),
                                          mkl=os.environ.get("MKL_ENABLE_INSTRUCTIONS"))))


def section_isa(args, rows, info):
    info["isa"] = {}
    for variant, env in (("aten-avx2", dict(ATEN_CPU_CAPABILITY="avx2")),
                         ("aten+mkl-avx2", dict(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2"))):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "isa.json"
            cmd = [sys.executable, os.path.abspath(__file__), "--isa-child", str(out), "--reps", str(args.reps)]
            subprocess.run(cmd + (["--quick"] if args.quick else []), check=True, env=dict(os.environ, **env))
            child = json.loads(out.read_text())
        info["isa"][variant] = child
        for c in child["cases"]:
            for isa in ("avx2", "generic"):
                rows.append(dict(section="isa", variant=variant, case=c["case"], dtype="fp32", mode="fwd", threads=1,
                                 provider=isa, time_ms=c[isa] * 1e3, vs_sdpa=c["sdpa"] / c[isa]))
            print(f"isa       {variant:14} {c['case']:28} avx2 {c['sdpa'] / c['avx2']:.2f}x SDPA, generic "
                  f"{c['sdpa'] / c['generic']:.2f}x SDPA ({c['generic'] / c['avx2']:.2f}x the avx2 time)", flush=True)


def section_threads(args, rows, info):
    """1 against all threads, wall clock, interleaved."""
    threads = info.get("threads", torch.get_num_threads())
    cases = [Case("fp32", 256, 64, mode="fwd")] if args.quick else \
        [Case("fp32", s, 128, causal=c, mode=m) for m in ("fwd", "bwd") for s in (2048, 4096) for c in (False, True)]
    for case in cases:
        fns = {f"t{t}": native_fns(case, t)[case.mode] for t in (1, threads)}
        times = interleaved(fns, args.reps, time.perf_counter)
        one, many = statistics.median(times["t1"]), statistics.median(times[f"t{threads}"])
        rows.append(case.row(section="threads", threads=threads, provider="native", reps=args.reps,
                             time_ms=many * 1e3, spread_pct=spread(times[f"t{threads}"]), speedup=one / many))
        print(f"threads   {case.name:32} {case.mode:4} 1 thread {one * 1e3:8.1f} ms, {threads} threads "
              f"{many * 1e3:8.1f} ms: {one / many:.2f}x", flush=True)


# ------------------------------------------------------------------------------------------ schedule


def section_schedule(args, rows, info):
    info["schedule"] = []
    shapes = [(s, h, c) for s in (2048, 8192, 32768) for h in (8, 32) for c in (False, True)]
    for threads in (2, 4, 8, 16, 32, 64):
        for s, h, c in shapes:
            fwd = forward_tasks(s, h, 128, 128, c, threads, l2_bytes=info.get("l2_bytes", 2 << 20))
            bwd = backward_tasks(s, h, c, threads)
            entry = dict(threads=threads, seqlen=s, heads=h, causal=c, fwd_tasks=len(fwd),
                         fwd_per_thread=len(fwd) / threads, fwd_imbalance=simulate(fwd, threads),
                         bwd_tasks=len(bwd), bwd_imbalance=simulate(bwd, threads))
            info["schedule"].append(entry)
        worst = max((e for e in info["schedule"] if e["threads"] == threads), key=lambda e: e["fwd_imbalance"])
        worst_b = max((e for e in info["schedule"] if e["threads"] == threads), key=lambda e: e["bwd_imbalance"])
        print(f"schedule  {threads:2d} threads: forward worst makespan {worst['fwd_imbalance']:.3f}x ideal "
              f"(S={worst['seqlen']}, H={worst['heads']}, {worst['fwd_tasks']} tasks); backward worst "
              f"{worst_b['bwd_imbalance']:.3f}x (S={worst_b['seqlen']}, H={worst_b['heads']})", flush=True)


# ----------------------------------------------------------------------------------------- targets


def _find(rows, section, **kw):
    return [r for r in rows if r.get("section") == section and all(r.get(k) == v for k, v in kw.items())]


def target_table(rows, info):
    """(target, wanted, measured, met) for every target that this run measured."""
    out = []

    def add(name, wanted, value, ok, fmt="{:.2f}x"):
        out.append((name, wanted, fmt.format(value) if isinstance(value, float) else value, "met" if ok else "NOT met"))

    for mode, want in (("fwd", 1.3), ("fwd+bwd", 1.4)):
        r = [x for x in _find(rows, "targets", provider="native", mode=mode, dtype="fp32", heads=8)
             if x["head_dim"] in (64, 128)]
        if r:
            g = geomean(x["vs_sdpa"] for x in r)
            add(f"fp32 grid {mode}: geomean vs SDPA", f">= {want}x", g, g >= want)
            lo = min(r, key=lambda x: x["vs_sdpa"])
            add(f"fp32 grid {mode}: lowest shape ({lo['case']})", ">= 1.05x", lo["vs_sdpa"], lo["vs_sdpa"] >= 1.05)
    for mode, want in (("fwd", 75), ("bwd", 65)):
        r = _find(rows, "roofline", mode=mode, dtype="fp32", seqlen=4096, head_dim=128, causal=False)
        if r:
            v = r[0]["pct_fma_peak"]
            add(f"fp32 dense S4096 D128 {mode}, % of FMA peak (1 thread)", f">= {want}%", v, v >= want, "{:.1f}%")
    for dt, want in (("fp32", 1.2), ("bf16", 1.5)):
        for d in (256, 512):
            for mode in ("fwd", "fwd+bwd"):
                r = _find(rows, "targets", provider="native", dtype=dt, head_dim=d, mode=mode)
                if r:
                    add(f"{dt} D{d} S1024 causal {mode} vs SDPA", f">= {want}x", r[0]["vs_sdpa"], r[0]["vs_sdpa"] >= want)
    r = _find(rows, "targets", provider="native", head_dim=192, head_dim_v=128, mode="fwd")
    if r:
        add(f"MLA 192/128 H16 S2048 causal fwd, % of FMA peak ({r[0]['threads']} thread(s))", ">= 55%", r[0]["pct_fma_peak"],
            r[0]["pct_fma_peak"] >= 55, "{:.1f}%")
    r = _find(rows, "headdim", mode="fwd")
    if r:
        lo = min(r, key=lambda x: x["pct_fma_peak"])
        add(f"every head dim fwd, % of FMA peak (lowest: {lo['case']})", ">= 55%", lo["pct_fma_peak"],
            lo["pct_fma_peak"] >= 55, "{:.1f}%")
    for variant in ("aten-avx2", "aten+mkl-avx2"):
        r = _find(rows, "isa", variant=variant, provider="avx2")
        if r:
            g = geomean(x["vs_sdpa"] for x in r)
            add(f"avx2 build vs SDPA ({variant}), forward grid geomean", ">= 1.0x", g, g >= 1.0)
    r = _find(rows, "isa", variant="aten+mkl-avx2")
    if r:
        by = {}
        for x in r:
            by.setdefault(x["case"], {})[x["provider"]] = x["time_ms"]
        g = geomean(v["generic"] / v["avx2"] for v in by.values())
        add("generic build time / avx2 build time, geomean", "<= 2.0x", g, g <= 2.0)
    r = [x for x in _find(rows, "threads") if x["seqlen"] >= 2048]
    if r:
        lo = min(r, key=lambda x: x["speedup"])
        add(f"1 -> {lo['threads']} threads speed-up, S >= 2048 (lowest: {lo['case']} {lo['mode']})", ">= 1.85x",
            lo["speedup"], lo["speedup"] >= 1.85)
    return out


def plot(rows, info, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = _find(rows, "roofline") + _find(rows, "headdim")
    prof = [e for e in info.get("profile", []) if e["threads"] == 1]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw=dict(width_ratios=[1.1, 1]))
    ax = axes[0]
    labels = [f"{r['case'].replace('-h8', '')} {r['mode']}" for r in roof]
    ax.barh(range(len(roof)), [r["pct_fma_peak"] for r in roof], color=["C0" if r["mode"] == "fwd" else "C1" for r in roof])
    for i, r in enumerate(roof):
        if r.get("pct_amx_peak"):
            ax.text(r["pct_fma_peak"] + 2, i, f"{r['pct_amx_peak']:.0f}% of AMX", va="center", fontsize=7)
    ax.axvline(100, color="k", lw=1)
    ax.axvline(75, color="g", ls="--", lw=1, label="75% target (fwd, D >= 64, S >= 4096)")
    ax.axvline(55, color="r", ls=":", lw=1, label="55% target (every head dim)")
    ax.set_yticks(range(len(roof)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"% of the measured fp32 FMA peak ({info['fma_peak_1']:.0f} GFLOP/s, 1 thread)")
    ax.set_title("achieved GFLOP/s / FMA peak (blue forward, orange backward)")
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[1]
    names = [k for k in PHASES + ("other",) if any(e["shares"].get(k, 0) > 0.5 for e in prof)]
    left = [0.0] * len(prof)
    for i, k in enumerate(names):
        vals = [e["shares"].get(k, 0.0) for e in prof]
        ax.barh(range(len(prof)), vals, left=left, label=k, color=plt.cm.tab20(i))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(prof)), [f"{e['case'].replace('-h8', '')} {e['mode']}" for e in prof], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of the task time (profiling build, 1 thread)")
    ax.set_title("where a call's time goes")
    ax.legend(fontsize=7, ncol=len(names), loc="upper center", bbox_to_anchor=(0.5, -0.08), columnspacing=0.8,
              handlelength=1.2)
    fig.suptitle(f"tileattn native kernels on {info.get('cpu', '?')} (AMX {'exposed' if info.get('amx') else 'absent'})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"figure: {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", help="write <out>.csv, <out>.json and <out>.png")
    parser.add_argument("--cpu-time", action="store_true",
                        help="targets on 1 thread in thread CPU time (robust on a shared machine)")
    parser.add_argument("--profile-child", help=argparse.SUPPRESS)
    parser.add_argument("--isa-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.profile_child:
        return profile_child(args.profile_child, args) or []
    if args.isa_child:
        return isa_child(args.isa_child, args) or []
    info = dict(nk.build_info(), python=platform.python_version(), torch=torch.__version__,
                threads=torch.get_num_threads(), load_before=os.getloadavg()[0], started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"native kernels: {info['isa']} ({info['compiler_version']}); torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}); {info['threads']} threads; load {info['load_before']:.1f}",
          flush=True)
    rows = []
    for name in args.only.split(","):
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; expected some of {', '.join(SECTIONS)}")
        globals()[f"section_{name}"](args, rows, info)
    info["load_after"] = os.getloadavg()[0]
    table = target_table(rows, info)
    width = max([len(t[0]) for t in table] + [10])
    print(f"\n{'target':{width}}  {'wanted':>8}  {'measured':>9}  verdict   (load {info['load_before']:.1f} -> "
          f"{info['load_after']:.1f})")
    for name, wanted, value, verdict in table:
        print(f"{name:{width}}  {wanted:>8}  {value:>9}  {verdict}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow({k: r.get(k) for k in FIELDS})
        out.with_suffix(".json").write_text(json.dumps(dict(info=info, targets=table, rows=rows), indent=1))
        if any(r["section"] in ("roofline", "headdim") for r in rows):
            plot(rows, info, out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
