"""``TrainConfig``: every option of ``recompute train``, declared once (the CLI is generated from it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from recompute.core.errors import one_of, positive_int, require, torch_seed
from recompute.core.workload import ATTENTIONS, LIMITS, LOSSES

__all__ = ["MAX_SAMPLE_TOKENS", "RESUME_MUST_MATCH", "TrainConfig"]

MAX_SAMPLE_TOKENS = 2**16
"""The longest sample ``--sample-tokens`` generates at the end of a run (one forward per token)."""


def _opt(flag: str, help: str, **extra: Any) -> dict[str, Any]:
    return {"flag": flag, "help": help, **extra}


@dataclass(frozen=True)
class TrainConfig:
    """One training run of a model (a preset, a transformers config.json, a factory) with a recomputation policy."""

    model: str = field(
        default="gpt2",
        metadata=_opt(
            "--model",
            "preset (resized by --layers/--hidden/--heads), hf:NAME, a transformers config.json (or its folder) or "
            "package.module:factory (trained as it is: the class it names)",
        ),
    )
    n_layers: int | None = field(default=4, metadata=_opt("--layers", "layers (overrides the preset; 0 keeps it)"))
    hidden: int | None = field(default=256, metadata=_opt("--hidden", "hidden size (overrides; 0 keeps it)"))
    n_heads: int | None = field(default=4, metadata=_opt("--heads", "attention heads (overrides; 0 keeps it)"))
    attention: str = field(
        default="flash", metadata=_opt("--attention", "flash (SDPA, the default) or eager", choices=ATTENTIONS)
    )
    dropout: float | None = field(
        default=None, metadata=_opt("--dropout", "dropout probability (overrides the preset's)")
    )
    policy: str = field(default="none", metadata=_opt("--policy", "recompute policy name, or a plan JSON file"))
    loss: str = field(
        default="full",
        metadata=_opt(
            "--loss",
            "full, or chunked: the output layer and the loss over chunks of --loss-chunk tokens, each chunk's "
            "logits recomputed in the backward",
            choices=LOSSES,
        ),
    )
    loss_chunk: int | None = field(
        default=None,
        metadata=_opt("--loss-chunk", "tokens per chunk with --loss chunked (default: 256 MiB of fp32 logits)"),
    )
    data: str | None = field(default=None, metadata=_opt("--data", "a text file or a directory of .txt files"))
    dataset: str | None = field(default=None, metadata=_opt("--dataset", "a Hugging Face dataset name[:split]"))
    tokenizer: str = field(
        default="byte",
        metadata=_opt("--tokenizer", "byte (no training) or bpe (trained on the corpus)", choices=("byte", "bpe")),
    )
    steps: int = field(default=200, metadata=_opt("--steps", "optimizer steps"))
    seq_len: int = field(default=256, metadata=_opt("--seq-len", "tokens per sequence"))
    micro_batch: int = field(
        default=8, metadata=_opt("--micro-batch", "sequences per micro-batch (over all --dp ranks together)")
    )
    grad_accum: int = field(default=1, metadata=_opt("--grad-accum", "micro-batches per optimizer step"))
    lr: float = field(default=1e-3, metadata=_opt("--lr", "peak learning rate (AdamW)"))
    warmup: int = field(default=20, metadata=_opt("--warmup", "linear warm-up steps before the cosine decay"))
    weight_decay: float = field(default=0.1, metadata=_opt("--weight-decay", "AdamW weight decay on matrices"))
    grad_clip: float = field(default=1.0, metadata=_opt("--grad-clip", "gradient-norm clip (0 disables)"))
    seed: int = field(default=1337, metadata=_opt("--seed", "seed for weights, data order and dropout"))
    out: str = field(default="runs/train", metadata=_opt("--out", "directory for metrics, checkpoints, sample"))
    checkpoint_every: int = field(
        default=100, metadata=_opt("--checkpoint-every", "steps between checkpoints (one is always written at the end)")
    )
    keep: int = field(default=2, metadata=_opt("--keep", "checkpoints to keep"))
    resume: bool = field(default=False, metadata=_opt("--resume", "continue from the newest checkpoint in --out"))
    overwrite: bool = field(
        default=False,
        metadata=_opt("--overwrite", "delete the run already in --out (metrics, checkpoints, sample) and start over"),
    )
    sample_tokens: int = field(default=200, metadata=_opt("--sample-tokens", "tokens to generate at the end"))
    device: str = field(default="auto", metadata=_opt("--device", "cpu, cuda or auto", choices=("auto", "cpu", "cuda")))
    tp: int = field(default=1, metadata=_opt("--tp", "tensor-parallel ranks (launch with torchrun)"))
    sp: bool = field(default=False, metadata=_opt("--sp", "sequence parallelism over the --tp ranks"))
    dp: int = field(default=1, metadata=_opt("--dp", "data-parallel (FSDP2) ranks (launch with torchrun)"))

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "micro_batch", "keep", "tp", "dp"):
            positive_int(flag(name), getattr(self, name))
        positive_int("--grad-accum", self.grad_accum, at_most=LIMITS["micro_batch"])  # 10**11: a step never ends
        for name in ("warmup", "checkpoint_every", "sample_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"{flag(name)} must be >= 0, got {value!r}")
        require(
            self.sample_tokens <= MAX_SAMPLE_TOKENS,
            f"--sample-tokens must be at most {MAX_SAMPLE_TOKENS:,} (a sample, generated one token at a time), "
            f"got {self.sample_tokens:,}",
        )
        require(self.lr > 0 and math.isfinite(self.lr), f"--lr must be a finite number > 0, got {self.lr}")
        for name in ("weight_decay", "grad_clip"):  # inf or nan: "the loss became nan ... lower --lr"
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, f"{flag(name)} must be a finite number >= 0, got {value}")
        torch_seed("--seed", self.seed)
        one_of("--attention", self.attention, ATTENTIONS)
        one_of("--tokenizer", self.tokenizer, ("byte", "bpe"))
        one_of("--device", self.device, ("auto", "cpu", "cuda"))
        one_of("--loss", self.loss, LOSSES)
        if self.loss_chunk is not None:
            positive_int("--loss-chunk", self.loss_chunk)
            require(self.loss == "chunked", "--loss-chunk sets the chunk of --loss chunked; add --loss chunked")
            tokens = self.micro_batch // self.dp * self.seq_len
            require(
                self.loss_chunk <= tokens,
                f"--loss-chunk {self.loss_chunk} is more than the {tokens} tokens of a micro-batch on one rank "
                f"(--micro-batch / --dp x --seq-len); use --loss-chunk <= {tokens}",
            )
        if self.dropout is not None:
            require(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        require(
            not (self.resume and self.overwrite),
            "--resume continues the run in --out and --overwrite deletes it; give one of them",
        )
        require(self.tp > 1 or not self.sp, "--sp splits the sequence over the --tp ranks; give --tp > 1 or drop --sp")
        require(
            self.micro_batch % self.dp == 0,
            f"--micro-batch {self.micro_batch} is split over --dp {self.dp} ranks; use a multiple of {self.dp}",
        )

    @property
    def parallel(self) -> bool:
        """Whether the run spans several processes (``tp * dp > 1``, launched with torchrun)."""
        return self.tp * self.dp > 1

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def command_line(self) -> list[str]:
        """``["train", options...]``: the arguments of ``recompute`` that give this config (non-defaults only)."""
        args = ["train"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                args += [f.metadata["flag"]] if value else []
            else:  # None where the default is not: the size overrides, whose "keep the preset's" is 0
                args += [f.metadata["flag"], "0" if value is None else str(value)]
        return args


# What a resumed run must share with the run that wrote the checkpoint for its losses to continue exactly.
RESUME_MUST_MATCH = (
    "model",
    "n_layers",
    "hidden",
    "n_heads",
    "attention",
    "dropout",
    "data",
    "dataset",
    "tokenizer",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "lr",
    "warmup",
    "weight_decay",
    "grad_clip",
    "seed",
    "tp",
    "sp",
    "dp",
)


def flag(name: str) -> str:
    """The CLI flag of a TrainConfig field."""
    return str(next(f.metadata["flag"] for f in dataclasses.fields(TrainConfig) if f.name == name))
