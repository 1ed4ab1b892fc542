"""Pricing: which device a step is priced on, and what each part of a step costs there. Torch-free.

Every command that shows a time (estimate, plan, report, bench) chooses its device here and prices with the
functions here: a step's time from the traced work of one rank (``recompute.core.timing``'s roofline for its
kernels, ``recompute.core.comms`` for its collectives), laid out on the job's schedule (pipeline bubble,
micro-batches, data-parallel reduction); a recompute policy's seconds per layer from the uniform policies'
step works; an offloaded layer's exposed copy time; measured step times from a ``recompute bench`` result; and
the reason when a workload gets no time.

Note: [the step's time] One rank's step, for ``m`` micro-batches on ``p`` pipeline stages of ``v`` chunks each:

    step = (m + (p - 1)/v) * (compute + tp + p2p) + optimizer + dp

- compute: one micro-batch's kernels on the slowest stage (its ceil(L/p) layers, and the embedding or the
  head and loss, whichever costs more), replays included; on a tensor-parallel rank every kernel also costs the
  host DTensor's work around it (``HostCost.parallel``, where ``calibrate --collectives`` measured it);
- tp: its tensor- and sequence-parallel collectives on the critical path: every one of the forward and of a
  replay (Megatron runs them in line), and of the backward what the weight-gradient matmuls do not hide
  (Megatron overlaps each input-gradient collective with a weight-gradient matmul; Korthikanti et al. 2022,
  Sec. 6.2): per phase, max(0, backward collectives - half the phase's weight matmul time under ``none``);
  on a CPU none is hidden (gloo's collectives copy and reduce on the cores that compute);
  each collective its transfer on the network's curves plus what one costs in a real step beyond it
  (``HostCost.collective``: launch, wait, the ranks arriving apart; where measured);
- p2p: the activations a micro-batch sends to the next stage in the forward and its gradient back, once per
  chunk boundary (v of them per stage), in line: b s h / t per rank (Megatron's scatter/gather optimisation, an
  all-gather over the tensor-parallel group on arrival without sequence parallelism);
- (p - 1)/v: the pipeline bubble of the (interleaved) 1F1B schedule, in micro-batch times (Narayanan et al.
  2021);
- optimizer: the optimizer step's kernels, the stage's share (ceil(L/p)/L) of the whole model's;
- dp: the data-parallel gradient reduction (all-reduce; reduce-scatter and then the parameters' all-gather
  for the distributed optimizer) of the stage's parameters, overlapped with one micro-batch's backward (the
  gather with its forward), one layer's share always exposed (the last bucket); none with d = 1.

tokens/s = m b s d / step. A policy's time overhead is the step's over the step under ``none``.

Over 400 lines because it is the one pricing module (issue 23): device choice, a step's time with its collectives,
pipeline schedule and data-parallel reduction, offload over the host link; every command prices through it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recompute.core.analytic.params import bytes_per_param, stage_params
from recompute.core.analytic.sharding import gathered_bytes
from recompute.core.comms import Layout, Network, comm_name, parse_comm
from recompute.core.costs import CostTable
from recompute.core.errors import positive_int, require
from recompute.core.hardware import GPUS, datasheet_device, datasheet_network, gpu_by_name
from recompute.core.policy import POLICIES
from recompute.core.results import read_bench
from recompute.core.spec import ModelSpec
from recompute.core.timing import Device, Op, StepWork, Timing, op_class, replayed
from recompute.core.workload import Workload

if TYPE_CHECKING:
    from recompute.core.profile import Profile

__all__ = [
    "DEFAULT_GPU",
    "DEFAULT_GPUS_PER_NODE",
    "Job",
    "StepTime",
    "choose_device",
    "communicates",
    "host_link",
    "layer_costs",
    "measured_costs",
    "network_notes",
    "network_of",
    "offload_layer_seconds",
    "offload_seconds",
    "phase_seconds",
    "profile_offload_seconds",
    "scheduled_profile_table",
    "step_time",
    "timing",
    "timings",
    "unpriced",
    "unpriced_offload",
    "with_expert_parallelism",
    "with_network",
]

DEFAULT_GPU = "h100-80gb"
"""The device times are predicted on when none is named: the datasheet row of an H100 SXM."""

DEFAULT_GPUS_PER_NODE = 8
"""GPUs per node when not given (``--gpus-per-node``): a DGX/HGX node's eight."""

