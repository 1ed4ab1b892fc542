"""``recompute plan``: the cheapest per-layer recomputation that fits a memory budget, and the frontier.

Torch-free unless ``--trace`` asks for the real step's peak (then ``recompute.trace`` is loaded).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from recompute.cli._common import add_model_args, add_workload_args, emit_json, workload_from, writable
from recompute.cli._lazy import torch_floor
from recompute.cli.render import render_plan
from recompute.core.errors import ConfigError
from recompute.core.hardware import gpu_by_name, usable_bytes
from recompute.core.plan import parse_budget, plan
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec, resolve_model
from recompute.core.workload import Workload

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", help="memory budget per GPU, e.g. 70GiB or 80GB")
    budget.add_argument("--gpu", help="a GPU name (e.g. h100-80gb): its usable memory is the budget")
    p.add_argument(
        "--cost",
        choices=("flops", "measured"),
        default="flops",
        help="recompute cost: analytic FLOPs, or step times measured by `recompute bench` (--bench)",
    )
    p.add_argument("--bench", help="a `recompute bench --json` result of this model, for --cost measured")
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the chosen plan's step on fake tensors and re-plan until its traced peak fits (needs torch)",
    )
    p.add_argument("-o", "--output", help="write the plan file here (apply and bench take it as is)")
    p.add_argument("--json", action="store_true", help="print the plan, frontier and prediction as JSON")


def run(args: argparse.Namespace) -> int:
    spec = resolve_model(args.model)
    wl = workload_from(args, spec)
    budget = float(usable_bytes(gpu_by_name(args.gpu))) if args.gpu else parse_budget(args.budget)
    if (args.cost == "measured") != (args.bench is not None):
        raise ConfigError("--cost measured needs --bench RESULTS.json (and --bench needs --cost measured)")
    output = writable(args.output, "--output", "plan.json") if args.output else None
    traced = _traced_peak(spec, wl) if args.trace else None
    result = plan(spec, wl, budget, measured=args.bench, traced_peak=traced)
    if output:
        output.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if args.json:
        emit_json(result.to_dict())
    else:
        print(render_plan(spec, wl, result))
        if output:
            print(f"\nwrote {output}")
    return 0


def _traced_peak(spec: ModelSpec, wl: Workload) -> Callable[[Policy], float]:
    """A policy's peak by ``recompute.trace``: the real step on fake tensors, the same step estimate models."""
    trace = torch_floor("recompute.trace").trace

    def peak(policy: Policy) -> float:
        return float(trace(spec, wl, policy).peak)

    return peak
