"""How tileattn measures: timing loops, their statistics, peak memory and machine probes.

One module so that ``tileattn bench``, ``tileattn tune``, ``tileattn memory``, the contest,
``benchmarks/`` and the hub's tutorials all mean the same thing by "median", "spread" and "peak
memory", and read the machine the same way. Tooling only: the engines never import it.

* **Timing** (:func:`time_interleaved`): every repetition runs each contender once, round-robin, and
  the starting contender rotates, so machine noise (other processes, frequency changes) hits all of
  them alike; compare ratios from one run, not absolute times across runs. Each sample is wall time
  on CPUs, CUDA-event time on GPUs (:func:`time_call`).
* **Statistics**: the median of the samples, and the spread ``(max - min) / median`` in percent.
* **Peak memory** (:func:`peak_memory`): what one call really adds at its peak above what was in use
  before it. On CUDA the allocator's peak after ``reset_peak_memory_stats``; on Linux CPUs the
  process's resident-set high-water mark ``VmHWM``, reset to the current resident size through
  ``/proc/self/clear_refs`` after handing free heap pages back to the kernel (``malloc_trim``), so
  it sees every allocation (PyTorch, NumPy, numba), not only PyTorch's.
* **Machine**: CPU model, usable cores, SIMD flags, L2 size, memory, GPUs, and the measured
  streaming read bandwidth (:func:`memory_bandwidth`), the yardstick of bandwidth-bound decode.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import json
import os
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..core.tunecache import cpu_model, usable_cores

__all__ = [
    "median", "spread_pct", "TimingStats", "time_call", "Step", "time_interleaved", "median_times",
    "proc_status_bytes", "peak_memory", "cpu_model", "usable_cores", "cpu_flags", "cache_size", "l2_per_core",
    "available_memory", "gpus", "SIMD_FLAGS", "memory_bandwidth",
]

# ---------------------------------------------------------------------------------------------
# Statistics.


def median(samples: Sequence[float]) -> Optional[float]:
    return statistics.median(samples) if samples else None


def spread_pct(samples: Sequence[float]) -> Optional[float]:
    """(max - min) / median, in percent: how noisy the repetitions were (None below two samples)."""
    if len(samples) < 2:
        return None
    return 100.0 * (max(samples) - min(samples)) / statistics.median(samples)


class Outcome(str, Enum):
    """What became of a timed thing (a bench provider's case, a tuning candidate): its value is what
    tables, CSV and JSON show."""

    def __str__(self) -> str:
        return self.value


class TimingStats:
    """Median, spread and range of ``times_ms``: the statistics of every timed result."""

    times_ms: List[float]

    @property
    def median_ms(self) -> Optional[float]:
        return median(self.times_ms)

    @property
    def spread_pct(self) -> Optional[float]:
        return spread_pct(self.times_ms)

    @property
    def min_ms(self) -> Optional[float]:
        return min(self.times_ms) if self.times_ms else None

    @property
    def max_ms(self) -> Optional[float]:
        return max(self.times_ms) if self.times_ms else None


# ---------------------------------------------------------------------------------------------
# Timing.


def synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_call(run: Callable[[], object], device: str = "cpu", iters: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of ``run()`` over ``iters`` back-to-back calls.

    CPU: wall time (``clock``; ``time.thread_time`` counts this thread's CPU time alone, which a
    single-threaded call on a shared machine keeps while the wall clock counts the other jobs). CUDA: the device is synchronised first, then CUDA events around the calls time
    the stream itself, without the tens of microseconds a host-side synchronisation would add.
    """
    synchronize(device)
    if str(device).startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / iters
    t0 = clock()
    for _ in range(iters):
        run()
    return (clock() - t0) / iters


@dataclass
class Step:
    """One contender: ``run`` is timed; ``prepare`` (untimed) runs before it in every repetition;
    ``context`` (a factory of context managers) is entered around both, outside the timed region."""

    run: Callable[[], object]
    prepare: Optional[Callable[[], object]] = None
    context: Optional[Callable[[], ContextManager]] = None


def _as_step(x: Union[Step, Callable]) -> Step:
    return x if isinstance(x, Step) else Step(run=x)


def time_interleaved(contenders: Mapping[str, Union[Step, Callable]], reps: int, warmup: int = 0,
                     device: str = "cpu", iters: int = 1,
                     on_error: Optional[Callable[[str, Exception], None]] = None,
                     on_step: Optional[Callable[[str], None]] = None,
                     clock: Callable[[], float] = time.perf_counter) -> Dict[str, List[float]]:
    """{name: [seconds per call, one per timed repetition]}, contenders run round-robin.

    ``warmup`` untimed rounds come first. The starting contender rotates every round. With
    ``on_error``, a contender that raises is reported through it and dropped (its samples cleared)
    while the others go on; without it the exception propagates. ``on_step(name)`` follows every call.
    ``clock``: see :func:`time_call`.
    """
    steps = {name: _as_step(x) for name, x in contenders.items()}
    samples: Dict[str, List[float]] = {name: [] for name in steps}
    alive = list(steps)
    for rnd in range(warmup + reps):
        shift = rnd % len(alive) if alive else 0
        for name in alive[shift:] + alive[:shift]:
            step = steps[name]
            try:
                with step.context() if step.context else contextlib.nullcontext():
                    if step.prepare is not None:
                        step.prepare()
                    elapsed = time_call(step.run, device, iters, clock)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(name, exc)
                samples[name].clear()
                alive.remove(name)
                continue
            if rnd >= warmup:
                samples[name].append(elapsed)
            if on_step is not None:
                on_step(name)
    return samples


def median_times(contenders: Mapping[str, Union[Step, Callable]], reps: int, warmup: int = 1,
                 device: str = "cpu") -> Dict[str, float]:
    """{name: median seconds per call} of :func:`time_interleaved`."""
    return {name: median(s) for name, s in time_interleaved(contenders, reps, warmup, device).items()}


# ---------------------------------------------------------------------------------------------
# Peak memory.


def proc_status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> bool:
    """Hand free heap pages back to the kernel, then make VmHWM equal the current RSS.

    Without ``malloc_trim`` a block freed by an earlier step could be reused without touching new
    pages, and the high-water mark would miss memory the measured call really needed.
    """
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


def peak_memory(fn: Callable[[], object], device: str = "cpu") -> Tuple[object, Optional[int]]:
    """(``fn()``'s result, peak bytes it added above what was in use before it, or None where this
    system offers no such counter)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, max(0, torch.cuda.max_memory_allocated() - before)
    if not _reset_peak_rss():
        return fn(), None
    before = proc_status_bytes("VmRSS")
    result = fn()
    peak = proc_status_bytes("VmHWM")
    if before is None or peak is None:
        return result, None
    return result, max(0, peak - before)


# ---------------------------------------------------------------------------------------------
# The machine.

SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "neon", "asimd", "sve")


def cpu_flags() -> List[str]:
    """The SIMD features of interest that /proc/cpuinfo lists (empty when it is unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in SIMD_FLAGS if f in have]
    except OSError:
        pass
    return []


def _parse_size(text: str) -> Optional[int]:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        return None
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def cache_size(level: int) -> Optional[int]:
    """Bytes of CPU 0's level-``level`` data or unified cache (sysfs), or None when unknown."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            if int((index / "level").read_text()) == level and (index / "type").read_text().strip() in ("Unified", "Data"):
                return _parse_size((index / "size").read_text())
    except (OSError, ValueError):
        pass
    return None


def l2_per_core() -> Tuple[Optional[int], str]:
    """(bytes of L2 per core, where the figure comes from): sysfs, else ``lscpu``; (None, why) if neither."""
    size = cache_size(2)
    if size:
        return size, "L2 per core (sysfs)"
    try:
        out = subprocess.run(["lscpu", "-B", "-C=NAME,ONE-SIZE"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts[:1] == ["L2"] and len(parts) > 1 and parts[1].isdigit():
                return int(parts[1]), "L2 per core (lscpu)"
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return None, "no cache information found"


def available_memory(device: str = "cpu") -> Optional[int]:
    """Bytes a new allocation can use now: free GPU memory, or ``MemAvailable`` (else physical RAM)."""
    if str(device).startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def gpus() -> List[dict]:
    found = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            found.append({
                "index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                "compute_capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                "shared_memory_per_block_optin": getattr(p, "shared_memory_per_block_optin", None),
            })
    return found


#: threads -> measured GB/s, one measurement per process and thread count.
_BANDWIDTH: Dict[int, float] = {}


def memory_bandwidth(threads: Optional[int] = None, size_bytes: Optional[int] = None, reps: int = 7) -> float:
    """Measured streaming read bandwidth of this machine in GB/s (1e9 bytes per second).

    A sum over an fp32 buffer much larger than the last-level cache (twice its size, between 256 MiB
    and 1 GiB, at most a quarter of the available memory), on ``threads`` torch threads (default:
    every usable core); the median of ``reps`` timed passes after one untimed pass. Cached per
    process and thread count when ``size_bytes`` is left to the default.
    """
    threads = usable_cores() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"tileattn: argument 'threads': got {threads}; expected a positive int or None")
    if reps < 1:
        raise ValueError(f"tileattn: argument 'reps': got {reps}; expected a positive int")
    cached = size_bytes is None
    if cached and threads in _BANDWIDTH:
        return _BANDWIDTH[threads]
    if size_bytes is None:
        size_bytes = min(max(2 * (cache_size(3) or 0), 256 * 2**20), 2**30)
        free = available_memory()
        if free:
            size_bytes = max(16 * 2**20, min(size_bytes, free // 4))
    if size_bytes < 4:
        raise ValueError(f"tileattn: argument 'size_bytes': got {size_bytes}; expected at least 4 bytes")
    buf = torch.ones(size_bytes // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf.sum()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    gbps = buf.numel() * 4 / statistics.median(times) / 1e9
    if cached:
        _BANDWIDTH[threads] = gbps
    return gbps


def write_results(out, rows: Sequence[dict], meta: dict) -> None:
    """A benchmark's results beside each other: ``<out>.csv`` (one line per row, the columns of the
    first) and ``<out>.json`` (``{"meta": meta, "rows": rows}``), the folder made when missing."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
