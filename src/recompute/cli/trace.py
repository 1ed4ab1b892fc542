"""``recompute trace``: every byte of a real training step on fake tensors (no memory used)."""

from __future__ import annotations

import argparse
from pathlib import Path

from recompute.cli._common import (
    add_model_args,
    add_policy_args,
    add_workload_args,
    emit_json,
    policy_from,
    workload_from,
)
from recompute.core.spec import ModelSpec, resolve_model
from recompute.trace import render_trace, trace

__all__ = ["add_args", "built_model", "run"]


def built_model(name: str) -> tuple[ModelSpec, bool]:
    """``--model`` for commands that build the model; ``hf:NAME`` or a config.json path builds transformers'."""
    base = name.removeprefix("hf:")
    return resolve_model(base), name.startswith("hf:") or Path(base).exists()


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p, device="cpu")
    add_policy_args(p, default="none")
    p.add_argument(
        "--layers",
        type=int,
        help="trace K and K+1 layers and scale to all of them (exact for identical layers; much faster)",
    )
    p.add_argument("--json", action="store_true", help="print the trace as JSON")


def run(args: argparse.Namespace) -> int:
    spec, hf = built_model(args.model)
    wl, pol = workload_from(args, spec), policy_from(args)
    result = trace(spec, wl, pol, layers=args.layers, hf=hf)
    emit_json(result.to_dict()) if args.json else print(render_trace(result))
    return 0
