"""Run one steady-state training step (forward, backward, optimizer step) under ``StepTracker``.

Works the same on real and on fake tensors: under ``FakeTensorMode`` nothing is allocated and every figure is
exact, because MemTracker counts storages by their declared size.

Note: [steady state] The step measured is a step of a run already under way: the optimizer's state exists
(``prime_optimizer`` creates it before tracking) and the gradients were set to ``None`` after the previous
step, as ``optimizer.zero_grad()`` does by default (``keep_grads=True``: they stay allocated, as with
``zero_grad(set_to_none=False)`` or DDP/Megatron gradient buffers; the analytic estimate assumes this).
The logits stay alive until the optimizer step ends, as in a training loop that keeps ``logits, loss =
model(x, y)`` (recompute's ``train`` and ``bench`` loops, nanoGPT's): 0.244 GiB of a 2-layer Llama's bf16 logits
at s = 4096 (vocab 32000) that an H100 measured in the optimizer step of ``block`` beyond a trace that had
dropped them after the backward (issue 34).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from recompute._compat import saved_tensors_hooks
from recompute.core.allocator import AllocationStream
from recompute.models.loss import LossFn, lm_loss
from recompute.runtime import forward_autocast
from recompute.trace._cuda import BLOCK
from recompute.trace._flops import PhaseFlops
from recompute.trace._hf_path import real_step_path
from recompute.trace._tracker import Phase, SavedRecord, StepTracker

__all__ = ["StepRecord", "prime_optimizer", "record_saved", "run_step"]


@dataclass(frozen=True)
class StepRecord:
    """What ``StepTracker`` saw in one step (raw material of a ``TraceResult``)."""

    n_layers: int
    phase_peaks: dict[Phase, tuple[int, dict[str, int]]]
    """Largest total bytes of each phase and the breakdown by MemTracker category at that moment."""
    saved: tuple[SavedRecord, ...]
    """Every storage saved for the backward during the forward, by its first saver."""
    states: dict[str, int]
    """Bytes by MemTracker category right after the optimizer step (parameters, gradients, optimizer)."""
    layer_deltas: tuple[int, ...]
    """Bytes each layer's forward left allocated (what it stores plus its output, minus nothing freed)."""
    layer_starts: tuple[int, ...] = ()
    """Bytes allocated when each layer's first forward begins."""
    flops: dict[Phase, dict[str, int]] = field(default_factory=dict)
    """FLOPs of each phase by op (``run_step(..., flops=True)``; a layer's replay is in its backward phase)."""
    work: dict[Phase, dict[tuple[str, str, int, int], int]] = field(default_factory=dict)
    """Every kernel of each phase by work signature (op, dtype, FLOPs, bytes): how many ran (``flops=True``)."""
    host_peak: int = 0
    """The most host-memory bytes alive at once (``offload`` layers' copies; in no device figure)."""
    layer_grads: tuple[int, ...] = ()
    """Bytes of gradients the backward allocated for each layer's parameters (none with ``keep_grads``: they
    exist before the step)."""
    layer_left: tuple[int, ...] = ()
    """Bytes each layer's forward allocated that are still alive when the backward ends (``owners=True``),
    such as a key/value cache's entries."""
    layer_dropped: tuple[int, ...] = ()
    """Bytes each layer's forward allocated that were freed as the forward ended, before the backward began
    (``owners=True``): autocast's cast weights that nothing saved, a checkpointed layer's (Note: [the weight
    cache] in ``_autocast``); zeros without autocast."""
    phase_shared: dict[Phase, int] = field(default_factory=dict)
    """Bytes alive at each phase's peak of what the forward allocated before the first layer, which the layers
    share (position ids, masks, rotary tables; ``owners=True``)."""
    phase_fetched: dict[Phase, dict[int, int]] = field(default_factory=dict)
    """Bytes alive at each phase's peak of the device copies an ``offload`` layer's saved tensors came back in,
    by the layer that offloaded them (phases with none left out)."""
    allocations: AllocationStream | None = None
    """Every device allocation and free of the step in order, for the caching allocator's replay
    (``run_step(..., allocations=True)``)."""

    @property
    def peak(self) -> tuple[int, Phase]:
        """(bytes, phase) of the largest total of the step."""
        phase, (value, _) = max(self.phase_peaks.items(), key=lambda kv: (kv[1][0], [-x for x in kv[0].order()]))
        return value, phase