_NO_COLLECTIVES = (
    "the device profile has no collectives measured: communication priced on the {gpu} datasheet's links "
    "({intra}; {inter}); measure them with `torchrun --nproc-per-node N -m recompute calibrate --collectives -o "
    "{path}`"
)


def choose_device(
    *,
    gpu: str | None = None,
    device_profile: str | Path | None = None,
    gpus_per_node: int | None = None,
    compiled: bool = False,
) -> Device:
    """The device of a ``recompute calibrate`` file, else ``gpu``'s datasheet row, else the default GPU's, with
    its network (``with_network``); ``compiled``: priced as run under ``torch.compile`` or CUDA graphs (no eager
    host dispatch).

    Raises:
        ConfigError: a missing or unreadable device profile, an unknown GPU, or gpus_per_node < 1.
    """
    if device_profile:
        measured = Device.load(device_profile)
        require(
            gpu is None or measured.name not in GPUS or gpu_by_name(gpu).name == measured.name,
            f"gpu {gpu} and device_profile {str(device_profile)!r} (measured on {measured.label}) name two devices; "
            "give one of them",
            fields=("gpu", "device_profile"),
        )
        device = with_network(measured, gpu=gpu, gpus_per_node=gpus_per_node, path=device_profile)
    else:
        device = with_network(datasheet_device(gpu or DEFAULT_GPU), gpu=gpu, gpus_per_node=gpus_per_node)
    return dataclasses.replace(device, compiled=True) if compiled else device


CPU_IN_FLOPS = (
    "a CPU step (device cpu) is planned in FLOPs, not on a GPU's times (nor with offload, which moves tensors to "
    "the host it already runs on); to plan it on time, calibrate this CPU (recompute calibrate --device cpu -o "
    "cpu.json) and pass that file as device_profile"
)
"""Why a CPU workload's plan is priced in FLOPs without a CPU's device profile (issue 36: it was priced on an
H100's datasheet row and offered offload)."""


def priced_on(wl: Workload, device: Device | None, *, asked: bool) -> tuple[Device | None, tuple[str, ...]]:
    """The device a plan of ``wl`` is priced on, and what to say of it: ``device``, or None (FLOPs) where ``wl``
    runs on the CPU and ``device`` is the default GPU's row (not ``asked`` for: no gpu, no device profile)."""
    if device is not None and wl.device == "cpu" and device.kind != "cpu" and not asked:
        return None, (CPU_IN_FLOPS,)
    return device, ()


def with_network(
    device: Device,
    *,
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    path: str | Path = "device.json",
) -> Device:
    """``device`` with its network (``Device.network``): ``gpu``'s (or the default) row's links, ``gpus_per_node``
    and the GPUs sharing a host link, and the collectives a calibrated profile measured. A calibrated profile
    without collectives takes the row's links and says so in a note.

    Raises:
        ConfigError: an unknown GPU, or gpus_per_node < 1.
    """
    g = positive_int("gpus_per_node", DEFAULT_GPUS_PER_NODE if gpus_per_node is None else gpus_per_node, at_most=2**16)
    row = gpu_by_name(gpu or (device.name if device.name in GPUS else DEFAULT_GPU))
    calibrated = not device.source.startswith("datasheet")
    measured = dict(device.network) if calibrated else {}
    notes = list(measured.get("notes", []))
    if calibrated and not measured.get("collectives"):
        notes.append(_NO_COLLECTIVES.format(gpu=row.name, intra=row.intra.name, inter=row.inter.name, path=path))
    network = {
        **measured,
        **datasheet_network(row, g).to_dict(),
        "collectives": measured.get("collectives", {}),
        "ranks": measured.get("ranks", 0),
        "backend": measured.get("backend", ""),
        "notes": notes,
        "gpus_per_host_link": row.gpus_per_host_link,
    }
    return dataclasses.replace(device, network=network)


