"""The host's time per kernel of eager training steps (``recompute.core.timing.HostCost``), for ``calibrate``.

A bare launch (a one-element add in a loop) is not what a training step costs the host per kernel: an eager
step also runs Python, ``nn.Module`` calls and autograd's bookkeeping around each kernel, and a non-reentrant
checkpoint's replay goes through its saved-tensor hooks and re-entered forward as well. So the host is timed on
real steps of small models (``HOST_MODELS``: recompute's GPT and Llama, two layers of width 64, 32 tokens)
whose device work is negligible:

- ``kernel``: a step's wall time, less its optimizer step's, less its kernels' device time (predicted on the
  rates just calibrated; on a GPU the host runs ahead, so nothing is taken off), over the forward's and
  backward's kernels as the fake-tensor trace of the same step files them;
- ``optimizer``: the optimizer step alone, the same way, over its kernels;
- ``replay``: what the step with every layer checkpointed (``block``) takes beyond the plain step, less the
  device time of the kernels it adds, over the kernels it adds (``recompute.core.timing.replayed``).

Each time is the calibration timer's (best of three batches). The models' figures are pooled: total time over
total kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recompute.checkpointing import apply
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec
from recompute.core.timing import OPTIMIZER_PHASE, Device, HostCost, StepWork, kernels
from recompute.core.workload import Workload
from recompute.models.source import ModelSource, build_source
from recompute.runtime import TORCH_DTYPES, random_batch
from recompute.trace import cached_works

__all__ = ["HOST_MODELS", "HOST_SHAPE", "host_cost"]

HOST_MODELS = {
    "gpt": ("gpt2", {"hidden": 64, "n_layers": 2, "n_heads": 2, "vocab": 256, "max_positions": 64}),
    "llama": (
        "llama3.1-8b",
        {"hidden": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 224, "vocab": 256, "max_positions": 64},
    ),
}
"""The models the host is timed on: a preset and its overrides (Llama 3.1's MLP ratio and GQA, shrunk)."""

HOST_SHAPE = (1, 32)
"""(micro-batch, sequence) of the timed steps."""

Timer = Callable[[Callable[[], Any]], float]


@dataclass(frozen=True)
class _Times:
    """One model's measured seconds and its traced kernels: the plain step, its optimizer step alone, and the
    step with every layer checkpointed; the device time of each part on the calibrated rates."""

    step: float
    optimizer: float
    replayed_step: float
    kernels: int
    optimizer_kernels: int
    replayed: int
    device: float
    optimizer_device: float
    replay_device: float


def host_cost(device: Device, timer: Timer, *, models: tuple[str, ...] = ("gpt", "llama")) -> HostCost:
    """The host's time per kernel, per replayed kernel and per optimizer kernel on this machine's ``device``
    (its rates already calibrated: ``device.host`` is not read), from real steps of ``models``."""
    times = {name: _measure(name, device, timer) for name in models}
    ahead = device.asynchronous  # the host runs ahead of a GPU: its time is the step's, nothing to take off

    def per(spent: float, busy: float, count: int) -> float:
        return max(device.overhead, (spent - (0.0 if ahead else busy)) / max(count, 1))

    t = list(times.values())
    kernel = per(
        sum(x.step - x.optimizer for x in t),
        sum(x.device - x.optimizer_device for x in t),
        sum(x.kernels - x.optimizer_kernels for x in t),
    )
    optimizer = per(
        sum(x.optimizer for x in t), sum(x.optimizer_device for x in t), sum(x.optimizer_kernels for x in t)
    )
    replay = per(sum(x.replayed_step - x.step for x in t), sum(x.replay_device for x in t), sum(x.replayed for x in t))
    b, s = HOST_SHAPE
    parts = "; ".join(
        f"{name}: step {x.step * 1e3:.2f} ms for {x.kernels} kernels (optimizer {x.optimizer * 1e3:.2f} ms for "
        f"{x.optimizer_kernels}), every layer checkpointed {x.replayed_step * 1e3:.2f} ms for {x.replayed} more"
        for name, x in times.items()
    )
    return HostCost(kernel, replay, optimizer, source=f"eager training steps at b={b} s={s}, {parts}")


def _measure(name: str, device: Device, timer: Timer) -> _Times:
    preset, overrides = HOST_MODELS[name]
    spec = ModelSpec.from_name(preset, **overrides)
    kind = "cpu" if device.kind == "cpu" else "cuda"
    b, s = HOST_SHAPE
    wl = Workload(micro_batch=b, seq_len=s, dtype="fp32" if kind == "cpu" else "bf16", device=kind, keep_grads=False)
    works = cached_works(spec, wl, ["none", "block"])
    plain, replayed = _Step(spec, wl, "none"), _Step(spec, wl, "block")
    step, again = timer(plain), timer(replayed)
    plain.backward()  # gradients for the optimizer step timed alone
    optimizer = timer(plain.optimizer.step)
    none, block = works["none"], works["block"]
    opt = none.phases.get(OPTIMIZER_PHASE, ())
    return _Times(
        step=step,
        optimizer=optimizer,
        replayed_step=again,
        kernels=none.kernels(),
        optimizer_kernels=kernels(opt),
        replayed=sum(block.replayed(none).values()),
        device=_device_seconds(none, device),
        optimizer_device=sum(device.kernel(op) * op[4] for op in opt),
        replay_device=_device_seconds(block, device) - _device_seconds(none, device),
    )


def _device_seconds(work: StepWork, device: Device) -> float:
    return sum(device.kernel(op) * op[4] for ops in work.phases.values() for op in ops)


class _Step:
    """One eager training step of a model under a policy: forward, backward, optimizer step, gradients freed."""

    def __init__(self, spec: ModelSpec, wl: Workload, policy: str) -> None:
        torch.manual_seed(0)
        built = build_source(
            ModelSource.preset(spec), attention=wl.attention, dtype=TORCH_DTYPES[wl.dtype], device=wl.device
        )
        self.model = built.model.train()
        apply(self.model, Policy(policy))
        self.loss_fn = built.loss_fn
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len, device=wl.device, seed=0)

    def backward(self) -> None:
        _, loss = self.loss_fn(self.model, *self.batch)
        loss.backward()

    def __call__(self) -> None:
        self.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