def prime_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state, as after a first step, and leave the gradients ``None``.

    Adam and AdamW get their state directly (what their lazy initialisation makes: a CPU step counter and
    two zero moments per parameter; a few ops instead of a whole step, which is most of a fake trace's
    time); any other optimizer takes one step on zero gradients.
    """
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not any(
        g.get("fused") or g.get("capturable") for g in optimizer.param_groups
    ):
        _init_adam(optimizer)
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _init_adam(optimizer: torch.optim.Optimizer) -> None:
    """Adam's ``_init_group`` state for every parameter (torch/optim/adam.py), with the step at 1."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or optimizer.state[p]:
                continue
            state = {
                "step": torch.tensor(1.0, dtype=scalar, device="cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def run_step(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    optimizer: torch.optim.Optimizer,
    layers: Iterable[nn.Module],
    *,
    loss_fn: LossFn = lm_loss,
    keep_grads: bool = False,
    flops: bool = False,
    step: bool = True,
    owners: bool = False,
    flop_layers: Collection[int] | None = None,
    cuda: bool = False,
    allocations: bool = False,
    autocast: torch.dtype | None = None,
) -> StepRecord:
    """Track one training step of ``model`` on ``batch`` (token ids, targets); the optimizer must be primed.

    ``keep_grads``: the gradients exist (as zeros) from the start, as with ``zero_grad(set_to_none=False)``
    or the persistent gradient buffers of DDP and Megatron; otherwise they start as ``None``. Leaves the
    gradients set to ``None`` afterwards. ``flops``: also count every op's FLOPs by phase (``PhaseFlops``).
    ``step``: run the optimizer step (without it the record has no optimizer phase and its ``states`` are
    those after the backward). ``owners``: record ``layer_left`` and ``phase_shared``.
    ``flop_layers``: count the ops of these layers only (and all outside the layers); None: all. ``cuda``:
    count as CUDA does a step traced on fake CPU tensors under CUDA's rules (``StepTracker(cuda=True)``).
    ``allocations``: record the step's allocation stream (``StepRecord.allocations``). ``autocast``: run the
    forward and the loss under ``torch.autocast`` to this dtype (``precision`` amp), the backward and the
    optimizer step outside it.
    """
    layers = list(layers)
    if keep_grads:
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    had = {id(p) for p in model.parameters() if p.grad is not None}
    tracker = StepTracker(layers, cuda=cuda)
    if owners:
        tracker.track_owners()
    if allocations:
        tracker.record_allocations()
    tracker.track_external(model, optimizer, *batch)
    deltas: dict[int, int] = {}
    starts: dict[int, int] = {}
    handles = _delta_hooks(tracker, layers, deltas, starts)
    counter = PhaseFlops(flop_layers) if flops else None
    tracker.counter = counter
    try:
        with tracker, real_step_path():
            tracker.set_stage("forward")
            with saved_tensors_hooks(tracker.pack, tracker.unpack):
                with forward_autocast(autocast, batch[0].device):
                    kept, loss = loss_fn(model, *batch)
                    ended = tracker.left_by_layer() if owners else ()
                dropped = tuple(a - b for a, b in zip(ended, tracker.left_by_layer())) if owners else ()
            tracker.set_stage("backward")
            loss.backward()
            left = tracker.left_by_layer()
            del loss
            grads = _new_grads(layers, had, cuda=cuda) if not keep_grads else (0,) * len(layers)
            if step:
                tracker.set_stage("optimizer")
                optimizer.step()
            del kept
            states = _merged_now(tracker)
            stream = tracker.allocation_stream()
    finally:
        for h in handles:
            h.remove()
    optimizer.zero_grad(set_to_none=True)
    return StepRecord(
        n_layers=len(layers),
        phase_peaks=dict(tracker.phase_peaks),
        saved=tuple(tracker.saved),
        states=states,
        layer_deltas=tuple(deltas.get(i, 0) for i in range(len(layers))),
        layer_starts=tuple(starts.get(i, 0) for i in range(len(layers))),
        flops={ph: dict(c) for ph, c in counter.by_phase.items()} if counter else {},
        work={ph: dict(c) for ph, c in counter.work.items()} if counter else {},
        host_peak=tracker.host_peak,
        layer_grads=grads,
        layer_left=left if owners else (),
        layer_dropped=dropped,
        phase_shared=dict(tracker.phase_shared),
        phase_fetched=dict(tracker.phase_fetched),
        allocations=stream,
    )


def _new_grads(layers: Sequence[nn.Module], had: set[int], *, cuda: bool = False) -> tuple[int, ...]:
    """Bytes of the gradients each layer's parameters got in the backward (that did not exist before it), each
    counted as the tracker counts it (``cuda``: in CUDA's 512-byte blocks, as a norm's small weight takes)."""
    block = BLOCK if cuda else 1
    return tuple(
        sum(
            -(-p.grad.untyped_storage().nbytes() // block) * block
            for p in layer.parameters()
            if p.grad is not None and id(p) not in had
        )
        for layer in layers
    )


def record_saved(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    layers: Iterable[nn.Module],
    *,
    loss_fn: LossFn = lm_loss,
    cuda: bool = False,
    autocast: torch.dtype | None = None,
) -> tuple[SavedRecord, ...]:
    """What the forward alone saves for the backward, by layer and component (no backward, no ops).

    The bytes are the same as ``run_step``'s (the forward decides what is saved); the saving op stays ``?``
    since it is named by the backward node that reads the tensor. ``cuda``, ``autocast``: as ``run_step``'s.
    """
    tracker = StepTracker(layers, cuda=cuda)
    tracker.track_external(model, *batch)
    with tracker, real_step_path():
        tracker.set_stage("forward")
        with saved_tensors_hooks(tracker.pack, tracker.unpack), forward_autocast(autocast, batch[0].device):
            kept, loss = loss_fn(model, *batch)
        saved = tuple(tracker.saved)  # before the graph goes: freeing it in the forward drops its records
        del kept, loss
    return saved


def _merged_now(tracker: StepTracker) -> dict[str, int]:
    out: dict[str, int] = {}
    for dev_snap in tracker.get_tracker_snapshot("current").values():
        for key, value in dev_snap.items():
            name = str(getattr(key, "value", key))
            out[name] = out.get(name, 0) + value
    return out


def _delta_hooks(
    tracker: StepTracker, layers: Sequence[nn.Module], deltas: dict[int, int], starts: dict[int, int]
) -> list[Any]:
    """Forward hooks that record the bytes allocated as each layer's first forward begins, and what it leaves."""
    handles = []
    for i, layer in enumerate(layers):

        def pre(_m: nn.Module, _args: Any, i: int = i) -> None:
            if tracker.stage == "forward" and i not in deltas:
                starts[i] = tracker.current_total()

        def post(_m: nn.Module, _args: Any, _out: Any, i: int = i) -> None:
            if tracker.stage == "forward" and i in starts and i not in deltas:
                deltas[i] = tracker.current_total() - starts[i]

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles
