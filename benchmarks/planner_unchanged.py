"""Today's planner against the ones it replaced: frontiers and plans of the same workloads, before and after.

What gates (exit 1 otherwise): issue 39 made the search settle states early (commit 670989b) and must not change
a plan. This tree is copied with ``core/search.py`` as it was before (``--search-before``, default 670989b^), so
both searches run on the same cost tables, whatever pricing has changed since; every workload below is planned
by both, FLOPs and predicted time (offload among the options on the GPU), and the frontiers (peak, cost, layers,
loss mode, each point) and the plans at four fractions of the peak range must be equal, JSON for JSON.

    python benchmarks/planner_unchanged.py                       # compare; writes results/planner/after.json
    python benchmarks/planner_unchanged.py --capture OUT_DIR     # capture (any version of recompute)

A record, not gating: the frontiers the two planners before issue 23 gave.
Before issue 23 a preset was planned by ``core/plan.py`` (a chain of alike layers) and any other model by
``core/profile.py`` (a chain of measured layer kinds). Their frontiers and chosen plans were captured with this
script's ``--capture`` on commit 9f6a878 (``benchmarks/results/planner/*_before.json``; the workloads only use
flags both versions have). Without ``--capture`` the script plans the same workloads with the one planner and
compares: every frontier point (peak, cost, loss mode) and the cost of the plan at each captured budget.

Since issue 25 every ``--cost time`` plan on a GPU is priced anew: the host's dispatch per kernel and per
replayed kernel (a phase takes the larger of host and device time), and the communication of tensor and data
parallelism; the tensor-parallel cases (``WAS_FLOPS``) were FLOP plans when captured. Their time frontiers are
re-priced by design (``_repriced``): what must hold of them is what pricing does not touch, the frontier's two
ends in memory (the smallest peak reachable and the peak with nothing recomputed) and a plan priced in time. The
FLOP frontiers and plans, which no pricing enters, must be the same point for point.

Since issue 34 a plan's peak is the step's, the optimizer step's included (mixed precision's fp32 master
weights and AdamW's temporaries peak there, with no activation held). Where that phase is over the captured
frontier's low end (the 70B case: 46.53 GiB against 39.05; both 405B cases, by 0.6 and 1.0 GiB), every plan
below it now peaks at it: what must hold is the captured frontier with each peak raised to that floor
(``_floored``), the floor being the optimizer step's (the plan at it says so), and no plan under it (each
captured budget below it refused, each above it the same cost). Issue 34 also counted the backward's kernel
scratch (CUDA's softmax backward, flash's), measured on an H100: it moved the Llama-3.1-8B chunked frontiers' low
end (60.00 GiB captured, 59.83 now at s = 8192), so those rows differ from the capture by design.

The profiled model is a Qwen3-MoE shape with a dense first layer (``results/planner/qwen3moe.json``), profiled
on fake tensors (the store keeps it). Before, its plan showed only the chosen loss mode's frontier and
recompute costs alone; the one planner shows both modes and counts a mode's own step time in the cost: the
comparison is per mode, and a plan's cost is compared net of that.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).parent / "results" / "planner"
SEARCH_BEFORE = "670989b^"
"""The last revision of ``core/search.py`` before issue 39 made it settle states early (commit 670989b)."""
PRESETS = {
    "llama3.1-8b s16384 dp8": [
        "--model",
        "llama3.1-8b",
        "--seq-len",
        "16384",
        "--precision",
        "distributed",
        "--dp",
        "8",
    ],
    "llama3.1-8b s8192 dp8": ["--model", "llama3.1-8b", "--seq-len", "8192", "--precision", "distributed", "--dp", "8"],
    "llama3.1-70b t8 sp p4 s8192": ["--model", "llama3.1-70b", "--seq-len", "8192", "--tp", "8", "--sp", "--pp", "4"],
    "llama3.1-405b t8 sp p9 s8192 dp8": [
        *("--model", "llama3.1-405b", "--seq-len", "8192", "--tp", "8", "--sp", "--pp", "9"),
        *("--precision", "distributed", "--dp", "8"),
    ],
    "llama3.1-405b t8 sp b2 s16384 dp64": [
        *("--model", "llama3.1-405b", "--seq-len", "16384", "--micro-batch", "2", "--tp", "8", "--sp"),
        *("--precision", "distributed", "--dp", "64"),
    ],
}
PROFILED = [
    *("--model", str(HERE / "qwen3moe.json"), "--seq-len", "256", "--micro-batch", "4"),
    *("--dtype", "fp32", "--device", "cpu"),
]
FRACTIONS = (0.0, 0.25, 0.5, 0.9)


def _plan(argv: list[str], cost: str, budget: float, src: Path | None = None) -> dict:
    """``recompute plan ARGV --json`` at ``budget``, importing recompute from ``src`` (None: the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(src)} if src else None
    done = subprocess.run(
        [sys.executable, "-m", "recompute", "plan", *argv, "--cost", cost, "--json", "--budget", repr(budget)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"recompute plan {' '.join(argv)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def capture(argv: list[str], src: Path | None = None) -> dict:
    """The frontier (no budget to speak of) and the plans at fractions of its peak range, by cost kind."""
    out = {}
    for cost in ("flops", "time"):
        front = _plan(argv, cost, 1e15, src)["frontier"]
        lo, hi = front[0]["peak"], front[-1]["peak"]
        plans = {}
        for f in FRACTIONS:
            data = _plan(argv, cost, lo + f * (hi - lo), src)
            plans[str(f)] = {
                "budget": lo + f * (hi - lo),
                "layers": data["policy"]["layers"],
                "loss": data["workload"]["loss"],
                "peak": data["predicted"]["peak"],
                "cost": data["predicted"]["cost"],
            }
        out[cost] = {"frontier": front, "plans": plans}
    return out


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


WAS_FLOPS = {name for name, argv in PRESETS.items() if "--tp" in argv}
"""Cases whose ``--cost time`` plans were FLOP plans when captured (time was not predicted under tensor
parallelism)."""


def _ends(frontier: list[dict]) -> tuple[float, float]:
    """The frontier's two ends in memory: its smallest peak and its largest (nothing recomputed), without the
    points that offload (weighed only where the plan is priced in time: the 405B case at p = 9 reaches 0.4 % below
    its all-block peak by offloading its first layer)."""
    peaks = [x["peak"] for x in frontier if "offload" not in x.get("layers", ())]
    return min(peaks), max(peaks)


def _repriced(name: str, data: dict, old: list[dict], floor: float = 0.0) -> dict:
    """A time row re-priced since issue 25: priced in time now, with the frontier's ends in memory unchanged (the
    low end raised to the optimizer step's floor where there is one)."""
    new, was = _ends(data["frontier"]), _ends(old)
    if floor:  # at the floor every plan peaks alike, and the cheapest in time may offload
        new = (min(x["peak"] for x in data["frontier"]), new[1])
        was = (max(was[0], floor), max(was[1], floor))
    return {
        "case": name, "cost": "time", "points": len(data["frontier"]), "frontier same": "n/a", "plans same": "n/a",
        "priced in time now": data["cost_kind"].startswith("predicted seconds"),
        "ends same": _same(new[0], was[0]) and _same(new[1], was[1]),
        "captured as": "flops" if name in WAS_FLOPS else "time",
    }  # fmt: skip


def _floor(argv: list[str], cost: str, frontier: list[dict], old: list[dict]) -> float:
    """The peak no plan goes under, where it is the optimizer step's and over the captured low end; else 0."""
    lowest = frontier[0]["peak"]
    if _same(lowest, old[0]["peak"]) or lowest < old[0]["peak"]:
        return 0.0
    at = _plan(argv, cost, lowest)["predicted"]
    if at["peak_phase"] != "optimizer step":
        raise SystemExit(f"the frontier's low end moved to {lowest:.0f} B in phase {at['peak_phase']!r}")
    return lowest


def _floored(old: list[dict], floor: float) -> list[dict]:
    """The captured frontier with each peak raised to ``floor``: of the points under it, only the cheapest stays."""
    under = [x for x in old if x["peak"] <= floor]
    kept = [{**min(under, key=lambda x: x["cost"]), "peak": floor}] if under else []
    return kept + [x for x in old if x["peak"] > floor]


def _plan_same(argv: list[str], cost: str, captured: dict, floor: float) -> bool:
    """The plan at a captured budget costs what it cost then; under the floor none fits."""
    if captured["budget"] < floor:
        done = subprocess.run(
            [sys.executable, "-m", "recompute", "plan", *argv, "--cost", cost, "--budget", repr(captured["budget"])],
            capture_output=True, text=True,
        )  # fmt: skip
        return done.returncode == 2 and "no plan fits" in done.stderr
    return _same(_plan(argv, cost, captured["budget"])["predicted"]["cost"], captured["cost"])


def compare_presets(before: dict) -> list[dict]:
    rows = []
    for name, argv in PRESETS.items():
        floor = 0.0
        for cost in ("flops", "time"):  # flops first: its floor holds for time too (no pricing enters a peak)
            old = before[name][cost]
            if cost == "time":
                rows.append(_repriced(name, _plan(argv, cost, 1e15), old["frontier"], floor))
                continue
            new = _plan(argv, cost, 1e15)["frontier"]
            floor = _floor(argv, cost, new, old["frontier"])
            want = _floored(old["frontier"], floor)
            same = len(new) == len(want) and all(
                _same(x["peak"], y["peak"]) and _same(x["cost"], y["cost"]) and x["loss"] == y["loss"]
                for x, y in zip(new, want)
            )
            plans = all(_plan_same(argv, cost, p, floor) for p in old["plans"].values())
            rows.append({"case": name, "cost": cost, "points": len(new), "frontier same": same, "plans same": plans,
                         "optimizer step floor": floor or None})  # fmt: skip
    return rows


def compare_profiled(before: dict) -> list[dict]:
    """Per loss mode: the full loss's frontier (what the old planner printed at an unbounded budget) and, at
    each captured budget, the chosen plan's cost net of its loss mode's own step time."""
    from recompute.core.pricing import choose_device
    from recompute.core.search import search
    from recompute.core.workload import Workload
    from recompute.planning import cost_tables

    wl = Workload(seq_len=256, micro_batch=4, dtype="fp32", device="cpu")
    rows = []
    for cost in ("flops", "time"):
        found = cost_tables(PROFILED[1], wl, device=choose_device() if cost == "time" else None, losses=("chunked",))
        full = found.tables[0]
        unit = (lambda c: c.seconds) if cost == "time" else (lambda c: c.flops)
        new = search(full).frontier
        old = before[cost]
        if cost == "time":
            data = {"frontier": [{"peak": x.peak} for x in new], "cost_kind": full.cost_kind}
            rows.append(_repriced("qwen3moe.json (profiled)", data, old["frontier"]))
            continue
        same = len(new) == len(old["frontier"]) and all(
            _same(x.peak, y["peak"]) and _same(unit(x), y["cost"]) for x, y in zip(new, old["frontier"])
        )
        plans = True
        for p in old["plans"].values():
            data = _plan(PROFILED, cost, p["budget"])
            table = next(t for t in found.tables if t.workload["loss"] == data["workload"]["loss"])
            extra = table.model_cost - full.model_cost if table.timed else 0.0
            plans &= _same(data["predicted"]["cost"] - extra, p["cost"])
        rows.append({"case": "qwen3moe.json (profiled)", "cost": cost, "points": len(new), "frontier same": same,
                     "plans same": plans})  # fmt: skip
    return rows


def with_search(rev: str, folder: Path) -> Path:
    """This tree's ``src`` in ``folder`` with ``core/search.py`` as it was at ``rev``: the same tables, the old
    search."""
    shutil.copytree(ROOT / "src", folder / "src", ignore=shutil.ignore_patterns("__pycache__"))
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/recompute/core/search.py"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    (folder / "src" / "recompute" / "core" / "search.py").write_text(old)
    return folder / "src"


def compare_search(rev: str) -> list[dict]:
    """Every workload planned with today's search and with ``rev``'s on the same tables: the frontiers (peak, cost,
    layers, loss mode) and the plans at the captured fractions, equal item for item."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_src, new_src = with_search(rev, Path(tmp) / "old"), ROOT / "src"
        for name, argv in [*PRESETS.items(), ("qwen3moe.json (profiled)", PROFILED)]:
            new, old = capture(argv, new_src), capture(argv, old_src)
            for cost in ("flops", "time"):
                rows.append({"case": name, "cost": cost, "points": len(new[cost]["frontier"]),
                             "frontier same": new[cost]["frontier"] == old[cost]["frontier"],
                             "plans same": new[cost]["plans"] == old[cost]["plans"]})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capture", metavar="DIR", help="capture this version's frontiers and plans into DIR")
    p.add_argument("--search-before", default=SEARCH_BEFORE, help="the revision of core/search.py to compare with")
    args = p.parse_args()
    if args.capture:
        folder = Path(args.capture)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "presets_before.json").write_text(json.dumps({n: capture(a) for n, a in PRESETS.items()}, indent=1))
        (folder / "profile_before.json").write_text(json.dumps(capture(PROFILED), indent=1))
        return
    rows = compare_search(args.search_before)
    print(f"today's search against {args.search_before}'s on today's tables (what issue 39 must not change):")
    for r in rows:
        print(f"  {r['case']:38s} {r['cost']:5s} {r['points']:4d} points  frontier same: {r['frontier same']!s:5s}  "
              f"plans same: {r['plans same']}")  # fmt: skip
    history = compare_presets(json.loads((HERE / "presets_before.json").read_text()))
    history += compare_profiled(json.loads((HERE / "profile_before.json").read_text()))
    print("against the two planners captured at 9f6a878 (issue 23; a record: later pricing moves it, see above):")
    for r in history:
        if "priced in time now" in r:
            print(f"  {r['case']:38s} {r['cost']:5s} {r['points']:4d} points  re-priced since issue 25 (captured in "
                  f"{r['captured as']}): priced in time {r['priced in time now']}, ends in memory same: "
                  f"{r['ends same']}")  # fmt: skip
            continue
        print(f"  {r['case']:38s} {r['cost']:5s} {r['points']:4d} points  frontier same: {r['frontier same']!s:5s}  "
              f"plans same: {r['plans same']}")  # fmt: skip
    (HERE / "after.json").write_text(json.dumps({"search": rows, "issue 23": history}, indent=1) + "\n")
    if not all(r["frontier same"] and r["plans same"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
