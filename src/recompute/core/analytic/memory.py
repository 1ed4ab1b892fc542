"""Activation bytes per transformer layer, by component and by policy (Korthikanti et al. 2022, Section 4).

Symbols as in the paper: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size. With 16-bit
activations, 1-byte dropout masks, d_ff = 4h, multi-head attention and no parallelism, the components add up
to the paper's Eq. 1, sbh(34 + 5as/h), plus the LayerNorm statistics the paper leaves out (see
``LayerActivations.norm_stats``). The model is architecture-aware:

- ``e`` bytes per element (2 for bf16/fp16, 4 for fp32); dropout masks take 1 byte on CUDA (``native_dropout``
  keeps a bool mask) and ``e`` bytes on the CPU (ATen's CPU dropout keeps a float mask); no masks when the
  model's dropout is 0;
- grouped-query attention stores K and V at n_kv_heads * head_dim, not h;
- SwiGLU stores four d_ff-wide tensors (gate, up, silu(gate), their product) where GELU stores two;
- ``eager`` attention stores the softmax (and, with dropout, its mask and output): the s^2 terms;
  ``flash`` (SDPA / FlashAttention) stores only the output and a per-row fp32 log-sum-exp, except on the CPU
  with dropout, where SDPA falls back to its math path (fp32 Q/K/V, softmax, mask and dropout output);
- LayerNorm keeps its input and mean and rstd (fp32 on CUDA, the input dtype on the CPU); RMSNorm on the CPU
  (a composite of ATen ops that upcasts to fp32) keeps the fp32 input, the fp32 normalised output and an fp32
  rstd, and on CUDA (the fused kernel) its input and an fp32 rstd.

Tensor parallelism divides the head- and d_ff-sharded tensors by t; without sequence parallelism the norm
inputs, the inputs of the first linears and the residual dropout masks stay whole on every rank (the paper's
10sbh), with it they are split along the sequence too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from recompute.core.analytic.memory_hf import hf_layer_parts, hf_shared_tables
from recompute.core.analytic.params import bytes_per_param
from recompute.core.analytic.sharding import gathered_bytes
from recompute.core.errors import require
from recompute.core.spec import ModelSpec
from recompute.core.workload import AMP, Workload, loss_chunk_tokens

__all__ = [
    "AMP_ANALYTIC",
    "LayerActivations",
    "OuterActivations",
    "check_one_dtype",
    "chunked_loss_transient",
    "layer_activations",
    "loss_chunk",
    "outer_activations",
    "paper_layer_bytes",
]

ATTENTION = ("attn_in", "qk_norm", "qkv", "scores", "attn_out", "attn_drop", "tables")
MLP = ("mlp_in", "router", "mlp_hidden", "mlp_drop")
NORMS = ("norms", "norm_stats")
GROUPS = {"attention": ATTENTION, "mlp": MLP, "norms": NORMS}
PART_GROUP = {part: group for group, parts in GROUPS.items() for part in parts}


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer saves for backward with nothing recomputed, by component (per rank, one micro-batch)."""

    attn_in: float
    """Input of the Q/K/V projections (the first norm's output): the paper's 2sbh."""
    qkv: float
    """Q and K for QK^T, V for attention over V: 6sbh (GQA: K and V at kv_dim)."""
    scores: float
    """eager: softmax output, its dropout mask and dropout output (5as^2b); flash: the fp32 log-sum-exp (with
    dropout on the CPU, SDPA's math path: fp32 softmax, mask, dropout output and q/k/v copies, less q/k/v)."""
    attn_out: float
    """Input of the attention output projection (the attention result): 2sbh."""
    attn_drop: float
    """Dropout mask after the attention output projection: sbh."""
    mlp_in: float
    """Input of the first MLP linear(s) (the second norm's output): 2sbh."""
    mlp_hidden: float
    """GELU: its input and output (16sbh at d_ff = 4h); SwiGLU: gate, up, silu(gate) and the product."""
    mlp_drop: float
    """Dropout mask after the MLP: sbh."""
    norms: float
    """The two norms' saved inputs (and RMSNorm's normalised output on the CPU, both in fp32): 4sbh."""
    norm_stats: float
    """The norms' per-token statistics (mean/rstd), which the paper leaves out: 16sb for LayerNorm on CUDA."""
    layer_in: float
    """The layer input, the one tensor full recomputation keeps (it is the first norm's saved input)."""
    workspace: float
    """Largest scratch the layer's backward allocates at once (gradients of its widest tensors)."""
    qk_norm: float = 0.0
    """The q/k norms' saved tensors (Qwen3, OLMo 2; transformers' classes only)."""
    router: float = 0.0
    """An MoE layer's router: fp32 softmax over the experts, top-k indices (and its renormalisation)."""
    tables: float = 0.0
    """Rotary cos/sin and a sliding-window mask that every layer reads and the first saves (transformers)."""
    core_kept: float | None = None
    """What ``core_attn`` keeps in place of ``qkv`` and ``attn_out`` when that differs (transformers' classes:
    the checkpointed attention function's q, k, v as passed, before any repeat; the output projection's input;
    in the first layer the mask passed to it)."""
    block_extra: float = 0.0
    """Beyond ``layer_in``, what a whole-layer checkpoint keeps (GPT-2's eager mask, passed positionally)."""

    def group(self, name: str) -> float:
        """Bytes of one component group: ``attention``, ``mlp`` or ``norms``."""
        return float(sum(getattr(self, c) for c in GROUPS[name]))

    @property
    def total(self) -> float:
        """Everything stored with policy ``none``."""
        return sum(self.group(g) for g in GROUPS)

    def stored(self, policy: str) -> float:
        """Bytes kept from the forward until the backward of this layer under ``policy``.

        A recomputed region keeps only its input; the inputs of the sub-blocks are tensors the layer keeps
        anyway (``attn_in``, ``mlp_in``), and the layer input is the first norm's saved input.
        """
        return sum(self.stored_by_component(policy).values())

    def stored_by_component(self, policy: str) -> dict[str, float]:
        """``stored`` split into components; ``checkpoint`` is a recomputed region's kept input."""
        parts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("layer_in", "workspace")}
        parts.pop("core_kept")
        parts.pop("block_extra")
        if policy == "core_attn":
            parts["scores"] = 0.0  # Q, K, V (its inputs) stay stored; only the s^2 / lse terms go
            if self.core_kept is not None:
                parts.update(qkv=self.core_kept, attn_out=0.0)
        if policy in ("attn", "attn+mlp"):
            parts.update({c: 0.0 for c in ATTENTION}, checkpoint=self.attn_in)
        if policy in ("mlp", "attn+mlp"):
            parts.update({c: 0.0 for c in MLP})
            parts["checkpoint"] = parts.get("checkpoint", 0.0) + self.mlp_in
        if policy == "block":
            parts = {c: 0.0 for c in parts}
            parts["checkpoint"] = self.layer_in + self.block_extra
        if policy == "offload":
            parts = {c: 0.0 for c in parts}  # only tensors under 64 KiB stay (norm statistics): taken as none
        return parts

    def offloaded(self, policy: str) -> float:
        """Bytes this layer keeps in host memory under ``policy``: everything it saves, under ``offload``.

        During the backward they come back: all of them while the layer's backward runs (``transient``), and
        meanwhile the layer below's when it is offloaded too (the estimate's peak adds those).
        """
        return self.total if policy == "offload" else 0.0

    def transient(self, policy: str) -> float:
        """Bytes that exist again while this layer's recomputed part is replayed in the backward.

        Note: [why peak includes the recompute transient] the recomputed activations are freed as the
        layer's backward consumes them, but for a moment all of them are back; the peak of a step with
        recomputation is the stored bytes of the layers below plus this transient.
        """
        return self.total - self.stored(policy)