def network_of(device: Device) -> Network:
    """The device's network (``choose_device`` fills it), else the default GPU row's links."""
    if "intra" in device.network:
        return Network.from_dict(device.network)
    return datasheet_network(DEFAULT_GPU if device.name not in GPUS else device.name)


def communicates(wl: Workload) -> bool:
    """Whether a step of ``wl`` talks to other GPUs (tensor, pipeline, data or expert parallelism)."""
    return wl.tp > 1 or wl.pp > 1 or wl.dp > 1 or wl.ep > 1


def network_notes(device: Device, wl: Workload) -> list[str]:
    """What the output says about communication: the links it is priced on (and a profile's missing
    collectives), for a workload that communicates; nothing otherwise.

    Raises:
        ConfigError: a layout whose groups do not tile the device's gpus_per_node.
    """
    if not communicates(wl):
        return []
    net = network_of(device)
    Layout(wl.tp, wl.dp, wl.pp, wl.ep, net.gpus_per_node).check()
    if net.measured:
        where = f"collectives measured on {net.ranks} ranks ({net.backend}) within a node"
    else:
        where = f"{net.intra.name} ({net.intra.achieved / 1e9:.0f} GB/s bus bandwidth)"
    line = (
        f"communication: {where}; across nodes {net.inter.name}; {net.gpus_per_node} GPUs per node "
        "(docs/time.md: what is overlapped and what is ignored)"
    )
    return [*net.notes, line]


def unpriced(wl: Workload, *, preset: bool = True) -> str | None:
    """Why a workload gets no predicted time, or None: every workload the analytic model accepts is priced
    (tensor, sequence, pipeline, data and expert parallelism), but tensor parallelism of a model that is not a
    preset: its step is traced from transformers' class, on one device."""
    if not preset and wl.tp > 1:
        return (
            "tensor parallelism of transformers' class (its step is traced on one device; recompute.parallel "
            "splits recompute's GPT and Llama)"
        )
    return None


@dataclass(frozen=True)
class Job:
    """What pricing a step needs besides its kernels: the workload (parallelism, micro-batches), the model's
    layers, the parameters one rank reduces over data parallelism and the bytes a pipeline boundary sends."""

    wl: Workload = field(default_factory=Workload)
    n_layers: int = 1
    params: int = 0
    """Parameters on one rank's pipeline stage (the data-parallel reduction's size)."""
    boundary: float = 0.0
    """Bytes one rank sends of a micro-batch's activations at a pipeline-stage boundary: b s h / t in the
    activation dtype (with sequence parallelism its shard; without, Megatron's scatter/gather optimisation sends
    1/t from each rank and all-gathers it on the next stage, Narayanan et al. 2021 Sec. 4.1)."""

    @classmethod
    def of(cls, spec: ModelSpec, wl: Workload) -> Job:
        """A preset's (or any ``ModelSpec``'s) job under ``wl``."""
        boundary = wl.micro_batch * wl.seq_len * spec.hidden * wl.element_bytes / wl.tp
        return cls(wl, spec.n_layers, stage_params(spec, wl), boundary)

    @property
    def tokens(self) -> int:
        """Tokens of the step: m micro-batches of b s on each of d data-parallel replicas (each expert-parallel rank
        trains on its own batch: at least ep of them)."""
        return self.wl.microbatches * self.wl.tokens * max(self.wl.dp, self.wl.ep)

    @property
    def layout(self) -> Layout:
        wl = self.wl
        return Layout(wl.tp, wl.dp, wl.pp, wl.ep)

    @property
    def stage_layers(self) -> int:
        return -(-self.n_layers // self.wl.pp)

    @property
    def bubble(self) -> float:
        """(p - 1)/v: idle micro-batch times of the (interleaved) 1F1B schedule."""
        return (self.wl.pp - 1) / self.wl.interleave

    @property
    def schedule(self) -> float:
        """m + (p - 1)/v: micro-batch times the step lasts."""
        return self.wl.microbatches + self.bubble


@dataclass(frozen=True)
class StepTime:
    """One rank's step, part by part (Note: [the step's time] in this module)."""

    compute: float
    """One micro-batch's kernels on the slowest stage, replays included."""
    tp: float
    """Its tensor-/sequence-parallel collectives on the critical path."""
    p2p: float
    """Its pipeline sends and receives."""
    microbatches: int
    bubble: float
    optimizer: float
    dp: float
    """The exposed data-parallel gradient reduction (and parameter gather)."""
    tokens: int
    """Tokens of the step: m b s d."""
    comm: float = 0.0
    """Every collective of a micro-batch's step on the stage, hidden or not."""

    @property
    def microbatch(self) -> float:
        return self.compute + self.tp + self.p2p

    @property
    def step(self) -> float:
        return self.microbatch * (self.microbatches + self.bubble) + self.optimizer + self.dp

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_seconds": self.step,
            "microbatch_seconds": self.microbatch,
            "compute_seconds": self.compute,
            "tp_exposed_seconds": self.tp,
            "p2p_seconds": self.p2p,
            "microbatches": self.microbatches,
            "bubble_microbatches": self.bubble,
            "optimizer_seconds": self.optimizer,
            "dp_exposed_seconds": self.dp,
            "comm_seconds": self.comm,
            "tokens": self.tokens,
        }


