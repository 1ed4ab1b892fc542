"""GPUs as data rows: memory, peak dense bf16 FLOP/s, and how much of the memory a training step can use.

Each row names its sources. ``memory`` is the total the driver reports (``nvidia-smi``'s ``memory.total``,
which is also what ``torch.cuda.get_device_properties(i).total_memory`` reports), not the marketing figure:
an "80GB" H100 reports 81559 MiB. ``peak_bf16`` is the dense (no 2:4 sparsity) bf16 tensor-core rate with
fp32 accumulation from the vendor's datasheet. Torch-free: the planner and the report read this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute.core.errors import ConfigError
from recompute.core.table import GiB, MiB

__all__ = ["CONTEXT_RESERVE", "FRAGMENTATION", "GPU", "GPUS", "gpu_by_name", "usable_bytes"]


CONTEXT_RESERVE = 1 * GiB
"""Bytes the step cannot use whatever it does: the CUDA context (about 0.5 GiB with PyTorch's kernels loaded
on a Hopper GPU), cuBLAS/cuDNN workspaces and the allocator's first blocks. A stated allowance, not a
measurement of any one machine; NCCL buffers of a multi-GPU job come on top."""

FRAGMENTATION = 0.05
"""Share of the memory that PyTorch's caching allocator loses to fragmentation in a long training run: blocks
cached but not reusable for the next size asked for. An allowance; ``expandable_segments`` lowers it."""

_SMI = "nvidia-smi memory.total as logged publicly"
_MODAL = "nvidia-smi memory.total per GPU type, modal-labs/modal-client PR #2797"


@dataclass(frozen=True)
class GPU:
    """One accelerator model."""

    name: str
    """Lower-case id used on the command line, e.g. ``h100-80gb``."""
    memory: int
    """Total device memory in bytes, as the driver reports it."""
    peak_bf16: float
    """Peak dense bf16 tensor-core FLOP/s (fp32 accumulation), from the datasheet."""
    label: str
    """Marketing name."""
    source: str
    """Where ``memory`` and ``peak_bf16`` come from."""


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU(
            "h100-80gb",
            81559 * MiB,
            989.4e12,
            "NVIDIA H100 SXM5 80GB",
            f"{_MODAL}; NVIDIA H100 datasheet (BF16 1,979 TFLOPS with sparsity)",
        ),
        GPU(
            "h200-141gb",
            143771 * MiB,
            989.4e12,
            "NVIDIA H200 141GB",
            f"{_SMI} (H200 NVL); NVIDIA H200 datasheet (BF16 1,979 TFLOPS with sparsity, SXM)",
        ),
        GPU(
            "a100-80gb",
            81920 * MiB,
            312e12,
            "NVIDIA A100 SXM4 80GB",
            f"{_MODAL}; NVIDIA A100 datasheet (BF16 312 TFLOPS, 624 with sparsity)",
        ),
        GPU(
            "a100-40gb",
            40960 * MiB,
            312e12,
            "NVIDIA A100 40GB",
            f"{_MODAL}; NVIDIA A100 datasheet (BF16 312 TFLOPS, 624 with sparsity)",
        ),
        GPU(
            "l40s-48gb",
            46068 * MiB,
            362.05e12,
            "NVIDIA L40S 48GB",
            f"{_MODAL}; NVIDIA L40S datasheet (BF16 362.05 TFLOPS, 733 with sparsity)",
        ),
        GPU(
            "rtx4090-24gb",
            24564 * MiB,
            165.2e12,
            "NVIDIA GeForce RTX 4090 24GB",
            f"{_SMI} (RLinf/RLinf issue #255); NVIDIA Ada Lovelace whitepaper (BF16 with FP32 accumulate 165.2 TFLOPS)",
        ),
    )
}


def gpu_by_name(name: str | GPU) -> GPU:
    """The GPU row for ``name`` (case-insensitive); a GPU passes through.

    Raises:
        ConfigError: unknown name; the message lists the known GPUs.
    """
    if isinstance(name, GPU):
        return name
    key = name.strip().lower()
    if key not in GPUS:
        raise ConfigError(f"{name!r} is not a known GPU; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]


def usable_bytes(gpu: str | GPU, *, context: float = CONTEXT_RESERVE, fragmentation: float = FRAGMENTATION) -> float:
    """Bytes a training step may plan to use on ``gpu``: memory - context - fragmentation * memory.

    Example: an H100 80GB reports 79.65 GiB; less 1 GiB of context and 5 % for fragmentation leaves 74.67 GiB.

    Raises:
        ConfigError: unknown GPU name, or a reserve that leaves nothing.
    """
    row = gpu_by_name(gpu)
    usable = row.memory - context - fragmentation * row.memory
    if usable <= 0 or not 0 <= fragmentation < 1:
        raise ConfigError(
            f"the reserve (context {context / GiB:.2f} GiB, fragmentation {fragmentation:.0%}) leaves no memory "
            f"on {row.name}; lower it"
        )
    return usable
