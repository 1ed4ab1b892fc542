"""``verify``: run a training step with and without a policy and show that nothing but memory changed.

Three runs from the same seed and batch (dropout on): the plain model, the model with the policy, and the
policy once more. The first two must agree (loss and every gradient, within fp32 tolerances; bit for bit
where the math is the same) and the last two bit for bit: recomputation replays the dropout masks.

The module imports no torch at load time (the CLI imports it for ``recompute estimate`` too).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recompute.errors import ConfigError
from recompute.policy import Policy
from recompute.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "GroupDiff",
    "VerifyResult",
    "add_verify_args",
    "loss_of",
    "render_verify",
    "run_verify",
    "verify",
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
    """
    import torch

    from recompute.checkpointing import applied_policy, apply

    apply(model, policy)  # parses and checks the policy before any step runs
    pol = applied_policy(model)
    assert pol is not None
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    tokens = torch.randint(_vocab(model), (micro_batch, seq_len + 1), generator=gen).to(device)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model.train()
    apply(model, "none")
    ref = _step(model, idx, targets, seed)
    apply(model, pol)
    one, two = _step(model, idx, targets, seed), _step(model, idx, targets, seed)
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
    """The fp32 cross-entropy of ``model`` on ``idx`` against ``targets`` (recompute's or HF's models)."""
    import torch.nn.functional as F

    if hasattr(model, "spec"):
        return model(idx, targets)[1]
    if hasattr(model, "config"):
        logits = model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
    raise ConfigError(f"verify runs recompute's models and Hugging Face causal LMs; got {type(model).__name__}")


Step = tuple["torch.Tensor", dict[str, "torch.Tensor"]]


def _step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, seed: int) -> Step:
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every run
    loss = loss_of(model, idx, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _closeness(rtol: float, atol: float) -> Any:
    """An elementwise ``|a - b| <= atol + rtol * |b|`` test over whole tensors."""
    import torch

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.isclose(a, b, rtol=rtol, atol=atol).all())

    return close


def _identical(a: Step, b: Step) -> bool:
    import torch

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
    from recompute.checkpointing import find_layers

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
    return int(spec.vocab if spec is not None else getattr(model, "config").vocab_size)  # noqa: B009


def _model_name(model: nn.Module) -> str:
    spec = getattr(model, "spec", None)
    return spec.name if spec is not None else type(model).__name__


# --- rendering --------------------------------------------------------------------------------------------


def render_verify(result: VerifyResult) -> str:
    """A short report: the verdict, the loss, the largest gradient difference per group, repeatability."""
    from recompute.render import render_table

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


# --- command line -----------------------------------------------------------------------------------------


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """Options of ``recompute verify``."""
    from recompute.cli import add_model_args, add_policy_args

    add_model_args(p)
    add_policy_args(p)
    for flag, field in (("--layers", "n_layers"), ("--hidden", "hidden"), ("--heads", "n_heads"), ("--vocab", "vocab")):
        p.add_argument(flag, dest=field, type=int, metavar="N", help=f"override the preset's {field} (to fit a CPU)")
    p.add_argument("--kv-heads", dest="n_kv_heads", type=int, metavar="N", help="override the preset's n_kv_heads")
    p.add_argument("--seq-len", type=int, default=64, metavar="S", help="s: tokens per sequence (default: 64)")
    p.add_argument("--micro-batch", type=int, default=2, metavar="B", help="b: sequences per batch (default: 2)")
    p.add_argument("--attention", choices=("eager", "flash"), default="eager", help="eager math or SDPA")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch and the dropout masks")
    p.add_argument("--device", default="cpu", help="where to run (default: cpu)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run_verify(args: argparse.Namespace) -> int:
    """``recompute verify``: 0 when the policy changes nothing, 1 when it does."""
    from recompute.cli import emit_json, policy_from

    model, name = _build_for_verify(args)
    pol = policy_from(args)
    result = verify(model, pol, micro_batch=args.micro_batch, seq_len=args.seq_len, seed=args.seed, name=name)
    if args.json:
        emit_json(result.to_dict())
    else:
        print(render_verify(result))
    return 0 if result.passed else 1


_OVERRIDES = ("n_layers", "hidden", "n_heads", "n_kv_heads", "vocab")


def verify_spec(model: str, **overrides: int | None) -> tuple[ModelSpec, bool]:
    """The spec ``--model`` names (``hf:`` prefix stripped; ``hf:llama`` = ``llama3.1-8b``), overridden.

    Returns the spec and whether to build the Hugging Face model.
    """
    from recompute.analytic import n_params
    from recompute.cli import resolve_model

    hf = model.startswith("hf:")
    base = model.removeprefix("hf:")
    spec = resolve_model({"llama": "llama3.1-8b"}.get(base, base) if hf else base)
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    if "hidden" in given or "n_heads" in given:
        given.update(head_dim=None)  # re-derived from the new width or head count
    if "hidden" in given:
        given.update(d_ff=None)  # re-derived from the new width
    if "n_heads" in given and "n_kv_heads" not in given and spec.kv_heads == spec.n_heads:
        given.update(n_kv_heads=None)  # multi-head attention stays multi-head
    spec = dataclasses.replace(spec, **given)
    if n_params(spec) > CPU_PARAM_LIMIT:
        raise ConfigError(
            f"{spec.name} has {n_params(spec) / 1e9:.1f}B parameters, too many to verify here; "
            "shrink it, e.g. --layers 2 --hidden 512 --heads 8 --kv-heads 2 --vocab 4096"
        )
    return spec, hf


def _build_for_verify(args: argparse.Namespace) -> tuple[nn.Module, str]:
    from recompute.models import build_model
    from recompute.models.hf import build_hf_model

    spec, hf = verify_spec(args.model, **{k: getattr(args, k) for k in _OVERRIDES})
    build = build_hf_model if hf else build_model
    model = build(spec, attention=args.attention, device=args.device)
    return model, f"{args.model} ({spec.n_layers} layers, h={spec.hidden})"
