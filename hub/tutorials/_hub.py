"""Small helpers shared by the tutorials: sizes, checks, timing, peak memory and plots.

Kept deliberately short so a reader can see everything a tutorial relies on. Timing and memory
go through :mod:`tileattn.tools.measure`, the module ``tileattn bench`` uses, so a tutorial's figures
mean what the command's mean.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch

from tileattn.tools import measure

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
    """Median seconds of each function, run round-robin so machine noise hits all of them alike
    (tileattn's own timing loop, :func:`tileattn.tools.measure.median_times`)."""
    return measure.median_times(fns, repeat, warmup)


def peak_memory(fn):
    """Run ``fn`` and return (its result, peak extra resident bytes while it ran). Linux only.

    :func:`tileattn.tools.measure.peak_memory` writes "5" to /proc/self/clear_refs, which resets the
    kernel's high-water mark (VmHWM) to the current resident size, so VmHWM after the call minus
    VmRSS before it is what the call added at its peak.
    """
    result, peak = measure.peak_memory(fn)
    if peak is None:
        raise RuntimeError("peak_memory needs a Linux kernel that can reset the peak resident size; not supported here")
    return result, peak


@contextlib.contextmanager
def tiles_visited():
    """The set of tiles, as (first query row, first key), whose scores the PyTorch-ops engine
    (``backend="cpu"``) computes while the block runs: it watches the engine's own walk over key
    blocks (``backends.cpu.kernels.key_blocks``), so it counts work done, not work predicted.

    Timings change with the CPU, its instruction set and the machine's load; which tiles a kernel
    visits does not, so the tutorials check this and report their timings as measurements."""
    from tileattn.backends.cpu import kernels

    seen = set()
    walk = kernels.key_blocks

    def watched(prob, i0, i1, block_n):
        for j0, j1 in walk(prob, i0, i1, block_n):
            seen.add((i0, j0))
            yield j0, j1

    kernels.key_blocks = watched
    try:
        yield seen
    finally:
        kernels.key_blocks = walk


def seeded(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype)


MiB = float(2**20)
