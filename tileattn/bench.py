"""Measurement engine: attention providers, interleaved timing and peak-memory measurement.

Used by ``tileattn bench``/``tileattn memory``/``tileattn tune``, by ``benchmarks/`` and by the hub.

* A :class:`Case` is one problem (shape, dtype, causal, mode, device).
* A *provider* is one way of computing attention: ``cpu``/``triton``/``reference`` (tileattn
  engines), ``tileattn`` (automatic dispatch), ``sdpa`` (PyTorch's fused kernel), ``naive``
  (matmul-softmax-matmul in the input dtype) and ``flex`` (FlexAttention). A provider that cannot run
  a case says why instead of crashing.
* :func:`run_cases` times every provider round-robin within each repetition (the starting provider
  rotates), so machine noise hits all providers alike; compare ratios, not absolute times.
* :func:`measure_peak_memory` measures the extra memory a call really uses: the CUDA allocator's peak
  on GPUs; on Linux CPUs the process's peak resident set (``VmHWM``), reset just before the call
  through ``/proc/self/clear_refs`` after returning free heap pages to the kernel, so it sees every
  allocation (PyTorch, NumPy, numba), not only PyTorch's.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

MODES = ("fwd", "bwd", "fwd+bwd")
#: FLOPs of a mode relative to the forward pass (FlashAttention's convention: backward = 2.5x).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    causal: bool = False
    mode: str = "fwd"
    device: str = "cpu"

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def spec(self):
        """The validated :class:`~tileattn.spec.AttentionSpec` of this case, on meta tensors."""
        from .spec import build_spec

        q = torch.empty(self.batch, self.heads, self.seqlen_q, self.head_dim, dtype=self.dtype, device="meta")
        kv = torch.empty(self.batch, self.heads, self.seqlen_k, self.head_dim, dtype=self.dtype, device="meta")
        return build_spec(q, kv, kv, causal=self.causal)

    def flops(self) -> float:
        return self.spec().flops() * MODE_FLOP_FACTOR[self.mode]

    def score_matrix_bytes(self) -> int:
        """Size of the (B, H, Sq, Sk) score matrix that naive attention materialises."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.batch * self.heads * self.seqlen_q * self.seqlen_k * itemsize

    def make_tensors(self, seed: int = 0):
        """Seeded q, k, v (requiring grad unless the mode is forward only) and an output gradient."""
        gen = torch.Generator().manual_seed(seed)
        grad = self.mode != "fwd"

        def rand(s):
            t = torch.randn(self.batch, self.heads, s, self.head_dim, generator=gen, dtype=torch.float32)
            return t.to(device=self.device, dtype=self.dtype).requires_grad_(grad)

        q, k, v = rand(self.seqlen_q), rand(self.seqlen_k), rand(self.seqlen_k)
        dout = rand(self.seqlen_q).detach()
        return q, k, v, dout


def bottom_right_causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Bool (Sq, Sk), True = take part: query i sees key j iff j <= i + Sk - Sq (tileattn's rule)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


class Unsupported(Exception):
    """A provider cannot run a case; the message says why."""


# ---------------------------------------------------------------------------------------------
# Providers: name -> builder(case, q, k, v) returning a forward callable ``f(q, k, v) -> out``.


def _tileattn_engine(name: str):
    def build(case: Case, q, k, v):
        from . import flash_attention
        from .dispatch import get_backend, select
        from .spec import build_spec

        inp = build_spec(q, k, v, causal=case.causal)
        if name == "auto":
            try:
                engine = select(inp, "auto").name
            except ValueError as exc:
                raise Unsupported(str(exc).splitlines()[0]) from None
        else:
            try:
                backend = get_backend(name)
            except ValueError:
                raise Unsupported(f"backend {name!r} is not registered here (is its package installed?)") from None
            why = backend.not_supported_reasons(inp)
            if why:
                raise Unsupported("; ".join(why))
            engine = name
        return lambda q, k, v: flash_attention(q, k, v, causal=case.causal, backend=engine)

    return build


def _build_sdpa(case: Case, q, k, v):
    import torch.nn.functional as F

    if case.causal and case.seqlen_q != case.seqlen_k:
        # SDPA's is_causal is top-left aligned; tileattn's is bottom-right: pass the mask explicitly.
        mask = bottom_right_causal_mask(case.seqlen_q, case.seqlen_k, q.device)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)


def _build_naive(case: Case, q, k, v):
    scale = 1.0 / math.sqrt(case.head_dim)
    mask = bottom_right_causal_mask(case.seqlen_q, case.seqlen_k, q.device) if case.causal else None

    def naive(q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v)

    return naive


