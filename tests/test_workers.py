"""Steps side by side in forked workers (``recompute.trace._workers``): results in order, errors as without."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from recompute.core.errors import ConfigError
from recompute.trace._workers import run_jobs, usable_cpus

forks = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def _pid(i: int) -> tuple[int, int]:
    return i, os.getpid()


def _refuse() -> None:
    raise ConfigError("micro_batch must be a positive integer, got 0", fields=("micro_batch",))


def _pid_after_a_worker(i: int, here: int, worked: Any) -> tuple[int, int]:
    """``_pid``; run here, it first waits for a worker to have run a job (no race with the workers' start)."""
    if os.getpid() == here:
        worked.wait(timeout=600)
    else:
        worked.set()
    return i, os.getpid()


@forks
@pytest.mark.parametrize("workers", [1, 2, 5])
def test_results_come_in_order_from_the_workers(workers: int) -> None:
    worked = multiprocessing.get_context("fork").Event()
    jobs = [partial(_pid_after_a_worker, i, os.getpid(), worked) for i in range(6)]
    found = run_jobs(jobs, workers=workers)
    assert [i for i, _ in found] == list(range(6))
    assert len({pid for _, pid in found} - {os.getpid()}) >= 1  # some ran in a worker


@pytest.mark.parametrize("workers", [0, None])
def test_no_worker_runs_every_job_here(workers: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``workers=0``, or the default on one CPU."""
    monkeypatch.setattr("recompute.trace._workers.usable_cpus", lambda: 1)
    found = run_jobs([partial(_pid, i) for i in range(3)], workers=workers)
    assert found == [(0, os.getpid()), (1, os.getpid()), (2, os.getpid())]


@forks
def test_a_job_failing_in_a_worker_raises_its_own_error_here() -> None:
    jobs: list[Callable[[], object]] = [partial(_pid, 0), _refuse, partial(_pid, 2)]
    with pytest.raises(ConfigError, match=r"^micro_batch must be a positive integer, got 0$") as caught:
        run_jobs(jobs, workers=2)
    assert caught.value.fields == ("micro_batch",)


def test_usable_cpus_is_positive() -> None:
    assert usable_cpus() >= 1


def _hang_in_a_worker(i: int, here: int) -> int:
    while os.getpid() != here:  # a worker that never answers (hung at fork on a lock another thread held)
        time.sleep(1.0)
    return i


@forks
def test_a_silent_worker_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that sends nothing for longer than the patience: its job is run here, and the call returns."""
    monkeypatch.setattr("recompute.trace._workers.PATIENCE_S", 2.0)
    jobs = [partial(_hang_in_a_worker, i, os.getpid()) for i in range(3)]
    assert run_jobs(jobs, workers=2) == [0, 1, 2]
