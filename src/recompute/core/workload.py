"""``Workload``: how a model is trained (batch, sequence, precision, parallelism), declared once.

Each field carries its CLI flag and help text in its metadata, so the command line is generated from this
class and no option is written twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from recompute.core.errors import ConfigError, one_of, positive_int, require
from recompute.core.spec import ModelSpec

__all__ = [
    "AMP",
    "ATTENTIONS",
    "DTYPE_BYTES",
    "LOSSES",
    "PRECISIONS",
    "Workload",
    "build_workload",
    "check_head_split",
    "check_sequence_split",
    "default_loss_chunk",
    "default_precision",
    "loss_chunk_tokens",
    "one_device",
    "parallel_sizes",
    "step_dtype",
    "workload_fields",
]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

LIMITS = {
    "micro_batch": 2**20,
    "seq_len": 2**24,
    "tp": 2**16,
    "pp": 2**16,
    "interleave": 2**10,
    "dp": 2**20,
    "ep": 2**16,
}
"""The largest value each size field takes (far beyond any real run: larger means a typo, e.g. 1e30)."""

ATTENTIONS = ("eager", "flash")
"""``eager``: the attention math written out (saves the s^2 softmax); ``flash``: SDPA / FlashAttention."""

_FP16_REASON = (
    "dtype fp16 with the chunked loss: it takes its gradients in the forward, before a scaler scales them, and "
    "in fp16 they would underflow; use dtype bf16 (no scaler needed) or the full loss"
)
"""Why the chunked loss refuses fp16 (``recompute.chunked_loss``)."""

LOSSES = ("full", "chunked")
"""``full``: the (b, s, v) logits at once; ``chunked``: the output layer and cross-entropy over token chunks,
each chunk's gradients taken in the forward while its logits live (``recompute.apply(..., loss="chunked")``)."""

LOSS_CHUNK_BYTES = 256 * 2**20
"""The default chunk: the most tokens (a power of two) whose fp32 logits take at most this many bytes."""

PRECISIONS = {
    "fp32": "fp32 weights, fp32 gradients, fp32 Adam m and v: 4 + 4 + 8 = 16 B/param (the workshop's figure)",
    "mixed": "16-bit weights, fp32 gradients, fp32 master weights, Adam: 2 + 4 + 4 + 8 = 18 B/param (Megatron)",
    "distributed": "mixed precision with the optimizer sharded over d data-parallel ranks (ZeRO-1): 6 + 12/d",
    "bf16": "bf16 weights, gradients and Adam states: 2 + 2 + 4 = 8 B/param",
    "amp": "autocast to --dtype (bf16 or fp16) over fp32 weights, gradients and Adam: 4 + 4 + 8 = 16 B/param, and "
    "autocast's own casts in the activations (HF Trainer bf16=True, Lightning bf16-mixed, accelerate bf16)",
}
"""Precision modes: what the parameters, gradients and optimizer state are kept in (and, for ``amp``, how the
forward runs). ``docs/precision.md`` says which mode each training stack's setting is."""

AMP = "amp"
"""The precision mode that runs the forward under ``torch.autocast`` over fp32 weights: traced as itself (its
activations are autocast's), where the other modes run one dtype and only price the model states."""


def step_dtype(dtype: object, precision: object = None) -> str:
    """How a step runs its dtype, in words: ``bf16``, or ``bf16 autocast (fp32 weights)`` under amp."""
    return f"{dtype} autocast (fp32 weights)" if precision == AMP else str(dtype)


def _opt(flag: str, help: str, **extra: Any) -> dict[str, Any]:
    return {"flag": flag, "help": help, **extra}


