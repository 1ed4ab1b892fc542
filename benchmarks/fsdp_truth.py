"""``--fsdp --dp d``: the fake-tensor trace of each FSDP2 rank against real FSDP2 steps on CPU ranks (issue 35).

For each case (model, precision, policy) and d in 2 and 4: d CPU processes over gloo on the loopback
(``recompute.bench._fsdp.real_figures``), each building the model from the same seed, applying the policy,
``recompute.parallel.shard`` (fully_shard per layer, then the root; FSDP's ``MixedPrecisionPolicy(bf16, fp32)``
under mixed and amp), AdamW, one untracked step, then three steps tracked by recompute's ``StepTracker`` (the one
that held least kept: Note: [late frees] there); against
``recompute.trace.step_record(..., rank=r)``, the fake trace of that rank (a d-rank fake process group). Every
figure compared: the peak, its phase and categories, each phase's peak (each layer's forward and backward apart),
the states after the optimizer step, the bytes each layer saved.

Each real step runs twice: as it is on gloo, and with FSDP's reduce-scatter done without gloo's clone of its
input (``in_place_reduce_scatter``: an all-reduce in place and this rank's chunk copied out, NCCL's memory). The
second must equal the trace exactly; the first differs only by that clone (Note: [gloo's reduce-scatter] in
``recompute.bench._fsdp``), shown against the size of the largest reduce-scatter input. Models: recompute's tiny
GPT (dropout 0.1, tied embeddings) and Llama, transformers' Llama and Qwen2 classes, three layers each, a
vocabulary of 131 rows (2 and 4 do not divide it: FSDP2's padding, and less Adam state on the last rank). Writes
benchmarks/results/fsdp_truth.json.

    python benchmarks/fsdp_truth.py [--d 2,4] [--only gpt,llama,hf-llama,hf-qwen2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from recompute import ModelSpec, Workload
from recompute.bench._fsdp import Case, figures, real_figures
from recompute.checkpointing import find_layers
from recompute.core.policy import Policy
from recompute.core.table import render_table
from recompute.models.source import ModelSource, build_source, resolve_source
from recompute.trace import step_record

LAYERS, VOCAB, SEQ, BATCH = 3, 131, 32, 2
HF = {
    "hidden_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "vocab_size": VOCAB,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
"""tests/test_zoo.py's tiny size, with the vocabulary of 131 rows."""
PRECISIONS = ("fp32", "mixed", "amp")
POLICIES: dict[str, Policy] = {
    "none": Policy("none"),
    "block": Policy("block"),
    "plan": Policy(layers=("block", "attn+mlp", "none")),
}
"""Uniform policies and one per-layer plan."""
STEPS = 3
"""Tracked real steps per case and rank, the one that held least kept (``recompute.bench._fsdp``'s Note: [late
frees]: gloo's worker thread can drop a buffer after the main thread has moved on)."""
OUT = Path(__file__).parent / "results" / "fsdp_truth.json"


def sources(folder: Path) -> dict[str, ModelSource]:
    base = {"hidden": 64, "n_layers": LAYERS, "n_heads": 4, "vocab": VOCAB, "max_positions": 64}
    llama = {"n_kv_heads": 2, "mlp": "swiglu", "norm": "rmsnorm", "position": "rotary", "dropout": 0.0}
    out = {
        "gpt": ModelSource.preset(ModelSpec(**base, dropout=0.1)),
        "llama": ModelSource.preset(ModelSpec(**base, **llama, bias=False, tied_embeddings=False)),
    }
    for kind in ("llama", "qwen2"):
        path = folder / f"{kind}.json"
        path.write_text(json.dumps({"model_type": kind, **HF}))
        out[f"hf-{kind}"] = resolve_source(str(path))
    return out


def workload(precision: str, d: int) -> Workload:
    dtype = "fp32" if precision == "fp32" else "bf16"
    return Workload(micro_batch=BATCH, seq_len=SEQ, dtype=dtype, precision=precision, device="cpu", fsdp=True, dp=d)


