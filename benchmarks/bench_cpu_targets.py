"""The CPU targets of one machine in one interleaved run: tileattn against PyTorch SDPA on the same
machine, one thread, the calling thread's CPU time (a shared machine's other jobs do not count).

    python benchmarks/bench_cpu_targets.py                  # -> benchmarks/results/cpu_targets_<isa>.{csv,json}
    python benchmarks/bench_cpu_targets.py --quick          # tiny sizes, seconds

On an AVX-512 machine, the AVX2 case is forced with ``TILEATTN_NATIVE_ISA=avx2
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (SDPA restricted the same way, as an AVX2-only
CPU runs it). Sections (docs/performance.md, "Every CPU: the targets"):

* ``fp32``: B 1, H 2, S 1024/4096 x D 64/128 x dense/causal, forward and forward+backward;
  GFLOP/s of the useful work (backward counted as 2.5x the forward) and its share of the native
  library's one-core FMA probe;
* ``bf16``: the same shapes, forward, against SDPA in bf16;
* ``decode``: B 1, 32/8 heads, D 128, one query token over 128-16k keys, fp32 and bf16;
* ``fp8``: that decode over 4k keys with e4m3 and e5m2 caches (per-token scales) against
  tileattn's own bf16 decode of the same cache.

Each row: medians of interleaved repetitions (the contenders round-robin, the start rotating), the
spread ((max - min) / median) and the ratio (> 1: tileattn faster). The CPU, the ISA the native engine
runs and the load average before and after are in the JSON's ``meta``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tileattn
from tileattn.backends.native import kernels as native_kernels
from tileattn.serving import quantise
from tileattn.tools import measure

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def flops(s_q, s_k, d, heads, causal, mode):
    pairs = s_q * s_k if not causal else s_q * (s_q + 1) / 2
    fwd = 4 * pairs * d * heads
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def contenders(q, k, v, causal, mode, **kw):
    """tileattn and SDPA on the same tensors; fwd+bwd runs the backward of the output's sum."""
    def ours():
        return tileattn.flash_attention(q, k, v, causal=causal, backend="native", **kw)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    if mode == "fwd":
        return dict(tileattn=lambda: ours(), sdpa=lambda: sdpa())

    def backward(fn):
        def step():
            for t in (q, k, v):
                t.grad = None
            fn().sum().backward()
        return step

    return dict(tileattn=backward(ours), sdpa=backward(sdpa))


def timed(calls, reps, clock):
    samples = measure.time_interleaved(calls, reps=reps, warmup=1, clock=clock)
    return {n: (measure.median(s), measure.spread_pct(s)) for n, s in samples.items()}


