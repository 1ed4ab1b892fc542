"""Where a tensor-parallel step's time goes on this CPU, op by op, against the time model (issue 25, 6b).

Runs itself under torchrun on 2 gloo ranks: times a 2 MiB all-reduce as ``dist.all_reduce`` and as the functional
collective DTensor calls (barrier, median of 15), then profiles three steps of bench's GPT shape of
``tp_time.py`` (4 layers, h 512, s 512, b 2, TP, ``none``) with torch's profiler on every rank. Rank 0 then prices
the same step's kernels on ``benchmarks/results/tp_time_cpu_device_2.json`` (the time model's per-op device
time) and prints, per op, the profiler's self time per step against the prediction, the largest gaps first.
Writes benchmarks/results/tp_profile_cpu.json.

    python benchmarks/tp_profile.py
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tp_time import SIZE

HERE = Path(__file__).parent / "results"
OUT = HERE / "tp_profile_cpu.json"
B, S = 2, 512


def _median_ms(fn: Any, dist: Any, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.profiler import ProfilerActivity, profile

    from recompute.checkpointing import apply
    from recompute.core.policy import Policy
    from recompute.core.spec import ModelSpec
    from recompute.models import build_model
    from recompute.parallel import end_process_group, init_from_env, parallelize
    from recompute.runtime import random_batch

    mesh = init_from_env(tp=int(os.environ["WORLD_SIZE"]))
    x = torch.ones(2**19)  # 2 MiB of fp32
    group = dist.group.WORLD
    c10d = _median_ms(lambda: dist.all_reduce(x), dist)
    functional = _median_ms(lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)), dist)
    torch.manual_seed(0)
    model = build_model(ModelSpec.from_name("gpt2", **SIZE), dtype=torch.float32, device="cpu").train()
    parallelize(model, mesh, sp=False)
    apply(model, Policy("none"))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = random_batch(SIZE["vocab"], B, S, device="cpu", seed=0)

    def step() -> None:
        _, loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    steps = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        steps.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    ops = {e.key: [e.count / 3, e.self_cpu_time_total / 3e6] for e in prof.key_averages()}
    rank = dist.get_rank()
    mine = {
        "step_s": statistics.median(steps),
        "ops": ops,
        "all_reduce_2MiB_ms": {"c10d": c10d, "functional": functional},
    }
    Path(os.environ["TP_PROFILE_DIR"], f"rank{rank}.json").write_text(json.dumps(mine))
    end_process_group()


def main() -> None:
    import tempfile

    from recompute.core.pricing import choose_device
    from recompute.core.spec import ModelSpec
    from recompute.core.workload import Workload
    from recompute.trace import cached_works

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TP_PROFILE_DIR": tmp}
        env |= {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            "--worker",
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"the profiled ranks failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    device = choose_device(device_profile=HERE / "tp_time_cpu_device_2.json")
    spec = ModelSpec.from_name("gpt2", **SIZE)
    work = cached_works(spec, Workload(micro_batch=B, seq_len=S, dtype="fp32", device="cpu", tp=2, sp=False), ["none"])
    predicted: dict[str, float] = collections.defaultdict(float)
    for ops in work["none"].phases.values():
        for op in ops:
            if not op[0].startswith("comm."):
                predicted["aten::" + op[0].split("[")[0]] += device.kernel(op) * op[4]
    measured = {k: v[1] for k, v in ranks[0]["ops"].items()}
    rows = sorted(
        ({"op": k, "measured_ms": 1e3 * measured.get(k, 0.0), "predicted_ms": 1e3 * predicted.get(k, 0.0)}
         for k in set(measured) | set(predicted)),
        key=lambda r: r["predicted_ms"] - r["measured_ms"],
    )  # fmt: skip
    print(f"step: rank 0 {ranks[0]['step_s']:.3f} s, rank 1 {ranks[1]['step_s']:.3f} s (median of 5, no profiler)")
    for r, data in enumerate(ranks):
        wait = data["ops"].get("_c10d_functional::wait_tensor", [0, 0.0])
        ar = data["all_reduce_2MiB_ms"]
        print(
            f"rank {r}: wait_tensor {1e3 * wait[1]:.1f} ms a step for {wait[0]:.0f} collectives; 2 MiB all-reduce "
            f"{ar['c10d']:.2f} ms as dist.all_reduce, {ar['functional']:.2f} ms functional"
        )
    print(f"{'op':45s} {'measured ms':>12s} {'predicted ms':>12s}")
    for row in rows[:20]:
        print(f"{row['op']:45s} {row['measured_ms']:12.2f} {row['predicted_ms']:12.2f}")
    OUT.write_text(json.dumps({"ranks": ranks, "ops": rows}, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
