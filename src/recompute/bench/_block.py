"""One policy's block of ``bench``: its model and optimizer built from the seed, its steps, then released.

Only one block is alive at a time, so a bench holds one model, its AdamW state and one step's activations: what
the largest policy's step needs alone. Each block builds its model from the same seed (the same weights) and
draws the same batch, warms up, runs its timed steps back to back, then measures one step's memory (after a
step, so that AdamW's state exists, as the trace has it) and, where asked, counts one step's FLOPs. On CUDA the
caching allocator's cache is emptied once the model is built, so the block's ``max_memory_reserved`` is what its
steps reserve beside the model (as ``recompute trace`` replays it).

Note: [compiled blocks] With ``compiled`` the block's model is ``torch.compile``d after its policy is applied (the
whole model, or each layer on its own as torchtitan compiles), dynamo's caches emptied first so that no block
inherits another's graphs or hits its recompile limit, and ``activation_memory_budget`` set for the block's
duration (it is read as the graphs are partitioned, in the first warm-up step). A compiled step's buffers are
Inductor's, allocated by generated code that calls no op, so no dispatch mode (MemTracker) sees them: on the CPU
its memory step is measured by c10's allocator itself (``recompute.bench.allocator_peak``) on top of what the
block holds between steps (parameters, buffers, AdamW's state, the batch), and its saved bytes are read from the
compiled regions' autograd nodes (``saved_by_compiled``: under ``block`` the layers', not the eager head's and
embedding's). On CUDA the peak is ``max_memory_allocated`` over the step above what the block holds between steps,
counted the same way.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from recompute.bench._allocator import allocator_peak
from recompute.checkpointing import apply, find_layers
from recompute.core.errors import require
from recompute.core.policy import Policy
from recompute.core.workload import Workload
from recompute.models.loss import LossFn
from recompute.models.source import BuiltModel, ModelSource, build_source
from recompute.runtime import TORCH_DTYPES, autocast_dtype, forward_autocast, random_batch, sync
from recompute.trace import compiled_regions, flop_counter, saved_by_compiled, trace_module

__all__ = ["Measured", "run_block"]

Step = tuple[float, float, float]
"""(forward, backward, optimizer) seconds of one training step."""


@dataclass(frozen=True)
class Measured:
    """What one block measured of its policy's step."""

    policy: Policy
    loss: str
    times: tuple[Step, ...]
    """Each timed step, in order."""
    class_name: str
    """The class built (``BuiltModel.class_name``)."""
    notes: tuple[str, ...]
    """What differs from what was asked (``BuiltModel.notes``)."""
    about: dict[str, object]
    """The model as a result describes one without a spec: class, parameters, layers, vocabulary."""
    memory: tuple[int, int, int] = (0, 0, 0)
    """(device peak, traced peak, saved activation bytes) of the memory step; zeros when not measured."""
    flops: int = 0
    """FLOPs of a forward and backward (counted only when asked)."""
    reserved: int | None = None
    """``torch.cuda.max_memory_reserved`` over the block's steps (CUDA only)."""


