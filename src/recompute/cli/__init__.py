"""The ``recompute`` command line: a thin layer over the library's typed functions.

Each command lives in its own module here with ``add_args(parser)`` and ``run(args) -> exit code``; only the
command asked for is imported, so ``recompute estimate`` and ``plan`` never import torch. Bad input prints one
line (what was expected and how to fix it; the library's field names turned into the options' flags) and
exits with code 2; nothing here prints a traceback for it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

from recompute.cli._common import Parser
from recompute.core.errors import ConfigError
from recompute.core.spec import check_model_text
from recompute.core.torch_range import installed_torch, require_supported_torch

__all__ = ["COMMANDS", "build_parser", "main", "main_exit"]


class Command(NamedTuple):
    module: str
    """``recompute.cli.<module>``, which defines the command's ``add_args`` and ``run`` functions."""
    help: str
    add_args: str = "add_args"
    run: str = "run"


COMMANDS: dict[str, Command] = {
    "estimate": Command(
        "estimate", "memory (by component) and FLOPs of a training step for every policy, from the analytic model"
    ),
    "trace": Command(
        "trace", "every byte of a real training step on fake tensors (no memory used): states, layers, ops, peak"
    ),
    "profile": Command(
        "profile",
        "each kind of layer of the real model under every policy: bytes kept and held, replay, FLOPs (fake tensors)",
    ),
    "calibrate": Command(
        "calibrate",
        "measure this machine's device for the time model: matmul, attention, bandwidth, element-wise ops, overhead",
    ),
    "validate": Command(
        "validate", "the analytic model against the trace for every preset, policy and attention: per-layer error"
    ),
    "plan": Command(
        "plan", "the cheapest per-layer recomputation whose predicted peak fits a memory budget, and the frontier"
    ),
    "verify": Command(
        "verify", "run a training step with and without a policy; compare loss and gradients (--model hf:NAME for HF)"
    ),
    "bench": Command(
        "bench",
        "real training steps under each policy: peak memory, step time, tokens/s, measured vs predicted overhead",
    ),
    "train": Command(
        "train",
        "train a reference GPT-2 or Llama with a recompute policy (the blog's run)",
        "add_train_args",
        "run_train",
    ),
    "compare-train": Command(
        "train",
        "the same training run under several policies: losses, peak memory and step time side by side",
        "add_compare_args",
        "run_compare",
    ),
    "report": Command(
        "report",
        "the workshop page from recompute's own numbers: one self-contained HTML file (plotly), PNGs with --png",
    ),
}
"""The commands in the order ``recompute --help`` lists them: the questions of the README, in turn."""


def _load(name: str) -> object:
    return importlib.import_module(f"recompute.cli.{COMMANDS[name].module}")


def build_parser(command: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The parser; only ``command``'s options are built (and its module imported); ``None`` builds them all, or
    none with ``every=False`` (``recompute --help`` lists the commands without importing any of them)."""
    parser = Parser(
        prog="recompute",
        description="Know what activation recomputation saves and costs, plan it, apply it, check it.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if (command is None and every) or name == command:
            getattr(_load(name), cmd.add_args)(p)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if a in COMMANDS), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 for bad input, and for a torch outside the supported range)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(argv)
    try:
        require_supported_torch(installed_torch())  # before a command's module imports torch
    except ConfigError as e:
        print(f"recompute{' ' + command if command else ''}: error: {e}", file=sys.stderr)
        return 2
    parser = build_parser(command, every=command is not None)
    args = parser.parse_args(argv)
    args.argv = argv  # to repeat in messages (the torchrun command)
    args.given = given_options(_subparser(parser, args.command), argv)
    cmd = COMMANDS[args.command]
    try:
        if isinstance(getattr(args, "model", None), str) and getattr(args, "profile", None) is None:
            check_model_text(args.model)  # a mistyped name refused before a command's module imports torch
        return int(getattr(_load(args.command), cmd.run)(args))
    except ConfigError as e:
        print(f"recompute {args.command}: error: {as_flags(e, _subparser(parser, args.command))}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the options ``argv`` names (``--seq-len 4096`` and ``--seq-len=4096`` alike): what the
    user gave, as opposed to what is a default."""
    return {
        a.dest
        for a in parser._actions
        for flag in a.option_strings
        if any(tok == flag or tok.startswith(flag + "=") for tok in argv)
    }


def as_flags(error: ConfigError, parser: argparse.ArgumentParser) -> str:
    """The error's message with each field it names (``micro_batch``) shown as the option (``--micro-batch``)."""
    flags = {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    message = str(error)
    for name in error.fields:
        if name in flags:
            message = re.sub(rf"(?<![\w-]){re.escape(name)}\b", flags[name], message)
    return message


def main_exit() -> NoReturn:
    """Console-script entry point.

    Note: [a quick exit] A command that traced a model leaves millions of objects (torch's and transformers'
    modules, fx graphs, the trace's records), and the interpreter's last garbage collections over them took 1.1 s
    after a cold plan had printed its answer (10.3 s in all). ``gc.freeze()`` moves them out of the collector's
    reach first: they are freed as the interpreter tears down, and atexit handlers and finalizers run as before.
    """
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # output piped into `head` and friends: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    gc.freeze()  # Note: [a quick exit]
    sys.exit(code)


if __name__ == "__main__":
    main_exit()
