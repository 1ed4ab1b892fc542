"""How long `recompute estimate` takes, process start included (target: under 0.5 s).

Runs the console command N times for a few presets and reports the median and the worst wall time, and
checks that the command did not import torch. Writes benchmarks/results/estimate_speed.json.

Issue 25's targets, with communication priced: ``estimate`` of Llama 3.1 70B at t = 8 with sequence
parallelism under 15 s on its first run (a fresh cache: it traces rank 0's step on a fake process group) and
under 0.5 s cached; ``plan`` of Llama 3.1 405B at t = 8 + SP, p = 9 (distributed optimizer over d = 8, so that a
plan fits) on time under 1 s, cached (``FIRST``: the first run of each, in a fresh cache, then ``--runs`` cached
runs; wall time and the processes' CPU time, since a shared machine's load inflates the wall time).

    python benchmarks/estimate_speed.py [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [  # --no-time: the analytic columns alone (the time columns trace the step once, then read a cache)
    ["--model", "gpt2", "--no-time"],
    ["--model", "llama3.1-8b", "--seq-len", "16384", "--no-time"],
    ["--model", "llama3.1-405b", "--seq-len", "8192", "--tp", "8", "--sp", "--pp", "9", "--json", "--no-time"],
]
FIRST = {  # command: argv (issue 25's targets), timed in a fresh cache first, then cached
    "estimate": ["estimate", "--model", "llama3.1-70b", "--tp", "8", "--sp"],
    "plan": ["plan", "--model", "llama3.1-405b", "--seq-len", "8192", "--tp", "8", "--sp", "--pp", "9",
             "--precision", "distributed", "--dp", "8", "--gpu", "h100-80gb"],
}  # fmt: skip
PROBE = (
    "import sys; from recompute.cli import main; rc = main(['estimate', *sys.argv[1:]]); "
    "print('torch' in sys.modules, file=sys.stderr)"
)


def time_case(args: list[str], runs: int) -> dict[str, object]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - start)
    return {
        "args": args,
        "median_s": statistics.median(times),
        "max_s": max(times),
        "imported_torch": done.stderr.strip().endswith("True"),
    }


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``recompute`` run, process start included."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "recompute", *argv], capture_output=True, text=True, check=True, env=env)
    after = os.times()
    return time.perf_counter() - start, (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def time_first(runs: int) -> list[dict[str, object]]:
    """Issue 25's targets: each command in a fresh cache, then ``runs`` times cached."""
    out = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "RECOMPUTE_CACHE": cache}
        for name, argv in FIRST.items():
            first = _timed(argv, env)
            cached = [_timed(argv, env) for _ in range(runs)]
            out.append(
                {
                    "command": name,
                    "args": argv,
                    "first_wall_s": first[0],
                    "first_cpu_s": first[1],
                    "cached_median_wall_s": statistics.median(w for w, _ in cached),
                    "cached_median_cpu_s": statistics.median(c for _, c in cached),
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    runs = parser.parse_args().runs
    results = [time_case(args, runs) for args in CASES]
    for r in results:
        print(
            f"estimate {' '.join(r['args'])}: median {r['median_s']:.3f} s, max {r['max_s']:.3f} s, "
            f"imported torch: {r['imported_torch']}"
        )
    first = time_first(runs)
    for f in first:
        print(
            f"{' '.join(f['args'])}: first run {f['first_wall_s']:.2f} s wall ({f['first_cpu_s']:.2f} s CPU), cached "
            f"median {f['cached_median_wall_s']:.3f} s wall ({f['cached_median_cpu_s']:.3f} s CPU)"
        )
    out = Path(__file__).parent / "results" / "estimate_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "python": sys.version.split()[0],
                "runs": runs,
                "load_average": os.getloadavg(),
                "results": results,
                "issue_25": first,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