def dense_rows(args, clock, peak):
    rows = []
    grid = [(s, d, c) for s in args.seqs for d in args.dims for c in (False, True)]
    for dtype, modes in (("fp32", ("fwd", "fwd+bwd")), ("bf16", ("fwd",))):
        for mode in modes:
            for s, d, causal in grid:
                g = torch.Generator().manual_seed(s + d)
                grad = mode == "fwd+bwd"
                q, k, v = (torch.randn(1, args.heads, s, d, generator=g).to(getattr(torch, {"fp32": "float32",
                           "bf16": "bfloat16"}[dtype])).requires_grad_(grad) for _ in range(3))
                reps = args.reps if s * d <= 1024 * 128 else max(3, args.reps // 2)
                got = timed(contenders(q, k, v, causal, mode), reps, clock)
                work = flops(s, s, d, args.heads, causal, mode)
                (t, spread), (base, base_spread) = got["tileattn"], got["sdpa"]
                rows.append(dict(section=dtype, mode=mode, shape=f"S{s} D{d} {'causal' if causal else 'dense'}",
                                 tileattn_ms=round(t * 1e3, 3), sdpa_ms=round(base * 1e3, 3),
                                 spread_pct=round(max(spread, base_spread), 1), ratio=round(base / t, 3),
                                 gflops=round(work / t / 1e9, 1), pct_peak=round(100 * work / t / 1e9 / peak, 1)))
                print(_line(rows[-1]), flush=True)
    return rows


def decode_rows(args, clock):
    rows = []
    hq, hkv, d = 32, 8, 128
    for dtype in (torch.float32, torch.bfloat16):
        for keys in args.keys:
            g = torch.Generator().manual_seed(keys)
            q = torch.randn(1, hq, 1, d, generator=g).to(dtype)
            k, v = (torch.randn(1, hkv, keys, d, generator=g).to(dtype) for _ in range(2))
            got = timed(contenders(q, k, v, False, "fwd"), args.decode_reps, clock)
            (t, spread), (base, base_spread) = got["tileattn"], got["sdpa"]
            name = "fp32" if dtype == torch.float32 else "bf16"
            rows.append(dict(section="decode", mode=name, shape=f"32/8 heads D128, {keys} keys",
                             tileattn_ms=round(t * 1e3, 4), sdpa_ms=round(base * 1e3, 4),
                             spread_pct=round(max(spread, base_spread), 1), ratio=round(base / t, 3),
                             gflops=None, pct_peak=None))
            print(_line(rows[-1]), flush=True)
    keys = args.keys[-2] if len(args.keys) > 1 else args.keys[0]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, hq, 1, d, generator=g).bfloat16()
    k, v = (torch.randn(1, hkv, keys, d, generator=g) for _ in range(2))
    calls = dict(bf16=lambda kb=k.bfloat16(), vb=v.bfloat16(): tileattn.flash_attention(q, kb, vb, backend="native"))
    for fmt, name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2"), (torch.int8, "int8")):
        (kq, ks, _), (vq, vs, _) = (quantise(t, fmt) for t in (k, v))
        calls[name] = (lambda kq=kq, vq=vq, ks=ks, vs=vs:
                       tileattn.flash_attention(q, kq, vq, k_scale=ks, v_scale=vs, backend="native"))
    got = timed(calls, args.decode_reps, clock)
    base = got["bf16"][0]
    for name in ("e4m3", "e5m2", "int8"):
        t, spread = got[name]
        rows.append(dict(section="fp8", mode=name, shape=f"32/8 heads D128, {keys} keys, per-token scales",
                         tileattn_ms=round(t * 1e3, 4), sdpa_ms=None, spread_pct=round(spread, 1),
                         ratio=round(base / t, 3), gflops=None, pct_peak=None))
        print(_line(rows[-1]) + "  (ratio against tileattn's own bf16)", flush=True)
    return rows


def _line(r):
    return (f"{r['section']:7} {r['mode']:8} {r['shape']:40} tileattn {r['tileattn_ms']:>10} ms  "
            f"sdpa {r['sdpa_ms'] if r['sdpa_ms'] is not None else '-':>10} ms  {r['ratio']:.2f}x"
            + (f"  {r['pct_peak']}% of peak" if r.get("pct_peak") else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--decode-reps", type=int, default=15)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--out", help="output path without suffix (default benchmarks/results/cpu_targets_<isa>)")
    args = p.parse_args()
    args.heads = 2
    args.seqs, args.dims, args.keys = ((256,), (64,), (128, 1024)) if args.quick else \
        ((1024, 4096), (64, 128), (128, 1024, 4096, 16384))
    if args.quick:
        args.reps, args.decode_reps = 2, 3
    torch.set_num_threads(1)
    isa = native_kernels.build_info()["isa"]
    peak = native_kernels.fma_peak_gflops(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    load_before = os.getloadavg()
    print(f"{cpu_name()}; native ISA {isa}; one-core FMA peak {peak:.0f} GFLOP/s; torch {torch.__version__}; "
          f"1 thread, {args.clock} clock; load {load_before}")
    rows = dense_rows(args, clock, peak) + decode_rows(args, clock)
    meta = dict(cpu=cpu_name(), isa=isa, fma_peak_gflops=round(peak, 1), torch=torch.__version__, threads=1,
                clock=args.clock, load_before=load_before, load_after=os.getloadavg(),
                aten_capability=os.environ.get("ATEN_CPU_CAPABILITY"),
                mkl_instructions=os.environ.get("MKL_ENABLE_INSTRUCTIONS"), when=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                                  time.gmtime()))
    out = args.out or RESULTS / f"cpu_targets_{isa}{'_quick' if args.quick else ''}"
    measure.write_results(out, rows, meta)
    print(f"wrote {Path(out).with_suffix('.csv')}")


if __name__ == "__main__":
    main()
