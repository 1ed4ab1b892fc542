"""The host's time per kernel of eager training steps (``recompute.core.timing.HostCost``), for ``calibrate``.

A bare launch (a one-element add in a loop) is not what a training step costs the host per kernel: an eager
step also runs Python, ``nn.Module`` calls and autograd's bookkeeping around each kernel, and a non-reentrant
checkpoint's replay goes through its saved-tensor hooks and re-entered forward as well. So the host is timed on
real steps of small models (``HOST_MODELS``: recompute's GPT and Llama, four layers of width 64, 32 tokens)
whose device work is negligible:

- ``kernel``: a step's forward and backward (a step less an optimizer step), less their kernels' device time
  (predicted on the rates just calibrated; on a GPU the host runs ahead, so nothing is taken off), over their
  kernels as the fake-tensor trace of the same step files them;
- ``optimizer``: the optimizer step, the same way, over its kernels;
- ``replay``: what the step with every layer checkpointed (``block``) takes beyond the plain step, less the
  device time of the kernels it adds, over the kernels it adds (``recompute.core.timing.replayed``).

Under torchrun (``calibrate --collectives``) the same models, split over the t ranks (``parallel_models``:
2t query heads, t key/value heads), are timed as whole tensor-parallel steps, with and without sequence
parallelism (``time_parallel_steps``), and ``parallel_host_cost`` fits the two costs a tensor-parallel step adds
on this host to what the time model already prices (the kernels at the host costs above, the collectives on
the curves just measured): ``parallel`` per kernel (DTensor's sharding propagation and redistribution in
Python) and ``collective`` per collective (its launch and wait beyond the transfer, the ranks arriving apart),
least squares over the four steps, neither below 0. Sequence parallelism adds collectives to the same kernels,
which is what tells the two apart.

The steps run in interleaved rounds (a batch of plain steps, a batch of checkpointed ones, a batch of optimizer
steps alone), each batch long enough to span the scheduler's time slices, and each time is the best batch's
over the rounds, as the rates are (``recompute.bench.calibrate``: the best of three batches): the host's time
and the device's are then measured alike, so a step's prediction, and a replay's share of it, are too. The
models' figures are pooled: their time over their kernels.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from recompute.checkpointing import apply
from recompute.core.comms import parse_comm
from recompute.core.errors import require
from recompute.core.policy import Policy
from recompute.core.pricing import Job, step_time
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec
from recompute.core.timing import OPTIMIZER_PHASE, Device, HostCost, StepWork, kernels
from recompute.core.workload import Workload
from recompute.models.source import ModelSource, build_source
from recompute.parallel import parallelize
from recompute.runtime import TORCH_DTYPES, random_batch, sync
from recompute.trace import cached_works

__all__ = [
    "HOST_MODELS",
    "HOST_SHAPE",
    "host_cost",
    "parallel_host_cost",
    "parallel_models",
    "splits",
    "time_parallel_steps",
]

HOST_MODELS = {
    "gpt": ("gpt2", {"hidden": 64, "n_layers": 4, "n_heads": 2, "vocab": 256, "max_positions": 64}),
    "llama": (
        "llama3.1-8b",
        {"hidden": 64, "n_layers": 4, "n_heads": 2, "n_kv_heads": 1, "d_ff": 224, "vocab": 256, "max_positions": 64},
    ),
}
"""The models the host is timed on: a preset and its overrides (Llama 3.1's MLP ratio and GQA, shrunk)."""

HOST_SHAPE = (1, 32)
"""(micro-batch, sequence) of the timed steps."""


def host_cost(device: Device, *, models: tuple[str, ...] = ("gpt", "llama"), seconds: float = 2.0) -> HostCost:
    """The host's time per kernel, per replayed kernel and per optimizer kernel on this machine's ``device``
    (its rates already calibrated: ``device.host`` is not read), from real steps of ``models``, about
    ``seconds`` of steps for each."""
    times = {name: _measure(name, device, seconds) for name in models}
    ahead = device.asynchronous  # the host runs ahead of a GPU: its time is the step's, nothing to take off

    def per(spent: float, busy: float, count: int) -> float:
        return max(device.overhead, (spent - (0.0 if ahead else busy)) / max(count, 1))

    t = list(times.values())
    kernel = per(sum(x.passes for x in t), sum(x.passes_device for x in t), sum(x.pass_kernels for x in t))
    optimizer = per(
        sum(x.optimizer for x in t), sum(x.optimizer_device for x in t), sum(x.optimizer_kernels for x in t)
    )
    replay = per(sum(x.replay for x in t), sum(x.replay_device for x in t), sum(x.replayed for x in t))
    b, s = HOST_SHAPE
    parts = "; ".join(
        f"{name}: forward and backward {x.passes * 1e3:.2f} ms for {x.pass_kernels} kernels, optimizer step "
        f"{x.optimizer * 1e3:.2f} ms for {x.optimizer_kernels}, every layer checkpointed +{x.replay * 1e3:.2f} ms "
        f"for {x.replayed} more ({x.rounds} rounds)"
        for name, x in times.items()
    )
    return HostCost(kernel, replay, optimizer, source=f"eager training steps at b={b} s={s}, best batches; {parts}")


@dataclass(frozen=True)
class _Times:
    """One model's best batches over interleaved rounds (of plain steps, of steps with every layer checkpointed,
    of optimizer steps alone): the plain step's forward and backward, its optimizer step, and what the
    checkpointed step takes beyond it; the traced kernels of each, and their device time on the calibrated
    rates."""

    passes: float
    optimizer: float
    replay: float
    pass_kernels: int
    optimizer_kernels: int
    replayed: int
    passes_device: float
    optimizer_device: float
    replay_device: float
    rounds: int


def _workload(kind: str, **parallel: int | bool) -> Workload:
    """The timed steps' workload on a ``kind`` device (fp32 on a CPU, bf16 on a GPU)."""
    kind = "cpu" if kind == "cpu" else "cuda"
    b, s = HOST_SHAPE
    dtype = "fp32" if kind == "cpu" else "bf16"
    return Workload(micro_batch=b, seq_len=s, dtype=dtype, device=kind, keep_grads=False, **parallel)  # type: ignore[arg-type]


def splits(tp: int) -> bool:
    """Whether the host models split over ``tp`` ranks: t divides their sequence, vocabulary and MLP width (32,
    256 and 224: t a power of two up to 32)."""
    return tp > 1 and all(n % tp == 0 for n in (HOST_SHAPE[1], 256, 224))


def parallel_models(tp: int) -> dict[str, ModelSpec]:
    """``HOST_MODELS`` with heads that split over ``tp`` ranks: 2t query heads, t key/value heads (Llama)."""
    out = {}
    for name, (preset, overrides) in HOST_MODELS.items():
        heads = {"n_heads": 2 * tp} | ({"n_kv_heads": tp} if "n_kv_heads" in overrides else {})
        out[name] = ModelSpec.from_name(preset, **{**overrides, **heads})
    return out


def time_parallel_steps(
    mesh: DeviceMesh, *, seconds: float = 2.0, progress: Progress = no_progress
) -> dict[str, float]:
    """Seconds of one whole training step (forward, backward, AdamW) of each ``parallel_models`` model split over
    ``mesh`` (1-D, tensor-parallel), without and with sequence parallelism (keys ``"gpt TP"``, ``"gpt TP+SP"``,
    ...): every rank calls it; the best batch of interleaved rounds (each batch after a barrier, about
    ``seconds`` of rounds per model), the slowest rank's."""
    tp = mesh.size()
    out: dict[str, float] = {}
    for i, (name, spec) in enumerate(parallel_models(tp).items()):
        progress(f"tensor-parallel steps of {name}", i, len(HOST_MODELS))
        wl = _workload(mesh.device_type)
        steps = {f"{name} {'TP+SP' if sp else 'TP'}": _Step(spec, wl, "none", mesh=mesh, sp=sp) for sp in (False, True)}
        for step in steps.values():  # warm-up
            for _ in range(3):
                step()
        once = torch.tensor([_batch(next(iter(steps.values())), 1)], device=mesh.device_type)
        dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank runs as many steps (each one has collectives)
        n = max(1, round(seconds / 10 / max(float(once.item()), 1e-6)))  # a tenth: 5 rounds of 2 batches
        best = dict.fromkeys(steps, float("inf"))
        for _ in range(5):
            for key, step in steps.items():
                dist.barrier()
                best[key] = min(best[key], _batch(step, n))
        out.update(best)
    progress("tensor-parallel steps", len(HOST_MODELS), len(HOST_MODELS))
    slowest = torch.tensor(list(out.values()), dtype=torch.float64, device=mesh.device_type)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(out, slowest.tolist(), strict=True))


