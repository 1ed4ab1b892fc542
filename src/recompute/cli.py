"""The ``recompute`` command line: a thin layer over the library's typed functions.

Workload options are generated from ``Workload``'s fields, so each is declared once. Bad input prints one
line (what was expected and how to fix it) and exits with code 2; nothing here prints a traceback for it.
Subcommands import torch only when they need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from recompute.errors import ConfigError
from recompute.policy import POLICIES, Policy
from recompute.presets import PRESETS
from recompute.report.command import add_report_args, run_report
from recompute.spec import ModelSpec
from recompute.verification import add_verify_args, run_verify
from recompute.workload import Workload, workload_fields

__all__ = ["main", "main_exit", "resolve_model"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def resolve_model(name: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json (file or directory) by path."""
    if name in PRESETS:
        return ModelSpec.from_name(name)
    if Path(name).exists():
        return ModelSpec.from_hf_config(name, name=Path(name).stem if Path(name).is_file() else Path(name).name)
    raise ConfigError(f"{name!r} is not a known model or a config.json path; known models: {', '.join(PRESETS)}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help="preset name or path to an HF config.json (default: gpt2)")


DEFAULT_SEQ_LEN = 2048


def add_field_args(p: argparse.ArgumentParser, fields: Sequence[dataclasses.Field[Any]], **defaults: Any) -> None:
    """One option per dataclass field, from the ``flag``/``help``/``choices`` in the field's metadata."""
    for f in fields:
        meta, default = f.metadata, defaults.get(f.name, f.default)
        if f.type in ("bool", bool):
            p.add_argument(meta["flag"], dest=f.name, action="store_true", default=default, help=meta["help"])
            continue
        kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
        extra = {"choices": meta["choices"]} if "choices" in meta else {}
        shown = f" (default: {default})" if default is not None else ""
        if f.name == "seq_len" and default is None:
            shown = f" (default: {DEFAULT_SEQ_LEN}, or the model's context if shorter)"
        p.add_argument(meta["flag"], dest=f.name, type=kind, default=default, help=meta["help"] + shown, **extra)


def add_workload_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One option per ``Workload`` field; ``--seq-len`` defaults to 2048, or the model's context if shorter."""
    add_field_args(p, workload_fields(), **{"seq_len": None, **defaults})


def workload_from(args: argparse.Namespace, spec: ModelSpec) -> Workload:
    """The Workload the options describe, with an unset ``--seq-len`` fitted to ``spec``."""
    values = {f.name: getattr(args, f.name) for f in workload_fields()}
    if values["seq_len"] is None:
        values["seq_len"] = min(DEFAULT_SEQ_LEN, spec.max_positions)
    return Workload(**values)


def add_policy_args(p: argparse.ArgumentParser, default: str | None = "block") -> None:
    p.add_argument(
        "--policy",
        default=default,
        help=f"one of {', '.join(POLICIES)}, or a plan/policy JSON file (default: {default})",
    )
    p.add_argument("--every", type=int, help="apply the policy to every k-th layer only")
    p.add_argument("--first", type=int, help="apply the policy to the first n layers only")


def policy_from(args: argparse.Namespace) -> Policy:
    pol = Policy.parse(args.policy)
    if args.every is not None or args.first is not None:
        if not pol.is_uniform:
            raise ConfigError("--every/--first apply to a policy name, not to a per-layer plan file")
        pol = dataclasses.replace(pol, every=args.every, first=args.first)
    return pol


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


# --- estimate ---------------------------------------------------------------------------------------------


def _estimate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p)
    add_policy_args(p)
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON")


def _estimate_run(args: argparse.Namespace) -> int:
    from recompute.analytic import estimate, estimate_policies
    from recompute.render import render_estimate

    spec = resolve_model(args.model)
    wl = workload_from(args, spec)
    rows, chosen = estimate_policies(spec, wl), estimate(spec, wl, policy_from(args))
    if args.json:
        emit_json(
            {
                "model": spec.to_dict(),
                "workload": wl.to_dict(),
                "policies": [e.to_dict() for e in rows],
                "chosen": chosen.to_dict(),
            }
        )
    else:
        print(render_estimate(spec, wl, rows, chosen))
    return 0


