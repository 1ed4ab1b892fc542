"""One rank of a parallel step, on a fake process group: the group, its mesh, FSDP2's initialisation, the notes.

Rank 0 (or any other: ``step_record``) of ``tp`` tensor-parallel ranks (``--tp``) or of ``dp`` FSDP2 ranks
(``--fsdp --dp``; not both: FSDP2 over TP concatenates the two meshes, which reads their ranks' values inside the
fake mode, which fake tensors refuse). PyTorch's testing
``FakeProcessGroup`` accepts every collective and moves no data, which is all a trace on fake tensors needs: the
shapes, and so every byte, are those of a real rank. Each mesh dim is a process group of its own named as a mesh
names its dims (``mesh_tp``, ``mesh_dp``), so that the collectives traced say which dim they run on
(``recompute.trace._flops``).

Note: [rank 0 is the most loaded] FSDP2 pads a parameter's dim 0 to ``d * ceil(rows / d)``: every rank holds a
padded shard of the parameters and gradients of the same size, and AdamW's moments are made for the unpadded
local shard, ``rows_r = clamp(rows - r * ceil(rows / d), 0, ceil(rows / d))``, which never grows with r. Rank 0
holds the most bytes (the last ranks less wherever d does not divide a parameter's rows), and every rank runs
the same activations (its own batch of the same shape).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from recompute._compat import cpu_stream_events, fake_collectives, fake_store
from recompute.core.errors import ConfigError
from recompute.core.workload import AMP, Workload
from recompute.trace._memtracker import sharding_propagation

__all__ = ["fake_group", "initialize_fsdp", "meshes", "rank_notes", "world"]


def world(wl: Workload) -> int:
    """Ranks of the job one traced rank belongs to: ``tp``, times ``dp`` under ``fsdp``."""
    return wl.tp * (wl.dp if wl.fsdp else 1)


@contextlib.contextmanager
def fake_group(wl: Workload, rank: int = 0) -> Iterator[None]:
    """With more than one rank (``world``): a fake process group of them, this process ``rank``, while inside."""
    if world(wl) == 1:
        yield
        return
    if dist.is_initialized():
        raise ConfigError(
            "--tp and --fsdp trace one rank on a fake process group, but a process group is already running here; "
            "run recompute trace outside torchrun"
        )
    hook = sys.excepthook  # each process group wraps it (a "[rank0]:" prefix): the fake one's is undone
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world(wl))
    try:
        with sharding_propagation(), fake_collectives(), cpu_stream_events(), warnings.catch_warnings():
            # torch 2.6 warns at every random op that a CPU mesh's RNG is not CUDA's; a trace draws nothing
            warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
            yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def meshes(wl: Workload, device: str) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """This rank's (tensor-parallel mesh, FSDP2 mesh) of ``wl``, None where the job has no such dim; made outside
    the fake mode (a mesh reads its ranks' values), inside ``fake_group``."""
    if world(wl) == 1:
        return None, None
    if wl.tp > 1 and wl.fsdp:  # FSDP2 over TP concatenates the meshes, which reads their ranks in the fake mode
        raise ConfigError("one traced rank of both tp and fsdp is not supported; drop one")
    name, size = ("tp", wl.tp) if wl.tp > 1 else ("dp", wl.dp)
    # A group of its own (not the default one a whole-world mesh reuses), so that its collectives are named.
    group = dist.new_group(ranks=list(range(size)), group_desc=f"mesh_{name}")
    mesh = DeviceMesh.from_group(group, device, mesh_dim_names=(name,))
    return (mesh, None) if name == "tp" else (None, mesh)


def initialize_fsdp(model: nn.Module) -> None:
    """Run FSDP2's lazy initialisation of every parameter group of ``model`` now (``FSDPModule.unshard``, then
    ``reshard``: every group gathered and freed in turn), before a traced step.

    Note: [FSDP2's lazy init on fake tensors] a group's first gather re-pads each parameter's local shard unless
    it already is the padded storage, which it tells by the data pointer; a fake storage has none, so on fake
    tensors the first forward makes a new padded shard of every unevenly split parameter (the last ranks' ones)
    and the tracker filed it under activations, where a real rank keeps its parameter. A real run does this in
    its first step.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


def rank_notes(wl: Workload) -> list[str]:
    """What a traced rank is, in words (nothing for one device)."""
    notes = []
    if wl.tp > 1:
        notes.append(
            f"one rank of {wl.tp}-way tensor parallelism{' with sequence parallelism' if wl.sp else ''} "
            "(recompute.parallel on a fake process group): every figure is per rank"
        )
    if wl.fsdp:
        reduce = "fp32" if wl.precision == "mixed" else wl.dtype
        policy = (
            f"MixedPrecisionPolicy(param_dtype={wl.dtype}, reduce_dtype={reduce})"
            if wl.mixed_policy
            else f"no MixedPrecisionPolicy: parameters, gradients and their reduction in {wl.param_dtype}"
        )
        autocast = f", forward under {wl.dtype} autocast" if wl.precision == AMP else ""
        notes.append(
            f"one rank of {wl.dp}-way FSDP2 full shard (fully_shard on each layer, then the root; {policy}"
            f"{autocast}): rank 0, the most loaded (the last ranks hold less Adam state where {wl.dp} does not "
            "divide a parameter's rows); every figure is per rank, collectives on NCCL's terms (a real "
            "reduce-scatter: gloo's copies its whole input first)"
        )
    return notes
