"""One-shot GPU check of tileattn's Triton engine: correctness first, then speed.

    python benchmarks/gpu_check.py OUTDIR            # on a CUDA GPU, a few minutes
    python benchmarks/gpu_check.py --dry-run OUTDIR  # anywhere: tiny shapes, Triton's CPU interpreter

(a) Correctness: forward and backward of ``backend="triton"`` against the fp64 reference with
    FlashAttention's rule (:func:`tileattn.core.testing.check_against_reference`) on a grid of bf16/fp16
    cases (causal with Sq != Sk, windows, GQA/MQA, varlen, odd lengths and head dims, ALiBi, softcap,
    mask, bias gradient, dropout), then forward-only decoding over KV caches (one query, GQA 32/8,
    D 128, B in {1, 8}, caches of 1k/8k/32k keys, contiguous and paged, ragged ``seqused_k`` at B=8).
    Prints PASS/FAIL per case, writes ``correctness.csv`` and exits non-zero on any failure (the
    timing is skipped then: a fast wrong kernel is not measured).
(b) Speed: TFLOP/s of the forward and of forward+backward, bf16, B*S = 16k tokens, H = 16,
    D in {64, 128}, S in {1k, 2k, 4k, 8k, 16k}, causal and not, for tileattn-triton, PyTorch SDPA with
    the FlashAttention backend, and FlexAttention (torch.compile'd; by default at 1k, 4k and 16k only,
    since every shape costs it a compile). Implementations are interleaved
    round by round and the median is kept, so clock drift hits all of them alike. Writes
    ``speed.csv`` and ``speed.png``. Part (a) used one fixed tile; the autotuned tiles measured here
    are held to SDPA's output on every shape (exit status 1 if they stray).
(c) Decode speed: ms and K/V read bandwidth (GB/s) of one decoding step on the shapes of (a)'s decode
    cases (full caches), for tileattn-triton on the contiguous and the paged cache, SDPA-flash on K/V
    repeated to the query heads (its flash kernel takes no GQA: users repeat the cache, and the
    repeat is made once, outside the timing, SDPA's best case) and FlexAttention's decoding path
    (``enable_gqa``, one query: torch picks its flex-decoding kernel). Writes ``decode_speed.csv``;
    held to SDPA's output like (b).

``--dry-run`` runs part (a) on tiny fp16/fp32 CPU shapes through Triton's interpreter (it re-executes
itself with ``TRITON_INTERPRET=1`` if needed, which must be set before triton is imported) and skips
part (b): it keeps the script from rotting in a CI without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch

import tileattn
from tileattn.tools import measure
from tileattn.core.testing import check_against_reference

TOKENS = 16 * 1024
HEADS = 16
#: Decoding shapes: query/kv heads, head dim, batch sizes, cache lengths, keys per page.
DECODE_HEADS = (32, 8)
DECODE_DIM = 128
DECODE_BATCHES = (1, 8)
DECODE_CACHES = (1024, 8192, 32768)
DECODE_PAGE = 256
#: Two bf16 flash kernels differ by rounding only: a few bf16 ulps of outputs of size ~1.
MAX_DIFF_VS_SDPA = 0.0625


# ----------------------------------------------------------------------------------- correctness


def correctness_cases(device: str, dry_run: bool):
    """(name, dtype, q, k, v, kwargs) for the correctness grid."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def qkv(b, hq, hkv, sq, sk, d, dv, dtype):
        return rnd(b, hq, sq, d, dtype=dtype), rnd(b, hkv, sk, d, dtype=dtype), rnd(b, hkv, sk, dv, dtype=dtype)

    if dry_run:
        dtypes = (torch.float32, torch.float16)
        grid = [
            ("plain", (1, 2, 2, 33, 40, 16, 16), {}),
            ("causal_sq_gt_sk_gqa", (1, 4, 2, 40, 17, 40, 24), {"causal": True}),
            ("window_alibi", (1, 2, 2, 30, 30, 16, 16),
             {"window": (5, 2), "alibi_slopes": torch.tensor([0.5, 0.25], device=device)}),
        ]
        varlen = ([0, 5, 37], [0, 9, 30], 2, 1, 16)
    else:
        dtypes = (torch.bfloat16, torch.float16)
        grid = [
            ("plain", (2, 4, 4, 257, 257, 64, 64), {}),
            ("causal", (2, 8, 8, 512, 512, 128, 128), {"causal": True}),
            ("causal_sq_gt_sk", (1, 4, 4, 300, 129, 64, 64), {"causal": True}),
            ("causal_sq_lt_sk", (1, 4, 4, 129, 1000, 64, 64), {"causal": True}),
            ("odd_lengths_d96", (1, 2, 2, 1025, 17, 96, 96), {}),
            ("seqlen_1_d256", (3, 2, 2, 1, 333, 256, 256), {"causal": True}),
            ("gqa_d40_dv80", (1, 8, 2, 200, 201, 40, 80), {"causal": True}),
            ("mqa_window", (1, 8, 1, 400, 400, 64, 64), {"window": (64, 16)}),
            ("alibi_softcap", (2, 4, 4, 150, 170, 64, 64),
             {"alibi_slopes": torch.rand(2, 4, device=device), "softcap": 30.0, "causal": True}),
            ("mask_bias_grad", (2, 2, 2, 100, 130, 64, 64),
             {"mask": torch.rand(100, 130, device=device) > 0.2,
              "bias": torch.randn(1, 2, 100, 130, device=device).requires_grad_(True)}),
            ("dropout", (1, 4, 2, 128, 256, 64, 64), {"dropout_p": 0.1, "seed": 7, "causal": True}),
        ]
        varlen = ([0, 1, 100, 357, 1000], [0, 40, 40, 300, 1200], 8, 2, 128)
    for dtype in dtypes:
        for name, (b, hq, hkv, sq, sk, d, dv), kwargs in grid:
            kwargs = {k: (x.to(dtype) if k == "bias" else x) for k, x in kwargs.items()}
            if "bias" in kwargs:
                kwargs["bias"] = kwargs["bias"].detach().requires_grad_(True)
            yield name, dtype, *qkv(b, hq, hkv, sq, sk, d, dv, dtype), kwargs
        cu_q, cu_k, hq, hkv, d = varlen
        q = rnd(cu_q[-1], hq, d, dtype=dtype)
        k, v = rnd(cu_k[-1], hkv, d, dtype=dtype), rnd(cu_k[-1], hkv, d, dtype=dtype)
        cu = dict(layout="TND", causal=True,
                  cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device))
        yield "varlen_causal", dtype, q, k, v, cu


