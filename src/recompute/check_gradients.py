"""``verify``: run a training step with and without a policy and show that nothing but memory changed.

Three runs from the same seed and batch (dropout on): the plain model, the model with the policy, and the
policy once more. The first two must agree (loss and every gradient, within fp32 tolerances; bit for bit
where the math is the same) and the last two bit for bit: recomputation replays the dropout masks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recompute.checkpointing import applied_policy, apply, find_layers
from recompute.core.analytic import estimate, n_params
from recompute.core.errors import ConfigError
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec, resolve_model
from recompute.core.table import render_table
from recompute.core.workload import Workload
from recompute.models.hf import HF_ALIASES
from recompute.models.loss import LossFn, lm_loss
from recompute.models.source import BuiltModel, ModelSource, build_source

__all__ = [
    "GroupDiff",
    "VerifyResult",
    "build_checked",
    "loss_of",
    "named_spec",
    "render_verify",
    "verify",
    "verify_need",
    "verify_spec",
]

CPU_PARAM_LIMIT = 1_000_000_000
"""Largest model ``recompute verify`` builds (three steps in fp32 need ~ 24 bytes per parameter)."""


@dataclass(frozen=True)
class GroupDiff:
    """The largest gradient difference within one parameter group (e.g. ``layers.*.attn``)."""

    name: str
    max_diff: float
    """max |grad with policy - grad without| over the group's elements."""
    max_ref: float
    """max |grad without policy|, for scale."""
    within_tol: bool
    """Every element within ``atol + rtol * |reference|``."""


@dataclass(frozen=True)
class VerifyResult:
    """What ``verify`` found; ``passed`` is the verdict."""

    model: str
    policy: str
    loss_ref: float
    loss: float
    loss_within_tol: bool
    groups: tuple[GroupDiff, ...]
    bit_exact: bool
    """The policy's loss and gradients equal the plain model's bit for bit."""
    repeatable: bool
    """Two runs with the policy are bit-identical (dropout masks replay)."""
    rtol: float
    atol: float

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.loss_ref)

    @property
    def max_grad_diff(self) -> float:
        return max((g.max_diff for g in self.groups), default=0.0)

    @property
    def passed(self) -> bool:
        return self.loss_within_tol and all(g.within_tol for g in self.groups) and self.repeatable

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(loss_diff=self.loss_diff, max_grad_diff=self.max_grad_diff, passed=self.passed)
        return out


def verify(
    model: nn.Module,
    policy: str | Policy,
    *,
    micro_batch: int = 2,
    seq_len: int = 64,
    seed: int = 0,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    name: str | None = None,
    loss_fn: LossFn | None = None,
) -> VerifyResult:
    """Compare a training step of ``model`` with and without ``policy`` (fp32 tolerances by default).

    The model runs in training mode on random token ids. On return ``policy`` is applied to it.

    Args:
        model: recompute's ``GPT``/``Llama`` or a Hugging Face causal LM.
        policy: anything ``recompute.apply`` takes.
        micro_batch, seq_len: the batch shape.
        seed: seeds the batch and, before every step, the dropout RNG.
        rtol, atol: elementwise tolerance, as in ``torch.testing.assert_close``.
        name: how to call the model in the result (default: its spec name or class).
        loss_fn: the model's loss convention (``BuiltModel.loss_fn``: a factory's names the factory when its
            forward fails); default ``loss_of``.
    """
    apply(model, policy)  # parses and checks the policy before any step runs
    pol = applied_policy(model)
    assert pol is not None
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    tokens = torch.randint(_vocab(model), (micro_batch, seq_len + 1), generator=gen).to(device)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model.train()
    apply(model, "none")
    ref = _step(model, idx, targets, seed, loss_fn)
    apply(model, pol)
    one, two = _step(model, idx, targets, seed, loss_fn), _step(model, idx, targets, seed, loss_fn)
    close = _closeness(rtol, atol)
    return VerifyResult(
        model=name or _model_name(model),
        policy=pol.describe(),
        loss_ref=ref[0].item(),
        loss=one[0].item(),
        loss_within_tol=close(one[0], ref[0]),
        groups=_group_diffs(model, ref[1], one[1], close),
        bit_exact=_identical(ref, one),
        repeatable=_identical(one, two),
        rtol=rtol,
        atol=atol,
    )


