"""``recompute validate``: the analytic model against the trace for every preset, policy and attention."""

from __future__ import annotations

import argparse

from recompute.check_formulas import render_validation, validate
from recompute.cli._common import csv, emit_json
from recompute.core.errors import ConfigError, distinct
from recompute.core.policy import POLICIES, Policy
from recompute.core.presets import PRESETS
from recompute.core.spec import resolve_model
from recompute.progress import progress_bar

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(PRESETS), help="comma-separated presets (default: all)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies (default: all)")
    p.add_argument("--attention", default="eager,flash", help="comma-separated: eager, flash (default: both)")
    p.add_argument("--seq-lens", help="comma-separated lengths (default: each model's context, max 8192, and half)")
    p.add_argument("--micro-batch", type=int, default=1, help="b (default: 1)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="activation dtype (default: bf16)")
    p.add_argument("--components", action="store_true", help="also show the error of every component")
    p.add_argument("--peaks", action="store_true", help="also compare the step's peak with estimate (slower)")
    p.add_argument("--keep-grads", action="store_true", help="with --peaks: gradients stay allocated between steps")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--models", args.models), ("--policies", args.policies), ("--attention", args.attention)):
        if not csv(value):
            raise ConfigError(f"{flag} {value!r} names nothing to check; give a comma-separated list, or drop it")
        distinct(flag, csv(value))
    if args.seq_lens is not None:
        if not csv(args.seq_lens):
            raise ConfigError(f"--seq-lens {args.seq_lens!r} names no length; give e.g. 512,1024, or drop it")
        distinct("--seq-lens", csv(args.seq_lens))
    for name in csv(args.models):
        if name not in PRESETS and ":" in name:  # a factory: resolve_model knows presets and config paths only
            raise ConfigError(
                f"--models {name!r}: validate holds the analytic model, which describes presets, to their traces; "
                f"measure a factory's class with `recompute trace --model {name}`"
            )
        resolve_model(name)  # a config.json is refused in one line that points to trace
    for name in csv(args.policies):
        Policy.parse(name)
    lengths = [_length(s) for s in csv(args.seq_lens)] if args.seq_lens else None
    with progress_bar("validate", enabled=not args.json) as progress:
        result = validate(
            csv(args.models),
            policies=csv(args.policies),
            attentions=csv(args.attention),
            lengths=lengths,
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            peaks=args.peaks,
            keep_grads=args.keep_grads,
            progress=progress,
        )
    if args.json:
        emit_json(result.to_dict(), "validate")
    else:
        print(render_validation(result, components=args.components))
    return 0 if result.passed else 1


def _length(text: str) -> int:
    """One ``--seq-lens`` entry as a positive whole number of tokens."""
    if not text.isdigit() or int(text) <= 0:
        raise ConfigError(f"--seq-lens takes positive whole numbers of tokens, e.g. 512,1024; got {text!r}")
    return int(text)
