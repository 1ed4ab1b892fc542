"""``shard(model, mesh)``: FSDP2 full shard of any transformer, ``fully_shard`` on each layer, then on the root.

torchtitan's and accelerate's wrapping: each transformer layer (``recompute.checkpointing.find_layers``) is one
FSDP parameter group, all-gathered for its forward and again for its backward and resharded after each; the
root group holds the rest (embeddings, final norm, output layer). Order with recompute's other transforms
(torchtitan's): tensor parallelism (``parallelize``), ``apply``, ``torch.compile``, then ``shard``.

Precision (``Workload`` under ``fsdp``, ``mixed_dtype``): the parameters are kept in ``param_dtype`` (fp32 for
``mixed`` and ``amp``, else ``dtype``); under ``mixed`` and ``amp`` FSDP's ``MixedPrecisionPolicy`` gathers the
fp32 shards in ``dtype`` for compute; ``mixed`` reduces the gradients in fp32 (torchtitan's
``mixed_precision_param`` and ``mixed_precision_reduce``), ``amp`` in ``dtype`` and runs the forward under autocast
besides (accelerate's ``MixedPrecisionPolicy(param_dtype=reduce_dtype=output_dtype=bf16)`` and its autocast, which
HF Trainer's FSDP runs: ``reduce_dtype``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from recompute._compat import require_fsdp
from recompute.checkpointing import find_layers
from recompute.core.errors import ConfigError
from recompute.core.workload import Workload
from recompute.runtime import TORCH_DTYPES

__all__ = ["mixed_dtype", "reduce_dtype", "shard"]


def mixed_dtype(wl: Workload) -> torch.dtype | None:
    """The dtype FSDP gathers ``wl``'s fp32 parameters in (``Workload.mixed_policy``: ``fsdp`` under ``mixed`` or
    ``amp`` with a 16-bit ``dtype``), or None: the parameters run in the dtype they are kept in."""
    return TORCH_DTYPES[wl.dtype] if wl.mixed_policy else None


def reduce_dtype(wl: Workload) -> torch.dtype:
    """The dtype FSDP reduces ``wl``'s gradients in under its mixed policy: fp32 under ``mixed`` (torchtitan's),
    the dtype under ``amp`` (accelerate's)."""
    return torch.float32 if wl.precision == "mixed" else TORCH_DTYPES[wl.dtype]


def shard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_dtype: torch.dtype | None = None,
    reduce: torch.dtype = torch.float32,
    reshard_after_forward: bool | None = None,
    layers: str | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh``, in place: ``fully_shard`` on each transformer layer, then the root.

    Call it after ``recompute.apply`` (and ``torch.compile``) and before building the optimizer. Parameters
    become DTensors sharded on dim 0 (``ceil(rows / d)`` rows per rank, the last ranks padded).

    Args:
        model: any model with a layer list ``find_layers`` finds (recompute's GPT and Llama, transformers'
            classes), on the mesh's device type (or fake tensors of it).
        mesh: a 1-D mesh of the data-parallel ranks (``mesh["dp"]`` of a 2-D ``("dp", "tp")`` one).
        mp_dtype: gather the parameters in this dtype for compute and reduce the gradients in ``reduce``
            (``MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=reduce)``); None: no policy.
        reshard_after_forward: ``fully_shard``'s; None leaves its default (every layer resharded after its
            forward, the root kept gathered from its forward to its backward on torch 2.13; 2.6 never
            reshards the root either).
        layers: dotted path of the layer list, when ``find_layers`` cannot find it.

    Returns:
        ``model``.

    Raises:
        ConfigError: a model that is not a module, a mesh that is not a 1-D DeviceMesh, a model sharded
            already, no layer list, or a torch that cannot run ``fully_shard`` on the mesh's device
            (``recompute._compat.require_fsdp``).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"shard takes the model (a torch.nn.Module), got a {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(
            f"shard takes a DeviceMesh of the data-parallel ranks, got a {type(mesh).__name__}; make one with "
            "torch.distributed.device_mesh.init_device_mesh(device, (world_size,))"
        )
    if mesh.ndim != 1:
        raise ConfigError(f"shard takes a 1-D data-parallel mesh, got {mesh.ndim}-D; pass mesh['dp']")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ConfigError(f"{type(model).__name__} is sharded already (fully_shard); shard a fresh model")
    require_fsdp(mesh.device_type)
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=reduce) if mp_dtype else MixedPrecisionPolicy()
    for module in (*find_layers(model, path=layers), model):
        if reshard_after_forward is None:  # fully_shard's own default, which differs by release
            fully_shard(module, mesh=mesh, mp_policy=mp)
        else:
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
