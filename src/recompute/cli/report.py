"""``recompute report``: the workshop page from recompute's own numbers, one self-contained HTML file.

plotly and matplotlib (optional) are imported when the page is drawn; torch for ``--trace`` and for the savings
table's predicted times (a fake-tensor trace of the step, cached; ``--no-time`` leaves them out).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import time
from typing import Any

from recompute.cli._common import (
    add_model_args,
    add_time_args,
    add_workload_args,
    time_device,
    workload_flags,
    workload_from,
    writable,
)
from recompute.cli._lazy import torch_floor
from recompute.core.analytic.memory import layer_activations
from recompute.core.errors import ConfigError, first_line, require
from recompute.core.files import atomic_write, check_folder
from recompute.core.hardware import gpu_by_name, usable_bytes
from recompute.core.plan import NothingFits, Plan, parse_budget, plan
from recompute.core.presets import PRESETS
from recompute.core.pricing import DEFAULT_GPU, Job, offload_layer_seconds, timing, unpriced
from recompute.core.spec import ModelSpec, resolve_model
from recompute.core.timing import Timing
from recompute.core.workload import ATTENTIONS, Workload
from recompute.planning import ModelTables, cost_tables, max_positions, preset_works
from recompute.progress import progress_bar
from recompute.report.answer import answer_data
from recompute.report.data import build_report
from recompute.report.extras import bench_section, plan_section, read_plan_file, trace_section
from recompute.report.html import render_html
from recompute.report.measured import profile_section
from recompute.report.png import write_pngs

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    """The report's options: the model and workload options of ``estimate``, then the report's own."""
    add_model_args(p)
    add_workload_args(p, "report")
    for action in p._actions:  # the report sweeps s; --seq-len only places the savings table
        if action.dest == "seq_len":
            action.help = f"s of the savings table ({str(action.help).split('(', 1)[1]}; the charts sweep 1K to 128K"
    add_time_args(p, what="plan for it, draw its memory line and predict the savings table's times")
    p.add_argument(
        "--budget",
        help="memory per GPU the answer's plan may use: a size or a GPU name (default: --gpu's usable memory)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the real step of every policy at --seq-len (fake tensors, torch; tens of seconds) and compare",
    )
    p.add_argument("--bench", metavar="RESULTS.json", help="a `recompute bench` result: measured next to predicted")
    p.add_argument("--plan", metavar="PLAN.json", help="a `recompute plan -o` file: the plan per layer and frontier")
    p.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default: report.html)")
    p.add_argument("--png", metavar="DIR", help="also write the main charts as PNG files into DIR (matplotlib)")


def _require_extra(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"recompute report needs {' and '.join(missing)}; install the extra: pip install 'recompute[report]'"
        )


def _sections(args: argparse.Namespace, spec: ModelSpec | None, wl: Workload) -> dict[str, Any]:
    """The optional sections asked for; the files are read (and refused) before the slow trace runs. A model the
    analytic model does not read takes ``--plan`` (drawn as its planner predicted it, once the model's identity is
    known: ``_measured``), not the sections drawn against the analytic model."""
    if spec is None:
        asked = [flag for flag, on in (("--bench", args.bench), ("--trace", args.trace)) if on]
        require(
            not asked,
            f"{', '.join(asked)} draw(s) against the analytic model, which does not read {args.model}; "
            "drop them (the page draws the model's own profile and plan; --plan takes a plan file)",
        )
        if args.plan:
            read_plan_file(args.plan)
        return {}
    sections: dict[str, Any] = {}
    if args.plan:
        sections["plan"] = plan_section(args.plan, spec)
    if args.bench:
        sections["bench"] = bench_section(args.bench, spec)
    if args.trace:
        sections["trace"] = trace_section(spec, wl, trace=torch_floor("recompute.trace").trace)
    return sections


def _answer(
    args: argparse.Namespace, wl: Workload, budget: float, gpu: str
) -> tuple[dict[str, Any], ModelTables, Plan | None]:
    """The first screen: the one planner's plan for this workload on this GPU (offload and the chunked loss
    weighed), priced in time unless --no-time; what it says when nothing fits. Also the tables and the plan."""
    device = None if args.no_time else time_device(args)
    flags = " ".join(workload_flags(wl))
    unit, scale = ("GiB", 2**30) if budget >= 2**30 else ("MiB", 2**20)  # a tiny model's budget read 0.00GiB
    size = f"{budget / scale:.2f}{unit}"
    command = f"recompute plan --model {args.model} {flags} --gpu {gpu} --budget {size} -o plan.json"
    usable, label = usable_bytes(gpu), gpu_by_name(gpu).label
    with progress_bar("profile") as progress:
        found = cost_tables(args.model, wl, device=device, losses=("chunked",), offload=True, progress=progress)
    try:
        result = plan(found.tables, budget, alternatives=found.alternatives, notes=found.notes)
    except NothingFits as e:
        refused = answer_data(None, budget=budget, gpu=label, usable=usable, command=command, refusal=str(e))
        return refused, found, None
    return answer_data(result, budget=budget, gpu=label, usable=usable, command=command), found, result


def _measured(args: argparse.Namespace, found: ModelTables, result: Plan | None, budget: float) -> dict[str, Any]:
    """The sections of a profiled model: its charts (``report.measured``), and ``--plan`` checked against it."""
    drawn = result if result is not None else plan(found.tables, math.inf)  # nothing fits: the frontier still
    chosen = result is not None
    sections = {"profile": profile_section(drawn, found.profiles, found.tables, budget=budget, chosen=chosen)}
    if args.plan and found.model is not None:
        sections["plan"] = plan_section(args.plan, found.model)
    return sections


def _times(args: argparse.Namespace, spec: ModelSpec, wl: Workload) -> dict[str, dict[str, Timing]] | None:
    """Each policy's predicted timing at the savings table's length, per attention (None with --no-time)."""
    device = time_device(args)
    at = dataclasses.replace(wl, seq_len=min(wl.seq_len, spec.max_positions))
    if args.no_time or unpriced(at) or args.model not in PRESETS:
        return None
    out = {}
    for attention in ATTENTIONS:
        wl_a = dataclasses.replace(at, attention=attention)
        job = Job.of(spec, wl_a)
        works = preset_works(spec, wl_a)
        out[attention] = {p: timing(works[p], works["none"], device, job) for p in works}
        if wl_a.dtype != "fp16":  # the chunked loss refuses fp16
            chunked = preset_works(spec, dataclasses.replace(wl_a, loss="chunked"))
            out[attention]["chunked loss"] = timing(chunked["none"], works["none"], device, job)
        held = layer_activations(spec, wl_a).offloaded("offload")
        layer = offload_layer_seconds(works["none"], held, device, job)
        if layer is not None:
            base = out[attention]["none"]
            step = base.step + spec.n_layers * layer
            out[attention]["offload"] = Timing(
                device.label, step, base.tokens_per_second * base.step / step, step / base.step - 1
            )
    return out


def run(args: argparse.Namespace) -> int:
    """Compute the report, render it, write the HTML (and PNGs); print one line saying what was written."""
    _require_extra("plotly", *(["matplotlib"] if args.png else []))
    start = time.perf_counter()
    gpu = args.gpu or DEFAULT_GPU
    gpu_by_name(gpu)  # fail on bad input before computing anything
    out = writable(args.output, "-o", "report.html", args)
    png = check_folder(args.png, "--png", "pngs") if args.png is not None else None
    budget = parse_budget(args.budget) if args.budget is not None else usable_bytes(gpu)
    try:
        spec: ModelSpec | None = resolve_model(args.model)
        why = ""
    except ConfigError as e:  # a factory, or a class the analytic model does not read: the answer alone
        spec, why = None, first_line(e)
    wl = workload_from(args, spec if spec is not None else max_positions(args.model))
    if spec is not None:
        wl.check(spec)
    sections = _sections(args, spec, wl)
    answer, found, result = _answer(args, wl, budget, gpu)
    if spec is None:
        sections = _measured(args, found, result, budget)
    times = _times(args, spec, wl) if spec is not None else None
    report = build_report(
        spec if spec is not None else args.model, wl, gpu=gpu, sections=sections, times=times, answer=answer,
        analytic=why,
    )  # fmt: skip
    try:
        atomic_write(out, render_html(report))
    except OSError as e:
        raise ConfigError(f"cannot write {str(out)!r}: {e.strerror}; pass -o a writable path") from e
    written = [str(out)]
    if png is not None:
        written += [str(p) for p in write_pngs(report, png)]
    print(f"wrote {', '.join(written)} in {time.perf_counter() - start:.1f} s")
    return 0
