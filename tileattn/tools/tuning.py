"""The search ``tileattn tune`` runs: which tile configuration of an engine is fastest for a shape.

The cache the engines read lives in :mod:`tileattn.core.tunecache` (core); this module is tooling and
only writes to it. A grid of candidates per engine; a budget model rejects those whose working set
cannot stay in fast memory (the CPU engines: one task's tile step against the per-core L2; Triton:
the forward kernel's shared memory against the GPU's per-block limit); every survivor must pass
FlashAttention's accuracy rule against the fp64 reference before it is timed; the candidates are
timed round-robin (:func:`tileattn.tools.measure.time_interleaved`) and the fastest is stored. Candidates
run through the public operator with :func:`tileattn.core.tunecache.overriding` in force, so what is
timed is exactly what dispatch will run.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from .bench import describe_error, make_step
from .measure import Outcome, Step, TimingStats, l2_per_core, time_interleaved
from ..core.tunecache import lookup, overriding, store


# ---------------------------------------------------------------------------------------------
# Candidate spaces and budget models.

CPU_BLOCK_M = (16, 32, 64, 128, 256, 512)
CPU_BLOCK_N = (64, 128, 256, 512, 1024)
#: The native kernels: query lanes per tile (a multiple of the 32-lane AVX-512 panel; GQA heads
#: sharing a kv head are stacked as lanes) and keys per tile (a multiple of 32: see tunecache.RULES).
NATIVE_BLOCK_M = (32, 64, 128, 256, 512)
NATIVE_BLOCK_N = (64, 128, 256, 512, 1024)
#: What the kernels use when no tuned entry exists (block_m=0, block_n=0: forward.c, backward.c).
NATIVE_DEFAULT = {"block_m": 128, "block_n": 256}
#: Lanes per panel: working sets count whole panels.
NATIVE_PANEL = 32
TRITON_BLOCK_M = (32, 64, 128)
TRITON_BLOCK_N = (32, 64, 128)
TRITON_NUM_WARPS = (4, 8)
TRITON_NUM_STAGES = (2, 3, 4)
#: Shared memory assumed per Triton program when no GPU is visible (Triton's interpreter).
TRITON_DEFAULT_BUDGET = 100 * 1024


def _clamped_grid(pairs, sq: int, sk: int) -> List[Tuple[int, int]]:
    """Drop candidates equivalent to a smaller one: blocks longer than the sequence act as it."""
    seen, out = set(), []
    for bm, bn in pairs:
        key = (min(bm, _pow2_at_least(sq)), min(bn, _pow2_at_least(sk)))
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def cpu_candidates(inp) -> List[dict]:
    grid = _clamped_grid([(bm, bn) for bm in CPU_BLOCK_M for bn in CPU_BLOCK_N], inp.seqlen_q, inp.seqlen_k)
    return [{"block_m": bm, "block_n": bn} for bm, bn in grid]


def cpu_working_set(config: dict, inp) -> int:
    """Bytes one CPU task (a query block of one or more kv heads) touches per tile step, in fp32/fp64.

    The engine runs one task per core at a time, so this is what must fit in a core's L2. When the
    engine batches several kv heads into one task, the per-head working set is multiplied by the
    most heads it would batch for these tiles (an upper bound: it may batch fewer to keep every
    core busy).
    """
    from ..backends.cpu import TileConfig

    cfg = TileConfig(int(config["block_m"]), int(config["block_n"]))
    kwargs = dict(group=inp.group_size, head_dim=inp.head_dim, head_dim_v=inp.head_dim_v,
                  itemsize=inp.acc_dtype().itemsize)
    if "heads_kv" in inspect.signature(cfg.working_set_bytes).parameters:
        kwargs["heads_kv"] = 1  # older signature: bytes for all kv heads at once; we want one head's
    heads = 1
    if hasattr(cfg, "heads_per_task"):
        try:  # with plenty of tasks per head the engine batches as many heads as its tile budget allows
            heads = int(cfg.heads_per_task(inp, tasks_per_head_range=1 << 30, min_tasks=1))
        except TypeError:
            heads = 1
    return cfg.working_set_bytes(**kwargs) * max(1, heads)


def cpu_budget() -> Tuple[int, str]:
    """(bytes, where the figure comes from): the per-core L2, else 1 MiB assumed."""
    size, source = l2_per_core()
    if size is None:
        return 2**20, f"assumed 1 MiB ({source})"
    return size, source


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _native_lanes(block_m: int, group: int) -> int:
    """Lanes of a native tile: whole query rows of all ``group`` heads of a kv head, in panels."""
    return _round_up(max(1, block_m // group) * group, NATIVE_PANEL)


def native_candidates(inp) -> List[dict]:
    """Lanes clamped to the rows of a kv head (Sq x group), keys to the sequence; both at least 32."""
    rows = inp.seqlen_q * inp.group_size
    seen, out = set(), []
    for bm in NATIVE_BLOCK_M:
        for bn in NATIVE_BLOCK_N:
            key = (max(NATIVE_PANEL, min(bm, _pow2_at_least(rows))), max(32, min(bn, _pow2_at_least(inp.seqlen_k))))
            if key not in seen:
                seen.add(key)
                out.append({"block_m": key[0], "block_n": key[1]})
    return out


def native_working_set(config: dict, inp) -> int:
    """Bytes one native task touches per tile step: the larger of the forward and backward passes,
    since one tune-cache entry serves both.

    Forward (forward.c ``fwd_bufs_get``): Q^T, the score tile, the accumulator and the running
    max/sum/column max per lane, plus the K and V tile. Backward (backward.c ``bwd_bufs_get``): Q and
    dO both ways, four lanes x keys tiles (S, dP, Z, T), the K and V tile, this key block's slice of the
    dK/dV accumulators and dQ^T. Arithmetic is fp32 (fp64 for fp64); bf16 on AMX adds its bf16 copies
    of the operands.
    """
    import torch

    d, dv, g = inp.head_dim, inp.head_dim_v, inp.group_size
    lanes = _native_lanes(int(config["block_m"]), g)
    bn = _round_up(int(config["block_n"]), 32)
    real = inp.acc_dtype().itemsize
    dpan, dvpan = _round_up(d, NATIVE_PANEL), _round_up(dv, NATIVE_PANEL)
    fwd = lanes * (d + bn + dv + 3) + bn * (d + dv)
    bwd = lanes * (d + dv) + lanes * (dpan + dvpan) + 4 * lanes * bn + 2 * bn * (d + dv) + lanes * d
    halves_fwd = halves_bwd = 0
    if inp.dtype is torch.bfloat16 and _native_amx():
        halves_fwd = lanes * dpan + bn * dpan + lanes * bn + bn * dvpan
        halves_bwd = 2 * lanes * (dpan + dvpan) + bn * (2 * dpan + dvpan) + 3 * bn * lanes
    return max(fwd * real + 2 * halves_fwd, bwd * real + 2 * halves_bwd)


def _native_amx() -> bool:
    """Whether the native kernels run bf16 on AMX tiles here (False when they cannot be built)."""
    from ..backends.native import kernels

    return kernels.available()[0] and kernels.build_info()["amx"]


def triton_candidates(inp) -> List[dict]:
    grid = _clamped_grid([(bm, bn) for bm in TRITON_BLOCK_M for bn in TRITON_BLOCK_N], inp.seqlen_q, inp.seqlen_k)
    # Triton needs blocks of at least 16 for tl.dot.
    grid = [(max(16, bm), max(16, bn)) for bm, bn in grid]
    return [{"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
            for bm, bn in dict.fromkeys(grid) for w in TRITON_NUM_WARPS for st in TRITON_NUM_STAGES]


def triton_shared_memory(config: dict, inp) -> int:
    """Shared memory of the forward kernel: the Q block plus ``num_stages`` pipelined K and V blocks."""
    d = max(16, _pow2_at_least(inp.head_dim))
    dv = max(16, _pow2_at_least(inp.head_dim_v))
    itemsize = inp.dtype.itemsize
    return (config["block_m"] * d + config["num_stages"] * config["block_n"] * (d + dv)) * itemsize


def triton_budget(device) -> Tuple[int, str]:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        optin = getattr(props, "shared_memory_per_block_optin", None)
        if optin:
            return int(optin), f"shared memory per block (opt-in) of {props.name}"
        return int(getattr(props, "shared_memory_per_block", 48 * 1024)), f"shared memory per block of {props.name}"
    return TRITON_DEFAULT_BUDGET, "assumed 100 KiB (no GPU visible)"


#: backend -> (candidate generator, working-set model, budget function, label of the model)
SPACES = {
    "native": (native_candidates, native_working_set, lambda device: cpu_budget(), "working set per task"),
    "cpu": (cpu_candidates, cpu_working_set, lambda device: cpu_budget(), "working set per task"),
    "triton": (triton_candidates, triton_shared_memory, triton_budget, "shared memory per program"),
}


# ---------------------------------------------------------------------------------------------
# The search.


class Verdict(Outcome):
    """Where a candidate ended; the value is what the table and ``--json`` show."""

    PENDING = "pending"  # not yet judged
    REJECTED = "rejected"  # over the budget: never run
    WRONG = "wrong"  # fails the accuracy rule
    ERROR = "error"  # the engine raised
    TIMED = "timed"  # survived and was timed


@dataclass
class Candidate(TimingStats):
    config: dict
    working_set: int
    status: Verdict = Verdict.PENDING
    reason: str = ""
    current: bool = False
    max_error_ratio: Optional[float] = None  # worst max-error / tolerance over the checked tensors
    times_ms: List[float] = field(default_factory=list)

    def as_record(self) -> dict:
        return dict(self.config, working_set_bytes=self.working_set, status=self.status.value, reason=self.reason,
                    current=self.current, max_error_ratio=self.max_error_ratio, median_ms=self.median_ms,
                    spread_pct=self.spread_pct, times_ms=list(self.times_ms))


def current_config(backend: str, inp) -> Optional[dict]:
    """The configuration dispatch uses today for this call, when the engine has a single one."""
    if backend == "cpu":
        from ..backends.cpu import default_config

        cfg = default_config(inp)
        return {"block_m": cfg.block_m, "block_n": cfg.block_n}
    if backend == "native":
        return lookup(backend, inp) or dict(NATIVE_DEFAULT)
    return lookup(backend, inp)


def _oracle(case, q, k, v, dout):
    """(fp64 reference results, same-dtype plain-math results): [out, lse] (+ [dq, dk, dv])."""
    import torch

    from ..core.reference import reference

    def run(compute_dtype):
        leaves = [t.detach().clone().requires_grad_(case.mode != "fwd") for t in (q, k, v)]
        out, lse = reference(*leaves, causal=case.causal, return_lse=True, compute_dtype=compute_dtype)
        res = [out, lse]
        if case.mode != "fwd":
            res += list(torch.autograd.grad(out, leaves, dout.to(out.dtype)))
        return [t.detach() for t in res]

    return run(torch.float64), run(None)


def _check(backend: str, case, q, k, v, dout, oracle, yardstick) -> float:
    """Worst error/tolerance ratio of the engine's out, lse (and grads) under the accuracy rule."""
    import torch

    from .. import flash_attention
    from ..core.testing import judge

    leaves = [t.detach().clone().requires_grad_(case.mode != "fwd") for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=case.causal, return_lse=True, backend=backend)
    res = [out, lse]
    if case.mode != "fwd":
        res += list(torch.autograd.grad(out, leaves, dout))
    worst = 0.0
    for name, r, o, y in zip(("out", "lse", "dq", "dk", "dv"), res, oracle, yardstick):
        vd = judge(name, r, o, y, case.dtype)
        worst = max(worst, vd.error / vd.tolerance if vd.tolerance > 0 else float("inf"))
    return worst


