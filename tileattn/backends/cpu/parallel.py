"""Run independent tiles of work on the cores, one single-threaded worker per core.

Why not let PyTorch's intra-op pool parallelise each tile operation? A tile step is a handful of
operations of 50-200 microseconds each; splitting every one of them over the cores costs a fork/join
barrier per operation, and on a shared machine a barrier waits for whichever core was preempted.
Giving each core whole work items (a query block of one head, or one head in the backward pass) the
way PyTorch's own C++ flash kernel does removes those barriers: every operation runs on one core,
start to end, and the Python threads overlap because torch operations release the GIL.

Each worker sets its own OpenMP/MKL thread count to 1 (a per-thread setting), so workers never
oversubscribe the cores. ``torch.set_num_threads`` also records a process-wide default for threads
created later; the caller's value is restored after the workers end.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch


def run_tasks(tasks: Sequence[Callable[[], None]]) -> None:
    """Run every task once, most expensive first (the caller orders them), on up to
    ``torch.get_num_threads()`` workers. Tasks must write disjoint outputs.

    Each task's arithmetic does not depend on which worker runs it, so results are bitwise
    identical for any thread count and scheduling.
    """
    workers = min(torch.get_num_threads(), len(tasks))
    if workers <= 1:
        for task in tasks:
            task()
        return
    caller_threads = torch.get_num_threads()
    lock = threading.Lock()
    next_index = [0]
    errors = []

    def work():
        torch.set_num_threads(1)
        with torch.no_grad():
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(tasks) or errors:
                    return
                try:
                    tasks[i]()
                except BaseException as exc:  # re-raised in the caller below
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=work, name=f"tileattn-cpu-{n}", daemon=True) for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.set_num_threads(caller_threads)
    if errors:
        raise errors[0]