def _job(job: Job | int) -> Job:
    return job if isinstance(job, Job) else Job(n_layers=job)


def step_time(work: StepWork, device: Device, job: Job | int, *, base: StepWork | None = None) -> StepTime:
    """One rank's step of ``work`` (one micro-batch's traced kernels and collectives) on ``device`` for ``job``.

    ``base``: the same step under ``none``, whose backward weight matmuls hide the backward's collectives
    (default: ``work`` itself).

    Raises:
        ConfigError: a layout whose groups do not tile ``gpus_per_node`` (``Layout.check``).
    """
    job = _job(job)
    device = device.tensor_parallel() if job.wl.tp > 1 else device
    net = network_of(device)
    layout = dataclasses.replace(job.layout, gpus_per_node=net.gpus_per_node)
    layout.check()
    base = base or work
    parts: dict[str, list[float]] = {"layers": [0.0, 0.0], "embedding": [0.0, 0.0], "head": [0.0, 0.0]}
    optimizer = 0.0
    for name, ops in work.phases.items():
        kernels = device.phase_seconds(ops, phase=name, replayed=replayed(ops, base.phases.get(name, ())))
        comm, exposed = _phase_comm(ops, base.phases.get(name, ()), name, device, net, layout)
        if name.startswith("optimizer"):
            optimizer += kernels + exposed
            continue
        part = "layers" if " of layer " in name else "embedding" if "embedding" in name else "head"
        parts[part][0] += kernels
        parts[part][1] += exposed
        parts[part].append(comm)
    share = job.stage_layers / job.n_layers if job.wl.pp > 1 else 1.0
    outer = ["embedding", "head"] if job.wl.pp == 1 else [max(("embedding", "head"), key=lambda k: sum(parts[k][:2]))]
    compute = share * parts["layers"][0] + sum(parts[k][0] for k in outer)
    tp = share * parts["layers"][1] + sum(parts[k][1] for k in outer)
    comm = share * sum(parts["layers"][2:]) + sum(sum(parts[k][2:]) for k in outer)
    p2p = _p2p(job, net, layout)
    fwd, bwd = _stage_passes(base, device, share)
    dp = _dp_exposed(job, net, layout, fwd, bwd)
    wl = job.wl
    return StepTime(
        compute=compute,
        tp=tp,
        p2p=p2p,
        microbatches=wl.microbatches,
        bubble=job.bubble,
        optimizer=share * optimizer,
        dp=dp,
        tokens=wl.microbatches * work.tokens * max(wl.dp, wl.ep),
        comm=comm + p2p,
    )


def phase_seconds(work: StepWork, device: Device, job: Job | int, *, base: StepWork | None = None) -> dict[str, float]:
    """Each phase's seconds on one rank: its kernels and its collectives on the critical path (a layer's
    forward, its backward with the replay: what Korthikanti et al.'s Table 4 times per layer)."""
    job = _job(job)
    device = device.tensor_parallel() if job.wl.tp > 1 else device
    net = network_of(device)
    layout = dataclasses.replace(job.layout, gpus_per_node=net.gpus_per_node)
    base = base or work
    out = {}
    for name, ops in work.phases.items():
        _, exposed = _phase_comm(ops, base.phases.get(name, ()), name, device, net, layout)
        again = replayed(ops, base.phases.get(name, ()))
        out[name] = device.phase_seconds(ops, phase=name, replayed=again) + exposed
    return out