def parallel_host_cost(device: Device, steps: Mapping[str, float], tp: int) -> HostCost:
    """``device.host`` with ``parallel`` and ``collective`` fitted to ``steps`` (``time_parallel_steps`` on ``tp``
    ranks): what each measured step takes beyond its prediction (its kernels at the host costs, its collectives on
    ``device``'s network), as a cost per kernel and per collective, least squares, neither below 0. Call it once
    the process group has ended (the trace starts a fake one).

    Raises:
        ConfigError: ``device`` has no host costs (calibrate it first) or ``steps`` misses a model.
    """
    require(device.host is not None, "the device profile has no host costs: calibrate it again without --collectives")
    assert device.host is not None
    plain = dataclasses.replace(device, host=dataclasses.replace(device.host, parallel=0.0, collective=0.0))
    rows = []
    for name, spec in parallel_models(tp).items():
        for sp in (False, True):
            key = f"{name} {'TP+SP' if sp else 'TP'}"
            require(key in steps, f"no timed step for {key}")
            wl = _workload(device.kind, tp=tp, sp=sp)
            work = cached_works(spec, wl, ["none"])["none"]
            predicted = step_time(work, plain, Job.of(spec, wl)).step
            collectives = sum(op[4] for ops in work.phases.values() for op in ops if parse_comm(op[0]))
            count = sum(kernels(ops) for ops in work.phases.values())
            rows.append((key, steps[key], predicted, count, collectives))
    parallel, collective = _fit_two([(r[1] - r[2], r[3], r[4]) for r in rows])
    parts = "; ".join(
        f"{k}: {m * 1e3:.2f} ms measured, {p * 1e3:.2f} ms priced, {n} kernels, {c} collectives"
        for k, m, p, n, c in rows
    )
    eager = device.host.source.split(_PARALLEL_SOURCE)[0]  # a profile measured again: its eager steps alone
    source = f"{eager}{_PARALLEL_SOURCE}{tp} ranks at b={HOST_SHAPE[0]} s={HOST_SHAPE[1]}: {parts}"
    return dataclasses.replace(device.host, parallel=parallel, collective=collective, source=source)


