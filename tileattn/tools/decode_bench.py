"""The decode benchmark: one query token per sequence against a KV cache, tileattn vs SDPA and naive.

Used by ``tileattn bench --preset decode`` and ``benchmarks/bench_decode.py``.

Decode is bandwidth-bound: each step reads the whole K/V cache once and does two flops per byte or
so. The figure to quote is therefore the bytes of K/V read per second (``kv_gb_per_s``), against the
machine's measured streaming read bandwidth (:func:`tileattn.tools.measure.memory_bandwidth`).

Contenders, timed round-robin in one run (:func:`tileattn.tools.measure.time_interleaved`):

* ``tileattn``: :func:`tileattn.flash_attention` with the cache in place and ``seqused_k`` (what a
  serving loop calls; dispatch picks the engine, the native split-KV decode kernel on CPUs; a
  repeated call takes the lean path, :mod:`tileattn.core.lean`).
* ``tileattn_full``: the same call with the lean path bypassed: validation, dispatch and the engine's
  keyword wrapper on every call (the path of the revisions before the lean call).
* ``sdpa_repeat``: PyTorch's SDPA after ``repeat_interleave`` of K/V to the query heads, the repeat
  inside the timed region (what a user of SDPA without GQA support must do on every step).
* ``sdpa_prerepeated``: the same SDPA call on K/V repeated once, outside the timed region (a lower
  bound for SDPA: a cache kept repeated costs Hq/Hkv times the memory).
* ``sdpa_gqa``: SDPA with ``enable_gqa=True`` (PyTorch >= 2.5; no repeat).
* ``naive``: repeat, matmul, softmax, matmul in the input dtype.

The per-call overhead probe (:func:`overhead`) times each layer of a decode-sized call on its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .measure import Step, available_memory, median, memory_bandwidth, spread_pct, time_call, time_interleaved

BASELINE = "sdpa_repeat"
PROVIDERS = ("tileattn", "tileattn_full", "sdpa_repeat", "sdpa_prerepeated", "sdpa_gqa", "naive")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Fields of every CSV row / JSON result.
FIELDS = ["provider", "engine", "dtype", "batch", "cache", "heads_q", "heads_kv", "head_dim", "status", "note", "reps",
          "median_ms", "min_ms", "max_ms", "spread_pct", "tokens_per_s", "kv_bytes", "kv_gb_per_s",
          "bandwidth_gb_per_s", "pct_bandwidth", "vs_sdpa_repeat", "vs_sdpa_gqa", "vs_tileattn_full", "max_err_vs_fp64",
          "same_bits_as_full"]


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    cache: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.float32

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def dtype_name(self) -> str:
        return {v: k for k, v in DTYPES.items()}[self.dtype]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one decode step reads."""
        return 2 * self.batch * self.heads_kv * self.cache * self.head_dim * self.dtype.itemsize

    def extra_bytes(self, provider: str) -> int:
        """Memory a contender needs besides the cache itself (repeated K/V copies)."""
        return 0 if provider in ("tileattn", "tileattn_full", "sdpa_gqa") else self.group * self.kv_bytes

    def tensors(self, seed: int = 0):
        """(q (B, Hq, 1, D), k_cache, v_cache (B, Hkv, cache, D), seqused_k int32 (B,)): a full cache."""
        gen = torch.Generator().manual_seed(seed)
        shape = (self.batch, self.heads_kv, self.cache, self.head_dim)
        q = torch.randn(self.batch, self.heads_q, 1, self.head_dim, generator=gen).to(self.dtype)
        k = torch.empty(shape, dtype=self.dtype)
        v = torch.empty(shape, dtype=self.dtype)
        for b in range(self.batch):  # filled a sequence at a time: no fp32 copy of a bf16 cache
            k[b] = torch.randn(shape[1:], generator=gen)
            v[b] = torch.randn(shape[1:], generator=gen)
        used = torch.full((self.batch,), self.cache, dtype=torch.int32)
        return q, k, v, used


def _naive(q, k, v, scale, group):
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * scale, dim=-1), v)


def contenders(case: DecodeCase, q, k, v, used, providers) -> Dict[str, Callable[[], object]]:
    """{provider: a call computing the decode step}; tileattn runs what dispatch runs."""
    from .. import flash_attention

    group, scale = case.group, 1.0 / math.sqrt(case.head_dim)
    calls = {}
    for name in providers:
        if name == "tileattn":
            calls[name] = lambda: flash_attention(q, k, v, seqused_k=used)
        elif name == "tileattn_full":
            calls[name] = lambda: _full_path(q, k, v, used)
        elif name == "sdpa_repeat":
            calls[name] = lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
        elif name == "sdpa_prerepeated":
            kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            calls[name] = lambda kr=kr, vr=vr: F.scaled_dot_product_attention(q, kr, vr)
        elif name == "sdpa_gqa":
            calls[name] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif name == "naive":
            calls[name] = lambda: _naive(q, k, v, scale, group)
        else:
            raise ValueError(f"tileattn: decode provider {name!r}; expected one of {', '.join(PROVIDERS)}")
    return calls


