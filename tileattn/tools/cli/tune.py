"""``tileattn tune``: search tile configurations for one shape and store the winner for dispatch.

See :mod:`tileattn.tools.tuning` for the candidate grids, the budget model and the search itself.
"""

from __future__ import annotations

from .common import (CliError, check_memory, check_writable, check_writable_dir, fmt_bytes, fmt_num, format_table,
                     int_arg, parse_device, parse_dtype, parse_names, parse_shape, positive_float_arg,
                     resolve_backend, seed_arg, write_json)
from .verify import oracle_bytes

HELP = "tune an engine's tile sizes for one shape and store the winner"


def add_parser(subparsers):
    p = subparsers.add_parser("tune", help=HELP, description=HELP + " (used by dispatch afterwards).")
    p.add_argument("--shape", required=True, help="B,H,S,D, e.g. 1,8,1024,64")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16, bf16 or fp64")
    p.add_argument("--causal", action="store_true", help="tune the causal problem")
    p.add_argument("--backend", default=None, help="native, cpu or triton (default: triton on a GPU, else native "
                                                  "where its kernels build, else cpu)")
    p.add_argument("--budget-kib", type=positive_float_arg, default=None,
                   help="on-chip memory budget per task/program in KiB (default: L2 per core on CPU, "
                        "shared memory per block on GPU)")
    p.add_argument("--mode", default=None, help="what is timed: fwd or fwd+bwd (default fwd+bwd on the CPU "
                                               "engines, whose entry serves both passes; fwd on triton, whose "
                                               "tuned configuration is the forward one)")
    p.add_argument("--reps", type=int_arg(1), default=3, help="timed repetitions per candidate (default 3)")
    p.add_argument("--warmup", type=int_arg(0), default=1, help="untimed rounds first (default 1)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random inputs, 0..2**64-1 (default 0)")
    p.add_argument("--no-store", action="store_true", help="print the table but leave the cache alone")
    p.add_argument("--json", metavar="PATH", help="write every candidate with its verdict and timings")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


#: Engines that run on CPU tensors: tuned on the CPU, timing forward+backward by default.
CPU_ENGINES = ("native", "cpu")


def default_cpu_engine() -> str:
    """The engine ``auto`` prefers on CPU tensors: the native kernels where they build, else cpu."""
    from ...backends.native import kernels

    return "native" if kernels.available()[0] else "cpu"


def run(args) -> int:
    import torch

    from ...core import tunecache
    from .. import tuning
    from ..bench import Case, Progress
    from ...core.spec import build_spec

    b, h, s, d = parse_shape(args.shape)
    dtype = parse_dtype(args.dtype)
    device = parse_device("auto")
    name = args.backend or ("triton" if device == "cuda" else default_cpu_engine())
    backend = resolve_backend(name)
    if name not in tuning.SPACES:
        raise CliError(f"argument --backend: got {name!r}; tuning exists for {', '.join(tuning.SPACES)}")
    cpu_engine = name in CPU_ENGINES
    if cpu_engine:
        device = "cpu"
    mode = args.mode or ("fwd+bwd" if cpu_engine else "fwd")
    parse_names(mode, "--mode", ["fwd", "fwd+bwd"])
    if "," in mode:
        raise CliError(f"argument --mode: got {mode!r}; expected one of fwd, fwd+bwd")
    check_writable(args.json, "--json")
    if not args.no_store:  # before the search, not after minutes of it
        folder = tunecache.cache_dir()
        if tunecache.cache_path().is_dir():
            raise CliError(f"the tune cache {tunecache.cache_path()} is a folder; remove it, set TILEATTN_CACHE_DIR "
                           "to another folder or pass --no-store")
        check_writable_dir(folder, "the tune cache folder (TILEATTN_CACHE_DIR, or pass --no-store)", create=True)
    check_memory(oracle_bytes(b, h, s, d), device, f"--shape {args.shape}")

    case = Case(b, h, s, s, d, dtype, args.causal, mode, device)
    # A broadcast view describes the call without allocating it (rows are unit-stride, as real
    # inputs: an engine refuses calls its kernels cannot read).
    probe = torch.empty(d, dtype=dtype, device=device).expand(b, h, s, d)
    inp = build_spec(probe, probe, probe, causal=args.causal)
    why = backend.not_supported_reasons(inp)
    if why:
        raise CliError(f"backend {name!r} cannot run {args.dtype} shape {args.shape} here: {'; '.join(why)}")
    _, _, budget_of, model = tuning.SPACES[name]
    if args.budget_kib is not None:
        budget, source = max(1, int(args.budget_kib * 1024)), "--budget-kib"
    else:
        budget, source = budget_of(torch.device(device))

    n = len(tuning.SPACES[name][0](inp)) + 1
    bar = Progress(n * (1 + args.warmup + args.reps), enabled=not args.quiet)
    cands, winner, path = tuning.tune(name, case, budget, reps=args.reps, warmup=args.warmup, seed=args.seed,
                                      on_step=lambda label: bar.step(label), store_winner=not args.no_store)
    bar.advance_to(bar.total)
    bar.close()

    print(f"tileattn tune: backend {name}, shape B,H,S,D = {b},{h},{s},{d}, {args.dtype}, causal {args.causal}, "
          f"timing {mode}, {args.reps} reps")
    print(f"budget: {fmt_bytes(budget)} ({source}); model: {model}")
    current = next((c for c in cands if c.current and c.median_ms), None)
    keys = list(cands[0].config) if cands else []
    rows = []
    order = sorted(cands, key=lambda c: (c.median_ms is None, c.median_ms or 0.0))
    for c in order:
        speed = "-"
        if current is not None and c.median_ms:
            speed = f"{current.median_ms / c.median_ms:.2f}x"
        mark = ("winner" if c is winner else "") + (" current" if c.current else "")
        rows.append([c.config[k] for k in keys] + [
            fmt_bytes(c.working_set), c.status, fmt_num(c.max_error_ratio), fmt_num(c.median_ms),
            "-" if c.spread_pct is None else f"{c.spread_pct:.0f}%", speed, mark.strip(), c.reason])
    print(format_table(keys + ["working set", "status", "err/tol", "median ms", "spread", "vs current", "pick", "reason"], rows))
    if winner is None:
        print("no candidate survived the budget and the accuracy check; nothing stored")
    elif path is not None:
        print(f"winner {winner.config} stored in {path}; dispatch uses it for this dtype, head dim, causal "
              f"and length bucket")
    else:
        print(f"winner {winner.config} (not stored: --no-store)")
    if args.json:
        write_json(args.json, {"backend": name, "shape": [b, h, s, d], "dtype": args.dtype, "causal": args.causal,
                               "mode": mode, "budget_bytes": budget, "budget_source": source,
                               "winner": None if winner is None else winner.config,
                               "cache_path": None if path is None else str(path),
                               "candidates": [c.as_record() for c in cands]})
        print(f"wrote {args.json}")
    return 0 if winner is not None else 1