def largest_reduce_scatter(source: ModelSource, d: int) -> int:
    """Bytes of the largest reduce-scatter input of a step (a group's padded gradients in fp32: every precision
    here reduces in fp32), which gloo clones: the root's (embeddings, final norm, head) or a layer's."""
    model = build_source(source, device="meta").model
    layer_params = {id(p) for p in find_layers(model).parameters()}

    def padded(params: Any) -> int:
        return sum(d * math.ceil(p.shape[0] / d) * (p.numel() // p.shape[0]) for p in params)

    root = padded(p for p in model.parameters() if id(p) not in layer_params)
    return 4 * max(root, padded(find_layers(model)[0].parameters()))


def compare(fake: dict[str, Any], real: dict[str, Any]) -> dict[str, Any]:
    """Where ``real`` differs from ``fake``: phases with their difference, and whether the rest is equal."""
    phases = {ph: real["phases"][ph] - v for ph, v in fake["phases"].items() if real["phases"].get(ph) != v}
    rest = [k for k in ("peak_phase", "breakdown", "states", "saved") if real[k] != fake[k]]
    return {"peak": real["peak"] - fake["peak"], "phases": phases, "other": rest}


def run(d: int, models: dict[str, ModelSource], precisions: tuple[str, ...]) -> list[dict[str, Any]]:
    grid = [(m, p, name) for m in models for p in precisions for name in POLICIES]
    cases = [Case(models[m], workload(p, d), POLICIES[n], flag) for m, p, n in grid for flag in (False, True)]
    start = time.perf_counter()
    real = real_figures(cases, d, steps=STEPS, timeout_s=3600)
    real_s = time.perf_counter() - start
    rows = []
    for (m, p, name), gloo, in_place in zip(grid, real[::2], real[1::2]):
        clone = largest_reduce_scatter(models[m], d)
        for rank in range(d):
            fake = figures(step_record(models[m], workload(p, d), POLICIES[name], rank=rank))
            rows.append(
                {
                    "model": m,
                    "precision": p,
                    "policy": name,
                    "d": d,
                    "rank": rank,
                    "fake": fake,
                    "real_in_place": in_place[rank],
                    "real_gloo": gloo[rank],
                    "exact_in_place": in_place[rank] == fake,
                    "gloo_minus_fake": compare(fake, gloo[rank]),
                    "largest_reduce_scatter": clone,
                    "real_seconds_all_cases": round(real_s, 1),
                }
            )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        diff = r["gloo_minus_fake"]
        worst = max(diff["phases"].items(), key=lambda kv: kv[1], default=None)
        body.append(
            [
                r["model"],
                r["precision"],
                r["policy"],
                f"{r['d']}",
                f"{r['rank']}",
                f"{r['fake']['peak']:,}",
                f"{r['real_in_place']['peak']:,}",
                "exact" if r["exact_in_place"] else "DIFFERS",
                f"{r['real_gloo']['peak']:,}",
                f"{diff['peak']:+,}",
                f"{len(diff['phases'])}" + (f" (max {worst[1]:+,} {worst[0]})" if worst else ""),
                f"{r['largest_reduce_scatter']:,}",
            ]
        )
    head = [
        "model",
        "precision",
        "policy",
        "d",
        "rank",
        "fake peak",
        "real peak (no clone)",
        "every figure",
        "real peak (gloo)",
        "gloo - fake",
        "phases gloo holds more",
        "largest RS input",
    ]
    return render_table(head, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", default="2,4", help="rank counts (default: 2,4)")
    parser.add_argument("--only", help="models, comma-separated: gpt, llama, hf-llama, hf-qwen2 (default: all)")
    parser.add_argument("--quick", action="store_true", help="fp32 and mixed only")
    parser.add_argument("-o", "--out", type=Path, default=OUT)
    args = parser.parse_args()
    precisions = PRECISIONS[:2] if args.quick else PRECISIONS
    with tempfile.TemporaryDirectory() as folder:
        models = sources(Path(folder))
        if args.only:
            models = {k: v for k, v in models.items() if k in args.only.split(",")}
        rows = [row for d in map(int, args.d.split(",")) for row in run(d, models, precisions)]
    print(render(rows))
    exact = sum(r["exact_in_place"] for r in rows)
    gloo_exact = sum(r["gloo_minus_fake"]["peak"] == 0 and not r["gloo_minus_fake"]["phases"] for r in rows)
    within = sum(
        all(0 < v <= r["largest_reduce_scatter"] for v in r["gloo_minus_fake"]["phases"].values()) for r in rows
    )
    print(
        f"{exact} of {len(rows)} ranks: the real step without gloo's clone equals the fake trace in every figure; "
        f"on gloo as it is, {gloo_exact} equal in every phase, and in all but {len(rows) - within} the phases that "
        "differ hold more by at most the largest reduce-scatter input (gloo's clone of it)"
    )
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "torch": torch.__version__,
                "machine": platform.processor() or platform.machine(),
                "precisions": list(precisions),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