AMP_ANALYTIC = (
    "the analytic model describes a step in one dtype; under precision amp autocast decides op by op what runs (and "
    "is kept) in fp32, so such a step is traced: drop --analytic (recompute profiles the model's own class)"
)
"""Why the formulas refuse ``amp``: its bytes are the trace's (``recompute.trace``), held to real autocast steps."""


def check_one_dtype(wl: Workload) -> None:
    """Raise ConfigError if ``wl`` runs autocast (``precision`` amp), which the formulas do not describe."""
    require(wl.precision != AMP, AMP_ANALYTIC, fields=("precision",))


def _mask_bytes(spec: ModelSpec, wl: Workload) -> int:
    if spec.dropout == 0:
        return 0
    return 1 if wl.device == "cuda" else wl.element_bytes


def _norm_bytes(spec: ModelSpec, wl: Workload, sbh: float) -> tuple[float, float]:
    """(saved tensor bytes, statistics bytes) of one norm over an (s, b, h) input (checked by the trace)."""
    sb = sbh / spec.hidden
    if spec.norm == "layernorm":
        stats = 4 if wl.device == "cuda" else wl.element_bytes  # the CPU kernel keeps mean and rstd in the input dtype
        return wl.element_bytes * sbh, 2 * stats * sb  # input; mean and rstd
    if wl.device == "cpu":
        return 2 * 4 * sbh, 4 * sb  # the composite upcasts: fp32 input and normalised output; fp32 rstd
    return wl.element_bytes * sbh, 4 * sb  # fused kernel: input; fp32 rstd


