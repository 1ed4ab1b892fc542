"""The schema of a profile file (``recompute profile -o``, the profile cache): checked before a figure is read.

A damaged or hand-edited profile must not turn into a plan: no layer kinds, a layer whose kind index points
nowhere, an unknown workload key, a byte or FLOP figure that is negative, fractional or not a number each give
one line here, where they would give a traceback or a wrong peak (exit 0) further on. Standard library only;
``recompute.core.profile.Profile.from_dict`` calls ``check_profile_dict`` first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from recompute.core.errors import ConfigError, first_line
from recompute.core.raw_config import SIZE_LIMITS
from recompute.core.store import MEASURED_WORKLOAD
from recompute.core.workload import Workload, workload_fields

__all__ = ["check_profile_dict"]

_TOP = {
    "format": str, "model": str, "origin": str, "class_name": str, "key": str, "workload": dict, "kinds": list,
    "layer_kind": list, "links": dict, "last": dict, "base_kept": list, "base_forward": list, "base_backward": list,
    "head_forward": int, "head_backward": int, "fixed": dict, "parameters": int, "gradients": int, "optimizer": int,
    "other": int, "parameter_count": int, "embedding_kept": int, "head_kept": int, "step_flops": int,
}  # fmt: skip
"""Every key a profile must have, with its JSON type."""
_TOP_OPTIONAL = {
    "outer_work": dict, "tokens": int, "notes": list, "versions": dict, "seconds": float, "phase_states": dict,
    "model_hash": str, "offload_shared": int,
}  # fmt: skip
_KIND = {
    "name": str, "layers": list, "parameters": int, "kept": dict, "held": dict, "components": dict, "ops": dict,
    "forward_delta": dict, "backward_delta": dict, "forward_flops": int, "backward_flops": dict,
    "forward_ops": dict, "backward_ops": dict,
}  # fmt: skip
_KIND_OPTIONAL = {"forward_work": dict, "backward_work": dict, "refused": dict, "host": dict, "below": dict}
_WORKLOAD = tuple(k for k in MEASURED_WORKLOAD if k not in ("tp", "sp"))
"""The workload keys every profile holds (``tp`` and ``sp`` came later): without one, a default stood in."""
_ONE_DEVICE = {"tp": 1, "pp": 1, "interleave": 1, "n_microbatches": None, "dp": 1, "ep": 1}
"""A profile measures one device's step (``recompute profile`` refuses the others): parallelism is priced on it."""
_COUNTS: tuple[str, ...] = ("head_forward", "head_backward", "parameters", "gradients", "optimizer", "other")
_COUNTS += ("parameter_count",)
_COUNTS += ("embedding_kept", "head_kept", "step_flops", "tokens", "offload_shared")
"""Byte and FLOP figures: non-negative integers."""


def _bad(where: str, expected: str, value: Any) -> ConfigError:
    shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
    return ConfigError(f"the profile's {where} must be {expected}, got {shown}; make it again with recompute profile")


def _int(where: str, value: Any, *, signed: bool = False) -> int:
    """``value`` if it is an integer (not a bool), non-negative unless ``signed``."""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 0 and not signed):
        raise _bad(where, "an integer" if signed else "a non-negative integer", value)
    return value


def _keys(where: str, data: Mapping[str, Any], required: Mapping[str, type], optional: Mapping[str, type]) -> None:
    """Every required key present, no unknown key, each of its JSON type."""
    known = {**required, **optional}
    whose = f"the profile's {where}" if where else "the profile"
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"{whose} has an unknown key {unknown[0]!r} (known: {', '.join(known)}); "
            "make it again with recompute profile"
        )
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"{whose} lacks {missing[0]!r}; make it again with recompute profile")
    for key, kind in known.items():
        value = data.get(key)
        if key not in data or (key in optional and value is None):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (number if kind is float else isinstance(value, kind)):
            raise _bad(f"{where}{key}", f"a JSON {kind.__name__}", value)


