"""``recompute plan``: the cheapest per-layer recomputation that fits a memory budget, and the frontier.

Any model, one planner (``recompute.core.plan``): a preset is read by the analytic model, any other model by its
profile (the real class measured on fake tensors), both as the same cost table (``recompute.planning``).
Torch-free unless something must be measured (a profile, a preset's step work for time) or ``--trace`` asks
for the real step's peak.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from recompute.cli._common import (
    add_model_args,
    add_source_args,
    add_time_args,
    add_workload_args,
    emit_json,
    measured_workload,
    time_device,
    workload_from,
    writable,
)
from recompute.cli._lazy import torch_floor
from recompute.cli.render import render_plan
from recompute.compile_plan import BUDGETS, render_compiled_plan, with_memory_budget
from recompute.core.analytic import estimate
from recompute.core.costs import CostTable
from recompute.core.errors import ConfigError, require
from recompute.core.export import STACKS, Export, export
from recompute.core.files import atomic_write
from recompute.core.plan import Plan, parse_budget, plan, require_fits
from recompute.core.pricing import priced_on
from recompute.core.profile import Profile
from recompute.core.table import gib
from recompute.core.workload import Workload, build_workload
from recompute.planning import cost_tables, is_profiled, max_positions
from recompute.progress import progress_bar

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p, "plan")
    add_source_args(p)
    p.add_argument(
        "--budget",
        help="memory per GPU the step may use: a size (70GiB, 80GB) or a GPU name (its usable memory); "
        "default: --gpu's usable memory",
    )
    add_time_args(p, what="price the plan", no_time=False)
    p.add_argument(
        "--cost",
        choices=("time", "flops", "measured"),
        default="time",
        help="recompute cost: predicted time on the device (--gpu or --device-profile; default h100-80gb), "
        "recomputed FLOPs, or step times measured by `recompute bench` (--bench)",
    )
    p.add_argument("--bench", help="a `recompute bench --json` result of this model, for --cost measured")
    p.add_argument(
        "--consider",
        default="offload,chunked",
        help="what the plan may use besides recomputation, comma-separated: offload (a layer's saved tensors in "
        "host memory; priced by copy time, so with --cost time on a GPU), chunked (the chunked loss, a global "
        "choice), or none (default: offload,chunked)",
    )
    p.add_argument(
        "--host-budget",
        help="host memory per GPU that offloaded layers may take, e.g. 96GiB (their saved tensors, pinned; a node's "
        "RAM over its GPUs, less what the job needs besides): the plan offloads no more (default: unchecked)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the chosen plan's step on fake tensors and re-plan until its traced peak fits (needs torch); on "
        "CUDA what the caching allocator reserves must fit, and a GPU's budget drops its fragmentation allowance",
    )
    p.add_argument(
        "--memory-budget",
        metavar="auto|X,Y,...",
        help="weigh torch.compile's activation_memory_budget beside the per-layer policies (implies --compiled): "
        "auto (1.0, 0.8, 0.6, 0.4, 0.2, 0.1) or fractions in (0, 1]; traces the compiled step on fake tensors "
        "(a minute or so per layer assignment; docs/compiled.md) and plans the cheapest of the knob, the policies "
        "and their mix; the plan file then carries the budget, which apply sets",
    )
    p.add_argument(
        "--per-block",
        action="store_true",
        help="with --memory-budget: each layer compiled on its own, the rest eager, as torchtitan compiles (the "
        "budget is then a fraction of each block's; default: the whole model compiled)",
    )
    p.add_argument("-o", "--output", help="write the plan file here (apply, bench, train and verify take it as is)")
    p.add_argument("--frontier", action="store_true", help="show every plan of the frontier (default: a dozen)")
    p.add_argument("--json", action="store_true", help="print the plan, frontier and prediction as JSON")
    p.add_argument(
        "--export",
        choices=STACKS,
        help="also write the plan in a stack's own settings (exact, or its closest setting with what that costs; "
        "docs/export.md); printed, and with -o written beside it (plan.torchtitan.toml)",
    )


def run(args: argparse.Namespace) -> int:
    _budget(args)  # checked before any work
    budgets = memory_budgets(args.memory_budget) if args.memory_budget is not None else None
    require(
        budgets is not None or not args.per_block,
        "--per-block says how the compiled step weighed by --memory-budget is compiled; add --memory-budget",
        fields=("per_block",),
    )
    if budgets is not None:
        require(
            args.profile is None or "model" in getattr(args, "given", set()),
            "--memory-budget traces the model's compiled step, which a --profile file does not hold: add --model",
            fields=("memory_budget",),
        )
        args.compiled = True
    if (args.cost == "measured") != (args.bench is not None):
        raise ConfigError("--cost measured needs --bench RESULTS.json (and --bench needs --cost measured)")
    require(
        args.cost == "time" or not args.device_profile,
        "--device-profile prices time: drop it or use --cost time",
        fields=("device_profile",),
    )
    timed = time_device(args)  # --gpu and --gpus-per-node checked whatever the cost
    device = timed if args.cost == "time" else None
    output = writable(args.output, "--output", "plan.json", args) if args.output is not None else None
    beside = _beside(output, args.export)
    host_budget = parse_budget(args.host_budget, "host_budget") if args.host_budget is not None else None
    consider = _considered(args.consider)
    require(  # it traced the default gpt2 against the profile's plan
        not (args.trace and args.profile and "model" not in getattr(args, "given", set())),
        "--trace traces the model's real step, which a --profile file does not hold: add --model (the config.json "
        "or factory the profile measured)",
        fields=("trace",),
    )
    wl = _workload(args)
    device, said = priced_on(wl, device, asked=bool(args.gpu or args.device_profile))
    budget = _budget(args, replayed=args.trace and wl.device == "cuda")
    require(
        args.export is None or wl.loss == "full",
        f"--export {args.export} prices the stack's settings with the full loss (it has no chunked loss): plan "
        "without --loss chunked (the chunked loss is weighed anyway)",
        fields=("export",),
    )
    losses = ("chunked",) if "chunked" in consider else ()
    source = {"analytic": args.analytic, "profile": args.profile}
    with progress_bar("plan", enabled=not args.json) as progress:
        # refuse before pricing (tracing) time
        if device is not None and not is_profiled(args.model, **source, precision=wl.precision, fsdp=wl.fsdp):
            unpriced = cost_tables(args.model, wl, losses=losses, offload="offload" in consider and not said, **source)
            require_fits(unpriced.tables, budget, host_budget=host_budget, alternatives=unpriced.alternatives)
        found = cost_tables(
            args.model,
            wl,
            device=device,
            measured=args.bench,
            losses=() if args.bench else losses,
            offload="offload" in consider and not said,
            progress=progress,
            **source,
        )
        traced = (
            torch_floor("recompute.trace").step_needs(found.spec if found.spec is not None else args.model)
            if args.trace
            else None
        )
        result = plan(
            found.tables,
            budget,
            host_budget=host_budget,
            traced_peak=traced,
            alternatives=found.alternatives,
            notes=(*said, *found.notes),
        )
        compiled = None
        if budgets is not None:
            result, compiled = with_memory_budget(
                result,
                args.model,
                wl,
                tables=found.tables,
                budgets=budgets,
                per_block=args.per_block,
                progress=progress,
            )
    notes = list(result.notes) + _notes(result, wl, host_budget)
    data = result.to_dict() | {"notes": notes}
    if output:
        atomic_write(output, json.dumps(data, indent=2) + "\n")
    exported = _export(args.export, result, found.tables, output, beside)
    if args.json:
        emit_json(data | ({"export": exported.to_dict()} if exported else {}), "plan")
        return 0
    breakdown = None
    if found.spec is not None:
        breakdown = estimate(found.spec, build_workload(**result.workload), result.policy)
    shown = len(result.frontier) if args.frontier else 12
    written = str(output) if output else None
    print(render_plan(result, wl, breakdown=breakdown, output=written, notes=notes, points=shown))
    if compiled is not None:
        print("\n" + render_compiled_plan(compiled))
    if exported is not None:
        print(f"\n{args.export} (--export):\n{exported.text}", end="")
    return 0


def memory_budgets(text: str) -> tuple[float, ...]:
    """``--memory-budget``'s values: ``auto`` or fractions in (0, 1], comma-separated.

    Raises:
        ConfigError: anything else.
    """
    if text.strip() == "auto":
        return BUDGETS
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    require(
        bool(values) and all(0 < v <= 1 for v in values),
        f"--memory-budget takes auto or fractions in (0, 1], comma-separated (e.g. 1.0,0.5,0.2), got {text!r}",
        fields=("memory_budget",),
    )
    return values


def _beside(output: Path | None, stack: str | None) -> Path | None:
    """Where ``--export`` writes beside the plan file (plan.torchtitan.toml), checked before any work."""
    if output is None or stack is None:
        return None
    suffix = STACKS[stack].suffix
    return writable(output.with_name(f"{output.stem}.{stack}.{suffix}"), "--export", f"plan.{stack}.{suffix}")


def _export(
    stack: str | None, result: Plan, tables: Sequence[CostTable], output: Path | None, beside: Path | None
) -> Export | None:
    """The plan in ``stack``'s settings (``recompute.core.export``), written beside the plan file."""
    if stack is None:
        return None
    exported = export(result, tables, stack, plan_file=str(output) if output else "plan.json")
    if beside is not None:
        atomic_write(beside, exported.text)
    return exported


