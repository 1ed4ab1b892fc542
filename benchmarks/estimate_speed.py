"""How long `recompute estimate` takes, process start included (target: under 0.5 s).

Runs the console command N times for a few presets and reports the median and the worst wall time, and
checks that the command did not import torch. Writes benchmarks/results/estimate_speed.json.

    python benchmarks/estimate_speed.py [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [  # --no-time: the analytic columns alone (the time columns trace the step once, then read a cache)
    ["--model", "gpt2", "--no-time"],
    ["--model", "llama3.1-8b", "--seq-len", "16384", "--no-time"],
    ["--model", "llama3.1-405b", "--seq-len", "8192", "--tp", "8", "--sp", "--pp", "9", "--json"],
]
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
    out = Path(__file__).parent / "results" / "estimate_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": platform.platform(), "python": sys.version.split()[0], "runs": runs, "results": results},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
