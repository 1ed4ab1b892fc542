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
from recompute.cli._timed import add_time_args, preset_works, time_device, timings, untimed_reason
from recompute.cli.render import device_note, render_estimate, render_profile, seconds
from recompute.core.analytic import estimate, estimate_policies
from recompute.core.spec import analytic_model
from recompute.core.table import gib
from recompute.core.timing import Device

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p)
    add_policy_args(p)
    add_profile_args(p)
    add_time_args(p)
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON")


def run(args: argparse.Namespace) -> int:
    device = time_device(args)
    if wants_profile(args):
        return _run_profiled(args, device)
    spec = analytic_model(args.model)
    wl = workload_from(args, spec)
    rows, chosen = estimate_policies(spec, wl), estimate(spec, wl, policy_from(args))
    why_not = untimed_reason(args, wl)
    times, note = None, f"times: not predicted ({why_not})" if why_not else ""
    if why_not is None:
        works = preset_works(spec, wl, quiet=args.json)
        n = spec.n_layers
        times = timings(works, [[e.policy] * n for e in rows] + [list(chosen.per_layer)], device)
        note = device_note(device, wl)
    if args.json:
        emit_json(
            {
                "model": spec.to_dict(),
                "workload": wl.to_dict(),
                "policies": [
                    {**e.to_dict(), **({"time": times[i].to_dict()} if times else {})} for i, e in enumerate(rows)
                ],
                "chosen": {**chosen.to_dict(), **({"time": times[-1].to_dict()} if times else {})},
                "device": device.to_dict() if times else None,
            }
        )
    else:
        print(render_estimate(spec, wl, rows, chosen, times[:-1] if times else None, note))
        if times:
            t = times[-1]
            print(f"chosen: step {seconds(t.step)}, {t.tokens_per_second:,.0f} tokens/s, {t.overhead:+.1%} time")
    return 0


def _run_profiled(args: argparse.Namespace, device: Device) -> int:
    prof, wl = profile_for(args, quiet=args.json)
    timed = None if args.no_time else device
    layers = policy_from(args).per_layer(prof.n_layers)
    chosen = prof.compose(layers, timed)
    if args.json:
        emit_json(
            {
                "profile": prof.to_dict(),
                "policies": {name: asdict(prof.compose([name] * prof.n_layers, timed)) for name in prof.applicable()},
                "chosen": asdict(chosen),
                "device": timed.to_dict() if timed else None,
            }
        )
        return 0
    print(render_profile(prof, timed))
    line = (
        f"\nchosen ({args.policy}): peak {gib(chosen.peak)} ({chosen.peak_phase}), activations "
        f"{gib(chosen.activations)}, recompute {chosen.overhead(prof.step_flops):.1%} of the step's FLOPs"
    )
    if chosen.step_seconds is not None and chosen.time_overhead is not None:
        line += f"; step {seconds(chosen.step_seconds)}, {chosen.time_overhead:+.1%} time"
    print(line)
    if timed:
        print(device_note(timed, wl))
    return 0
