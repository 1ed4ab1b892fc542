"""``recompute trace``: every byte of a real training step on fake tensors (no memory used)."""

from __future__ import annotations

import argparse

from recompute.cli._common import (
    add_model_args,
    add_policy_args,
    add_workload_args,
    emit_json,
    policy_from,
    workload_from,
)
from recompute.core.errors import ConfigError, positive_int
from recompute.core.policy import Policy
from recompute.core.workload import Workload
from recompute.models.source import ModelSource, resolve_source
from recompute.progress import progress_bar
from recompute.trace import PARTITIONERS, render_compiled, render_trace, trace, trace_compiled

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p, "trace")
    add_policy_args(p, default="none")
    p.add_argument(
        "--scale-from",
        type=int,
        metavar="K",
        help="trace K and K+1 layers and scale to all of them, run by run where the layers differ (dense-first MoE); "
        "exact; much faster",
    )
    p.add_argument(
        "--compiled",
        nargs="?",
        const="model",
        choices=("model", "block"),
        help="trace the torch.compile'd step instead: what AOTAutograd's partitioner saves for the backward "
        "(Inductor's min cut by default), on fake tensors, no kernel generated; 'block': each layer compiled on its "
        "own, the rest eager, as torchtitan compiles (default: the whole model)",
    )
    p.add_argument(
        "--partitioner",
        choices=PARTITIONERS,
        help="with --compiled: min_cut (Inductor's, torch.compile's default) or default (aot_eager's); "
        "default: min_cut",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        metavar="X",
        help="with --compiled: torch._functorch.config.activation_memory_budget in (0, 1] for the min cut "
        "(default: PyTorch's, 1.0)",
    )
    p.add_argument("--layers", dest="renamed_layers", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the trace as JSON")


def run(args: argparse.Namespace) -> int:
    if args.renamed_layers is not None:
        raise ConfigError(
            f"trace --layers {args.renamed_layers} is now --scale-from {args.renamed_layers} (trace K and K+1 layers "
            "and scale); --layers resizes the model in bench, train and verify"
        )
    if args.scale_from is not None:
        positive_int("--scale-from", args.scale_from)  # the library's "layers must be ..." named no option
    source = resolve_source(args.model)
    wl, pol = workload_from(args, source), policy_from(args)
    if args.compiled or args.partitioner is not None or args.memory_budget is not None:
        return _compiled(args, source, wl, pol)
    with progress_bar("trace", enabled=not args.json) as progress:
        progress(f"{args.model}: one step on fake tensors", 0, 1)  # one unit: the bar shows the elapsed time
        result = trace(source, wl, pol, layers=args.scale_from)
        progress("done", 1, 1)
    emit_json(result.to_dict(), "trace") if args.json else print(render_trace(result))
    return 0


def _compiled(args: argparse.Namespace, source: ModelSource, wl: Workload, pol: Policy) -> int:
    """``--compiled``: the compiled step's saved values (``trace_compiled``)."""
    if not args.compiled:
        given = "--partitioner" if args.partitioner is not None else "--memory-budget"
        raise ConfigError(f"{given} is an option of the compiled trace; add --compiled")
    if args.scale_from is not None:
        raise ConfigError("--compiled traces every layer (dynamo compiles each of them); drop --scale-from")
    with progress_bar("trace", enabled=not args.json) as progress:
        progress(f"{args.model}: the compiled step on fake tensors", 0, 1)
        result = trace_compiled(
            source,
            wl,
            pol,
            partitioner=args.partitioner or "min_cut",
            budget=args.memory_budget,
            per_block=args.compiled == "block",
            peak=True,
        )
        progress("done", 1, 1)
    emit_json(result.to_dict(), "trace --compiled") if args.json else print(render_compiled(result))
    return 0
