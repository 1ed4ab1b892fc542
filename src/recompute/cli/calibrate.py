"""``recompute calibrate``: measure the local CPU or GPU for the time model and write ``device.json``.

Every command that predicts time takes the file as ``--device-profile``; the datasheet rows
(``recompute.core.hardware``) stand in for a device not measured. ``--collectives``, under torchrun, measures
the process group's collectives too (``recompute.bench.collectives``) into the profile's network.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from recompute.bench._host import parallel_host_cost, splits, time_parallel_steps
from recompute.bench.calibrate import calibrate
from recompute.bench.collectives import measure_collectives
from recompute.cli._common import emit_json, writable
from recompute.core.errors import ConfigError, positive_int
from recompute.core.pricing import with_network
from recompute.core.table import render_table
from recompute.core.timing import Device
from recompute.parallel import end_process_group, under_torchrun
from recompute.progress import progress_bar

__all__ = ["add_args", "render_device", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="where to write the device profile (e.g. device.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="what to measure (default: cuda if any)")
    p.add_argument(
        "--threads", type=int, help="CPU threads to measure with (torch.set_num_threads); predictions assume them"
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and shorter batches (seconds, less exact)")
    p.add_argument(
        "--operands",
        choices=("cold", "warm"),
        default="cold",
        help="CPU: time each op on a ring of copies of its operands, out of the cache as in a training step "
        "(cold, the default), or on the same operands each call (warm: a model whose whole step stays in the cache)",
    )
    p.add_argument(
        "--collectives",
        action="store_true",
        help="under torchrun: measure all-reduce, all-gather, reduce-scatter and all-to-all over a size sweep on the "
        "process group (gloo on CPUs, NCCL on GPUs) into the profile at -o (made first if missing)",
    )
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def run(args: argparse.Namespace) -> int:
    output = writable(args.output, "--output", "device.json")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads is not None:
        positive_int("threads", args.threads, at_most=os.cpu_count() or 1)  # torch crashes on 100,000
        if device != "cpu":
            raise ConfigError("--threads sets CPU threads; drop it to calibrate a GPU")
        torch.set_num_threads(args.threads)
    if args.collectives:
        return _collectives(args, output, device)
    with progress_bar("calibrate", enabled=not args.json) as progress:
        result = calibrate(device, quick=args.quick, cold=args.operands == "cold", progress=progress)
    result.save(output)
    if args.json:
        emit_json(result.to_dict(), "calibrate")
    else:
        print(render_device(result))
        print(f"\nwrote {output}")
    return 0


def _collectives(args: argparse.Namespace, output: Path, device: str) -> int:
    """Every rank measures the collectives, and rank 0 writes them into the profile at -o. Without one there
    yet, every rank calibrates the device first, all at once (the ranks of a step share the machine: on a CPU
    the rates they reach together are what a step sees), and rank 0 keeps its own. Then every rank times real
    tensor-parallel steps of small models, and rank 0 fits the host's costs of such a step per kernel and per
    collective (``recompute.bench._host.parallel_host_cost``) into the profile's host costs."""
    if not under_torchrun():
        raise ConfigError(
            "--collectives measures a process group: torchrun --nproc-per-node 2 -m recompute calibrate "
            f"--collectives -o {output}"
        )
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank0 = dist.get_rank() == 0
    base = Device.load(output, "--output") if output.is_file() else None
    dist.barrier()  # every rank has looked before rank 0 writes
    if base is None:
        with progress_bar("calibrate", enabled=rank0 and not args.json) as progress:
            base = calibrate(device, quick=args.quick, cold=args.operands == "cold", progress=progress)
    dist.barrier()
    with progress_bar("collectives", enabled=rank0 and not args.json) as progress:
        found = measure_collectives(quick=args.quick, progress=progress)
    steps, ranks = None, dist.get_world_size()
    if base.host is not None and splits(ranks):
        mesh = init_device_mesh(device, (ranks,))
        with progress_bar("tensor-parallel steps", enabled=rank0 and not args.json) as progress:
            steps = time_parallel_steps(mesh, seconds=2.0 if args.quick else 8.0, progress=progress)
    end_process_group()  # before the fit's traces, which start a fake process group
    if rank0:
        result = dataclasses.replace(base, network={**base.network, **found})
        if steps is not None:
            host = parallel_host_cost(with_network(result), steps, ranks)
            result = dataclasses.replace(result, host=host)
        result.save(output)
        if args.json:
            emit_json(result.to_dict(), "calibrate")
        else:
            print(render_collectives(found))
            print(result.host_note())
            if steps is None:
                why = (
                    "the profile has no host costs"
                    if base.host is None
                    else f"the host models do not split {ranks} ways"
                )
                print(
                    f"note: the host's costs of tensor-parallel steps not measured ({why}; 2, 4, 8, 16 or 32 ranks do)"
                )
            print(f"\nwrote {output}")
        sys.stdout.flush()
    return 0


def render_collectives(found: dict) -> str:
    """Bus bandwidth per collective at each size measured."""
    rows = [
        [kind, f"{size:,.0f}", f"{found['times'][kind][i][1] * 1e6:,.1f}", f"{busbw / 1e9:.3g}"]
        for kind, points in found["collectives"].items()
        for i, (size, busbw) in enumerate(points)
    ]
    head = f"collectives on {found['ranks']} ranks ({found['backend']}):"
    return "\n".join([head, render_table(["collective", "bytes", "time (us)", "bus bandwidth (GB/s)"], rows)])


def render_device(d: Device) -> str:
    """The calibrated rates at their largest measured size, the bare launch and the host's time per kernel."""
    rows = [[k, f"{c.points[-1][1] / 1e12:.3g} TFLOP/s", f"{c.points[0][1] / 1e12:.3g}"] for k, c in d.compute.items()]
    rows += [[k, f"{c.points[-1][1] / 1e9:.3g} GB/s", f"{c.points[0][1] / 1e9:.3g}"] for k, c in d.bandwidth.items()]
    rows += [[k, f"{c.points[-1][1] / 1e9:.3g} GB/s", f"{c.points[0][1] / 1e9:.3g}"] for k, c in d.ops.items()]
    lines = [
        f"{d.label} ({d.kind}): {d.source}",
        render_table(["rate", "largest size", "smallest size"], rows),
        f"overhead per kernel: {d.overhead * 1e6:.2f} us (a bare launch)",
        d.host_note(),
    ]
    if d.host_link:
        lines.append(f"host to device (pinned): {d.host_link / 1e9:.3g} GB/s")
    pool = d.measured.get("operand_pool_bytes")
    if pool:
        lines.append(
            f"operands: cold, each op rotated through {pool / 2**20:.0f} MiB of copies (a step's working set is "
            "larger than the cache)"
        )
    elif pool == 0 and d.kind == "cpu":
        lines.append("operands: warm, the same ones each call (--operands warm: a step that stays in the cache)")
    return "\n".join(lines)
