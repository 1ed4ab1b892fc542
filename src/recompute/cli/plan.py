"""``recompute plan``: the cheapest per-layer recomputation that fits a memory budget, and the frontier.

A preset (or ``--analytic``) is planned on the closed-form model; any other model on its profile, the real
class measured on fake tensors (``recompute profile``), exactly for a mix of layer kinds. Torch-free unless
``--trace`` asks for the real step's peak or a profile has to be measured (then ``recompute.trace`` is loaded).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from recompute.cli._common import add_model_args, add_workload_args, emit_json, workload_from, writable
from recompute.cli._lazy import torch_floor
from recompute.cli._profiled import add_profile_args, profile_for, wants_profile
from recompute.cli._timed import offload_layer_seconds, preset_works, time_device, untimed_reason
from recompute.cli.render import device_note, render_plan, render_profile_plan
from recompute.core.errors import ConfigError, require
from recompute.core.files import atomic_write
from recompute.core.hardware import gpu_by_name, usable_bytes
from recompute.core.plan import Times, parse_budget, plan, require_fits
from recompute.core.policy import Policy
from recompute.core.profile import ProfilePlan, plan_profile, plan_profiles
from recompute.core.spec import ModelSpec, analytic_model
from recompute.core.table import gib
from recompute.core.timing import Device
from recompute.core.workload import Workload

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p)
    add_profile_args(p)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", help="memory budget per GPU, e.g. 70GiB or 80GB")
    budget.add_argument("--gpu", help="a GPU name (e.g. h100-80gb): its usable memory is the budget")
    p.add_argument(
        "--cost",
        choices=("time", "flops", "measured"),
        default="time",
        help="recompute cost: predicted time on the device (--gpu or --device-profile; default h100-80gb), "
        "recomputed FLOPs, or step times measured by `recompute bench` (--bench)",
    )
    p.add_argument(
        "--device-profile",
        help="a `recompute calibrate -o` file: plan on predicted time on that device (default: --gpu's datasheet)",
    )
    p.add_argument("--bench", help="a `recompute bench --json` result of this model, for --cost measured")
    p.add_argument(
        "--consider",
        default=None,
        help="what the plan may use besides recomputation, comma-separated: offload (a layer's saved tensors in "
        "host memory; priced by copy time, so with --cost time on a GPU), chunked (the chunked loss, a global "
        "choice), or none (default: offload,chunked for a preset; chunked for a profiled model, which is planned on "
        "recomputation and the loss mode)",
    )
    p.add_argument(
        "--host-budget",
        help="host memory per GPU that offloaded layers may take, e.g. 96GiB (their saved tensors, pinned; a node's "
        "RAM over its GPUs, less what the job needs besides): the plan offloads no more (default: unchecked)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the chosen plan's step on fake tensors and re-plan until its traced peak fits (needs torch)",
    )
    p.add_argument("-o", "--output", help="write the plan file here (apply and bench take it as is)")
    p.add_argument("--json", action="store_true", help="print the plan, frontier and prediction as JSON")


def run(args: argparse.Namespace) -> int:
    budget = float(usable_bytes(gpu_by_name(args.gpu))) if args.gpu else parse_budget(args.budget)
    if (args.cost == "measured") != (args.bench is not None):
        raise ConfigError("--cost measured needs --bench RESULTS.json (and --bench needs --cost measured)")
    require(
        args.cost == "time" or not args.device_profile,
        "--device-profile prices time: drop it or use --cost time",
        fields=("device_profile",),
    )
    device = time_device(args) if args.cost == "time" else None
    output = writable(args.output, "--output", "plan.json") if args.output is not None else None
    host_budget = parse_budget(args.host_budget, "host_budget") if args.host_budget is not None else None
    if wants_profile(args):
        return _run_profiled(args, budget, output, device)
    spec = analytic_model(args.model)
    wl = workload_from(args, spec)
    consider = _considered("offload,chunked" if args.consider is None else args.consider)
    notes = []
    losses: tuple[str, ...] = (wl.loss,)
    if "chunked" in consider and wl.loss == "full":
        if wl.dtype == "fp16":
            notes.append(f"the chunked loss not considered: {_FP16}")
        else:
            losses = ("full", "chunked")
    times: Times | None = None
    offload: float | None = None
    if device is not None:
        why_not = untimed_reason(args, wl)
        if why_not:
            notes.append(f"planned on recomputed FLOPs: no time predicted with {why_not}")
        else:
            require_fits(spec, wl, budget, offload="offload" in consider, losses=losses, host_budget=host_budget)
            times = _predicted_times(spec, device, quiet=args.json)
            offload = offload_layer_seconds(spec, wl, device, quiet=args.json) if "offload" in consider else None
    if "offload" in consider and offload is None:
        notes.append(f"offload not considered: {_unpriced_offload(args, device)}")
    if host_budget is not None and offload is None:
        notes.append("--host-budget unused: the plan offloads nothing")
    traced = _traced_peak(spec) if args.trace else None
    result = plan(
        spec,
        wl,
        budget,
        measured=args.bench,
        traced_peak=traced,
        times=times,
        time_device=device.label if device else "",
        offload=offload,
        losses=() if args.bench else losses,
        host_budget=host_budget,
    )
    if result.estimate.host:
        notes.append(
            f"the offloaded layers take {gib(result.estimate.host)} of pinned host memory per GPU"
            + ("" if host_budget is not None else "; cap it with --host-budget (a node's RAM over its GPUs)")
        )
    if result.workload["loss"] == "chunked" and wl.loss == "full":
        notes.append(_USE_CHUNKED)
    note = "\n".join(f"note: {n}" for n in notes)
    data = result.to_dict()
    if times is not None and device is not None:
        data["device"] = device.to_dict()
    if output:
        atomic_write(output, json.dumps(data, indent=2) + "\n")
    if args.json:
        emit_json(data)
    else:
        print(render_plan(spec, wl, result))
        if times is not None and device is not None:
            print(device_note(device, wl))
        if note:
            print(note)
        if output:
            print(f"\nwrote {output}")
    return 0


_USE_CHUNKED = (
    "the plan uses the chunked loss: apply it with recompute.apply(model, plan, loss='chunked') "
    "(--loss chunked on bench and train)"
)
_FP16 = "with --dtype fp16 its gradients, taken in the forward before a loss scaler scales them, would underflow"


def _considered(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    require(
        bool(names) and names <= {"offload", "chunked", "none"} and not ("none" in names and len(names) > 1),
        f"--consider takes offload, chunked (comma-separated) or none, got {text!r}",
        fields=("consider",),
    )
    return names - {"none"}


def _predicted_times(spec: ModelSpec, device: Device, *, quiet: bool) -> Callable[[Workload], dict[str, float]]:
    """Each uniform policy's predicted step seconds at a workload (the loss mode decides the step traced)."""

    def times(wl: Workload) -> dict[str, float]:
        return {name: work.seconds(device) for name, work in preset_works(spec, wl, quiet=quiet).items()}

    return times