def _phase_comm(
    ops: Sequence[Op], base: Sequence[Op], name: str, device: Device, net: Network, layout: Layout
) -> tuple[float, float]:
    """(every collective's seconds, the exposed seconds) of one phase."""
    inline = hidden = 0.0
    for op in ops:
        parsed = parse_comm(op[0])
        if parsed is None:
            continue
        kind, group, n, replay = parsed
        _, nodes = layout.group(group) if group in ("tp", "dp", "pp", "ep") else (n, 1)
        seconds = op[4] * (net.seconds(kind, op[3], n, nodes) + device.collective_overhead)
        if device.asynchronous and name.startswith("backward") and not replay and kind != "all_to_all":  # rule 4
            hidden += seconds
        else:
            inline += seconds
    if not hidden:
        return inline, inline
    return inline + hidden, inline + max(0.0, hidden - 0.5 * _weight_matmuls(base, device))


REPLAYS_EXPERTS = ("mlp", "attn+mlp", "block")
"""Policies whose replay runs a layer's MLP (its experts) again: with them its all-to-alls run again too."""


def with_expert_parallelism(works: Mapping[str, StepWork], spec: ModelSpec, wl: Workload) -> dict[str, StepWork]:
    """One rank's step works, traced without expert parallelism, with each MoE layer's all-to-alls under ``wl.ep``
    added: the dispatch and the combine of the token copies routed to the rank (``Workload.routed_tokens``, h
    each) in the forward, both again in the backward, and in the backward's replay for a policy that recomputes
    the experts (``REPLAYS_EXPERTS``). The experts' compute is the traced step's: at one rank, transformers'
    grouped matmuls run every routed copy (b s k), as many as an expert-parallel rank receives at the expected
    load (Note: [expected load] in ``recompute.core.workload``)."""
    if wl.ep == 1 or not spec.n_experts:
        return dict(works)
    size = int(wl.routed_tokens(spec)) * spec.hidden * wl.element_bytes
    once, again = comm_name("all_to_all", "ep", wl.ep), comm_name("all_to_all", "ep", wl.ep, replay=True)
    out = {}
    for policy, work in works.items():
        phases = dict(work.phases)
        for name, ops in work.phases.items():
            m = re.fullmatch(r"(forward|backward) of layer (\d+)", name)
            if m is None or not spec.is_moe(int(m.group(2))):
                continue
            added: list[Op] = [(once, wl.dtype, 0, size, 2)]
            if m.group(1) == "backward" and policy in REPLAYS_EXPERTS:
                added.append((again, wl.dtype, 0, size, 2))
            phases[name] = (*ops, *added)
        out[policy] = StepWork(phases, work.tokens)
    return out


def _weight_matmuls(ops: Sequence[Op], device: Device) -> float:
    """Seconds of a phase's matmuls with a weight (not attention's batched products)."""
    return sum(
        device.seconds(op) for op in ops if op_class(op[0], op[2]) == "matmul" and op[0] not in ("bmm", "baddbmm")
    )


def _p2p(job: Job, net: Network, layout: Layout) -> float:
    """A micro-batch's sends to the next stage (forward) and back (backward), once per chunk boundary; without
    sequence parallelism each is all-gathered over the tensor-parallel group on arrival."""
    wl = job.wl
    if wl.pp == 1:
        return 0.0
    _, nodes = layout.group("pp")
    one = net.seconds("send_recv", job.boundary, 2, 2 if nodes > 1 else 1)
    if wl.tp > 1 and not wl.sp:
        one += net.seconds("all_gather", job.boundary * wl.tp, *layout.group("tp"))
    return 2 * wl.interleave * one


