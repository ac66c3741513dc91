"""Run independent tiles of work on the cores, one single-threaded worker per core.

Why not let PyTorch's intra-op pool parallelise each tile operation? A tile step is a handful of
operations of 50-200 microseconds each; splitting every one of them over the cores costs a fork/join
barrier per operation, and on a shared machine a barrier waits for whichever core was preempted.
Giving each core whole work items (a query block of one head, or one head in the backward pass) the
way PyTorch's own C++ flash kernel does removes those barriers: every operation runs on one core,
start to end, and the Python threads overlap because torch operations release the GIL.

Every task runs in the same state, whichever thread runs it (a worker, or the caller's thread when
there is one worker): one intra-op thread, inference mode, autocast off. So the arithmetic of a task
never depends on the thread count, on scheduling or on the caller's thread-local modes, and with the
task plan fixed by :func:`planned_workers`, results (output, LSE, gradients) are bitwise identical
for any ``torch.get_num_threads()`` and any number of concurrent callers, on one machine and PyTorch
build (another CPU count plans other tasks, and other CPUs round vectorised operations differently
anyway).

One intra-op thread per task, without touching anyone else's settings: ``torch.set_num_threads``
cannot do it, because besides the calling thread's count it rewrites process-wide state (the
default that PyTorch gives every thread created later, and the QNNPACK pool size); a worker calling
it once left threads created during a call single-threaded for good. Instead :class:`_ThreadLimit`
sets the calling thread's own OpenMP and MKL counts (``omp_set_num_threads`` and
``mkl_set_num_threads_local`` are per-thread), and the caller's thread gets its values back after
the tasks it ran. Where the runtime does not expose them, tasks run one after another on the
caller's thread with its own settings (correct; bitwise reproducibility across thread counts then
holds only for equal thread counts).

Ctrl-C: the caller's thread only waits while the workers run, so it stays interruptible. On
KeyboardInterrupt (or any error in a task) the remaining tasks are abandoned, each worker finishes
its current task and exits, and the exception reaches the caller once no worker is left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Callable, Optional, Sequence

import torch


def planned_workers() -> int:
    """The worker count task sizes are planned for: the machine's CPU count, not
    ``torch.get_num_threads()``. The way a call is cut into tasks changes the shapes of the tensor
    operations, and with them the rounding (the vectorised tail of an element-wise operation falls
    on other elements); planning for a machine constant keeps results independent of the thread
    count."""
    return os.cpu_count() or 1


def run_tasks(tasks: Sequence[Callable[[], None]], max_workers: Optional[int] = None) -> None:
    """Run every task once, in order of the list (the caller puts the most expensive first), on up
    to ``torch.get_num_threads()`` workers (or ``max_workers``). Tasks must write disjoint outputs,
    unless ``max_workers=1``, which runs them one after another on the caller's thread."""
    if not tasks:
        return
    limit = _ThreadLimit.get()
    workers = min(torch.get_num_threads(), len(tasks), max_workers or len(tasks))
    if workers <= 1 or limit is None:
        with task_state(limit):
            for task in tasks:
                task()
        return
    run = _Run(tasks, limit, workers)
    threads = [threading.Thread(target=run.work, args=(n,), name=f"tileattn-cpu-{n}") for n in range(workers)]
    for t in threads:
        t.start()
    try:
        run.wait()
    except BaseException:
        run.abandon()
        run.wait(uninterrupted=True)
        raise
    finally:
        for t in threads:
            t.join()  # each has signalled its end: only its return is left
    if run.errors:
        raise run.errors[0]


@contextlib.contextmanager
def task_state(limit: Optional["_ThreadLimit"]):
    """The state every task runs in: one intra-op thread (when ``limit`` can set it), inference mode
    (outputs of a call made under ``torch.inference_mode`` are inference tensors, which only inference
    mode may write; buffers a thread keeps between calls are always made and written here), and
    autocast off (the engine's arithmetic is fixed by its own dtypes)."""
    saved = limit.set_single() if limit is not None else None
    try:
        with torch.inference_mode(), torch.autocast("cpu", enabled=False):
            yield
    finally:
        if saved is not None:
            limit.restore(saved)


