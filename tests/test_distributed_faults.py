"""Faults across processes end every rank with a clear error in bounded time, never a hang.

* a rank raises inside the attention and stays alive (so its peers cannot learn of it from a closed
  connection): the peers give up after tileattn's timeout, here set through ``$TILEATTN_CP_TIMEOUT``
  as a caller who passed no ``timeout=`` gets it;
* a rank dies in the middle of the ring: its peers fail as soon as the connection drops.

Mismatched shapes and dtypes across ranks are checked up front and raise the same error on every
rank with the group still usable (``tests/test_distributed.py::test_bad_calls_...``). Both fault
groups are spawned at once (their time is mostly waiting).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import tileattn.distributed as cp
import tileattn.distributed.ring as ring_mod
from tileattn.distributed.launch import run_local

TIMEOUT_S = 3.0
SLACK_S = 6.0  # process scheduling on a loaded 2-core machine


def _fault_main(kind):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (cp.shard(torch.randn(1, 4, 64, 16, generator=gen), seq_dim=2).requires_grad_() for _ in range(3))
    kwargs = dict(causal=True)
    if kind == "raise":
        os.environ["TILEATTN_CP_TIMEOUT"] = str(TIMEOUT_S)
    else:
        kwargs["timeout"] = TIMEOUT_S
    cp.context_parallel_attention(q, k, v, **kwargs).sum().backward()  # a healthy step first
    if rank == 1:
        def broken(*args, **kw):
            if kind == "die":
                os._exit(3)
            raise RuntimeError("injected failure on rank 1")

        ring_mod.attention_partial = broken
    t0 = time.monotonic()
    try:
        cp.context_parallel_attention(q, k, v, **kwargs).sum().backward()
    except Exception as exc:
        seconds = time.monotonic() - t0
        if rank == 1:
            # Alive and silent until well after rank 0's deadline: rank 0 must give up on its own timeout,
            # not learn of the failure from a closed connection.
            time.sleep(TIMEOUT_S + SLACK_S + 2)
        return dict(error=type(exc).__name__, message=str(exc), seconds=seconds)
    return dict(error=None, seconds=time.monotonic() - t0)


@pytest.fixture(scope="module")
def outcomes():
    with ThreadPoolExecutor(2) as pool:
        futures = {kind: pool.submit(run_local, _fault_main, 2, kind, timeout=120, check=False)
                   for kind in ("raise", "die")}
        return {kind: f.result() for kind, f in futures.items()}


def test_a_rank_that_raises_ends_its_peers_after_the_timeout(outcomes):
    first, second = outcomes["raise"]
    assert second.ok and second.value["error"] == "RuntimeError", second
    assert "injected failure on rank 1" in second.value["message"]
    assert first.ok, first
    got = first.value
    assert got["error"] == "CollectiveError", got
    assert "rank 0 of 2" in got["message"] and "ring" in got["message"], got["message"]
    assert f"within {TIMEOUT_S:g} s" in got["message"] and "TILEATTN_CP_TIMEOUT" in got["message"], got["message"]
    assert TIMEOUT_S - 0.5 <= got["seconds"] <= TIMEOUT_S + SLACK_S, got


def test_a_rank_that_dies_ends_its_peers(outcomes):
    first, second = outcomes["die"]
    assert not second.ok and second.exitcode == 3, second
    assert first.ok, first
    got = first.value
    assert got["error"] == "CollectiveError", got
    assert "rank 0 of 2" in got["message"] and "ring" in got["message"], got["message"]
    assert got["seconds"] <= TIMEOUT_S + SLACK_S, got


def test_the_launcher_reports_a_hang_instead_of_waiting_for_it():
    """run_local's own bound: a rank stuck outside tileattn is killed and reported."""
    got = run_local(time.sleep, 2, 60, timeout=6, check=False)
    assert all(not o.ok and "still running after 6 s" in o.error for o in got), got