def _sdpa_math_on_cpu(spec: ModelSpec, wl: Workload) -> bool:
    """Whether SDPA runs its math path: on the CPU no fused kernel takes dropout."""
    return wl.attention == "flash" and wl.device == "cpu" and spec.dropout > 0


def layer_activations(spec: ModelSpec, wl: Workload, layer: int | None = None) -> LayerActivations:
    """Activation bytes of one layer, per tensor-parallel rank, for one micro-batch (Korthikanti Table 2).

    For a spec read from a transformers config, what that class saves (``memory_hf``): layer ``layer``
    (``None``: the last, a layer without the tables the first one saves for all).

    Raises:
        ConfigError: ``wl.precision`` is amp, whose activations are autocast's (``check_one_dtype``).
    """
    check_one_dtype(wl)
    if spec.transformers:
        index = spec.n_layers - 1 if layer is None else layer
        tables = hf_shared_tables(spec, wl) if index == 0 else 0.0
        return LayerActivations(**hf_layer_parts(spec, wl, index), tables=tables)
    s, b, h, a, t, e = wl.seq_len, wl.micro_batch, spec.hidden, spec.n_heads, wl.tp, wl.element_bytes
    f, r = spec.d_ff, (t if wl.sp else 1)  # r divides what sequence parallelism splits and TP alone does not
    sbh, sb = s * b * h, s * b
    m = _mask_bytes(spec, wl)
    qkv = e * sb * (spec.q_dim + 2 * spec.kv_dim) / t
    if wl.attention == "eager":
        scores = (e + (m + e if m else 0)) * a * s * s * b / t  # softmax out (+ dropout mask and output)
        # dP and dS of the (b, a, s, s) scores in backward, and on CUDA the softmax backward's scratch dP * P
        # (Note: [softmax's backward on CUDA] in recompute.trace._cuda)
        attn_grad = (3 if wl.device == "cuda" else 2) * e * a * s * s * b / t
    elif _sdpa_math_on_cpu(spec, wl):
        # Note: [SDPA with dropout on the CPU] the math path upcasts to fp32 and repeats K/V to all heads; it
        # keeps fp32 copies of q, k, v (not q, k, v themselves) and the fp32 softmax, mask and dropout output.
        # ``scores`` is what the core keeps beyond its inputs, so core_attn (which keeps q, k, v) still drops it.
        scores = (3 * 4 * a * s * s * b + 4 * sb * 3 * spec.q_dim) / t - qkv
        if e == 4 and b == 1 and spec.n_kv_heads == spec.n_heads:
            # Note: [a view keeps its storage] in fp32 nothing is upcast, and at b = 1 the math path's v is a
            # view of the fused c_attn output (nothing repeats it), so the whole output stays alive: its q and k
            # parts beside the copies the path makes of them. Dropped with the core, like the rest of scores.
            scores += e * sb * (spec.q_dim + spec.kv_dim) / t
        attn_grad = 2 * 4 * a * s * s * b / t
    else:
        scores = 4 * a * s * b / t  # fp32 log-sum-exp per row: (b, a, s)
        attn_grad = 0.0
    hidden_tensors = 4 if spec.mlp == "swiglu" else 2
    norm_saved, norm_stats = _norm_bytes(spec, wl, sbh)
    return LayerActivations(
        attn_in=e * sbh / r,
        qkv=qkv,
        scores=scores,
        attn_out=e * sb * spec.q_dim / t,
        attn_drop=m * sbh / r,
        mlp_in=e * sbh / r,
        mlp_hidden=hidden_tensors * e * sb * f / t,
        mlp_drop=m * sbh / r,
        norms=2 * norm_saved / r,
        norm_stats=2 * norm_stats / r,
        layer_in=e * sbh / r,
        workspace=max(attn_grad, 2 * e * sb * f / t, 2 * e * sbh),
    )


