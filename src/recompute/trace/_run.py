"""``trace(spec, workload, policy)``: the real PyTorch training step of a model, on fake tensors.

The model is built on the meta device, its parameters become ``FakeTensor``s, the policy is applied with
``recompute.apply``, and one steady-state step (forward, backward, AdamW step) runs under ``StepTracker``.
Nothing is allocated, so Llama-3.1-70B at s = 8192 traces on a laptop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from recompute.checkpointing import applied_policy, apply, find_layers
from recompute.core.errors import ConfigError, positive_int, require
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload
from recompute.models import model_class
from recompute.models.hf import hf_class_name
from recompute.models.loss import LossFn, lm_loss, loss_fn_for
from recompute.parallel import parallelize
from recompute.runtime import TORCH_DTYPES, random_batch, resolve_device
from recompute.trace._build import build_meta, fakeify
from recompute.trace._result import PartTrace, TraceResult, from_record, part_trace
from recompute.trace._scale import scale_record
from recompute.trace._step import StepRecord, prime_optimizer, record_saved, run_step

__all__ = ["trace", "trace_layer", "trace_module"]


def trace(
    spec: ModelSpec,
    wl: Workload,
    policy: Policy | str = "none",
    *,
    layers: int | None = None,
    hf: bool = False,
) -> TraceResult:
    """Trace one training step of ``spec`` under ``wl`` with ``policy``, allocating nothing.

    Args:
        spec: the model; recompute's reference model is traced, or Hugging Face's with ``hf=True``.
        wl: batch, sequence, dtype (parameters, gradients and AdamW state all in it), attention and device.
        policy: a policy name, a ``Policy``, or a plan file path.
        layers: trace this many layers (and one more) and scale to ``spec.n_layers`` (the layers are
            identical; the result says so). ``None`` traces every layer.
        hf: trace the ``transformers`` implementation of ``spec`` instead of recompute's.

    Raises:
        ConfigError: the sequence is longer than the model's positions, the policy does not fit the model,
            the model cannot be built, or CUDA is asked for without CUDA.
    """
    _check_traceable(spec, wl, hf)
    pol = Policy.parse(policy)
    per_layer = pol.per_layer(spec.n_layers)
    device = resolve_device(wl.device)
    start = time.perf_counter()
    if layers is None or layers >= spec.n_layers - 1:
        counts: tuple[int, ...] = (spec.n_layers,)
        record = _trace_layers(spec, wl, pol, spec.n_layers, device=device, hf=hf)
    else:
        positive_int("layers", layers)
        require(
            pol.is_uniform,
            f"layers {layers} scales identical layers, but the policy differs by layer ({pol.describe()}); "
            "drop layers to trace every layer",
            fields=("layers",),
        )
        counts = (layers, layers + 1)
        small, big = (_trace_layers(spec, wl, pol, n, device=device, hf=hf) for n in counts)
        record = scale_record(small, big, spec.n_layers)
    return from_record(
        record,
        model=spec.name,
        policy=pol.describe(),
        per_layer=per_layer,
        workload=_workload_dict(wl),
        traced=counts,
        notes=_notes(spec, wl, counts, hf),
        seconds=time.perf_counter() - start,
    )


def _check_traceable(spec: ModelSpec, wl: Workload, hf: bool) -> None:
    wl.check(spec)
    require(
        wl.pp == wl.dp == 1,
        "trace runs one tensor-parallel rank of one pipeline stage's model; drop pp and dp "
        "(recompute estimate models pipeline and data parallelism)",
        fields=("pp", "dp"),
    )
    require(
        wl.tp == 1 or not hf,
        f"tp {wl.tp} traces recompute's reference GPT/Llama (recompute.parallel); drop tp or use a preset",
        fields=("tp",),
    )


def _trace_layers(spec: ModelSpec, wl: Workload, pol: Policy, n: int, *, device: str, hf: bool) -> StepRecord:
    """One fake step of ``spec`` cut to ``n`` layers (of rank 0, with ``wl.tp`` > 1)."""
    with _fake_group(wl.tp):
        if wl.tp > 1:
            # Note: [DTensor's first call] the first time DTensor meets an op and its shardings it works out
            # the output by running the op on whole-size tensors, which the tracker would count as memory (2 GiB
            # in the head's backward of Llama 3.1 8B at t = 8). A one-layer step per policy fills that cache.
            for name in dict.fromkeys(pol.per_layer(n)):
                _step(spec, wl, Policy(name), 1, device=device, hf=hf)
        return _step(spec, wl, pol, n, device=device, hf=hf)


def _step(spec: ModelSpec, wl: Workload, pol: Policy, n: int, *, device: str, hf: bool) -> StepRecord:
    model, stack, mode = _fake_model(spec, wl, pol, n, device=device, hf=hf)
    with mode:
        optimizer = torch.optim.AdamW(model.parameters())
        prime_optimizer(model, optimizer)
        batch = random_batch(spec.vocab, wl.micro_batch, wl.seq_len, device=device)
        return run_step(model, batch, optimizer, stack, loss_fn=loss_fn_for(hf), keep_grads=wl.keep_grads)


@contextlib.contextmanager
def _fake_group(tp: int) -> Iterator[None]:
    """With ``tp`` > 1: a fake process group of ``tp`` ranks (this process is rank 0) for the trace's duration.

    PyTorch's testing ``FakeProcessGroup`` accepts every collective and moves no data, which is all a trace
    on fake tensors needs: the shapes (and so every byte) are those of a real rank.
    """
    if tp == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(
            "--tp traces one rank on a fake process group, but a process group is already running here; "
            "run recompute trace outside torchrun"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_model(
    spec: ModelSpec, wl: Workload, pol: Policy, n: int, *, device: str, hf: bool
) -> tuple[nn.Module, nn.ModuleList, FakeTensorMode]:
    """``spec`` cut to ``n`` layers, built with fake parameters, in training mode, with ``pol`` applied."""
    small = dataclasses.replace(spec, n_layers=n) if n != spec.n_layers else spec
    model = build_meta(small, attention=wl.attention, dtype=TORCH_DTYPES[wl.dtype], hf=hf)
    mode = FakeTensorMode()
    fakeify(model, mode, device)
    if wl.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (wl.tp,), mesh_dim_names=("tp",))  # outside the fake mode
        with mode:
            parallelize(model, mesh, sp=wl.sp)
    model.train()
    apply(model, pol)
    return model, find_layers(model), mode


def trace_layer(spec: ModelSpec, wl: Workload, policy: Policy | str = "none", *, hf: bool = False) -> PartTrace:
    """What one layer saves for the backward under a uniform ``policy``: a fake forward of two layers.

    The second layer is returned (the first also saves tensors the layers share, such as rotary tables).
    Faster than ``trace`` (no backward, no optimizer); the bytes are the same, the ops are not named.

    Raises:
        ConfigError: as ``trace``, and for a policy that is not the same in every layer.
    """
    _check_traceable(spec, wl, hf)
    pol = Policy.parse(policy)
    require(pol.is_uniform, f"trace_layer needs one policy for every layer, got {pol.describe()}")
    device = resolve_device(wl.device)
    with _fake_group(wl.tp):
        model, stack, mode = _fake_model(spec, wl, pol, 2, device=device, hf=hf)
        with mode:
            saved = record_saved(
                model,
                random_batch(spec.vocab, wl.micro_batch, wl.seq_len, device=device),
                stack,
                loss_fn=loss_fn_for(hf),
            )
    return part_trace("layer 1", [r for r in saved if r.layer == 1])


def trace_module(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn = lm_loss,
    name: str = "model",
    keep_grads: bool = False,
) -> TraceResult:
    """Trace one step of an existing module (real or fake tensors) with whatever policy it has applied.

    ``batch`` is (token ids, targets); ``loss_fn(model, idx, targets) -> (kept outputs, loss)``. Creates an
    AdamW optimizer when none is given, and primes it (see ``_step``'s note on the steady state).
    """
    stack = find_layers(model)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
        prime_optimizer(model, optimizer)
    start = time.perf_counter()
    record = run_step(model, batch, optimizer, stack, loss_fn=loss_fn, keep_grads=keep_grads)
    pol = applied_policy(model) or Policy("none")
    idx = batch[0]
    return from_record(
        record,
        model=name,
        policy=pol.describe(),
        per_layer=pol.per_layer(len(stack)),
        workload={"micro_batch": idx.size(0), "seq_len": idx.size(1), "device": idx.device.type},
        traced=(len(stack),),
        seconds=time.perf_counter() - start,
    )


def _workload_dict(wl: Workload) -> dict[str, Any]:
    keys = ("micro_batch", "seq_len", "dtype", "attention", "device", "tp", "sp", "keep_grads")
    return {k: getattr(wl, k) for k in keys}


def _class_name(spec: ModelSpec, hf: bool) -> str:
    return f"transformers.{hf_class_name(spec)}" if hf else f"recompute.models.{model_class(spec).__name__}"


def _notes(spec: ModelSpec, wl: Workload, counts: tuple[int, ...], hf: bool) -> tuple[str, ...]:
    notes = [
        f"traced {_class_name(spec, hf)} built from the {spec.name} spec on fake {wl.device} tensors: "
        "exact sizes, nothing allocated",
        "steady-state step: AdamW state exists, gradients "
        + ("stay allocated (zero_grad(set_to_none=False))" if wl.keep_grads else "start as None (zero_grad())")
        + f"; parameters, gradients and AdamW state in {wl.dtype}",
    ]
    if wl.tp > 1:
        notes.append(
            f"one rank of {wl.tp}-way tensor parallelism{' with sequence parallelism' if wl.sp else ''} "
            "(recompute.parallel on a fake process group): every figure is per rank"
        )
    if len(counts) == 2:
        notes.append(
            f"layers are identical: traced {counts[0]} and {counts[1]} layers and scaled every figure to "
            f"{spec.n_layers} (exact for identical layers)"
        )
    return tuple(notes)
