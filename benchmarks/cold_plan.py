"""How long a cold ``recompute plan --model config.json`` takes (nothing in the profile store), before and after
issue 39 item 1, side by side in one run, and whether the profiles it stores are the same.

Targets (issue 39, item 1): a cold plan of a model up to 3B in under 10 s, of an 8B in under 20 s, on a quiet
machine. Each plan runs in a child process (``python -m recompute plan``) with a store of its own (an empty
``$RECOMPUTE_CACHE``), alternating the code before (``--before``, a git revision of this repository, exported to a
temporary folder) and after (this tree). Its seconds are wall time around the child, its CPU seconds the child's
(``resource.getrusage(RUSAGE_CHILDREN)``): the machine is shared, so the CPU seconds are the steadier figure. The
profiles each stores (both loss modes: the plan weighs the chunked loss too) are compared byte for byte, less
their ``seconds``.

    python benchmarks/cold_plan.py [--runs 2] [--before 9727924] [--models tiny qwen2.5-1.5b] [--precision bf16]
        [--out cold_plan.json]
    python benchmarks/cold_plan.py --split [--models tiny]   # where one cold plan of this tree spends its time

Writes benchmarks/results/cold_plan.json (or ``--out``'s name there). ``--split`` times one cold plan of this tree
by part instead: importing the CLI, what comes before the profile's steps (reading the config, building the model,
the policies each layer takes), the steps (wall time, and each step's CPU seconds by kind, in whichever process
ran it), and what follows them (planning); it writes cold_plan_split.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from profile_speed import export  # the before revision's src, exported the same way

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "configs"

MODELS = {
    "tiny": ("qwen2.5-1.5b.json", 2),  # Qwen2.5-1.5B's shape cut to 2 layers: the cost a model's size does not set
    "qwen2.5-1.5b": ("qwen2.5-1.5b.json", None),
    "llama-3.2-3b": ("llama-3.2-3b.json", None),
    "llama-3.1-8b": ("llama-3.1-8b.json", None),  # the 8B goal's (meta-llama/Llama-3.1-8B's published config)
}
"""Name -> (config in benchmarks/configs, layers kept or None for all)."""

ARGS = ("--gpu", "rtx4090-24gb", "--seq-len", "1024")


def cold_plan(src: Path, config: Path, store: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One cold plan in a child process importing ``recompute`` from ``src``, with an empty store at ``store``
    (``extra``: more arguments to ``plan``)."""
    env = {**os.environ, "PYTHONPATH": str(src), "RECOMPUTE_CACHE": str(store)}
    load, cpu, start = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "recompute", "plan", "--model", str(config), *ARGS, *extra],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    seconds, used = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = used.ru_utime - cpu.ru_utime + used.ru_stime - cpu.ru_stime
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "rc": done.returncode, "load_before": load, "last": last}


def stored(store: Path) -> dict[str, Any]:
    """The profiles a plan stored, by file name, less their ``seconds`` (the only field timing sets)."""
    return {
        path.name: {k: v for k, v in json.loads(path.read_text()).items() if k != "seconds"}
        for path in sorted(store.rglob("*.json"))
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(r["seconds"] for r in runs),
        "median_cpu_s": statistics.median(r["cpu_seconds"] for r in runs),
        "runs": runs,
    }


def _child(config: str, log: str) -> None:
    """``--split``'s child: one cold plan with its parts timed, as one JSON line on stdout."""
    start = time.perf_counter()
    import recompute.cli as cli
    import recompute.trace._profile as profile

    marks = {"imported": time.perf_counter()}
    for name in ("_chain_step", "_whole_step", "_anchor_step"):
        step = getattr(profile, name)

        def timed(*a: Any, _step: Any = step, _name: str = name, **k: Any) -> Any:
            cpu = time.process_time()
            out = _step(*a, **k)
            with open(log, "a") as f:  # a forked worker's too: one short line per step
                f.write(
                    json.dumps({"kind": _name.strip("_").removesuffix("_step"), "cpu_s": time.process_time() - cpu})
                    + "\n"
                )
            return out

        setattr(profile, name, timed)
    run_jobs = profile.run_jobs

    def jobs(*a: Any, **k: Any) -> Any:
        marks["jobs"] = time.perf_counter()
        out = run_jobs(*a, **k)
        marks["jobs_done"] = time.perf_counter()
        return out

    profile.run_jobs = jobs
    code = cli.main(["plan", "--model", config, *ARGS])
    end = time.perf_counter()
    steps = [json.loads(line) for line in Path(log).read_text().splitlines()]
    print(
        json.dumps(
            {
                "rc": code,
                "import_s": marks["imported"] - start,
                "before_steps_s": marks["jobs"] - marks["imported"],
                "steps_s": marks["jobs_done"] - marks["jobs"],
                "after_steps_s": end - marks["jobs_done"],
                "total_s": end - start,
                "steps": steps,
                "workers": profile.side_workers(),
            }
        )
    )


