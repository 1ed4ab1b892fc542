"""What every torch-using piece needs once: dtypes by name, the device, a random batch, a sync.

Library floor: bench, trace, verify and train take these from here instead of keeping their own copies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recompute.core.errors import ConfigError

__all__ = ["TORCH_DTYPES", "device_name", "random_batch", "resolve_device", "sync"]

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""recompute's dtype names (``Workload.dtype``) and the torch dtypes they mean."""


def resolve_device(name: str) -> str:
    """``name`` if this PyTorch can run there; a ConfigError for CUDA without CUDA or an unknown device."""
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device cuda needs a CUDA build of PyTorch and a GPU, and this machine has none; use device cpu "
            "(a CPU step keeps its dropout masks in the activation dtype)"
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
