"""``recompute train`` and ``recompute compare-train``: the blog's run, under one policy or several."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from recompute.checkpointing import find_layers
from recompute.cli._common import add_field_args, csv, emit_json, writable
from recompute.cli.progress import progress_bar
from recompute.core.errors import ConfigError, distinct
from recompute.core.files import check_folder
from recompute.core.policy import Policy
from recompute.models.source import build_source
from recompute.train import compare_train, plot_losses, render_compare, train
from recompute.train.config import TrainConfig
from recompute.train.loop import build_spec, train_source

__all__ = ["add_compare_args", "add_train_args", "run_compare", "run_train"]


def _fields(*skip: str) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in skip]


def _config(args: argparse.Namespace, *skip: str) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in _fields(*skip)})


def add_train_args(p: argparse.ArgumentParser) -> None:
    add_field_args(p, _fields())
    p.add_argument("--plan", help="a plan JSON file to apply instead of --policy")


def run_train(args: argparse.Namespace) -> int:
    if args.plan:
        args.policy = args.plan
    _check_out_folder(args.out)
    with progress_bar("train", enabled=int(os.environ.get("RANK", "0")) == 0) as progress:
        result = train(_config(args), progress=progress)
    if result.rank != 0:
        return 0  # under torchrun, rank 0 reports
    last = result.metrics[-1]
    print(
        f"trained {result.name}, {result.built} ({args.policy}) for {last.step + 1} steps: final loss {last.loss:.4f}, "
        f"{result.config.micro_batch * result.config.seq_len / result.median_step_time:,.0f} tokens/s; "
        f"metrics, checkpoints and sample in {args.out}"
    )
    print(f"sample: {result.sample[:200]!r}")
    return 0


def _check_policy(pol: Policy, name: str, n_layers: int) -> None:
    pol.per_layer(n_layers)
    if pol.model is not None and pol.model != name:
        raise ConfigError(f"the plan {pol.describe()!r} was made for {pol.model!r}, not {name!r}; plan this model")


def _name_and_layers(config: TrainConfig) -> tuple[str, int]:
    """The model's name and layer count, before any work (a factory is built on the meta device to count)."""
    source = train_source(config)
    if source.spec is not None:
        spec = build_spec(config, vocab=1)
        return spec.name, spec.n_layers
    return source.name, source.n_layers or len(find_layers(build_source(source, device="meta").model))


def _check_out_folder(out: str) -> None:
    check_folder(out, "--out", "runs/train")


def _png(path: str) -> Path:
    png = writable(path, "--png", "loss.png")
    if png.suffix.lower() not in ("", ".png"):
        raise ConfigError(f"--png {path!r} is not a .png path; the loss curves are a PNG image, e.g. loss.png")
    return png


def add_compare_args(p: argparse.ArgumentParser) -> None:
    add_field_args(p, _fields("policy", "resume"), out="runs/compare")
    p.add_argument(
        "--policies",
        default="none,block,attn+mlp",
        help="comma-separated policies (names or plan files); the first is the reference",
    )
    p.add_argument("--png", help="where to write the loss-curve PNG (default: OUT/loss.png)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def run_compare(args: argparse.Namespace) -> int:
    policies = csv(args.policies)
    if not policies:
        raise ConfigError(f"--policies {args.policies!r} names no policy; e.g. --policies none,block")
    distinct("--policies", policies)
    _check_out_folder(args.out)
    name, n_layers = _name_and_layers(_config(args, "policy", "resume"))
    for p in policies:
        _check_policy(Policy.parse(p), name, n_layers)  # every policy and plan fits the model, before training
    png = _png(args.png) if args.png is not None else Path(args.out) / "loss.png"
    if args.tp > 1 or args.dp > 1 or args.sp:
        raise ConfigError("compare-train runs one process; drop --tp/--sp/--dp (recompute train takes them)")
    with progress_bar("compare-train", enabled=not args.json) as progress:
        rows, runs = compare_train(_config(args, "policy", "resume"), policies, progress=progress)
    plot_losses(runs, png)
    if args.json:
        emit_json({"rows": [dataclasses.asdict(r) for r in rows], "png": str(png)})
    else:
        print(render_compare(rows))
        print(f"\nloss curves: {png}")
    return 0
