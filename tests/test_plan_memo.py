"""The plan memo keeps no tensor alive: a plan holds shapes, flags and the lowered kernel arguments,
and a call's tensors (q, k, v, seqused_k, block_table, and the tensors of its modifiers) are bound
per call. A growing KV cache makes a new call shape every step, so before, every step's K and V
stayed alive in the memo (+1.17 GiB after 250 decode steps).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import tileattn
from tileattn.core import api, lean, plans
from tileattn.core.dispatch import get_backend


def _tensors_reachable(root) -> list:
    """Tensors reachable from ``root`` through plain objects (not through modules, classes or
    functions, which reach everything)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, type(sys), type(_tensors_reachable))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        stack.extend(gc.get_referents(obj))
    return found


def _steps(kind: str, step: int):
    """One call of a loop whose shapes change every step: its tensors and keywords."""
    g = torch.Generator().manual_seed(step)
    n = 40 + step  # the cache grows by one key per step
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)
    kwargs = {}
    if kind == "seqused_k":
        kwargs["seqused_k"] = torch.tensor([n, n // 2], dtype=torch.int32)
    elif kind == "paged":
        pool = 2 * (-(-n // 8))
        k, v = torch.randn(pool, 8, 2, 16, generator=g), torch.randn(pool, 8, 2, 16, generator=g)
        kwargs["block_table"] = torch.arange(pool, dtype=torch.int32).reshape(2, -1)
        kwargs["seqused_k"] = torch.tensor([n, n - 3], dtype=torch.int32)
    elif kind == "modifiers":
        kwargs.update(mask=torch.rand(2, 1, 1, n, generator=g) > 0.2, bias=torch.randn(4, 1, n, generator=g),
                      alibi_slopes=torch.rand(4, generator=g), sinks=torch.randn(4, generator=g), causal=True)
    return (q, k, v), kwargs


@pytest.mark.parametrize("kind", ["plain", "seqused_k", "paged", "modifiers"])
def test_a_growing_decode_cache_leaves_nothing_alive_in_the_plans(kind):
    plans.clear()
    refs = []
    for step in range(12):
        tensors, kwargs = _steps(kind, step)
        for _ in range(3):  # the second call makes the shape's plan, the third is served by it
            with lean.bypassed():  # the full path's memo (the lean call's: the next test)
                tileattn.flash_attention(*tensors, **kwargs)
        refs += [weakref.ref(t) for t in list(tensors) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        del tensors, kwargs
    assert plans.count("full") == (3 if kind == "paged" else 12)  # a pool grows by whole pages
    assert all(isinstance(plan, api.Plan) for plan in plans.entries("full"))
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} tensors of earlier calls are still alive"
    for plan in plans.entries("full"):
        assert not _tensors_reachable(plan)


@pytest.mark.parametrize("kind", ["plain", "seqused_k", "paged", "modifiers"])
def test_the_lean_calls_of_a_growing_decode_cache_share_one_plan_that_holds_no_tensor(kind):
    plans.clear()
    refs = []
    for step in range(12):
        tensors, kwargs = _steps(kind, step)
        for _ in range(2):
            tileattn.flash_attention(*tensors, **kwargs)
        refs += [weakref.ref(t) for t in list(tensors) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        del tensors, kwargs
    kept = [plan for plan in plans.entries("lean") if plan is not None]
    # one plan whatever the cache length (a block table, whose width is in the key, grows by whole
    # pages); none for modifiers that bind tensors per call (mask, bias, ALiBi, sinks), and none
    # where the native engine, the one that prepares calls, cannot be built
    native = not get_backend("native").unavailable_reason()
    assert len(kept) == ({"paged": 3, "modifiers": 0}.get(kind, 1) if native else 0)
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} tensors of earlier calls are still alive"
    for plan in kept:
        assert not _tensors_reachable(plan)


def test_one_bounded_memo_holds_every_kind_of_plan_and_no_tensor(monkeypatch):
    """The lean call's prepared plans, the full path's plans and the modifiers' lowered arguments
    live in one memo (tileattn.core.plans) with one bound: the oldest entry goes first, whatever
    its kind, and no entry of any kind reaches a tensor."""
    plans.clear()
    monkeypatch.setattr(plans, "LIMIT", 6)
    g = torch.Generator().manual_seed(0)
    for n in range(20, 30):  # decode steps (which the lean call serves) and prefills
        q = torch.randn(1, 2, 1 if n % 2 else n, 16, generator=g)
        k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(2))
        slopes = torch.rand(2, generator=g)
        for _ in range(2):
            tileattn.flash_attention(q, k, v, causal=True)
            tileattn.flash_attention(q, k, v, alibi_slopes=slopes)
        assert sum(plans.count(kind) for kind in ("lean", "full", "lowered")) <= 6
    kinds = {kind: list(plans.entries(kind)) for kind in ("lean", "full", "lowered")}
    assert kinds["full"] and kinds["lowered"], kinds
    assert any(isinstance(plan, lean.LeanPlan) for plan in kinds["lean"]) == \
        (not get_backend("native").unavailable_reason())
    for entries in kinds.values():
        for plan in entries:
            assert not _tensors_reachable(plan)
    plans.clear()
    assert not any(plans.count(kind) for kind in kinds)


def test_training_steps_of_varying_lengths_leave_nothing_alive():
    plans.clear()
    refs = []
    for step, n in enumerate((33, 48, 57, 64, 80)):
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(1, 2, n, 16, generator=g, requires_grad=True) for _ in range(3))
        bias = torch.randn(2, n, n, generator=g, requires_grad=True)
        for _ in range(2):
            out = tileattn.flash_attention(q, k, v, bias=bias, causal=True, softcap=20.0, dropout_p=0.1)
            out.sum().backward()
        refs += [weakref.ref(t) for t in (q, k, v, bias, out, q.grad, bias.grad)]
        del q, k, v, bias, out
    gc.collect()
    assert all(r() is None for r in refs)
    assert plans.count("full") and not any(_tensors_reachable(plan) for plan in plans.entries("full"))


_RSS_SCRIPT = textwrap.dedent("""
    import os, torch, tileattn

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    for step in range(STEPS):
        q = torch.randn(1, 8, 1, 64)
        k = torch.randn(1, 8, 1000 + step, 64)  # 2 MiB each for k and v, one key longer every step
        v = torch.randn(1, 8, 1000 + step, 64)
        tileattn.flash_attention(q, k, v)
        if step == 19:
            base = rss()
    print(rss() - base)
""")


def test_rss_stays_flat_over_a_growing_decode_cache():
    """The issue's loop in a fresh process: 100 steps of a cache that grows by one key would hold
    ~400 MiB of old K/V in the memo; the bound allows 32 MiB of allocator noise. Allocations go
    through mmap (a fixed threshold), so freed tensors leave the process's resident memory."""
    env = dict(**__import__("os").environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT.replace("STEPS", "120")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = int(proc.stdout.strip().splitlines()[-1])
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 100 decode steps"