@dataclass
class _Run:
    """A block's live objects: dropped with the block."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    batch: tuple[Tensor, Tensor]
    call: nn.Module
    """What the steps call: ``model``, or its ``torch.compile``d wrapper."""
    compiled: str | None = None


def run_block(
    source: ModelSource,
    wl: Workload,
    policy: Policy,
    *,
    seed: int,
    device: str,
    warmup: int,
    steps: int,
    tick: Callable[[str], None],
    measure: bool = True,
    count: bool = False,
    name: str = "",
    compiled: str | None = None,
    budget: float | None = None,
) -> Measured:
    """Build ``source`` under ``policy`` from ``seed`` on ``device``, run ``warmup`` steps, ``steps`` timed steps,
    one memory step (``measure``) and one FLOP-counted forward and backward (``count``), and release it.

    ``tick`` is called with a label before each step; ``name`` labels them (default: the policy). ``compiled``:
    ``model`` or ``block``, the model ``torch.compile``d (Note: [compiled blocks]) under ``budget``
    (``activation_memory_budget``; None: PyTorch's own).
    """
    if compiled is not None and count:
        raise ValueError("a compiled block's FLOPs are its trace's (FlopCounterMode misses Inductor's kernels)")
    with _compile_scope(compiled, budget):
        run, built = _build(source, wl, policy, seed, device, compiled)
        label = name or policy.describe()
        for i in range(warmup):
            tick(f"{label}: warm-up {i + 1}/{warmup}")
            _timed_step(run, device)
        times = []
        for i in range(steps):
            tick(f"{label}: step {i + 1}/{steps}")
            times.append(_timed_step(run, device))
        reserved = _reserved(device)
        memory, flops = (0, 0, 0), 0
        if measure:  # after a step: AdamW's state exists, as in every step but the first (and in the trace)
            tick(f"{label}: memory step")
            memory = _memory(run, device, wl.keep_grads)
        if count:
            tick(f"{label}: FLOP count")
            flops = _count_flops(run)
        if reserved is not None:
            reserved = max(reserved, _reserved(device) or 0)  # the memory step reset the peak: the larger of both
        about = _described(run.model, built)
        return Measured(policy, wl.loss, tuple(times), built.class_name, built.notes, about, memory, flops, reserved)


@contextlib.contextmanager
def _compile_scope(compiled: str | None, budget: float | None) -> Iterator[None]:
    """``torch._functorch.config.activation_memory_budget`` at ``budget`` inside (None: as it is), and as it was
    after, whatever set it inside (a plan's ``apply``); with ``compiled``, dynamo's caches emptied after (Note:
    [compiled blocks]). A PyTorch without the setting is left alone (``bench`` refuses a budget there)."""
    import torch._functorch.config as config

    try:
        if not hasattr(config, "activation_memory_budget"):
            yield
            return
        with config.patch(activation_memory_budget=config.activation_memory_budget if budget is None else budget):
            yield
    finally:
        if compiled is not None:
            torch.compiler.reset()  # no compiled entry outlives its block


def _build(
    source: ModelSource, wl: Workload, policy: Policy, seed: int, device: str, compiled: str | None = None
) -> tuple[_Run, BuiltModel]:
    """The block's model (the same weights for every block with this seed), optimizer and batch, compiled where
    asked (Note: [compiled blocks]); the previous block's objects collected first, and on CUDA the cache emptied
    after the build."""
    if compiled is not None:
        torch.compiler.reset()  # Note: [compiled blocks]
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(seed)
    built = build_source(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], device=device)
    model = built.model.train()
    apply(model, policy, loss=wl.loss, loss_chunk=wl.loss_chunk)
    batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len, device=device, seed=seed)
    if device == "cuda":  # the build's own temporaries (a config is built in fp32, then cast) are not the steps'
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loss_fn = _autocast_loss(built.loss_fn, autocast_dtype(wl), device)
    call = model
    if compiled == "block":  # each layer on its own, the rest eager, as torchtitan compiles
        stack = find_layers(model)
        for i, layer in enumerate(list(stack)):
            stack[i] = cast(nn.Module, torch.compile(layer))
    elif compiled is not None:
        call = cast(nn.Module, torch.compile(model))
    return _Run(model, torch.optim.AdamW(model.parameters()), loss_fn, batch, call, compiled), built


def _autocast_loss(loss_fn: LossFn, dtype: torch.dtype | None, device: str) -> LossFn:
    """``loss_fn`` with its forward and loss under autocast to ``dtype`` (``precision`` amp: what HF Trainer,
    Lightning and accelerate run), the backward and the optimizer step outside it; ``loss_fn`` for None."""
    if dtype is None:
        return loss_fn

    def autocast(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[Any, Tensor]:
        with forward_autocast(dtype, device):
            return loss_fn(model, idx, targets)

    return autocast


def _reserved(device: str) -> int | None:
    return int(torch.cuda.max_memory_reserved()) if device == "cuda" else None


def _timed_step(run: _Run, device: str) -> Step:
    """(forward, backward, optimizer) seconds of one training step."""
    sync(device)
    t0 = time.perf_counter()
    _, loss = run.loss_fn(run.call, *run.batch)
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    t2 = time.perf_counter()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    sync(device)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _count_flops(run: _Run) -> int:
    """FLOPs of one forward and backward of ``run`` (recomputation included); no optimizer step.

    A step of its own: under ``FlopCounterMode`` the memory step's peak grew (module hooks keep tensors alive).
    """
    with flop_counter() as counter:  # FlopCounterMode that takes grouped-query attention on every torch
        _, loss = run.loss_fn(run.call, *run.batch)
        loss.backward()
    run.model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def _memory(run: _Run, device: str, keep_grads: bool = False) -> tuple[int, int, int]:
    """(device peak, traced peak, saved activation bytes) of one step of ``run``; a compiled one's traced peak is
    0 (no dispatch mode sees its buffers: Note: [compiled blocks])."""
    if run.compiled is not None:
        return _compiled_memory(run, device)
    traced = trace_module(run.model, run.batch, optimizer=run.optimizer, loss_fn=run.loss_fn, keep_grads=keep_grads)
    if device != "cuda":
        return traced.peak, traced.peak, traced.activations
    own = _resident_bytes(run)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _timed_step(run, device)
    peak = own + torch.cuda.max_memory_allocated() - base  # the step's peak over what it found, plus the model
    return peak, traced.peak, traced.activations


def _compiled_memory(run: _Run, device: str) -> tuple[int, int, int]:
    """(device peak, 0, saved bytes) of one compiled step of ``run`` (Note: [compiled blocks]): the bytes its
    compiled regions save, read from a forward's autograd graph (then run through its backward, the gradients
    dropped), and the peak of the next whole step over what the block holds between steps."""
    weights = [*run.model.parameters(), *run.model.buffers(), *run.batch]
    out, loss = run.loss_fn(run.call, *run.batch)
    want = len(find_layers(run.model)) if run.compiled == "block" else 1
    found = compiled_regions(loss)
    require(
        found >= want,
        f"{found} of the step's {want} compiled regions ran compiled: dynamo ran the rest eagerly (a graph break, "
        "or its recompile limit), and the figures would mix eager and compiled code; bench the whole model "
        "(compiled 'model') or raise dynamo's recompile limit (torch._dynamo.config.recompile_limit)",
    )
    saved = saved_by_compiled(loss, exclude=weights)
    loss.backward()
    del out, loss
    run.optimizer.zero_grad(set_to_none=True)
    held = _resident_bytes(run, everything=True)  # what the trace's prediction counts as held (compiled_peak)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _timed_step(run, device)
        return held + torch.cuda.max_memory_allocated() - base, 0, saved
    return held + allocator_peak(lambda: _timed_step(run, device)).peak, 0, saved


def _resident_bytes(run: _Run, *, everything: bool = False) -> int:
    """Bytes of ``run``'s parameters and optimizer state (what it holds between steps) on CUDA; ``everything``:
    with its buffers and batch too, on whichever device it runs."""
    tensors = list(run.model.parameters()) + [
        v for state in run.optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
    ]
    if everything:
        tensors += [*run.model.buffers(), *run.batch]
    device = run.batch[0].device.type if everything else "cuda"
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == device
    }
    return sum(storages.values())


def _described(model: nn.Module, built: BuiltModel) -> dict[str, object]:
    """What the result says of a model that has no spec: its class, parameter count, layers and vocabulary."""
    return {
        "class": built.class_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "n_layers": len(find_layers(model)),
        "vocab": built.vocab,
    }
