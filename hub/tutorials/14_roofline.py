# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 14 · The roofline: how close the CPU kernels get to the machine
#
# Chapter 09 built a native kernel and measured its micro-GEMM at the FMA peak in cache. A whole
# attention call is more than that GEMM: the scores have to go through `exp2`, the keys and values
# stream in from beyond L2, queries are packed and results written back, and the work is split
# across threads. This chapter asks, for the engine's own kernels, the performance engineer's
# question: **what is the most this machine can do, how much of it do we get, and where does the
# rest go?**
#
# * Two roofs, both measured by the engine itself: the fp32 **FMA peak** (`kernels.fma_peak_gflops`)
#   and the **exp2 rate** (`kernels.exp2_rate`, elements per second). On a CPU both run on the same
#   vector ports, so they do not overlap: they add up.
# * The achieved GFLOP/s of the forward and backward kernels against both.
# * A **profiling build** (`TILEATTN_NATIVE_PROFILE=1`) whose kernels count time-stamp ticks per
#   phase: GEMMs, softmax, packing, writing back, threads waiting.
# * The **schedule**: how a call is cut into tasks, and what that does on 2 to 64 cores.
#
# The full-size numbers, every shape and dtype, and the comparison with PyTorch's SDPA are
# `python benchmarks/bench_roofline.py` ([docs/performance.md](../../docs/performance.md)).

# %%
import json
import os
import subprocess
import sys
import time

import torch

from tileattn.backends.native import checked, kernels as nk
from tileattn.backends.native.schedule import forward_block, forward_tasks, backward_tasks, simulate
from _hub import SMALL, check, figure, pick, save_figure, seeded

torch.set_num_threads(1)
ok, why = nk.available()
if not ok:
    raise SystemExit(f"this chapter needs the native kernels: {why}")
info = nk.build_info()
peak = max(nk.fma_peak_gflops(1) for _ in range(5))
exp_rate = max(nk.exp2_rate() for _ in range(3))
print(f"build: {info['isa']} ({info['compiler_version']}), AMX usable: {info['amx']}")
print(f"fp32 FMA peak, 1 core: {peak:.0f} GFLOP/s; exp2 with its subtraction and row sum: {exp_rate / 1e9:.2f} G/s")

# %% [markdown]
# ## The attention bound
#
# Per (query, key) pair the forward pass does `2 (D + Dv)` FLOPs of GEMM (the score and the P.V
# product) and one `exp2`; the backward does 2.5x the FLOPs and again one `exp2` (it recomputes P from
# the LSE). With both on the same ports, a pair costs `2 (D + Dv) / peak + 1 / exp_rate` seconds at
# best, so the best the kernel can reach, as a fraction of the FMA peak, is
#
# `bound(D) = 1 / (1 + peak / (2 (D + Dv) exp_rate))`
#
# Small heads spend relatively more on the softmax: at D = 32 the exponentials alone cost a sizeable
# slice of every pair, at D = 256 next to nothing.

# %%
def bound(d, dv=None, backward=False):
    flops = 2 * (d + (dv or d)) * (2.5 if backward else 1.0)
    return 1 / (1 + peak * 1e9 / (flops * exp_rate))


print(" head dim   forward bound   backward bound  (fraction of the FMA peak)")
for d in (32, 64, 128, 256, 512):
    print(f"{d:9d}   {bound(d):12.1%}   {bound(d, backward=True):14.1%}")
check(bound(32) < bound(64) < bound(128) < bound(256) < 1, "the bound rises with the head dim and stays below the peak")
check(bound(64, backward=True) > bound(64), "the backward's extra GEMMs dilute its exponentials further")

# %% [markdown]
# ## Measured: achieved GFLOP/s against the peak and the bound
#
# One thread, timed in thread CPU time (another job on the machine barely moves it), the best of a
# few calls. GFLOP/s count useful work only: a causal call is credited with the visible half.

# %%
H = pick(2, 8)
shapes = [(pick(512, 4096), d, c) for d in (64, 128) for c in (False, True)]


