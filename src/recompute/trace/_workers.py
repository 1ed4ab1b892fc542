"""Independent fake steps side by side: forked worker processes and this one take the jobs in turn.

Note: [steps in workers] A profile's steps (the whole model's, the anchors', the chain's parts) share nothing
while they run: each traces its own meta copy of the model on fake tensors. On a machine with more than one CPU,
worker processes forked before any job starts (they inherit the models and the fake kernels already set up, and
import nothing) and this process take the jobs one at a time, in the order given (the longest first keeps them
even), and what a worker's job returns comes back pickled. Fork only, and only on Linux: elsewhere, with one
CPU, or with CUDA initialised in this process (a forked child cannot use it), every job runs here in order. A
job that fails (here or in a worker), or one a worker that died or went silent had taken, is run again here after
the others, in order: its error is raised as it is without workers, the same one line. The figures are the same
either way (``tests/test_profile.py``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["run_jobs", "side_workers", "usable_cpus"]

T = TypeVar("T")

_FAILED = object()
PATIENCE_S = 180.0  # how long a worker may send nothing, beyond three times the longest job run here


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _forkable() -> bool:
    return sys.platform == "linux" and not torch.cuda.is_initialized()


def side_workers(workers: int | None = None) -> int:
    """How many forked processes ``run_jobs`` would run beside this one, for as many jobs as wanted: ``workers``
    (default: one per other usable CPU), or 0 where it cannot fork (the module's note)."""
    return max(0, usable_cpus() - 1 if workers is None else workers) if _forkable() else 0


def run_jobs(
    jobs: Sequence[Callable[[], T]], *, workers: int | None = None, done: Callable[[int], None] = lambda n: None
) -> list[T]:
    """Each job's result, in order, with up to ``workers`` forked processes taking jobs beside this one
    (default: one per other usable CPU; 0, or one job: all here, in order). ``done(n)`` is called here as the
    ``n``-th job is done (the module's note)."""
    n = min(len(jobs) - 1, side_workers(workers))
    if n < 1:
        out = []
        for job in jobs:
            out.append(job())
            done(len(out))
        return out
    return _Pool(jobs, n, done).run()


class _Pool:
    """``run_jobs`` over ``n`` forked workers: a shared counter hands out the next job's index."""

    def __init__(self, jobs: Sequence[Callable[[], Any]], n: int, done: Callable[[int], None]) -> None:
        ctx = multiprocessing.get_context("fork")
        self.jobs, self.done = jobs, done
        self.next = ctx.Value("i", 0)
        self.results: Any = ctx.Queue()
        self.found: dict[int, Any] = {}
        self.longest = 0.0  # seconds, the longest job this process ran
        self.procs = [ctx.Process(target=self._work, daemon=True) for _ in range(n)]

    def run(self) -> list[Any]:
        for p in self.procs:
            p.start()
        try:
            while (i := self._take()) < len(self.jobs):
                start = time.monotonic()
                self._found(i, _attempt(self.jobs[i]))
                self.longest = max(self.longest, time.monotonic() - start)
                self._drain(block=False)
            # Wait for the workers' jobs while they send results at the pace this process ran its own: one that
            # sends nothing for much longer (hung, e.g. a lock held by another thread at fork) is not waited for.
            patience = PATIENCE_S + 3.0 * self.longest
            deadline = time.monotonic() + patience
            while len(self.found) < len(self.jobs) and time.monotonic() < deadline:
                if self._drain(block=True):
                    deadline = time.monotonic() + patience
                elif not any(p.is_alive() for p in self.procs):
                    break
            for i in range(len(self.jobs)):  # failed in a worker, or taken by one that died: its own error here
                if self.found.get(i, _FAILED) is _FAILED:
                    self.found[i] = self.jobs[i]()
            return [self.found[i] for i in range(len(self.jobs))]
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
                p.join()

    def _take(self) -> int:
        with self.next.get_lock():
            i = self.next.value
            self.next.value += 1
        return int(i)

    def _found(self, i: int, value: Any) -> None:
        self.found[i] = value
        if value is not _FAILED:
            self.done(sum(v is not _FAILED for v in self.found.values()))

    def _drain(self, *, block: bool) -> bool:
        """Take the results the workers sent (blocking: the next one, waiting up to a second); whether one came."""
        came = False
        while True:
            try:
                i, ok, value = self.results.get(timeout=1.0) if block else self.results.get_nowait()
            except queue.Empty:
                return came
            self._found(i, pickle.loads(value) if ok else _FAILED)
            came = True
            if block:
                return True

    def _work(self) -> None:
        """A worker: job after job until none is left, each sent back as (index, ok, result)."""
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not a progress display's proxy (its lock)
        while (i := self._take()) < len(self.jobs):
            value = _attempt(self.jobs[i])
            try:
                self.results.put((i, True, pickle.dumps(value)) if value is not _FAILED else (i, False, None))
            except Exception:  # a result that does not pickle: run again here
                self.results.put((i, False, None))


def _attempt(job: Callable[[], Any]) -> Any:
    """The job's result, or ``_FAILED`` where it raised (run again here, in order, for its own error)."""
    try:
        return job()
    except Exception:
        return _FAILED