# --- plan -------------------------------------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", help="memory budget per GPU, e.g. 70GiB or 80GB")
    budget.add_argument("--gpu", help="a GPU name (e.g. h100-80gb): its usable memory is the budget")
    p.add_argument(
        "--cost",
        choices=("flops", "measured"),
        default="flops",
        help="recompute cost: analytic FLOPs, or step times measured by `recompute bench` (--bench)",
    )
    p.add_argument("--bench", help="a `recompute bench --json` result, for --cost measured")
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the chosen plan's step on fake tensors and re-plan until its traced peak fits (needs torch)",
    )
    p.add_argument("-o", "--output", help="write the plan file here (apply and bench take it as is)")
    p.add_argument("--json", action="store_true", help="print the plan, frontier and prediction as JSON")


def _plan_run(args: argparse.Namespace) -> int:
    from recompute.plan import parse_budget, plan
    from recompute.render import render_plan

    spec = resolve_model(args.model)
    wl = workload_from(args, spec)
    if args.gpu:
        from recompute.hardware import gpu_by_name, usable_bytes

        budget = float(usable_bytes(gpu_by_name(args.gpu)))
    else:
        budget = parse_budget(args.budget)
    if (args.cost == "measured") != (args.bench is not None):
        raise ConfigError("--cost measured needs --bench RESULTS.json (and --bench needs --cost measured)")
    result = plan(spec, wl, budget, measured=args.bench, traced=args.trace)
    if args.output:
        Path(args.output).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if args.json:
        emit_json(result.to_dict())
    else:
        print(render_plan(spec, wl, result))
        if args.output:
            print(f"\nwrote {args.output}")
    return 0


# --- train, compare-train -----------------------------------------------------------------------------------


def _train_fields(*skip: str) -> list[dataclasses.Field[Any]]:
    from recompute.train.config import TrainConfig

    return [f for f in dataclasses.fields(TrainConfig) if f.name not in skip]


def _train_config(args: argparse.Namespace, *skip: str) -> Any:
    from recompute.train.config import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in _train_fields(*skip)})


def _train_args(p: argparse.ArgumentParser) -> None:
    add_field_args(p, _train_fields())
    p.add_argument("--plan", help="a plan JSON file to apply instead of --policy")


def _train_run(args: argparse.Namespace) -> int:
    from recompute.train import train

    if args.plan:
        args.policy = args.plan
    result = train(_train_config(args))
    if result.rank != 0:
        return 0  # under torchrun, rank 0 reports
    last = result.metrics[-1]
    print(
        f"trained {result.spec.name} ({args.policy}) for {last.step + 1} steps: final loss {last.loss:.4f}, "
        f"{result.config.micro_batch * result.config.seq_len / result.median_step_time:,.0f} tokens/s; "
        f"metrics, checkpoints and sample in {args.out}"
    )
    print(f"sample: {result.sample[:200]!r}")
    return 0


