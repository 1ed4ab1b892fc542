"""Real FSDP2 steps on CPU ranks, each rank's steady-state step tracked as the trace tracks a fake one.

``rank_records`` runs in every rank of a started process group: the model built from the same seed on each,
the policy applied, ``recompute.parallel.shard`` over the ranks (FSDP's ``MixedPrecisionPolicy`` where the
workload asks), AdamW; one untracked step (the optimizer state made as a run makes it), then one step under
``StepTracker`` (``recompute.trace._step.run_step``). ``run_ranks`` starts ``d`` such processes over gloo on
the loopback (``torch.multiprocessing``), with a time limit. ``benchmarks/fsdp_truth.py`` and tests/test_fsdp.py
hold the fake trace of rank r (``recompute.trace``) to the real rank r with them.

Note: [gloo's reduce-scatter] gloo has no reduce-scatter of its own: ``_reduce_scatter_base`` clones its whole
input, all-reduces the clone and copies this rank's chunk out in ``wait()``. The clone (a layer's gradients in
the reduce dtype) lives only on gloo, where NCCL reduces in place; a real CPU step can hold it at a phase's peak
(under a ``MixedPrecisionPolicy``, at the backward of the last layer), and gloo's worker thread frees it at a
moment the main thread does not see, so a phase that starts right after can still count it. The trace models
a real reduce-scatter (NCCL's).

Note: [late frees] gloo's worker thread holds a collective's tensors until it drops the finished work, which can
be after the main thread has moved on: a buffer FSDP released (a reduce-scatter input, or gloo's clone of it) is
then counted a little longer, into the next phase (the embedding's backward, the optimizer step), now and then,
by a few tens of KB on the tiny models here. Such a free only ever comes late, so of several tracked steps the one
that held least is the step's own figure (``real_figures(..., steps=n)``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recompute._compat import require_fsdp
from recompute.checkpointing import apply, find_layers
from recompute.core.errors import ConfigError
from recompute.core.policy import Policy
from recompute.core.workload import Workload
from recompute.models.source import ModelSource, build_source
from recompute.parallel import mixed_dtype, reduce_dtype, shard
from recompute.runtime import TORCH_DTYPES, autocast_dtype, forward_autocast, random_batch
from recompute.trace._step import StepRecord, run_step

__all__ = ["Case", "figures", "in_place_reduce_scatter", "rank_records", "real_figures", "run_ranks"]


def rank_records(
    source: ModelSource,
    wl: Workload,
    policy: Policy | str,
    mesh: DeviceMesh,
    *,
    steps: int = 1,
    seed: int = 0,
    in_place: bool = False,
) -> list[StepRecord]:
    """``steps`` real steady-state training steps of ``source`` on this rank of ``mesh``, each tracked
    (``run_step``).

    The model is built on the mesh's device from ``seed`` (the same weights on every rank), in
    ``wl.param_dtype``; ``policy`` applied, then sharded (``shard``, ``mixed_dtype(wl)``); the batch is this
    rank's own (``seed`` plus the rank); one untracked step first (AdamW's state made). Under ``amp`` the forward
    and loss run under autocast. ``in_place``: FSDP's reduce-scatters run as ``in_place_reduce_scatter`` (no gloo
    clone: Note: [gloo's reduce-scatter]).

    Raises:
        ConfigError: the model cannot be built, or this torch cannot run ``fully_shard`` on the device.
    """
    require_fsdp(mesh.device_type)
    torch.manual_seed(seed)
    built = build_source(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], device=mesh.device_type)
    model = built.model.train()
    apply(model, policy, loss=wl.loss, loss_chunk=wl.loss_chunk)
    shard(model, mesh, mp_dtype=mixed_dtype(wl), reduce=reduce_dtype(wl))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = random_batch(
        built.vocab, wl.micro_batch, wl.seq_len, device=mesh.device_type, seed=seed + mesh.get_local_rank()
    )
    autocast = autocast_dtype(wl)
    with forward_autocast(autocast, mesh.device_type):
        _, loss = built.loss_fn(model, *batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    layers = find_layers(model)
    with in_place_reduce_scatter() if in_place else contextlib.nullcontext():
        return [
            run_step(
                model, batch, optimizer, layers, loss_fn=built.loss_fn, keep_grads=wl.keep_grads, autocast=autocast
            )
            for _ in range(steps)
        ]


_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")
"""``torch.distributed``'s reduce-scatter of one flat tensor, as FSDP2 calls it (2.6: the first; 2.13: the second)."""


@contextlib.contextmanager
def in_place_reduce_scatter() -> Iterator[None]:
    """While inside, a blocking reduce-scatter of one tensor is an all-reduce of its input in place and this rank's
    chunk copied out: the same result, and the memory of a collective library with a reduce-scatter of its own
    (NCCL's: no clone of the input; Note: [gloo's reduce-scatter]). Only to show what gloo's clone adds."""
    originals = {name: getattr(dist, name) for name in _REDUCE_SCATTERS if hasattr(dist, name)}

    def patched(original: Callable[..., Any]) -> Callable[..., Any]:
        def reduce_scatter(
            output: Any, input: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
        ) -> Any:
            if async_op:
                return original(output, input, op=op, group=group, async_op=async_op)
            dist.all_reduce(input, op=op, group=group)
            output.copy_(input.view(dist.get_world_size(group), -1)[dist.get_rank(group)].view_as(output))
            return None

        return reduce_scatter

    for name, original in originals.items():
        setattr(dist, name, patched(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@dataclass(frozen=True)
class Case:
    """A real step to run on every rank."""

    source: ModelSource
    wl: Workload
    """Its workload (``fsdp``; ``dp``: the ranks ``real_figures`` starts)."""
    policy: Policy | str
    in_place: bool = False
    """FSDP's reduce-scatters without gloo's clone (``rank_records``'s)."""


def figures(record: StepRecord) -> dict[str, Any]:
    """What a rank's fake and real steps are compared by: the peak, its phase and MemTracker's categories there,
    every phase's peak (each layer's forward and backward apart), the model states after the optimizer step, and
    the bytes each layer saved."""
    saved = [0] * record.n_layers
    for r in record.saved:
        if r.layer >= 0 and not r.host:
            saved[r.layer] += r.nbytes
    return {
        "peak": record.peak[0],
        "peak_phase": str(record.peak[1]),
        "breakdown": {k: v for k, v in record.phase_peaks[record.peak[1]][1].items() if v},
        "phases": {
            str(ph): value for ph, (value, _) in sorted(record.phase_peaks.items(), key=lambda kv: kv[0].order())
        },
        "states": {k: record.states.get(k, 0) for k in ("Parameter", "Gradient", "Optstate")},
        "saved": saved,
    }


def real_figures(
    cases: Sequence[Case], d: int, *, steps: int = 1, timeout_s: float = 600.0
) -> list[list[dict[str, Any]]]:
    """``figures`` of each case's real step on each of ``d`` CPU ranks (``run_ranks``, one process group for all
    of them): one list per case, by rank; of ``steps`` tracked steps, the one that held least (Note: [late frees]).

    Raises:
        as ``run_ranks``.
    """
    out = run_ranks(d, functools.partial(_cases, tuple(cases), steps), timeout_s=timeout_s)
    try:
        by_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(d)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return [[by_rank[r][i] for r in range(d)] for i in range(len(cases))]


def _cases(cases: tuple[Case, ...], steps: int, mesh: DeviceMesh, out: Path) -> None:
    """Every case's real steps on this rank, the ``figures`` of the one that held least (the least sum of its phase
    peaks) written to ``out/rank<r>.json``."""
    rows = []
    for c in cases:
        each = [figures(r) for r in rank_records(c.source, c.wl, c.policy, mesh, steps=steps, in_place=c.in_place)]
        rows.append(min(each, key=lambda f: sum(f["phases"].values())))
    (out / f"rank{mesh.get_local_rank()}.json").write_text(json.dumps(rows))


def run_ranks(d: int, worker: Callable[[DeviceMesh, Path], None], *, timeout_s: float = 600.0) -> Path:
    """Run ``worker(mesh, folder)`` in ``d`` new CPU processes, a gloo process group of them on the loopback (the
    mesh: 1-D over all of them, named ``dp``); return the folder (a new temporary one) they wrote their results in.

    Raises:
        ConfigError: this torch cannot run FSDP2 on the CPU, or it has no gloo.
        ProcessRaisedException: a rank failed (its traceback in the message; the others ended).
        RuntimeError: they ran past ``timeout_s`` (all ended).
    """
    require_fsdp("cpu")
    if not (dist.is_available() and dist.is_gloo_available()):
        raise ConfigError("real FSDP2 ranks on the CPU need torch.distributed with gloo; this torch has none")
    out = Path(tempfile.mkdtemp(prefix="recompute-fsdp-"))
    context = mp.start_processes(
        _rank_main, args=(d, _free_port(), worker, out), nprocs=d, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise RuntimeError(f"{d} FSDP2 ranks ran past {timeout_s:.0f} s; ended them")
    return out


def _rank_main(rank: int, d: int, port: int, worker: Callable[[DeviceMesh, Path], None], out: Path) -> None:
    """One rank: its process group (gloo, loopback), its mesh, the worker; the group ended together."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=d)
    try:
        worker(init_device_mesh("cpu", (d,), mesh_dim_names=("dp",)), out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
