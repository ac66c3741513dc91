"""Benchmark cases and attention providers, and the driver that times them against each other.

Used by ``tileattn bench``/``tileattn memory``/``tileattn tune``, by ``benchmarks/`` and by the hub.

* A :class:`Case` is one problem (shape, dtype, causal, mode, device).
* A *provider* is one way of computing attention: ``native``/``cpu``/``triton``/``reference``
  (tileattn engines: the C kernels, the PyTorch-ops fallback, the GPU kernels, the exact oracle),
  ``tileattn`` (automatic dispatch: on CPU tensors the native engine where its kernels build, else
  ``cpu``), ``sdpa`` (PyTorch's fused kernel), ``naive`` (matmul-softmax-matmul in the input dtype)
  and ``flex`` (FlexAttention). A provider that cannot run a case says why instead of crashing; a
  result names the tileattn engine that ran it (``engine``).
* :func:`run_case` times every provider round-robin within each repetition (the starting provider
  rotates), so machine noise hits all providers alike; compare ratios, not absolute times. The
  timing loop, its statistics and the peak-memory reading come from :mod:`tileattn.tools.measure`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from .measure import Outcome, Step, TimingStats, peak_memory, time_interleaved

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
        """The validated :class:`~tileattn.core.spec.AttentionSpec` of this case, on meta tensors."""
        from ..core.spec import build_spec

        q = torch.empty(self.batch, self.heads, self.seqlen_q, self.head_dim, dtype=self.dtype, device="meta")
        kv = torch.empty(self.batch, self.heads, self.seqlen_k, self.head_dim, dtype=self.dtype, device="meta")
        return build_spec(q, kv, kv, causal=self.causal)

    def flops(self) -> float:
        return self.spec().flops() * MODE_FLOP_FACTOR[self.mode]

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


#: Providers that are tileattn engines -> the backend they ask dispatch for ("auto": its choice).
ENGINES = {"native": "native", "cpu": "cpu", "triton": "triton", "reference": "reference", "tileattn": "auto"}


def engine_of(provider: str, case: Case, q, k, v) -> str:
    """The tileattn engine that runs ``case`` for ``provider`` (the provider itself when it is not a
    tileattn engine); :class:`Unsupported` with the reason when it cannot run it."""
    name = ENGINES.get(provider)
    if name is None:
        return provider
    from ..core.dispatch import get_backend, select
    from ..core.spec import build_spec

    inp = build_spec(q, k, v, causal=case.causal)
    if name == "auto":
        try:
            return select(inp, "auto").name
        except ValueError as exc:
            raise Unsupported(str(exc).splitlines()[0]) from None
    try:
        backend = get_backend(name)
    except ValueError:
        raise Unsupported(f"backend {name!r} is not registered here (is its package installed?)") from None
    why = backend.not_supported_reasons(inp)
    if why:
        raise Unsupported("; ".join(why))
    return name


def _tileattn_engine(provider: str):
    def build(case: Case, q, k, v):
        from .. import flash_attention

        engine = engine_of(provider, case, q, k, v)
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
    **{provider: _tileattn_engine(provider) for provider in ENGINES},
    "sdpa": _build_sdpa,
    "naive": _build_naive,
    "flex": _build_flex,
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
# Benchmark driver.


class Status(Outcome):
    """How a provider fared on a case; the value is the ``status`` field of CSV and JSON rows."""

    OK = "ok"
    UNSUPPORTED = "unsupported"  # the provider cannot run this case: ``note`` says why
    ERROR = "error"  # the provider raised: ``note`` holds the first line of the error


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
    engine: str = ""  # the tileattn engine that ran the case (for sdpa, naive, flex: the provider)
    status: Status = Status.OK
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

    def fail(self, status: Status, note: str) -> None:
        self.status, self.note = status, note
        self.times_ms.clear()

    def as_record(self) -> dict:
        """Flat dict with the fields documented in docs/cli.md (CSV and JSON)."""
        rec = asdict(self)
        rec.update(
            status=self.status.value,
            reps=len(self.times_ms),
            median_ms=self.median_ms,
            min_ms=self.min_ms,
            max_ms=self.max_ms,
            spread_pct=self.spread_pct,
            gflops_per_s=None if self.flops_per_s is None else self.flops_per_s / 1e9,
            peak_mem_mib=None if self.peak_mem_bytes is None else self.peak_mem_bytes / 2**20,
            times_ms=list(self.times_ms),
        )
        return rec


def describe_error(exc: BaseException, limit: int = 200) -> str:
    """'TypeName: first line of the message', at most ``limit`` characters: one table cell."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:limit]