def call(s, d, causal, threads=1):
    q, k, v = (seeded(1, H, s, d, seed=i) for i in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, H, s)
    dout = seeded(1, H, s, d, seed=3)
    kw = dict(scale=d ** -0.5, right=0 if causal else -1, num_threads=threads)
    checked.forward(q, k, v, out, lse, **kw)
    delta = (dout * out).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return (lambda: checked.forward(q, k, v, out, lse, **kw),
            lambda: checked.backward(q, k, v, out, dout, lse, delta, dq, dk, dv, **kw))


def best_cpu_time(fn, reps=3):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


measured = []
print("     S    D  causal  pass   GFLOP/s  % of peak  % of bound")
for s, d, causal in shapes:
    pairs = s * (s + 1) // 2 if causal else s * s
    for name, fn, backward in zip(("fwd", "bwd"), call(s, d, causal), (False, True)):
        flops = 2 * H * pairs * 2 * d * (2.5 if backward else 1.0)
        gflops = flops / best_cpu_time(fn) / 1e9
        measured.append(dict(s=s, d=d, causal=causal, mode=name, gflops=gflops, pct=gflops / peak,
                             of_bound=gflops / peak / bound(d, backward=backward)))
        m = measured[-1]
        print(f"{s:6d} {d:4d}  {str(causal):6} {name:4}  {gflops:8.1f}  {m['pct']:9.1%}  {m['of_bound']:10.1%}")
# The peak is probed again after the kernels ran: on a machine shared with other work (or a vCPU
# whose SMT sibling is busy) one probe can fall well short of the roof the kernels then reach.
peak_after = max(nk.fma_peak_gflops(1) for _ in range(5))
if peak_after > peak:
    print(f"FMA peak probed again after the kernels: {peak_after:.0f} GFLOP/s (was {peak:.0f})")
roof = max(peak, peak_after)
check(all(m["gflops"] < 1.25 * roof for m in measured),
      "no kernel beats the measured FMA peak (physics; 25 % for the probes' noise on a shared machine)")

# %% [markdown]
# ## AVX2 beside AVX-512
#
# The same kernels are built for each instruction set from one source: `csrc/simd.h` is the only file
# that knows the vector width. AVX-512 has 32 registers of 16 floats, AVX2 16 registers of 8, so the
# micro-GEMM's register block shrinks (fewer rows of accumulators: `TA_MR` in `simd.h`) and every
# vector instruction does half the work: at the same clock an AVX2 core's FMA peak is half an AVX-512
# core's (AVX-512 cores often run a lower clock, which narrows the gap). The roofline does not care which: what matters is the *share* of its own peak a build
# reaches. Two committed measurements, one per instruction set, put them side by side
# (`benchmarks/results/roofline.json`, Sapphire Rapids with AVX-512; `cpu_targets_avx2.json`, AMD
# Zen 3 with AVX2 only; both one thread, thread CPU time):

# %%
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "results")
with open(os.path.join(RESULTS, "roofline.json")) as f:
    wide = json.load(f)
with open(os.path.join(RESULTS, "cpu_targets_avx2.json")) as f:
    narrow = json.load(f)
wide_rows = {(r["seqlen"], r["head_dim"], r["causal"]): r for r in wide["rows"]
             if r["section"] == "roofline" and r["threads"] == 1 and r["dtype"] == "fp32" and r["mode"] == "fwd"}
print(f"AVX-512: {wide['info']['cpu']}, one-core FMA peak {wide['info']['fma_peak_1']:.0f} GFLOP/s")
print(f"AVX2:    {narrow['meta']['cpu']} ({narrow['meta']['isa']} build), one-core FMA peak "
      f"{narrow['meta']['fma_peak_gflops']:.0f} GFLOP/s")