_COMPILED_FLEX = {}


def _build_flex(case: Case, q, k, v):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        raise Unsupported(f"FlexAttention is not in torch {torch.__version__}") from None
    if case.device == "cpu" and case.mode != "fwd":
        raise Unsupported("FlexAttention on CPU has no backward")
    if "fn" not in _COMPILED_FLEX:
        # Uncompiled FlexAttention materialises the scores; it is only a flash kernel once compiled.
        _COMPILED_FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    compiled = _COMPILED_FLEX["fn"]
    block_mask = None
    if case.causal:
        off = case.seqlen_k - case.seqlen_q

        def causal_mod(b, h, i, j):
            return j <= i + off

        block_mask = create_block_mask(causal_mod, None, None, case.seqlen_q, case.seqlen_k, device=case.device)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


PROVIDERS: Dict[str, Callable] = {
    "cpu": _tileattn_engine("cpu"),
    "triton": _tileattn_engine("triton"),
    "reference": _tileattn_engine("reference"),
    "tileattn": _tileattn_engine("auto"),
    "sdpa": _build_sdpa,
    "naive": _build_naive,
    "flex": _build_flex,
}

PROVIDER_HELP = {
    "cpu": "tileattn's tiled CPU engine",
    "triton": "tileattn's Triton engine",
    "reference": "tileattn's exact reference (materialises the scores)",
    "tileattn": "tileattn with automatic backend choice",
    "sdpa": "torch.nn.functional.scaled_dot_product_attention",
    "naive": "matmul-softmax-matmul in the input dtype",
    "flex": "torch FlexAttention, compiled (forward only on CPU)",
}


def make_step(forward: Callable, case: Case, q, k, v, dout):
    """(prepare, run): ``prepare`` does the untimed part of one repetition, ``run`` the timed part."""
    state = {}
    if case.mode == "fwd":
        def run():
            with torch.no_grad():
                state["out"] = forward(q, k, v)
        return (lambda: state.clear()), run
    if case.mode == "fwd+bwd":
        def run():
            out = forward(q, k, v)
            state["grads"] = torch.autograd.grad(out, (q, k, v), dout)
        return (lambda: state.clear()), run

    def prepare():
        state.clear()
        state["out"] = forward(q, k, v)

    def run_bwd():
        state["grads"] = torch.autograd.grad(state.pop("out"), (q, k, v), dout)

    return prepare, run_bwd