@dataclass(frozen=True)
class OuterActivations:
    """Activation bytes outside the transformer layers, per rank and micro-batch (Korthikanti Section 4.3)."""

    embedding: float
    """Token ids kept by the embedding backward (int64) and the embedding dropout mask (the paper's sbhp/t)."""
    head: float
    """Final norm's saved input and statistics, and the output layer's input: 4sbh/t in the paper."""
    logits: float
    """fp32 log-probabilities kept by cross-entropy: 4sbv/t (none with the chunked loss)."""
    loss_transient: float
    """Logits and the loss gradients alive at once at the start of the backward: (e + 8)sbv/t; with t > 1
    the vocabulary-parallel loss turns its fp32 copy into the kept softmax in place: (e + 4)sbv/t (esbv/t
    in fp32). With the chunked loss, one chunk's and the output layer's weight gradient made so far
    (``chunked_loss_transient``)."""
    kept_logits: float = 0.0
    """The logits the training loop holds until the optimizer step ends (``logits, loss = model(x, y)``): esbv/t
    (none with the chunked loss: the model returns no logits)."""

    @property
    def stored(self) -> float:
        return self.embedding + self.head + self.logits


def outer_activations(spec: ModelSpec, wl: Workload, *, last_stage: bool) -> OuterActivations:
    """Embedding, head and loss activations; the head and loss live only on the last pipeline stage."""
    s, b, h, v, t, e = wl.seq_len, wl.micro_batch, spec.hidden, spec.vocab, wl.tp, wl.element_bytes
    r = t if wl.sp else 1
    sbh = s * b * h
    embedding = 8 * s * b + _mask_bytes(spec, wl) * sbh / r
    if not last_stage:
        return OuterActivations(embedding=embedding, head=0.0, logits=0.0, loss_transient=0.0)
    norm_saved, norm_stats = _norm_bytes(spec, wl, sbh)
    norm, x = (norm_saved + norm_stats) / r, e * sbh / r  # the final norm's; the output layer's input
    if wl.loss == "chunked":  # nothing keeps x past the loss, which takes its gradient in the forward
        return OuterActivations(embedding, norm, logits=0.0, loss_transient=x + chunked_loss_transient(spec, wl))
    return OuterActivations(
        embedding=embedding,
        head=norm + x,
        logits=4 * s * b * v / t,
        loss_transient=_loss_transient(wl) * s * b * v / t,
        kept_logits=e * s * b * v / t,
    )


