"""The compiled step's peak, traced on fake tensors, against real compiled CPU steps measured by the CPU
allocator (issue 40 item 2: "the measured peak of the step").

For each model (GPT-2 small's and Qwen2.5-0.5B's widths, 2 layers), workload, policy (none, and a per-layer plan)
and memory budget, one real step each, measured by c10's CPU allocator (``recompute.bench.allocator_peak``: the
most bytes allocated at once in the forward and backward, above what was allocated before; the parameters,
buffers and batch exist before it, the gradients are made in it), beside what recompute predicts:

- **eager**: the real eager step against the eager trace's (``recompute.trace.trace``: its largest forward or
  backward phase, less the parameters, optimizer state, buffers and batch);
- **graphs**: the real step of the partitioned graphs run as they are (the capture backend on real tensors: the
  same graphs the trace partitions, no kernel fused) against the same graphs' peak traced on fake tensors
  (``step_peak(..., fused=False)``): the liveness itself, exact;
- **Inductor**: the real Inductor step (``torch.compile``'s default backend, its kernels built and run) against
  the compiled trace's peak (``trace_compiled(...).peak``: the graphs run on fake tensors with the buffers
  Inductor fuses away or reuses in place left out, Note: [compiled peak]) and against the substitution the
  compiled options of ``recompute plan --memory-budget`` are priced by (the eager peak, less what the eager step
  saves, plus what the compiled step saves), and against the checked peak the plan takes for the options it
  checks (the larger of the substitution and the eager peak with the eager step's window, counted
  on the same fake model as the compiled step's, swapped for the compiled step's traced peak; Note: [checking a
  compiled peak] in ``recompute.compile_plan``).

Two workloads: b = 1, s = 256 (the largest tensors are the model's gradients and the vocabulary's: the peak is in
the embedding's backward) and b = 2, s = 1024 (activations set the peak), the second for GPT-2 only by default
(``WORKLOADS``). Writes benchmarks/results/compiled_peak.json after every case.

    python benchmarks/compiled_peak.py [--only gpt2] [--workloads 1x256,2x1024] [--budgets 1.0,0.5] [--per-block]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from compiled_fidelity import POLICIES, PUBLISHED, budget_patch, compile_blocks, real_model

from recompute import Policy, Workload
from recompute.bench import allocator_peak
from recompute.core.table import render_table
from recompute.models.source import ModelSource
from recompute.trace import capture_backend, saved_by_eager, trace, trace_budgets

OUT = Path(__file__).parent / "results" / "compiled_peak.json"
WORKLOADS = {"gpt2": ("1x256", "2x1024"), "hf-qwen2": ("1x256",)}
"""Each model's default workloads: Qwen2.5-0.5B's vocabulary at b = 2, s = 1024 (1.2 GB of fp32 logits per
tensor) took this 24 GiB machine out of memory across its eager, graphs and Inductor steps."""
BUDGETS = (1.0, 0.5)


def real_peak(
    source: ModelSource,
    wl: Workload,
    policy: Policy,
    backend: str | Callable[..., Any] | None,
    budget: float | None,
    per_block: bool = False,
) -> dict[str, int]:
    """One real step of ``source`` (random weights, ``policy`` applied, compiled with ``backend`` under
    ``budget``: the whole model, or each layer on its own; or eager) after a first that compiles it: the
    allocator's peak over its forward and backward, the outputs held through the backward (as the trace's step
    holds them); for the eager step also what it saves."""
    built, idx, targets = real_model(source, wl, policy)
    model = run = built.model
    if backend is not None and per_block:
        compile_blocks(model, backend)
    elif backend is not None:
        run = torch.compile(model, backend=backend, dynamic=False)

    def step() -> None:
        kept, loss = built.loss_fn(run, idx, targets)
        loss.backward()
        del kept, loss

    torch._dynamo.reset()
    out: dict[str, int] = {}
    try:
        with budget_patch(budget):
            step()
            model.zero_grad(set_to_none=True)
            out["peak"] = allocator_peak(step).peak
    finally:
        torch._dynamo.reset()
    if backend is None:
        weights = [*model.parameters(), *model.buffers(), idx, targets]
        out["saved"] = saved_by_eager(lambda: built.loss_fn(model, idx, targets), exclude=weights)
    return out


def eager_window(source: ModelSource, wl: Workload, policy: str) -> int:
    """The eager trace's peak over its forward and backward, less what exists before them (the parameters, the
    optimizer state, buffers and batch): the window ``allocator_peak`` measures."""
    t = trace(source, wl, POLICIES[policy])
    before = t.parameters + t.optimizer + t.other
    return max(v for k, v in t.phases.items() if k != "optimizer step") - before


def case(name: str, wl: Workload, policy: str, budget: float, per_block: bool = False) -> dict[str, Any]:
    source, pol = PUBLISHED[name], POLICIES[policy]
    start = time.perf_counter()
    eager = real_peak(source, wl, pol, None, None)
    traced_eager = eager_window(source, wl, policy)
    compiled = trace_budgets(source, wl, pol, (budget,), per_block=per_block, peak=True, eager=True)[0]
    unfused = trace_budgets(source, wl, pol, (budget,), per_block=per_block, peak=True, unfused=True)[0].peak
    assert compiled.peak is not None and unfused is not None, "this PyTorch traces no compiled peak"
    graphs = real_peak(source, wl, pol, capture_backend("min_cut", budget)[0], budget, per_block)["peak"]
    inductor = real_peak(source, wl, pol, "inductor", budget, per_block)["peak"]
    substituted = traced_eager - eager["saved"] + compiled.saved
    assert compiled.eager_window is not None
    checked = max(substituted, traced_eager - compiled.eager_window + compiled.peak)  # Note: [checking a compiled peak]
    return {
        "model": name,
        "workload": f"{wl.micro_batch}x{wl.seq_len}",
        "policy": policy,
        "budget": budget,
        "per_block": per_block,
        "eager_real": eager["peak"],
        "eager_traced": traced_eager,
        "eager_error": traced_eager / eager["peak"] - 1,
        "graphs_real": graphs,
        "graphs_traced": unfused,
        "graphs_error": unfused / graphs - 1,
        "compiled_traced": compiled.peak,
        "inductor_real": inductor,
        "traced_vs_inductor": compiled.peak / inductor - 1,
        "substituted": substituted,
        "substituted_vs_inductor": substituted / inductor - 1,
        "eager_window_live": compiled.eager_window,
        "checked": checked,
        "checked_vs_inductor": checked / inductor - 1,
        "eager_saved": eager["saved"],
        "compiled_saved": compiled.saved,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated models of {', '.join(PUBLISHED)}")
    p.add_argument("--workloads", help="BxS, comma-separated (default: 1x256,2x1024 for gpt2, 1x256 for hf-qwen2)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="memory budgets in (0, 1]")
    p.add_argument("--per-block", action="store_true", help="each layer compiled on its own, as torchtitan compiles")
    p.add_argument("-o", "--out", type=Path)
    args = p.parse_args()
    out = args.out or OUT.with_name("compiled_peak" + ("_per_block" if args.per_block else "") + ".json")
    models = args.only.split(",") if args.only else list(PUBLISHED)
    unknown = [m for m in models if m not in PUBLISHED]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(PUBLISHED)}")
    try:
        given = [w for w in (args.workloads or "").split(",") if w]
        shapes = {m: [_shape(w) for w in (given or WORKLOADS[m])] for m in models}
        budgets = tuple(float(b) for b in args.budgets.split(","))
    except ValueError:
        p.error(f"--workloads are BxS (e.g. 2x1024) and --budgets fractions, got {args.workloads!r}, {args.budgets!r}")
    if not all(0 < b <= 1 for b in budgets):
        p.error(f"--budgets are fractions in (0, 1], got {args.budgets}")
    torch.set_num_threads(2)
    rows: list[dict[str, Any]] = []
    meta = {"torch": torch.__version__, "machine": platform.platform(), "threads": torch.get_num_threads()}
    order = sorted({(b, s, name) for name in models for b, s in shapes[name]}, key=lambda c: (c[0] * c[1], c[2]))
    for b, s, name in order:
        wl = Workload(micro_batch=b, seq_len=s, dtype="fp32", device="cpu")
        for policy in POLICIES:
            for budget in budgets:
                r = case(name, wl, policy, budget, args.per_block)
                rows.append(r)
                _write(out, meta, rows)  # after every case: an interrupted run keeps what it measured
                print(
                    f"{name} {r['workload']} {policy} {budget}: eager {r['eager_traced']} vs {r['eager_real']} "
                    f"({r['eager_error']:+.2%}); graphs {r['graphs_traced']} vs {r['graphs_real']} "
                    f"({r['graphs_error']:+.2%}); Inductor {r['inductor_real']}: traced {r['compiled_traced']} "
                    f"({r['traced_vs_inductor']:+.1%}), "
                    f"substituted {r['substituted_vs_inductor']:+.1%}, checked {r['checked_vs_inductor']:+.1%} "
                    f"({r['seconds']} s)",
                    flush=True,
                )
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    table = [
        [r["model"], r["workload"], r["policy"], f"{r['budget']:g}", mib(r["eager_real"]), f"{r['eager_error']:+.2%}",
         mib(r["graphs_real"]), f"{r['graphs_error']:+.2%}", mib(r["inductor_real"]), f"{r['traced_vs_inductor']:+.1%}",
         f"{r['substituted_vs_inductor']:+.1%}", f"{r['checked_vs_inductor']:+.1%}"]
        for r in rows
    ]  # fmt: skip
    print()
    print(
        render_table(
            ["model", "b x s", "policy", "budget", "eager MiB", "traced", "graphs MiB", "traced", "Inductor MiB",
             "traced", "substituted", "checked"],
            table,
        )
    )  # fmt: skip
    _write(out, meta, rows)
    print(f"\nwrote {out}")


def _shape(w: str) -> tuple[int, int]:
    b, s = (int(x) for x in w.split("x"))
    return b, s


def _write(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
