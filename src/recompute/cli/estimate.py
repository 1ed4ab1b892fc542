"""``recompute estimate``: memory by component and FLOPs of a step for every policy.

A preset (or ``--analytic``) is estimated by the closed-form model, without torch; any other model by its
profile (``recompute profile``: the real class measured on fake tensors, kept in the store). Predicted times
come from ``recompute.core.pricing`` on the ``--gpu`` (or ``--device-profile``) device.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from recompute.cli._common import (
    add_model_args,
    add_policy_args,
    add_source_args,
    add_time_args,
    add_workload_args,
    emit_json,
    measured_workload,
    policy_from,
    time_device,
    workload_from,
)
from recompute.cli.render import device_note, render_estimate, render_profile, render_step, seconds
from recompute.core.analytic import estimate, estimate_policies
from recompute.core.comms import comms_of, summarize
from recompute.core.presets import PRESETS
from recompute.core.pricing import Job, network_notes, scheduled_profile_table, step_time, timings, unpriced
from recompute.core.profile import Profile
from recompute.core.spec import analytic_model
from recompute.core.table import gib
from recompute.core.timing import Device
from recompute.core.workload import build_workload
from recompute.planning import is_profiled, max_positions, model_works, profiles_of, shown_offload
from recompute.progress import progress_bar

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p, "estimate")
    add_policy_args(p)
    add_source_args(p)
    add_time_args(p)
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON")


def run(args: argparse.Namespace) -> int:
    device = time_device(args)
    if is_profiled(args.model, analytic=args.analytic, profile=args.profile, precision=args.precision, fsdp=args.fsdp):
        return _run_profiled(args, device)
    spec = analytic_model(args.model)
    wl = workload_from(args, spec)
    rows, chosen = estimate_policies(spec, wl), estimate(spec, wl, policy_from(args))
    why_not = "--no-time" if args.no_time else unpriced(wl, preset=args.model in PRESETS)
    times, note, steps, works = None, f"times: not predicted ({why_not})" if why_not else "", {}, {}
    if why_not is None:
        job = Job.of(spec, wl)
        notes = network_notes(device, wl)  # refuses a layout that does not tile the nodes before tracing
        with progress_bar("time model", enabled=not args.json) as progress:
            works = model_works(args.model, spec, wl, progress=progress)
        n = spec.n_layers
        times = timings(works, [[e.policy] * n for e in rows] + [list(chosen.per_layer)], device, job)
        steps = {e.policy: step_time(works[e.policy], device, job, base=works["none"]) for e in rows}
        note = "\n".join([device_note(device, wl), *(f"note: {n}" for n in notes)])
    if args.json:
        emit_json(
            {
                "source": "analytic",
                "model": spec.to_dict(),
                "workload": wl.to_dict(),
                "policies": [
                    {**e.to_dict(), **({"time": times[i].to_dict() | _parts(works, steps, e.policy)} if times else {})}
                    for i, e in enumerate(rows)
                ],
                "chosen": {**chosen.to_dict(), **({"time": times[-1].to_dict()} if times else {})},
                "device": device.to_dict() if times else None,
            },
            "estimate",
        )
    else:
        print(render_estimate(spec, wl, rows, chosen, times[:-1] if times else None, note))
        if times:
            t = times[-1]
            print(f"chosen: step {seconds(t.step)}, {t.tokens_per_second:,.0f} tokens/s, {t.overhead:+.1%} time")
            uniform = chosen.per_layer[0] if len(set(chosen.per_layer)) == 1 else "none"
            if uniform in steps:
                print(render_step(uniform, steps[uniform], summarize(comms_of(works[uniform].phases))))
    return 0


def _parts(works: dict[str, Any], steps: dict[str, Any], policy: str) -> dict[str, Any]:
    """A uniform policy's step, part by part, and its collectives of one micro-batch (``--json``)."""
    return {"step": steps[policy].to_dict(), "collectives": summarize(comms_of(works[policy].phases))}


def _run_profiled(args: argparse.Namespace, device: Device) -> int:
    if args.profile:
        prof = Profile.load(args.profile)
        asked = measured_workload(args, prof)
        prof = prof.restated(asked.precision, asked.dp, fsdp=asked.fsdp)
    else:
        asked = workload_from(args, max_positions(args.model))
        with progress_bar("profile", enabled=not args.json) as progress:
            prof = profiles_of(args.model, asked, progress=progress)[0].restated(
                asked.precision, asked.dp, fsdp=asked.fsdp
            )
    wl = build_workload(**prof.workload_dict())
    timed = None if args.no_time else device
    offload = shown_offload(prof, timed, wl)
    table = prof.cost_table(timed, offload=offload)
    if timed is not None:
        table = scheduled_profile_table(table, prof, timed, wl)
    layers = policy_from(args).per_layer(prof.n_layers)
    chosen = table.compose(layers)
    step = (
        table.model_seconds + chosen.seconds if table.model_seconds is not None and chosen.seconds is not None else None
    )
    if args.json:

        def row(policy: str, per_layer: Sequence[str]) -> dict[str, Any]:
            """The fields every estimate row has (docs/json.md), then the profile's composition's own."""
            c = table.compose(per_layer)
            acts = prof.activations(per_layer)
            common = {"policy": policy, "per_layer": list(per_layer), "peak": c.peak, "peak_phase": c.peak_phase}
            return common | {"activation_bytes": acts, "recompute_flops": c.flops, "host": c.host} | asdict(c)

        emit_json(
            {
                "source": "profile",
                "model": {"name": prof.model, "origin": prof.origin, "class": prof.class_name},
                "workload": wl.to_dict(),
                "policies": [row(name, [name] * table.n) for name in table.options()],
                "chosen": row(args.policy, layers) | {"step_seconds": step},
                "device": timed.to_dict() if timed else None,
                "profile": prof.to_dict(),
            },
            "estimate",
        )
        return 0
    print(render_profile(prof, timed, offload=offload))
    line = (
        f"\nchosen ({args.policy}): peak {gib(chosen.peak)} ({chosen.peak_phase}), activations "
        f"{gib(prof.activations(layers))}, recompute {chosen.flops / table.model_flops:.1%} of the step's FLOPs"
    )
    if step is not None and table.model_seconds and chosen.seconds is not None:
        line += f"; step {seconds(step)}, {chosen.seconds / table.model_seconds:+.1%} time"
    print(line)
    if timed:
        print(device_note(timed, wl))
    return 0
