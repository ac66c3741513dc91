"""Serving benchmark of the native kernels: KV caches read as stored (bf16) or quantised (int8, fp8),
and ragged batches (decode rows and a prefill chunk over one paged pool), at the kernels.py level.

    python benchmarks/bench_serving.py                           # every section -> benchmarks/results/serving.{csv,json}
    python benchmarks/bench_serving.py --sections decode --caches 1024,4096,16384 --baseline-rev main
    python benchmarks/bench_serving.py --sections quant --cache-modes cold

Sections (B=1, Hq 8 / Hkv 2, D 64 unless changed):

* ``decode``: bf16 decode, ``checked.forward`` (out and lse preallocated) vs PyTorch SDPA-bf16 with
  ``enable_gqa=True``, and with ``--baseline-rev REV`` the same kernel interface built from another
  revision of ``tileattn/backends/native`` (``git archive``; e.g. ``main``).
* ``quant``: int8 (per-channel scale + offset: Ascend antiquant mode 0; per-token-head scale) and fp8
  e4m3 / e5m2 (per (batch, kv head) descales: FlashAttention-3) caches against tileattn's own bf16
  decode of the same length; bytes per cached token of each format.
* ``bandwidth``: decode at ``--bw-heads`` (32 / 8) heads, D 128, batch ``--bw-batch`` (4) over
  ``--bw-caches`` cached keys, the cache stored in each format as a server would (bf16; int8, fp8 e4m3
  and e5m2 with per-token scales; int4 with per-token scales per 32-channel group, Q4_0's blocks) by
  :func:`tileattn.serving.quantise`: the bytes read per second (K, V and scales) and their fraction of
  the measured streaming bandwidth, and each format's speed against tileattn's own bf16 of the same
  cache. ``--plot`` draws it (``<out>_bandwidth.png``): fraction of the bandwidth against cached keys,
  one line per format and cache mode.
* ``ragged``: 16 decode rows with cached lengths spread over 100..8k plus one 512-token prefill chunk
  on a 4k prefix, one paged pool (pages of 16): one ``checked.forward`` call vs SDPA on padded
  caches, one call per sequence and one padded call for all (the faster is the reference).

Cache modes: ``hot`` reads the same K/V every repetition (served from the last-level cache once it
fits); ``cold`` reads another copy every repetition, the copies together over twice the last-level
cache, so every call streams its K/V from memory as in a server whose caches outgrow the LLC.

Reported per row: median and spread (max - min) / median of wall time over interleaved repetitions
(contenders round-robin, rotating start), the calling thread's CPU time per call in a separate
one-thread run (less sensitive to other load on a shared machine), K/V GB/s and % of the streaming
bandwidth measured by :func:`tileattn.tools.measure.memory_bandwidth`, and ratios. ``/proc/loadavg`` is
recorded before and after.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tileattn.backends.native import checked, kernels as nk
from tileattn.tools.measure import available_memory, cache_size, cpu_model, memory_bandwidth, usable_cores

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("decode", "quant", "bandwidth", "ragged")
FIELDS = ["section", "mode", "case", "contender", "keys", "kv_bytes", "bytes_per_token", "threads", "reps",
          "median_us", "spread_pct", "cpu_us_1thread", "kv_gb_per_s", "pct_bandwidth", "speedup", "speedup_vs",
          "max_err_vs_fp64"]


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--cache-modes", default="hot,cold", help="comma-separated subset of hot, cold")
    p.add_argument("--caches", type=_ints, default=[1024, 4096, 8192, 16384], help="decode: cached keys")
    p.add_argument("--quant-cache", type=int, default=8192, help="quant: cached keys")
    p.add_argument("--heads", type=_ints, default=[8, 2], help="query heads, kv heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=15, help="timed repetitions (interleaved)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=usable_cores())
    p.add_argument("--padded-sdpa", action="store_true", help="ragged: also time SDPA as one padded call (every "
                   "sequence padded to 512 query rows and the longest cache: tens of GFLOP per call)")
    p.add_argument("--baseline-rev", help="git revision whose tileattn/backends/native is timed as 'baseline'")
    p.add_argument("--cold-bytes", type=int, help="bytes of K/V copies in cold mode (default 2 x LLC, "
                   "at most a quarter of the available memory)")
    p.add_argument("--bw-caches", type=_ints, default=[1024, 4096, 16384], help="bandwidth: cached keys")
    p.add_argument("--bw-batch", type=int, default=4, help="bandwidth: sequences")
    p.add_argument("--bw-heads", type=_ints, default=[32, 8], help="bandwidth: query heads, kv heads")
    p.add_argument("--plot", action="store_true", help="bandwidth: draw <out>_bandwidth.png")
    p.add_argument("--out", default=str(RESULTS / "serving"), help="output path without suffix")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- helpers


def load_baseline(rev: str):
    """The checked entry of another revision's native kernels (checked.py; kernels.py before it had
    one), imported as its own package (its library is built into the same cache under its own key)."""
    folder = Path(tempfile.mkdtemp(prefix="tileattn-baseline-"))
    pkg = folder / "tileattn_baseline_native"
    pkg.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "tileattn/backends/native"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    for item in (folder / "tileattn/backends/native").iterdir():
        item.rename(pkg / item.name)
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(folder))
    entry = "checked" if (pkg / "checked.py").is_file() else "kernels"
    return importlib.import_module(f"tileattn_baseline_native.{entry}")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return tuple(_clone(v) for v in x)


class Copies:
    """``count`` copies (in distinct memory) of the tensors ``make()`` returns, read round-robin: in
    cold mode every read streams from memory."""

    def __init__(self, make, count):
        first = make()
        self.sets = [first] + [_clone(first) for _ in range(count - 1)]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.sets)
        return self.sets[self.i]


def copies_for(nbytes, mode, budget):
    if mode == "hot":
        return 1
    return max(2, min(budget, 2 * (cache_size(3) or 64 * 2**20)) // max(nbytes, 1) + 1)


def time_contenders(calls, reps, warmup, threads):
    """{name: (wall seconds per call, ...)} interleaved at `threads` threads, and {name: thread CPU
    seconds per call} interleaved at one thread. Each call is ``fn(copy)`` with its own next copy."""
    wall = {n: [] for n in calls}
    cpu = {n: [] for n in calls}
    names = list(calls)
    for samples, nthreads, clock in ((wall, threads, time.perf_counter), (cpu, 1, time.thread_time)):
        torch.set_num_threads(nthreads)
        for rnd in range(warmup + reps):
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                fn, copies = calls[name]
                data = copies.next()
                t0 = clock()
                fn(data, nthreads)
                elapsed = clock() - t0
                if rnd >= warmup:
                    samples[name].append(elapsed)
    torch.set_num_threads(threads)
    return wall, cpu


def rows_for(section, mode, case, calls, wall, cpu, kv_bytes, keys, bandwidth, threads, reps, ref, extra=None):
    out = []
    ref_med = statistics.median(wall[ref])
    for name in calls:
        med = statistics.median(wall[name])
        row = dict(section=section, mode=mode, case=case, contender=name, keys=keys, kv_bytes=kv_bytes.get(name),
                   threads=threads, reps=reps, median_us=med * 1e6,
                   spread_pct=100 * (max(wall[name]) - min(wall[name])) / med,
                   cpu_us_1thread=statistics.median(cpu[name]) * 1e6, speedup=ref_med / med, speedup_vs=ref)
        if kv_bytes.get(name):
            row["kv_gb_per_s"] = kv_bytes[name] / med / 1e9
            row["pct_bandwidth"] = 100 * row["kv_gb_per_s"] / bandwidth
        row.update((extra or {}).get(name, {}))
        out.append(row)
    return out


def max_err(out, ref):
    return float((out.double() - ref).abs().max())


# ---------------------------------------------------------------------------------------- sections


def decode_section(args, mode, budget, bandwidth, baseline):
    hq, hkv = args.heads
    d = args.head_dim
    rows = []
    for keys in args.caches:
        nbytes = 2 * hkv * keys * d * 2
        g = torch.Generator().manual_seed(keys)
        q = torch.randn(1, hq, 1, d, generator=g).to(torch.bfloat16)
        copies = Copies(lambda: tuple(torch.randn(1, hkv, keys, d, generator=g).to(torch.bfloat16)
                                        for _ in range(2)), copies_for(nbytes, mode, budget))
        out, lse = torch.empty(1, hq, 1, d, dtype=torch.bfloat16), torch.empty(1, hq, 1)

        def ours(kv, n, mod=checked):
            mod.forward(q, kv[0], kv[1], out, lse, scale=d ** -0.5, num_threads=n)

        calls = {"tileattn": (ours, copies),
                 "sdpa_gqa": (lambda kv, n: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True), copies)}
        if baseline is not None:
            calls["baseline"] = (lambda kv, n: ours(kv, n, baseline), copies)
        k0, v0 = copies.sets[0]
        ours((k0, v0), args.threads)
        exact = torch.softmax((q.double() @ k0.double().repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * d ** -0.5,
                              -1) @ v0.double().repeat_interleave(hq // hkv, 1)
        extra = {"tileattn": dict(max_err_vs_fp64=max_err(out, exact), bytes_per_token=2 * hkv * d * 2)}
        wall, cpu = time_contenders(calls, args.reps, args.warmup, args.threads)
        rows += rows_for("decode", mode, f"bf16 B=1 Hq{hq}/Hkv{hkv} D{d}", calls, wall, cpu,
                         {n: nbytes for n in calls}, keys, bandwidth, args.threads, args.reps, "sdpa_gqa", extra)
    return rows


QUANT = {  # name: (format, k_scale shape, k_offset?, v_scale shape) over the logical (B, Hkv, S, groups)
    "int8 channel+offset": (torch.int8, lambda h, s, d: (1, h, 1, d), True, lambda h, s, d: (1, h, 1, d)),
    "int8 token-head": (torch.int8, lambda h, s, d: (1, h, s, 1), False, lambda h, s, d: (1, h, s, 1)),
    "fp8 e4m3 descale": (torch.float8_e4m3fn, lambda h, s, d: (1, h, 1, 1), False, lambda h, s, d: (1, h, 1, 1)),
    "fp8 e5m2 descale": (torch.float8_e5m2, lambda h, s, d: (1, h, 1, 1), False, lambda h, s, d: (1, h, 1, 1)),
}


def quant_section(args, mode, budget, bandwidth):
    hq, hkv = args.heads
    d, keys = args.head_dim, args.quant_cache
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, hq, 1, d, generator=g).to(torch.bfloat16)
    out, lse = torch.empty(1, hq, 1, d, dtype=torch.bfloat16), torch.empty(1, hq, 1)
    calls, kv_bytes, extra = {}, {}, {}

    def bf16_set():
        return tuple(torch.randn(1, hkv, keys, d, generator=g).to(torch.bfloat16) for _ in range(2))

    bf16 = Copies(bf16_set, copies_for(4 * hkv * keys * d, mode, budget))
    calls["bf16"] = (lambda kv, n: checked.forward(q, kv[0], kv[1], out, lse, scale=d ** -0.5, num_threads=n), bf16)
    kv_bytes["bf16"] = 4 * hkv * keys * d
    extra["bf16"] = dict(bytes_per_token=4 * hkv * d)
    for name, (fmt, ks_shape, offset, vs_shape) in QUANT.items():
        def make(fmt=fmt, ks_shape=ks_shape, offset=offset, vs_shape=vs_shape):
            if fmt is torch.int8:
                k, v = (torch.randint(-127, 128, (1, hkv, keys, d), generator=g, dtype=torch.int8) for _ in range(2))
            else:
                k, v = ((torch.randn(1, hkv, keys, d, generator=g) * 24).to(fmt) for _ in range(2))
            sc = dict(k_scale=torch.rand(ks_shape(hkv, keys, d), generator=g) * 0.02 + 0.01,
                      v_scale=torch.rand(vs_shape(hkv, keys, d), generator=g) * 0.02 + 0.01)
            if offset:
                sc["k_offset"] = torch.randint(-8, 9, ks_shape(hkv, keys, d), generator=g).float()
            return k, v, sc

        copies = Copies(make, copies_for(2 * hkv * keys * d, mode, budget))
        calls[name] = (lambda kv, n: checked.forward(q, kv[0], kv[1], out, lse, scale=d ** -0.5, num_threads=n,
                                                     **kv[2]), copies)
        k, v, sc = copies.sets[0]
        scale_bytes = sum(t.numel() * 4 for t in sc.values())
        kv_bytes[name] = 2 * hkv * keys * d + scale_bytes
        extra[name] = dict(bytes_per_token=round(kv_bytes[name] / keys, 2))
        checked.forward(q, k, v, out, lse, scale=d ** -0.5, **sc)

        def deq(x, s, o):
            y = x.double() + (o.double() if o is not None else 0)
            return y * s.double()

        kd = deq(k, sc["k_scale"], sc.get("k_offset")).repeat_interleave(hq // hkv, 1)
        vd = deq(v, sc["v_scale"], None).repeat_interleave(hq // hkv, 1)
        exact = torch.softmax((q.double() @ kd.transpose(-1, -2)) * d ** -0.5, -1) @ vd
        extra[name]["max_err_vs_fp64"] = max_err(out, exact)
    wall, cpu = time_contenders(calls, args.reps, args.warmup, args.threads)
    return rows_for("quant", mode, f"B=1 Hq{hq}/Hkv{hkv} D{d}", calls, wall, cpu, kv_bytes, keys, bandwidth,
                    args.threads, args.reps, "bf16", extra)


#: bandwidth section: name -> (quantise dtype or None for bf16, group size)
FORMATS = {"bf16": (None, None), "int8": (torch.int8, None), "fp8 e4m3": (torch.float8_e4m3fn, None),
           "fp8 e5m2": (torch.float8_e5m2, None), "int4 g32": ("int4", 32)}


def bandwidth_section(args, mode, budget, bandwidth):
    """Each format of one cache, decoded; bytes per second of what is stored (K, V, scales)."""
    from tileattn.serving import quantise

    hq, hkv = args.bw_heads
    b, d = args.bw_batch, 128
    rows = []
    for keys in args.bw_caches:
        g = torch.Generator().manual_seed(keys)
        q = torch.randn(b, hq, 1, d, generator=g).to(torch.bfloat16)
        out, lse = torch.empty(b, hq, 1, d, dtype=torch.bfloat16), torch.empty(b, hq, 1)
        calls, kv_bytes, extra = {}, {}, {}
        for name, (fmt, group) in FORMATS.items():
            def make(fmt=fmt, group=group):
                k, v = (torch.randn(b, hkv, keys, d, generator=g) for _ in range(2))
                if fmt is None:
                    return k.bfloat16(), v.bfloat16(), {}
                (kq, ks, _), (vq, vs, _) = (quantise(t, fmt, group_size=group) for t in (k, v))
                return kq, vq, dict(k_scale=ks, v_scale=vs)

            per_key = hkv * d * (0.5 if fmt == "int4" else 2 if fmt is None else 1) + \
                (0 if fmt is None else 4 * hkv * (d // group if group else 1))
            nbytes = int(2 * b * keys * per_key)  # K and V with their scales
            copies = Copies(make, copies_for(nbytes, mode, budget))
            calls[name] = (lambda kv, n: checked.forward(q, kv[0], kv[1], out, lse, scale=d ** -0.5, num_threads=n,
                                                         **kv[2]), copies)
            kv_bytes[name] = nbytes
            extra[name] = dict(bytes_per_token=round(nbytes / (b * keys), 2))
        wall, cpu = time_contenders(calls, args.reps, args.warmup, args.threads)
        rows += rows_for("bandwidth", mode, f"B={b} Hq{hq}/Hkv{hkv} D{d}, bf16 q", calls, wall, cpu, kv_bytes, keys,
                         bandwidth, args.threads, args.reps, "bf16", extra)
    return rows


def plot_bandwidth(rows, path):
    """Fraction of the streaming bandwidth against cached keys, per format and cache mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, style in (("hot", "--"), ("cold", "-")):
        for i, name in enumerate(FORMATS):
            pts = sorted((r["keys"], r["pct_bandwidth"]) for r in rows
                         if r["section"] == "bandwidth" and r["mode"] == mode and r["contender"] == name)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=f"C{i}",
                        label=f"{name} ({'streamed' if mode == 'cold' else mode})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached keys per sequence")
    ax.set_ylabel("% of the measured streaming bandwidth")
    ax.set_title("decode: bytes read per second (K, V, scales) / bandwidth")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ragged_section(args, mode, budget, bandwidth):
    """16 decode rows (100..8k keys) + a 512-token chunk after a 4k prefix, bf16, one paged pool."""
    hq, hkv = args.heads
    d, page = args.head_dim, 16
    lengths = [int(round(100 * (8192 / 100) ** (i / 15))) for i in range(16)] + [4096 + 512]
    q_lens = [1] * 16 + [512]
    b, smax = len(lengths), max(lengths)
    pages_per = [-(-n // page) for n in lengths]
    total_pages = sum(pages_per)
    kv_bytes = 2 * hkv * sum(lengths) * d * 2
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    used = torch.tensor(lengths, dtype=torch.int32)
    table = torch.zeros(b, max(pages_per), dtype=torch.int32)
    order = torch.randperm(total_pages, generator=g).to(torch.int32)
    start = 0
    for i, n in enumerate(pages_per):
        table[i, :n] = order[start:start + n]
        start += n

    def make():
        pools = tuple(torch.randn(total_pages, page, hkv, d, generator=g).to(torch.bfloat16) for _ in range(2))
        # the same keys as padded per-sequence caches (B, Hkv, Smax, D) for SDPA
        padded = []
        for pool in pools:
            x = torch.zeros(b, hkv, smax, d, dtype=torch.bfloat16)
            for s, n in enumerate(lengths):
                x[s, :, :n] = pool[table[s, :pages_per[s]].long()].flatten(0, 1)[:n].transpose(0, 1)
            padded.append(x)
        return pools + tuple(padded)

    copies = Copies(make, copies_for(3 * kv_bytes, mode, budget))
    out, lse = torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(hq, q.shape[0])
    causal = torch.ones(512, lengths[-1], dtype=torch.bool).tril(lengths[-1] - 512)
    qs = [q[cu[s]:cu[s + 1]].transpose(0, 1)[None] for s in range(b)]

    def ours(data, n):
        checked.forward(q, data[0], data[1], out, lse, scale=d ** -0.5, cu_seqlens_q=cu, block_table=table,
                        seqused_k=used, right=0, num_threads=n)

    def sdpa_loop(data, n):
        for s in range(b):
            ks, vs = data[2][s:s + 1, :, :lengths[s]], data[3][s:s + 1, :, :lengths[s]]
            F.scaled_dot_product_attention(qs[s], ks, vs, attn_mask=causal if q_lens[s] > 1 else None,
                                           enable_gqa=True)

    big_q = torch.zeros(b, hq, 512, d, dtype=torch.bfloat16)
    for s in range(b):
        big_q[s, :, :q_lens[s]] = qs[s][0]
    rows_i = torch.arange(512)[:, None]
    keys_i = torch.arange(smax)[None, :]
    q_len_t = torch.tensor(q_lens)[:, None, None]
    len_t = used.long()[:, None, None]
    padded_mask = ((keys_i < len_t) & (keys_i <= rows_i + len_t - q_len_t))[:, None]

    def sdpa_padded(data, n):
        F.scaled_dot_product_attention(big_q, data[2], data[3], attn_mask=padded_mask, enable_gqa=True)

    calls = {"tileattn": (ours, copies), "sdpa_per_sequence": (sdpa_loop, copies)}
    if args.padded_sdpa:
        calls["sdpa_padded"] = (sdpa_padded, copies)
    wall, cpu = time_contenders(calls, args.reps, args.warmup, args.threads)
    ref = min((n for n in calls if n.startswith("sdpa")), key=lambda n: statistics.median(wall[n]))
    ours(copies.sets[0], args.threads)
    data = copies.sets[0]
    errs = []
    for s in (0, 15, 16):
        ks, vs = (t[s:s + 1, :, :lengths[s]].double().repeat_interleave(hq // hkv, 1) for t in data[2:4])
        sc = (qs[s].double() @ ks.transpose(-1, -2)) * d ** -0.5
        if q_lens[s] > 1:
            sc = sc.masked_fill(~causal, float("-inf"))
        exact = torch.softmax(sc, -1) @ vs
        errs.append(max_err(out[cu[s]:cu[s + 1]].transpose(0, 1)[None], exact))
    case = f"16 decode rows 100..8k + 512-token chunk on a 4k prefix, bf16, pages of {page}, Hq{hq}/Hkv{hkv} D{d}"
    return rows_for("ragged", mode, case, calls, wall, cpu, {n: kv_bytes for n in calls}, sum(lengths), bandwidth,
                    args.threads, args.reps, ref, {"tileattn": dict(max_err_vs_fp64=max(errs))})


# -------------------------------------------------------------------------------------------- main


def render(rows):
    head = ["section", "mode", "keys", "contender", "median us", "spread", "cpu us (1 thr)", "GB/s", "% BW",
            "speedup", "vs"]
    lines = [head]
    for r in rows:
        lines.append([r["section"], r["mode"], str(r["keys"]), r["contender"], f"{r['median_us']:.1f}",
                      f"{r['spread_pct']:.0f}%", f"{r['cpu_us_1thread']:.1f}",
                      f"{r['kv_gb_per_s']:.2f}" if r.get("kv_gb_per_s") else "-",
                      f"{r['pct_bandwidth']:.0f}%" if r.get("pct_bandwidth") else "-", f"{r['speedup']:.2f}x",
                      r["speedup_vs"]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    bandwidth = memory_bandwidth(args.threads)
    budget = min(args.cold_bytes or 2**62, (available_memory() or 8 * 2**30) // 4)
    baseline = load_baseline(args.baseline_rev) if args.baseline_rev else None
    rows = []
    with torch.inference_mode():
        for mode in args.cache_modes.split(","):
            for section in args.sections.split(","):
                print(f"{section} ({mode})", file=sys.stderr)
                if section == "decode":
                    rows += decode_section(args, mode, budget, bandwidth, baseline)
                elif section == "quant":
                    rows += quant_section(args, mode, budget, bandwidth)
                elif section == "bandwidth":
                    rows += bandwidth_section(args, mode, budget, bandwidth)
                elif section == "ragged":
                    rows += ragged_section(args, mode, budget, bandwidth)
                else:
                    raise SystemExit(f"--sections: unknown {section!r}; expected a subset of {', '.join(SECTIONS)}")
    meta = dict(cpu=cpu_model(), amx=nk.build_info()["amx"], isa=nk.build_info()["isa"], threads=args.threads,
                torch=torch.__version__, bandwidth_gb_per_s=bandwidth, llc_bytes=cache_size(3),
                loadavg_before=load_before, loadavg_after=loadavg(), baseline_rev=args.baseline_rev)
    print(f"{meta['cpu']}, {args.threads} threads, AMX {meta['amx']}, streaming bandwidth {bandwidth:.1f} GB/s, "
          f"load {load_before} -> {meta['loadavg_after']}")
    print(render(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".json").write_text(json.dumps(dict(meta, args=vars(args), results=rows), indent=1,
                                                   default=str) + "\n")
    if args.plot and any(r["section"] == "bandwidth" for r in rows):
        plot_bandwidth(rows, out.with_name(out.name + "_bandwidth.png"))
    return rows


if __name__ == "__main__":
    main()
