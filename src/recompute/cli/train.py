"""``recompute train`` and ``recompute compare-train``: the blog's run, under one policy or several."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

from recompute.checkpointing import find_layers
from recompute.cli._common import add_field_args, add_workload_args, csv, emit_json, workload_from, writable
from recompute.core.errors import ConfigError, distinct, require
from recompute.core.files import check_folder
from recompute.core.identity import ModelId, require_same_model
from recompute.core.plan_file import read_plan
from recompute.core.policy import ALL_POLICIES, Policy, distinct_policies
from recompute.models.identity import source_identity
from recompute.models.source import ModelSource, build_source
from recompute.progress import progress_bar
from recompute.train import compare_train, plot_losses, render_compare, train
from recompute.train.config import TrainConfig
from recompute.train.data import load_text, make_tokenizer
from recompute.train.loop import build_spec, train_source

__all__ = ["add_compare_args", "add_train_args", "run_compare", "run_train"]


def _fields(*skip: str) -> list[dataclasses.Field[Any]]:
    """The run's own options (the workload's come from ``add_workload_args``)."""
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in ("workload", *skip)]


def _config(args: argparse.Namespace, *skip: str) -> TrainConfig:
    run = {f.name: getattr(args, f.name) for f in _fields(*skip)}
    return TrainConfig(workload=workload_from(args, None), **run)


def add_train_args(p: argparse.ArgumentParser) -> None:
    add_field_args(p, _fields())
    add_workload_args(p, "train", loss=None)
    _loss_from_plan_help(p)
    p.add_argument("--plan", help="a plan JSON file to apply instead of --policy (its loss mode too)")


def _loss_from_plan_help(p: argparse.ArgumentParser) -> None:
    for action in p._actions:
        if action.dest == "loss":
            action.help = f"{action.help} (default: a plan's loss mode, else full)"


def run_train(args: argparse.Namespace) -> int:
    if args.plan:
        args.policy = args.plan
    _resolve_loss(args, [args.policy])
    _check_out_folder(args.out)
    _check_policies(_config(args), [args.policy])
    with progress_bar("train", enabled=int(os.environ.get("RANK", "0")) == 0) as progress:
        result = train(_config(args), progress=progress)
    if result.rank != 0:
        return 0  # under torchrun, rank 0 reports
    last = result.metrics[-1]
    print(
        f"trained {result.name}, {result.built} ({args.policy}{', chunked loss' if args.loss == 'chunked' else ''}) "
        f"for {last.step + 1} steps: final loss {last.loss:.4f}, "
        f"{result.config.tokens_per_step / result.median_step_time:,.0f} tokens/s; "
        f"metrics, checkpoints and sample in {args.out}"
    )
    print(f"sample: {result.sample[:200]!r}")
    return 0


def _resolve_loss(args: argparse.Namespace, policies: list[str]) -> None:
    """``--loss``/``--loss-chunk`` from the plans among ``policies`` where not given; refused where they differ.

    Raises:
        ConfigError: a ``--loss`` or ``--loss-chunk`` a plan contradicts, or plans made with different losses.
    """
    files = [p for p in policies if p not in ALL_POLICIES and (p.endswith(".json") or Path(p).is_file())]
    planned = {p: loss for p in files if (loss := read_plan(p)[1]) is not None}
    modes = {mode for mode, _ in planned.values()}
    require(
        len(modes) <= 1,
        f"the plans were made with different loss modes ({', '.join(f'{p}: {m}' for p, (m, _) in planned.items())}); "
        "every run takes one: give plans made with one --loss",
        fields=("loss",),
    )
    for plan, (mode, chunk) in planned.items():
        require(
            args.loss in (None, mode),
            f"the plan {plan} was made with --loss {mode}, not {args.loss}; drop --loss (the plan's is taken), or "
            f"make a plan with --loss {args.loss}",
            fields=("loss",),
        )
        require(
            args.loss_chunk is None or chunk is None or args.loss_chunk == chunk,
            f"the plan {plan} was made with --loss-chunk {chunk}, not {args.loss_chunk}; drop --loss-chunk",
            fields=("loss_chunk",),
        )
        args.loss = mode
        args.loss_chunk = args.loss_chunk if args.loss_chunk is not None else chunk
    args.loss = args.loss or "full"


def _check_policies(config: TrainConfig, policies: list[str]) -> None:
    """Every policy and plan fits the model trained (its layer count; a plan its identity), before any work."""
    identity: ModelId | None = None
    n_layers = 0
    for pol in map(Policy.parse, policies):
        if pol.model is not None and pol.model.hash:
            identity = identity or _trained_identity(config)
            require_same_model(pol.model, identity)
        elif pol.model is not None:  # a plan older than the hash: by the name of what --model names
            require_same_model(pol.model, ModelId(train_source(config).name))
        if not pol.is_uniform:
            n_layers = n_layers or _n_layers(config)
            pol.per_layer(n_layers)


def _trained_identity(config: TrainConfig) -> ModelId:
    """The identity of the model ``config`` trains: a preset resized and given the tokenizer's vocabulary, or a
    config or factory as it is (a factory built on the meta device)."""
    source = train_source(config)
    if source.spec is None:
        return source_identity(source)
    text = load_text(config.data, config.dataset, seed=config.seed) if config.tokenizer != "byte" else ""
    spec = build_spec(config, make_tokenizer(config.tokenizer, text).vocab_size)
    return source_identity(ModelSource.preset(spec, hf=source.hf))


def _n_layers(config: TrainConfig) -> int:
    """The model's layer count, before any work (a factory is built on the meta device to count)."""
    source = train_source(config)
    if source.spec is not None:
        return build_spec(config, vocab=1).n_layers
    return source.n_layers or len(find_layers(build_source(source, device="meta").model))


def _check_out_folder(out: str) -> None:
    check_folder(out, "--out", "runs/train")


def _png(path: str) -> Path:
    png = writable(path, "--png", "loss.png")
    if png.suffix.lower() not in ("", ".png"):
        raise ConfigError(f"--png {path!r} is not a .png path; the loss curves are a PNG image, e.g. loss.png")
    return png


def add_compare_args(p: argparse.ArgumentParser) -> None:
    add_field_args(p, _fields("policy", "resume"), out="runs/compare")
    add_workload_args(p, "compare-train", loss=None)
    _loss_from_plan_help(p)
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
    distinct_policies("--policies", distinct("--policies", policies))
    _check_out_folder(args.out)
    _resolve_loss(args, policies)
    _check_policies(_config(args, "policy", "resume"), policies)
    png = _png(args.png) if args.png is not None else Path(args.out) / "loss.png"
    if importlib.util.find_spec("matplotlib") is None:  # refused now, not after the runs
        raise ConfigError("compare-train draws the loss curves with matplotlib; pip install 'recompute[report]'")
    with progress_bar("compare-train", enabled=not args.json) as progress:
        rows, runs = compare_train(_config(args, "policy", "resume"), policies, progress=progress)
    plot_losses(runs, png)
    if args.json:
        emit_json({"rows": [dataclasses.asdict(r) for r in rows], "png": str(png)}, "compare-train")
    else:
        print(render_compare(rows))
        print(f"\nloss curves: {png}")
    return 0