def loss_chunk(spec: ModelSpec, wl: Workload) -> int:
    """Tokens per chunk of the chunked loss (``wl.loss_chunk`` or the default); with sequence parallelism,
    whole positions of every rank's shard (at least one each), as ``recompute.chunked_loss`` takes them."""
    c = loss_chunk_tokens(wl.loss_chunk, spec.vocab, wl.tokens)
    if wl.sp and wl.tp > 1:
        per_rank = wl.micro_batch * wl.tp
        c = per_rank * max(1, c // per_rank)
    return c


def chunked_loss_transient(spec: ModelSpec, wl: Workload) -> float:
    """Bytes alive at the chunked loss beyond the stored activations and its input (checked by the trace).

    Note: [the chunked loss phase] the loss's forward takes each chunk's gradients at once
    (``recompute.chunked_loss``), so its peak is in the forward, with every stored activation alive. Beside
    them: the gradient of the head input, one buffer for every chunk, bhse/r; from the second chunk on, the
    output layer's weight gradient summed over the chunks before, G = vh/t (gradient bytes per parameter);
    and the chunk's own, the larger of two moments: its log-softmax's backward, with the fp32
    log-probabilities, their gradient and the logits' gradient, 12cv/t (Megatron's vocabulary-parallel loss,
    t > 1: its kept softmax, the gradient made from it and the logits' gradient in their dtype,
    (e + 8)cv/t); and its output layer's backward, with the chunk's weight gradient G, the logits' gradient
    ecv/t and the chunk's input gradient ech.
    """
    s, b, h, v, t, e = wl.seq_len, wl.micro_batch, spec.hidden, spec.vocab, wl.tp, wl.element_bytes
    c = loss_chunk(spec, wl)
    per = gathered_bytes(wl)[0] if wl.fsdp else bytes_per_param(str(wl.precision), wl.dp)["gradients"]
    weight_grad = v * h / t * per  # under FSDP the root's gradients stay unsharded until the backward ends
    softmax = (12 if t == 1 else e + 8) * c * v / t
    matmul = weight_grad + e * c * v / t + e * c * h
    summed = weight_grad if c < s * b else 0.0
    return e * s * b * h / (t if wl.sp else 1) + summed + max(softmax, matmul)


def _loss_transient(wl: Workload) -> int:
    """Bytes per logit alive at the loss beyond the kept fp32 softmax (checked by the trace).

    PyTorch's cross-entropy (t = 1): the logits, their fp32 copy (or an fp32 intermediate) and the gradient,
    e + 8. Megatron's vocabulary-parallel cross-entropy (``recompute.parallel``, t > 1): the logits and
    their fp32 copy, which becomes the kept softmax in place (no copy when the logits are already fp32).
    """
    if wl.tp == 1:
        return wl.element_bytes + 8
    return wl.element_bytes + (4 if wl.element_bytes != 4 else 0)


def paper_layer_bytes(spec: ModelSpec, wl: Workload, policy: str) -> float | None:
    """Korthikanti et al. 2022 (Table 2) for one layer per tensor-parallel rank, where the paper applies.

    sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh(34/t + 5as/(ht)) with sequence parallelism too;
    selective recomputation (``core_attn``) drops the 5as/(ht) term and full recomputation (``block``) keeps
    2sbh (2sbh/t with sequence parallelism). fp16 activations and 1-byte dropout masks, whatever ``wl``
    says; ``None`` for policies and models outside the paper (no dropout, SwiGLU, GQA). ``layer_activations``
    in the paper's setting differs only by the LayerNorm statistics, which the paper leaves out.
    """
    if spec.mlp != "gelu" or spec.dropout == 0 or spec.n_kv_heads != spec.n_heads or policy not in PAPER_POLICIES:
        return None
    s, b, h, a, t = wl.seq_len, wl.micro_batch, spec.hidden, spec.n_heads, wl.tp
    sbh = s * b * h
    if policy == "block":
        return 2 * sbh / (t if wl.sp else 1)
    scores = 0.0 if policy == "core_attn" else 5 * a * s / (h * t)
    return sbh * ((34 / t if wl.sp else 10 + 24 / t) + scores)


PAPER_POLICIES = ("none", "core_attn", "block")
"""The policies the paper's Table 2 covers: no recomputation, selective, full."""
