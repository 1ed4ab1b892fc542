"""The schema check of a plan file (``Plan.to_dict``'s shape), below ``policy`` and ``plan_file`` so that every
reader of a policy or plan file, ``Policy.load`` included, runs it (issue 38)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from recompute.core.errors import ConfigError
from recompute.core.workload import LOSSES, build_workload

__all__ = ["check_plan_dict"]


_POINT = ("peak", "cost", "overhead")
"""The figures every plan point has (finite numbers; peak and cost not negative)."""


def check_plan_dict(data: Mapping[str, Any]) -> None:
    """Refuse a hand-edited or damaged plan (``Plan.to_dict``'s shape) before anything reads a figure: one line
    naming the key, what it must be and what it holds (issue 38: ``"budget": "abc"`` was accepted and failed at
    the first training step; a workload with ``seq_len`` 1e30 was benched). Every key present is checked; only
    the policy is needed (``apply`` reads the policy, the model and the loss mode). A policy file (no plan
    ``format``) is left to ``Policy.from_dict``.

    Raises:
        ConfigError: the first key of the wrong type, not finite or out of range.
    """
    if not isinstance(data, Mapping) or not str(data.get("format", "")).startswith("recompute.plan/"):
        return
    _expect(isinstance(data.get("policy"), Mapping), "policy", "a policy map", data.get("policy"))
    if "model" in data:
        model = data["model"]
        _expect(isinstance(model, Mapping) and isinstance(model.get("name"), str), "model", "a {name, hash} map", model)
    if "workload" in data:
        workload = data["workload"]
        _expect(isinstance(workload, Mapping), "workload", "a map of workload fields", workload)
        try:
            build_workload(**workload)
        except ConfigError as e:
            raise ConfigError(f"the plan's workload: {e}") from None
    if "budget" in data:
        _number("budget", data["budget"], positive=True)
    if data.get("host_budget") is not None:
        _number("host_budget", data["host_budget"])
    if "loss" in data:
        loss = data["loss"]
        _expect(isinstance(loss, Mapping) and loss.get("mode") in LOSSES, "loss", f"a map with mode {LOSSES}", loss)
        chunk = loss.get("chunk")
        _expect(chunk is None or (type(chunk) is int and chunk > 0), "loss chunk", "a positive whole number", chunk)
    points = [("predicted", data["predicted"])] if "predicted" in data else []
    frontier = data.get("frontier", [])
    _expect(isinstance(frontier, list), "frontier", "a list of plan points", frontier)
    points += [(f"frontier point {i}", p) for i, p in enumerate(frontier)]
    for where, point in points:
        if not isinstance(point, Mapping):
            _expect(False, where, "a map of peak, cost and overhead", point)
            return
        for key in _POINT:
            _number(f"{where}'s {key}", point.get(key), signed=key == "overhead")


def _expect(ok: bool, key: str, expected: str, value: Any) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
        raise ConfigError(
            f"the plan's {key} must be {expected}, got {shown}; make the plan again with `recompute plan -o`"
        )


def _number(key: str, value: Any, *, positive: bool = False, signed: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (signed or value >= 0) and (not positive or value > 0)
    kind = "a positive" if positive else "a" if signed else "a non-negative"
    _expect(ok, key, f"{kind} finite number", value)
