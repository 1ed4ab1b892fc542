"""What every torch-using piece needs once: dtypes by name, the device, a random batch, a sync.

Library floor: bench, trace, verify and train take these from here instead of keeping their own copies.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import recompute._compat  # noqa: F401  (a torch outside the supported range: one ConfigError, here)
from recompute.core.errors import ConfigError
from recompute.core.table import gib
from recompute.core.workload import AMP, Workload

__all__ = [
    "TORCH_DTYPES",
    "autocast_dtype",
    "available_memory",
    "device_name",
    "forward_autocast",
    "random_batch",
    "require_memory",
    "resolve_device",
    "sync",
]

HEADROOM = 0.9
"""Share of the available memory a run may plan to use (the allocator, the interpreter and torch need the rest)."""

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""recompute's dtype names (``Workload.dtype``) and the torch dtypes they mean."""


def autocast_dtype(wl: Workload) -> torch.dtype | None:
    """The dtype a step of ``wl`` autocasts its forward to (``precision`` amp: ``wl.dtype``); None: no autocast."""
    return TORCH_DTYPES[wl.dtype] if wl.precision == AMP else None


def forward_autocast(dtype: torch.dtype | None, device: str | torch.device) -> contextlib.AbstractContextManager[Any]:
    """What a step's forward and loss run under: ``torch.autocast`` to ``dtype`` on ``device``'s type (HF
    Trainer's, Lightning's and accelerate's placement: the backward and the optimizer step outside it), or
    nothing for ``dtype`` None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def resolve_device(name: str) -> str:
    """``name`` if this PyTorch can run there; a ConfigError for CUDA without CUDA or an unknown device."""
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {name!r}", fields=("device",))
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device cuda needs a CUDA build of PyTorch and a GPU, and this machine has none; use device cpu "
            "(a CPU step keeps its dropout masks in the activation dtype)",
            fields=("device",),
        )
    return name


def device_name(device: str) -> str:
    """The GPU's name, or ``cpu (N threads)``."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def random_batch(
    vocab: int, micro_batch: int, seq_len: int, *, device: str | torch.device = "cpu", seed: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(idx, targets)``: two (b, s) tensors of token ids below ``vocab``, from ``seed`` when given."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (micro_batch, seq_len)
    idx, targets = (torch.randint(vocab, shape, generator=g) for _ in range(2))
    return idx.to(device), targets.to(device)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a timer reads the work's end."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def available_memory(device: str) -> int:
    """Bytes a new allocation can use now: free device memory on a GPU, ``MemAvailable`` of the host on the CPU."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def require_memory(need: float, device: str, *, what: str, fix: str, fields: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, a run whose predicted memory ``need`` exceeds what ``device`` has free.

    Raises:
        ConfigError: ``need`` is over ``HEADROOM`` of ``available_memory(device)``; the message gives both
            figures and ``fix``.
    """
    have = available_memory(device)
    if need > HEADROOM * have:
        raise ConfigError(
            f"{what} needs about {gib(need)} but {gib(have)} is available on {device}; {fix}", fields=fields
        )
