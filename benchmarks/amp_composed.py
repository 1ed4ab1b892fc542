"""Under ``--precision amp``, a profile's composed peak against the whole trace (Note: [dropped as the forward
ends] in ``recompute/trace/_chain.py``).

Qwen2.5-1.5B's published config (benchmarks/configs) cut to six layers, b = 4, s = 4096 (the layers' phases are
the step's highest), amp: the profile's cost table composes the peak of each assignment, and the fake trace of the
whole step under that assignment is the reference. A checkpointed layer's cast weights are in what it holds but
freed before the backward, so the composed peak may be high by what the layers below drop, never low.

    python benchmarks/amp_composed.py

Writes benchmarks/results/amp_composed.json.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from recompute import Workload
from recompute.core.policy import Policy
from recompute.models.source import resolve_source
from recompute.trace import profile, trace

ROOT = Path(__file__).resolve().parent
LAYERS = 6
WL = Workload(seq_len=4096, micro_batch=4, precision="amp")
ASSIGNMENTS = (
    ("none",) * LAYERS,
    ("mlp",) * LAYERS,
    ("block",) * LAYERS,
    ("attn+mlp",) * LAYERS,
    ("none", "mlp", "block", "mlp", "attn", "none"),
)


def main() -> None:
    config = json.loads((ROOT / "configs" / "qwen2.5-1.5b.json").read_text())
    config["num_hidden_layers"] = LAYERS
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(config))
    source = resolve_source(str(path))
    table = profile(source, WL).cost_table()
    rows = []
    for layers in ASSIGNMENTS:
        composed, traced = int(table.compose(list(layers)).peak), trace(source, WL, Policy(layers=layers)).peak
        rows.append({"layers": list(layers), "composed": composed, "traced": traced, "over": composed - traced})
        over = 100 * (composed / traced - 1)
        print(f"{','.join(layers)}: composed {composed:,} B, traced {traced:,} B, {over:+.2f} %")
    out = ROOT / "results" / "amp_composed.json"
    result = {
        "command": "python benchmarks/amp_composed.py",
        "model": f"qwen2.5-1.5b.json cut to {LAYERS} layers",
        "workload": WL.to_dict(),
        "rows": rows,
        "never_low": all(r["over"] >= 0 for r in rows),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "machine": platform.platform(),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
