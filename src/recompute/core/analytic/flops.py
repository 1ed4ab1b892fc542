"""FLOPs per layer and per step, recompute FLOPs and overhead, model vs hardware FLOPs, MFU and HFU.

A multiply-add is 2 FLOPs. Per layer (forward, GPT layer, Korthikanti Appendix A and the workshop):
attention projections 8bsh^2, attention scores and attention over V 4bs^2h (dense: no causal halving, as
the paper and ``FlopCounterMode`` count it), MLP 16bsh^2; GQA shrinks the K/V projections and SwiGLU has
three d_ff matmuls. The step is forward + backward = 3F; recomputation adds the forward of what it replays.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

__all__ = [
    "LayerFlops",
    "hardware_flops",
    "layer_flops",
    "logits_flops",
    "mfu",
    "model_flops",
    "overhead_from_flops",
    "paper_hardware_flops_full",
    "paper_hardware_flops_selective",
    "paper_model_flops",
    "recompute_flops",
]


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer per tensor-parallel rank, by part, and what each policy replays."""

    attn_proj: float
    """Q, K, V and output projections: 8bsh^2 for multi-head attention."""
    attn_core: float
    """QK^T and attention over V: 4bs^2h."""
    mlp: float
    """The MLP matmuls: 16bsh^2 for GELU with d_ff = 4h; 6bsh*d_ff for SwiGLU."""
    out_proj: float = 0.0
    """The attention output projection (part of ``attn_proj``)."""
    mlp_out: float = 0.0
    """The MLP's down projection (part of ``mlp``)."""
    dropout: bool = True
    """Whether residual dropout follows each sub-block (its mask is the last tensor a replay must rebuild)."""
    fused_core: bool = False
    """Whether the core attention is one fused op (SDPA / flash), replayed whole."""

    @property
    def forward(self) -> float:
        return self.attn_proj + self.attn_core + self.mlp

    def recomputed(self, policy: str) -> float:
        """Forward FLOPs replayed in the backward under ``policy`` (norms and pointwise ops neglected).

        Note: [early stop] non-reentrant ``torch.utils.checkpoint`` stops a replay as soon as every tensor
        the backward needs is back. So ``core_attn`` in eager math replays QK^T and the softmax but not the
        attention over V (nothing in the region saves its output), and without dropout a sub-block's last
        matmul (output or down projection) is skipped, since only its input is saved. With dropout the
        residual mask comes last and the whole region replays. ``FlopCounterMode`` pins this in the tests.
        """
        attn = self.attn_proj + self.attn_core - (0.0 if self.dropout else self.out_proj)
        mlp = self.mlp - (0.0 if self.dropout else self.mlp_out)
        return {
            "none": 0.0,
            "core_attn": self.attn_core if self.fused_core else self.attn_core / 2,
            "attn": attn,
            "mlp": mlp,
            "attn+mlp": attn + mlp,
            "block": self.attn_proj + self.attn_core + mlp,
            "offload": 0.0,  # copies, not FLOPs
        }[policy]

    def overhead(self, policy: str) -> float:
        """The workshop's per-layer overhead, F_recomputed / 3F, as a fraction."""
        return self.recomputed(policy) / (3 * self.forward)


def layer_flops(spec: ModelSpec, wl: Workload, layer: int | None = None) -> LayerFlops:
    """Forward FLOPs of one transformer layer (per tensor-parallel rank, one micro-batch).

    An MoE layer (``layer``: its index; ``None``: the last layer) counts its router, 2bshE, and only the
    experts each token is routed to: 6Rh*d_expert for the R = b*s*k token copies a rank runs at the expected
    load (``Workload.routed_tokens``), not all E experts.
    """
    s, b, h, t = wl.seq_len, wl.micro_batch, spec.hidden, wl.tp
    bs = b * s
    index = spec.n_layers - 1 if layer is None else layer
    if spec.is_moe(index):
        R = wl.routed_tokens(spec)
        mlp, mlp_out = 2 * bs * h * spec.n_experts + 6 * R * h * spec.d_expert / t, 2 * R * h * spec.d_expert / t
    else:
        mlp, mlp_out = (6 if spec.gated else 4) * bs * h * spec.d_ff / t, 2 * bs * h * spec.d_ff / t
    return LayerFlops(
        attn_proj=2 * bs * h * (2 * spec.q_dim + 2 * spec.kv_dim) / t,
        attn_core=4 * b * s * s * spec.q_dim / t,
        mlp=mlp,
        out_proj=2 * bs * h * spec.q_dim / t,
        mlp_out=mlp_out,
        dropout=spec.dropout > 0,
        fused_core=wl.attention == "flash" and not (wl.device == "cpu" and spec.dropout > 0),
    )


