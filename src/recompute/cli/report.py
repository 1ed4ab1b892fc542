"""``recompute report``: the workshop page from recompute's own numbers, one self-contained HTML file.

plotly and matplotlib (optional) are imported when the page is drawn; torch for ``--trace`` and for the savings
table's predicted times (a fake-tensor trace of the step, cached; ``--no-time`` leaves them out).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
from typing import Any

from recompute.cli._common import add_model_args, add_workload_args, workload_from, writable
from recompute.cli._lazy import torch_floor
from recompute.cli._timed import offload_layer_seconds, preset_works, time_device, untimed_reason
from recompute.core.errors import ConfigError
from recompute.core.files import atomic_write, check_folder
from recompute.core.hardware import GPUS, gpu_by_name
from recompute.core.spec import ModelSpec, resolve_model
from recompute.core.timing import Timing, timing
from recompute.core.workload import ATTENTIONS, Workload
from recompute.report.data import build_report
from recompute.report.extras import bench_section, plan_section, trace_section
from recompute.report.html import render_html
from recompute.report.png import write_pngs

__all__ = ["DEFAULT_TABLE_SEQ_LEN", "add_args", "run"]

DEFAULT_TABLE_SEQ_LEN = 16384
"""Where the savings table is taken by default, as on the workshop page (8B at 16K)."""


def add_args(p: argparse.ArgumentParser) -> None:
    """The report's options: the model and workload options of ``estimate``, then the report's own."""
    add_model_args(p)
    add_workload_args(p)
    for action in p._actions:  # the report sweeps s; --seq-len only places the savings table
        if "--seq-len" in action.option_strings:
            action.help = (
                f"s of the savings table (default: {DEFAULT_TABLE_SEQ_LEN}, or the model's context if shorter); "
                "the charts sweep 1K to 128K"
            )
    p.add_argument("--gpu", default="h100-80gb", help=f"the GPU line: one of {', '.join(GPUS)} (default: h100-80gb)")
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the real step of every policy at --seq-len (fake tensors, torch; tens of seconds) and compare",
    )
    p.add_argument("--bench", metavar="RESULTS.json", help="a `recompute bench` result: measured next to predicted")
    p.add_argument("--plan", metavar="PLAN.json", help="a `recompute plan -o` file: the plan per layer and frontier")
    p.add_argument(
        "--device-profile",
        help="a `recompute calibrate -o` file: the savings table's predicted times on it (default: --gpu's datasheet)",
    )
    p.add_argument(
        "--no-time", action="store_true", help="no predicted times in the savings table (no trace of the step)"
    )
    p.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default: report.html)")
    p.add_argument("--png", metavar="DIR", help="also write the main charts as PNG files into DIR (matplotlib)")


def _require_extra(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"recompute report needs {' and '.join(missing)}; install the extra: pip install 'recompute[report]'"
        )


def _workload(args: argparse.Namespace, spec: ModelSpec) -> Workload:
    wl = workload_from(args, spec)
    if args.seq_len is None:
        wl = dataclasses.replace(wl, seq_len=min(DEFAULT_TABLE_SEQ_LEN, spec.max_positions))
    return wl


def _sections(args: argparse.Namespace, spec: ModelSpec, wl: Workload) -> dict[str, Any]:
    """The optional sections asked for; the files are read (and refused) before the slow trace runs."""
    sections: dict[str, Any] = {}
    if args.plan:
        sections["plan"] = plan_section(args.plan, spec)
    if args.bench:
        sections["bench"] = bench_section(args.bench, spec)
    if args.trace:
        sections["trace"] = trace_section(spec, wl, trace=torch_floor("recompute.trace").trace)
    return sections


def _times(args: argparse.Namespace, spec: ModelSpec, wl: Workload) -> dict[str, dict[str, Timing]] | None:
    """Each policy's predicted timing at the savings table's length, per attention (None with --no-time)."""
    device = time_device(args)
    at = dataclasses.replace(wl, seq_len=min(wl.seq_len, spec.max_positions))
    if untimed_reason(args, at):
        return None
    out = {}
    for attention in ATTENTIONS:
        wl_a = dataclasses.replace(at, attention=attention)
        works = preset_works(spec, wl_a)
        out[attention] = {p: timing(works[p], works["none"], device) for p in works}
        if wl_a.dtype != "fp16":  # the chunked loss refuses fp16
            chunked = preset_works(spec, dataclasses.replace(wl_a, loss="chunked"))
            out[attention]["chunked loss"] = timing(chunked["none"], works["none"], device)
        layer = offload_layer_seconds(spec, wl_a, device)
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
    gpu_by_name(args.gpu)  # fail on bad input before computing anything
    out = writable(args.output, "-o", "report.html")
    png = check_folder(args.png, "--png", "pngs") if args.png is not None else None
    spec = resolve_model(args.model)
    wl = _workload(args, spec)
    wl.check(spec)
    report = build_report(spec, wl, gpu=args.gpu, sections=_sections(args, spec, wl), times=_times(args, spec, wl))
    try:
        atomic_write(out, render_html(report))
    except OSError as e:
        raise ConfigError(f"cannot write {str(out)!r}: {e.strerror}; pass -o a writable path") from e
    written = [str(out)]
    if png is not None:
        written += [str(p) for p in write_pngs(report, png)]
    print(f"wrote {', '.join(written)} in {time.perf_counter() - start:.1f} s")
    return 0
