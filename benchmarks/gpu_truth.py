"""recompute's predictions held to a real GPU in one call: every peak, reserve and step that ``recompute bench``
measures, beside what recompute predicted for it (issue 34, item 5).

The cases (bf16 on the GPU; bench runs and prices plain training in that dtype), in the order they run:

- ``gpt2 flash``: GPT-2 124M (the preset: the blog's pair) at s = 1024, b = 32 under every policy, with predicted
  step times (a quick calibration of the GPU: issue 34 found GPT-2's steps predicted 30 % short);
- ``llama flash``: a transformers Llama-3.1-8B-shaped config cut to 4 layers at s = 8192, b = 2, every policy
  under both losses (issue 34's goal: predicted to need 58.80 GiB alone, the largest reserve, against 104.64 GiB
  with every model resident);
- ``qwen3-moe flash``: a transformers Qwen3-30B-A3B-shaped config cut to 2 layers at s = 8192, b = 1, every
  policy and ``experts`` under both losses;
- ``gpt2 eager``, ``llama eager``: none / core_attn / block with eager attention (GPT-2 at b = 32; the Llama at
  s = 4096, b = 1: at 8192 its ``none`` is predicted at 87.5 GiB);
- ``gpt2 plan``, ``llama plan``: the plan ``recompute.plan(..., gpu="h100-80gb")`` makes (on the CPU, priced on
  the H100's datasheet row) for a budget halfway between none's and block's predicted peaks, benched;
- ``gpt2 offload``: GPT-2 at b = 8 under none, block and offload, with both losses (docs/offload.md).

Every row has the measured peak (``max_memory_allocated`` with the model held) and reserve (``max_memory_reserved``)
beside the trace's predicted peak and replayed reserve, a preset's analytic peak, the step time and overheads
beside their predictions. The cases run in this order and each prints its wall time; a case that would start
after ``--budget-s`` less the longest case so far is skipped (and recorded as such), and the JSON is rewritten
after every case, so an interrupted call keeps what it measured. A case that needs transformers is skipped
without it; one that bench refuses (too large for this device) or that fails is recorded with its one line.

``--device cpu --tiny`` runs the same cases, the same code, on tiny shapes of the same models on the CPU (fp32,
one step each, each case's first and last policy under its last loss mode, no step-time predictions: a
calibration of a CPU takes minutes; the GPT-2 plan priced in FLOPs by recomputation alone, the Llama plan
skipped: the plan of a model that is not a preset profiles it first): what CI runs (tests/test_gpu_truth.py).

    python benchmarks/gpu_truth.py [--out benchmarks/results/gpu/gpu_truth.json] [--budget-s 480]
    python benchmarks/gpu_truth.py --device cpu --tiny --out /tmp/gpu_truth.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from published import MODELS

import recompute
from recompute import Workload
from recompute.bench import BenchResult, BenchRow, bench, bench_source, run_precision
from recompute.bench.calibrate import cached_calibration
from recompute.core.errors import ConfigError, first_line
from recompute.core.policy import POLICIES
from recompute.models.source import ModelSource
from recompute.runtime import device_name
from recompute.trace import trace

ALL = tuple(POLICIES)
DEFAULT_OUT = "benchmarks/results/gpu/gpu_truth.json"


@dataclass(frozen=True)
class Case:
    """One bench call: a model at a workload under some policies (or the plan made for it)."""

    label: str
    model: str
    """``gpt2`` (the preset) or a key of ``published.MODELS`` (a transformers config)."""
    layers: int
    micro_batch: int
    seq_len: int
    attention: str
    policies: tuple[str, ...] = ()
    losses: tuple[str, ...] = ("full",)
    timed: bool = False
    """Also predict step times (a quick calibration of the device, cached)."""
    plan: bool = False
    """Bench the plan made for ``PLAN_GPU`` at a budget halfway between none's and block's predicted peaks."""

    def policies_run(self, tiny: bool) -> tuple[str, ...]:
        """The policies benched: all of them, or with ``--tiny`` the first and the last (seconds a run here)."""
        return self.policies[:1] + self.policies[-1:] if tiny and len(self.policies) > 2 else self.policies

    def losses_run(self, tiny: bool) -> tuple[str, ...]:
        """The loss modes benched: all of them, or with ``--tiny`` the last (the chunked loss where there is one)."""
        return self.losses[-1:] if tiny else self.losses


PLAN_GPU = "h100-80gb"
CASES = (
    Case("gpt2 flash", "gpt2", 12, 32, 1024, "flash", ALL, timed=True),
    Case("llama flash", "Llama-3.1-8B", 4, 2, 8192, "flash", ALL, ("full", "chunked")),
    Case("qwen3-moe flash", "Qwen3-30B-A3B", 2, 1, 8192, "flash", (*ALL, "experts"), ("full", "chunked")),
    Case("gpt2 eager", "gpt2", 12, 32, 1024, "eager", ("none", "core_attn", "block"), timed=True),
    Case("llama eager", "Llama-3.1-8B", 4, 1, 4096, "eager", ("none", "core_attn", "block")),
    Case("gpt2 plan", "gpt2", 12, 32, 1024, "flash", plan=True),
    Case("llama plan", "Llama-3.1-8B", 4, 2, 8192, "flash", plan=True),
    Case("gpt2 offload", "gpt2", 12, 8, 1024, "flash", ("none", "block", "offload"), ("full", "chunked")),
)  # fmt: skip
"""In the order they run, the most asked-for first: a case that would start past the budget is skipped."""

TINY_PRESET = {"n_layers": 2, "hidden": 64, "n_heads": 4, "vocab": 256}
TINY_CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
}  # fmt: skip
"""``--tiny``: the same models at h = 64 (4 heads, 2 KV heads; 4 experts, top-2), vocabulary 256."""
TINY_SHAPE = {"micro_batch": 4, "seq_len": 64}
"""``--tiny``: long enough for the activations to set the peak (the plan then has something to recompute)."""
TINY_PLAN = "--tiny plans GPT-2 only: the plan of a model that is not a preset profiles it first (10-20 s here)"


def source_of(case: Case, folder: Path, tiny: bool) -> tuple[ModelSource, Any]:
    """The model bench runs (``bench_source``) and what ``recompute.plan`` takes for it (the spec, or the path of
    the config.json written to ``folder``)."""
    if case.model == "gpt2":
        source = bench_source("gpt2", **(TINY_PRESET if tiny else {"n_layers": case.layers}))
        return source, source.spec
    config = {**MODELS[case.model], "num_hidden_layers": case.layers}
    if tiny:  # the expert sizes for a mixture of experts only
        config.update({k: v for k, v in TINY_CONFIG.items() if "expert" not in k or k in config})
    path = folder / f"{case.model}-{case.layers}l{'-tiny' if tiny else ''}.json"
    path.write_text(json.dumps(config, indent=1))
    return bench_source(str(path)), str(path)


def workload_of(case: Case, device: str, tiny: bool) -> Workload:
    """The case's workload in the precision bench runs (plain training in the dtype: ``run_precision``)."""
    shape = TINY_SHAPE if tiny else {"micro_batch": case.micro_batch, "seq_len": case.seq_len}
    wl = Workload(**shape, attention=case.attention, dtype="fp32" if tiny else "bf16", device=device)
    return dataclasses.replace(wl, precision=run_precision(wl))


