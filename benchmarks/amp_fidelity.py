"""``--precision amp`` at published width: the fake-tensor trace against real CPU autocast steps (issue 35).

For each model, the class at its published width cut to two layers (transformers' own class for a config.json,
recompute's GPT-2 for the preset), fp32 weights, forward and loss under bf16 ``torch.autocast("cpu")``, AdamW:
one real step on this CPU, tracked by recompute's tracker on real tensors (``trace_module``), against the trace
of the same step on fake tensors (``recompute.trace``, ``--precision amp --device cpu``). Every figure compared:
per-layer saved bytes, the model states, each phase's peak and the step's peak. Also the plain bf16 step's saved
bytes per layer beside it (what the amp step keeps over it). Writes benchmarks/results/amp_fidelity.json.

    python benchmarks/amp_fidelity.py [--seq-len 32] [--only qwen2.5-1.5b,gpt2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from recompute import ModelSpec, Workload
from recompute.checkpointing import apply
from recompute.core.table import render_table
from recompute.models.source import ModelSource, build_source, resolve_source
from recompute.trace import TraceResult, trace, trace_module

CONFIGS = Path(__file__).parent / "configs"
MODELS = {
    "qwen2.5-1.5b": CONFIGS / "qwen2.5-1.5b.json",
    "gpt2": "gpt2",
    "llama-3.2-3b": CONFIGS / "llama-3.2-3b.json",
}
"""The published configs in benchmarks/configs (Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-3B) and a preset.

Note: [bf16 on this CPU] a real bf16 step is slow here (AVX2, no bf16 units: a (32, 1536) @ (1536, 151936) bf16
matmul took 110 s), so the default is a short sequence and two policies; the bytes per token do not change
with the length (tests/test_amp.py holds every policy and both losses at tiny width)."""
POLICIES = ("none", "block")
LAYERS = 2


def source_of(model: str | Path, folder: Path) -> ModelSource:
    """The model cut to ``LAYERS`` layers: a config.json rewritten, a preset's spec overridden."""
    if isinstance(model, str):
        return ModelSource.preset(ModelSpec.from_name(model, n_layers=LAYERS))
    raw = json.loads(model.read_text())
    path = folder / model.name
    path.write_text(json.dumps({**raw, "num_hidden_layers": LAYERS}))
    return resolve_source(str(path))


def real_step(source: ModelSource, wl: Workload, policy: str) -> TraceResult:
    """One real CPU step of ``source`` under ``wl`` (amp: fp32 weights, bf16 autocast), tracked."""
    torch.manual_seed(0)
    fp32 = wl.param_dtype == "fp32"
    built = build_source(source, attention=wl.attention, dtype=torch.float32 if fp32 else torch.bfloat16)
    model = built.model.train()
    apply(model, policy)
    shape = (wl.micro_batch, wl.seq_len)
    batch = (torch.randint(built.vocab, shape), torch.randint(built.vocab, shape))
    autocast = torch.bfloat16 if wl.precision == "amp" else None
    return trace_module(model, batch, loss_fn=built.loss_fn, autocast=autocast)


def compare(fake: TraceResult, real: TraceResult) -> dict[str, Any]:
    figures = ("parameters", "gradients", "optimizer", "peak", "peak_phase", "phases")
    layers = [p.total for p in fake.layers], [p.total for p in real.layers]
    return {
        "layers_traced": layers[0],
        "layers_real": layers[1],
        "peak_traced": fake.peak,
        "peak_real": real.peak,
        "exact": layers[0] == layers[1] and all(getattr(fake, f) == getattr(real, f) for f in figures),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--only", help="comma-separated model names")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "amp_fidelity.json"))
    args = p.parse_args()
    wanted = args.only.split(",") if args.only else list(MODELS)
    amp = Workload(micro_batch=1, seq_len=args.seq_len, dtype="bf16", precision="amp", device="cpu")
    plain = dataclasses.replace(amp, precision="bf16")
    rows, cases = [], []
    with tempfile.TemporaryDirectory() as folder:
        for name in wanted:
            source = source_of(MODELS[name], Path(folder))
            for policy in POLICIES:
                start = time.perf_counter()
                found = compare(trace(source, amp, policy), real_step(source, amp, policy))
                bf16 = trace(source, plain, policy).layers[1].total
                seconds = time.perf_counter() - start
                cases.append({"model": name, "policy": policy, **found, "bf16_layer1": bf16, "seconds": seconds})
                rows.append(
                    [name, policy, f"{found['layers_real'][1]:,}", f"{found['layers_traced'][1]:,}", f"{bf16:,}",
                     f"{found['peak_real']:,}", f"{found['peak_traced']:,}", "yes" if found["exact"] else "NO",
                     f"{seconds:.1f}"]
                )  # fmt: skip
                print(render_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(render_table(HEADERS, rows))
    exact = sum(c["exact"] for c in cases)
    print(f"\nexact: {exact} of {len(cases)} (goal: all)")
    out = {
        "what": "amp (bf16 autocast over fp32 weights) on this CPU: fake trace vs a real step, 2 layers, b=1",
        "seq_len": args.seq_len,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cases": cases,
        "exact": exact,
        "total": len(cases),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


HEADERS = [
    "model", "policy", "layer 1 real B", "layer 1 traced B", "layer 1 plain bf16 B", "peak real B",
    "peak traced B", "exact", "s",
]  # fmt: skip

if __name__ == "__main__":
    main()
