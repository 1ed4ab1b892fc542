"""Korthikanti et al. 2022, Figure 7: per-rank activation memory of one layer, as % of tensor parallelism alone.

For the paper's 22B model (h = 6144, a = 64, s = 2048, b = 4, t = 8) it traces one tensor-parallel rank of a
real PyTorch layer (``recompute.trace_layer`` with ``recompute.parallel`` on a fake process group: fake
tensors, full size, nothing allocated) under tensor parallelism alone, with sequence parallelism, with
selective recomputation (``core_attn``), with both, and with full recomputation (``block``), and sets the
bytes next to the analytic model (``recompute.core.analytic.layer_activations``) and the paper's formulas.

The trace runs on the CPU, where PyTorch keeps dropout masks in the activation dtype (2 bytes); the paper
counts 1-byte masks (CUDA). So three columns: the trace, the analytic model for the same CPU step (these
two must agree), and the analytic model in the paper's accounting (CUDA, 1-byte masks), which equals the
paper's formulas up to the LayerNorm statistics the paper leaves out.

    python benchmarks/sequence_parallel.py [--model 22b] [--seq-len 2048] [--micro-batch 4] [--tp 8]

Prints a table and writes benchmarks/results/sequence_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from recompute import ModelSpec, Workload
from recompute.core.analytic import layer_activations, paper_layer_bytes
from recompute.core.table import render_table
from recompute.trace import trace_layer

RESULTS = Path(__file__).parent / "results" / "sequence_parallel.json"
SETTINGS = (  # (label, sequence parallel, policy)
    ("tensor parallel (baseline)", False, "none"),
    ("+ sequence parallel", True, "none"),
    ("+ selective recompute", False, "core_attn"),
    ("+ selective + sequence parallel", True, "core_attn"),
    ("+ full recompute", False, "block"),
    ("+ full recompute + sequence parallel", True, "block"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="22b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    spec = ModelSpec.from_name(args.model)
    rows, records = [], []
    base: dict[str, float] = {}
    start = time.perf_counter()
    for label, sp, policy in SETTINGS:
        common = {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "tp": args.tp, "sp": sp, "dtype": "bf16"}
        cpu, cuda = Workload(device="cpu", **common), Workload(device="cuda", **common)
        traced = float(trace_layer(spec, cpu, policy).total)
        figures = {
            "traced": traced,
            "analytic": layer_activations(spec, cpu).stored(policy),
            "analytic_cuda": layer_activations(spec, cuda).stored(policy),
            "paper": paper_layer_bytes(spec, cuda, policy) or 0.0,
        }
        base = base or figures
        pct = {k: 100 * v / base[k] for k, v in figures.items()}
        records.append({"setting": label, "sp": sp, "policy": policy, "bytes": figures, "percent": pct})
        rows.append(
            [
                label,
                f"{traced / 2**20:,.0f} MiB",
                f"{pct['traced']:.1f}%",
                f"{pct['analytic']:.1f}%",
                f"{pct['analytic_cuda']:.1f}%",
                f"{pct['paper']:.1f}%",
                f"{traced / figures['analytic'] - 1:+.2%}",
            ]
        )
    seconds = time.perf_counter() - start
    print(
        f"{spec.name}: s={args.seq_len} b={args.micro_batch} t={args.tp}, bf16; one layer, per rank "
        f"(% of tensor parallelism alone); traced in {seconds:.1f} s"
    )
    print(
        render_table(
            ["setting", "traced", "traced %", "analytic (CPU) %", "analytic (CUDA) %", "paper %", "trace vs analytic"],
            rows,
        )
    )
    RESULTS.write_text(
        json.dumps(
            {
                "command": "python benchmarks/sequence_parallel.py "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                "machine": {"platform": platform.platform(), "torch": torch.__version__},
                "spec": spec.to_dict(),
                "seconds": seconds,
                "rows": records,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
