"""The ``recompute`` command line: a thin layer over the library's typed functions.

Workload options are generated from ``Workload``'s fields, so each is declared once. Bad input prints one
line (what was expected and how to fix it) and exits with code 2; nothing here prints a traceback for it.
Subcommands import torch only when they need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from recompute.errors import ConfigError
from recompute.policy import POLICIES, Policy
from recompute.presets import PRESETS
from recompute.spec import ModelSpec
from recompute.workload import Workload, workload_fields

__all__ = ["main", "main_exit", "resolve_model"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def resolve_model(name: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json (file or directory) by path."""
    if name in PRESETS:
        return ModelSpec.from_name(name)
    if Path(name).exists():
        return ModelSpec.from_hf_config(name, name=Path(name).stem if Path(name).is_file() else Path(name).name)
    raise ConfigError(f"{name!r} is not a known model or a config.json path; known models: {', '.join(PRESETS)}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help="preset name or path to an HF config.json (default: gpt2)")


DEFAULT_SEQ_LEN = 2048


def add_workload_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One option per ``Workload`` field, with the field's own help text.

    ``--seq-len`` defaults to 2048, or to the model's context where that is shorter.
    """
    defaults.setdefault("seq_len", None)
    for f in workload_fields():
        meta, default = f.metadata, defaults.get(f.name, f.default)
        if f.type in ("bool", bool):
            p.add_argument(meta["flag"], dest=f.name, action="store_true", default=default, help=meta["help"])
            continue
        kind = int if "int" in str(f.type) else str
        extra = {"choices": meta["choices"]} if "choices" in meta else {}
        shown = f" (default: {default})" if default is not None else ""
        if f.name == "seq_len" and default is None:
            shown = f" (default: {DEFAULT_SEQ_LEN}, or the model's context if shorter)"
        p.add_argument(meta["flag"], dest=f.name, type=kind, default=default, help=meta["help"] + shown, **extra)


def workload_from(args: argparse.Namespace, spec: ModelSpec) -> Workload:
    """The Workload the options describe, with an unset ``--seq-len`` fitted to ``spec``."""
    values = {f.name: getattr(args, f.name) for f in workload_fields()}
    if values["seq_len"] is None:
        values["seq_len"] = min(DEFAULT_SEQ_LEN, spec.max_positions)
    return Workload(**values)


def add_policy_args(p: argparse.ArgumentParser, default: str | None = "block") -> None:
    p.add_argument(
        "--policy",
        default=default,
        help=f"one of {', '.join(POLICIES)}, or a plan/policy JSON file (default: {default})",
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


# --- estimate ---------------------------------------------------------------------------------------------


def _estimate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p)
    add_policy_args(p)
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON")


def _estimate_run(args: argparse.Namespace) -> int:
    from recompute.analytic import estimate, estimate_policies
    from recompute.render import render_estimate

    spec = resolve_model(args.model)
    wl = workload_from(args, spec)
    rows, chosen = estimate_policies(spec, wl), estimate(spec, wl, policy_from(args))
    if args.json:
        emit_json(
            {
                "model": spec.to_dict(),
                "workload": wl.to_dict(),
                "policies": [e.to_dict() for e in rows],
                "chosen": chosen.to_dict(),
            }
        )
    else:
        print(render_estimate(spec, wl, rows, chosen))
    return 0


Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]

COMMANDS: dict[str, Command] = {
    "estimate": (
        _estimate_args,
        _estimate_run,
        "memory (by component) and FLOPs of a training step for every policy, from the analytic model",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recompute", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (add_args, _, help_text) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except ConfigError as e:
        print(f"recompute {args.command}: error: {e}", file=sys.stderr)
        return 2


def main_exit() -> NoReturn:
    """Console-script entry point."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # output piped into `head` and friends: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main_exit()
