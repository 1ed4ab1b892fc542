"""``PhaseFlops``: every op's FLOPs by PyTorch's own formulas (``FlopCounterMode``'s table), filed under the
phase of the step.

Not ``FlopCounterMode`` itself, for two reasons. It files FLOPs under the modules running, which misses a
checkpoint's replay (the replayed ops run inside the backward, and the layer's own forward hook does not fire
again); the phase the ``StepTracker`` knows (forward or backward of layer j, of the head, ...) does not: a
layer's replay is part of its backward phase, so a policy's recompute FLOPs in layer j are its backward FLOPs
there minus ``none``'s. And it decomposes every op it has no formula for, which changes what the step
allocates (90 KiB more in a tiny Llama's layer backward); this mode only counts, so the bytes measured in the
same step stay those of the real one. It is not a dispatch mode of its own: ``StepTracker`` hands it every op
it dispatches (one Python mode fewer on every op of a fake step).

PyTorch's formula table has no entry for two ops a CPU step runs; they are added here with the same
conventions (2 FLOPs per multiply-add; attention counted as if no mask, as PyTorch counts SDPA):
``_scaled_dot_product_flash_attention_for_cpu`` (SDPA's CPU kernel, forward and backward) and
``_grouped_mm`` (transformers' MoE experts). The SDPA kernels' formulas are recompute's own
(``SDPA_FORMULAS``): PyTorch's refuse grouped-query shapes before 2.13 (fewer key/value heads than query
heads: ``sdpa_flop_count: query/key/value shapes are incompatible``), and 2.13's count them as these do, every
query head against its group's keys. ``flop_counter`` is a plain ``FlopCounterMode`` with them: 2.13's counts
on every supported torch.

It also files every kernel the step runs as a ``Work`` signature (op, dtype, FLOPs, bytes) under its phase,
for the time model (``recompute.core.timing``): bytes are what the op reads (each input's memory span once)
plus what it writes; views, and the allocations that run no kernel, are not kernels and are left out.

Collectives (DTensor's functional ones, and the process group's own that FSDP2 calls) are filed too, under
``comm.<kind>.<group>.<ranks>`` (``recompute.core.comms.comm_name``), with the collective's size as nccl-tests
counts it (the all-reduce buffer, the whole gathered or scattered tensor) as bytes; the group is the mesh
dimension its process group was made for (``tp``, ``dp``). One that runs inside a checkpoint's recomputation is
marked ``.replay``: a replayed region runs its collectives again.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Collection
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from recompute._compat import resolve_process_group
from recompute.core.comms import comm_name
from recompute.offload import moving
from recompute.trace._memtracker import propagating
from recompute.trace._tracker import Phase

__all__ = ["SDPA_FORMULAS", "PhaseFlops", "flop_counter", "op_name", "span", "tensors_of"]

aten = torch.ops.aten

_NO_KERNEL = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "resize_", "set_"}
    | {"_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size"}
    | {"_unsafe_view"}
)
"""Ops that allocate or read metadata and run no kernel (views are recognised by their schema)."""

_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "send": "send_recv",
    "recv_": "send_recv",
}
"""Collective ops (``_c10d_functional`` and ``c10d``) by the kind ``recompute.core.comms`` prices."""


def _grouped(query: Any, key: Any, value: Any) -> tuple[Any, Any, Any]:
    """(b, h, s, d) shapes of query, key and value with the key/value heads widened to the query's (GQA)."""
    return query, *((*shape[:1], query[1], *shape[2:]) for shape in (key, value))


def _sdpa(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(*_grouped(query, key, value)))


def _sdpa_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, *_grouped(query, key, value)))


def _sdpa_ops(*kernels: str) -> dict[Any, Any]:
    """{op: formula} of the forward and backward of SDPA's ``kernels`` that this torch has."""
    names = {
        f"_scaled_dot_product_{k}{end}": f for k in kernels for end, f in (("", _sdpa), ("_backward", _sdpa_backward))
    }
    return {getattr(aten, name): f for name, f in names.items() if hasattr(aten, name)}