def loss_of(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The fp32 cross-entropy of ``model`` on ``idx`` against ``targets``.

    A Hugging Face causal LM (it has a ``config``) is called as ``model(input_ids=idx)``; any other model as
    ``logits, loss = model(idx, targets)`` (recompute's models, and a factory's: see ``recompute.models.source``).
    """
    if hasattr(model, "config") and not hasattr(model, "spec"):
        logits = model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
    return lm_loss(model, idx, targets)[1]  # which refuses a model that breaks the convention


Step = tuple["torch.Tensor", dict[str, "torch.Tensor"]]


def _step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, seed: int, loss_fn: LossFn | None) -> Step:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every run
    loss = loss_of(model, idx, targets) if loss_fn is None else loss_fn(model, idx, targets)[1]
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _closeness(rtol: float, atol: float) -> Any:
    """An elementwise ``|a - b| <= atol + rtol * |b|`` test over whole tensors."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.isclose(a, b, rtol=rtol, atol=atol).all())

    return close


def _identical(a: Step, b: Step) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _group_diffs(model: nn.Module, ref: dict[str, Any], got: dict[str, Any], close: Any) -> tuple[GroupDiff, ...]:
    if ref.keys() != got.keys():
        missing = sorted(set(ref) ^ set(got))
        return (GroupDiff(f"gradients present in one run only: {', '.join(missing)}", float("inf"), 0.0, False),)
    groups: dict[str, list[str]] = {}
    layers = _layers_path(model)
    for n in ref:
        groups.setdefault(_group_of(n, layers), []).append(n)
    return tuple(
        GroupDiff(
            name=g,
            max_diff=max((got[n] - ref[n]).abs().max().item() for n in names),
            max_ref=max(ref[n].abs().max().item() for n in names),
            within_tol=all(close(got[n], ref[n]) for n in names),
        )
        for g, names in groups.items()
    )


def _layers_path(model: nn.Module) -> str:
    stack = find_layers(model)
    return next(n for n, m in model.named_modules() if m is stack)


def _group_of(param: str, layers: str) -> str:
    """``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.*.attn``; ``lm_head.weight`` -> ``lm_head``."""
    prefix = f"{layers}." if layers else ""
    if param.startswith(prefix):
        index, child, *_ = [*param[len(prefix) :].split("."), ""]
        if index.isdigit():
            return f"{prefix}*.{child}"
    return param.rsplit(".", 1)[0]


def _vocab(model: nn.Module) -> int:
    spec = getattr(model, "spec", None)
    if spec is not None:
        return int(spec.vocab)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is None:
            raise ConfigError(
                f"{type(model).__name__} has no config.vocab_size and no nn.Embedding; verify runs causal LMs"
            )
        vocab = embedding.num_embeddings
    return int(vocab)


def _model_name(model: nn.Module) -> str:
    spec = getattr(model, "spec", None)
    return spec.name if spec is not None else type(model).__name__


# --- rendering --------------------------------------------------------------------------------------------


def render_verify(result: VerifyResult) -> str:
    """A short report: the verdict, the loss, the largest gradient difference per group, repeatability."""
    verdict = "PASS" if result.passed else "FAIL"
    head = [
        f"verify {result.model}, policy {result.policy}: {verdict}",
        f"loss: {result.loss_ref:.8g} without, {result.loss:.8g} with the policy (|diff| {result.loss_diff:.3g})",
        f"gradients: {'bit-exact' if result.bit_exact else 'not bit-exact'}; "
        f"tolerance |diff| <= {result.atol:g} + {result.rtol:g} * |ref|",
    ]
    rows = [
        [g.name, f"{g.max_diff:.3g}", f"{g.max_ref:.3g}", "ok" if g.within_tol else "DIFFERS"] for g in result.groups
    ]
    table = render_table(["parameter group", "max |diff|", "max |grad|", ""], rows)
    tail = f"two runs with the policy: {'bit-identical' if result.repeatable else 'DIFFERENT (masks do not replay)'}"
    return "\n".join([*head, "", table, "", tail])


def verify_need(spec: ModelSpec, wl: Workload) -> float:
    """Bytes ``verify`` holds at its peak: fp32 weights, three gradient sets kept for the comparison and the
    one being made, and the activations of the plain model's step (no optimizer)."""
    est = estimate(spec, dataclasses.replace(wl, dtype="fp32", precision="fp32"), "none")
    return est.peak - est.states.optimizer + 3 * est.states.gradients


def named_spec(model: str, **sizes: int | None) -> tuple[ModelSpec, bool]:
    """The spec ``--model`` names (``hf:`` prefix stripped; ``hf:llama`` = ``llama3.1-8b``), resized, at any size.

    Returns the spec and whether to build the Hugging Face model.

    Raises:
        ConfigError: an unknown model, or sizes it cannot take.
    """
    hf = model.startswith("hf:")
    base = model.removeprefix("hf:")
    return resolve_model(HF_ALIASES.get(base, base) if hf else base).resized(**sizes), hf


def verify_spec(model: str, **sizes: int | None) -> tuple[ModelSpec, bool]:
    """``named_spec``, refused over ``CPU_PARAM_LIMIT`` parameters (verify keeps three gradient sets).

    Raises:
        ConfigError: as ``named_spec``, or a model over ``CPU_PARAM_LIMIT`` parameters.
    """
    spec, hf = named_spec(model, **sizes)
    if n_params(spec) > CPU_PARAM_LIMIT:
        raise ConfigError(
            f"{spec.name} has {n_params(spec) / 1e9:.1f}B parameters, too many to run real steps of here; "
            "shrink it, e.g. --layers 2 --hidden 512 --heads 8 --kv-heads 2 --vocab 4096, "
            "or use `recompute trace` (fake tensors, any size) or `recompute estimate`"
        )
    return spec, hf


def build_checked(
    source: ModelSource, *, attention: str = "flash", device: str | torch.device = "cpu", seed: int = 0
) -> BuiltModel:
    """``source`` built for real steps here (seeded weights), after checking its size on the meta device.

    Raises:
        ConfigError: the model cannot be built, or has over ``CPU_PARAM_LIMIT`` parameters.
    """
    meta = build_source(source, attention=attention, device="meta").model
    count = sum(p.numel() for p in meta.parameters())
    if count > CPU_PARAM_LIMIT:
        raise ConfigError(
            f"{source.name} has {count / 1e9:.1f}B parameters, too many to run real steps of here; "
            "pass a smaller config (fewer layers, a narrower hidden size), "
            "or use `recompute trace` (fake tensors, any size)"
        )
    torch.manual_seed(seed)  # the same weights in every invocation with this seed
    return build_source(source, attention=attention, device=device)
