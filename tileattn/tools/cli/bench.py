"""``tileattn bench``: interleaved timing of attention providers over sequence lengths.

A preset gives every setting; any explicit option overrides it. Each cell (sequence length, causal,
mode) times all providers round-robin, so noise hits them alike. Reported per provider: median
time, spread ((max - min) / median), throughput (attention FLOPs: ``AttentionSpec.flops()``,
backward = 2.5x forward), measured peak extra memory and speed-up against the baseline.
"""

from __future__ import annotations

from typing import List

from .common import (CliError, add_measure_outputs, check_memory, check_writable, fmt_bytes, fmt_num, format_table,
                     int_arg, parse_device, parse_dtype, parse_names, parse_positive_ints, pyplot, tensor_bytes,
                     write_csv, write_json)

HELP = "time tileattn against SDPA, naive attention and others"

#: Providers per device: on CPU, tileattn as dispatch runs it (the native engine where its kernels
#: build), the PyTorch-ops engine it falls back to, PyTorch's SDPA and naive attention.
PROVIDERS_BY_DEVICE = {"cpu": ["tileattn", "cpu", "sdpa", "naive"], "cuda": ["triton", "sdpa", "naive"]}
PRESETS = {
    "readme": dict(batch=1, heads=8, seqlens=[1024, 2048], head_dim=64, dtype="fp32", modes=["fwd", "fwd+bwd"],
                   causal=[False, True], reps=3, warmup=1, baseline="sdpa", providers=PROVIDERS_BY_DEVICE),
    "llama-7b": dict(batch=1, heads=32, seqlens=[512, 1024, 2048], head_dim=128, dtype="fp32", modes=["fwd", "fwd+bwd"],
                     causal=[True], reps=3, warmup=1, baseline="sdpa", providers=PROVIDERS_BY_DEVICE),
    "quick": dict(batch=1, heads=2, seqlens=[64, 128], head_dim=32, dtype="fp32", modes=["fwd", "fwd+bwd"],
                  causal=[False], reps=2, warmup=1, baseline="sdpa", providers=PROVIDERS_BY_DEVICE),
}
DEFAULTS = dict(batch=1, heads=8, seqlens=[1024], head_dim=64, dtype="fp32", modes=["fwd"], causal=[False],
                reps=5, warmup=1, baseline="sdpa", providers=PROVIDERS_BY_DEVICE)

#: Fields of every CSV row / JSON result (documented in docs/cli.md).
FIELDS = ["provider", "engine", "device", "dtype", "batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "causal", "mode",
          "status", "note", "reps", "median_ms", "min_ms", "max_ms", "spread_pct", "flops", "gflops_per_s",
          "peak_mem_mib", "baseline", "speedup"]