def split(models: list[str], folder: Path, file: str = "cold_plan_split.json") -> None:
    """``--split``: one cold plan of each model, in a child process, timed by part."""
    results = {}
    for name in models:
        path = _config(name, folder)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RECOMPUTE_CACHE": str(folder / f"{name}-split")}
        log = folder / f"{name}-steps.jsonl"
        load = os.getloadavg()[0]
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(path), str(log)], env=env, capture_output=True, text=True
        )
        if done.returncode != 0 or not done.stdout.strip():
            sys.exit(f"the timed plan of {name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        by_kind: dict[str, list[float]] = {}
        for step in got["steps"]:
            by_kind.setdefault(step["kind"], []).append(round(step["cpu_s"], 2))
        results[name] = got | {"load_before": load, "steps": by_kind}
        print(
            f"{name}: {got['total_s']:.1f} s: import {got['import_s']:.1f} s, before the steps "
            f"{got['before_steps_s']:.1f} s, the steps {got['steps_s']:.1f} s on {1 + got['workers']} processes "
            f"(CPU s: {by_kind}), after {got['after_steps_s']:.1f} s"
        )
    out = Path(__file__).parent / "results" / file
    command = "python benchmarks/cold_plan.py --split --models " + " ".join(models) + f" --out {file}"
    out.write_text(
        json.dumps(
            {"command": command, "plan": f"recompute plan --model CONFIG {' '.join(ARGS)}", "models": results}, indent=2
        )
        + "\n"
    )
    print(f"wrote {out}")


def _config(name: str, folder: Path) -> Path:
    """The config.json of ``MODELS[name]``, written into ``folder``."""
    file, n_layers = MODELS[name]
    config = json.loads((CONFIGS / file).read_text())
    if n_layers is not None:
        config["num_hidden_layers"] = n_layers
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--before", default="9727924", help="the revision whose cold plan is timed as before")
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen2.5-1.5b"], choices=list(MODELS))
    parser.add_argument(
        "--out", help="the results file in benchmarks/results (cold_plan.json; with --split cold_plan_split.json)"
    )
    parser.add_argument("--precision", help="plan's --precision (default: its own, amp)")
    parser.add_argument(
        "--split", action="store_true", help="time one cold plan of this tree by part (--models only: one run each)"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    if args.split:
        split(args.models, folder, args.out or "cold_plan_split.json")
        return
    before_src, after_src = export(args.before, folder), ROOT / "src"
    results: dict[str, Any] = {}
    for name in args.models:
        file, n_layers = MODELS[name]
        path = _config(name, folder)
        config = json.loads(path.read_text())
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        same = True
        for i in range(args.runs):
            found = {}
            for side, src in (("before", before_src), ("after", after_src)):
                store = folder / f"{name}-{side}-{i}"
                extra = ("--precision", args.precision) if args.precision else ()
                runs[side].append(cold_plan(src, path, store, extra))
                found[side] = stored(store)
            same = same and bool(found["before"]) and found["before"] == found["after"]
        results[name] = {"config": file, "layers": n_layers or config["num_hidden_layers"], "same_profiles": same}
        results[name] |= {side: _summary(r) for side, r in runs.items()}
        b, a = results[name]["before"], results[name]["after"]
        print(
            f"{name}: before {b['median_s']:.1f} s ({b['median_cpu_s']:.1f} s CPU), after {a['median_s']:.1f} s "
            f"({a['median_cpu_s']:.1f} s CPU); the same profiles stored: {same}"
        )
    result = {
        "plan": f"recompute plan --model CONFIG {' '.join(ARGS)}"
        + (f" --precision {args.precision}" if args.precision else "")
        + " (an empty store)",
        "before_revision": args.before,
        "models": results,
        "targets": {"up_to_3b_s": 10, "8b_s": 20},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": f"python benchmarks/cold_plan.py --runs {args.runs} --before {args.before} --models "
        + " ".join(args.models)
        + (f" --precision {args.precision}" if args.precision else "")
        + (f" --out {args.out}" if args.out else ""),
    }
    out = Path(__file__).parent / "results" / (args.out or "cold_plan.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
