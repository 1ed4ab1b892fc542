"""How fast ``recompute trace`` accounts for every layer of Llama-3.1-8B and -70B, and how much memory it uses.

Each trace runs as its own ``recompute trace ... --json`` process, so the wall time includes starting Python
and importing torch, and the resident memory is that process's peak (``getrusage``). Writes
benchmarks/results/trace_speed.json and prints a table.

Usage: python benchmarks/trace_speed.py [--quick]   (--quick: the 8B runs only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "trace_speed.json"
BASE = ["--seq-len", "8192", "--micro-batch", "1", "--attention", "flash", "--json"]
RUNS = [
    ("llama3.1-8b", "none", None),
    ("llama3.1-8b", "none", 2),
    ("llama3.1-8b", "block", 2),
    ("llama3.1-70b", "none", None),
    ("llama3.1-70b", "none", 2),
]


def machine() -> dict[str, Any]:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0],
    }


def run(model: str, policy: str, layers: int | None) -> dict[str, Any]:
    """One trace in a fresh process: wall seconds, peak resident MiB, and what it reported."""
    cli = ["trace", "--model", model, "--policy", policy, *BASE] + (["--layers", str(layers)] if layers else [])
    argv = [sys.executable, "-c", "from recompute.cli import main_exit; main_exit()", *cli]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves: the rusage is this child's alone
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{shlex.join(argv)} failed: {err.read().strip()}")
        data = json.loads(out.read())
    return {
        "command": "recompute " + shlex.join(cli),
        "wall_s": round(wall, 2),
        "max_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
        "trace_s": round(data["seconds"], 2),
        "traced_layers": data["traced"],
        "n_layers": data["n_layers"],
        "peak_gib": round(data["peak"] / 2**30, 3),
        "peak_phase": data["peak_phase"],
        "activations_gib": round(data["activations"] / 2**30, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the Llama-3.1-8B runs only")
    args = parser.parse_args()
    rows = [run(*r) for r in RUNS if not args.quick or r[0] == "llama3.1-8b"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "runs": rows}, indent=2) + "\n")
    width = max(len(r["command"]) for r in rows)
    print(f"{'command':<{width}}  wall s  trace s  max RSS MiB  layers traced  peak GiB")
    for r in rows:
        traced = "+".join(map(str, r["traced_layers"])) + f" of {r['n_layers']}"
        print(
            f"{r['command']:<{width}}  {r['wall_s']:6.1f}  {r['trace_s']:7.1f}  {r['max_rss_mib']:11.0f}  "
            f"{traced:>13}  {r['peak_gib']:8.2f}"
        )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
