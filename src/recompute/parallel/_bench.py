"""``recompute bench --tp T [--sp] [--dp D]`` under torchrun: what one rank keeps per layer, and its step time.

Every rank builds the model from the same seed, ``parallelize``s it and applies each policy in turn; each
data-parallel rank gets its own batch. Per policy it measures the activation bytes each layer leaves to
autograd on this rank (``saved_bytes_per_layer``), a few timed training steps (AdamW) and, on CUDA, the
allocator's peak. Rank 0 reports, next to the analytic model for the same step and Korthikanti et al.'s
formulas (fp16, 1-byte masks: the paper's accounting, with the analytic model in that accounting beside
it, which differs from the paper only by the LayerNorm statistics the paper leaves out).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from recompute.analytic import layer_activations, paper_layer_bytes
from recompute.errors import require
from recompute.parallel._env import init_from_env
from recompute.parallel._measure import saved_bytes_per_layer
from recompute.parallel._plan import check_parallel, parallelize
from recompute.policy import Policy
from recompute.render import render_table
from recompute.spec import ModelSpec
from recompute.workload import Workload

__all__ = ["ParallelBench", "RankRow", "bench_parallel", "render_parallel_bench"]


@dataclass(frozen=True)
class RankRow:
    """One policy under one parallel setting, on one rank."""

    mode: str
    """``TP`` or ``TP+SP`` (``DP`` when t = 1)."""
    policy: str
    measured: float
    """Activation bytes one layer keeps on this rank (mean over the layers)."""
    analytic: float
    """``layer_activations(spec, wl).stored(policy)`` for this step."""
    paper_setting: float
    """The analytic model in the paper's accounting (fp16, 1-byte dropout masks)."""
    paper: float | None
    """Korthikanti et al. 2022 Table 2 (``paper_layer_bytes``), where the paper covers the model and policy."""
    step_s: float
    """Median training step (forward, backward, AdamW step)."""
    peak: int | None
    """``torch.cuda.max_memory_allocated`` over one step on this rank (CUDA only)."""


@dataclass(frozen=True)
class ParallelBench:
    """``bench_parallel``'s result, as rank 0 sees it."""

    model: str
    workload: dict[str, Any]
    world: int
    device: str
    steps: int
    rows: tuple[RankRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bench_parallel(
    spec: ModelSpec,
    wl: Workload,
    policies: Sequence[str | Policy] = ("none", "core_attn", "block"),
    *,
    steps: int = 3,
    warmup: int = 1,
    seed: int = 0,
    argv: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ParallelBench:
    """Measure every policy under ``wl.tp``-way tensor parallelism (and again with SP when ``wl.sp``).

    Run in every process torchrun starts (t * d of them); every rank returns its own figures.

    Raises:
        ConfigError: t does not divide the heads or (with SP) the sequence, --pp given, or not under
            torchrun with t * d processes.
    """
    from recompute.bench import _batch, _dtype, _sync
    from recompute.checkpointing import apply
    from recompute.models import build_model

    check_parallel(spec, tp=wl.tp, seq_len=wl.seq_len, sp=wl.sp)
    require(wl.pp == 1, "bench runs tensor and data parallelism; drop --pp (recompute estimate models pipelines)")
    require(steps > 0 and warmup >= 0, f"--steps must be > 0 and --warmup >= 0, got {steps} and {warmup}")
    pols = [Policy.parse(p) for p in policies]
    mesh = init_from_env(tp=wl.tp, dp=wl.dp, argv=argv)
    device = mesh.device_type
    batch = _batch(spec, wl, device, seed + mesh["dp"].get_local_rank())  # a batch per data-parallel rank
    say = progress or (lambda _: None)
    rows = []
    for sp in (False, True) if wl.sp else (False,):
        here = dataclasses.replace(wl, sp=sp)
        paper_wl = dataclasses.replace(here, dtype="fp16", device="cuda")
        for pol in pols:
            mode = ("TP+SP" if sp else "TP") if wl.tp > 1 else "DP"
            say(f"{mode} {pol.describe()}")
            torch.manual_seed(seed)
            model = build_model(spec, attention=wl.attention, dtype=_dtype(wl), device=device).train()
            parallelize(model, mesh, sp=sp)
            apply(model, pol)
            kept = [sum(layer.values()) for layer in saved_bytes_per_layer(model, batch)]
            optimizer = torch.optim.AdamW(model.parameters())
            times = [_step(model, optimizer, batch, _sync, device) for _ in range(warmup + steps)][warmup:]
            peak = None
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                _step(model, optimizer, batch, _sync, device)
                peak = torch.cuda.max_memory_allocated()
            per_layer = pol.per_layer(spec.n_layers)
            paper = [paper_layer_bytes(spec, paper_wl, name) for name in per_layer]
            rows.append(
                RankRow(
                    mode=mode,
                    policy=pol.describe(),
                    measured=statistics.mean(kept),
                    analytic=_mean_stored(spec, here, per_layer),
                    paper_setting=_mean_stored(spec, paper_wl, per_layer),
                    paper=None if None in paper else statistics.mean(p for p in paper if p is not None),
                    step_s=statistics.median(times),
                    peak=peak,
                )
            )
            del model, optimizer
    return ParallelBench(
        model=spec.name,
        workload=wl.to_dict(),
        world=mesh.size(),
        device=device,
        steps=steps,
        rows=tuple(rows),
    )


def _mean_stored(spec: ModelSpec, wl: Workload, per_layer: Sequence[str]) -> float:
    la = layer_activations(spec, wl)
    return statistics.mean(la.stored(name) for name in per_layer)


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    sync: Callable[[str], None],
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
    base = {row.mode: row.step_s for row in r.rows if row.policy == "none"}
    body = []
    for row in r.rows:
        over = f"{100 * (row.step_s / base[row.mode] - 1):+.1f}%" if row.mode in base else "-"
        body.append(
            [
                row.mode,
                row.policy,
                f"{row.measured / 2**20:,.2f} MiB",
                f"{row.analytic / 2**20:,.2f} MiB",
                f"{row.measured / row.analytic - 1:+.2%}",
                f"{row.paper_setting / 2**20:,.2f} MiB",
                f"{row.paper / 2**20:,.2f} MiB" if row.paper is not None else "-",
                f"{row.step_s:.3f} s",
                over,
                f"{row.peak / 2**30:.2f} GiB" if row.peak is not None else "-",
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
            "peak",
        ],
        body,
    )
    note = (
        "paper's fp16: fp16 activations and 1-byte dropout masks, as Korthikanti et al. count; the analytic model "
        "there differs from the paper's formula only by the LayerNorm statistics the paper leaves out"
    )
    return f"{head}\n{table}\n{note}"
