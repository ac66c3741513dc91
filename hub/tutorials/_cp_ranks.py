"""What each process runs in tutorial 12 (context parallelism).

Under ``torchrun`` this would be the script every rank runs after ``init_process_group``; in the
tutorial :func:`tileattn.distributed.launch.run_local` starts the processes. It is a module of its
own because a process started with ``spawn`` (what ``run_local`` uses: ``fork`` is unsafe once
torch has started threads) finds the function it must run by *importing* it: a tutorial's own
functions are not importable (a notebook has no file, and a script would be re-run from the top in
every child). :func:`spawn` deals with the second half of that (see its docstring).

Nothing here judges anything: the ranks return their shards put back together, what they sent and
how long they worked, and the tutorial checks it all against ``tileattn.reference`` in the parent.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import tileattn
import tileattn.distributed as cp
from tileattn.distributed.launch import run_local


def inputs(S, H, Hkv, D, seed=0, batch=1):
    """Full q, k, v, dout and dlse: the same tensors on every rank and in the parent."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return (rand(batch, H, S, D), rand(batch, Hkv, S, D), rand(batch, Hkv, S, D), rand(batch, H, S, D),
            rand(batch, H, S))


def _stats(s: cp.CommStats) -> dict:
    """What one rank sent, by (operation, tag): messages and bytes."""
    return dict(messages=dict(s.messages), bytes=dict(s.bytes), wait_s=s.wait_s)


def attend(mode, S, H, Hkv, D, seed=0, load_balance=True, group=None):
    """One causal attention call sharded over the group, forward and backward (through the output
    and the LSE). Returns the whole out, lse, dq, dk, dv (every rank's shard put back together) and
    the messages this rank sent in the forward and in the backward."""
    q, k, v, dout, dlse = inputs(S, H, Hkv, D, seed)
    place = dict(group=group, load_balance=load_balance)
    q, k, v = (cp.shard(t, seq_dim=2, **place).requires_grad_() for t in (q, k, v))
    dout, dlse = cp.shard(dout, seq_dim=2, **place), cp.shard(dlse, seq_dim=2, **place)
    with cp.count_collectives() as fwd:
        out, lse = cp.context_parallel_attention(q, k, v, causal=True, mode=mode, group=group,
                                                 load_balance=load_balance, return_lse=True, timeout=120)
    with cp.count_collectives() as bwd:
        torch.autograd.backward([out, lse], [dout, dlse])
    whole = lambda t: cp.unshard(t.detach(), seq_dim=2, **place)  # noqa: E731
    return dict(out=whole(out), lse=whole(lse), dq=whole(q.grad), dk=whole(k.grad), dv=whole(v.grad),
                local_tokens=q.shape[2], fwd=_stats(fwd), bwd=_stats(bwd))


def busy_times(S, H, Hkv, D, reps):
    """Causal ring attention, forward and backward, with contiguous and with zigzag placement,
    alternating (so that a change in the machine's load hits both alike): per repetition, this
    rank's wall time, the CPU time of its (single) compute thread, and the time it spent blocked
    waiting for the other rank."""
    torch.set_num_threads(1)  # the compute then runs in this thread: its CPU time is this rank's work
    q, k, v, dout, _ = inputs(S, H, Hkv, D, seed=1)
    placements = {"contiguous": False, "zigzag": True}
    shards = {name: ([cp.shard(t, seq_dim=2, load_balance=lb) for t in (q, k, v)],
                     cp.shard(dout, seq_dim=2, load_balance=lb)) for name, lb in placements.items()}
    result = {name: [] for name in placements}
    for rep in range(reps + 1):  # the first is a warm-up
        for name, load_balance in placements.items():
            leaves = [t.detach().requires_grad_() for t in shards[name][0]]
            dist.barrier()
            with cp.count_collectives() as stats:
                wall, cpu = time.perf_counter(), time.thread_time()
                out = cp.context_parallel_attention(*leaves, causal=True, load_balance=load_balance, timeout=120)
                out.backward(shards[name][1])
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            if rep:
                result[name].append((wall, cpu, stats.wait_s))
    return result


