"""Context-parallel benchmark: time and peak memory per rank against single-process attention.

    python benchmarks/bench_distributed.py            # the grid below, several minutes on 2 cores
    python benchmarks/bench_distributed.py --quick    # tiny sizes, seconds
    python benchmarks/bench_distributed.py --memory   # peak memory per rank against one process, 16k tokens

Each configuration runs in fresh processes (gloo, started by ``run_local``): ``single`` is one
process calling :func:`tileattn.flash_attention` on the whole sequence with every core; ``ring``,
``ulysses`` and ``hybrid`` are ``world`` processes, each holding its zigzag shard (drawn directly
at shard size, so no process ever holds the whole sequence) and calling
:func:`tileattn.distributed.context_parallel_attention`. Per rank it records, with
:mod:`tileattn.tools.measure`, the wall time of one call (forward, or forward and backward) and the
peak memory the call added (resident-set high-water mark: inputs excluded, outputs, gradients
and every buffer included), what the forward left resident (its output and what autograd saved
for the backward: across layers, that is what accumulates), and with ``count_collectives`` the
messages and bytes it sent and the time it sat waiting for them (communication that compute did
not hide). The bytes are checked against the analytic model of :mod:`tileattn.distributed.model`.

This machine has 2 cores: the ranks share them (1 thread each) where the single process has 2,
so times compare equal CPU budgets, not a speed-up; on 4 ranks the cores are oversubscribed, and
other jobs on the machine make single timings vary by 2x. What transfers to real clusters is the
memory per rank and the traffic.
Results: ``benchmarks/results/distributed_<tag>.csv`` and ``.json``.

``--memory``: the peak memory per rank of every mode on 2 and 4 ranks against one process over the
whole sequence (16k tokens, causal, 4 query / 2 kv heads, head dim 64), bf16 and fp32, forward and
forward + backward, one call each (memory does not depend on timing). The column ``peak_x_world``
is ``peak / single peak * world``: 1.0 is a rank holding exactly its 1/W share of one process's
peak. Results: ``benchmarks/results/distributed_memory.csv`` and ``.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tileattn
import tileattn.distributed as cp
from tileattn.tools import measure
from tileattn.distributed import model
from tileattn.distributed.launch import run_local

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FIELDS = ("mode", "world", "seqlen", "heads", "kv_heads", "head_dim", "dtype", "pass", "rank", "threads", "ms",
          "peak_mib", "peak_vs_single", "retained_mib", "retained_vs_single", "wait_ms", "messages", "sent_bytes",
          "model_bytes")


MEMORY_FIELDS = ("mode", "world", "seqlen", "heads", "kv_heads", "head_dim", "dtype", "pass", "rank", "peak_mib",
                 "single_peak_mib", "peak_x_world", "retained_mib", "messages", "sent_bytes")


def memory_grid():
    """(mode, world, seqlen, heads, kv_heads, pass, dtype) rows of the memory section."""
    modes = (("single", 1), ("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4), ("hybrid", 4))
    return [(m, w, 16384, 4, 2, passes, dtype) for dtype in ("bf16", "fp32") for passes in ("fwd", "fwd+bwd")
            for m, w in modes]


def grid(quick: bool):
    """(mode, world, seqlen, heads, kv_heads, pass) rows."""
    if quick:
        return [(m, w, 2048, 4, 2, "fwd+bwd") for m, w in (("single", 1), ("ring", 2), ("ulysses", 2), ("ring", 4),
                                                            ("hybrid", 4))]
    rows = []
    for s in (4096, 16384):
        rows += [(m, w, s, 4, 2, "fwd+bwd") for m, w in (("single", 1), ("ring", 2), ("ring", 4), ("ulysses", 2),
                                                          ("ulysses", 4), ("hybrid", 4))]
    for s in (32768, 65536):
        rows += [(m, w, s, 2, 2, "fwd") for m, w in (("single", 1), ("ring", 2), ("ring", 4))]
    return rows


def _call(mode, world, s, heads, kv_heads, d, dtype, passes, seed):
    """(zero-argument timed call, its inputs) on this rank."""
    gen = torch.Generator().manual_seed(seed)
    mesh = cp.hybrid_mesh(2, world // 2) if mode == "hybrid" else None
    local = s if mode == "single" else cp.ShardPlan.build(world, True, seq_len=s).local_len(dist.get_rank())
    grad = passes == "fwd+bwd"
    q = torch.randn(1, heads, local, d, generator=gen, dtype=dtype).requires_grad_(grad)
    k, v = (torch.randn(1, kv_heads, local, d, generator=gen, dtype=dtype).requires_grad_(grad) for _ in range(2))

    def attention():
        if mode == "single":
            return tileattn.flash_attention(q, k, v, causal=True)
        return cp.context_parallel_attention(q, k, v, causal=True, mode=mode, group=mesh, timeout=3600)

    retained = []

    def run():
        """One call; records what the forward left resident (its output and what autograd saved)."""
        before = measure.proc_status_bytes("VmRSS")
        with torch.set_grad_enabled(grad):
            out = attention()
        retained.append(measure.proc_status_bytes("VmRSS") - before)
        if grad:
            out.backward(torch.ones_like(out))
            for t in (q, k, v):
                t.grad = None

    return run, retained


def rank_job(row, d, dtype_name, reps):
    mode, world, s, heads, kv_heads, passes = row
    dtype = DTYPES[dtype_name]
    _call(mode, world, 512 * world, heads, kv_heads, d, dtype, passes, 1)[0]()  # warm-up: engine, connections
    run, retained = _call(mode, world, s, heads, kv_heads, d, dtype, passes, 2)
    with cp.count_collectives() as stats:
        t0 = time.perf_counter()
        _, peak = measure.peak_memory(run)
        first = time.perf_counter() - t0
    times = [first] + [measure.time_call(run) for _ in range(reps - 1)]
    return dict(ms=1e3 * measure.median(times), peak=peak, retained=retained[0], wait_ms=1e3 * stats.wait_s,
                messages=stats.count("send") + stats.count("all_to_all"),
                sent=stats.nbytes("send") + stats.nbytes("all_to_all"),
                threads=torch.get_num_threads())


def model_bytes(row, d, dtype_name):
    mode, world, s, heads, kv_heads, passes = row
    shape = model.Shape(s, heads, kv_heads, d, elem_bytes=DTYPES[dtype_name].itemsize)
    bwd = passes == "fwd+bwd"
    if mode == "ring":
        return model.ring_bytes(shape, world, backward=bwd)
    if mode == "ulysses":
        return model.ulysses_bytes(shape, world, backward=bwd)
    if mode == "hybrid":
        return sum(model.hybrid_bytes(shape, 2, world // 2, backward=bwd))
    return 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--tag", default=None, help="results file suffix (default: quick, full or memory)")
    ap.add_argument("--memory", action="store_true", help="only the peak-memory section")
    args = ap.parse_args(argv)
    tag = args.tag or ("memory" if args.memory else "quick" if args.quick else "full")
    cores = len(os.sched_getaffinity(0))
    # Every allocation above 64 KiB gets its own mapping, returned to the system when freed: the
    # resident set then follows live memory instead of what glibc's heap happens to keep.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    if args.memory:
        return memory_section(args.head_dim, tag, cores)
    out, t_start = [], time.perf_counter()
    single = {}
    for row in grid(args.quick):
        mode, world, s, heads, kv_heads, passes = row
        reps = 3 if args.quick or s <= 8192 else 1
        per_rank = run_local(rank_job, world, row, args.head_dim, args.dtype, reps, timeout=3600,
                             threads=max(1, cores // world))
        want = model_bytes(row, args.head_dim, args.dtype)
        for rank, r in enumerate(per_rank):
            if mode == "single":
                single[(s, heads, passes)] = (r["peak"], r["retained"])
            base, base_kept = single.get((s, heads, passes), (None, None))
            rec = dict(mode=mode, world=world, seqlen=s, heads=heads, kv_heads=kv_heads, head_dim=args.head_dim,
                       dtype=args.dtype, **{"pass": passes}, rank=rank, threads=r["threads"], ms=round(r["ms"], 1),
                       peak_mib=None if r["peak"] is None else round(r["peak"] / 2**20, 1),
                       peak_vs_single=None if not (base and r["peak"]) else round(r["peak"] / base, 3),
                       retained_mib=round(r["retained"] / 2**20, 1),
                       retained_vs_single=None if not base_kept else round(r["retained"] / base_kept, 3),
                       wait_ms=round(r["wait_ms"], 1), messages=r["messages"], sent_bytes=r["sent"],
                       model_bytes=int(want))
            out.append(rec)
            print(" ".join(f"{k}={rec[k]}" for k in ("mode", "world", "seqlen", "pass", "rank", "ms", "peak_mib",
                                                      "peak_vs_single", "retained_mib", "retained_vs_single",
                                                      "wait_ms", "sent_bytes", "model_bytes")),
                  flush=True)
            if mode != "single" and r["sent"] != int(want):
                raise SystemExit(f"measured traffic {r['sent']} B differs from the model's {int(want)} B: {rec}")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"distributed_{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(out)
    meta = dict(machine=measure.cpu_model(), cores=cores, torch=torch.__version__, backend="gloo",
                seconds=round(time.perf_counter() - t_start, 1), command=" ".join(sys.argv))
    (RESULTS / f"distributed_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=out), indent=1))
    print(f"wrote {RESULTS / f'distributed_{tag}.csv'} ({meta['seconds']} s)")


def memory_section(d, tag, cores):
    out, t_start, single = [], time.perf_counter(), {}
    for mode, world, s, heads, kv_heads, passes, dtype_name in memory_grid():
        row = (mode, world, s, heads, kv_heads, passes)
        per_rank = run_local(rank_job, world, row, d, dtype_name, 1, timeout=3600, threads=max(1, cores // world))
        want = model_bytes(row, d, dtype_name)
        for rank, r in enumerate(per_rank):
            if r["peak"] is None:
                raise SystemExit("no peak-memory counter on this system (Linux /proc/self/status and clear_refs)")
            if mode == "single":
                single[(passes, dtype_name)] = r["peak"]
            base = single[(passes, dtype_name)]
            rec = dict(mode=mode, world=world, seqlen=s, heads=heads, kv_heads=kv_heads, head_dim=d, dtype=dtype_name,
                       **{"pass": passes}, rank=rank, peak_mib=round(r["peak"] / 2**20, 2),
                       single_peak_mib=round(base / 2**20, 2), peak_x_world=round(r["peak"] / base * world, 3),
                       retained_mib=round(r["retained"] / 2**20, 2), messages=r["messages"], sent_bytes=r["sent"])
            out.append(rec)
            print(" ".join(f"{k}={rec[k]}" for k in MEMORY_FIELDS), flush=True)
            if mode != "single" and r["sent"] != int(want):
                raise SystemExit(f"measured traffic {r['sent']} B differs from the model's {int(want)} B: {rec}")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"distributed_{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=MEMORY_FIELDS)
        w.writeheader()
        w.writerows(out)
    meta = dict(machine=measure.cpu_model(), cores=cores, torch=torch.__version__, backend="gloo",
                seconds=round(time.perf_counter() - t_start, 1), command=" ".join(sys.argv))
    (RESULTS / f"distributed_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=out), indent=1))
    print(f"wrote {RESULTS / f'distributed_{tag}.csv'} ({meta['seconds']} s)")


if __name__ == "__main__":
    main()
