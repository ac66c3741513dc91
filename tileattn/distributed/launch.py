"""Run a function on ``world_size`` local processes with torch.distributed initialised: the tests,
the hub recipe and the benchmark use it so that nothing needs an external launcher.

    outcomes = run_local(train_step, 2, batch, backend="gloo")   # fn(*args) on ranks 0 and 1

Each process gets the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), joins a process group through a fresh file
store, runs ``fn(*args)`` and reports its return value or its error. The parent waits at most
``timeout`` seconds in all and then kills what still runs, so a hang becomes a reported failure.
With torchrun the same ``fn`` runs unchanged after ``init_process_group()``.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class Outcome:
    """What one rank did: ``value`` when ``ok``; else ``error`` (type and message) and traceback."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0
    exitcode: Optional[int] = None


def _child(rank, world, store, backend, threads, timeout, results, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(*args)
        buf = io.BytesIO()
        torch.save(value, buf)  # bytes, not shared-memory handles: this process exits right after
        results.put(Outcome(rank, True, buf.getvalue(), seconds=time.perf_counter() - t0))
    except BaseException as exc:  # reported to the parent, which decides
        results.put(Outcome(rank, False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                            seconds=time.perf_counter() - t0))
    results.close()
    results.join_thread()  # the report is flushed to the parent before the process ends
    # No destroy_process_group: after a peer's failure it could block; the process ends here.
    os._exit(0)


def run_local(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 300.0,
              threads: Optional[int] = None, check: bool = True):
    """``fn(*args)`` on ``world_size`` new processes; returns each rank's value (``check``) or every
    :class:`Outcome` (``check=False``: failures are data, e.g. for fault tests).

    ``fn`` must be importable by reference (a module-level function). ``threads`` per process
    defaults to the usable cores shared out between the processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = threads or max(1, len(os.sched_getaffinity(0)) // world_size)
    with tempfile.TemporaryDirectory(prefix="tileattn-cp-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, world_size, store, backend, threads, timeout, results, fn,
                                                  args), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got = {}
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                o = results.get(timeout=0.2)
                got[o.rank] = o
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
                got.setdefault(r, Outcome(r, False, error=f"TimeoutError: still running after {timeout:g} s (killed)"))
            got.setdefault(r, Outcome(r, False, error=f"ProcessDied: exited with status {p.exitcode} and no report"))
            got[r].exitcode = p.exitcode
    outcomes = [got[r] for r in range(world_size)]
    for o in outcomes:
        if o.ok:
            o.value = torch.load(io.BytesIO(o.value), weights_only=False)
    if not check:
        return outcomes
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError("tileattn.distributed.launch.run_local: " + " | ".join(
            f"rank {o.rank}: {o.error}\n{o.traceback}" for o in failed))
    return [o.value for o in outcomes]