def plan_for(model: Any, source: ModelSource, wl: Workload, *, tiny: bool) -> recompute.Plan:
    """The plan ``recompute.plan`` makes for ``PLAN_GPU`` at the budget halfway between the traced peaks of
    ``none`` and ``block`` (so it has to recompute something), for the step bench runs: priced on the GPU's
    datasheet row, weighing offload and the chunked loss too, or with ``tiny`` in FLOPs and by recomputation
    alone (pricing time traces every policy's kernels, the chunked loss a second profile: a minute here)."""
    low, high = (trace(source, wl, p).peak for p in ("block", "none"))
    fields = {k: v for k, v in dataclasses.asdict(wl).items() if k in ("micro_batch", "attention", "dtype", "device")}
    priced = {"cost": "flops", "consider": ()} if tiny else {"cost": "time"}
    return recompute.plan(
        model, (low + high) / 2, gpu=PLAN_GPU, seq_len=wl.seq_len, precision=wl.precision, **priced, **fields
    )


def run_case(case: Case, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Bench one case; its rows beside their predictions, or why it did not run."""
    out: dict[str, Any] = {"case": case.label, "model": case.model}
    if case.model != "gpt2" and importlib.util.find_spec("transformers") is None:
        return {**out, "status": "skipped", "reason": "needs transformers (pip install 'recompute[hf]')"}
    if case.model != "gpt2" and case.plan and args.tiny:
        return {**out, "status": "skipped", "reason": TINY_PLAN}
    try:
        source, model = source_of(case, folder, args.tiny)
        wl = workload_of(case, args.device, args.tiny)
        policies: list[Any] = list(case.policies_run(args.tiny))
        losses = list(case.losses_run(args.tiny))
        if case.plan:
            made = plan_for(model, source, wl, tiny=args.tiny)
            policies, losses = [made.policy], [made.loss]
            out["plan"] = {"policy": made.policy.describe(), "loss": made.loss, "budget": made.budget,
                           "planned_peak": made.peak, "overhead": made.overhead, "cost": made.cost_kind}  # fmt: skip
        timed = cached_calibration(args.device) if case.timed and not args.tiny else None  # minutes on a CPU
        steps = {"steps": 1, "warmup": 0} if args.tiny else {"steps": 2, "warmup": 1}
        result = bench(source, wl, policies, losses=losses, device_profile=timed, **steps)
    except ConfigError as e:
        return {**out, "status": "refused", "reason": str(e)}
    except Exception as e:  # a CUDA out-of-memory or another failure of the real step: record it, go on
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**out, "status": "failed", "reason": f"{type(e).__name__}: {first_line(e)}"}
    return {**out, "status": "ran", **summary(result)}


def summary(result: BenchResult) -> dict[str, Any]:
    """The figures a reader holds to each other: each row's measured and predicted peak, reserve and step."""
    ref = result.reference
    return {
        "workload": result.workload,
        "notes": list(result.notes),
        "drift": result.drift,
        "rows": [row_figures(row, ref) for row in result.rows],
        "bench": result.to_dict(),
    }


def row_figures(row: BenchRow, ref: BenchRow) -> dict[str, Any]:
    def error(predicted: float | None, measured: float | None) -> float | None:
        return predicted / measured - 1 if predicted is not None and measured else None

    return {
        "policy": row.policy,
        "loss": row.loss,
        "peak": row.peak,
        "predicted_peak": row.predicted_peak,
        "peak_error": error(row.predicted_peak, row.peak),
        "analytic_peak": row.analytic_peak,
        "analytic_error": error(row.analytic_peak, row.peak),
        "reserved": row.reserved,
        "predicted_reserved": row.predicted_reserved,
        "reserved_error": error(row.predicted_reserved, row.reserved),
        "step_s": row.step_s,
        "predicted_step_s": row.predicted_step_s,
        "step_error": error(row.predicted_step_s, row.step_s),
        "overhead": row.step_s / ref.step_s - 1,
        "predicted_overhead_flops": row.predicted_overhead - ref.predicted_overhead,
        "predicted_overhead_time": row.predicted_time_overhead,
    }


def device_info(device: str) -> dict[str, Any]:
    """The device, its driver and the software the run used."""
    cuda = device == "cuda"
    return {
        "device": device_name(device),
        "driver": _driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "transformers": _version("transformers"),
        "recompute": recompute.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None where it cannot be asked."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    return str(importlib.import_module(package).__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes of the same models (the CPU check CI runs)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the cases that would start too late")
    p.add_argument("--only", help="comma-separated case labels to run (default: all)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_truth: --device cuda needs a GPU; use --device cpu --tiny for the CPU check", file=sys.stderr)
        return 2
    labels = [c.label for c in CASES]
    unknown = sorted(set(args.only.split(",")) - set(labels)) if args.only else []
    if unknown or not args.budget_s > 0:
        why = f"--only names no case {', '.join(unknown)}; the cases: {', '.join(labels)}" if unknown else ""
        print(f"gpu_truth: {why or f'--budget-s must be a positive number of seconds, got {args.budget_s:g}'}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.tiny:
        torch.set_num_threads(1)  # tiny steps wait on a second thread more than it helps (tests/conftest.py)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.parent / f"{out.stem}-configs"
    folder.mkdir(exist_ok=True)
    wanted = set(args.only.split(",")) if args.only else {c.label for c in CASES}
    record: dict[str, Any] = {
        "benchmark": "gpu_truth",
        "command": " ".join(["python", "benchmarks/gpu_truth.py", *(argv if argv is not None else sys.argv[1:])]),
        "mode": "tiny" if args.tiny else "full",
        **device_info(args.device),
        "budget_s": args.budget_s,
        "cases": [],
    }
    run_cases([c for c in CASES if c.label in wanted], args, folder, record, out)
    print(f"wrote {out} ({record['wall_s']:.1f} s)")
    return 0


def run_cases(cases: list[Case], args: argparse.Namespace, folder: Path, record: dict[str, Any], out: Path) -> None:
    """Each case in turn, its wall time printed and the JSON rewritten after it; a case that would start after
    the budget less the longest case so far is skipped."""
    start, longest = time.perf_counter(), 0.0
    for case in cases:
        used = time.perf_counter() - start
        done: dict[str, Any] = {"case": case.label, "model": case.model}
        if used + longest > args.budget_s:
            done.update(status="skipped", reason=f"out of the time budget ({used:.0f} of {args.budget_s:g} s used)")
        else:
            t0 = time.perf_counter()
            done = {**run_case(case, args, folder), "seconds": time.perf_counter() - t0}
            longest = max(longest, done["seconds"])
        record["cases"].append(done)
        record["wall_s"] = time.perf_counter() - start
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{case.label}: {done['status']} in {done.get('seconds', 0.0):.1f} s; {_line(done)}", flush=True)


def _line(case: dict[str, Any]) -> str:
    """The case's worst peak and reserve errors, or why it did not run."""
    if case["status"] != "ran":
        return case["reason"]
    worst = {
        k: max((abs(r[k]) for r in case["rows"] if r[k] is not None), default=None)
        for k in ("peak_error", "reserved_error", "step_error")
    }
    return ", ".join(f"worst {k.replace('_', ' ')} {v:.2%}" for k, v in worst.items() if v is not None)


if __name__ == "__main__":
    raise SystemExit(main())
