"""``recompute bench --fsdp --dp D`` under torchrun: each rank's real FSDP2 step against the fake trace of that rank.

Every rank builds the model from the same seed, applies each policy in turn, shards it (``recompute.parallel
.shard``, FSDP's ``MixedPrecisionPolicy`` under mixed and amp) and runs its own batch: one untracked step, then
``steps`` steps tracked by recompute's ``StepTracker`` (``recompute.bench._fsdp.rank_records``; the one that held
least kept: Note: [late frees] there), and on CUDA the allocator's peak over the last of them. Rank 0 gathers
every rank's figures and, once the process group has ended, traces each rank on fake tensors
(``recompute.trace.step_record(..., rank=r)``: a fake process group of its own) and sets them side by side: the
peak and every phase. On CPU ranks over gloo a backward can hold gloo's clone of a reduce-scatter input more than
the trace (Note: [gloo's reduce-scatter]); NCCL reduces in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recompute.bench._fsdp import figures, rank_records
from recompute.core.errors import require
from recompute.core.policy import Policy
from recompute.core.progress import Progress, no_progress
from recompute.core.table import render_table, size
from recompute.core.workload import Workload, parallel_sizes
from recompute.models.source import ModelSource
from recompute.parallel import init_from_env
from recompute.trace import step_record

__all__ = ["ShardedBench", "ShardedRow", "bench_fsdp", "render_fsdp_bench", "with_traces"]


@dataclass(frozen=True)
class ShardedRow:
    """One policy on one rank: its real step, and the fake trace of that rank once ``with_traces`` ran."""

    policy: str
    rank: int
    peak: int
    """The tracked real step's peak (``StepTracker``: every storage, as the trace counts them)."""
    phases: dict[str, int]
    """Each phase's peak of the real step (each layer's forward and backward apart)."""
    states: dict[str, int]
    """Parameters, gradients and optimizer state on this rank after the optimizer step."""
    allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the last tracked step (CUDA only)."""
    traced_peak: int | None = None
    traced_phases: dict[str, int] | None = None

    @property
    def differing(self) -> dict[str, int]:
        """Phases where the real step held other than the trace: real minus traced (empty before ``with_traces``)."""
        traced = self.traced_phases or {}
        return {ph: v - traced[ph] for ph, v in self.phases.items() if ph in traced and v != traced[ph]}


@dataclass(frozen=True)
class ShardedBench:
    """``bench_fsdp``'s result, as rank 0 sees it: every rank's rows."""

    model: str
    workload: dict[str, Any]
    device: str
    rows: tuple[ShardedRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bench_fsdp(
    source: ModelSource,
    wl: Workload,
    policies: Sequence[str | Policy],
    *,
    steps: int = 2,
    seed: int = 0,
    argv: Sequence[str] | None = None,
    progress: Progress = no_progress,
) -> ShardedBench | None:
    """Measure each policy's real FSDP2 step on every rank (run in every process torchrun starts, ``wl.dp`` of
    them); rank 0 returns every rank's rows, the others None. Call ``with_traces`` on it once the process group
    has ended.

    Raises:
        ConfigError: ``wl`` without ``fsdp`` or with ``tp``, ``steps`` < 1, not under torchrun with ``wl.dp``
            processes, or a torch that cannot run ``fully_shard`` on this device.
    """
    sizes, fields = parallel_sizes(wl, ("tp", "pp"))
    require(wl.fsdp, "bench_fsdp runs a --fsdp workload; give fsdp=True", fields=("fsdp",))
    require(not fields, f"bench --fsdp runs FSDP2 alone; drop {sizes}", fields=fields)
    require(steps > 0, f"--steps must be > 0, got {steps}")
    mesh = init_from_env(tp=1, dp=wl.dp, argv=argv)["dp"]
    rank, cuda = mesh.get_local_rank(), mesh.device_type == "cuda"
    names = [Policy.parse(p).describe() for p in policies]
    rows = []
    for i, (pol, name) in enumerate(zip(policies, names)):
        progress(f"FSDP2 {name}", i, len(policies))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        records = rank_records(source, wl, pol, mesh, steps=steps, seed=seed)
        allocated = torch.cuda.max_memory_allocated() if cuda else None
        least = min((figures(r) for r in records), key=lambda f: sum(f["phases"].values()))
        rows.append(ShardedRow(name, rank, least["peak"], least["phases"], least["states"], allocated))
    progress("done", len(policies), len(policies))
    gathered: list[Any] = [None] * mesh.size() if rank == 0 else []
    dist.gather_object(rows, gathered if rank == 0 else None, dst=0, group=mesh.get_group())
    if rank != 0:
        return None
    every = sorted((row for part in gathered for row in part), key=lambda r: (names.index(r.policy), r.rank))
    return ShardedBench(source.name, wl.to_dict(), mesh.device_type, tuple(every))


def with_traces(result: ShardedBench, source: ModelSource, policies: Sequence[str | Policy]) -> ShardedBench:
    """``result`` with each row's fake trace of its rank (``step_record``). Call it once the process group has
    ended (the trace starts a fake one)."""
    wl = Workload(**result.workload)
    names = {Policy.parse(p).describe(): p for p in policies}
    rows = []
    for row in result.rows:
        fake = figures(step_record(source, wl, names[row.policy], rank=row.rank))
        rows.append(dataclasses.replace(row, traced_peak=fake["peak"], traced_phases=fake["phases"]))
    return dataclasses.replace(result, rows=tuple(rows))


def render_fsdp_bench(r: ShardedBench) -> str:
    """Each rank's real step next to the fake trace of that rank."""
    wl = r.workload
    body = [[row.policy, str(row.rank), *_cells(row)] for row in r.rows]
    head = (
        f"{r.model}: b={wl['micro_batch']} s={wl['seq_len']} {wl['dtype']} ({wl['precision']}), FSDP2 over "
        f"{wl['dp']} ranks ({r.device}): each rank's real step (StepTracker) against the fake trace of that rank"
    )
    columns = ["policy", "rank", "peak", "traced peak", "diff", "phases equal", "states", "allocator peak"]
    note = (
        "note: on CPU ranks gloo clones a reduce-scatter's input (it has no reduce-scatter of its own) and its worker "
        "thread frees buffers late: a backward phase can hold more than the trace, which counts NCCL's in-place one"
    )
    return "\n".join([head, render_table(columns, body), note])


def _cells(row: ShardedRow) -> list[str]:
    """Peak, traced peak, their difference, the phases equal (and the one most apart), states, allocator peak."""
    traced = row.traced_peak
    diff = row.differing
    worst = max(diff.items(), key=lambda kv: abs(kv[1]), default=None)
    phases = f"{len(row.phases) - len(diff)} of {len(row.phases)}"
    if worst is not None:
        phases += f" ({worst[0]}: {worst[1]:+,} B)"
    states = sum(row.states.get(k, 0) for k in ("Parameter", "Gradient", "Optstate"))
    return [
        size(row.peak),
        size(traced) if traced is not None else "-",
        f"{row.peak - traced:+,} B" if traced is not None else "-",
        phases if traced is not None else "-",
        size(states),
        size(row.allocated) if row.allocated is not None else "-",
    ]
