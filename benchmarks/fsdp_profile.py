"""A profile of one FSDP2 rank against that rank's whole trace (issue 35): what ``plan --fsdp --dp d`` prices.

``recompute plan --fsdp`` plans from a profile of one rank (Note: [an FSDP rank's profile] in
``trace/_profile.py``): the whole ``none`` step traced as that rank, each policy's effect on a layer from the
one-device step with the weights in the dtype FSDP gathers them in. This composes per-layer plans from such a
profile and sets each beside the fake trace of the same rank running that plan whole (``recompute trace --fsdp``,
which benchmarks/fsdp_truth.py holds to real gloo ranks). Models: GPT-2 124M and transformers' Qwen2 class at
Qwen2.5-1.5B's width (benchmarks/configs), each cut to ``--layers`` layers (GPT-2 at its 1024 positions), under
HF Trainer's amp, torchtitan's mixed and fp32. Writes benchmarks/results/fsdp_profile.json.

    python benchmarks/fsdp_profile.py [--layers 8] [--seq-len 4096] [--dp 8] [--only gpt2]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import amp_fidelity
import torch
from amp_fidelity import CONFIGS, source_of

from recompute import Workload
from recompute.core.policy import Policy
from recompute.core.table import render_table
from recompute.trace import profile, trace

MODELS = {"gpt2": "gpt2", "qwen2.5-1.5b": CONFIGS / "qwen2.5-1.5b.json"}
PRECISIONS = {"amp": "bf16", "mixed": "bf16", "fp32": "fp32"}


def plans(n: int) -> dict[str, tuple[str, ...]]:
    """Uniform none and block, and a mixed per-layer plan."""
    mixed = tuple(("none", "block", "mlp", "attn+mlp")[i % 4] for i in range(n))
    return {"none": ("none",) * n, "block": ("block",) * n, "per-layer": mixed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--only", help="comma-separated model names")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fsdp_profile.json"))
    args = p.parse_args()
    amp_fidelity.LAYERS = args.layers
    wanted = args.only.split(",") if args.only else list(MODELS)
    rows, cases = [], []
    with tempfile.TemporaryDirectory() as folder:
        for name in wanted:
            source = source_of(MODELS[name], Path(folder))
            for precision, dtype in PRECISIONS.items():
                seq_len = min(args.seq_len, source.spec.max_positions) if source.spec else args.seq_len
                wl = Workload(micro_batch=1, seq_len=seq_len, dtype=dtype, precision=precision, fsdp=True, dp=args.dp)
                start = time.perf_counter()
                table = profile(source, wl).cost_table(None)
                for label, layers in plans(args.layers).items():
                    composed = table.compose(list(layers))
                    traced = trace(source, wl, Policy(layers=layers))
                    error = composed.peak / traced.peak - 1
                    case = {"model": name, "seq_len": seq_len, "precision": precision, "plan": label}
                    case |= {"layers": list(layers)}
                    case |= {"profile_peak": composed.peak, "trace_peak": traced.peak, "error": error}
                    case |= {"profile_phase": composed.peak_phase, "trace_phase": traced.peak_phase}
                    cases.append(case)
                    rows.append(
                        [name, precision, label, f"{traced.peak:,}", f"{composed.peak:,.0f}", f"{100 * error:+.2f} %",
                         traced.peak_phase, composed.peak_phase]
                    )  # fmt: skip
                    print(render_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
                print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print()
    print(render_table(HEADERS, rows))
    worst = max(cases, key=lambda c: abs(c["error"]))
    under = [c for c in cases if c["error"] < 0]
    print(f"\nlargest error {100 * worst['error']:+.2f} % ({worst['model']} {worst['precision']} {worst['plan']}); "
          f"{len(under)} of {len(cases)} under the trace")  # fmt: skip
    out: dict[str, Any] = {
        "what": f"plan --fsdp's profile of one rank of {args.dp} vs that rank's whole trace, {args.layers} layers",
        "seq_len": args.seq_len,
        "dp": args.dp,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cases": cases,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


HEADERS = ["model", "precision", "plan", "rank trace B", "profile B", "error", "trace's peak", "profile's peak"]

if __name__ == "__main__":
    main()