SDPA_FORMULAS: dict[Any, Any] = {
    op: f
    for op, f in _sdpa_ops("flash_attention", "efficient_attention", "cudnn_attention").items()
    if op in flop_registry
}
"""FLOPs of the SDPA kernels PyTorch's table has, by their (b, h, s, d) shapes, grouped-query attention included
(as ``FlopCounterMode``'s ``custom_mapping`` takes them). The varlen kernels (``_flash_attention_forward``) keep
PyTorch's formula: SDPA calls them from inside its kernel, where no dispatch mode sees them."""


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode(display=False)`` that counts grouped-query attention on every supported torch."""
    return FlopCounterMode(display=False, custom_mapping=SDPA_FORMULAS)


def _grouped_mm(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """(m, k) x (g, k, n) -> (m, n), each row by one group: 2mkn; (k, m) x (m, n) by groups of m -> (g, k, n):
    2kmn; (g, m, k) x (g, k, n): 2gmkn."""
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[-2] * a[-1] * b[-1]


_FORMULAS: dict[Any, Any] = {
    **flop_registry,
    **{op: shape_wrapper(f) for op, f in {**SDPA_FORMULAS, **_sdpa_ops("flash_attention_for_cpu")}.items()},
}
if hasattr(aten, "_grouped_mm"):  # PyTorch 2.8 and later
    _FORMULAS[aten._grouped_mm] = shape_wrapper(_grouped_mm)


def span(t: torch.Tensor) -> int:
    """Bytes of memory a tensor covers: its elements for a dense one, less for a broadcast (stride 0) one."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))) * t.element_size()


def op_name(func: Any, kwargs: dict[str, Any]) -> str:
    """The op's name as the time model prices it: aten's, with GELU's tanh form told apart (three times the
    cost of the erf form per element on a CPU)."""
    name = str(func._overloadpacket).removeprefix("aten.")
    if name in ("gelu", "gelu_backward") and kwargs.get("approximate") == "tanh":
        return f"{name}[tanh]"
    return name


