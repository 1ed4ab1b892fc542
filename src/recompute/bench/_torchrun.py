"""``recompute bench --tp T [--sp] [--dp D]`` under torchrun: what one rank keeps per layer, and its step time.

Every rank builds the model from the same seed, ``parallelize``s it and applies each policy in turn; each
data-parallel rank gets its own batch. Per policy it measures the activation bytes each layer leaves to
autograd on this rank (``saved_bytes_per_layer``), a few timed training steps (AdamW) and, on CUDA, the
allocator's peak. Rank 0 reports, next to the analytic model for the same step and Korthikanti et al.'s
formulas (fp16, 1-byte masks: the paper's accounting, with the analytic model in that accounting beside
it, which differs from the paper only by the LayerNorm statistics the paper leaves out), and next to the time
model's step for the rank (``with_predictions``: the fake-tensor trace of rank 0, its kernels priced on the
device profile and its collectives on the profile's measured ones), worked out once the process group has ended
(the trace runs on a fake one).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh

from recompute.checkpointing import apply
from recompute.core.analytic import layer_activations, paper_layer_bytes
from recompute.core.errors import require
from recompute.core.policy import Policy
from recompute.core.pricing import Job, StepTime, network_notes, step_time
from recompute.core.progress import Progress, no_progress
from recompute.core.results import ParallelBench, RankRow
from recompute.core.spec import ModelSpec
from recompute.core.table import gib, mib, render_table
from recompute.core.timing import Device
from recompute.core.workload import Workload
from recompute.models import build_model
from recompute.parallel import check_parallel, init_from_env, parallelize
from recompute.runtime import TORCH_DTYPES, random_batch, sync
from recompute.trace import cached_works, saved_bytes_per_layer, step_work

__all__ = [
    "ParallelBench",
    "RankRow",
    "bench_parallel",
    "predict_parallel",
    "render_parallel_bench",
    "with_predictions",
]


def bench_parallel(
    spec: ModelSpec,
    wl: Workload,
    policies: Sequence[str | Policy] = ("none", "core_attn", "block"),
    *,
    steps: int = 3,
    warmup: int = 1,
    seed: int = 0,
    argv: Sequence[str] | None = None,
    progress: Progress = no_progress,
) -> ParallelBench:
    """Measure every policy under ``wl.tp``-way tensor parallelism (and again with SP when ``wl.sp``).

    Run in every process torchrun starts (t * d of them); every rank returns its own figures.

    Raises:
        ConfigError: t does not divide the heads or (with SP) the sequence, --pp given, or not under
            torchrun with t * d processes.
    """
    check_parallel(spec, tp=wl.tp, seq_len=wl.seq_len, sp=wl.sp)
    require(wl.pp == 1, "bench runs tensor and data parallelism; drop --pp (recompute estimate models pipelines)")
    require(steps > 0 and warmup >= 0, f"--steps must be > 0 and --warmup >= 0, got {steps} and {warmup}")
    pols = [Policy.parse(p) for p in policies]
    modes = (False, True) if wl.sp else (False,)
    mesh = init_from_env(tp=wl.tp, dp=wl.dp, argv=argv)
    device = mesh.device_type
    batch = random_batch(
        spec.vocab, wl.micro_batch, wl.seq_len, device=device, seed=seed + mesh["dp"].get_local_rank()
    )  # a batch per data-parallel rank
    rows: list[RankRow] = []
    for sp in modes:
        here = dataclasses.replace(wl, sp=sp)
        paper_wl = dataclasses.replace(here, dtype="fp16", device="cuda")
        mode = ("TP+SP" if sp else "TP") if wl.tp > 1 else "DP"
        runs: list[_Run] = []
        for pol in pols:
            progress(f"{mode} {pol.describe()}", len(rows) + len(runs), len(modes) * len(pols))
            runs.append(_Run(pol, *_built(spec, here, pol, mesh, batch, seed)))
            if device == "cuda":  # one model resident at a time: the allocator's peak is this policy's
                _measure(runs[-1], batch, device, steps=steps, warmup=warmup)
                del runs[-1].model, runs[-1].optimizer
        if device != "cuda":  # every model resident: the timed steps go round the policies (a drifting CPU)
            _measure_round_robin(runs, batch, device, steps=steps, warmup=warmup)
        for run in runs:
            per_layer = run.policy.per_layer(spec.n_layers)
            paper = [paper_layer_bytes(spec, paper_wl, name) for name in per_layer]
            rows.append(
                RankRow(
                    mode=mode,
                    policy=run.policy.describe(),
                    measured=statistics.mean(run.kept),
                    analytic=_mean_stored(spec, here, per_layer),
                    paper_setting=_mean_stored(spec, paper_wl, per_layer),
                    paper=None if None in paper else statistics.mean(p for p in paper if p is not None),
                    step_s=statistics.median(run.times),
                    peak=run.peak,
                )
            )
        del runs
    progress("done", len(rows), len(rows))
    return ParallelBench(
        model=spec.name,
        workload=wl.to_dict(),
        world=mesh.size(),
        device=device,
        steps=steps,
        rows=tuple(rows),
    )


def with_predictions(
    result: ParallelBench,
    spec: ModelSpec,
    policies: Sequence[str | Policy],
    device: Device,
    *,
    progress: Progress = no_progress,
) -> ParallelBench:
    """``result`` with each row's predicted step (``predict_parallel``) and where the prediction comes from.
    Call it once the process group has ended (the trace starts a fake one)."""
    wl = Workload(**result.workload)
    pols = [Policy.parse(p) for p in policies]
    modes = (False, True) if wl.sp else (False,)
    predicted = predict_parallel(spec, wl, pols, device, modes=modes, progress=progress)
    rows = tuple(
        dataclasses.replace(row, predicted_s=predicted[row.mode == "TP+SP", row.policy].step) for row in result.rows
    )
    return dataclasses.replace(result, rows=rows, notes=tuple(network_notes(device, wl)))


def predict_parallel(
    spec: ModelSpec,
    wl: Workload,
    policies: Sequence[Policy],
    device: Device,
    *,
    modes: Sequence[bool] = (False,),
    progress: Progress = no_progress,
) -> dict[tuple[bool, str], StepTime]:
    """Each policy's predicted step on one rank, per mode (sequence parallelism off or on): the step of rank 0
    traced on a fake process group (``recompute.trace``), its kernels priced on ``device`` and its collectives
    on ``device``'s network. Call it before a process group starts (the trace starts a fake one).

    Data parallelism is priced as gradient reduction (``recompute.core.pricing``); FSDP2's own parameter
    gathers are not traced.
    """
    out = {}
    for sp in modes:
        here = dataclasses.replace(wl, sp=sp)
        names = [p.name for p in policies if p.is_uniform]
        works = cached_works(spec, here, list(dict.fromkeys(["none", *names])), progress=progress)
        job = Job.of(spec, here)
        for pol in policies:
            work = works[pol.name] if pol.is_uniform else step_work(spec, here, pol)
            out[sp, pol.describe()] = step_time(work, device, job, base=works["none"])
    return out


@dataclass
class _Run:
    """One policy's model on this rank, what it keeps per layer, and its timed steps."""

    policy: Policy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    kept: list[int]
    times: list[float] = field(default_factory=list)
    peak: int | None = None


