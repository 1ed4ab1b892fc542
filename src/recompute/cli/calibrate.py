"""``recompute calibrate``: measure the local CPU or GPU for the time model and write ``device.json``.

Every command that predicts time takes the file as ``--device-profile``; the datasheet rows
(``recompute.core.hardware``) stand in for a device not measured.
"""

from __future__ import annotations

import argparse

import torch

from recompute.bench.calibrate import calibrate
from recompute.cli._common import emit_json, writable
from recompute.cli.progress import progress_bar
from recompute.core.errors import ConfigError, require
from recompute.core.table import render_table
from recompute.core.timing import Device

__all__ = ["add_args", "render_device", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="where to write the device profile (e.g. device.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="what to measure (default: cuda if any)")
    p.add_argument(
        "--threads", type=int, help="CPU threads to measure with (torch.set_num_threads); predictions assume them"
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and shorter batches (seconds, less exact)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def run(args: argparse.Namespace) -> int:
    output = writable(args.output, "--output", "device.json")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads is not None:
        require(args.threads > 0, f"--threads must be a positive integer, got {args.threads}", fields=("threads",))
        if device != "cpu":
            raise ConfigError("--threads sets CPU threads; drop it to calibrate a GPU")
        torch.set_num_threads(args.threads)
    with progress_bar("calibrate", enabled=not args.json) as progress:
        result = calibrate(device, quick=args.quick, progress=progress)
    result.save(output)
    if args.json:
        emit_json(result.to_dict())
    else:
        print(render_device(result))
        print(f"\nwrote {output}")
    return 0


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
    return "\n".join(lines)
