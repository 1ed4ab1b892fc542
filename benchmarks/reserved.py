"""What PyTorch's CUDA caching allocator is predicted to reserve beside the allocated peak (issue 34, items 4 and 5).

Traces CUDA steps on fake CPU tensors (no GPU needed) and replays each step's allocations through
``recompute.core.allocator``: the allocated peak the trace counts, the allocator's own count of it (whole blocks)
and what it reserves over steady steps (``TraceResult.reserved``, the prediction of ``max_memory_reserved``).
Cases: issue 34's H100 runs (a 2-layer Llama-3.1-8B-shaped model with a 32000 vocabulary at s = 4096, b = 1, eager
and flash), GPT-2 124M at b = 32 (flash) and b = 16 (eager), s = 1024, and a 4-layer Llama-3.1-8B at s = 4096; bf16
throughout. A GPU's ``benchmarks/gpu_truth.py`` records the measured ``max_memory_reserved`` to hold these to.

    python benchmarks/reserved.py [--out benchmarks/results/reserved_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from recompute import ModelSpec, Workload
from recompute.core.table import render_table
from recompute.trace import trace

CASES = [  # (label, preset, overrides, micro-batch, sequence, attention)
    ("issue 34 Llama", "llama3.1-8b", {"n_layers": 2, "vocab": 32000}, 1, 4096, "eager"),
    ("issue 34 Llama", "llama3.1-8b", {"n_layers": 2, "vocab": 32000}, 1, 4096, "flash"),
    ("GPT-2 124M", "gpt2", {}, 16, 1024, "eager"),
    ("GPT-2 124M", "gpt2", {}, 32, 1024, "flash"),
    ("Llama-3.1-8B, 4 layers", "llama3.1-8b", {"n_layers": 4}, 1, 4096, "flash"),
]
POLICIES = ("none", "core_attn", "block")


def run() -> list[dict[str, object]]:
    rows = []
    for label, name, overrides, b, s, attention in CASES:
        spec = ModelSpec.from_name(name, **overrides)
        wl = Workload(micro_batch=b, seq_len=s, dtype="bf16", precision="bf16", attention=attention, device="cuda")
        for policy in POLICIES:
            start = time.perf_counter()
            r = trace(spec, wl, policy)
            assert r.reserved is not None
            rows.append(
                {
                    "case": label,
                    "model": name,
                    "overrides": overrides,
                    "micro_batch": b,
                    "seq_len": s,
                    "attention": attention,
                    "policy": policy,
                    "peak": r.peak,
                    "peak_phase": r.peak_phase,
                    "reserved": r.reserved,
                    "reserved_over_peak": r.reserved / r.peak - 1,
                    "seconds": time.perf_counter() - start,
                }
            )
            print(f"{label} {attention} {policy}: {r.peak / 2**30:.3f} -> {r.reserved / 2**30:.3f} GiB", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/reserved_cpu.json")
    args = p.parse_args()
    rows = run()
    print(
        render_table(
            ["case", "b", "s", "attention", "policy", "peak GiB", "phase", "reserved GiB", "over the peak"],
            [
                [
                    r["case"],
                    r["micro_batch"],
                    r["seq_len"],
                    r["attention"],
                    r["policy"],
                    f"{int(r['peak']) / 2**30:.3f}",  # type: ignore[call-overload]
                    r["peak_phase"],
                    f"{int(r['reserved']) / 2**30:.3f}",  # type: ignore[call-overload]
                    f"{float(r['reserved_over_peak']):+.1%}",  # type: ignore[arg-type]
                ]
                for r in rows
            ],
        )
    )
    out = {
        "benchmark": "reserved",
        "command": "python benchmarks/reserved.py",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "note": "predictions only: fake CUDA steps on a CPU, the caching allocator replayed (recompute.core.allocator)",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