def _built(
    spec: ModelSpec, wl: Workload, pol: Policy, mesh: DeviceMesh, batch: tuple[torch.Tensor, torch.Tensor], seed: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[int]]:
    """The model (same seed on every rank), parallelized, ``pol`` applied, its AdamW, and the bytes each layer
    keeps on this rank."""
    torch.manual_seed(seed)
    model = build_model(spec, attention=wl.attention, dtype=TORCH_DTYPES[wl.dtype], device=mesh.device_type).train()
    parallelize(model, mesh, sp=wl.sp)
    apply(model, pol, loss=wl.loss, loss_chunk=wl.loss_chunk)
    kept = [sum(layer.values()) for layer in saved_bytes_per_layer(model, batch)]
    return model, torch.optim.AdamW(model.parameters()), kept


def _measure(run: _Run, batch: tuple[torch.Tensor, torch.Tensor], device: str, *, steps: int, warmup: int) -> None:
    run.times = [_step(run.model, run.optimizer, batch, device) for _ in range(warmup + steps)][warmup:]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        _step(run.model, run.optimizer, batch, device)
        run.peak = torch.cuda.max_memory_allocated()


def _measure_round_robin(
    runs: list[_Run], batch: tuple[torch.Tensor, torch.Tensor], device: str, *, steps: int, warmup: int
) -> None:
    """Warm every run up, then time one step of each in turn, ``steps`` rounds."""
    for run in runs:
        for _ in range(warmup):
            _step(run.model, run.optimizer, batch, device)
    for _ in range(steps):
        for run in runs:
            run.times.append(_step(run.model, run.optimizer, batch, device))


def _mean_stored(spec: ModelSpec, wl: Workload, per_layer: Sequence[str]) -> float:
    la = layer_activations(spec, wl)
    return statistics.mean(la.stored(name) for name in per_layer)


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: str,
) -> float:
    sync(device)
    start = time.perf_counter()
    _, loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def render_parallel_bench(r: ParallelBench) -> str:
    """The per-rank table: measured bytes per layer against the analytic model and the paper."""
    wl = r.workload
    base = {row.mode: row for row in r.rows if row.policy == "none"}
    body = []
    for row in r.rows:
        ref = base.get(row.mode)
        over = f"{100 * (row.step_s / ref.step_s - 1):+.1f}%" if ref else "-"
        guess = "-"
        if row.predicted_s is not None:
            guess = f"{row.predicted_s:.3f} s"
            if ref is not None and ref.predicted_s:
                guess += f" ({100 * (row.predicted_s / ref.predicted_s - 1):+.1f}%)"
        body.append(
            [
                row.mode,
                row.policy,
                mib(row.measured, digits=2),
                mib(row.analytic, digits=2),
                f"{row.measured / row.analytic - 1:+.2%}",
                mib(row.paper_setting, digits=2),
                mib(row.paper, digits=2) if row.paper is not None else "-",
                f"{row.step_s:.3f} s",
                over,
                guess,
                gib(row.peak) if row.peak is not None else "-",
            ]
        )
    head = (
        f"{r.model}: b={wl['micro_batch']} s={wl['seq_len']} {wl['dtype']} {wl['attention']}, t={wl['tp']} "
        f"d={wl['dp']} ({r.world} ranks, {r.device}); one layer on rank 0"
    )
    table = render_table(
        [
            "mode",
            "policy",
            "kept per layer",
            "analytic",
            "diff",
            "analytic (paper's fp16)",
            "paper formula",
            "step",
            "overhead",
            "predicted step (overhead)",
            "peak",
        ],
        body,
    )
    note = (
        "paper's fp16: fp16 activations and 1-byte dropout masks, as Korthikanti et al. count; the analytic model "
        "there differs from the paper's formula only by the LayerNorm statistics the paper leaves out"
    )
    return "\n".join([head, table, note, *(f"note: {n}" for n in r.notes)])
