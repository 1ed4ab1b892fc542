"""``TrainConfig``: one training run, a ``Workload`` plus the run's own options, each declared once (the CLI
is generated from these fields and from ``Workload``'s).

``--micro-batch`` is what it is in every command: the sequences of one micro-batch on each data-parallel rank
(``b``); a run over ``--dp`` ranks takes ``b x dp`` sequences per micro-batch in all.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from recompute.core.errors import ConfigError, one_of, positive_int, require, torch_seed
from recompute.core.workload import AMP, LIMITS, Workload, workload_fields

__all__ = [
    "MAX_SAMPLE_TOKENS",
    "RESUME_MUST_MATCH",
    "TRAIN_WORKLOAD",
    "WORKLOAD_DEFAULTS",
    "TrainConfig",
    "flag",
    "resolve_auto",
    "resolved_workload",
]

MAX_SAMPLE_TOKENS = 2**16
"""The longest sample ``--sample-tokens`` generates at the end of a run (one forward per token)."""

TRAIN_WORKLOAD = ("micro_batch", "seq_len", "dtype", "attention", "loss", "loss_chunk", "device", "tp", "sp", "dp")
"""The workload fields a run takes (the others, pipelining, experts, another precision, describe runs that
``recompute train`` does not make)."""

WORKLOAD_DEFAULTS: dict[str, Any] = {"micro_batch": 8, "seq_len": 256, "dtype": "auto", "device": "auto"}
"""The run's workload defaults where they differ from ``Workload``'s, sizes a CPU trains in seconds.
``device`` auto: cuda when torch sees one, else cpu; ``dtype`` auto: bf16 (autocast) on cuda, fp32 on cpu."""


def resolve_auto(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (workload fields) with an ``auto`` device and dtype resolved: cuda when torch sees one, else
    cpu; bf16 (autocast) on cuda, fp32 on cpu. Torch is imported only where something is ``auto``."""
    out = dict(values)
    if out.get("device") == "auto":
        import torch

        out["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if out.get("dtype") == "auto":
        out["dtype"] = "bf16" if out.get("device") == "cuda" else "fp32"
    return out


def resolved_workload(**values: Any) -> Workload:
    """The run's ``Workload`` from ``values`` (workload field names) over ``WORKLOAD_DEFAULTS``, ``auto`` resolved;
    a 16-bit dtype is the amp precision a run trains in (autocast over fp32 weights)."""
    given = {k: v for k, v in values.items() if v is not None or k == "loss_chunk"}
    resolved = resolve_auto({**WORKLOAD_DEFAULTS, **given})
    if resolved.get("dtype") != "fp32":
        resolved.setdefault("precision", AMP)
    return Workload(**resolved)


def _opt(flag: str, help: str, **extra: Any) -> dict[str, Any]:
    return {"flag": flag, "help": help, **extra}


@dataclass(frozen=True)
class TrainConfig:
    """One training run of a model (a preset, a transformers config.json, a factory) with a recomputation policy:
    its ``workload`` (micro-batch per rank, sequence, dtype, attention, loss mode, device, tp/sp/dp) and the run's
    own options. ``TrainConfig.of(**flat)`` takes both kinds of field by name."""

    model: str = field(
        default="gpt2",
        metadata=_opt(
            "--model",
            "preset (resized by --layers/--hidden/--heads), hf:NAME, a transformers config.json (or its folder) or "
            "package.module:factory (trained as it is: the class it names)",
        ),
    )
    workload: Workload = field(default_factory=resolved_workload)
    n_layers: int | None = field(default=4, metadata=_opt("--layers", "layers (overrides the preset; 0 keeps it)"))
    hidden: int | None = field(default=256, metadata=_opt("--hidden", "hidden size (overrides; 0 keeps it)"))
    n_heads: int | None = field(default=4, metadata=_opt("--heads", "attention heads (overrides; 0 keeps it)"))
    dropout: float | None = field(
        default=None, metadata=_opt("--dropout", "dropout probability (overrides the preset's)")
    )
    policy: str = field(default="none", metadata=_opt("--policy", "recompute policy name, or a plan JSON file"))
    data: str | None = field(default=None, metadata=_opt("--data", "a text file or a directory of .txt files"))
    dataset: str | None = field(default=None, metadata=_opt("--dataset", "a Hugging Face dataset name[:split]"))
    tokenizer: str = field(
        default="byte",
        metadata=_opt("--tokenizer", "byte (no training) or bpe (trained on the corpus)", choices=("byte", "bpe")),
    )
    steps: int = field(default=200, metadata=_opt("--steps", "optimizer steps"))
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

    def __post_init__(self) -> None:
        require(isinstance(self.workload, Workload), f"workload must be a Workload, got {self.workload!r}")
        for name in ("steps", "keep"):
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
        one_of("--tokenizer", self.tokenizer, ("byte", "bpe"))
        if self.dropout is not None:
            require(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        require(
            not (self.resume and self.overwrite),
            "--resume continues the run in --out and --overwrite deletes it; give one of them",
        )
        _check_runnable(self.workload)

    # The workload's figures a run reads most, by their names.
    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch on each data-parallel rank."""
        return self.workload.micro_batch

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len

    @property
    def tp(self) -> int:
        return self.workload.tp

    @property
    def dp(self) -> int:
        return self.workload.dp

    @property
    def parallel(self) -> bool:
        """Whether the run spans several processes (``tp * dp > 1``, launched with torchrun)."""
        return self.workload.tp * self.workload.dp > 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, over every data-parallel rank."""
        return self.workload.micro_batch * self.workload.dp * self.workload.seq_len * self.grad_accum

    @classmethod
    def of(cls, **values: Any) -> TrainConfig:
        """A config from flat names: ``TrainConfig.of(model="gpt2", seq_len=64, steps=10)`` (the run's fields and
        the workload's; workload fields not given take ``WORKLOAD_DEFAULTS``, then ``Workload``'s).

        Raises:
            ConfigError: a name that is neither a run option nor a workload field.
        """
        known = {f.name for f in dataclasses.fields(cls)} - {"workload"}
        unknown = sorted(set(values) - known - set(TRAIN_WORKLOAD) - {f.name for f in workload_fields()})
        if unknown:
            raise ConfigError(
                f"TrainConfig has no field {unknown[0]!r}; its fields: {', '.join(sorted(known))}, and the "
                f"workload's {', '.join(TRAIN_WORKLOAD)}"
            )
        wl = {k: v for k, v in values.items() if k not in known}
        return cls(workload=resolved_workload(**wl), **{k: v for k, v in values.items() if k in known})

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with some fields changed, the workload's by their names (``replace(dp=2, micro_batch=2)``)."""
        wl = {k: changes.pop(k) for k in list(changes) if k in {f.name for f in workload_fields()}}
        return dataclasses.replace(self, workload=dataclasses.replace(self.workload, **wl), **changes)

    def to_dict(self) -> dict[str, Any]:
        """The run's options and the workload's fields, flat (a checkpoint records them; ``of`` reads them back)."""
        run = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "workload"}
        return {**run, **self.workload.to_dict()}

    def command_line(self) -> list[str]:
        """``["train", options...]``: the arguments of ``recompute`` that give this config (the run's options that
        differ from their defaults; the workload's fields that ``train`` takes, ``device`` and ``dtype`` always)."""
        args = ["train"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "workload" or value == f.default:
                continue
            if isinstance(value, bool):
                args += [f.metadata["flag"]] if value else []
            else:  # None where the default is not: the size overrides, whose "keep the preset's" is 0
                args += [f.metadata["flag"], "0" if value is None else str(value)]
        defaults = Workload().to_dict()
        for f in workload_fields():
            value = getattr(self.workload, f.name)
            if f.name not in TRAIN_WORKLOAD or (value == defaults[f.name] and f.name not in WORKLOAD_DEFAULTS):
                continue
            args += [f.metadata["flag"]] if isinstance(value, bool) else [f.metadata["flag"], str(value)]
        return args


def _check_runnable(wl: Workload) -> None:
    """What ``recompute train`` runs of a workload: tp, sp, dp and one precision per dtype.

    Raises:
        ConfigError: a workload field a run does not take, or sp without tp.
    """
    require(wl.tp > 1 or not wl.sp, "--sp splits the sequence over the --tp ranks; give --tp > 1 or drop --sp")
    require(
        wl.dtype != "fp16",
        "--dtype fp16 would need a gradient scaler, which train does not run; use --dtype bf16 (autocast, no "
        "scaler needed) or fp32",
        fields=("dtype",),
    )
    expected = "fp32" if wl.dtype == "fp32" else AMP
    how = "fp32 throughout" if expected == "fp32" else "autocast over fp32 weights"
    require(
        wl.precision == expected,
        f"train runs --dtype {wl.dtype} as {expected} precision ({how}), not {wl.precision}; drop --precision",
        fields=("precision",),
    )
    for name, value in (("pp", wl.pp), ("interleave", wl.interleave), ("ep", wl.ep)):
        require(value == 1, f"train runs tensor and data parallelism, not {name} {value}; drop it", fields=(name,))
    require(not wl.keep_grads, "train frees gradients after each step (zero_grad); drop keep_grads")
    require(
        wl.n_microbatches is None and wl.capacity_factor == 1.0,
        "train takes --grad-accum for micro-batches per step; drop n_microbatches and capacity_factor",
    )
    wl.check_loss_chunk()


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
    "dtype",
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
    """The CLI flag of a TrainConfig field or of a workload field."""
    fields = [f for f in dataclasses.fields(TrainConfig) if f.name != "workload"] + list(workload_fields())
    return str(next(f.metadata["flag"] for f in fields if f.name == name))