# ---------------------------------------------------------------------------------------------
# Timing and memory.


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(run: Callable, device: str) -> float:
    """Seconds taken by ``run()``, with the device synchronised before and after."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def _proc_status_bytes(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Return free heap pages to the kernel, then make VmHWM equal the current RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_memory_method() -> Optional[str]:
    """How CPU peak memory is measured here, or None when this system offers no way."""
    if _proc_status_bytes("VmHWM") is None or not _reset_peak_rss():
        return None
    return "peak RSS (VmHWM reset via /proc/self/clear_refs)"


def measure_peak_memory(run: Callable, device: str) -> Optional[int]:
    """Peak bytes allocated by ``run()`` above what was in use before it; None if not measurable."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before)
    if not _reset_peak_rss():
        return None
    before = _proc_status_bytes("VmRSS")
    run()
    peak = _proc_status_bytes("VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before)


# ---------------------------------------------------------------------------------------------
# Benchmark driver.


class TimingStats:
    """Median and spread of ``times_ms``: shared by benchmark results and tuning candidates."""

    times_ms: List[float]

    @property
    def median_ms(self) -> Optional[float]:
        return statistics.median(self.times_ms) if self.times_ms else None

    @property
    def spread_pct(self) -> Optional[float]:
        """(max - min) / median, in percent: how noisy the repetitions were."""
        if len(self.times_ms) < 2:
            return None
        return 100.0 * (max(self.times_ms) - min(self.times_ms)) / self.median_ms


@dataclass
class Result(TimingStats):
    provider: str
    device: str
    dtype: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    mode: str
    status: str = "ok"  # "ok", "unsupported" or "error"
    note: str = ""
    times_ms: List[float] = field(default_factory=list)
    flops: float = 0.0
    peak_mem_bytes: Optional[int] = None
    baseline: Optional[str] = None
    speedup: Optional[float] = None

    @property
    def flops_per_s(self) -> Optional[float]:
        m = self.median_ms
        return self.flops / (m * 1e-3) if m else None

    def as_record(self) -> dict:
        """Flat dict with the fields documented in docs/cli.md (CSV and JSON)."""
        rec = asdict(self)
        rec.pop("times_ms")
        rec.update(
            reps=len(self.times_ms),
            median_ms=self.median_ms,
            min_ms=min(self.times_ms) if self.times_ms else None,
            max_ms=max(self.times_ms) if self.times_ms else None,
            spread_pct=self.spread_pct,
            gflops_per_s=None if self.flops_per_s is None else self.flops_per_s / 1e9,
            peak_mem_mib=None if self.peak_mem_bytes is None else self.peak_mem_bytes / 2**20,
            times_ms=list(self.times_ms),
        )
        return rec


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


_INITIALISED = set()
#: Providers whose first call at each new shape compiles (``torch.compile(dynamic=False)``).
COMPILES_PER_SHAPE = {"flex"}


def run_case(case: Case, providers: List[str], reps: int, warmup: int, memory: bool = True,
             baseline: Optional[str] = None, on_step: Optional[Callable[[str], None]] = None,
             seed: int = 0) -> List[Result]:
    """Time ``providers`` on one case, interleaved. ``on_step(label)`` is called after every call."""
    tick = on_step or (lambda label: None)
    q, k, v, dout = case.make_tensors(seed)
    flops = case.flops()
    results: Dict[str, Result] = {}
    steps = {}
    for name in providers:
        res = Result(provider=name, device=case.device, dtype=case.dtype_name, batch=case.batch,
                     heads=case.heads, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k,
                     head_dim=case.head_dim, causal=case.causal, mode=case.mode, flops=flops)
        results[name] = res
        try:
            steps[name] = make_step(PROVIDERS[name](case, q, k, v), case, q, k, v, dout)
        except Unsupported as exc:
            res.status, res.note = "unsupported", str(exc)
        except Exception as exc:  # a provider that fails to build must not stop the others
            res.status, res.note = "error", _first_line(exc)

    def attempt(name, fn):
        try:
            return fn()
        except Exception as exc:
            results[name].status, results[name].note = "error", _first_line(exc)
            results[name].times_ms.clear()
            steps.pop(name, None)
            return None

    # A provider's first call in this process pays one-time costs (kernel loading, compilation,
    # thread pools) that belong in neither the memory figure nor the timings. Compiled providers
    # pay them again for every new shape.
    for name in list(steps):
        key = (name, case) if name in COMPILES_PER_SHAPE else name
        if key not in _INITIALISED:
            prepare, run = steps[name]
            attempt(name, prepare)
            if name in steps:
                attempt(name, run)
            if name in steps:
                _INITIALISED.add(key)
    # One untimed call per provider measures memory; the warm-up calls after it absorb the page
    # faults of memory the measurement returned to the kernel.
    for name in list(steps):
        prepare, run = steps[name]
        if memory:
            attempt(name, prepare)
            if name in steps:
                results[name].peak_mem_bytes = attempt(name, lambda: measure_peak_memory(run, case.device))
        tick(name)
    for _ in range(warmup):
        for name in list(steps):
            prepare, run = steps[name]
            attempt(name, prepare)
            if name in steps:
                attempt(name, run)
            tick(name)
    for rep in range(reps):
        order = list(steps)
        shift = rep % len(order) if order else 0
        for name in order[shift:] + order[:shift]:
            if name not in steps:
                continue
            prepare, run = steps[name]
            attempt(name, prepare)
            if name in steps:
                elapsed = attempt(name, lambda: time_call(run, case.device))
                if elapsed is not None:
                    results[name].times_ms.append(elapsed * 1e3)
            tick(name)
    base = results.get(baseline) if baseline else None
    for res in results.values():
        if base is not None and base.median_ms and res.median_ms:
            res.baseline, res.speedup = baseline, base.median_ms / res.median_ms
    return [results[n] for n in providers]


def calls_per_case(n_providers: int, reps: int, warmup: int) -> int:
    """Progress-bar ticks :func:`run_case` makes per case when every provider runs."""
    return n_providers * (reps + warmup + 1)


class Progress:
    """A one-line progress bar on stderr (redrawn in place; plain lines when not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, stream=None, width: int = 30):
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_tenth = -1

    def step(self, label: str = "", n: int = 1):
        self.advance_to(self.done + n, label)

    def advance_to(self, done: int, label: str = ""):
        """Jump to ``done`` (e.g. at the end of a case whose unsupported providers made no calls)."""
        self.done = min(self.total, done)
        if not self.enabled:
            return
        frac = self.done / self.total
        filled = int(frac * self.width)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write("\r" + line[:100].ljust(100))
            self.stream.flush()
        elif int(frac * 10) != self._last_tenth:  # logs: one line per 10%
            self._last_tenth = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
