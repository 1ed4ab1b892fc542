"""The planner against what users have today, side by side in one run on this CPU.

For budgets from 30 % to 90 % of the no-recompute activation memory of a GPT-2-shaped model with eager
attention (long enough sequences for the s^2 term to matter), it measures real training steps of

  (a) recompute's plan (``recompute.core.plan``, checked against the fake-tensor trace: ``traced_peak``),
  (b) the best uniform "policy on every k-th layer" setting that fits (what HF and torchtitan offer),
  (c) ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` tuned to the same saved
      activation bytes as the plan (backend ``aot_eager_decomp_partition``: the min-cut partitioner on eager
      kernels; its overhead is measured against the same compiled model at budget 1.0),

and reports measured recompute overhead (step time against ``none``), measured peak (MemTracker, gradients
kept allocated between steps as the estimate assumes) against the prediction, and saved activation bytes.
Prints a table and writes benchmarks/results/plan_vs_uniform.json.

    python benchmarks/plan_vs_uniform.py [--steps 20] [--compile-steps 6] [--seq-len 1024] [--layers 8]
                                         [--cost flops|measured] [--allocator reuse|system] [--threads 1]

Note: [the CPU allocator] glibc serves every buffer over its mmap threshold (at most 32 MiB) with a fresh
mmap, so each (b, a, s, s) score tensor page-faults in anew on every op and a memory-bound replay costs
several times its arithmetic. CUDA's caching allocator reuses blocks instead. ``--allocator reuse`` (the
default) re-runs this script with glibc told to keep freed memory (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_), which is what the caching allocator does; ``system`` measures glibc as it comes.
Every variant runs in the same process, so both settings compare like with like.

Note: [one thread] on this shared 2-core machine a step with two threads waits, op after op, for the slower
core, which adds its own jitter to the host's; ``--threads 1`` (the default) trades speed for steadier steps,
and every variant, compiled ones too, runs with it.

Note: [paired overheads] even with one thread the host's load moves a policy's step times by tens of per cent
over a run (the JSON keeps each step's time; ``step_time_spread`` sums it up), more than the overheads it
compares; steps run next to each other are moved more alike. The policies run in rounds (``bench(rounds=...)``:
each round builds every policy afresh), one step each per round, so a policy's overhead is the median over rounds
of its step time over the same round's ``none`` step, and the plan-to-every-k ratio comes with a bootstrap
interval over the rounds (2000 resamples, 5th to 95th percentile).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recompute import ModelSpec, Policy, Workload, estimate
from recompute.bench import bench
from recompute.core.analytic.table import analytic_table
from recompute.core.errors import ConfigError
from recompute.core.plan import best_uniform, plan
from recompute.core.policy import POLICIES
from recompute.core.pricing import measured_costs
from recompute.core.table import render_table
from recompute.trace import trace

FRACTIONS = (0.3, 0.5, 0.7, 0.9)
COMPILE_BUDGETS = (0.1, 0.3, 0.5, 0.7, 1.0)
REUSE = {"MALLOC_MMAP_THRESHOLD_": str(2**40), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
"""glibc settings that keep freed blocks for reuse (read at process start, hence the re-exec)."""


def use_allocator(kind: str) -> None:
    """Re-run this process with glibc's reuse settings when ``kind`` is ``reuse`` and they are not set."""
    if kind == "reuse" and any(os.environ.get(k) != v for k, v in REUSE.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **REUSE})


def saved_activation_bytes(model: torch.nn.Module, fn: Any) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and count the storages autograd saves, leaving out the parameters."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, sum(seen.values())


