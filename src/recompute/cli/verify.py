"""``recompute verify``: a training step with and without a policy; loss and gradients compared."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from recompute.check_gradients import build_checked, render_verify, verify, verify_need, verify_spec
from recompute.cli._common import (
    add_model_args,
    add_policy_args,
    add_workload_args,
    emit_json,
    policy_from,
    workload_from,
)
from recompute.cli.bench import add_size_args, size_overrides
from recompute.core.errors import ConfigError, torch_seed
from recompute.core.workload import Workload
from recompute.models import build_model
from recompute.models.hf import build_hf_model
from recompute.models.loss import LossFn
from recompute.models.source import resolve_source
from recompute.runtime import require_memory, resolve_device

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, built=True)
    add_policy_args(p)
    add_size_args(p)
    add_workload_args(p, "verify")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the batch and the dropout masks")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """0 when the policy changes nothing, 1 when it does."""
    torch_seed("--seed", args.seed)
    model, name, wl, loss_fn = _build(args)
    pol = policy_from(args)
    result = verify(
        model, pol, micro_batch=wl.micro_batch, seq_len=wl.seq_len, seed=args.seed, name=name, loss_fn=loss_fn
    )
    emit_json(result.to_dict(), "verify") if args.json else print(render_verify(result))
    return 0 if result.passed else 1


def _build(args: argparse.Namespace) -> tuple[nn.Module, str, Workload, LossFn | None]:
    """The model, its name, the workload, and a factory's loss convention (a failing forward names the factory)."""
    source = resolve_source(args.model)
    wl = workload_from(args, source)
    device = resolve_device(wl.device)
    if source.spec is None:
        given = [k for k, v in size_overrides(args).items() if v is not None]
        if given:
            raise ConfigError(
                f"--{given[0].removeprefix('n_').replace('_', '-')} resizes presets; {args.model} is built as it "
                "is: edit its config (or factory) instead"
            )
        built = build_checked(source, attention=args.attention, device=device, seed=args.seed)
        loss_fn = built.loss_fn if source.factory is not None else None
        return built.model, f"{built.class_name} from {source.origin}", wl, loss_fn
    spec, hf = verify_spec(args.model, **size_overrides(args))
    wl.check(spec)
    fix = "use a shorter --seq-len, a smaller --micro-batch, or a smaller model (--layers, --hidden, --vocab)"
    require_memory(verify_need(spec, wl), device, what="verify", fix=fix)
    build = build_hf_model if hf else build_model
    torch.manual_seed(args.seed)  # the same weights in every invocation with this seed
    model = build(spec, attention=args.attention, device=device)
    return model, f"{args.model} ({spec.n_layers} layers, h={spec.hidden})", wl, None
