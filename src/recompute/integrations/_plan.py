"""What every integration does with a plan, whatever the stack: read it, check it against the step the stack
runs, say it in one line. Torch-light: no training library imported here.

Note: [the plan's workload] a plan is priced for one step (``Workload``): its precision, micro-batch, sharding.
Each integration reads the run's from its stack's settings as ``{field: (value, the setting it comes from)}``
(``recompute.integrations.hf.trainer_workload``, ``accelerator_workload``,
``recompute.integrations.lightning.lightning_workload``), and a plan made for another step is refused in one
line that names each difference and the flags that plan this one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require
from recompute.core.plan_file import Plan, check_plan_dict, plan_loss
from recompute.core.policy import Policy
from recompute.core.results import read_json
from recompute.core.table import gib
from recompute.core.workload import LOSSES, workload_fields

__all__ = ["check_apply_options", "differences", "mismatch", "plan_data", "summary"]

Run = Mapping[str, tuple[Any, str]]
"""The run's workload fields, each with the setting it comes from (Note: [the plan's workload])."""


def plan_data(plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any]) -> dict[str, Any]:
    """The plan as a plan file's JSON (a policy's alone for a ``Policy`` or a name); checked readable now."""
    if isinstance(plan, (Plan, Policy)):
        data = plan.to_dict()
    elif isinstance(plan, Mapping):
        data = dict(plan)
    elif isinstance(plan, (str, os.PathLike)) and (os.fspath(plan).endswith(".json") or Path(plan).is_file()):
        data = read_json(os.fspath(plan), "plan file", "pass a file written by `recompute plan -o plan.json`")
    elif isinstance(plan, str):
        data = Policy.parse(plan).to_dict()
    else:
        raise ConfigError(f"expected a plan file, a Plan, a Policy or a policy name; got {type(plan).__name__}")
    check_plan_dict(data)
    try:
        Policy.from_dict(data)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"not a recompute plan or policy ({e}); pass a file written by `recompute plan -o`") from e
    return data


def summary(plan: Mapping[str, Any]) -> str:
    """One line: the policy, the loss mode, the model and, for a plan, its predicted peak against its budget."""
    policy = Policy.from_dict(dict(plan))
    loss = plan_loss(plan)
    text = f"recompute: {policy.describe()}" + ("; chunked loss" if loss and loss[0] == "chunked" else "")
    if policy.model is not None:
        text += f" for {policy.model.describe()}"
    predicted, budget = plan.get("predicted"), plan.get("budget")
    if isinstance(predicted, Mapping) and isinstance(predicted.get("peak"), (int, float)) and budget:
        text += f"; predicted peak {gib(predicted['peak'])} of the {gib(float(budget))} budget"
    return text


def differences(planned: Any, run: Run) -> list[str]:
    """Each field of the run's step that the plan's workload prices otherwise, as ``field planned -> run (why)``."""
    if not isinstance(planned, Mapping):
        return []  # a policy, not a plan: nothing was priced
    defaults = {f.name: f.default for f in workload_fields()}
    out = []
    for name, (value, why) in run.items():
        was = planned.get(name, defaults.get(name))
        if was != value:
            out.append(f"{name} {was} in the plan, {value} in this run ({why})")
    return out


def mismatch(differ: list[str], run: Run, instead: str) -> str:
    """The one-line refusal of a plan for another step: the differences, the flags that plan this one, and
    ``instead`` (what else the user can do: ``RecomputeCallback(plan, replan=True)``)."""
    flags = " ".join(f for f in (_flag(name, value) for name, (value, _) in run.items()) if f)
    return (
        f"this plan was made for another step than this run's: {'; '.join(differ)}; plan this one "
        f"(recompute plan --model <config> {flags} ...) or {instead}"
    )


def _flag(name: str, value: Any) -> str:
    flag = next(f.metadata["flag"] for f in workload_fields() if f.name == name)
    if isinstance(value, bool):
        return flag if value else ""
    return f"{flag} {value}"


_APPLY_OPTIONS = ("layers", "attn", "mlp", "loss", "loss_chunk")
"""``recompute.apply``'s keywords, which ``prepare`` and ``RecomputeCallback`` pass on."""


def check_apply_options(options: Mapping[str, Any]) -> None:
    """Refuse an option ``recompute.apply`` does not take, or one of the wrong type, before the Trainer runs.

    Raises:
        ConfigError: the first such option, with what it takes.
    """
    unknown = sorted(set(options) - set(_APPLY_OPTIONS))
    require(not unknown, f"unknown options {unknown}; recompute.apply takes {', '.join(_APPLY_OPTIONS)}")
    for key in ("layers", "attn", "mlp"):
        value = options.get(key)
        require(value is None or isinstance(value, str), f"{key} must be a name (a str), got {value!r}", fields=(key,))
    loss, chunk = options.get("loss"), options.get("loss_chunk")
    require(loss in (None, *LOSSES), f"loss must be one of {', '.join(LOSSES)}, got {loss!r}", fields=("loss",))
    whole = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0
    require(chunk is None or whole, f"loss_chunk must be a positive integer, got {chunk!r}", fields=("loss_chunk",))