def tensors_of(inputs: Any, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The distinct tensors an op reads and the ones it writes that it did not read (in-place writes once)."""
    return _distinct(tree_leaves(inputs), tree_leaves(out))


def _distinct(*leaves: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    seen: set[int] = set()
    groups: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for group, found in zip(groups, leaves):
        for t in found:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                group.append(t)
    return groups


def _leaves(tree: Any, into: list[Any]) -> list[Any]:
    """The leaves of an op's arguments or outputs in pytree's order, without pytree: an op's are tuples, lists
    and dicts of tensors and numbers (a tuple subclass such as ``torch.Size`` is walked too, which adds numbers
    only). Counting an op through pytree (``tree_map_only`` for DTensors, then ``tree_leaves`` twice) cost more
    than the rest of the count; this cut a cold plan's CPU by 4-6 % (``python benchmarks/cold_plan.py --before
    4155a74``: 27.7 to 26.6 s for two of Qwen2.5-1.5B's layers, 39.0 to 36.6 s for all 28, the same profiles)."""
    if isinstance(tree, tuple | list):
        for x in tree:
            _leaves(x, into)
    elif type(tree) is dict:
        for x in tree.values():
            _leaves(x, into)
    else:
        into.append(tree)
    return into


def _dtype(tensors: list[torch.Tensor]) -> str:
    floating = next((t for t in tensors if t.is_floating_point()), None)
    return str((floating if floating is not None else tensors[0]).dtype).removeprefix("torch.") if tensors else "-"


class PhaseFlops:
    """FLOPs by phase of the step and by op (``by_phase[Phase][op name]``), and every kernel's work signature
    by phase (``work[Phase][(op, dtype, flops, bytes)]`` = how many times it ran).

    ``layers``: count only the phases of these layers (and every phase outside the layers); None: all."""

    def __init__(self, layers: Collection[int] | None = None) -> None:
        self.layers = None if layers is None else frozenset(layers)
        self.by_phase: dict[Phase, Counter[str]] = {}
        self.work: dict[Phase, Counter[tuple[str, str, int, int]]] = {}

    def count(self, phase: Phase, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """File one op that ran in ``phase`` (``StepTracker`` calls this after every op)."""
        if self.layers is not None and phase.part == "layer" and phase.layer not in self.layers:
            return
        if propagating() or moving():  # Note: [DTensor's shape propagation runs no kernel]; offload's copies are
            return  # priced over the host link (recompute.core.pricing.offload_seconds), not as kernels
        ins, outs = _leaves((args, kwargs), []), _leaves(out, [])
        if any(isinstance(t, DTensor) for t in ins) or any(isinstance(t, DTensor) for t in outs):
            args, kwargs, out = _local((args, kwargs, out))  # Note: [DTensor ops are local kernels]
            ins, outs = _leaves((args, kwargs), []), _leaves(out, [])
        name = op_name(func, kwargs)
        kind = _COLLECTIVES.get(name.split(".")[-1]) if "c10d" in name else None
        if kind is not None:
            self._file_comm(phase, kind, args, kwargs, out)
            return
        formula = _FORMULAS.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        if flops:
            self.by_phase.setdefault(phase, Counter())[name] += flops
        if not func.is_view and name not in _NO_KERNEL and not name.startswith("prim."):
            self._file(phase, name, flops, *_distinct(ins, outs))

    def _file_comm(self, phase: Phase, kind: str, args: Any, kwargs: Any, out: Any) -> None:
        inputs, outputs = tensors_of((args, kwargs), out)
        size = max((span(t) for t in inputs + outputs), default=0)
        group, n = _group(args, kwargs)
        name = comm_name(kind, group, n, replay=_replaying())
        self.work.setdefault(phase, Counter())[name, _dtype(inputs + outputs), 0, size] += 1

    def _file(
        self, phase: Phase, name: str, flops: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> None:
        tensors = outputs + inputs
        if not tensors or not (outputs or name.endswith("_")):  # metadata queries return no tensor
            return
        nbytes = sum(span(t) for t in tensors)
        self.work.setdefault(phase, Counter())[name, _dtype(tensors), flops, nbytes] += 1


def _local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's local tensor.

    Note: [DTensor ops are local kernels] an op on DTensors reaches this mode with the global shapes (the
    mode runs before DTensor's own dispatch, which then runs the local kernel out of the mode's sight): a
    row-parallel matmul would count t times its FLOPs. What the rank runs is the op on its local shards.
    """
    return tree_map_only(DTensor, lambda t: t.to_local() if isinstance(t, DTensor) else t, tree)


def _group(args: Any, kwargs: Any) -> tuple[str, int]:
    """(mesh dimension, ranks) of a collective's process group: by its name (functional collectives) or the
    group itself (the process group's own ops)."""
    for a in tree_leaves((args, kwargs)):
        pg: Any = None
        if isinstance(a, str):
            pg = resolve_process_group(a)
        elif hasattr(a, "size") and hasattr(a, "group_desc"):
            pg = a
        if pg is not None:
            desc = str(getattr(pg, "group_desc", "") or "")
            return (desc.removeprefix("mesh_") if desc.startswith("mesh_") else "world"), int(pg.size())
    return "world", dist.get_world_size() if dist.is_initialized() else 1


def _replaying() -> bool:
    """Whether the op runs inside non-reentrant checkpoint's recomputation (``recompute_fn`` on the stack)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "recompute_fn" and frame.f_code.co_filename.replace("\\", "/").endswith(
            "torch/utils/checkpoint.py"
        ):
            return True
        frame = frame.f_back
    return False
