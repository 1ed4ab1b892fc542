"""``recompute profile``: what each kind of layer of the real model keeps, replays and costs under every policy.

Measured on fake tensors of the model's own class (``recompute.trace.profile``) and kept in the store
(``recompute.core.store``) under the model's identity, the workload and the library versions; ``plan`` and
``estimate`` use it for any model that is not a preset.
"""

from __future__ import annotations

import argparse
import json

from recompute.cli._common import (
    add_model_args,
    add_time_args,
    add_workload_args,
    emit_json,
    time_device,
    workload_from,
    writable,
)
from recompute.cli._lazy import torch_floor
from recompute.cli.render import device_note, render_profile
from recompute.core import store
from recompute.core.files import atomic_write
from recompute.planning import shown_offload
from recompute.progress import progress_bar

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_workload_args(p, "profile")
    p.add_argument("-o", "--output", help="also write the profile here (plan --profile takes it)")
    p.add_argument("--refresh", action="store_true", help="measure again even if the store has this profile")
    add_time_args(p, what="price each layer's replay")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def run(args: argparse.Namespace) -> int:
    device = None if args.no_time else time_device(args)
    trace = torch_floor("recompute.trace")
    source = trace.resolve_source(args.model)
    wl = workload_from(args, source)
    output = writable(args.output, "--output", "profile.json", args) if args.output is not None else None
    with progress_bar("profile", enabled=not args.json) as progress:
        if args.refresh:
            result = trace.profile(source, wl, progress=progress)
            key = trace.profile_key(source, wl)
            if key:
                store.save("profiles", key, result.to_dict())
        else:
            result, _ = trace.cached_profile(source, wl, progress=progress)
    if output:
        atomic_write(output, json.dumps(result.to_dict(), indent=1) + "\n")
    if args.json:
        emit_json(result.to_dict(), "profile")
    else:
        print(render_profile(result, device, offload=shown_offload(result, device, wl)))
        if device is not None:
            print(device_note(device, wl))
        if output:
            print(f"\nwrote {output}")
    return 0
