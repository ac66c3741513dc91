"""The wheel's prebuilt native libraries against builds compiled here with -march=native (issue 37).

    python benchmarks/bench_prebuilt.py --out benchmarks/results/prebuilt_vs_native
    python benchmarks/bench_prebuilt.py --quick            # tiny shapes, seconds (the test)
    python benchmarks/bench_prebuilt.py --prebuilt DIR     # an installed wheel's prebuilt/ folder

For each variant this CPU runs (avx512, avx2, generic), the prebuilt library (explicit flags:
:data:`tileattn.backends.native.prebuilt.LEVELS`; compiled into a temporary folder unless
``--prebuilt`` names a folder of them) and the variant compiled here as the compile-on-first-use path
does (``-march=native``, ``-mno-avx512f`` below avx512) are loaded side by side in this process and
timed interleaved (one round calls every library once, the starting library rotating), forward only,
on a small grid: B=1, H=4, S 1024/4096, D 64/128, fp32, bf16 and bf16 without AMX, not causal. One thread and thread
CPU time by default (other jobs on a shared machine barely move it); the minimum and the median of
the repetitions are kept. The load average before and after goes into the JSON; the CSV has one row
per case and variant with ``prebuilt_ms``, ``native_ms`` and ``native_speedup`` (prebuilt time over
native time, from the minima: > 1 means the native build is faster).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tileattn.backends.native import build, kernels as nk, prebuilt
from tileattn.core.kernel_args import KernelArgs
from tileattn.programs import toolchain
from tileattn.tools.measure import time_interleaved

#: bf16-noamx: bf16 with the AMX tiles off (options NO_AMX), as on a Sapphire Rapids whose kernel or
#: hypervisor does not grant AMX; avx512 only (the other variants have no AMX path)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-noamx": torch.bfloat16}


def libraries(prebuilt_dir: Path) -> dict:
    """{variant: {"prebuilt": _Library, "native": _Library}} for the variants this CPU runs."""
    cc = tuple(build.find_compiler())
    flags = prebuilt.cpu_flags()
    out = {}
    for level in prebuilt.LEVELS:
        missing = [f for f in level.cpu if f not in flags]
        if missing:
            print(f"{level.isa}: skipped, this CPU lacks {', '.join(missing)}", flush=True)
            continue
        if isinstance(toolchain.variant(cc, level.isa), str):
            print(f"{level.isa}: skipped, no native build here: {toolchain.variant(cc, level.isa)}", flush=True)
            continue
        info, why = prebuilt.verified(prebuilt_dir / level.isa)
        if info is None:
            raise SystemExit(f"{level.isa}: {why}")
        out[level.isa] = {"prebuilt": nk._Library(info), "native": nk._Library(build.build(isa=level.isa))}
    return out


def run_case(libs: dict, s: int, d: int, dtype: str, threads: int, reps: int, clock) -> list:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, s, d, generator=gen).to(DTYPES[dtype]) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 4, s)
    if dtype == "bf16-noamx":
        libs = {isa: pair for isa, pair in libs.items() if isa == "avx512"}
    options = nk.NO_AMX if dtype == "bf16-noamx" else 0
    contenders = {}
    for isa, pair in libs.items():
        for source, lib in pair.items():
            def call(lib=lib):
                nk._state["lib"] = lib
                nk.forward(q, k, v, out, lse, KernelArgs(scale=d ** -0.5),
                           tiles=nk.Tiles(num_threads=threads, options=options))
            contenders[(isa, source)] = call
    times = time_interleaved(contenders, reps, warmup=1, clock=clock)
    rows = []
    for isa in libs:
        pre, nat = times[(isa, "prebuilt")], times[(isa, "native")]
        rows.append(dict(isa=isa, s=s, d=d, dtype=dtype, threads=threads, reps=reps,
                         prebuilt_ms=round(min(pre) * 1e3, 3), native_ms=round(min(nat) * 1e3, 3),
                         prebuilt_median_ms=round(statistics.median(pre) * 1e3, 3),
                         native_median_ms=round(statistics.median(nat) * 1e3, 3),
                         native_speedup=round(min(pre) / min(nat), 3)))
        r = rows[-1]
        print(f"{isa:8} S={s:5} D={d:3} {dtype:10}  prebuilt {r['prebuilt_ms']:9.2f} ms  native {r['native_ms']:9.2f} ms"
              f"  native/prebuilt speed {r['native_speedup']:.3f}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write OUT.csv and OUT.json")
    p.add_argument("--prebuilt", default=None, help="folder of prebuilt variants (default: compile them now)")
    p.add_argument("--threads", type=int, default=1, help="threads per call (default 1: thread CPU time)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"some of {', '.join(DTYPES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="S=256, D=64, 2 repetitions")
    args = p.parse_args(argv)
    unknown = [t for t in args.dtypes.split(",") if t not in DTYPES]
    if unknown:
        p.error(f"argument --dtypes: got {', '.join(unknown)}; expected some of {', '.join(DTYPES)}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.prebuilt) if args.prebuilt else Path(tmp)
        if not args.prebuilt:
            start = time.perf_counter()
            prebuilt.compile_all(folder, tuple(build.find_compiler()))
            print(f"prebuilt variants compiled in {time.perf_counter() - start:.1f} s", flush=True)
        libs = libraries(folder)
        grid = [(256, 64, "fp32")] if args.quick else \
            [(s, d, t) for t in args.dtypes.split(",") for s in (1024, 4096) for d in (64, 128)]
        rows = [r for s, d, t in grid for r in run_case(libs, s, d, t, args.threads, 2 if args.quick else args.reps,
                                                        clock)]
        flags = prebuilt.cpu_flags()
        meta = dict(cpu=platform.processor() or platform.machine(), model=_model(),
                    amx="amx_bf16" in flags and any(p["native"].amx_available() for p in libs.values()),
                    avx512_bf16="avx512_bf16" in flags, load_before=load_before, load_after=os.getloadavg(),
                    cores=os.cpu_count(), threads=args.threads, torch=torch.__version__,
                    libraries={isa: {src: dict(flags=" ".join(lib.info.flags), path=lib.info.path)
                                     for src, lib in pair.items()} for isa, pair in libs.items()})
    print(f"load average before {load_before}, after {meta['load_after']}")
    if args.out:
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        Path(args.out + ".json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    return 0


def _model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
