"""Recomputation policies: what each transformer layer recomputes, as data that serialises to JSON.

A policy is one of the names below for every layer, chosen uniformly, for every k-th layer, for the first n
layers (Megatron's ``block`` method), or given layer by layer (what ``plan`` emits). The training stacks' own
words are aliases (``ALIASES``: ``full`` is ``block``, ``selective`` is ``core_attn``, Megatron's default), and
a name takes its layer selection after a colon: ``block:every=2`` (layers 0, 2, 4, ...), ``full:first=16``.
Op-level selective checkpointing (a save-list of ops) and offloading the kept checkpoints to CPU memory are
options on top. This module imports no torch: the analytic model and the CLI read policies too.

``POLICIES`` are the dense policies, the ones the analytic model costs and the planner searches;
``MOE_POLICIES`` apply to mixture-of-experts layers only and are measured by ``trace``, not modelled;
``OFFLOAD_POLICIES`` recompute nothing but move what a layer saves to host memory: the analytic model costs
their device and host bytes, but the planner does not search them (their price is transfer time, which it
does not model: in FLOPs they would look free).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, positive_int, require
from recompute.core.files import atomic_write, is_path
from recompute.core.identity import ModelId
from recompute.core.plan_schema import check_plan_dict
from recompute.core.results import read_json

__all__ = [
    "ALIASES",
    "ALL_POLICIES",
    "MOE_POLICIES",
    "OFFLOAD_POLICIES",
    "POLICIES",
    "Policy",
    "check_analytic",
    "distinct_policies",
]

POLICIES: dict[str, str] = {
    "none": "store everything; recompute nothing",
    "core_attn": "recompute QK^T, softmax, dropout and attention over V (Megatron 'selective')",
    "attn": "recompute the attention sub-block from its input (workshop strategy A)",
    "mlp": "recompute the MLP sub-block from its input (workshop strategy B)",
    "attn+mlp": "recompute both sub-blocks; keep the norms and the two sub-block inputs (workshop strategy C)",
    "block": "recompute the whole layer from its input (full recomputation)",
}

MOE_POLICIES: dict[str, str] = {
    "experts": "recompute only the experts of a mixture-of-experts MLP; keep the router's output (issue 13)",
}
"""Policies for mixture-of-experts layers: ``apply`` and ``trace`` know them, the analytic model does not."""

OFFLOAD_POLICIES: dict[str, str] = {
    "offload": "keep what the layer saves, in host memory: copied out during the forward, back one layer ahead "
    "in the backward",
}
"""Policies that move saved tensors to host memory instead of recomputing them (``recompute.offload``)."""

ALL_POLICIES: dict[str, str] = {**POLICIES, **MOE_POLICIES, **OFFLOAD_POLICIES}
"""Every policy name ``Policy`` accepts."""

ALIASES: dict[str, str] = {
    "full": "block",  # torchtitan's mode = "full", Megatron's --recompute-granularity full, HF's checkpointing
    "selective": "core_attn",  # Megatron's --recompute-granularity selective with its default module, core_attn
}
"""The training stacks' words for recompute's policies (docs/export.md): accepted wherever a name is, stored as
the name they stand for."""

FORMAT = "recompute.policy/1"

_SPEC = re.compile(r"(?P<name>[a-z_+]+)(?::(?P<key>every|first)=(?P<value>\d+))?")


def check_name(name: str) -> str:
    """The policy ``name`` stands for (itself, or the one its alias names), else raise ConfigError listing them."""
    if not isinstance(name, str) or ALIASES.get(name, name) not in ALL_POLICIES:
        raise ConfigError(f"{name!r} is not a policy; choose one of: {_names()}")
    return ALIASES.get(name, name)


def _names() -> str:
    aliases = ", ".join(f"{a} (= {n})" for a, n in ALIASES.items())
    return f"{', '.join(ALL_POLICIES)}, or an alias: {aliases}; NAME:every=K or NAME:first=N selects layers"


@dataclass(frozen=True)
class Policy:
    """What to recompute in each transformer layer.

    Exactly one of ``every``, ``first`` and ``layers`` may be set; with none, ``name`` applies to all layers.

    Example:
        >>> Policy("block", every=2).per_layer(4)
        ('block', 'none', 'block', 'none')
    """

    name: str = "block"
    """The policy for the selected layers (ignored when ``layers`` is given)."""
    every: int | None = None
    """Apply ``name`` to every k-th layer (layers 0, k, 2k, ...), ``none`` elsewhere."""
    first: int | None = None
    """Apply ``name`` to the first n layers, ``none`` to the rest (Megatron's ``block`` method)."""
    layers: tuple[str, ...] | None = None
    """One policy name per layer, as a plan emits."""
    save_ops: tuple[str, ...] | None = None
    """Op-level selective checkpointing inside the recomputed region: aten ops (e.g. ``aten.mm``) to save."""
    offload: bool = False
    """Keep the checkpointed tensors in CPU memory instead of on the device."""
    memory_budget: float | None = None
    """``torch._functorch.config.activation_memory_budget`` for the ``torch.compile``d step (a plan weighed
    under compile, ``recompute plan --memory-budget``): ``apply`` sets it; None leaves PyTorch's."""
    model: ModelId | None = field(default=None, compare=False)
    """The model a plan was made for (``recompute.core.identity``), checked when the plan is applied; a name
    alone (a plan file older than the hash) is read as a ``ModelId`` without one."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", check_name(self.name))
        if isinstance(self.model, str):
            object.__setattr__(self, "model", ModelId(self.model))
        chosen = [k for k in ("every", "first", "layers") if getattr(self, k) is not None]
        require(len(chosen) <= 1, f"give at most one of every, first, layers; got {', '.join(chosen)}")
        if self.every is not None:
            positive_int("every", self.every)
        if self.first is not None:
            require(
                isinstance(self.first, int) and not isinstance(self.first, bool) and self.first > 0,
                f"first must be a positive number of layers, got {self.first!r}"
                + (" (first=0 recomputes nothing: use the policy none)" if self.first == 0 else ""),
            )
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(check_name(n) for n in self.layers))
            require(len(self.layers) > 0, "layers must name a policy for at least one layer")
        if self.memory_budget is not None:
            require(
                isinstance(self.memory_budget, int | float)
                and not isinstance(self.memory_budget, bool)
                and 0 < self.memory_budget <= 1,
                f"memory_budget is torch.compile's activation_memory_budget, a fraction in (0, 1], got "
                f"{self.memory_budget!r}",
                fields=("memory_budget",),
            )
        if self.save_ops is not None:
            require(
                not isinstance(self.save_ops, str) and all(isinstance(op, str) and op for op in self.save_ops),
                f"save_ops must be a sequence of aten op names, e.g. ('aten.mm',); got {self.save_ops!r}",
                fields=("save_ops",),
            )
            object.__setattr__(self, "save_ops", tuple(self.save_ops))

    def per_layer(self, n_layers: int) -> tuple[str, ...]:
        """The policy name of each of ``n_layers`` layers.

        Raises:
            ConfigError: a per-layer list whose length is not ``n_layers``.
        """
        if self.layers is not None:
            require(
                len(self.layers) == n_layers,
                f"the policy lists {len(self.layers)} layers but the model has {n_layers}; "
                "make the plan for this model",
            )
            return self.layers
        for key in ("every", "first"):
            value = getattr(self, key)
            require(
                value is None or value <= n_layers,
                f"{key} {value} exceeds the model's {n_layers} layers; use {key} <= {n_layers}",
                fields=(key,),
            )
        if self.every is not None:
            return tuple(self.name if i % self.every == 0 else "none" for i in range(n_layers))
        if self.first is not None:
            return tuple(self.name if i < self.first else "none" for i in range(n_layers))
        return (self.name,) * n_layers

    @property
    def spec(self) -> str | None:
        """The policy as ``Policy.parse`` reads it back (``block``, ``block:every=2``, ``mlp:first=16``); None for
        a per-layer plan or one with options beyond a name (save_ops, offload)."""
        if self.layers is not None or self.save_ops or self.offload:
            return None
        if self.every is not None:
            return f"{self.name}:every={self.every}"
        return f"{self.name}:first={self.first}" if self.first is not None else self.name

    @property
    def is_uniform(self) -> bool:
        """True when every layer gets ``name``."""
        return self.every is None and self.first is None and self.layers is None

    def __repr__(self) -> str:
        """Short: a plan's policy of 126 layers spelled every layer (``describe`` counts them)."""
        if self.layers is None:
            fields = ("name", "every", "first", "save_ops", "offload")
            given = [f"{k}={getattr(self, k)!r}" for k in fields if getattr(self, k) not in (None, False)]
        else:
            given = [repr(self.describe())]
        if self.model is not None:
            given.append(f"model={self.model.describe()!r}")
        return f"Policy({', '.join(given)})"

    def describe(self) -> str:
        """A short human label, e.g. ``block every 2nd layer``."""
        if self.layers is not None:
            counts = {n: self.layers.count(n) for n in ALL_POLICIES if n in self.layers}
            text = "per-layer " + ", ".join(f"{n} x{c}" for n, c in counts.items())
        elif self.every is not None:
            text = f"{self.name} every {self.every} layers" if self.every > 1 else self.name
        elif self.first is not None:
            text = f"{self.name} on the first {self.first} layers"
        else:
            text = self.name
        extras = [f"saving {', '.join(self.save_ops)}"] if self.save_ops else []
        extras += ["offloaded to CPU"] if self.offload else []
        extras += [f"torch.compile's memory budget {self.memory_budget:g}"] if self.memory_budget is not None else []
        return text + (f" ({'; '.join(extras)})" if extras else "")

    def to_dict(self) -> dict[str, Any]:
        """The policy as JSON-ready data, with a format tag."""
        out: dict[str, Any] = {"format": FORMAT}
        for key in ("name", "every", "first", "layers", "save_ops", "offload", "memory_budget"):
            value = getattr(self, key)
            if value not in (None, False):
                out[key] = list(value) if isinstance(value, tuple) else value
        if self.model is not None:
            out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        """Inverse of ``to_dict``; also accepts a plan file's dict (its ``policy`` entry)."""
        data = data.get("policy", data) if isinstance(data.get("policy"), dict) else data
        fmt = data.get("format", FORMAT)
        require(fmt == FORMAT, f"unknown policy format {fmt!r}; expected {FORMAT!r}")
        known = {"name", "every", "first", "layers", "save_ops", "offload", "memory_budget", "model"}
        unknown = sorted(set(data) - known - {"format"})
        require(not unknown, f"unknown policy keys {unknown}; expected some of {sorted(known)}")
        _check_policy_dict(data)
        kwargs = {k: v for k, v in data.items() if k in known}
        for key in ("layers", "save_ops"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
        if kwargs.get("model") is not None:
            kwargs["model"] = ModelId.from_json(kwargs["model"])
        return cls(**kwargs)

    def save(self, path: str | Path) -> None:
        """Write the policy as JSON to ``path``."""
        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """Read a policy or plan JSON file."""
        data = read_json(path, "policy file", "pass a policy name or a file written by `recompute plan -o`")
        try:
            check_plan_dict(data)  # a plan file's figures too: one schema for every reader (issue 38)
            return cls.from_dict(data)
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):  # said with the file it is about
                raise ConfigError(f"policy file {str(path)!r}: {e}") from None  # its keys, not options
            raise ConfigError(f"policy file {str(path)!r} is not a recompute policy or plan ({e})") from e

    @classmethod
    def parse(cls, value: str | Policy) -> Policy:
        """A Policy from a Policy, a name (or an alias: ``full``, ``selective``), a name with its layers
        (``block:every=2``, ``full:first=16``), or a path to a JSON policy/plan file."""
        if isinstance(value, Policy):
            return value
        if not isinstance(value, (str, Path)):
            raise ConfigError(
                f"a policy is a name ({_names()}), a Policy or a plan file path; got {type(value).__name__}"
            )
        value = str(value)
        m = _SPEC.fullmatch(value.strip())
        if m is not None and ALIASES.get(m["name"], m["name"]) in ALL_POLICIES:
            count = int(m["value"]) if m["key"] else None
            return cls(
                m["name"], every=count if m["key"] == "every" else None, first=count if m["key"] == "first" else None
            )
        if value.endswith(".json") or is_path(value):
            return cls.load(value)
        raise ConfigError(f"{value!r} is not a policy or a policy file; choose one of: {_names()}")


def check_analytic(policy: Policy) -> None:
    """Raise ConfigError if ``policy`` uses a policy the analytic model has no costs for (``MOE_POLICIES``)."""
    names = policy.layers if policy.layers is not None else (policy.name,)
    for name in MOE_POLICIES:
        if name in names:
            raise ConfigError(
                f"the analytic model has no costs for the mixture-of-experts policy {name!r} (it models dense "
                f"layers); measure it with `recompute trace --model <config.json> --policy {name}`"
            )


def _check_policy_dict(data: dict[str, Any]) -> None:
    """Refuse a hand-edited policy dict ``Policy`` would misread: neither a name nor per-layer names (``{}`` was
    read as block on every layer), layers or save_ops that are not lists of names (a string was read letter by
    letter), an offload that is not a bool (issue 38).

    Raises:
        ConfigError: the first such key, with what it holds.
    """
    require(
        "name" in data or "layers" in data,
        f"a policy states its name ({', '.join(ALL_POLICIES)}) or one per layer (layers); got "
        + (f"only the keys {sorted(data)}" if data else "an empty map"),
    )
    for key in ("layers", "save_ops"):
        value = data.get(key)
        if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
            raise ConfigError(f"a policy's {key} must be a list of names, got {shown}")
    offload = data.get("offload", False)
    require(isinstance(offload, bool), f"a policy's offload must be true or false, got {offload!r}")


def distinct_policies(flag: str, values: list[str]) -> list[str]:
    """Return ``values`` if no two name the same policy once aliases and files are read (``full`` is ``block``:
    ``--policies full,block`` ran block twice and compared it with itself, issue 38), else refuse naming both.

    Raises:
        ConfigError: a value that is no policy, or the first pair that is one policy.
    """
    seen: dict[Policy, str] = {}
    for value in values:
        policy = Policy.parse(value)
        if policy in seen:
            raise ConfigError(
                f"{flag} names {seen[policy]!r} and {value!r}, one policy ({policy.describe()}); give each once",
                fields=(flag,),
            )
        seen[policy] = value
    return values