_PARALLEL_SOURCE = "; tensor-parallel steps on "


def _fit_two(rows: list[tuple[float, int, int]]) -> tuple[float, float]:
    """(a, b) >= 0 minimising the sum of (r - a x - b y)^2 over rows (r, x, y): the unconstrained solution, else
    the better of a alone and b alone."""
    sxx = sum(x * x for _, x, _ in rows)
    syy = sum(y * y for _, _, y in rows)
    sxy = sum(x * y for _, x, y in rows)
    sxr = sum(x * r for r, x, _ in rows)
    syr = sum(y * r for r, _, y in rows)
    det = sxx * syy - sxy * sxy
    if det > 0:
        a, b = (sxr * syy - syr * sxy) / det, (syr * sxx - sxr * sxy) / det
        if a >= 0 and b >= 0:
            return a, b
    candidates = [(max(0.0, sxr / sxx) if sxx else 0.0, 0.0), (0.0, max(0.0, syr / syy) if syy else 0.0)]
    return min(candidates, key=lambda ab: sum((r - ab[0] * x - ab[1] * y) ** 2 for r, x, y in rows))


def _measure(name: str, device: Device, seconds: float) -> _Times:
    preset, overrides = HOST_MODELS[name]
    spec = ModelSpec.from_name(preset, **overrides)
    wl = _workload(device.kind)
    works = cached_works(spec, wl, ["none", "block"])
    plain, checkpointed = _Step(spec, wl, "none"), _Step(spec, wl, "block")
    for _ in range(3):  # warm-up: the allocator's blocks, the optimizer's state, lazy initialisations
        plain()
        checkpointed()
    n = max(1, round(seconds / 20 / max(_batch(plain, 1), 1e-6)))  # steps per batch: a twentieth of the time
    rounds: list[tuple[float, float, float]] = []
    start = time.perf_counter()
    while len(rounds) < 3 or time.perf_counter() - start < seconds:
        batches = _batch(plain, n), _batch(checkpointed, n)
        plain.backward()  # gradients for optimizer steps alone
        rounds.append((*batches, _batch(plain.optimizer.step, n, wait=plain.device)))
        plain.optimizer.zero_grad(set_to_none=True)
    step, again, optimizer = (min(r[i] for r in rounds) for i in range(3))
    none, block = works["none"], works["block"]
    opt = StepWork({OPTIMIZER_PHASE: none.phases.get(OPTIMIZER_PHASE, ())}, 0)
    return _Times(
        passes=step - optimizer,
        optimizer=optimizer,
        replay=again - step,
        pass_kernels=none.kernels() - opt.kernels(),
        optimizer_kernels=opt.kernels(),
        replayed=sum(block.replayed(none).values()),
        passes_device=_device_seconds(none, device) - _device_seconds(opt, device),
        optimizer_device=_device_seconds(opt, device),
        replay_device=_device_seconds(block, device) - _device_seconds(none, device),
        rounds=len(rounds),
    )


def _batch(fn: Callable[[], object], n: int, *, wait: str | None = None) -> float:
    """Mean seconds of ``n`` calls of ``fn`` in a row, the device waited for at the end (on a GPU the host runs
    ahead: a batch's wall time is the host's)."""
    device = wait or str(getattr(fn, "device", "cpu"))
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


def _device_seconds(work: StepWork, device: Device) -> float:
    return sum(device.kernel(op) * op[4] for ops in work.phases.values() for op in ops)


class _Step:
    """One eager training step of a model under a policy: forward, backward, optimizer step, gradients freed."""

    def __init__(
        self, spec: ModelSpec, wl: Workload, policy: str, *, mesh: DeviceMesh | None = None, sp: bool = False
    ) -> None:
        torch.manual_seed(0)
        built = build_source(
            ModelSource.preset(spec), attention=wl.attention, dtype=TORCH_DTYPES[wl.dtype], device=wl.device
        )
        self.model = built.model.train()
        if mesh is not None:
            parallelize(self.model, mesh, sp=sp)
        apply(self.model, Policy(policy))
        self.loss_fn = built.loss_fn
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len, device=wl.device, seed=0)
        self.device = wl.device

    def backward(self) -> None:
        _, loss = self.loss_fn(self.model, *self.batch)
        loss.backward()

    def __call__(self) -> None:
        self.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