def decode_problem(b, heads, d, cache, page, dtype, device, gen, ragged):
    """One decoding step over a KV cache: ``(q, k, v, pool_k, pool_v, block_table, seqused_k)``.

    q is (B, 1, Hq, D) (layout BSND), k/v the contiguous caches (B, S, Hkv, D) and pool_k/pool_v the
    same keys scattered over a shuffled pool of ``page``-key pages (plus spare pages) that
    ``block_table`` (B, S / page) lists. ``ragged``: sequence b uses a cache prefix of its own length
    (the first one the whole cache, none empty), else every sequence uses the whole cache.
    """
    hq, hkv = heads
    pages = -(-cache // page)
    q = torch.randn(b, 1, hq, d, generator=gen).to(device=device, dtype=dtype)
    pool_k, pool_v = (torch.randn(b * pages + 2, page, hkv, d, generator=gen).to(device=device, dtype=dtype)
                      for _ in range(2))
    table = torch.randperm(b * pages + 2, generator=gen)[: b * pages].view(b, pages)
    k, v = (pool[table].reshape(b, pages * page, hkv, d)[:, :cache] for pool in (pool_k, pool_v))
    used = torch.full((b,), cache)
    if ragged and b > 1:
        used[1:] = torch.randint(cache // 2, cache, (b - 1,), generator=gen)
    return (q, k.contiguous(), v.contiguous(), pool_k, pool_v, table.to(device=device, dtype=torch.int32),
            used.to(device=device, dtype=torch.int32))


def decode_cases(device: str, dry_run: bool):
    """(name, dtype, q, k, v, kwargs) of forward-only decoding, contiguous and paged."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    if dry_run:
        dtypes, heads, d, batches, caches, page = (torch.float32,), (4, 2), 16, (1, 2), (300,), 16
    else:
        dtypes, heads, d, batches, caches, page = ((torch.bfloat16, torch.float16), DECODE_HEADS, DECODE_DIM,
                                                   DECODE_BATCHES, DECODE_CACHES, DECODE_PAGE)
    for dtype in dtypes:
        for b in batches:
            for cache in caches:
                q, k, v, pool_k, pool_v, table, used = decode_problem(b, heads, d, cache, page, dtype, device, gen,
                                                                      ragged=True)
                common = dict(layout="BSND", causal=True, seqused_k=used)
                yield f"decode_b{b}_{cache}", dtype, q, k, v, common
                yield f"decode_paged_b{b}_{cache}", dtype, q, pool_k, pool_v, dict(common, block_table=table)


def run_correctness(outdir: Path, device: str, dry_run: bool) -> bool:
    def triton_fn(q, k, v, **kwargs):
        return tileattn.flash_attention(q, k, v, backend="triton", **kwargs)

    rows, all_ok = [], True
    # Lazily, one case on the device at a time; decoding is forward-only (a paged cache has no gradients).
    cases = itertools.chain(((case, True) for case in correctness_cases(device, dry_run)),
                            ((case, False) for case in decode_cases(device, dry_run)))
    for (name, dtype, q, k, v, kwargs), grad in cases:
        verdicts = check_against_reference(triton_fn, q, k, v, grad=grad, return_lse=True, **kwargs)
        # The LSE tolerance is infinite when a row sees no key; finite rows are judged by the others.
        ok = all(x.ok for x in verdicts) and len(verdicts) >= (5 if grad else 2)
        all_ok &= ok
        worst = max(x.error / x.tolerance if x.tolerance > 0 else float(x.error > 0) for x in verdicts)
        dt = str(dtype).replace("torch.", "")
        print(f"{'PASS' if ok else 'FAIL'}  {name:22s} {dt:9s} worst err/tol {worst:.3f}", flush=True)
        if not ok:
            for x in verdicts:
                print("      ", x)
        rows.append([name, dt, f"{worst:.4f}", ";".join(f"{x.name}={x.error:.3e}" for x in verdicts),
                     "PASS" if ok else "FAIL"])
    with open(outdir / "correctness.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case", "dtype", "worst_err_over_tol", "errors", "status"])
        writer.writerows(rows)
    return all_ok


def run_flex_handoff(device: str) -> bool:
    """tileattn.flex_attention on ``device``: on CUDA it hands the call to PyTorch's compiled
    FlexAttention; forward and backward judged against the fp64 flex reference (2x rule)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from tileattn.flex import examples
    from tileattn.flex.semantics import flex_reference
    from tileattn.core.testing import judge

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device=device, generator=gen) for _ in range(3))
    block_mask = create_block_mask(examples.sliding_window(64), None, None, 256, 256, device=device)
    dout = torch.randn(2, 4, 256, 64, device=device, generator=gen)

    def run(fn, **extra):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, score_mod=examples.alibi(4), block_mask=block_mask, **extra)
        return [out, *torch.autograd.grad(out, leaves, dout)]

    got, oracle, plain = run(tileattn.flex_attention), run(flex_reference, compute_dtype=torch.float64), \
        run(flex_reference)
    verdicts = [judge(n, a, o, p, torch.float32) for n, a, o, p in zip(("out", "dq", "dk", "dv"), got, oracle, plain)]
    ok = all(x.ok for x in verdicts)
    print(f"{'PASS' if ok else 'FAIL'}  flex_attention on {device} (window 64 + ALiBi score_mod), fwd+bwd", flush=True)
    for x in verdicts:
        print("      ", x)
    return ok


