"""Options and helpers every command shares: the model, the workload, the policy, JSON output, output paths.

Workload options are generated from ``Workload``'s fields, so each is declared once; each command's defaults
(where they differ) and the fields it takes are stated once here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from recompute.core.errors import ConfigError
from recompute.core.files import check_writable
from recompute.core.plan_file import FORMAT as PLAN_FORMAT
from recompute.core.policy import ALL_POLICIES, Policy
from recompute.core.presets import PRESETS
from recompute.core.pricing import DEFAULT_GPU, DEFAULT_GPUS_PER_NODE, choose_device
from recompute.core.profile import FORMAT as PROFILE_FORMAT
from recompute.core.results import BENCH_FORMAT
from recompute.core.spec import ModelSpec
from recompute.core.timing import DEVICE_FORMAT, Device
from recompute.core.workload import Workload, default_precision, workload_fields
from recompute.train.config import TRAIN_WORKLOAD, resolve_auto
from recompute.train.config import WORKLOAD_DEFAULTS as TRAIN_DEFAULTS

if TYPE_CHECKING:  # the analytic commands run without torch
    from recompute.models.source import ModelSource

__all__ = [
    "JSON_FORMATS",
    "Parser",
    "add_field_args",
    "add_model_args",
    "add_policy_args",
    "add_source_args",
    "add_time_args",
    "add_workload_args",
    "csv",
    "emit_json",
    "measured_workload",
    "policy_from",
    "time_device",
    "workload_flags",
    "workload_from",
    "writable",
]

SEQ_LEN = {
    "report": 16384,
    "bench": 256,
    "verify": 64,
    "train": TRAIN_DEFAULTS["seq_len"],
    "compare-train": TRAIN_DEFAULTS["seq_len"],
}
"""Each command's default sequence length (else 2048), or the model's context if shorter: the commands that run
real steps here (bench, verify, train) default to sizes a CPU runs in seconds; the report's savings table sits
at the workshop page's 16K."""

WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "trace": {"device": "cpu"},
    "bench": {"micro_batch": 4, "dtype": "fp32", "device": "auto"},
    "verify": {"micro_batch": 2, "dtype": "fp32", "device": "cpu"},
    "train": TRAIN_DEFAULTS,
    "compare-train": TRAIN_DEFAULTS,
}
"""Each command's workload defaults where they differ from ``Workload``'s (``auto``: cuda when torch sees one)."""

WORKLOAD_FIELDS: dict[str, tuple[str, ...]] = {
    "verify": ("micro_batch", "seq_len", "attention", "device"),
    "train": TRAIN_WORKLOAD,
    "compare-train": tuple(f for f in TRAIN_WORKLOAD if f not in ("tp", "sp", "dp")),
}
"""The workload fields a command takes where it does not take them all (a flag it would ignore is not offered)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser, *, built: bool = False) -> None:
    """``--model``; ``built``: the command builds the model, so any config.json or a factory will do."""
    kinds = "a transformers config.json (or its folder), or package.module:factory" if built else "an HF config.json"
    p.add_argument("--model", default="gpt2", help=f"preset name, {kinds} (default: gpt2)")


def add_field_args(p: argparse.ArgumentParser, fields: Sequence[dataclasses.Field[Any]], **defaults: Any) -> None:
    """One option per dataclass field, from the ``flag``/``help``/``choices`` in the field's metadata."""
    for f in fields:
        meta, default = f.metadata, defaults.get(f.name, f.default)
        if f.type in ("bool", bool):
            p.add_argument(meta["flag"], dest=f.name, action="store_true", default=default, help=meta["help"])
            continue
        kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
        choices = tuple(meta.get("choices", ())) + (("auto",) if default == "auto" else ())
        extra: dict[str, Any] = {"choices": choices} if choices else {}
        shown = f" (default: {default})" if default is not None else ""
        p.add_argument(meta["flag"], dest=f.name, type=kind, default=default, help=meta["help"] + shown, **extra)


def add_workload_args(p: argparse.ArgumentParser, command: str, **resolved_later: None) -> None:
    """The workload options ``command`` takes (``WORKLOAD_FIELDS``), with its defaults (``WORKLOAD_DEFAULTS``,
    ``SEQ_LEN``), declared once by ``Workload``'s fields; ``resolved_later``: fields whose default the command
    resolves itself (None in the namespace, e.g. train's ``loss`` from a plan)."""
    wanted = WORKLOAD_FIELDS.get(command)
    fields = [f for f in workload_fields() if wanted is None or f.name in wanted]
    add_field_args(p, fields, **{**WORKLOAD_DEFAULTS.get(command, {}), "seq_len": None, **resolved_later})
    for action in p._actions:
        if action.dest == "seq_len":
            action.help = f"{action.help} (default: {SEQ_LEN.get(command, 2048)}, or the model's context if shorter)"
        if action.dest == "device" and action.default == "auto":
            action.help = f"{action.help}; auto: cuda when torch sees one, else cpu"
        if action.dest == "dtype" and action.default == "auto":
            action.help = f"{action.help}; auto: bf16 (autocast over fp32 weights) on cuda, fp32 on cpu"