def logits_flops(spec: ModelSpec, wl: Workload) -> float:
    """Forward FLOPs of the output projection: 2bshV (per tensor-parallel rank)."""
    return 2 * wl.micro_batch * wl.seq_len * spec.hidden * spec.vocab / wl.tp


def model_flops(spec: ModelSpec, wl: Workload) -> float:
    """Model FLOPs of one micro-batch's forward and backward: 3 * (L layers + logits). Independent of policy."""
    if not spec.n_experts:
        return 3 * (spec.n_layers * layer_flops(spec, wl).forward + logits_flops(spec, wl))
    layers = sum(layer_flops(spec, wl, i).forward for i in range(spec.n_layers))
    return 3 * (layers + logits_flops(spec, wl))


def recompute_flops(spec: ModelSpec, wl: Workload, policies: tuple[str, ...]) -> float:
    """FLOPs replayed in the backward for one micro-batch, given one policy name per layer.

    The chunked loss replays nothing: it takes each chunk's gradients in the forward (``recompute.chunked_loss``).
    """
    if not spec.n_experts:
        lf = layer_flops(spec, wl)
        return sum(lf.recomputed(p) for p in policies)
    return sum(layer_flops(spec, wl, i).recomputed(p) for i, p in enumerate(policies))


def hardware_flops(spec: ModelSpec, wl: Workload, policies: tuple[str, ...]) -> float:
    """FLOPs executed: model FLOPs plus the recomputation (what HFU counts)."""
    return model_flops(spec, wl) + recompute_flops(spec, wl, policies)


def overhead_from_flops(attention: float, mlp: float, recomputed: str) -> float:
    """The workshop's worked example: overhead of recomputing ``attn``, ``mlp`` or ``attn+mlp``.

    With attention 100 and MLP 300: attn 100/1200 = 8.3 %, mlp 300/1200 = 25 %, both 400/1200 = 33.3 %.
    """
    f = {"attn": attention, "mlp": mlp, "attn+mlp": attention + mlp}[recomputed]
    return f / (3 * (attention + mlp))


# Korthikanti et al. 2022, Appendix A, with B the global batch in sequences.
def paper_model_flops(B: int, s: int, L: int, h: int, V: int) -> float:
    """Eq. 7: model FLOPs per iteration, 72BsLh^2 (1 + s/6h + V/12hL)."""
    return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))


def paper_hardware_flops_selective(B: int, s: int, L: int, h: int, V: int) -> float:
    """Eq. 8: hardware FLOPs with selective recomputation, 72BsLh^2 (1 + s/3h + V/12hL).

    Note: the extra s/6h is 12Bs^2h per layer, three times the core-attention forward (4Bs^2h) that a
    replay executes; ``hardware_flops`` counts the replay as ``FlopCounterMode`` sees it.
    """
    return 72 * B * s * L * h**2 * (1 + s / (3 * h) + V / (12 * h * L))


def paper_hardware_flops_full(B: int, s: int, L: int, h: int, V: int) -> float:
    """Hardware FLOPs with full recomputation (Narayanan et al. 2021), 96BsLh^2 (1 + s/6h + V/16hL)."""
    return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * h * L))


def mfu(flops_per_step: float, step_time_s: float, peak_flops: float) -> float:
    """Utilisation: FLOPs per step over step time and peak FLOP/s (MFU with model FLOPs, HFU with hardware)."""
    return flops_per_step / (step_time_s * peak_flops)