def _full_path(q, k, v, used):
    from .. import flash_attention
    from ..core import lean

    with lean.bypassed():
        return flash_attention(q, k, v, seqused_k=used)


def _max_error(case: DecodeCase, q, k, v, out) -> float:
    """Max |tileattn - fp64 reference| over the first sequence (the reference of all would double memory)."""
    from ..core.reference import reference

    exact = reference(q[:1], k[:1], v[:1], compute_dtype=torch.float64)
    return (out[:1].double() - exact.double()).abs().max().item()


def run_case(case: DecodeCase, providers, reps: int, warmup: int, budget_bytes: int, bandwidth: float,
             on_step: Optional[Callable[[str], None]] = None, iters: int = 1, clock=None) -> List[dict]:
    """One row per provider: timings, tokens/s, K/V GB/s, % of ``bandwidth`` and ratios."""
    from ..core.api import explain

    base = dict(dtype=case.dtype_name, batch=case.batch, cache=case.cache, heads_q=case.heads_q,
                heads_kv=case.heads_kv, head_dim=case.head_dim, kv_bytes=case.kv_bytes,
                bandwidth_gb_per_s=round(bandwidth, 2), reps=reps)
    rows = {name: dict(base, provider=name, engine="", status="ok", note="") for name in providers}
    if case.kv_bytes > budget_bytes:
        for row in rows.values():
            row.update(status="skipped", note=f"K/V of {case.kv_bytes / 2**30:.1f} GiB exceed the memory budget "
                                               f"of {budget_bytes / 2**30:.1f} GiB")
        return list(rows.values())
    q, k, v, used = case.tensors()
    room, run = budget_bytes - case.kv_bytes, []
    for name in providers:
        # a repeated K/V copy that does not fit leaves that contender out
        if case.extra_bytes(name) > room:
            rows[name].update(status="skipped", note=f"its repeated K/V ({case.extra_bytes(name) / 2**30:.1f} GiB) "
                                                     "exceed the memory budget")
        else:
            run.append(name)
            if name == "sdpa_prerepeated":
                room -= case.extra_bytes(name)
    calls = contenders(case, q, k, v, used, run)
    if "tileattn" in calls:
        engine = [name for name, why in explain(q, k, v, seqused_k=used).items() if not why]
        rows["tileattn"]["engine"] = engine[0] if engine else ""
        out = calls["tileattn"]()
        rows["tileattn"]["max_err_vs_fp64"] = _max_error(case, q, k, v, out)
        if "tileattn_full" in calls:
            rows["tileattn"]["same_bits_as_full"] = bool(torch.equal(out, calls["tileattn_full"]()))

    def failed(name, exc):
        rows[name].update(status="error", note=f"{type(exc).__name__}: {exc}"[:200])

    samples = time_interleaved(calls, reps=reps, warmup=warmup, on_error=failed, on_step=on_step, iters=iters,
                               clock=clock or time.perf_counter)
    for name, times in samples.items():
        if not times:
            continue
        sec = median(times)
        rows[name].update(median_ms=sec * 1e3, min_ms=min(times) * 1e3, max_ms=max(times) * 1e3,
                          spread_pct=spread_pct(times), tokens_per_s=case.batch / sec,
                          kv_gb_per_s=case.kv_bytes / sec / 1e9, pct_bandwidth=100 * case.kv_bytes / sec / 1e9 / bandwidth)
    for ref in ("sdpa_repeat", "sdpa_gqa", "tileattn_full"):
        if rows.get(ref, {}).get("median_ms"):
            for row in rows.values():
                if row.get("median_ms"):
                    row[f"vs_{ref}"] = rows[ref]["median_ms"] / row["median_ms"]
    return list(rows.values())


def grid(batches, caches, dtypes, heads_q=32, heads_kv=8, head_dim=128) -> List[DecodeCase]:
    return [DecodeCase(b, c, heads_q, heads_kv, head_dim, DTYPES[d]) for d in dtypes for b in batches for c in caches]


def memory_budget(fraction: float = 0.4) -> int:
    """Bytes the benchmark may hold at once: ``fraction`` of the memory available now."""
    return int(fraction * (available_memory() or 4 * 2**30))