def add_parser(subparsers):
    from ..bench import MODES, PROVIDERS

    p = subparsers.add_parser("bench", help=HELP, description=HELP + ".")
    p.add_argument("--preset", choices=sorted(PRESETS) + ["decode"],
                   help="readme, llama-7b, quick or decode (one query token against a KV cache: "
                        "--batch and --seqlens (cache lengths), --dtype, --reps, --warmup, --csv, --json, --quiet "
                        "apply); options below override it")
    p.add_argument("--batch", type=int_arg(1), help="batch size")
    p.add_argument("--heads", type=int_arg(1), help="number of heads")
    p.add_argument("--seqlens", help="comma-separated sequence lengths, e.g. 512,1024")
    p.add_argument("--head-dim", type=int_arg(1), help="head dimension")
    p.add_argument("--dtype", help="fp32, fp16, bf16 or fp64")
    p.add_argument("--causal", action="store_true", default=None, help="causal only")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="non-causal only")
    p.add_argument("--mode", help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--providers", help=f"comma-separated subset of {', '.join(PROVIDERS)}")
    p.add_argument("--baseline", help="provider the speed-up is relative to (default sdpa; 'none' for no column)")
    p.add_argument("--reps", type=int_arg(1), help="timed repetitions per provider and cell")
    p.add_argument("--warmup", type=int_arg(0), help="untimed repetitions before timing")
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement call")
    return add_measure_outputs(p, run, "provider and cell", "the run's settings, machine and results",
                               "throughput against sequence length")


def settings_from_args(args) -> dict:
    """The preset (or defaults) with explicit options applied, validated; raises CliError."""
    from ..bench import MODES, PROVIDERS

    device = parse_device(args.device)
    base = PRESETS[args.preset] if args.preset else DEFAULTS
    s = {k: v for k, v in base.items() if k != "providers"}
    s["providers"] = list(base["providers"]["cuda" if device.startswith("cuda") else "cpu"])
    s["device"] = device
    for name in ("batch", "heads", "head_dim", "reps", "warmup"):
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    if args.seqlens is not None:
        s["seqlens"] = parse_positive_ints(args.seqlens, "--seqlens", what="comma-separated positive ints, e.g. 512,1024")
    if args.dtype is not None:
        s["dtype"] = args.dtype
    parse_dtype(s["dtype"])
    if args.causal is not None:
        s["causal"] = [args.causal]
    if args.mode is not None:
        s["modes"] = parse_names(args.mode, "--mode", MODES)
    if args.providers is not None:
        s["providers"] = parse_names(args.providers, "--providers", list(PROVIDERS))
    if args.baseline is not None:
        s["baseline"] = None if args.baseline == "none" else args.baseline
    if s["baseline"] is not None and s["baseline"] not in s["providers"]:
        if args.baseline is not None:
            raise CliError(f"argument --baseline: got {args.baseline!r}; expected one of the providers "
                           f"({', '.join(s['providers'])}) or 'none'")
        s["baseline"] = None
    s["memory"] = not args.no_memory
    return s


#: Providers that materialise the (B, H, S, S) scores, with how many such matrices they hold at once.
SCORE_MATRICES = {"naive": 4, "reference": 4}


def case_bytes(s: dict, itemsize: int) -> int:
    """Rough bytes of the largest case: q, k, v, the output and their gradients, plus the score
    matrices of providers that materialise them (in fp32 at least)."""
    longest = max(s["seqlens"])
    need = 8 * tensor_bytes((s["batch"], s["heads"], longest, s["head_dim"]), itemsize)
    copies = max((SCORE_MATRICES.get(p, 0) for p in s["providers"]), default=0)
    return need + copies * tensor_bytes((s["batch"], s["heads"], longest, longest), max(itemsize, 4))


def run(args) -> int:
    from .. import bench as B

    if args.preset == "decode":
        from .bench_decode import run_decode

        return run_decode(args)
    check_writable(args.csv, "--csv")
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot", ".png")
    s = settings_from_args(args)
    dtype = parse_dtype(s["dtype"])
    check_memory(case_bytes(s, dtype.itemsize), s["device"], f"B={s['batch']} H={s['heads']} "
                 f"S={max(s['seqlens'])} D={s['head_dim']} {s['dtype']} with {', '.join(s['providers'])}")
    cases = [B.Case(s["batch"], s["heads"], n, n, s["head_dim"], dtype, causal, mode, s["device"])
             for mode in s["modes"] for causal in s["causal"] for n in s["seqlens"]]
    per_case = B.calls_per_case(len(s["providers"]), s["reps"], s["warmup"])
    bar = B.Progress(per_case * len(cases), enabled=not args.quiet)
    results = []
    for i, case in enumerate(cases):
        label = f"S={case.seqlen_q} {case.mode}{' causal' if case.causal else ''}"
        results += B.run_case(case, s["providers"], s["reps"], s["warmup"], memory=s["memory"],
                              baseline=s["baseline"], on_step=lambda name: bar.step(f"{label} {name}"))
        bar.advance_to((i + 1) * per_case, label)
    bar.close()
    if all(r.status == "unsupported" for r in results):
        raise CliError("no provider can run these settings: " + "; ".join(sorted({f"{r.provider}: {r.note}" for r in results})))

    gpu = s["device"].startswith("cuda")
    print(f"tileattn bench{' --preset ' + args.preset if args.preset else ''}: B={s['batch']} H={s['heads']} "
          f"D={s['head_dim']} {s['dtype']} on {s['device']}, {s['reps']} reps (+{s['warmup']} warm-up), interleaved")
    print(render_table(results, s["baseline"], gpu))
    records = [r.as_record() for r in results]
    if args.csv:
        write_csv(args.csv, records, FIELDS)
    if args.json:
        from .env import collect

        env = collect()
        write_json(args.json, {"settings": {k: v for k, v in s.items()}, "preset": args.preset,
                               "versions": env["versions"], "machine": env["machine"], "results": records})
    if args.plot:
        plot_throughput(results, args.plot, f"B={s['batch']} H={s['heads']} D={s['head_dim']} {s['dtype']} {s['device']}", gpu)
    for path in (args.csv, args.json, args.plot):
        if path:
            print(f"wrote {path}")
    return 1 if any(r.status == "error" for r in results) else 0


def render_table(results, baseline, gpu: bool) -> str:
    """One row per result; an ``engine`` column when a provider ran as another engine (tileattn ->
    native)."""
    unit, scale = ("TFLOP/s", 1e12) if gpu else ("GFLOP/s", 1e9)
    engines = any(r.engine and r.engine != r.provider for r in results)
    headers = ["S", "causal", "mode", "provider"] + (["engine"] if engines else [])
    headers += ["median ms", "spread", unit, "peak mem"]
    if baseline:
        headers.append(f"vs {baseline}")
    headers.append("note")
    rows = []
    for r in results:
        row = [r.seqlen_q, "yes" if r.causal else "no", r.mode, r.provider] + ([r.engine or "-"] if engines else [])
        row += [fmt_num(r.median_ms), "-" if r.spread_pct is None else f"{r.spread_pct:.0f}%",
                fmt_num(None if r.flops_per_s is None else r.flops_per_s / scale), fmt_bytes(r.peak_mem_bytes)]
        if baseline:
            row.append("-" if r.speedup is None else f"{r.speedup:.2f}x")
        row.append("" if r.status == "ok" else f"{r.status}: {r.note}")
        rows.append(row)
    return format_table(headers, rows)


def plot_throughput(results, path: str, title: str, gpu: bool) -> None:
    """One panel per (mode, causal): throughput against sequence length, one line per provider."""
    plt = pyplot()
    unit, scale = ("TFLOP/s", 1e12) if gpu else ("GFLOP/s", 1e9)
    panels: List[tuple] = sorted({(r.mode, r.causal) for r in results}, key=lambda p: (p[0] != "fwd", p[0], p[1]))
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows + 0.4), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    # One colour per provider across all panels.
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {name: palette[i % len(palette)] for i, name in enumerate(dict.fromkeys(r.provider for r in results))}
    for ax, (mode, causal) in zip(axes.flat, panels):
        cell = [r for r in results if r.mode == mode and r.causal == causal and r.flops_per_s]
        for name in dict.fromkeys(r.provider for r in cell):
            mine = [r for r in cell if r.provider == name]
            pts = sorted((r.seqlen_q, r.flops_per_s / scale) for r in mine)
            ran = mine[0].engine
            label = f"{name} ({ran})" if ran and ran != name else name
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=colours[name])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}{', causal' if causal else ''}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        if cell:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