def _by_policy(where: str, table: Any, policies: Sequence[str], *, signed: bool = False) -> None:
    """``table`` maps every policy in ``policies`` (and no other) to an integer."""
    if not isinstance(table, dict) or set(table) != set(policies):
        raise _bad(where, f"an object with one figure per policy ({', '.join(policies)})", table)
    for policy, value in table.items():
        _int(f"{where}[{policy!r}]", value, signed=signed)


def _nested_counts(where: str, table: Any) -> None:
    """``{name: {name: count}}`` of non-negative integers (components, ops by policy)."""
    for outer, inner in table.items():
        if not isinstance(inner, dict):
            raise _bad(f"{where}[{outer!r}]", "an object", inner)
        for name, value in inner.items():
            _int(f"{where}[{outer!r}][{name!r}]", value)


def _work(where: str, table: Any) -> None:
    """``{phase or policy: [[op, dtype, flops, bytes, count], ...]}``."""
    for name, ops in table.items():
        if not isinstance(ops, list):
            raise _bad(f"{where}[{name!r}]", "a list of [op, dtype, flops, bytes, count]", ops)
        for op in ops:
            if not (isinstance(op, list) and len(op) == 5 and isinstance(op[0], str) and isinstance(op[1], str)):
                raise _bad(f"{where}[{name!r}]", "a list of [op, dtype, flops, bytes, count]", op)
            for value in op[2:]:
                _int(f"{where}[{name!r}] op {op[0]!r}", value)


def _kind(i: int, kind: Any, n_layers: int) -> tuple[str, ...]:
    """Check the layer kind ``i``; returns the policies it takes."""
    where = f"kinds[{i}]"
    if not isinstance(kind, dict):
        raise _bad(where, "an object", kind)
    _keys(f"{where}.", kind, _KIND, _KIND_OPTIONAL)
    policies = tuple(kind["kept"])
    if "none" not in policies:
        raise _bad(f"{where}.kept", "an object with a figure for 'none' and each policy the layer takes", kind["kept"])
    for key in ("kept", "backward_flops"):
        _by_policy(f"{where}.{key}", kind[key], policies)
    for key in ("held", "forward_delta", "backward_delta"):
        _by_policy(f"{where}.{key}", kind[key], policies, signed=True)
    for key in ("host", "below"):  # offload's figures; absent from profiles stored before they were measured
        if kind.get(key):
            _by_policy(f"{where}.{key}", kind[key], policies)
    for layer in kind["layers"]:
        if _int(f"{where}.layers", layer) >= n_layers:
            raise _bad(f"{where}.layers", f"layer numbers below {n_layers}", layer)
    _int(f"{where}.parameters", kind["parameters"])
    _int(f"{where}.forward_flops", kind["forward_flops"])
    for key in ("components", "ops", "backward_ops"):
        _nested_counts(f"{where}.{key}", kind[key])
    for op, count in kind["forward_ops"].items():  # kinds[0].forward_ops['mm'], as the others are named
        _int(f"{where}.forward_ops[{op!r}]", count)
    for key in ("forward_work", "backward_work"):
        work = kind.get(key) or {}
        if work and not set(policies) <= set(work):
            raise _bad(f"{where}.{key}", "an object with the kernels of every policy the layer takes", work)
        _work(f"{where}.{key}", work)
    return policies


def _triples(where: str, table: Any, policies: Sequence[str]) -> None:
    if not isinstance(table, dict) or not set(policies) <= set(table):
        raise _bad(where, f"an object with an entry per policy ({', '.join(policies)})", table)
    for policy, value in table.items():
        if not (isinstance(value, list) and len(value) == 3):
            raise _bad(f"{where}[{policy!r}]", "three integers", value)
        for v in value:
            _int(f"{where}[{policy!r}]", v, signed=True)


