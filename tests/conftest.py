"""Shared test setup."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models run many times slower with two threads on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Profiles, step work and calibrations measured by the tests go to one cache of the session, not ~/.cache:
    shared between tests (a preset's step is traced once), never left behind or read from an earlier run."""
    before = os.environ.get("RECOMPUTE_CACHE")
    os.environ["RECOMPUTE_CACHE"] = str(tmp_path_factory.mktemp("recompute-cache"))
    yield
    if before is None:
        del os.environ["RECOMPUTE_CACHE"]
    else:
        os.environ["RECOMPUTE_CACHE"] = before