class HasPositions(Protocol):
    """A model as ``workload_from`` sees it: the longest sequence it takes (``None``: no limit known)."""

    @property
    def max_positions(self) -> int | None: ...


def workload_from(args: argparse.Namespace, model: ModelSpec | ModelSource | HasPositions | int | None) -> Workload:
    """The Workload the options describe: an unset ``--seq-len`` is the command's default or the model's
    context (``model``: its longest sequence, or something with ``max_positions``), whichever is shorter;
    ``--device auto`` is cuda when torch sees one; an unset ``--precision`` is ``default_precision``'s (amp for
    a model recompute traces, in a 16-bit dtype)."""
    values = {f.name: getattr(args, f.name) for f in workload_fields() if hasattr(args, f.name)}
    if values.get("seq_len") is None:
        default = SEQ_LEN.get(args.command, 2048)
        positions = model if isinstance(model, int) or model is None else model.max_positions
        values["seq_len"] = min(default, positions or default)
    values = resolve_auto(values)
    if "precision" in values and values["precision"] is None:
        preset = getattr(args, "model", None) in PRESETS or bool(getattr(args, "analytic", False))
        values["precision"] = default_precision(preset=preset, dtype=str(values.get("dtype", "bf16")))
    wl = Workload(**{k: v for k, v in values.items() if v is not None or k not in ("loss", "precision")})
    wl.check_loss_chunk()
    return wl


def add_source_args(p: argparse.ArgumentParser) -> None:
    """``--analytic`` and ``--profile``: where a model that is not a preset gets its figures."""
    p.add_argument(
        "--analytic",
        action="store_true",
        help="use the closed-form model even for a model that is not a preset (default: its measured profile)",
    )
    p.add_argument("--profile", help="a `recompute profile -o` file: use it, at its workload (no torch needed)")


def workload_flags(wl: Workload) -> list[str]:
    """The options that give ``wl`` on the command line: its fields that differ from the defaults."""
    defaults = {**Workload().to_dict(), "precision": Workload(dtype=wl.dtype).precision}  # it follows the dtype
    out = []
    for f in workload_fields():
        value = getattr(wl, f.name)
        if value == defaults[f.name]:
            continue
        out += [f.metadata["flag"]] if isinstance(value, bool) else [f.metadata["flag"], str(value)]
    return out


PRICED_STATES = ("precision", "dp")
"""Workload fields a profile's states are re-priced for rather than measured at."""


def measured_workload(args: argparse.Namespace, profile: Any) -> Workload:
    """The workload of a ``--profile`` file, which the options may not contradict: a model or a workload option
    the user gave (``args.given``) that differs from the profile's is refused, not silently ignored. But for
    ``--precision`` and ``--dp``: they only price the model states, which ``Profile.restated`` re-prices."""
    given_options: set[str] = getattr(args, "given", set())
    priced = {k: getattr(args, k) for k in PRICED_STATES if k in given_options and getattr(args, k, None) is not None}
    wl = Workload(**{**profile.workload_dict(), **priced})
    if "model" in given_options and args.model not in (profile.model, profile.origin):
        raise ConfigError(
            f"--model {args.model} contradicts --profile (a profile of {profile.model}); drop one of them"
        )
    for f in workload_fields():
        given = getattr(args, f.name, None)
        if f.name not in given_options or given == getattr(wl, f.name):
            continue
        raise ConfigError(
            f"{f.metadata['flag']} {given} contradicts --profile, measured at {getattr(wl, f.name)}; drop "
            f"{f.metadata['flag']} (a profile is of one workload: measure another with recompute profile)"
        )
    return wl


