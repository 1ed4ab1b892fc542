"""The compiled trace's graph FLOPs against ``FlopCounterMode`` over a real eager step, at published widths.

``plan --memory-budget`` prices what a partition recomputes by the FLOPs of its forward and backward graphs
(``recompute.trace.graph_flops``, PyTorch's flop formulas on each node's shapes). Under the min cut at budget
1.0 nothing with FLOPs is recomputed, so the graphs' FLOPs must be the plain step's: here ``FlopCounterMode``
counts them over one real eager forward and backward of the same model (real tensors, this CPU). The models are
``compiled_fidelity.py --published``'s: GPT-2 small's width and Qwen2.5-0.5B's, cut to 2 layers, b = 1, s = 256,
fp32.

    python benchmarks/compiled_flops.py   # writes benchmarks/results/compiled_flops.json
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from compiled_fidelity import PUBLISHED, PUBLISHED_WL
from torch.utils.flop_counter import FlopCounterMode

from recompute.models.source import build_source
from recompute.runtime import random_batch
from recompute.trace import trace_compiled

OUT = Path(__file__).parent / "results" / "compiled_flops.json"


def main() -> None:
    torch.set_num_threads(1)
    wl, rows = PUBLISHED_WL, []
    for name, source in PUBLISHED.items():
        traced = trace_compiled(source, wl, "none")
        built = build_source(source, attention=wl.attention, dtype=torch.float32, device="cpu")
        built.model.train()
        batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len)
        with FlopCounterMode(display=False) as counter:
            built.loss_fn(built.model, *batch)[1].backward()
        real = counter.get_total_flops()
        rows.append({"model": name, "traced": traced.flops, "real": real, "equal": traced.flops == real})
        print(f"{name}: compiled graphs {traced.flops:,} FLOPs, real eager step {real:,}: equal {traced.flops == real}")
    OUT.write_text(
        json.dumps(
            {
                "command": "python benchmarks/compiled_flops.py",
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "machine": platform.machine(),
                "workload": {k: getattr(wl, k) for k in ("micro_batch", "seq_len", "dtype", "device")},
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