def _workload(workload: Mapping[str, Any]) -> None:
    """The profiled workload: its keys all there, one device's, values ``Workload`` takes."""
    missing = [k for k in _WORKLOAD if k not in workload]
    if missing:
        raise ConfigError(f"the profile's workload lacks {missing[0]!r}; make it again with recompute profile")
    for key, one in _ONE_DEVICE.items():
        if workload.get(key, one) != one:
            raise _bad(f"workload[{key!r}]", f"{one} (a profile measures one device's step)", workload[key])
    try:
        Workload(**workload)
    except ConfigError as e:  # without its fields: the CLI would name an option the user did not give
        raise ConfigError(
            f"the profile's workload is not one recompute takes ({first_line(e)}); make it again with recompute profile"
        ) from None


def check_profile_dict(data: Mapping[str, Any]) -> None:
    """Refuse a profile (``Profile.to_dict()``'s shape) that is not whole and sane.

    Checked: every key known and of its type; the workload's keys are ``Workload`` fields; at least one
    layer kind, each with a figure per policy it takes (``none`` included); every layer's kind index valid;
    a link for every pair of kinds that follow each other and every pair of their policies, and a last-layer
    entry per policy of the last layer's kind; byte and FLOP figures non-negative integers (deltas may be
    negative), one per layer where per layer.

    Raises:
        ConfigError: the first problem found, in one line.
    """
    _keys("", data, _TOP, _TOP_OPTIONAL)
    known = {f.name for f in workload_fields()}
    unknown = sorted(set(data["workload"]) - known)
    if unknown:
        raise ConfigError(
            f"the profile's workload has an unknown key {unknown[0]!r} (known: {', '.join(sorted(known))}); "
            "make it again with recompute profile"
        )
    _workload(data["workload"])
    layer_kind, kinds = data["layer_kind"], data["kinds"]
    if not kinds:
        raise _bad("kinds", "a non-empty list of layer kinds", kinds)
    if not 0 < len(layer_kind) <= SIZE_LIMITS["n_layers"]:
        raise _bad("layer_kind", f"a list of 1 to {SIZE_LIMITS['n_layers']:,} kind indices (one per layer)", layer_kind)
    for index in layer_kind:
        if _int("layer_kind", index) >= len(kinds):
            raise _bad("layer_kind", f"kind indices below {len(kinds)} (the profile has {len(kinds)} kinds)", index)
    policies = [_kind(i, kind, len(layer_kind)) for i, kind in enumerate(kinds)]
    for i, kind in enumerate(kinds):
        if sorted(kind["layers"]) != [j for j, k in enumerate(layer_kind) if k == i]:
            raise _bad(f"kinds[{i}].layers", f"the layers whose layer_kind is {i}", kind["layers"])
    for a, b in sorted({(layer_kind[i], layer_kind[i + 1]) for i in range(len(layer_kind) - 1)}):
        table = data["links"].get(f"{a}>{b}")
        if not isinstance(table, dict) or not set(policies[a]) <= set(table):
            raise _bad(f"links['{a}>{b}']", "an object per policy of the first layer", table)
        for p in policies[a]:
            _triples(f"links['{a}>{b}'][{p!r}]", table[p], policies[b])
    _triples("last", data["last"], policies[layer_kind[-1]])
    for key in ("base_kept", "base_forward", "base_backward"):
        values = data[key]
        if len(values) != len(layer_kind):
            raise _bad(key, f"a list of {len(layer_kind)} figures (one per layer)", values)
        for value in values:
            _int(key, value)
    for key in _COUNTS:
        if data.get(key) is not None:
            _int(key, data[key])
    for key in ("step_flops", "tokens"):  # the step's FLOPs and tokens divide
        if data.get(key) == 0:
            raise _bad(key, "a positive integer", 0)
    for phase, value in data["fixed"].items():  # named fixed[...], not the empty field's ['fixed'][...] (issue 38)
        _int(f"fixed[{phase!r}]", value)
    _work("outer_work", data.get("outer_work") or {})
    for phase, pair in (data.get("phase_states") or {}).items():
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _bad(f"phase_states[{phase!r}]", "[gradient bytes, temporary bytes]", pair)
        for value in pair:
            _int(f"phase_states[{phase!r}]", value)