class _Run:
    """The shared state of one :func:`run_tasks` call: the next task to take, errors, abandonment,
    and one event per worker that says it has stopped working.

    The caller waits on those events rather than on ``Thread.join``: a KeyboardInterrupt that lands
    inside ``join`` can leave the thread marked as stopped while it still runs (CPython's
    bpo-45274 handling), and then nothing would wait for it.
    """

    def __init__(self, tasks, limit, workers):
        self.tasks = tasks
        self.limit = limit
        self.lock = threading.Lock()
        self.next = 0
        self.errors = []
        self.finished = [threading.Event() for _ in range(workers)]

    def take(self) -> Optional[Callable[[], None]]:
        with self.lock:
            if self.errors or self.next >= len(self.tasks):
                return None
            self.next += 1
            return self.tasks[self.next - 1]

    def abandon(self):
        with self.lock:
            self.next = len(self.tasks)

    def work(self, n):
        try:
            with task_state(self.limit):
                while (task := self.take()) is not None:
                    try:
                        task()
                    except BaseException as exc:  # re-raised in the caller
                        with self.lock:
                            self.errors.append(exc)
                        return
        finally:
            self.finished[n].set()

    def wait(self, uninterrupted=False):
        """Until every worker has stopped. Timed waits stay interruptible on every platform; with
        ``uninterrupted``, further Ctrl-C are ignored: leaving workers running would let the
        interpreter exit under them (an abort at exit)."""
        for event in self.finished:
            while True:
                try:
                    if event.wait(0.25):
                        break
                except KeyboardInterrupt:
                    if not uninterrupted:
                        raise


class _ThreadLimit:
    """Set the calling thread's own intra-op thread count, nothing else.

    PyTorch's CPU operations split over ``omp_get_max_threads()`` of the calling thread, and MKL's
    GEMMs over that or, once a thread has one, its MKL-local count (PyTorch sets both when it first
    initialises a thread after ``torch.set_num_threads`` was called). Both setters are per-thread.
    They are looked up in the libraries PyTorch loaded, and trusted only once a probe thread saw
    ``torch.get_num_threads()`` follow them.
    """

    _instance = None
    _probed = False
    _probe_lock = threading.Lock()

    def __init__(self, omp_set, omp_get, mkl_set_local):
        self.omp_set, self.omp_get, self.mkl_set_local = omp_set, omp_get, mkl_set_local

    @classmethod
    def get(cls) -> Optional["_ThreadLimit"]:
        with cls._probe_lock:
            if not cls._probed:
                cls._probed = True
                cls._instance = cls._probe()
        return cls._instance

    def set_single(self):
        """Make this thread's operations single-threaded; returns what :meth:`restore` needs."""
        torch.get_num_threads()  # PyTorch initialises a thread's counts on first use: not after ours
        previous_omp = self.omp_get()
        previous_mkl = self._set_mkl_local(1)
        self.omp_set(1)
        return previous_omp, previous_mkl

    def restore(self, saved):
        previous_omp, previous_mkl = saved
        self.omp_set(previous_omp)
        self._set_mkl_local(previous_mkl)

    def _set_mkl_local(self, n):
        """Set this thread's MKL count (0 = none of its own); returns the previous one."""
        if self.mkl_set_local is None:
            return 0
        # The Fortran entry point (trailing underscore) takes its argument by reference, whichever
        # way MKL was linked into PyTorch.
        return self.mkl_set_local(ctypes.byref(ctypes.c_int(n)))

    @classmethod
    def _probe(cls) -> Optional["_ThreadLimit"]:
        omp_set, omp_get = _symbol("omp_set_num_threads"), _symbol("omp_get_max_threads")
        if omp_set is None or omp_get is None:
            return None
        omp_set.restype, omp_get.restype = None, ctypes.c_int
        mkl_set_local = _symbol("mkl_set_num_threads_local_")
        if mkl_set_local is not None:
            mkl_set_local.restype = ctypes.c_int
        limit = cls(omp_set, omp_get, mkl_set_local)
        seen = []

        def probe():
            before = torch.get_num_threads()
            saved = limit.set_single()
            seen.append(torch.get_num_threads() == 1)
            limit.restore(saved)
            seen.append(torch.get_num_threads() == before)

        t = threading.Thread(target=probe, name="tileattn-probe")
        t.start()
        t.join()
        return limit if seen == [True, True] else None


def _symbol(name: str):
    """``name`` from the process's global symbols or from a library PyTorch ships, or None."""
    for lib in _loaded_libraries():
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def _loaded_libraries():
    try:
        yield ctypes.CDLL(None)
    except (OSError, TypeError):  # no global namespace to search (Windows)
        pass
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:
        names = sorted(os.listdir(libdir))
    except OSError:
        return
    mode = getattr(os, "RTLD_NOLOAD", 0)  # only libraries already loaded (POSIX)
    for name in names:
        shared = name.endswith((".dylib", ".dll")) or ".so" in name
        # The OpenMP runtime PyTorch ships, and torch_cpu, which holds MKL in the official builds.
        if shared and ("omp" in name or "torch_cpu" in name):
            try:
                yield ctypes.CDLL(os.path.join(libdir, name), mode=mode)
            except OSError:
                continue