print("fp32 forward        AVX-512 GFLOP/s  % peak   AVX2 GFLOP/s  % peak   AVX2 vs SDPA")
side = []
for r in narrow["rows"]:
    if r["section"] != "fp32" or r["mode"] != "fwd":
        continue
    seq, hd, kind = r["shape"].split()
    key = (int(seq[1:]), int(hd[1:]), kind == "causal")
    w = wide_rows[key]
    side.append((r["shape"], w["pct_fma_peak"], r["pct_peak"]))
    print(f"{r['shape']:20} {w['gflops']:14.0f}  {w['pct_fma_peak']:6.0f}  {r['gflops']:12.0f}  {r['pct_peak']:6.0f}"
          f"   {r['ratio']:.2f}x")
check(wide["info"]["fma_peak_1"] > 1.4 * narrow["meta"]["fma_peak_gflops"],
      "an AVX-512 core's FMA peak is well above an AVX2 core's (twice the lanes per instruction)")
check(all(a > 60 and b > 60 for name, a, b in side if "S4096" in name),
      "at S 4096 both builds run the forward at more than 60 % of their own machine's FMA peak")
print(f"this machine's build: {info['isa']}")

# %% [markdown]
# Both builds reach a similar share of their own roof (70-80 % on long sequences), so the AVX2
# build's absolute speed follows its core's peak (104 against 162 GFLOP/s for these two machines). Against SDPA on the same AVX2 CPU the dense
# shapes sit near 1.0x (SDPA's GEMMs are MKL's, at the same share of the same peak) and causal ones
# gain from the skipped tiles; `docs/performance.md` ("Every CPU: the targets on AVX2") has the
# whole table, decode and the fp8 caches included.

# %% [markdown]
# ## Where the time goes: the profiling build
#
# `TILEATTN_NATIVE_PROFILE=1` builds the same sources with `-DTA_PROFILE=1` into a library of its
# own (in every other build the counters compile to nothing). Each thread adds the time-stamp
# ticks of every phase of every tile to its counters; `kernels.profile()` returns them and clears
# them. A task during which the thread was preempted is left out (its phases would carry the whole
# time slice of another job). The build is chosen when the library loads, so the profile runs in a
# child process.

# %%
PROFILE_CHILD = r"""
import json, sys, torch
from tileattn.backends.native import checked, kernels as nk
torch.set_num_threads(1)
H, s, threads = (int(x) for x in sys.argv[1:4])
out = []
for d in (32, 64, 128):
    for causal in (False, True):
        q, k, v = (torch.randn(1, H, s, d) for _ in range(3))
        o, lse, do = torch.empty_like(q), torch.empty(1, H, s), torch.randn(1, H, s, d)
        kw = dict(scale=d ** -0.5, right=0 if causal else -1, num_threads=threads)
        checked.forward(q, k, v, o, lse, **kw); nk.profile()
        for _ in range(3): checked.forward(q, k, v, o, lse, **kw)
        fwd = nk.profile()
        delta = (do * o).sum(-1)
        g = [torch.empty_like(t) for t in (q, k, v)]
        checked.backward(q, k, v, o, do, lse, delta, *g, **kw); nk.profile()
        for _ in range(2): checked.backward(q, k, v, o, do, lse, delta, *g, **kw)
        out.append(dict(d=d, causal=causal, fwd=fwd, bwd=nk.profile()))
print(json.dumps(out))
"""
S_PROF = pick(512, 2048)
res = subprocess.run([sys.executable, "-c", PROFILE_CHILD, str(H), str(S_PROF), "1"], capture_output=True,
                     text=True, env=dict(os.environ, TILEATTN_NATIVE_PROFILE="1"), timeout=600)
if res.returncode:
    raise SystemExit(res.stderr[-2000:])
profiles = json.loads(res.stdout.strip().splitlines()[-1])

GEMMS = {"fwd": ("scores", "pv"), "bwd": ("scores", "dp", "dv", "dk", "dq")}


def shares(counters, mode):
    """Phase -> share of the time the phases counted (in tasks that ran unpreempted). On a loaded
    machine a task can also lose time between phases, which no phase owns: shares of the counted
    time say where the kernel's own work goes whatever the load."""
    phases = {k[4:]: v for k, v in counters.items() if k.startswith(mode + "_") and v}
    tot = max(sum(phases.values()), 1)
    return {k: v / tot for k, v in phases.items()}


