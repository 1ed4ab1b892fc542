"""Does ``use_cache`` change what a layer saves? (issue 37, item 3)

``python benchmarks/hf_cache.py``: every class the ``--classes`` sweep found exact (benchmarks/results/
hf_classes.json), at its shrunk size (``hf_fidelity.shrunk``: six layers of h = 64, fp32, b = 2, s = 16), traced
on fake tensors under ``none`` with its config's ``use_cache`` on and off. Writes, per class, each layer's bytes
without the cache less those with it (benchmarks/results/hf_classes_cache.json), or why there is no figure (a
config without ``use_cache``). Where any is not zero, a plan or profile made with the cache is not one for a step
without it: ``recompute.core.identity`` hashes ``use_cache`` where it is off.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import transformers
from hf_fidelity import CLASS_WL, RESULTS, shrunk

from recompute.models.source import ModelSource
from recompute.trace import trace


def cache_difference(model_type: str) -> list[int] | str:
    """Each layer's saved bytes without the cache less with it, or why there is none."""
    raw = shrunk(model_type, transformers.AutoConfig.for_model(model_type).to_dict())
    if "use_cache" not in raw:
        return "its config has no use_cache"
    on, off = (
        [
            layer.total
            for layer in trace(ModelSource.from_config({**raw, "use_cache": c}, name=model_type), CLASS_WL).layers
        ]
        for c in (True, False)
    )
    return [b - a for a, b in zip(on, off)]


def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = json.loads((RESULTS / "hf_classes.json").read_text())["rows"]
    out: dict[str, Any] = {}
    for row in rows:
        if row["status"] == "exact":
            out[row["model_type"]] = cache_difference(row["model_type"])
            print(row["model_type"], out[row["model_type"]], flush=True)
    changed = sorted(t for t, d in out.items() if isinstance(d, list) and any(d))
    data = {
        "command": "python benchmarks/hf_cache.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "changed": changed,
        "rows": out,
    }
    (RESULTS / "hf_classes_cache.json").write_text(json.dumps(data, indent=1) + "\n")
    measured = sum(isinstance(d, list) for d in out.values())
    print(f"{len(changed)} of the {measured} classes with use_cache save other bytes without it: {', '.join(changed)}")


if __name__ == "__main__":
    main()
