"""``cached_work``: the step work (``recompute.core.timing.StepWork``) of a model under a policy, from the cache or
traced now: what ``estimate``, ``plan`` and ``bench`` price with a device's roofline."""

from __future__ import annotations

import json

from recompute.core.errors import ConfigError
from recompute.core.policy import Policy
from recompute.core.profile import cache_root
from recompute.core.spec import ModelSpec
from recompute.core.timing import StepWork
from recompute.core.workload import Workload
from recompute.models.source import ModelSource
from recompute.trace._profile import profile_key
from recompute.trace._run import _source_of, step_work

__all__ = ["cached_work"]


def cached_work(model: ModelSpec | ModelSource | str, wl: Workload, policy: str) -> StepWork:
    """``step_work`` of ``model`` at ``wl`` with every layer under the policy named, cached under
    ``$RECOMPUTE_CACHE/work``.

    A preset's layers are alike: two and three are traced and scaled (seconds at any size). Any other model is
    traced whole.
    """
    source = _source_of(model, False)
    pol = Policy(policy)
    key = profile_key(source, wl)
    path = cache_root() / "work" / f"{key}-{pol.name}.json"
    if key and path.is_file():
        try:
            return StepWork.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            pass  # an unreadable cache entry is traced again
    work = step_work(source, wl, pol, layers=2 if source.spec is not None and not source.hf else None)
    if key:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(work.to_dict()) + "\n")
        tmp.replace(path)
    return work