def _compare_args(p: argparse.ArgumentParser) -> None:
    add_field_args(p, _train_fields("policy", "resume"), out="runs/compare")
    p.add_argument(
        "--policies",
        default="none,block,attn+mlp",
        help="comma-separated policies (names or plan files); the first is the reference",
    )
    p.add_argument("--png", help="where to write the loss-curve PNG (default: OUT/loss.png)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def _compare_run(args: argparse.Namespace) -> int:
    from recompute.policy import Policy
    from recompute.train import compare_train, plot_losses, render_compare

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        Policy.parse(p)  # fail fast on a bad name, before any training
    if args.tp > 1 or args.dp > 1 or args.sp:
        raise ConfigError("compare-train runs one process; drop --tp/--sp/--dp (recompute train takes them)")
    rows, runs = compare_train(_train_config(args, "policy", "resume"), policies, quiet=args.json)
    png = Path(args.png or Path(args.out) / "loss.png")
    plot_losses(runs, png)
    if args.json:
        emit_json({"rows": [dataclasses.asdict(r) for r in rows], "png": str(png)})
    else:
        print(render_compare(rows))
        print(f"\nloss curves: {png}")
    return 0


# --- trace, validate, bench -------------------------------------------------------------------------------


def _built_model(name: str) -> tuple[ModelSpec, bool]:
    """``--model`` for commands that build the model; ``hf:NAME`` or a config.json path builds transformers'."""
    base = name.removeprefix("hf:")
    return resolve_model(base), name.startswith("hf:") or Path(base).exists()


def _trace_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_workload_args(p, device="cpu")
    add_policy_args(p, default="none")
    p.add_argument(
        "--layers",
        type=int,
        help="trace K and K+1 layers and scale to all of them (exact for identical layers; much faster)",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="gradients stay allocated between steps (zero_grad(set_to_none=False), DDP/Megatron), as estimate assumes",
    )
    p.add_argument("--json", action="store_true", help="print the trace as JSON")


def _trace_run(args: argparse.Namespace) -> int:
    from recompute.trace import render_trace, trace

    spec, hf = _built_model(args.model)
    wl, pol = workload_from(args, spec), policy_from(args)
    result = trace(spec, wl, pol, layers=args.layers, hf=hf, keep_grads=args.keep_grads)
    emit_json(result.to_dict()) if args.json else print(render_trace(result))
    return 0


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(PRESETS), help="comma-separated presets (default: all)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies (default: all)")
    p.add_argument("--attention", default="eager,flash", help="comma-separated: eager, flash (default: both)")
    p.add_argument("--seq-lens", help="comma-separated lengths (default: each model's context, max 8192, and half)")
    p.add_argument("--micro-batch", type=int, default=1, help="b (default: 1)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="activation dtype (default: bf16)")
    p.add_argument("--components", action="store_true", help="also show the error of every component")
    p.add_argument("--peaks", action="store_true", help="also compare the step's peak with estimate (slower)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def _validate_run(args: argparse.Namespace) -> int:
    from recompute.validate import render_validation, stderr_progress, validate

    for name in _csv(args.models):
        resolve_model(name)
    for name in _csv(args.policies):
        Policy.parse(name)
    result = validate(
        _csv(args.models),
        policies=_csv(args.policies),
        attentions=_csv(args.attention),
        lengths=[int(s) for s in _csv(args.seq_lens)] if args.seq_lens else None,
        micro_batch=args.micro_batch,
        dtype=args.dtype,
        peaks=args.peaks,
        progress=None if args.json else stderr_progress,
    )
    if not args.json:
        print(file=sys.stderr)
    emit_json(result.to_dict()) if args.json else print(render_validation(result, components=args.components))
    return 0 if result.passed else 1


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset or hf:NAME (default: GPT-2 at 6 layers, h 384, 6 heads: CPU-sized)")
    for flag, field in (("--layers", "n_layers"), ("--hidden", "hidden"), ("--heads", "n_heads")):
        p.add_argument(flag, dest=field, type=int, help=f"override the model's {field}")
    p.add_argument("--kv-heads", dest="n_kv_heads", type=int, help="override the model's n_kv_heads")
    p.add_argument("--vocab", type=int, help="override the model's vocabulary size")
    add_workload_args(p, seq_len=256, micro_batch=4, dtype="fp32", device=None)
    p.add_argument("--policies", default="none,block", help="comma-separated; the first is the reference")
    p.add_argument("--plan", help="a plan JSON file (recompute plan -o), benched after --policies")
    p.add_argument("--keep-grads", action="store_true", help="keep gradients allocated between steps (as estimate)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per policy, after warm-up (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per policy (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default: 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _bench_run(args: argparse.Namespace) -> int:
    import torch

    from recompute.bench import bench, bench_spec, render_bench, stderr_progress

    keys = ("n_layers", "hidden", "n_heads", "n_kv_heads", "vocab")
    spec, hf = bench_spec(args.model, **{k: getattr(args, k) for k in keys})
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    policies = _csv(args.policies) + ([args.plan] if args.plan else [])
    for name in policies:
        Policy.parse(name)
    wl = workload_from(args, spec)
    if wl.tp > 1 or wl.dp > 1:
        return _bench_parallel(args, spec, wl, policies, hf)
    runs = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed}
    result = bench(spec, wl, policies, **runs, hf=hf, keep_grads=args.keep_grads, progress=stderr_progress)
    print(file=sys.stderr)
    emit_json(result.to_dict()) if args.json else print(render_bench(result))
    return 0


def _bench_parallel(args: argparse.Namespace, spec: ModelSpec, wl: Workload, policies: list[str], hf: bool) -> int:
    """``bench --tp/--dp`` under torchrun: every rank measures, rank 0 prints."""
    import torch.distributed as dist

    from recompute.bench import stderr_progress
    from recompute.parallel import bench_parallel, end_process_group, render_parallel_bench

    if hf:
        raise ConfigError("--tp/--dp bench recompute's reference GPT/Llama (recompute.parallel); drop the hf: model")
    runs = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed}
    say = lambda line: stderr_progress(line) if dist.get_rank() == 0 else None  # noqa: E731
    result = bench_parallel(spec, wl, policies, **runs, argv=args.argv, progress=say)
    if dist.get_rank() == 0:
        print(file=sys.stderr)
        emit_json(result.to_dict()) if args.json else print(render_parallel_bench(result))
        sys.stdout.flush()
    end_process_group()  # Note: [ending together]
    return 0


Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]

