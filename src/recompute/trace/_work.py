"""``cached_works``: the step work (``recompute.core.timing.StepWork``) of a model under each uniform policy, from
the cache or traced now: what ``estimate``, ``plan`` and ``report`` price with a device's roofline."""

from __future__ import annotations

from collections.abc import Sequence

from recompute.core import store
from recompute.core.policy import Policy
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec
from recompute.core.timing import StepWork
from recompute.core.workload import Workload
from recompute.models.source import ModelSource
from recompute.trace._profile import profile_key
from recompute.trace._run import _source_of, step_work, step_works

__all__ = ["cached_works"]


def cached_works(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    policies: Sequence[str],
    *,
    progress: Progress = no_progress,
) -> dict[str, StepWork]:
    """``step_work`` of ``model`` at ``wl`` with every layer under each policy named, kept in the store
    (``recompute.core.store``).

    A preset's layers are alike: ``step_works`` traces one and two layers and scales (seconds at any size). Any
    other model is traced whole, policy by policy.
    """
    source = _source_of(model, False)
    names = [Policy(name).name for name in policies]
    key = profile_key(source, wl)
    found = {name: store.load("work", f"{key}-{name}", StepWork.from_dict) if key else None for name in names}
    missing = [name for name, work in found.items() if work is None]
    if not missing:
        return {name: work for name, work in found.items() if work is not None}
    if source.spec is not None and not source.hf:
        traced = step_works(source, wl, missing, progress=progress)
    else:
        traced = {}
        for i, name in enumerate(missing):
            progress(f"trace {name}", i, len(missing))
            traced[name] = step_work(source, wl, name)
        progress("done", len(missing), len(missing))
    for name, work in traced.items():
        if key:
            store.save("work", f"{key}-{name}", work.to_dict())
    return {name: found[name] or traced[name] for name in names}
