"""``tileattn memory``: measured peak extra memory of naive attention vs tileattn, per length.

Each sequence length is measured in a fresh Python process, so one length's allocations cannot hide
in another's freed memory and a naive run that exhausts memory kills only its own process. Inside
it :func:`tileattn.tools.measure.peak_memory` reads the real peak: the CUDA allocator's on GPUs, the
resident-set high-water mark (reset just before the call) on CPUs. The child uses glibc's fixed mmap
threshold, so freed buffers go back to the kernel and every new buffer shows up in the peak.

Naive attention is skipped where its predicted peak (2 score matrices forward, 4 with backward)
exceeds ``--cap-gib``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .common import (add_measure_outputs, check_memory, check_writable, fmt_bytes, format_table, int_arg, parse_device,
                     parse_dtype, parse_names, parse_positive_ints, positive_float_arg, pyplot, tensor_bytes, write_csv,
                     write_json)

HELP = "measure peak extra memory of naive attention vs tileattn"
#: Predicted naive peak in score matrices: scores + probabilities forward; plus their gradients.
NAIVE_SCORE_COPIES = {"fwd": 2, "fwd+bwd": 4}
FIELDS = ["seqlen", "mode", "provider", "engine", "status", "peak_bytes", "peak_mib", "score_matrix_bytes",
          "predicted_bytes", "saving_pct", "note"]


def add_parser(subparsers):
    p = subparsers.add_parser("memory", help=HELP, description=HELP + ". Each length runs in a fresh process.")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="comma-separated lengths")
    p.add_argument("--batch", type=int_arg(1), default=1)
    p.add_argument("--heads", type=int_arg(1), default=8)
    p.add_argument("--head-dim", type=int_arg(1), default=64)
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16, bf16 or fp64")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated subset of fwd, fwd+bwd")
    p.add_argument("--cap-gib", type=positive_float_arg, default=4.0, help="skip naive where its predicted peak exceeds this (default 4)")
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    return add_measure_outputs(p, run, "length, mode and provider", "the settings and rows as JSON",
                               "peak memory against sequence length")


def child() -> None:
    """Entry point of the measuring subprocess: one JSON line per measurement on stdout."""
    import torch

    from ..bench import PROVIDERS, Case, describe_error, make_step
    from ..measure import peak_memory
    from ...core.dispatch import select
    from ...core.spec import build_spec

    job = json.loads(sys.argv[1])
    dtype = getattr(torch, job["dtype"])
    for mode, provider in job["runs"]:
        case = Case(job["batch"], job["heads"], job["seqlen"], job["seqlen"], job["head_dim"], dtype,
                    job["causal"], mode, job["device"])
        rec = {"seqlen": job["seqlen"], "mode": mode, "provider": provider, "status": "ok", "note": ""}
        try:
            q, k, v, dout = case.make_tensors()
            rec["engine"] = select(build_spec(q, k, v, causal=case.causal)).name if provider == "tileattn" else provider
            prepare, run = make_step(PROVIDERS[provider](case, q, k, v), case, q, k, v, dout)
            small = Case(case.batch, case.heads, 64, 64, case.head_dim, dtype, case.causal, mode, case.device)
            sq, sk, sv, sd = small.make_tensors()
            warm_prepare, warm_run = make_step(PROVIDERS[provider](small, sq, sk, sv), small, sq, sk, sv, sd)
            warm_prepare()
            warm_run()  # one-time costs (kernel loading, thread pools) stay out of the figure
            prepare()
            _, rec["peak_bytes"] = peak_memory(run, case.device)
            if rec["peak_bytes"] is None:
                rec.update(status="unmeasurable", note="no way to read peak memory on this system")
            del q, k, v, dout, prepare, run
        except Exception as exc:  # reported per row; the parent goes on with the next one
            rec.update(status="error", note=describe_error(exc))
        print(json.dumps(rec), flush=True)


def _measure(job: dict, timeout: float = 1800.0) -> list:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    code = "from tileattn.tools.cli.memory import child; child()"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    done = {(r["mode"], r["provider"]) for r in rows}
    for mode, provider in job["runs"]:
        if (mode, provider) not in done:
            why = f"measuring process ended with status {proc.returncode}"
            if proc.returncode in (-9, 137):
                why += " (killed: out of memory?)"
            rows.append({"seqlen": job["seqlen"], "mode": mode, "provider": provider, "status": "error", "note": why})
    return rows


def run(args) -> int:
    from ..bench import Progress

    seqlens = parse_positive_ints(args.seqlens, "--seqlens", what="comma-separated positive ints, e.g. 512,1024")
    modes = parse_names(args.modes, "--modes", list(NAIVE_SCORE_COPIES))
    dtype = parse_dtype(args.dtype)
    device = parse_device(args.device)
    itemsize = dtype.itemsize
    # Each length's child holds q, k, v, the output and their gradients (naive's scores are capped).
    longest = max(seqlens)
    check_memory(8 * tensor_bytes((args.batch, args.heads, longest, args.head_dim), itemsize), device,
                 f"--seqlens {longest} with B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}")
    check_writable(args.csv, "--csv")
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot", ".png")
    cap = args.cap_gib * 2**30

    rows = []
    bar = Progress(len(seqlens), enabled=not args.quiet)
    for n in seqlens:
        score = args.batch * args.heads * n * n * itemsize
        runs, skipped = [], []
        for mode in modes:
            runs.append((mode, "tileattn"))
            predicted = NAIVE_SCORE_COPIES[mode] * score
            if predicted > cap:
                skipped.append({"seqlen": n, "mode": mode, "provider": "naive", "engine": "naive", "status": "skipped",
                                "predicted_bytes": predicted, "note": f"skipped (> cap): predicted {fmt_bytes(predicted)}"})
            else:
                runs.append((mode, "naive"))
        job = dict(seqlen=n, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                   dtype=str(dtype).replace("torch.", ""), causal=args.causal, device=device, runs=runs)
        measured = _measure(job)
        for r in measured + skipped:
            r["score_matrix_bytes"] = score
            if r["provider"] == "naive":
                r.setdefault("predicted_bytes", NAIVE_SCORE_COPIES[r["mode"]] * score)
            if r.get("peak_bytes") is not None:
                r["peak_mib"] = r["peak_bytes"] / 2**20
        rows += measured + skipped
        bar.step(f"S={n}")
    bar.close()
    _add_savings(rows)
    engine = next((r.get("engine") for r in rows if r["provider"] == "tileattn" and r.get("engine")), "auto")
    print(f"tileattn memory: B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}"
          f"{' causal' if args.causal else ''} on {device}; peak extra memory measured in a fresh process per length")
    print(render_table(rows, modes, seqlens, engine))
    ordered = sorted(rows, key=lambda r: (r["seqlen"], r["mode"], r["provider"]))
    if args.csv:
        write_csv(args.csv, ordered, FIELDS)
    if args.json:
        write_json(args.json, {"settings": dict(vars(args), func=None), "rows": ordered})
    if args.plot:
        plot_memory(rows, args.plot, engine, f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype} {device}")
    for path in (args.csv, args.json, args.plot):
        if path:
            print(f"wrote {path}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def _add_savings(rows) -> None:
    """saving_pct on tileattn rows: 100 * (1 - tileattn peak / naive peak) where both were measured."""
    naive = {(r["seqlen"], r["mode"]): r.get("peak_bytes") for r in rows if r["provider"] == "naive"}
    for r in rows:
        base = naive.get((r["seqlen"], r["mode"]))
        if r["provider"] == "tileattn" and base and r.get("peak_bytes") is not None:
            r["saving_pct"] = 100.0 * (1.0 - r["peak_bytes"] / base)


def _cell(r) -> str:
    if r is None:
        return "-"
    if r["status"] == "skipped":
        return "skipped (> cap)"
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('note', '')}"
    return fmt_bytes(r["peak_bytes"])


def render_table(rows, modes, seqlens, engine: str) -> str:
    index = {(r["seqlen"], r["mode"], r["provider"]): r for r in rows}
    out = []
    for n in seqlens:
        for mode in modes:
            tile = index.get((n, mode, "tileattn"))
            naive = index.get((n, mode, "naive"))
            saving = tile.get("saving_pct") if tile else None
            out.append([n, fmt_bytes(tile["score_matrix_bytes"]) if tile else "-", mode, _cell(naive), _cell(tile),
                        "-" if saving is None else f"{saving:.1f}%"])
    return format_table(["S", "score matrix", "mode", "naive peak", f"tileattn ({engine}) peak", "saving"], out,
                        right=[True, True, False, True, True, True])


def plot_memory(rows, path: str, engine: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (provider, mode) in sorted({(r["provider"], r["mode"]) for r in rows}):
        pts = sorted((r["seqlen"], r["peak_bytes"] / 2**20) for r in rows
                     if r["provider"] == provider and r["mode"] == mode and r.get("peak_bytes"))
        if pts:
            label = f"{'tileattn (' + engine + ')' if provider == 'tileattn' else provider} {mode}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak extra memory (MiB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