@dataclass(frozen=True)
class Workload:
    """One training step's shape: micro-batch, sequence, precision and parallelism."""

    micro_batch: int = field(
        default=1, metadata=_opt("--micro-batch", "b: sequences per micro-batch on each data-parallel rank")
    )
    seq_len: int = field(default=2048, metadata=_opt("--seq-len", "s: tokens per sequence"))
    dtype: str = field(default="bf16", metadata=_opt("--dtype", "activation dtype", choices=tuple(DTYPE_BYTES)))
    tp: int = field(default=1, metadata=_opt("--tp", "t: tensor-parallel size"))
    sp: bool = field(default=False, metadata=_opt("--sp", "sequence parallelism (needs t > 1 to matter)"))
    pp: int = field(default=1, metadata=_opt("--pp", "p: pipeline-parallel size"))
    interleave: int = field(
        default=1, metadata=_opt("--interleave", "m: model chunks per pipeline rank (interleaved schedule)")
    )
    n_microbatches: int | None = field(
        default=None, metadata=_opt("--microbatches", "micro-batches per step (default: p, a full pipeline)")
    )
    dp: int = field(default=1, metadata=_opt("--dp", "d: data-parallel size (shards the distributed optimizer)"))
    fsdp: bool = field(
        default=False,
        metadata=_opt(
            "--fsdp",
            "FSDP2 full shard (fully_shard) over the --dp ranks: parameters, gradients and optimizer state 1/d on "
            "each rank, a layer's parameters gathered for its forward and its backward; with --precision mixed "
            "or amp, fp32 shards gathered in --dtype (MixedPrecisionPolicy, fp32 gradient reduction)",
        ),
    )
    ep: int = field(
        default=1, metadata=_opt("--ep", "expert-parallel size: each rank holds E/ep experts of an MoE model")
    )
    capacity_factor: float = field(
        default=1.0,
        metadata=_opt(
            "--capacity-factor",
            "tokens an expert rank receives, as a multiple of the expected load of even routing (1); at most "
            "ep*min(k, E/ep)/k, the worst case without a cap",
        ),
    )
    precision: str | None = field(
        default=None,
        metadata=_opt(
            "--precision",
            "parameter/gradient/optimizer mode (default: fp32 for --dtype fp32, else mixed); amp: autocast to --dtype "
            "over fp32 weights, the step HF Trainer, Lightning and accelerate run",
            choices=tuple(PRECISIONS),
        ),
    )
    attention: str = field(
        default="flash",
        metadata=_opt(
            "--attention",
            "eager stores the s^2 softmax; flash (SDPA/FlashAttention) stores only a per-row log-sum-exp",
            choices=ATTENTIONS,
        ),
    )
    keep_grads: bool = field(
        default=False,
        metadata=_opt(
            "--keep-grads",
            "gradients stay allocated between steps (zero_grad(set_to_none=False), DDP/Megatron buffers); "
            "by default they are freed, as PyTorch's zero_grad() does",
        ),
    )
    loss: str = field(
        default="full",
        metadata=_opt(
            "--loss",
            "full: the logits of every token at once; chunked: the output layer and the loss over chunks of "
            "--loss-chunk tokens, each chunk's gradients taken in the forward (the logits never all alive)",
            choices=LOSSES,
        ),
    )
    loss_chunk: int | None = field(
        default=None,
        metadata=_opt(
            "--loss-chunk",
            "tokens per chunk with --loss chunked (default: the most, a power of two, whose fp32 logits fit 256 "
            "MiB: 512 for a 128256 vocabulary; at most b*s)",
        ),
    )
    device: str = field(
        default="cuda",
        metadata=_opt(
            "--device",
            "where the step runs: cuda keeps 1-byte dropout masks, cpu keeps them in the activation dtype",
            choices=("cuda", "cpu"),
        ),
    )

    def __post_init__(self) -> None:
        for name, limit in LIMITS.items():
            positive_int(name, getattr(self, name), at_most=limit)
        if self.n_microbatches is not None:
            positive_int("n_microbatches", self.n_microbatches)
        one_of("dtype", self.dtype, tuple(DTYPE_BYTES))
        one_of("attention", self.attention, ATTENTIONS)
        one_of("device", self.device, ("cuda", "cpu"))
        one_of("loss", self.loss, LOSSES)
        require(not (self.loss == "chunked" and self.dtype == "fp16"), _FP16_REASON, fields=("dtype",))
        if self.loss_chunk is not None:
            positive_int("loss_chunk", self.loss_chunk)
            require(
                self.loss == "chunked",
                f"loss_chunk {self.loss_chunk} needs loss chunked; add loss chunked or drop loss_chunk",
                fields=("loss_chunk", "loss"),
            )
        if self.precision is None:
            object.__setattr__(self, "precision", "fp32" if self.dtype == "fp32" else "mixed")
        one_of("precision", self.precision, tuple(PRECISIONS))
        require(
            self.precision != AMP or self.dtype != "fp32",
            "precision amp autocasts to a 16-bit dtype over fp32 weights; use dtype bf16 (or fp16), or precision fp32",
            fields=("precision", "dtype"),
        )
        require(
            not self.fsdp or self.dp > 1,
            f"fsdp shards over the dp ranks; give dp 2 or more (got {self.dp})",
            fields=("fsdp", "dp"),
        )
        require(
            not (self.fsdp and self.precision == "distributed"),
            "fsdp shards the optimizer state itself (and the parameters and gradients); precision distributed is "
            "ZeRO-1's sharding: drop one",
            fields=("fsdp", "precision"),
        )
        require(
            self.interleave == 1 or self.pp > 1,
            f"interleave {self.interleave} needs pipeline parallelism; set pp > 1 or drop interleave",
            fields=("interleave", "pp"),
        )
        if self.sp:
            check_sequence_split(self.seq_len, self.tp)
        require(
            1.0 <= self.capacity_factor <= 2**16,
            f"capacity_factor must be at least 1 (the expected load), got {self.capacity_factor!r}; "
            "dropping tokens is not modelled",
            fields=("capacity_factor",),
        )

    @property
    def element_bytes(self) -> int:
        """Bytes per activation element (the paper's 2 for 16-bit activations)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def param_dtype(self) -> str:
        """The dtype the parameters are kept in: fp32 under ``amp`` (autocast casts them for each op) and under
        FSDP's mixed precision (``mixed_policy``), else ``dtype`` (a step traced in one dtype;
        ``recompute.core.states`` prices other states)."""
        return "fp32" if self.precision == AMP or self.mixed_policy else self.dtype

    @property
    def mixed_policy(self) -> bool:
        """Whether FSDP2 gathers the fp32 parameters in ``dtype`` for compute (``MixedPrecisionPolicy``):
        ``fsdp`` under ``mixed`` (torchtitan's training: ``reduce_dtype=float32``) and ``amp`` (accelerate's and HF
        Trainer's: ``reduce_dtype`` the dtype too, and autocast besides)."""
        return self.fsdp and self.dtype != "fp32" and self.precision in ("mixed", AMP)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step, resolved."""
        return self.n_microbatches if self.n_microbatches is not None else self.pp

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch, b * s."""
        return self.micro_batch * self.seq_len

    def check_loss_chunk(self) -> None:
        """Raise ConfigError if ``loss_chunk`` is more than the b*s tokens of a micro-batch.

        Asked of what the user gave (the CLI); a model run refuses such a chunk at its first forward, while the
        analytic model, for workloads derived with a shorter sequence (``plan``'s advice, ``report``'s sweeps),
        takes it as one chunk of the whole batch.
        """
        require(
            self.loss_chunk is None or self.loss_chunk <= self.tokens,
            f"loss_chunk {self.loss_chunk} is more than the {self.tokens} tokens of a micro-batch (b*s); "
            f"use loss_chunk <= {self.tokens}",
            fields=("loss_chunk",),
        )

    def check(self, spec: ModelSpec) -> None:
        """Raise ConfigError if this workload cannot run ``spec`` (divisibility, positions, pipeline depth)."""
        p, m, L = self.pp, self.interleave, spec.n_layers
        require(
            self.seq_len <= spec.max_positions,
            f"seq_len {self.seq_len} exceeds {spec.name}'s {spec.max_positions} positions; "
            f"use seq_len <= {spec.max_positions}",
            fields=("seq_len",),
        )
        check_head_split(spec, self.tp)
        require(p <= L, f"pp {p} is larger than the {L} layers of {spec.name}; use pp <= {L}", fields=("pp",))
        require(
            m == 1 or L % (p * m) == 0,
            f"interleave {m} needs the {L} layers to split into p*m = {p * m} equal chunks",
            fields=("interleave",),
        )
        require(
            self.ep == 1 or (spec.n_experts > 0 and spec.n_experts % self.ep == 0),
            f"ep {self.ep} must divide the {spec.n_experts} experts of {spec.name}"
            + ("; use ep = 1 for a dense model" if spec.n_experts == 0 else ""),
            fields=("ep",),
        )
        require(
            self.capacity_factor == 1.0 or spec.n_experts > 0,
            f"capacity_factor {self.capacity_factor:g} sizes the experts' load; {spec.name} is dense (no experts): "
            "drop capacity_factor",
            fields=("capacity_factor",),
        )

    def routed_tokens(self, spec: ModelSpec) -> float:
        """Token copies one expert rank runs through its experts per MoE layer (Note: [expected load]).

        Note: [expected load] each of the ep ranks routes its b*s tokens to k experts each; spread evenly, a
        rank receives b*s*k copies whatever ep is (transformers' grouped-matmul path runs exactly that many
        without expert parallelism). ``capacity_factor`` scales it, up to the worst case of every token of
        all ep ranks choosing this rank's E/ep experts: ep*b*s*min(k, E/ep).
        """
        k, per_rank = spec.top_k, spec.n_experts // self.ep
        worst = self.ep * min(k, per_rank) / k
        return self.tokens * k * min(self.capacity_factor, worst)

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-ready values."""
        return dataclasses.asdict(self)


def check_head_split(spec: ModelSpec, tp: int) -> None:
    """Raise ConfigError unless ``tp`` divides the query and the key/value heads of ``spec``."""
    require(
        spec.n_heads % tp == 0,
        f"tp {tp} must divide the {spec.n_heads} query heads of {spec.name}",
        fields=("tp",),
    )
    require(
        spec.n_kv_heads % tp == 0,
        f"tp {tp} must divide the {spec.n_kv_heads} key/value heads of {spec.name}; use tp <= {spec.n_kv_heads}",
        fields=("tp",),
    )


def check_sequence_split(seq_len: int, tp: int) -> None:
    """Raise ConfigError unless sequence parallelism can split ``seq_len`` positions over ``tp`` ranks."""
    require(
        seq_len % tp == 0,
        f"with sp the sequence length ({seq_len}) must be divisible by tp ({tp}); use a multiple of {tp}",
        fields=("sp", "tp", "seq_len"),
    )


def default_loss_chunk(vocab: int) -> int:
    """Tokens per chunk of the chunked loss when none is given: the most, a power of two, whose fp32 logits
    take at most ``LOSS_CHUNK_BYTES`` (256 MiB): 512 for Llama 3's 128256 tokens, 1024 for GPT-2's 50257.

    Note: [why a byte budget] a chunk should hold enough tokens to keep the output layer's matmul efficient
    and few enough that its logits are small next to the rest of the step; a fixed budget makes the loss
    transient independent of the sequence length.
    """
    tokens = max(1, LOSS_CHUNK_BYTES // (4 * vocab))
    return 1 << (tokens.bit_length() - 1)


def loss_chunk_tokens(loss_chunk: int | None, vocab: int, tokens: int) -> int:
    """Tokens per chunk for a step of ``tokens`` (b*s): ``loss_chunk`` or the default, at most ``tokens``."""
    return min(loss_chunk if loss_chunk is not None else default_loss_chunk(vocab), tokens)


def default_precision(*, preset: bool, dtype: str) -> str | None:
    """The precision mode a workload gets when none is given: ``amp`` for a model recompute traces (a
    transformers config, a factory: trained by HF Trainer, Lightning or accelerate, whose bf16 settings are
    autocast over fp32 weights) in a 16-bit dtype; else None, ``Workload``'s own (``mixed``, Megatron's, for a
    preset, as in Korthikanti et al.; fp32 for fp32). docs/precision.md says which mode each stack's setting is."""
    return AMP if not preset and dtype != "fp32" else None


