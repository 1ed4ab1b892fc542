"""``recompute estimate``: memory by component and FLOPs of a step for every policy (analytic, no torch)."""

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
from recompute.cli.render import render_estimate
from recompute.core.analytic import estimate, estimate_policies
from recompute.core.spec import resolve_model

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p)
    add_policy_args(p)
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON")


def run(args: argparse.Namespace) -> int:
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
