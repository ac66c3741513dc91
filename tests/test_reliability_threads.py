"""The CPU engine's worker threads: callers' thread-local state (inference mode, thread counts),
Ctrl-C, and bitwise reproducibility whatever the thread count or the number of concurrent callers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import tileattn
import tileattn.npu as torch_npu
from tileattn.backends.cpu import TileConfig, kernels, parallel

from conftest import assert_matches_reference, make_qkv, sigint_as_usual


@pytest.fixture
def two_threads():
    """Two intra-op threads (more than one task runs on workers), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _dialect_calls():
    """Every dialect on a problem of several tasks (two batch items, two heads)."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=40, sk=48, d=16, seed=1)
    bsnd = [t.transpose(1, 2) for t in (q, k, v)]
    return {
        "flash_attention": lambda: tileattn.flash_attention(q, k, v, causal=True, backend="cpu"),
        "flash_attn_func": lambda: tileattn.flash_attn_func(*bsnd, causal=True),
        "flash_attn_with_kvcache": lambda: tileattn.flash_attn_with_kvcache(
            bsnd[0], bsnd[1], bsnd[2], cache_seqlens=torch.tensor([48, 30], dtype=torch.int32), causal=True),
        "scaled_dot_product_attention": lambda: tileattn.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True),
        "npu_fusion_attention": lambda: torch_npu.npu_fusion_attention(
            q, k, v, 4, "BNSD", scale=0.25, sparse_mode=3)[0],
    }


@pytest.mark.parametrize("name", list(_dialect_calls()))
def test_every_dialect_runs_under_inference_mode(two_threads, name):
    call = _dialect_calls()[name]
    expected = call()
    with torch.inference_mode():
        got = call()
    assert got.is_inference()
    assert torch.equal(got, expected)


def test_inference_mode_call_then_normal_call_on_one_thread():
    """Buffers a thread keeps between calls must serve calls in and out of inference mode alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q, k, v = make_qkv(b=1, hq=1, sq=32, d=16, seed=2)
        with torch.inference_mode():
            inside = tileattn.flash_attention(q, k, v, backend="cpu")
        outside = tileattn.flash_attention(q, k, v, backend="cpu")
        assert torch.equal(inside, outside)
    finally:
        torch.set_num_threads(before)


def test_autograd_state_does_not_leak_into_tasks(two_threads):
    q, k, v = make_qkv(b=2, hq=2, sq=40, d=16, seed=3, requires_grad=True)
    with torch.no_grad():
        out = tileattn.flash_attention(q, k, v, backend="cpu")
    assert not out.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_autocast = tileattn.flash_attention(q, k, v, backend="cpu")
    assert out_autocast.dtype == torch.float32
    assert torch.equal(out_autocast, tileattn.flash_attention(q, k, v, backend="cpu"))


def _fresh_thread_count():
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_calls_leave_every_threads_count_and_the_process_default_alone(two_threads):
    q, k, v = make_qkv(b=2, hq=4, sq=64, d=16, seed=4)
    assert _fresh_thread_count() == 2
    counts = {}

    def caller(name, own=None, ready=None, go=None):
        if own is not None:
            torch.get_num_threads()  # PyTorch initialises a thread's count on first use, from the default
            torch.set_num_threads(own)  # also sets the process default, which the main thread resets
            ready.set()
            go.wait()
        mine = torch.get_num_threads()
        for _ in range(3):
            tileattn.flash_attention(q, k, v, backend="cpu")
        counts[name] = (mine, torch.get_num_threads())

    # A thread with its own count (3) calls while the process default is 2: the call must write
    # neither 3 nor 1 as the default.
    ready, go = threading.Event(), threading.Event()
    t = threading.Thread(target=caller, args=("three", 3, ready, go))
    t.start()
    ready.wait()
    torch.set_num_threads(2)
    go.set()
    t.join()
    assert counts["three"] == (3, 3)
    assert _fresh_thread_count() == 2

    # Concurrent callers; threads created while they run must still get the process default.
    callers = [threading.Thread(target=caller, args=(f"c{i}",)) for i in range(3)]
    for t in callers:
        t.start()
    during = []
    while any(t.is_alive() for t in callers):
        during.append(_fresh_thread_count())
    for t in callers:
        t.join()
    assert all(counts[f"c{i}"] == (2, 2) for i in range(3))
    assert set(during) == {2}, f"threads created during calls got {sorted(set(during))} threads"
    assert _fresh_thread_count() == 2 and torch.get_num_threads() == 2


