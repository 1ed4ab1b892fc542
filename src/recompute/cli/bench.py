"""``recompute bench``: real training steps under each policy; ``--tp/--dp`` under torchrun, per rank."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from recompute.bench import (
    MAX_MINUTES,
    bench,
    bench_fsdp,
    bench_parallel,
    bench_source,
    render_bench,
    render_fsdp_bench,
    render_parallel_bench,
    with_predictions,
    with_traces,
)
from recompute.bench.calibrate import cached_calibration
from recompute.cli._common import add_workload_args, csv, emit_json, workload_from
from recompute.core.errors import ConfigError, distinct, require, torch_seed
from recompute.core.plan_file import read_plan
from recompute.core.policy import Policy, distinct_policies
from recompute.core.pricing import choose_device, with_network
from recompute.core.timing import Device
from recompute.core.workload import Workload, parallel_sizes
from recompute.models.source import ModelSource
from recompute.parallel import end_process_group
from recompute.progress import progress_bar

__all__ = ["SIZE_FLAGS", "add_args", "add_size_args", "run", "size_overrides"]

SIZE_FLAGS = (("--layers", "n_layers"), ("--hidden", "hidden"), ("--heads", "n_heads"), ("--kv-heads", "n_kv_heads"))
"""Options that shrink a preset to fit this machine (``bench`` and ``verify``)."""


def add_size_args(p: argparse.ArgumentParser) -> None:
    """``--layers/--hidden/--heads/--kv-heads/--vocab``: override the model's size."""
    for flag, field in (*SIZE_FLAGS, ("--vocab", "vocab")):
        p.add_argument(flag, dest=field, type=int, metavar="N", help=f"override the model's {field} (to fit here)")