def _budget(args: argparse.Namespace, *, replayed: bool = False) -> float:
    """``--budget`` (a size or a GPU name), else the ``--gpu``'s usable memory (``replayed``: without the
    fragmentation allowance, which ``--trace`` measures on CUDA by replaying the caching allocator)."""
    if args.budget is not None:
        return parse_budget(args.budget, replayed=replayed)
    if args.gpu is not None:
        return parse_budget(args.gpu, "gpu", replayed=replayed)
    raise ConfigError("plan needs a memory budget: give --budget (e.g. 70GiB) or --gpu (its usable memory)")


def _workload(args: argparse.Namespace) -> Workload:
    """The workload of the options (``--profile``: the profile's own, which the options may not contradict)."""
    if args.profile is None:
        return workload_from(args, max_positions(args.model))
    return measured_workload(args, Profile.load(args.profile))


def _considered(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    require(
        bool(names) and names <= {"offload", "chunked", "none"} and not ("none" in names and len(names) > 1),
        f"--consider takes offload, chunked (comma-separated) or none, got {text!r}",
        fields=("consider",),
    )
    return names - {"none"}


def _notes(result: Plan, wl: Workload, host_budget: float | None) -> list[str]:
    """What the plan takes besides device memory, and how to apply what it chose."""
    notes = []
    if result.traced_reserved is not None:
        notes.append(
            "checked by what CUDA's caching allocator reserves over the plan's steps (replayed from its trace); a "
            "GPU's budget then leaves out its fragmentation allowance"
        )
    if result.host:
        notes.append(
            f"the offloaded layers take {gib(result.host)} of pinned host memory per GPU"
            + ("" if host_budget is not None else "; cap it with --host-budget (a node's RAM over its GPUs)")
        )
    elif host_budget is not None:
        notes.append("--host-budget unused: the plan offloads nothing")
    return notes