def run_grid(cases: List[DecodeCase], providers=PROVIDERS, reps: int = 5, warmup: int = 1,
             budget_bytes: Optional[int] = None, threads: Optional[int] = None,
             on_case: Optional[Callable[[DecodeCase], None]] = None, iters: int = 1, clock=None) -> List[dict]:
    """Every case's rows, on ``threads`` torch threads (default: every usable core); each timed
    sample is the mean of ``iters`` back-to-back calls (small calls: several), timed by ``clock``
    (default wall time; see :func:`tileattn.tools.measure.time_call`)."""
    from .measure import usable_cores

    threads = threads or usable_cores()
    budget = memory_budget() if budget_bytes is None else budget_bytes
    bandwidth = memory_bandwidth(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        with torch.inference_mode():
            for case in cases:
                if on_case is not None:
                    on_case(case)
                rows += run_case(case, providers, reps, warmup, budget, bandwidth, iters=iters, clock=clock)
    finally:
        torch.set_num_threads(before)
    return rows


# ---------------------------------------------------------------------------------------------
# Per-call overhead of a decode-sized call, layer by layer.


def overhead(cache: int = 128, batch: int = 1, heads_q: int = 8, heads_kv: int = 2, head_dim: int = 64,
             iters: int = 2000, reps: int = 7, dtype: torch.dtype = torch.float32, clock=None) -> List[dict]:
    """Microseconds per call of each layer of ``flash_attention(q, k, v, seqused_k=...)`` on the
    native engine, each timed on its own over ``iters`` back-to-back calls (median of ``reps``), and
    of SDPA's whole call. Two paths: the lean call (a repeated call: memo lookup, then the plan's
    checks, the output allocation and the prepared kernel call) and the full path (validation +
    dispatch + run_forward: allocation, argument building, kernel wrapper). The layers nest, so
    differences between rows are each layer's own cost."""
    from .. import flash_attention
    from ..core import lean, ops
    from ..backends.native import kernels
    from ..core.dispatch import select
    from ..core.spec import build_spec
    from ..core.tunecache import lookup

    case = DecodeCase(batch, cache, heads_q, heads_kv, head_dim, dtype)
    q, k, v, used = case.tensors()
    spec = build_spec(q, k, v, seqused_k=used)
    engine = select(spec)
    if engine.name != "native":
        raise RuntimeError(f"tileattn: the overhead probe needs the native engine; dispatch chose {engine.name!r}")
    call = engine._call_arguments(spec)
    out = torch.empty(batch, heads_q, 1, head_dim, dtype=dtype)
    lse = torch.empty(batch, heads_q, 1)
    lib = kernels._library()
    loc = lib.buffers()
    kernels.forward(spec.q_c, spec.k_c, spec.v_c, out, lse, *call)
    keywords = ("BNSD", None, None, False, None, "bottom_right", 0.0, used, None, False, "auto")
    with torch.inference_mode():
        for _ in range(2):  # the first call makes the lean plan
            flash_attention(q, k, v, seqused_k=used)
        _, plan = lean.lookup(q, k, v, *keywords)
    if plan is None:
        raise RuntimeError("tileattn: the overhead probe's call made no lean plan")
    prepared = plan.prepared
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), None, cache, k.stride()[:3], v.stride()[:3],
            used.data_ptr(), 0)
    group = case.group

    def full():
        with lean.bypassed():
            return flash_attention(q, k, v, seqused_k=used)

    layers = [
        ("flash_attention(seqused_k=) whole call, lean path", lambda: flash_attention(q, k, v, seqused_k=used)),
        ("  lean.lookup (call key + memo)", lambda: lean.lookup(q, k, v, *keywords)),
        ("  LeanPlan.run (K/V checks + output + prepared call)", lambda: plan.run(q, k, v, used, None, False)),
        ("    prepared call (pointers, strides + C)", lambda: prepared.run(*ptrs)),
        ("flash_attention(seqused_k=) whole call, full path", full),
        ("  build_spec (validation)", lambda: build_spec(q, k, v, seqused_k=used)),
        ("  dispatch.select", lambda: select(spec)),
        ("  ops.run_forward (alloc + engine)", lambda: ops.run_forward(spec, engine, False)),
        ("    engine._call_arguments (incl. tune cache)", lambda: engine._call_arguments(spec)),
        ("      tunecache.lookup", lambda: lookup("native", spec)),
        ("    kernels.forward (packing + C)",
         lambda: kernels.forward(spec.q_c, spec.k_c, spec.v_c, out, lse, *call)),
        ("custom op round trip (ops.attention_forward, with autograd)",
         lambda: ops.attention_forward(*ops.pack(spec, engine.name, False))),
        ("C kernel alone (ta_forward)", lambda: lib.forward_fn(loc.args_addr)),
        ("sdpa whole call (enable_gqa)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        ("sdpa whole call (repeat_interleave)", lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))),
    ]
    samples = {name: [] for name, _ in layers}
    with torch.inference_mode():
        for _ in range(reps):  # layers interleaved: a burst of load hits all of them alike
            for name, fn in layers:
                if name.startswith("C kernel"):
                    # this thread's struct last held another call's (freed) output: pack this call's
                    kernels.forward(spec.q_c, spec.k_c, spec.v_c, out, lse, *call)
                fn()
                samples[name].append(time_call(fn, iters=iters, clock=clock or time.perf_counter) * 1e6)
    return [dict(layer=name, cache=cache, dtype=case.dtype_name, median_us=median(times), min_us=min(times),
                 spread_pct=spread_pct(times)) for name, times in samples.items()]