def one_device(wl: Workload) -> Workload:
    """The one-device step a data-parallel rank of ``wl`` runs (what a profile measures): dp and FSDP's sharding
    dropped, their states re-priced (``Profile.restated``); under FSDP's ``mixed`` policy the one-device step
    computes on bf16 weights, which is the one-dtype step the ``mixed`` profile measures."""
    return dataclasses.replace(wl, dp=1, fsdp=False)


def parallel_sizes(wl: Workload, names: tuple[str, ...] = ("tp", "pp", "dp", "sp")) -> tuple[str, tuple[str, ...]]:
    """Those of ``names`` that ``wl`` sets beyond one device, as a message names them ("tp 2 and pp 2") and as its
    fields: a refusal of ``--pp 2`` alone said "drop --tp, --pp and --dp", flags the user never gave."""
    given = tuple(name for name in names if getattr(wl, name) is True or getattr(wl, name) not in (1, False))
    shown = [name if name == "sp" else f"{name} {getattr(wl, name)}" for name in given]
    return " and ".join(filter(None, (", ".join(shown[:-1]), *shown[-1:]))), given


def workload_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of ``Workload`` with their CLI metadata (used to build the command line)."""
    return dataclasses.fields(Workload)


def build_workload(**values: Any) -> Workload:
    """Build a Workload, turning a TypeError from unknown keys into a ConfigError."""
    known = {f.name for f in dataclasses.fields(Workload)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown workload fields {unknown}; known: {sorted(known)}")
    return Workload(**values)