def _stage_passes(base: StepWork, device: Device, share: float) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on the stage under ``none``."""
    fwd = bwd = 0.0
    for name, ops in base.phases.items():
        seconds = device.phase_seconds(ops, phase=name) * (share if " of layer " in name else 1.0)
        if name.startswith("forward"):
            fwd += seconds
        elif name.startswith("backward"):
            bwd += seconds
    return fwd, bwd


def _dp_exposed(job: Job, net: Network, layout: Layout, forward: float, backward: float) -> float:
    """The data-parallel reduction's exposed seconds (module note)."""
    wl = job.wl
    if wl.dp == 1 or not job.params:
        return 0.0
    n, nodes = layout.group("dp")
    per = bytes_per_param(str(wl.precision), wl.dp)
    grads = job.params * per["gradients"]
    last = 1 / job.stage_layers
    if wl.fsdp:  # each layer gathered in its forward and again in its backward, its gradients reduce-scattered
        w, r = gathered_bytes(wl)
        scatter = net.seconds("reduce_scatter", job.params * r, n, nodes)
        gather = net.seconds("all_gather", job.params * w, n, nodes)
        return (
            max(last * scatter, scatter - backward)
            + max(last * gather, gather - forward)
            + max(last * gather, gather - backward)
        )
    if wl.precision == "distributed":
        scatter = net.seconds("reduce_scatter", grads, n, nodes)
        gather = net.seconds("all_gather", job.params * per["parameters"], n, nodes)
        return max(last * scatter, scatter - backward) + max(last * gather, gather - forward)
    reduce = net.seconds("all_reduce", grads, n, nodes)
    return max(last * reduce, reduce - backward)


def timing(work: StepWork, base: StepWork, device: Device, job: Job | int) -> Timing:
    """``work``'s predicted step time, tokens/s and time overhead against ``base`` (the step under ``none``)."""
    step = step_time(work, device, job, base=base).step
    plain = step_time(base, device, job).step
    tokens = step_time(base, device, job).tokens
    return Timing(device.label, step, tokens / step if step else 0.0, step / plain - 1 if plain else 0.0)


def layer_costs(works: Mapping[str, StepWork], device: Device, job: Job | int) -> tuple[dict[str, float], float]:
    """Seconds each recompute policy adds to one layer's share of the step, and the step's seconds without
    recomputation, from each uniform policy's step work.

    A layer's share: what the policy adds to one micro-batch of the stage, per layer, times the micro-batch
    times of the step and over the p stages that each run it (a cost table adds it up over the stage's layers
    and multiplies by p): (T_policy - T_none) / L' * (m + (p - 1)/v) / p, L' the stage's layers."""
    job = _job(job)
    missing = [p for p in POLICIES if p not in works]
    require(not missing, f"no step work for {', '.join(missing)}")
    base = works["none"]
    times = {p: step_time(works[p], device, job, base=base) for p in POLICIES}
    per_layer = job.schedule / job.wl.pp / job.stage_layers
    none = times["none"]
    return {p: max(0.0, (times[p].microbatch - none.microbatch) * per_layer) for p in POLICIES}, none.step


def scheduled_profile_table(table: CostTable, profile: Profile, device: Device, wl: Workload) -> CostTable:
    """A profile's table priced on ``device`` (one micro-batch of one device's step), laid out on ``wl``'s
    schedule: m micro-batches (gradient accumulation: each layer's replay m times), the data-parallel
    reduction a profile does not run, and the step's m b s d tokens."""
    if table.model_seconds is None or (wl.microbatches == 1 and wl.dp == 1):
        return table
    work = profile.step_work(["none"] * profile.n_layers)
    job = Job(wl, profile.n_layers, profile.parameter_count)
    m = wl.microbatches
    kinds = tuple(dataclasses.replace(k, seconds={p: m * v for p, v in k.seconds.items()}) for k in table.kinds)
    return dataclasses.replace(table, kinds=kinds, model_seconds=step_time(work, device, job).step, tokens=job.tokens)


def measured_costs(path: str | Path, model: str, n_layers: int) -> tuple[dict[str, float], float]:
    """The same from a ``recompute bench --json`` result of this model: its measured step times per policy.

    Raises:
        ConfigError: unreadable, of another model, or without every policy.
    """
    result = read_bench(path, model=model)
    require(
        result.compiled is None,
        f"{path}: its steps ran torch.compile'd ({result.compiled}), which prices no eager plan; bench the policies "
        "without --compiled",
    )
    times = result.step_times()
    missing = [p for p in POLICIES if p not in times]
    require(not missing, f"{path}: no measured step time for {', '.join(missing)}; bench every policy")
    base = times["none"]
    return {p: max(0.0, (times[p] - base) / n_layers) for p in POLICIES}, base