def tune(backend: str, case, budget: int, reps: int = 3, warmup: int = 1, seed: int = 0,
         on_step: Optional[Callable[[str], None]] = None, store_winner: bool = True):
    """Search the configurations of ``backend`` for ``case`` (a :class:`tileattn.tools.bench.Case`).

    Returns ``(candidates, winner or None, cache path or None)``. Storing replaces whatever the cache
    held for this bucket, a malformed entry included.
    """
    from .. import flash_attention
    from ..core.spec import build_spec

    tick = on_step or (lambda label: None)
    candidates_of, working_set, _, model = SPACES[backend]
    q, k, v, dout = case.make_tensors(seed)
    inp = build_spec(q, k, v, causal=case.causal)
    current = current_config(backend, inp)
    configs = candidates_of(inp)
    if current is not None and current not in configs:
        configs.append(current)
    cands = [Candidate(cfg, working_set(cfg, inp), current=(cfg == current)) for cfg in configs]
    for c in cands:
        if c.working_set > budget:
            c.status = Verdict.REJECTED
            c.reason = f"{model} {c.working_set // 1024} KiB > budget {budget // 1024} KiB"
    oracle, yardstick = _oracle(case, q, k, v, dout)
    for c in cands:
        if c.status is not Verdict.PENDING:
            continue
        try:
            with overriding(backend, c.config):
                c.max_error_ratio = _check(backend, case, q, k, v, dout, oracle, yardstick)
            if c.max_error_ratio > 1.0:
                c.status = Verdict.WRONG
                c.reason = f"fails the accuracy rule (error {c.max_error_ratio:.2f}x tolerance)"
        except Exception as exc:  # a configuration the engine cannot launch is reported, not fatal
            c.status, c.reason = Verdict.ERROR, describe_error(exc, 160)
        tick("check")
    alive = {i: c for i, c in enumerate(cands) if c.status is Verdict.PENDING}

    def forward(q_, k_, v_):
        return flash_attention(q_, k_, v_, causal=case.causal, backend=backend)

    prepare, run = make_step(forward, case, q, k, v, dout)

    def failed(i, exc):
        alive[i].status, alive[i].reason = Verdict.ERROR, describe_error(exc, 160)

    steps = {i: Step(run=run, prepare=prepare, context=lambda c=c: overriding(backend, c.config))
             for i, c in alive.items()}
    samples = time_interleaved(steps, reps, warmup, case.device, on_error=failed, on_step=lambda i: tick("time"))
    for i, c in alive.items():
        if c.status is Verdict.PENDING:
            c.status, c.times_ms = Verdict.TIMED, [t * 1e3 for t in samples[i]]
    timed = [c for c in cands if c.status is Verdict.TIMED]
    winner = min(timed, key=lambda c: c.median_ms) if timed else None
    path = store(backend, inp, winner.config) if (winner is not None and store_winner) else None
    return cands, winner, path