for p in profiles:
    for mode in ("fwd", "bwd"):
        sh = shares(p[mode], mode)
        line = "  ".join(f"{k} {v:5.1%}" for k, v in sorted(sh.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        print(f"D={p['d']:3d} {'causal' if p['causal'] else 'dense ':6} {mode}: {line}")
gemm_share = {(p["d"], p["causal"], m): sum(shares(p[m], m).get(g, 0) for g in GEMMS[m])
              for p in profiles for m in ("fwd", "bwd")}
softmax_share = {p["d"]: shares(p["fwd"], "fwd").get("softmax", 0) for p in profiles if not p["causal"]}
check(all(v > 0.6 for (d, _, _), v in gemm_share.items() if d >= 64), "for D >= 64 the GEMMs take most of every call")
check(softmax_share[32] > softmax_share[128], "the softmax's share shrinks as the head dim grows (the bound above)")
check(all(p[m]["task"] <= p[m]["task_all"] <= p[m]["region"] for p in profiles for m in ("fwd", "bwd")),
      "tasks never take more than the parallel region offered")

# %% [markdown]
# What the profile led to (each step measured against the one before, in one interleaved run):
#
# * the two GEMMs of a tile ran at ~75-84 % of the peak at S = 4096 against ~97 % with the same
#   data hot in L2: a head's K and V outgrow L2, and the first panel of every tile waited for them.
#   The GEMMs now **prefetch the next tile's K and V rows into L2** while they compute;
# * **wider query blocks** (up to 512 rows, as many as fit 3/4 of this core's L2) stream K and V
#   fewer times per FLOP;
# * each panel of 32 query rows handles **only the keys it can see** and goes scores -> softmax ->
#   P.V while its scores are still in L1: on the causal diagonal the hidden half of a tile is not
#   computed, in the backward too (where dK/dV sum only over the panels that see a key block);
# * the query packing and the writing of the output go through VW x VW register transposes.

# %% [markdown]
# ## The schedule on many cores
#
# A forward call is cut into tasks of one query block of one kv head; the block is as wide as L2
# allows **and** narrow enough that every thread gets at least four tasks. The tile grid is fixed
# (tiles start at multiples of the tile size), so the block width never changes a bit of the
# result. Threads take the tasks longest first; a causal call's tasks differ in cost (late query
# blocks see more keys), which the longest-first order absorbs.
# `tileattn/backends/native/schedule.py` models exactly this, and the profiling build's task count
# tells whether the model and the C plan agree.

# %%
PLAN_CHILD = r"""
import json, sys, torch
from tileattn.backends.native import checked, kernels as nk
H, s, d, threads = (int(x) for x in sys.argv[1:5])
q, k, v = (torch.randn(1, H, s, d) for _ in range(3))
o, lse = torch.empty_like(q), torch.empty(1, H, s)
nk.profile()
checked.forward(q, k, v, o, lse, scale=0.1, num_threads=threads)
print(json.dumps(nk.profile()["tasks"]))
"""
l2 = nk.l2_bytes()  # what the kernels size their blocks by
for threads in (1, 2, 3):
    s, d = pick(1024, 4096), 64
    res = subprocess.run([sys.executable, "-c", PLAN_CHILD, str(H), str(s), str(d), str(threads)], capture_output=True,
                         text=True, env=dict(os.environ, TILEATTN_NATIVE_PROFILE="1"), timeout=600)
    tasks = json.loads(res.stdout.strip().splitlines()[-1])
    model = len(forward_tasks(s, H, d, threads=threads, l2_bytes=l2))
    rows, _ = forward_block(d, d, H, [s], threads, l2)
    print(f"{threads} thread(s): {tasks:.0f} tasks run, the model plans {model} (blocks of {rows} query rows)")
    check(tasks == model, f"the schedule model matches the C plan on {threads} thread(s)")

print("\nthreads  S      H  causal  fwd tasks/thread  fwd makespan/ideal  bwd makespan/ideal")
worst = {}
for threads in (2, 4, 8, 16, 32, 64):
    for s in (2048, 8192, 32768):
        for h in (8, 32):
            for causal in (False, True):
                f = forward_tasks(s, h, 128, causal=causal, threads=threads, l2_bytes=l2)
                b = backward_tasks(s, h, causal=causal, threads=threads)
                fi, bi = simulate(f, threads), simulate(b, threads)
                worst[threads] = max(worst.get(threads, (1, 1)), (fi, bi))
                if s == 8192 and h == 8:
                    print(f"{threads:7d}  {s:5d} {h:3d}  {str(causal):6}  {len(f) / threads:16.1f}  {fi:18.3f}  {bi:18.3f}")
check(all(fi < 1.1 for fi, _ in worst.values()), "the forward's schedule stays within 10% of ideal up to 64 threads")

# %% [markdown]
# The forward keeps every thread busy because the block width adapts (512 rows on 2 cores, down to
# 32 on 64 cores for short sequences): the price on big machines is per-core efficiency, since
# narrower blocks stream K and V from L3 more often per FLOP. The backward runs one task per kv head
# (five GEMMs a tile, no atomics) while there are two heads per thread, and otherwise splits into
# key-block tasks (dK, dV) and query-block tasks (dQ) at seven GEMMs a tile instead of five: the
# parallelism costs 40 % more arithmetic, which is why a backward with few heads on many cores is
# the case to watch.

# %%
fig, (ax1, ax2) = figure(1, 2, figsize=(13, 4.8))
labels = [f"S{m['s']} D{m['d']}{' causal' if m['causal'] else ''} {m['mode']}" for m in measured]
ax1.barh(range(len(measured)), [100 * m["pct"] for m in measured],
         color=["C0" if m["mode"] == "fwd" else "C1" for m in measured], label="achieved")
ax1.scatter([100 * bound(m["d"], backward=m["mode"] == "bwd") for m in measured], range(len(measured)),
            marker="|", s=300, color="k", label="bound: FMA + exp2 roofs")
ax1.axvline(100, color="k", lw=0.8)
ax1.set_yticks(range(len(measured)), labels, fontsize=8)
ax1.invert_yaxis()
ax1.set_xlabel(f"% of the FMA peak ({peak:.0f} GFLOP/s, 1 core)")
ax1.set_title("achieved against the roofs")
ax1.legend(fontsize=8, loc="lower right")
names = ["pack", "scores", "dp", "mods", "softmax", "probs", "pv", "dv", "dk", "dq", "finish", "store"]
COLORS = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
          "#c5b0d5", "#8c564b", "#c49c94"]
bars = [(f"D{p['d']}{' c' if p['causal'] else ''} {m}", shares(p[m], m)) for p in profiles for m in ("fwd", "bwd")]
left = [0.0] * len(bars)
for i, name in enumerate(names):
    vals = [100 * sh.get(name, 0.0) for _, sh in bars]
    if any(vals):
        ax2.barh(range(len(bars)), vals, left=left, label=name, color=COLORS[i])
        left = [a + b for a, b in zip(left, vals)]
ax2.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
ax2.invert_yaxis()
ax2.set_xlabel("% of the task time (profiling build)")
ax2.set_title(f"where the time goes (S={S_PROF}, 1 core)")
ax2.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
save_figure(fig, "14_roofline.png")

# %% [markdown]
# ![roofline](../../docs/hub/14_roofline.png)
#
# ## Exercises
#
# 1. Lower the degree of the exp2 polynomial in `csrc/simd.h` by one and re-run the bound and the
#    profile: how much of the softmax's share comes back at D = 64, and what does the accuracy rule
#    (`tests/test_native_kernels.py`) say?
# 2. Run the profile child on 2 threads (its third argument): where does the idle time
#    (`region - task`) come from, and does it shrink for causal calls when the sequence grows?
# 3. With `schedule.py`, find the smallest sequence length at which 64 threads keep blocks of at
#    least 128 query rows for 8 heads. What happens to the backward there?
# 4. Set `block_m=32` and `block_n=64` in a `checked.forward` call on a long sequence and compare its
#    GFLOP/s with the defaults: which of the profile's phases grows?