def add_time_args(p: argparse.ArgumentParser, *, what: str = "predict step times", no_time: bool = True) -> None:
    """``--gpu`` (the device everywhere), ``--device-profile``, ``--compiled`` and ``--no-time``."""
    p.add_argument("--gpu", help=f"the GPU you train on: {what} on its datasheet row (default: {DEFAULT_GPU})")
    p.add_argument(
        "--device-profile",
        help=f"a `recompute calibrate -o` file: {what} on that device (instead of --gpu's datasheet row)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="the step runs under torch.compile or CUDA graphs: price no eager host dispatch, a bare launch per "
        "kernel (default: eager PyTorch, the host's time per kernel as calibrated)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_GPUS_PER_NODE,
        help="GPUs per node: a parallel group within a node talks over --gpu's NVLink (or PCIe), across nodes over "
        f"each GPU's InfiniBand (default: {DEFAULT_GPUS_PER_NODE})",
    )
    if no_time:
        p.add_argument(
            "--no-time",
            action="store_true",
            help="leave predicted times out (no fake-tensor trace of the step; FLOPs only, without torch)",
        )


def time_device(args: argparse.Namespace) -> Device:
    """The device of ``--device-profile``, else ``--gpu``'s datasheet row, else the default GPU's (``--compiled``:
    priced without eager host dispatch).

    Raises:
        ConfigError: a missing or unreadable device profile, or an unknown GPU.
    """
    return choose_device(
        gpu=getattr(args, "gpu", None),
        device_profile=getattr(args, "device_profile", None),
        compiled=getattr(args, "compiled", False),
        gpus_per_node=getattr(args, "gpus_per_node", None),
    )


def add_policy_args(p: argparse.ArgumentParser, default: str | None = "block") -> None:
    p.add_argument(
        "--policy",
        default=default,
        help=f"one of {', '.join(ALL_POLICIES)} (or full = block, selective = core_attn), with its layers as "
        f"NAME:every=K or NAME:first=N, or a plan/policy JSON file (default: {default})",
    )
    p.add_argument("--every", type=int, help="apply the policy to every k-th layer only")
    p.add_argument("--first", type=int, help="apply the policy to the first n layers only")


def policy_from(args: argparse.Namespace) -> Policy:
    pol = Policy.parse(args.policy)
    if args.every is not None or args.first is not None:
        if not pol.is_uniform:
            given = [f"--{k}" for k in ("every", "first") if getattr(args, k) is not None]
            raise ConfigError(
                f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to a plain policy name, not to "
                f"{args.policy!r}; drop {' and '.join(given)} or give the layers in the name (NAME:every=K)"
            )
        pol = dataclasses.replace(pol, every=args.every, first=args.first)
    return pol


JSON_FORMATS = {
    "estimate": "recompute.estimate/2",
    "plan": PLAN_FORMAT,
    "profile": PROFILE_FORMAT,
    "trace": "recompute.trace/1",
    "trace --compiled": "recompute.trace.compiled/1",
    "verify": "recompute.verify/1",
    "validate": "recompute.validate/1",
    "bench": BENCH_FORMAT,
    "bench --tp/--dp": "recompute.bench.parallel/1",
    "bench --fsdp": "recompute.bench.fsdp/1",
    "calibrate": DEVICE_FORMAT,
    "compare-train": "recompute.compare-train/1",
}
"""Each command's ``--json`` shape by name (docs/json.md): the same for every model source; the name changes when
the shape does. A plan, a profile and a device profile print the format of the file they write."""


def emit_json(data: dict[str, Any], command: str) -> None:
    """Print ``command``'s ``--json`` output: ``data`` under its ``format`` (``JSON_FORMATS``), first."""
    name = JSON_FORMATS[command]
    assert data.get("format", name) == name, f"{command} --json: {data.get('format')!r} is not {name!r}"
    json.dump({"format": name, **data}, sys.stdout, indent=2)
    sys.stdout.write("\n")


def csv(value: str) -> list[str]:
    """``a, b,,c`` -> ``[a, b, c]``."""
    return [v.strip() for v in value.split(",") if v.strip()]


INPUT_FLAGS = ("model", "profile", "plan", "policy", "bench", "device_profile", "data")
"""Options that name a file the command reads: an output may not be one of them."""


def writable(path: str | Path, flag: str, example: str = "out.json", inputs: argparse.Namespace | None = None) -> Path:
    """``path`` if a file can be written there (``recompute.core.files.check_writable``: a probe file is made and
    removed in its folder); checked before any work starts. Write it with ``atomic_write``. ``inputs``: the
    command's options, whose input files (``INPUT_FLAGS``) the output may not replace.

    Raises:
        ConfigError: empty, a folder, a device, a symlink loop, its folder is missing or takes no new file, or
            it is a file the command reads.
    """
    out = check_writable(path, flag, example)
    for name in INPUT_FLAGS if inputs is not None and out.exists() else ():
        given = getattr(inputs, name, None)
        if isinstance(given, str) and given and Path(given).is_file() and Path(given).samefile(out):
            option = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} {str(path)!r} is the file {option} reads; writing it would replace that input: give "
                f"{flag} another path, e.g. {example}"
            )
    return out
