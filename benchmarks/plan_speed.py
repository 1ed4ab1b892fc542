"""How fast the CLI answers, against issue 39's goals, side by side with an earlier revision in one run.

- ``recompute plan`` from the cached 48-layer Qwen3-30B-A3B profile (s = 4096, b = 1, bf16, fake CUDA rules, so
  offload is among the options on an H100), the whole frontier (``--budget 1e15``): goal under 0.5 s, process
  start included;
- ``recompute --help``: goal under 1 s;
- ``recompute estimate`` of a preset (analytic columns, ``--no-time``): goal under 0.2 s.

Each command runs ``--runs`` times from this tree and from ``--before`` (a git revision of this repository,
exported to a temporary folder), alternating, with the same profile; the plans must be equal. Wall times on a
shared machine are inflated by its load (noted before and after): the ratio and the CPU seconds of the child
processes are the steadier figures.

    python benchmarks/plan_speed.py [--runs 5] [--before eba2513]

Writes benchmarks/results/plan_speed.json.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from profile_speed import QWEN3_30B_A3B, export

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"plan": 0.5, "help": 1.0, "estimate": 0.2}
PROFILE = """
import sys
from recompute import Workload
from recompute.models.source import ModelSource
import recompute.trace as trace
wl = Workload(seq_len=4096, micro_batch=1, dtype="bf16", device="cuda")
trace.profile(ModelSource.from_config(sys.argv[1]), wl).save(sys.argv[2])
"""


def commands(profile: Path) -> dict[str, list[str]]:
    return {
        "plan": [
            *("plan", "--profile", str(profile), "--gpu", "h100-80gb"),
            *("--precision", "bf16", "--budget", "1e15", "--json"),
        ],
        "help": ["--help"],
        "estimate": ["estimate", "--model", "llama3.1-8b", "--seq-len", "16384", "--no-time"],
    }


def run(src: Path, argv: list[str], cache: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of ``recompute ARGV`` importing recompute from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src), "RECOMPUTE_CACHE": str(cache)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", "from recompute.cli import main_exit; main_exit()", *argv],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"recompute {' '.join(argv)} from {src} failed: {done.stderr.strip()[-500:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", default="eba2513", help="the revision timed as before")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    sources = {"before": export(args.before, folder), "after": ROOT / "src"}
    config, profile = folder / "qwen3-30b-a3b.json", folder / "qwen3-30b-a3b-profile.json"
    config.write_text(json.dumps(QWEN3_30B_A3B))
    env = {**os.environ, "PYTHONPATH": str(sources["after"]), "RECOMPUTE_CACHE": str(folder / "cache")}
    subprocess.run([sys.executable, "-c", PROFILE, str(config), str(profile)], check=True, env=env)
    out: dict[str, Any] = {}
    for name, argv in commands(profile).items():
        figures: dict[str, dict[str, list[float]]] = {side: {"wall": [], "cpu": []} for side in sources}
        outputs = {}
        load = os.getloadavg()[0]
        for _ in range(args.runs):
            for side, src in sources.items():
                wall, cpu, stdout = run(src, argv, folder / f"cache-{side}")
                figures[side]["wall"].append(wall)
                figures[side]["cpu"].append(cpu)
                outputs[side] = stdout
        row = {
            side: {"median_s": statistics.median(f["wall"]), "median_cpu_s": statistics.median(f["cpu"])}
            for side, f in figures.items()
        }
        row |= {"goal_s": GOALS[name], "command": f"recompute {' '.join(argv)}", "load": [load, os.getloadavg()[0]]}
        row["same_output"] = outputs["before"] == outputs["after"]
        if not row["same_output"]:  # what differs, for the reader to judge
            diff = difflib.unified_diff(outputs["before"].splitlines(), outputs["after"].splitlines(), lineterm="", n=0)
            row["output_diff"] = list(diff)[2:22]
        out[name] = row
        print(
            f"{name}: after {row['after']['median_s']:.2f} s ({row['after']['median_cpu_s']:.2f} s CPU), before "
            f"{row['before']['median_s']:.2f} s ({row['before']['median_cpu_s']:.2f} s CPU), goal "
            f"{GOALS[name]} s; same output: {row['same_output']}; load {row['load'][0]:.1f}-{row['load'][1]:.1f}"
        )
    result = {
        "before_revision": args.before,
        "runs": args.runs,
        "cases": out,
        "command": f"python benchmarks/plan_speed.py --runs {args.runs} --before {args.before}",
        "cpus": os.cpu_count(),
    }
    path = Path(__file__).parent / "results" / "plan_speed.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