def offload_seconds(layer_bytes: float, forward: float, backward: float, host_link: float) -> float:
    """A layer's offload cost: its saved bytes copied out during the forward and back during the backward over
    the host link, less what one layer's forward (resp. backward) compute hides (the copies run on a side
    stream, prefetched one layer ahead)."""
    copy = layer_bytes / host_link
    return max(0.0, copy - forward) + max(0.0, copy - backward)


def host_link(device: Device, job: Job | int = 1) -> float | None:
    """The host bandwidth one GPU gets while offloading: the device's host link, shared by the GPUs behind one
    PCIe switch when the job runs on more than one GPU of the node (they all copy at once)."""
    if not device.host_link:
        return None
    sharing = int(device.network.get("gpus_per_host_link", 1))
    on_node = min(_job(job).layout.world, network_of(device).gpus_per_node)
    return device.host_link / max(1, min(sharing, on_node))


def offload_layer_seconds(none: StepWork, layer_bytes: float, device: Device, job: Job | int = 1) -> float | None:
    """Seconds one offloaded layer adds to a step on ``device`` (``offload_seconds`` against the first layer's
    forward and backward under ``none``, on the host link the GPU's PCIe switch shares; each micro-batch's
    copies, over the step's micro-batch times and the stages), or None where offload is not priced: a CPU (its
    host memory is its memory), or a device without a host link."""
    link = host_link(device, job)
    if device.kind == "cpu" or not link:
        return None
    job = _job(job)
    layer = none.phase_seconds(device)
    one = offload_seconds(layer_bytes, layer["forward of layer 0"], layer["backward of layer 0"], link)
    return one * job.schedule / job.wl.pp


def profile_offload_seconds(profile: Profile, device: Device, wl: Workload) -> dict[int, float] | None:
    """Seconds offloading one layer adds to one micro-batch's step on ``device``, per kind of ``profile`` (its
    index) that takes offload: ``offload_seconds`` of the bytes the layer keeps in host memory against its own
    forward and backward under ``none`` (the profile's kernels, priced by the roofline), on the host link the
    GPU's PCIe switch shares among ``wl``'s GPUs. None where offload is not priced: a CPU (its host memory is
    its memory), or a device without a host link (``unpriced_offload`` says why)."""
    link = host_link(device, Job(wl, profile.n_layers, profile.parameter_count))
    if device.kind == "cpu" or not link:
        return None
    return {
        i: offload_seconds(kind.host["offload"], *kind.phase_seconds("none", device), link)
        for i, kind in enumerate(profile.kinds)
        if "offload" in kind.host
    }


def unpriced_offload(device: Device | None, cost: str) -> str:
    """Why offload is not weighed: what its price (copy time) would need."""
    if device is None:
        return f"its price is copy time, and costs are {cost}; plan with --cost time"
    if device.kind == "cpu":
        return "the device is a CPU (its host memory is its memory)"
    if not device.host_link:
        return f"{device.label} has no host link bandwidth; calibrate it with `recompute calibrate -o`"
    return "no time is predicted"


def timings(
    works: Mapping[str, StepWork], layer_policies: Sequence[Sequence[str]], device: Device, job: Job | int
) -> list[Timing]:
    """The predicted timing of each per-layer assignment (one policy per layer of the model) of a model of
    alike layers: the step under ``none`` plus each layer's share (``layer_costs``) of its policy's uniform
    step. An ``offload`` layer runs ``none``'s kernels (its copies are priced by ``offload_layer_seconds``)."""
    seconds, step = layer_costs(works, device, job)
    tokens = step_time(works["none"], device, job).tokens
    out = []
    for layers in layer_policies:
        extra = sum(seconds.get(name, 0.0) for name in layers)
        total = step + extra
        out.append(Timing(device.label, total, tokens / total if total else 0.0, extra / step if step else 0.0))
    return out
