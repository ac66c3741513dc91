"""``tileattn bench --preset decode``: a small decode grid of :mod:`tileattn.tools.decode_bench`.

One query token per sequence against a KV cache (Hq/Hkv 32/8, D 128): tileattn as dispatch runs it
(``seqused_k``, the cache in place) against SDPA with K/V repeated (inside and outside the timed
region), SDPA with ``enable_gqa`` and naive, interleaved. Reported: median, spread, tokens/s, K/V
GB/s and their share of the measured memory bandwidth, ratios to SDPA. ``benchmarks/bench_decode.py``
runs the full grid.
"""

from __future__ import annotations

from .common import CliError, check_writable, format_table, fmt_num, parse_dtype, parse_positive_ints, write_csv, write_json

PRESET = dict(batches=[1, 8], caches=[1024, 4096], dtypes=["fp32", "bf16"], heads_q=32, heads_kv=8, head_dim=128,
              reps=3, warmup=1)
#: ``tileattn bench`` options that mean nothing for decode.
UNUSED = ("heads", "head_dim", "causal", "mode", "providers", "baseline", "plot")


def settings_from_args(args) -> dict:
    s = dict(PRESET)
    given = [name for name in UNUSED if getattr(args, name, None) is not None]
    if given or getattr(args, "device", "auto") not in ("auto", "cpu"):
        raise CliError(f"--preset decode: {', '.join('--' + g.replace('_', '-') for g in given) or '--device'} "
                       "does not apply (decode runs on CPU with Hq/Hkv 32/8, D 128; use benchmarks/bench_decode.py "
                       "for other shapes)")
    if args.batch is not None:
        s["batches"] = [args.batch]
    if args.seqlens is not None:
        s["caches"] = parse_positive_ints(args.seqlens, "--seqlens", what="comma-separated cache lengths, e.g. 1024,4096")
    if args.dtype is not None:
        parse_dtype(args.dtype)
        if args.dtype not in ("fp32", "bf16", "fp16"):
            raise CliError(f"argument --dtype: got {args.dtype!r}; expected fp32, bf16 or fp16 for decode")
        s["dtypes"] = [args.dtype]
    for name in ("reps", "warmup"):
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    return s


def run_decode(args) -> int:
    from .. import decode_bench as D

    check_writable(args.csv, "--csv")
    check_writable(args.json, "--json")
    s = settings_from_args(args)
    cases = D.grid(s["batches"], s["caches"], s["dtypes"], s["heads_q"], s["heads_kv"], s["head_dim"])
    progress = None if args.quiet else (lambda c: print(f"  {c.dtype_name} B={c.batch} cache={c.cache}", flush=True))
    rows = D.run_grid(cases, reps=s["reps"], warmup=s["warmup"], on_case=progress)
    print(f"tileattn bench --preset decode: Hq/Hkv {s['heads_q']}/{s['heads_kv']}, D {s['head_dim']}, {s['reps']} reps "
          f"(+{s['warmup']} warm-up), interleaved; measured memory bandwidth {rows[0]['bandwidth_gb_per_s']} GB/s")
    print(render_table(rows))
    if args.csv:
        write_csv(args.csv, rows, D.FIELDS)
    if args.json:
        from .env import collect

        env = collect()
        write_json(args.json, {"settings": s, "preset": "decode", "versions": env["versions"],
                               "machine": env["machine"], "results": rows})
    for path in (args.csv, args.json):
        if path:
            print(f"wrote {path}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def render_table(rows) -> str:
    headers = ["dtype", "B", "cache", "provider", "median ms", "spread", "tokens/s", "K/V GB/s", "% bandwidth",
               "vs sdpa_repeat", "vs sdpa_gqa", "note"]
    table = []
    for r in rows:
        ratio = [("-" if r.get(f"vs_{ref}") is None else f"{r[f'vs_{ref}']:.2f}x") for ref in ("sdpa_repeat", "sdpa_gqa")]
        table.append([r["dtype"], r["batch"], r["cache"], r["provider"] + (f" ({r['engine']})" if r["engine"] else ""),
                      fmt_num(r.get("median_ms")), "-" if r.get("spread_pct") is None else f"{r['spread_pct']:.0f}%",
                      fmt_num(r.get("tokens_per_s")), fmt_num(r.get("kv_gb_per_s")), fmt_num(r.get("pct_bandwidth")),
                      *ratio, "" if r["status"] == "ok" else f"{r['status']}: {r['note']}"])
    return format_table(headers, table)