def paired_overhead(times: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of a policy's step time over the same round's ``none`` step, minus one."""
    return statistics.median(t / b for t, b in zip(times, base)) - 1


def ratio_interval(
    plan_times: Sequence[float], uniform_times: Sequence[float], base: Sequence[float], draws: int = 2000
) -> tuple[float, float] | None:
    """5th and 95th percentiles of plan overhead / every-k overhead over rounds resampled with replacement."""
    rng = random.Random(0)
    n, ratios = len(base), []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        u = paired_overhead([uniform_times[i] for i in pick], [base[i] for i in pick])
        if u > 0:
            ratios.append(paired_overhead([plan_times[i] for i in pick], [base[i] for i in pick]) / u)
    if len(ratios) < draws // 2:
        return None  # every-k's overhead is not above zero in most resamples: no ratio to speak of
    ratios.sort()
    return ratios[len(ratios) // 20], ratios[-(len(ratios) // 20) - 1]


def compiled_run(
    spec: ModelSpec, wl: Workload, budget: float, batch: tuple[torch.Tensor, torch.Tensor], steps: int
) -> dict[str, float]:
    """Saved activation bytes and median step time of the model compiled at one memory budget."""
    from recompute.models import build_model

    x, y = batch
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = budget
    torch.manual_seed(0)
    model = build_model(spec, attention=wl.attention)
    compiled = torch.compile(model, backend="aot_eager_decomp_partition")
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        _, loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # compiles
    loss, saved = saved_activation_bytes(model, lambda: compiled(x, y)[1])
    loss.backward()
    opt.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch._functorch.config.activation_memory_budget = 1.0
    return {"saved": saved, "step_s": statistics.median(times)}


def compiled_runs(spec: ModelSpec, wl: Workload, steps: int) -> dict[float, dict[str, float]]:
    """``compiled_run`` at each budget of COMPILE_BUDGETS."""
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(spec.vocab, (wl.micro_batch, wl.seq_len), generator=g),
        torch.randint(spec.vocab, (wl.micro_batch, wl.seq_len), generator=g),
    )
    out = {}
    for budget in COMPILE_BUDGETS:
        out[budget] = compiled_run(spec, wl, budget, batch, steps)
        print(
            f"  compile budget {budget:.2f}: saved {out[budget]['saved'] / 2**20:.1f} MiB, "
            f"step {out[budget]['step_s']:.3f} s"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed rounds: one step of each policy per round")
    parser.add_argument("--compile-steps", type=int, default=6, help="timed steps per torch.compile budget")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument(
        "--cost",
        choices=("flops", "measured"),
        default="flops",
        help="plan on FLOPs, or on step times of every uniform policy benched first",
    )
    parser.add_argument(
        "--allocator",
        choices=("reuse", "system"),
        default="reuse",
        help="reuse: glibc keeps freed memory, like CUDA's caching allocator (the default); system: as it comes",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see the note on one thread)")
    args = parser.parse_args()
    use_allocator(args.allocator)
    torch.set_num_threads(args.threads)
    spec = ModelSpec.from_name(
        "gpt2",
        n_layers=args.layers,
        hidden=args.hidden,
        n_heads=args.heads,
        vocab=8192,
        dropout=0.0,
        max_positions=args.seq_len,
    )
    wl = Workload(
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        dtype="fp32",
        device="cpu",
        precision="fp32",
        attention="eager",
        keep_grads=True,  # the step the recorded results measured: gradients kept between steps
    )
    none = estimate(spec, wl, "none")
    act = none.peak - none.states.total
    budgets = {f: none.states.total + f * act for f in FRACTIONS}
    measured = None
    if args.cost == "measured":
        print("benching every uniform policy for the planner's measured costs")
        costs = bench(spec, wl, list(POLICIES), steps=args.steps, warmup=1, rounds=args.steps)
        measured = Path(__file__).parent / "results" / "plan_vs_uniform_costs.json"
        measured.write_text(json.dumps(costs.to_dict(), indent=2) + "\n")
    table = analytic_table(spec, wl)
    if measured is not None:
        seconds, base = measured_costs(measured, spec.name, spec.n_layers)
        table = analytic_table(spec, wl, seconds=seconds, model_seconds=base, cost_kind="measured seconds")
    plans = {}
    for f, b in budgets.items():
        try:
            plans[f] = plan(table, b, traced_peak=lambda pol, w: trace(spec, w, pol).peak)
        except ConfigError as e:
            print(f"  {f:.0%} budget left out: {e}")
    uniforms = {f: best_uniform(spec, wl, b) for f, b in budgets.items()}
    policies: dict[str, Policy] = {"none": Policy("none")}
    for f in plans:
        policies[f"plan {f:.0%}"] = plans[f].policy
        u = uniforms[f]
        if u is not None:
            policies[f"uniform {f:.0%}"] = u[0]
    distinct = list({p.describe(): p for p in policies.values()}.values())
    print(f"benching {len(distinct)} distinct policies, {args.steps} steps each, one per round")
    result = bench(spec, wl, distinct, steps=args.steps, warmup=1, rounds=args.steps)
    rows = {r.policy: r for r in result.rows}
    base_times = rows[Policy("none").describe()].step_times
    spread = {r.policy: (max(r.step_times) - min(r.step_times)) / r.step_s for r in result.rows}
    print("compiling with activation_memory_budget")
    compiled = compiled_runs(spec, wl, args.compile_steps)

    table, records = [], []
    for f in plans:
        p = rows[plans[f].policy.describe()]
        u = rows[uniforms[f][0].describe()] if uniforms[f] else None
        fits = [b for b, c in compiled.items() if c["saved"] <= p.activations] or [min(compiled)]
        cb = max(fits)
        c_over = compiled[cb]["step_s"] / compiled[1.0]["step_s"] - 1
        p_over = paired_overhead(p.step_times, base_times)
        u_over = paired_overhead(u.step_times, base_times) if u else None
        interval = ratio_interval(p.step_times, u.step_times, base_times) if u else None
        record = {
            "fraction": f,
            "budget": budgets[f],
            "plan": {
                "policy": p.policy,
                "overhead": p_over,
                "overhead_of_minima": min(p.step_times) / min(base_times) - 1,
                "peak": p.peak,
                "predicted_peak": plans[f].peak,
                "peak_error": p.peak / plans[f].peak - 1,
                "traced_peak": plans[f].traced_peak,
                "fits": p.peak <= budgets[f],
                "saved": p.activations,
                "predicted_overhead": plans[f].overhead,
                "predicted_overhead_cost": plans[f].cost_kind,
            },
            "uniform": None
            if u is None
            else {
                "policy": u.policy,
                "overhead": u_over,
                "overhead_of_minima": min(u.step_times) / min(base_times) - 1,
                "peak": u.peak,
                "saved": u.activations,
            },
            "compile": {"budget": cb, "overhead": c_over, "saved": compiled[cb]["saved"]},
            "plan_over_uniform": (p_over / u_over) if u_over and u_over > 0 else None,
            "plan_over_uniform_90": interval,
        }
        records.append(record)
        table.append(
            [
                f"{f:.0%}",
                f"{budgets[f] / 2**20:.0f} MiB",
                p.policy,
                f"{100 * p_over:+.1f}%",
                f"{p.peak / 2**20:.0f} / {plans[f].peak / 2**20:.0f} MiB",
                u.policy if u else "-",
                f"{100 * u_over:+.1f}%" if u_over is not None else "-",
                "-" if record["plan_over_uniform"] is None else f"{record['plan_over_uniform']:.2f}",
                "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}",
                f"{cb:.2f}",
                f"{100 * c_over:+.1f}%",
            ]
        )
    print(
        render_table(
            [
                "budget",
                "bytes",
                "(a) plan",
                "overhead",
                "peak meas./pred.",
                "(b) every-k",
                "overhead",
                "(a)/(b)",
                "90% interval",
                "(c) compile budget",
                "overhead",
            ],
            table,
        )
    )
    print(
        f"step-time spread, (max - min) / median over {args.steps} steps: none {spread['none']:.1%}, "
        f"median over the policies {statistics.median(spread.values()):.1%}"
    )
    out = Path(__file__).parent / "results" / "plan_vs_uniform.json"
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/plan_vs_uniform.py "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                "machine": {
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "allocator": {k: os.environ.get(k) for k in REUSE},
                },
                "spec": spec.to_dict(),
                "workload": wl.to_dict(),
                "none_step_s": rows[Policy("none").describe()].step_s,
                "step_time_spread": spread,
                "bench": result.to_dict(),
                "compiled": {str(k): v for k, v in compiled.items()},
                "budgets": records,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