_INTERRUPTED_CALL = """
import os, sys, threading, time, traceback
import torch, tileattn
torch.set_num_threads(2)
q = torch.randn(1, 16, 8192, 16)
print("calling", flush=True)
try:
    while True:  # calls of about a second each, whatever the machine's speed
        tileattn.flash_attention(q, q, q, backend="cpu")
except KeyboardInterrupt as exc:
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    # Inside the call: almost always while the CPU engine's run_tasks waits for its workers; on a
    # loaded machine sometimes while the launcher prepares operands or the API builds the call.
    print("interrupted in the call:", any(os.sep + "tileattn" + os.sep in f for f in frames), flush=True)
    workers = [t.name for t in threading.enumerate() if t.name.startswith("tileattn")]
    print("workers", workers, flush=True)
    {after}
"""


@pytest.mark.parametrize("reraise", [False, True])
def test_ctrl_c_stops_a_long_call_cleanly(reraise):
    """SIGINT in the middle of a call: KeyboardInterrupt reaches the caller promptly, no worker
    thread is left running, and the process exits normally (no abort at exit)."""
    script = _INTERRUPTED_CALL.format(after="raise" if reraise else "sys.exit(0)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_as_usual)
    try:
        assert child.stdout.readline().strip() == "calling"
        time.sleep(1.0)
        child.send_signal(signal.SIGINT)
        sent = time.perf_counter()
        out, err = child.communicate(timeout=60)
        # A task is a few milliseconds: the caller must not wait for the rest of the call.
        assert time.perf_counter() - sent < 5.0
    finally:
        child.kill()
    lines = out.splitlines()
    assert lines[:2] == ["interrupted in the call: True", "workers []"], (out, err)
    assert "terminate called" not in err, err
    # Python exits through SIGINT when a KeyboardInterrupt is left uncaught (not SIGABRT).
    assert child.returncode == (-signal.SIGINT if reraise else 0), (child.returncode, err)


def _run(q, k, v, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = tileattn.flash_attention(*leaves, backend="cpu", return_lse=True, **kwargs)
    out.backward(dout)
    return [out.detach(), lse] + [t.grad for t in leaves]


#: Shapes whose arithmetic used to depend on the thread count: one task on the caller's thread
#: (PyTorch split its element-wise operations over the intra-op threads), and GQA heads batched
#: into tiles by a thread-count-dependent rule.
_REPRODUCIBLE = [
    dict(shape=(1, 1, 1, 300, 300, 64), kwargs={}),
    dict(shape=(1, 32, 8, 5, 700, 128), kwargs=dict(causal=True)),
    dict(shape=(2, 4, 2, 80, 96, 16), kwargs=dict(causal=True), config=TileConfig(24, 40)),
]


@pytest.mark.parametrize("case", _REPRODUCIBLE, ids=lambda c: "x".join(map(str, c["shape"])))
def test_bitwise_identical_for_any_thread_count_and_concurrent_callers(case):
    b, hq, hkv, sq, sk, d = case["shape"]
    q, k, v = make_qkv(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, seed=8)
    dout = torch.randn(b, hq, sq, d, generator=torch.Generator().manual_seed(9))
    cpu = tileattn.get_backend("cpu")
    cpu.config_override = case.get("config")
    threads = torch.get_num_threads()
    try:
        results = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results[n] = _run(q, k, v, dout, **case["kwargs"])
        torch.set_num_threads(2)
        concurrent = [None, None]

        def caller(i):
            concurrent[i] = _run(q, k, v, dout, **case["kwargs"])

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
    finally:
        torch.set_num_threads(threads)
        cpu.config_override = None
    names = ("out", "lse", "dq", "dk", "dv")
    for label, other in [("2 threads", results[2]), ("3 threads", results[3]),
                         ("caller 0", concurrent[0]), ("caller 1", concurrent[1])]:
        differ = [n for n, a, b in zip(names, results[1], other) if not torch.equal(a, b)]
        assert not differ, f"{label} differs from 1 thread in {differ}"


def test_without_per_thread_controls_tasks_run_on_the_callers_thread(two_threads, monkeypatch):
    """Where the OpenMP runtime cannot be reached, tasks run in order on the caller's thread with its
    own settings: correct, and nobody's thread count changes."""
    monkeypatch.setattr(parallel._ThreadLimit, "get", classmethod(lambda cls: None))
    names = []
    real = kernels.forward_block

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "forward_block", spy)
    q, k, v = make_qkv(b=2, hq=2, sq=40, d=16, seed=10)
    assert_matches_reference("cpu", q, k, v, causal=True, grad=False)
    assert len(names) > 1 and set(names) == {threading.current_thread().name}
    assert torch.get_num_threads() == 2 and _fresh_thread_count() == 2