def link_and_flops(S, H, Hkv, D, reps=5):
    """This machine's two numbers of the ring's overlap condition: gloo's bytes/s between the two
    processes (a K/V block of ``S / 2`` tokens sent back and forth) and causal attention FLOP/s on
    one thread (the forward of one zigzag ring step's work)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    block = torch.randn(2, Hkv, S // 2, D)  # K and V of S/2 tokens, fp32
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(block, 1)
            dist.recv(block, 1)
        else:
            dist.recv(block, 0)
            dist.send(block, 0)
        times.append((time.perf_counter() - t0) / 2)  # one transfer each way
    link = block.numel() * block.element_size() / statistics.median(times[1:])
    n = S // 2
    q, k, v = (torch.randn(1, H if i == 0 else Hkv, n, D) for i in range(3))
    runs = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        tileattn.flash_attention(q, k, v, causal=True)
        runs.append(time.perf_counter() - t0)
    flops = 2.0 * n * n * H * D / statistics.median(runs[1:])  # causal: half of 4 n^2 H D
    return dict(bytes_per_s=link, flops=flops)


def heads_error(H=3):
    """Ulysses with a head count the group does not divide: the error every rank raises, then a
    correct call on the same group (it stays usable)."""
    q, k, v, _, _ = inputs(16, H, H, 8)
    q, k, v = (cp.shard(t, seq_dim=2) for t in (q, k, v))
    try:
        cp.context_parallel_attention(q, k, v, causal=True, mode="ulysses", timeout=60)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    out = cp.context_parallel_attention(q, k, v, causal=True, mode="ring", timeout=60)
    return dict(message=message, usable=bool(torch.isfinite(out).all()))


def two_ranks(cfg):
    """Every experiment of the chapter that runs on 2 processes, in one group."""
    S, H, Hkv, D = cfg["S"], cfg["H"], cfg["Hkv"], cfg["D"]
    res = dict(rank=dist.get_rank())
    res["ring"] = attend("ring", S, H, Hkv, D)
    res["ring_contiguous"] = attend("ring", S, H, Hkv, D, load_balance=False)
    res["ulysses"] = attend("ulysses", S, H, Hkv, D)
    res["ulysses_mqa"] = attend("ulysses", S, H, 1, D, seed=2)  # one kv head for 2 ranks: replicated
    res["heads_error"] = heads_error()
    res["busy"] = busy_times(cfg["S_time"], cfg["H_time"], cfg["Hkv_time"], cfg["D_time"], cfg["reps"])
    res["machine"] = link_and_flops(cfg["S_time"], cfg["H_time"], cfg["Hkv_time"], cfg["D_time"])
    return res


def four_ranks(cfg):
    """The 4-process experiments: ring and Ulysses over 4 ranks, hybrid on a 2 x 2 mesh."""
    S, H, Hkv, D = cfg["S"], cfg["H"], cfg["Hkv"], cfg["D"]
    mesh = cp.hybrid_mesh(ring_size=2, ulysses_size=2)
    return dict(rank=dist.get_rank(), ring=attend("ring", S, H, Hkv, D), ulysses=attend("ulysses", S, H, Hkv, D),
                hybrid=attend("hybrid", S, H, Hkv, D, group=mesh))


def spawn(fn, world, *args):
    """``run_local(fn, world, *args)`` from a script that is not guarded by ``if __name__ ==
    "__main__":`` (a tutorial runs top to bottom). A spawned child re-runs the parent's main script
    when it has a file, to find functions defined there; ours are here, so the file is hidden from
    ``multiprocessing`` for the duration, as it is in a notebook, which has none."""
    main = sys.modules["__main__"]
    path = main.__dict__.pop("__file__", None)
    try:
        return run_local(fn, world, *args, timeout=600)
    finally:
        if path is not None:
            main.__file__ = path
