"""Options and helpers every command shares: the model, the workload, the policy, JSON output, output paths.

Workload options are generated from ``Workload``'s fields, so each is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from recompute.core.errors import ConfigError
from recompute.core.files import check_writable
from recompute.core.policy import ALL_POLICIES, Policy
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload, workload_fields

if TYPE_CHECKING:  # the analytic commands run without torch
    from recompute.models.source import ModelSource

__all__ = [
    "DEFAULT_SEQ_LEN",
    "Parser",
    "add_field_args",
    "add_model_args",
    "add_policy_args",
    "add_workload_args",
    "csv",
    "emit_json",
    "policy_from",
    "workload_from",
    "writable",
]

DEFAULT_SEQ_LEN = 2048


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser, *, built: bool = False) -> None:
    """``--model``; ``built``: the command builds the model, so any config.json or a factory will do."""
    kinds = "a transformers config.json (or its folder), or package.module:factory" if built else "an HF config.json"
    p.add_argument("--model", default="gpt2", help=f"preset name, {kinds} (default: gpt2)")


def add_field_args(p: argparse.ArgumentParser, fields: Sequence[dataclasses.Field[Any]], **defaults: Any) -> None:
    """One option per dataclass field, from the ``flag``/``help``/``choices`` in the field's metadata."""
    for f in fields:
        meta, default = f.metadata, defaults.get(f.name, f.default)
        if f.type in ("bool", bool):
            p.add_argument(meta["flag"], dest=f.name, action="store_true", default=default, help=meta["help"])
            continue
        kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
        extra = {"choices": meta["choices"]} if "choices" in meta else {}
        shown = f" (default: {default})" if default is not None else ""
        if f.name == "seq_len" and default is None:
            shown = f" (default: {DEFAULT_SEQ_LEN}, or the model's context if shorter)"
        p.add_argument(meta["flag"], dest=f.name, type=kind, default=default, help=meta["help"] + shown, **extra)


def add_workload_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One option per ``Workload`` field; ``--seq-len`` defaults to 2048, or the model's context if shorter."""
    add_field_args(p, workload_fields(), **{"seq_len": None, **defaults})


class HasPositions(Protocol):
    """A model as ``workload_from`` sees it: the longest sequence it takes (``None``: no limit known)."""

    @property
    def max_positions(self) -> int | None: ...


def workload_from(args: argparse.Namespace, model: ModelSpec | ModelSource | HasPositions) -> Workload:
    """The Workload the options describe, with an unset ``--seq-len`` fitted to the model's positions."""
    values = {f.name: getattr(args, f.name) for f in workload_fields()}
    if values["seq_len"] is None:
        values["seq_len"] = min(DEFAULT_SEQ_LEN, model.max_positions or DEFAULT_SEQ_LEN)
    wl = Workload(**values)
    wl.check_loss_chunk()
    return wl


def add_policy_args(p: argparse.ArgumentParser, default: str | None = "block") -> None:
    p.add_argument(
        "--policy",
        default=default,
        help=f"one of {', '.join(ALL_POLICIES)}, or a plan/policy JSON file (default: {default})",
    )
    p.add_argument("--every", type=int, help="apply the policy to every k-th layer only")
    p.add_argument("--first", type=int, help="apply the policy to the first n layers only")


def policy_from(args: argparse.Namespace) -> Policy:
    pol = Policy.parse(args.policy)
    if args.every is not None or args.first is not None:
        if not pol.is_uniform:
            raise ConfigError("--every/--first apply to a policy name, not to a per-layer plan file")
        pol = dataclasses.replace(pol, every=args.every, first=args.first)
    return pol


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def csv(value: str) -> list[str]:
    """``a, b,,c`` -> ``[a, b, c]``."""
    return [v.strip() for v in value.split(",") if v.strip()]


def writable(path: str | Path, flag: str, example: str = "out.json") -> Path:
    """``path`` if a file can be written there (``recompute.core.files.check_writable``: a probe file is made and
    removed in its folder); checked before any work starts. Write it with ``atomic_write``.

    Raises:
        ConfigError: empty, a folder, a device, a symlink loop, or its folder is missing or takes no new file.
    """
    return check_writable(path, flag, example)