COMMANDS: dict[str, Command] = {
    "estimate": (
        _estimate_args,
        _estimate_run,
        "memory (by component) and FLOPs of a training step for every policy, from the analytic model",
    ),
    "train": (_train_args, _train_run, "train a reference GPT-2 or Llama with a recompute policy (the blog's run)"),
    "compare-train": (
        _compare_args,
        _compare_run,
        "the same training run under several policies: losses, peak memory and step time side by side",
    ),
    "plan": (
        _plan_args,
        _plan_run,
        "the cheapest per-layer recomputation whose predicted peak fits a memory budget, and the frontier",
    ),
    "verify": (
        add_verify_args,
        run_verify,
        "run a training step with and without a policy; compare loss and gradients (--model hf:NAME for HF)",
    ),
    "report": (
        add_report_args,
        run_report,
        "the workshop page from recompute's own numbers: one self-contained HTML file (plotly), PNGs with --png",
    ),
    "trace": (
        _trace_args,
        _trace_run,
        "every byte of a real training step on fake tensors (no memory used): states, layers, ops, peak",
    ),
    "validate": (
        _validate_args,
        _validate_run,
        "the analytic model against the trace for every preset, policy and attention: per-layer error",
    ),
    "bench": (
        _bench_args,
        _bench_run,
        "real training steps under each policy: peak memory, step time, tokens/s, measured vs predicted overhead",
    ),
}


ORDER = ("estimate", "trace", "validate", "plan", "verify", "bench", "train", "compare-train", "report")
"""The order ``recompute --help`` lists the commands in: the questions of the README, in turn."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="recompute",
        description="Know what activation recomputation saves and costs, plan it, apply it, check it.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in ORDER:
        add_args, _, help_text = COMMANDS[name]
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 for bad input)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to repeat in messages (the torchrun command)
    try:
        return COMMANDS[args.command][1](args)
    except ConfigError as e:
        print(f"recompute {args.command}: error: {e}", file=sys.stderr)
        return 2


def main_exit() -> NoReturn:
    """Console-script entry point."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # output piped into `head` and friends: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main_exit()