# ----------------------------------------------------------------------------------------- speed


_FLEX = {}


def _compiled_flex():
    """One torch.compile'd flex_attention for the whole run (each new shape recompiles once)."""
    if not _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # 20 shapes x fwd/bwd exceed dynamo's default of 8 recompiles, after which flex_attention
        # would silently fall back to eager (materialised scores) and its numbers would be meaningless.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _implementations(causal: bool, seqlen: int, use_flex: bool):
    """name -> f(q, k, v) -> out, for (B, H, S, D) CUDA tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def ours(q, k, v):
        return tileattn.flash_attention(q, k, v, causal=causal, backend="triton")

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)

    impls = {"tileattn-triton": ours, "sdpa-flash": sdpa}
    if use_flex:
        from torch.nn.attention.flex_attention import create_block_mask

        compiled = _compiled_flex()
        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b, h, qi, kj: qi >= kj, B=None, H=None, Q_LEN=seqlen,
                                           KV_LEN=seqlen, device="cuda")

        def flex(q, k, v):
            return compiled(q, k, v, block_mask=block_mask)

        impls["flex-attention"] = flex
    return impls


def run_speed(outdir: Path, seqlens, head_dims, rounds: int, flex_seqlens) -> bool:
    """Measure and plot; False if tileattn's output strayed from SDPA's on some shape."""
    rows, mismatches = [], 0
    for d in head_dims:
        for causal in (False, True):
            for s in seqlens:
                b = max(1, TOKENS // s)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, HEADS, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                           .requires_grad_(True) for _ in range(3))
                dout = torch.randn_like(q)
                pairs = s * (s + 1) / 2 if causal else s * s
                fwd_flops = 4.0 * b * HEADS * pairs * d
                impls = _implementations(causal, s, use_flex=s in flex_seqlens)
                steps = {}
                for name, f in impls.items():
                    steps[(name, "fwd")] = lambda f=f: f(q, k, v)
                    steps[(name, "fwd+bwd")] = lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), dout)
                for step in steps.values():  # warm up: compile, autotune, allocate
                    step()
                    step()
                with torch.no_grad():
                    # The autotuned tiles are not those of part (a): hold them to SDPA on every shape.
                    ours, theirs = impls["tileattn-triton"](q, k, v), impls["sdpa-flash"](q, k, v)
                    diff = float((ours.float() - theirs.float()).abs().max())
                mismatches += diff > MAX_DIFF_VS_SDPA
                # Interleaved: every implementation once per round, 5 calls per sample.
                samples = measure.time_interleaved(steps, rounds, device="cuda", iters=5)
                for (name, mode), times in samples.items():
                    ms = measure.median(times) * 1e3
                    flops = fwd_flops * (1.0 if mode == "fwd" else 3.5)  # backward = 2.5x forward
                    tflops = flops / (ms * 1e-3) / 1e12
                    rows.append([name, mode, d, int(causal), s, b, f"{ms:.4f}", f"{tflops:.1f}", f"{diff:.2e}"])
                    print(f"D={d:3d} causal={int(causal)} S={s:6d} B={b:2d} {name:16s} {mode:8s} "
                          f"{ms:8.3f} ms {tflops:7.1f} TFLOP/s  (triton vs sdpa max diff {diff:.1e})", flush=True)
                del q, k, v, dout
                torch.cuda.empty_cache()
    with open(outdir / "speed.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["impl", "mode", "head_dim", "causal", "seqlen", "batch", "ms", "tflops",
                         "triton_max_abs_diff_vs_sdpa"])
        writer.writerows(rows)
    _plot(rows, outdir / "speed.png", head_dims)
    return mismatches == 0


def _decode_implementations(q, k, v, pool_k, pool_v, table, used, use_flex: bool):
    """name -> step() of one decoding step over full caches; q (B, 1, Hq, D), caches as decode_problem's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    group = q.shape[2] // k.shape[2]
    # (B, H, S, D) views for SDPA and Flex; SDPA's flash kernel needs K/V repeated to the query heads.
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (kh, vh))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(qh, k_rep, v_rep).transpose(1, 2)

    impls = {
        "tileattn-triton": lambda: tileattn.flash_attention(q, k, v, layout="BSND", causal=True, backend="triton"),
        "tileattn-triton-paged": lambda: tileattn.flash_attention(
            q, pool_k, pool_v, layout="BSND", causal=True, block_table=table, seqused_k=used, backend="triton"),
        "sdpa-flash-repeated-kv": sdpa,
    }
    if use_flex:
        compiled = _compiled_flex()
        impls["flex-decoding"] = lambda: compiled(qh, kh, vh, enable_gqa=True).transpose(1, 2)
    return impls


