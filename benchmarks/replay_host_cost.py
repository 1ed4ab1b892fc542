"""What a checkpoint's replay costs the host, policy by policy: a fixed time per checkpoint call and a time per
replayed kernel (issue 25, item 4: the time model prices the second only, calibrated on ``block``).

For each of the models ``recompute calibrate`` times the host on (``recompute.bench._host.HOST_MODELS``: GPT
and Llama, four layers of width 64, 32 tokens), every policy's step and the plain step run in interleaved
batches; a policy's added time (best batch less the plain step's best) per layer is set against the kernels it
replays per layer, and a line through the policies of one checkpoint per layer (all but attn+mlp) gives the
fixed cost per call (intercept) and the cost per replayed kernel (slope). Device time is left in: these
models' kernels take microseconds. Writes benchmarks/results/replay_host_cost_<device>.json.

    python benchmarks/replay_host_cost.py [--device cpu] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from plan_vs_uniform import use_allocator

from recompute import ModelSpec, Workload
from recompute.bench._host import HOST_MODELS, HOST_SHAPE, _batch, _Step
from recompute.bench.calibrate import local_device_label
from recompute.core.policy import POLICIES
from recompute.core.table import render_table
from recompute.trace import cached_works

RESULTS = Path(__file__).parent / "results"
CHECKPOINTS = {"core_attn": 1, "attn": 1, "mlp": 1, "attn+mlp": 2, "block": 1}
"""Checkpoint calls per layer of each policy (``recompute.checkpointing``)."""


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y against x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.device == "cpu":
        use_allocator("reuse")
        torch.set_num_threads(1)
    b, s = HOST_SHAPE
    wl = Workload(
        micro_batch=b, seq_len=s, dtype="fp32" if args.device == "cpu" else "bf16", device=args.device, keep_grads=False
    )
    out: dict[str, dict[str, object]] = {}
    for name, (preset, overrides) in HOST_MODELS.items():
        spec = ModelSpec.from_name(preset, **overrides)
        works = cached_works(spec, wl, list(POLICIES))
        steps = {p: _Step(spec, wl, p) for p in POLICIES}
        for step in steps.values():
            step()
            step()
        best = dict.fromkeys(POLICIES, float("inf"))
        for _ in range(args.rounds):  # interleaved: every policy's batch in each round
            for p, step in steps.items():
                best[p] = min(best[p], _batch(step, 4))
        rows = {}
        for p in CHECKPOINTS:
            per_layer = (best[p] - best["none"]) / spec.n_layers
            kernels = sum(works[p].replayed(works["none"]).values()) / spec.n_layers
            rows[p] = {"seconds_per_layer": per_layer, "replayed_kernels_per_layer": kernels}
        single = [(v["replayed_kernels_per_layer"], v["seconds_per_layer"]) for p, v in rows.items() if p != "attn+mlp"]
        call, kernel = line(single)
        out[name] = {"step_s": best["none"], "policies": rows, "per_call_s": call, "per_kernel_s": kernel}
        table = [
            [p, f"{v['replayed_kernels_per_layer']:.0f}", f"{v['seconds_per_layer'] * 1e3:.2f}", str(CHECKPOINTS[p])]
            for p, v in rows.items()
        ]
        print(f"{name}: plain step {best['none'] * 1e3:.2f} ms")
        print(render_table(["policy", "replayed kernels / layer", "added ms / layer", "checkpoints / layer"], table))
        print(f"fit over one-checkpoint policies: {call * 1e3:.2f} ms per call + {kernel * 1e6:.0f} us per kernel\n")
    record = {
        "benchmark": "replay_host_cost",
        "command": "python " + " ".join(sys.argv),
        "device": local_device_label(args.device),
        "torch": torch.__version__,
        "shape": {"micro_batch": b, "seq_len": s},
        "rounds": args.rounds,
        "models": out,
    }
    path = RESULTS / f"replay_host_cost_{'gpu' if args.device == 'cuda' else 'cpu'}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
