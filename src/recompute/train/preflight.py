"""Memory preflight of a training run: refuse, before the model is built, a run the device cannot hold.

``bench`` and ``verify`` check their steps against the free memory before they start (``runtime.require_memory``);
``train`` and ``compare-train`` do the same here, with the largest micro-batch and the longest sequence that
would fit in the message. A preset is priced by the analytic model (``recompute estimate``) of the step train
runs: fp32 weights, gradients and AdamW state (16 B/param), activations in fp32 on the CPU and under bf16
autocast on a GPU, the policy and loss mode asked for. A transformers config or a factory has no formula here,
so its bound is what it holds at least: 16 bytes per parameter (counted on the meta device) and the fp32
logits of a micro-batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import nn

from recompute.core.analytic import estimate
from recompute.core.errors import ConfigError
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec
from recompute.core.table import gib
from recompute.core.workload import Workload
from recompute.runtime import HEADROOM, available_memory
from recompute.train.config import TrainConfig

__all__ = ["check_train_memory", "preset_need", "source_need"]

STATE_BYTES = 16
"""fp32 weights (4), gradients (4) and AdamW's m and v (8) per parameter: what ``train`` keeps."""


def _workload(spec: ModelSpec, config: TrainConfig, device: str, micro_batch: int, seq_len: int) -> Workload:
    """The step one rank of ``train`` runs, as the analytic model takes it."""
    return Workload(
        micro_batch=micro_batch,
        seq_len=seq_len,
        dtype=config.workload.dtype,
        precision="fp32",
        attention=config.workload.attention,
        device="cpu" if device == "cpu" else "cuda",
        tp=config.tp,
        sp=config.workload.sp,
        loss=config.workload.loss,
        loss_chunk=config.workload.loss_chunk,
    )


def preset_need(spec: ModelSpec, config: TrainConfig, device: str, *, micro_batch: int, seq_len: int) -> float:
    """Bytes one rank of ``train`` holds at its peak: the analytic peak of the step under the run's policy,
    with the model's states sharded over the data-parallel ranks (FSDP2).

    Raises:
        ConfigError: the policy does not fit the model (a plan for another model, ...).
    """
    wl = _workload(spec, config, device, micro_batch, seq_len)
    est = estimate(spec, wl, Policy.parse(config.policy))
    return est.peak - est.states.total * (1 - 1 / config.dp)


def source_need(model: nn.Module, vocab: int, *, micro_batch: int, seq_len: int) -> float:
    """The least a transformers config's or a factory's run holds: 16 bytes per parameter of ``model`` (built
    on the meta device) and a micro-batch's fp32 logits."""
    params = sum(p.numel() for p in model.parameters())
    return float(STATE_BYTES * params + 4 * micro_batch * seq_len * vocab)


def check_train_memory(need: Callable[[int, int], float], config: TrainConfig, device: str) -> None:
    """Refuse, before the model is built, a run whose memory ``need(micro_batch, seq_len)`` is over
    ``HEADROOM`` of what ``device`` has free, saying the largest micro-batch and the longest sequence that would
    fit. On the CPU the ranks torchrun starts on this host share its memory.

    Raises:
        ConfigError: the run does not fit (one line, with the figures and the fix).
    """
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device == "cpu" else 1
    have = HEADROOM * available_memory(device) / max(1, ranks)
    total = need(config.micro_batch, config.seq_len)
    if total <= have:
        return
    per = f" per rank ({ranks} on this host)" if ranks > 1 else ""
    raise ConfigError(
        f"train needs about {gib(total)}{per} but {gib(have / HEADROOM)} is available on {device}; "
        f"{_fix(need, config, have)}"
    )


def _fits(need: Callable[[int, int], float], micro_batch: int, seq_len: int, have: float) -> bool:
    try:
        return need(micro_batch, seq_len) <= have
    except ConfigError:  # a shape the model does not take (a sequence the tensor-parallel ranks cannot split)
        return False


def _fix(need: Callable[[int, int], float], config: TrainConfig, have: float) -> str:
    """The largest micro-batch (at this sequence) and the longest sequence (at this micro-batch) that fit."""
    fits = []
    if _fits(need, 1, config.seq_len, have):
        low, high = 1, config.micro_batch  # low fits, high does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if _fits(need, mid, config.seq_len, have) else (low, mid)
        fits.append(f"--micro-batch {low} or less (at --seq-len {config.seq_len})")
    s = config.seq_len // 2
    while s >= 16 and not _fits(need, config.micro_batch, s, have):
        s //= 2
    if s >= 16:
        fits.append(f"--seq-len {s} or less (at --micro-batch {config.micro_batch})")
    if fits:
        return "use " + ", or ".join(fits)
    return "even one short sequence does not fit: use a smaller model (--layers, --hidden) or a device with more memory"
