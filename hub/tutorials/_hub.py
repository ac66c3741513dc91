"""Small helpers shared by the tutorials: sizes, checks, timing, peak memory and plots.

Kept deliberately short so a reader can see everything a tutorial relies on.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

#: ``TILEATTN_SMALL=1`` shrinks every tutorial to seconds (what the test suite runs).
SMALL = os.environ.get("TILEATTN_SMALL") == "1"
REPO = Path(__file__).resolve().parents[2]


def pick(small, full):
    """The small-size value under ``TILEATTN_SMALL=1``, the full-size value otherwise."""
    return small if SMALL else full


def check(condition: bool, claim: str) -> None:
    """Assert a claim the prose makes; unlike ``assert`` this survives ``python -O``."""
    if not condition:
        raise AssertionError(f"tutorial claim failed: {claim}")
    print(f"  [checked] {claim}")


def plot_path(name: str) -> Path:
    """Where a figure goes: ``docs/hub/`` for full-size runs, a temp dir for small ones.

    Small runs must not overwrite the committed full-size figures; ``TILEATTN_HUB_OUT`` overrides.
    """
    out = os.environ.get("TILEATTN_HUB_OUT")
    if out:
        root = Path(out)
    elif SMALL:
        root = Path(tempfile.gettempdir()) / "tileattn-hub"
    else:
        root = REPO / "docs" / "hub"
    root.mkdir(parents=True, exist_ok=True)
    return root / name


def save_figure(fig, name: str) -> Path:
    path = plot_path(name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"  figure written to {path}")
    return path


def figure(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def interleaved_times(fns: dict, repeat: int = 5, warmup: int = 1) -> dict:
    """Median seconds of each function, run round-robin so machine noise hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _return_free_memory_to_os() -> None:
    """Ask glibc to give freed heap pages back to the OS (``malloc_trim``).

    Otherwise a block freed by an earlier step could be reused without touching new pages, and the
    resident-set high-water mark would miss memory the measured step really needed. (Setting
    ``M_MMAP_THRESHOLD`` instead would do it too, but makes every later tile allocation a slow
    ``mmap`` and would distort the timings.)
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory(fn):
    """Run ``fn`` and return (its result, peak extra resident bytes while it ran). Linux only.

    Writing "5" to /proc/self/clear_refs resets the kernel's high-water mark (VmHWM) to the current
    resident size, so VmHWM after the call minus VmRSS before it is what the call added at its peak.
    """
    if not Path("/proc/self/clear_refs").exists():
        raise RuntimeError("peak_memory needs Linux /proc/self/clear_refs; not supported on this system")
    _return_free_memory_to_os()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    result = fn()
    return result, max(0, _status_bytes("VmHWM") - before)


def seeded(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype)


MiB = float(2**20)
