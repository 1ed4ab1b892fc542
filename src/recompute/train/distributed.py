"""Where one process of ``recompute train --tp T [--sp] [--dp D]`` stands: its mesh, its rank, its batch share.

torchrun starts t * d processes; ``start`` begins the process group (``recompute.parallel.init_from_env``:
gloo on the CPU, NCCL with CUDA) and returns the ``("dp", "tp")`` mesh. A one-process run gets ``Ranks()``,
whose methods do nothing.

Note: [one process group per process] a group that ``start`` begins lives until the process exits (``atexit``
ends it), and later runs in the process (``compare-train``'s) reuse it: a second ``init_process_group`` after
``destroy_process_group`` in one torchrun worker hung here (gloo, 2 CPU ranks), not every time.

Data: every rank draws the same global micro-batch (``TokenStream.batch``, a pure function of seed, step and
micro-batch); the tensor-parallel ranks of one replica all use the rows of their data-parallel rank, rows
[r*b/d, (r+1)*b/d) of the b. So ``--micro-batch`` counts sequences over all the data-parallel ranks together,
FSDP averages the gradients over them, and the run optimises what a single process with the same options
does (the reported loss is the mean over the data-parallel ranks: the global batch's mean).
"""

from __future__ import annotations

import atexit
import gc
import shlex
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from recompute.core.errors import require
from recompute.core.spec import ModelSpec
from recompute.parallel import check_parallel, init_from_env
from recompute.train.config import TrainConfig

__all__ = ["Ranks", "start"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run; ``mesh`` is ``None`` for a one-process run."""

    mesh: DeviceMesh | None = None

    @property
    def rank(self) -> int:
        """The global rank (0 for a one-process run); rank 0 prints and writes the run's files."""
        return dist.get_rank() if self.mesh is not None else 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, x: Tensor) -> Tensor:
        """This data-parallel rank's rows of the global micro-batch ``x`` (b, ...): (b/d, ...)."""
        if self.mesh is None:
            return x
        dp = self.mesh["dp"]
        return x.chunk(dp.size())[dp.get_local_rank()]

    def wait_for_all(self) -> None:
        """Block until every rank is here (nothing for one process): ranks leave a run together."""
        if self.mesh is not None:
            dist.barrier()  # Note: [ending together] in recompute.parallel._env

    def mean(self, value: float) -> float:
        """``value`` averaged over the data-parallel ranks: the same float on every rank."""
        if self.mesh is None or self.mesh["dp"].size() == 1:
            return value  # the tensor-parallel ranks of a replica already agree (vocabulary-parallel loss)
        dp = self.mesh["dp"]
        total = torch.tensor(value, dtype=torch.float64, device=self.mesh.device_type)
        dist.all_reduce(total, group=dp.get_group())
        return total.item() / dp.size()


def start(config: TrainConfig, spec: ModelSpec) -> Ranks:
    """Join the torchrun launch that ``config.tp * config.dp > 1`` needs; ``Ranks()`` for one process.

    Raises:
        ConfigError: t does not divide the heads (or, with --sp, the sequence), --device cpu where the ranks
            would use CUDA, or not under torchrun with t * d processes (``init_from_env``'s one-line message,
            with the torchrun command that runs this config).
    """
    if not config.parallel:
        return Ranks()
    if config.tp > 1:
        check_parallel(spec, tp=config.tp, seq_len=config.seq_len, sp=config.workload.sp)
    require(
        config.workload.device != "cpu" or not torch.cuda.is_available(),
        "--tp/--dp ranks use CUDA (NCCL) where it is available; drop --device cpu or hide the GPUs",
    )
    if not dist.is_initialized():
        atexit.register(_end_group)  # Note: [one process group per process]
    return Ranks(init_from_env(tp=config.tp, dp=config.dp, argv=[shlex.quote(a) for a in config.command_line()]))


def _end_group() -> None:
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