def size_overrides(args: argparse.Namespace) -> dict[str, int | None]:
    return {field: getattr(args, field) for _, field in (*SIZE_FLAGS, ("--vocab", "vocab"))}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="preset, hf:NAME, a transformers config.json (or its folder) or package.module:factory; the class it "
        "names runs (default: GPT-2 at 6 layers, h 384, 6 heads: CPU-sized)",
    )
    add_size_args(p)
    add_workload_args(p, "bench")
    p.add_argument("--policies", default="none,block", help="comma-separated; the first is the reference")
    p.add_argument("--plan", help="a plan JSON file (recompute plan -o), benched after --policies")
    p.add_argument(
        "--loss-modes",
        help="comma-separated loss modes to run every policy under, side by side, e.g. full,chunked "
        "(default: --loss's alone)",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per policy, after warm-up (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per policy and round (default: 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="share the timed steps out over this many rounds, each building every policy afresh: steps side by "
        "side on a drifting machine, for a build and warm-up per policy per round (default: 1, one block each)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default: 0)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=MAX_MINUTES,
        help="on the CPU, refuse a run predicted (its FLOPs at this CPU's matmul rate) to take longer "
        f"(default: {MAX_MINUTES:g})",
    )
    p.add_argument(
        "--device-profile",
        help="this device's `recompute calibrate -o` file, for predicted step times (default: a quick calibration "
        "of this device, cached)",
    )
    p.add_argument("--no-time", action="store_true", help="no predicted step times (no calibration, no trace)")
    p.add_argument(
        "--compiled",
        nargs="?",
        const="model",
        choices=("model", "block"),
        help="run each policy's steps torch.compile'd (Inductor), compiled in the warm-up, and hold each to the "
        "compiled step's trace (recompute trace --compiled): its peak and its graphs' FLOPs; 'block': each layer "
        "compiled on its own, the rest eager, as torchtitan compiles (default: the whole model); no predicted step "
        "time",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        metavar="X",
        help="with --compiled: torch._functorch.config.activation_memory_budget in (0, 1] (default: PyTorch's, 1.0)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    torch_seed("--seed", args.seed)
    source = bench_source(args.model, **size_overrides(args))
    policies = distinct("--policies", csv(args.policies) + ([args.plan] if args.plan else []))
    for name in policies:  # a plan file's figures checked too (check_plan_dict), a name's spelling
        read_plan(name) if name.endswith(".json") or os.path.isfile(name) else Policy.parse(name)
    distinct_policies("--policies", policies)
    wl = workload_from(args, source)
    require(
        args.memory_budget is None or args.compiled is not None,
        "--memory-budget is torch.compile's; add --compiled",
        fields=("memory_budget",),
    )
    if args.compiled is not None:
        sizes, fields = parallel_sizes(wl, ("tp", "dp"))
        require(not fields, f"--compiled benches one process; drop {sizes}", fields=fields)
        require(
            not args.device_profile,
            "--compiled predicts no step time (the time model prices eager kernels); drop --device-profile",
            fields=("device_profile",),
        )
    if wl.fsdp:
        return _run_fsdp(args, source, wl, policies)
    if wl.tp > 1 or wl.dp > 1:
        return _run_parallel(args, source, wl, policies)
    runs = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed, "rounds": args.rounds}
    require(not (args.no_time and args.device_profile), "--no-time and --device-profile exclude each other")
    require(args.max_minutes > 0, f"--max-minutes must be a number above 0, got {args.max_minutes:g}")
    device = None
    if not args.no_time and args.compiled is None:
        device = choose_device(device_profile=args.device_profile) if args.device_profile else None
        if device is not None:
            device.check_runs_on(wl.device, threads=torch.get_num_threads())
    losses = csv(args.loss_modes) if args.loss_modes else []
    with progress_bar("bench") as progress:
        timed: Device | Callable[[], Device] | None = device
        if not args.no_time and device is None and args.compiled is None:
            timed = functools.partial(cached_calibration, wl.device, progress=progress)  # after the memory check
        result = bench(
            source, wl, policies, **runs, progress=progress, device_profile=timed, losses=losses,
            max_minutes=args.max_minutes, compiled=args.compiled, memory_budget=args.memory_budget,
        )  # fmt: skip
    emit_json(result.to_dict(), "bench") if args.json else print(render_bench(result))
    return 0


def _run_parallel(args: argparse.Namespace, source: ModelSource, wl: Workload, policies: list[str]) -> int:
    """``bench --tp/--dp`` under torchrun: every rank measures, rank 0 prints."""
    spec = source.spec
    if spec is None or source.hf:
        sizes, fields = parallel_sizes(wl, ("tp", "dp"))
        raise ConfigError(
            f"{sizes} bench recompute's reference GPT/Llama (recompute.parallel), not {source.origin}; "
            f"drop {sizes}, or bench a preset",
            fields=fields,
        )
    runs = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed}
    require(not (args.no_time and args.device_profile), "--no-time and --device-profile exclude each other")
    sizes, fields = parallel_sizes(wl, ("tp", "dp"))
    require(args.rounds == 1, f"--rounds is the one-process bench's; drop it under {sizes}", fields=("rounds", *fields))
    device = None
    if not args.no_time and args.device_profile:  # refused on every rank before the steps, if it is
        device = choose_device(device_profile=args.device_profile)
        device.check_runs_on(wl.device, threads=torch.get_num_threads())
    with progress_bar("bench", enabled=_rank() == 0) as progress:
        result = bench_parallel(spec, wl, policies, **runs, argv=args.argv, progress=progress)
    rank = dist.get_rank()
    end_process_group()  # Note: [ending together]
    if rank == 0:
        if not args.no_time:  # rank 0 predicts once the group has ended: the trace runs on a fake one
            with progress_bar("time model", enabled=not args.json) as progress:
                if device is None:
                    device = with_network(cached_calibration(wl.device, progress=progress))
                result = with_predictions(result, spec, policies, device, progress=progress)
        emit_json(result.to_dict(), "bench --tp/--dp") if args.json else print(render_parallel_bench(result))
        sys.stdout.flush()
    return 0


def _run_fsdp(args: argparse.Namespace, source: ModelSource, wl: Workload, policies: list[str]) -> int:
    """``bench --fsdp --dp D`` under torchrun: every rank measures its real step, rank 0 traces each rank and prints
    them side by side (any model source: ``recompute.parallel.shard`` takes any layer list)."""
    require(args.loss_modes is None, "--loss-modes is not run under --fsdp; drop it (bench one --loss at a time)")
    with progress_bar("bench", enabled=_rank() == 0 and not args.json) as progress:
        result = bench_fsdp(source, wl, policies, steps=args.steps, seed=args.seed, argv=args.argv, progress=progress)
    end_process_group()  # Note: [ending together]
    if result is not None:  # rank 0, once the group has ended: the trace runs on a fake one
        result = with_traces(result, source, policies)
        emit_json(result.to_dict(), "bench --fsdp") if args.json else print(render_fsdp_bench(result))
        sys.stdout.flush()
    return 0


def _rank() -> int:
    """This process's rank under torchrun (before the process group exists), else 0."""
    return int(os.environ.get("RANK", "0"))