def run_case(case: Case, providers: List[str], reps: int, warmup: int, memory: bool = True,
             baseline: Optional[str] = None, on_step: Optional[Callable[[str], None]] = None,
             seed: int = 0) -> List[Result]:
    """Time ``providers`` on one case, interleaved. ``on_step(label)`` is called after every call.

    A provider that cannot run the case, or raises, is marked so in its :class:`Result`; the others
    go on.
    """
    tick = on_step or (lambda label: None)
    q, k, v, dout = case.make_tensors(seed)
    flops = case.flops()
    results: Dict[str, Result] = {}
    steps: Dict[str, Step] = {}
    for name in providers:
        res = Result(provider=name, device=case.device, dtype=case.dtype_name, batch=case.batch,
                     heads=case.heads, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k,
                     head_dim=case.head_dim, causal=case.causal, mode=case.mode, flops=flops)
        results[name] = res
        try:
            res.engine = engine_of(name, case, q, k, v)
            prepare, run = make_step(PROVIDERS[name](case, q, k, v), case, q, k, v, dout)
            steps[name] = Step(run=run, prepare=prepare)
        except Unsupported as exc:
            res.fail(Status.UNSUPPORTED, str(exc))
        except Exception as exc:  # a provider that fails to build must not stop the others
            res.fail(Status.ERROR, describe_error(exc))

    def untimed(name, fn):
        """``fn()``, or None with the provider marked as failed (and dropped) if it raises."""
        try:
            return fn()
        except Exception as exc:
            results[name].fail(Status.ERROR, describe_error(exc))
            steps.pop(name)
            return None

    def call(step):
        step.prepare()
        return step.run()

    # Every provider first makes this very call once, untimed: what a call pays once per process, per
    # mode or per shape (kernel loading, a compilation per shape, thread pools, the first backward's
    # buffers: 75 MiB of first-use growth on the first fwd+bwd row after fwd rows) belongs in neither
    # the memory figure nor the timings, which describe a call in steady state.
    for name in list(steps):
        untimed(name, lambda: call(steps[name]))
        tick(name)

    # One untimed call per provider measures memory; the warm-up rounds after it absorb the page
    # faults of memory the measurement returned to the kernel.
    def peak_bytes(step):
        step.prepare()
        return peak_memory(step.run, case.device)[1]

    for name in list(steps):
        if memory:
            results[name].peak_mem_bytes = untimed(name, lambda: peak_bytes(steps[name]))
        tick(name)

    def failed(name, exc):
        results[name].fail(Status.ERROR, describe_error(exc))

    samples = time_interleaved(steps, reps, warmup, case.device, on_error=failed, on_step=tick)
    for name, seconds in samples.items():
        if results[name].status is Status.OK:
            results[name].times_ms = [t * 1e3 for t in seconds]
    base = results.get(baseline) if baseline else None
    for res in results.values():
        if base is not None and base.median_ms and res.median_ms:
            res.baseline, res.speedup = baseline, base.median_ms / res.median_ms
    return [results[n] for n in providers]


def calls_per_case(n_providers: int, reps: int, warmup: int) -> int:
    """Progress-bar ticks :func:`run_case` makes per case when every provider runs: the first call,
    the memory measurement's turn, the warm-up rounds and the timed repetitions."""
    return n_providers * (reps + warmup + 2)


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