def _unpriced_offload(args: argparse.Namespace, device: Device | None) -> str:
    if device is None:
        return f"its price is copy time, and costs are {args.cost}; plan with --cost time"
    if device.kind == "cpu":
        return "the device is a CPU (its host memory is its memory)"
    if not device.host_link:
        return f"{device.label} has no host link bandwidth; calibrate it with `recompute calibrate -o`"
    return "no time is predicted"


def _run_profiled(args: argparse.Namespace, budget: float, output: Path | None, device: Device | None) -> int:
    require(args.cost != "measured", "--cost measured plans presets; a profiled model is planned on predicted time")
    considered = _considered("chunked" if args.consider is None else args.consider)
    prof, wl = profile_for(args, quiet=args.json)
    profiles, notes = [prof], []
    if "chunked" in considered and wl.loss == "full":
        why_not = ""
        if args.profile:
            why_not = "--profile holds one loss mode's profile"
        elif wl.dtype == "fp16":
            why_not = _FP16
        if not why_not:
            profiles.append(profile_for(argparse.Namespace(**{**vars(args), "loss": "chunked"}), quiet=args.json)[0])
        elif args.consider is not None or wl.dtype == "fp16":
            notes.append(f"the chunked loss not considered: {why_not}")
    if "offload" in considered or args.host_budget is not None:
        notes.append("offload not considered: a profiled model is planned on recomputation and the loss mode")
    result = plan_profiles(profiles, budget, device)
    wl = Workload(**result.profile.workload)
    if wl.loss == "chunked" and prof.workload.get("loss") == "full":
        notes.append(_USE_CHUNKED)
    traced = None
    if args.trace:
        result, traced = _fit_traced_profile(args.model, wl, result, budget)
    data = result.to_dict()
    data["predicted"]["traced_peak"] = traced
    if output:
        atomic_write(output, json.dumps(data, indent=2) + "\n")
    if args.json:
        emit_json(data)
    else:
        print(render_profile_plan(result))
        if traced is not None:
            print(f"traced peak of the chosen plan: {gib(traced)}")
        for n in notes:
            print(f"note: {n}")
        if output:
            print(f"\nwrote {output}")
    return 0


def _fit_traced_profile(model: str, wl: Workload, result: ProfilePlan, budget: float) -> tuple[ProfilePlan, float]:
    """Trace the chosen plan's whole step; while it is over the budget, re-plan lower by the overshoot.

    The profile composes each layer's figures measured in a short model; a layer's backward also depends a
    little on its neighbours' policies (how the incoming gradient is held), so the trace is the arbiter.
    """
    trace = torch_floor("recompute.trace").trace
    target = budget
    for _ in range(8):
        peak = float(trace(model, wl, Policy(layers=result.chosen.layers)).peak)
        if peak <= budget:
            return result, peak
        target -= peak - budget
        result = plan_profile(result.profile, target, result.device)
    raise ConfigError(f"no plan's traced peak fits {gib(budget)}; raise the budget", fields=("budget",))


def _traced_peak(spec: ModelSpec) -> Callable[[Policy, Workload], float]:
    """A policy's peak by ``recompute.trace``: the real step on fake tensors, the same step estimate models."""
    trace = torch_floor("recompute.trace").trace

    def peak(policy: Policy, wl: Workload) -> float:
        return float(trace(spec, wl, policy).peak)

    return peak