def run_decode_speed(outdir: Path, rounds: int, use_flex: bool) -> bool:
    """Time one decoding step per shape; False if an implementation strayed from SDPA's output."""
    rows, mismatches = [], 0
    gen = torch.Generator(device="cpu").manual_seed(2)
    for b in DECODE_BATCHES:
        for cache in DECODE_CACHES:
            problem = decode_problem(b, DECODE_HEADS, DECODE_DIM, cache, DECODE_PAGE, torch.bfloat16, "cuda", gen,
                                     ragged=False)
            impls = _decode_implementations(*problem, use_flex=use_flex)
            with torch.no_grad():
                outs = {name: step() for name, step in impls.items()}  # warm up: compile, allocate
                diffs = {name: float((out.float() - outs["sdpa-flash-repeated-kv"].float()).abs().max())
                         for name, out in outs.items()}
                mismatches += sum(diff > MAX_DIFF_VS_SDPA for diff in diffs.values())
                samples = measure.time_interleaved(impls, rounds, device="cuda", iters=20)
            kv_bytes = 2 * b * DECODE_HEADS[1] * cache * DECODE_DIM * 2  # what a GQA-aware kernel must read
            for name, times in samples.items():
                ms = measure.median(times) * 1e3
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                rows.append([name, b, cache, f"{ms:.4f}", f"{gbps:.0f}", f"{diffs[name]:.2e}"])
                print(f"decode B={b} cache={cache:6d} {name:24s} {ms:8.4f} ms {gbps:7.0f} GB/s of K/V  "
                      f"(max diff vs sdpa {diffs[name]:.1e})", flush=True)
            del problem, impls, outs
            torch.cuda.empty_cache()
    with open(outdir / "decode_speed.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["impl", "batch", "cache", "ms", "kv_gb_per_s", "max_abs_diff_vs_sdpa"])
        writer.writerows(rows)
    return mismatches == 0


def _plot(rows, path: Path, head_dims):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("fwd", "fwd+bwd")
    fig, axes = plt.subplots(len(head_dims) * 2, 2, figsize=(11, 4 * len(head_dims) * 2), squeeze=False)
    for r, (d, causal) in enumerate((d, c) for d in head_dims for c in (0, 1)):
        for c, mode in enumerate(modes):
            ax = axes[r][c]
            for impl in sorted({row[0] for row in rows}):
                pts = [(row[4], float(row[7])) for row in rows
                       if row[0] == impl and row[1] == mode and row[2] == d and row[3] == causal]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, D={d}, {'causal' if causal else 'full'}, bf16, B*S=16k, H=16")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------ main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path, help="folder for correctness.csv, speed.csv and speed.png")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny CPU shapes through Triton's interpreter, correctness only, no timing")
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median kept)")
    p.add_argument("--flex-seqlens", type=int, nargs="*", default=[1024, 4096, 16384],
                   help="lengths at which FlexAttention is measured (each shape costs a compile)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention entirely")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-decode", action="store_true", help="skip the decoding timings (c)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        from tileattn.backends.triton.launch import interpreter_active

        if not interpreter_active():
            # The interpreter must be on before triton is imported: start over in a fresh process.
            env = dict(os.environ, TRITON_INTERPRET="1")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--dry-run", str(args.outdir)]
            return subprocess.run(cmd, env=env).returncode
        ok = run_correctness(args.outdir, "cpu", dry_run=True)
        print("dry run: correctness " + ("PASS" if ok else "FAIL") + "; speed skipped (no timing on CPU)")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    import triton

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if not args.skip_correctness:
        # One fixed tile per feature set: the grid compiles once per case instead of autotuning each.
        previous = os.environ.get("TILEATTN_TRITON_FIXED")
        os.environ["TILEATTN_TRITON_FIXED"] = "1"
        try:
            ok = run_correctness(args.outdir, "cuda", dry_run=False) and run_flex_handoff("cuda")
        finally:
            if previous is None:
                os.environ.pop("TILEATTN_TRITON_FIXED")
            else:
                os.environ["TILEATTN_TRITON_FIXED"] = previous
        if not ok:
            print("correctness FAILED: speed not measured", file=sys.stderr)
            return 1
    flex_seqlens = set() if args.no_flex else set(args.flex_seqlens)
    ok = run_speed(args.outdir, args.seqlens, args.head_dims, args.rounds, flex_seqlens)
    if not args.skip_decode:
        ok &= run_decode_speed(args.outdir, args.rounds, use_flex=not args.no_flex)
    if not ok:
        print(f"an implementation differs from SDPA by more than {MAX_DIFF_VS_SDPA} on some shape "
              "(see speed.csv, decode_speed.csv)", file=sys.stderr)
        return 1
    print(f"wrote {args.outdir / 'correctness.csv'}, {args.outdir / 'speed.csv'}, {args.outdir / 'speed.png'}"
          + ("" if args.skip_decode else f", {args.outdir / 'decode_speed.csv'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
