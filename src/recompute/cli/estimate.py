"""``recompute estimate``: memory by component and FLOPs of a step for every policy.

A preset (or ``--analytic``) is estimated by the closed-form model, without torch; any other model by its
profile (``recompute profile``: the real class measured on fake tensors, cached).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from recompute.cli._common import (
    add_model_args,
    add_policy_args,
    add_workload_args,
    emit_json,
    policy_from,
    workload_from,
)
from recompute.cli._profiled import add_profile_args, profile_for, wants_profile
from recompute.cli.render import render_estimate, render_profile
from recompute.core.analytic import estimate, estimate_policies
from recompute.core.spec import analytic_model
from recompute.core.table import gib

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p)
    add_policy_args(p)
    add_profile_args(p)
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON")


def run(args: argparse.Namespace) -> int:
    if wants_profile(args):
        return _run_profiled(args)
    spec = analytic_model(args.model)
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


def _run_profiled(args: argparse.Namespace) -> int:
    prof, _ = profile_for(args, quiet=args.json)
    layers = policy_from(args).per_layer(prof.n_layers)
    chosen = prof.compose(layers)
    if args.json:
        emit_json(
            {
                "profile": prof.to_dict(),
                "policies": {name: asdict(prof.compose([name] * prof.n_layers)) for name in prof.applicable()},
                "chosen": asdict(chosen),
            }
        )
        return 0
    print(render_profile(prof))
    print(
        f"\nchosen ({args.policy}): peak {gib(chosen.peak)} ({chosen.peak_phase}), activations "
        f"{gib(chosen.activations)}, recompute {chosen.overhead(prof.step_flops):.1%} of the step's FLOPs"
    )
    return 0
