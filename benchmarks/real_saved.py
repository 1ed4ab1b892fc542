"""What a real training step saves for the backward, measured apart from recompute's tracker (issue 37).

The reference the trace is held to: transformers' own class, built from a config with real (random) weights on
this CPU, one forward on real tensors under a ``torch.autograd.graph.saved_tensors_hooks`` pack hook. Every
tensor autograd saves is counted once per storage (a saved view keeps its whole base alive); storages of the
parameters and buffers are left out. The measurement imports nothing of recompute: the two sides share only the
config (``traced_per_layer`` runs the trace beside it, for the comparison).

Per-layer bytes by layer differencing, as ``recompute trace --scale-from 1`` does: the model with 1 and with 2
layers, everything else the same; the difference is what one more layer keeps (what every layer shares, such as
rotary tables, and the embedding, head and loss cancel).

    python benchmarks/real_saved.py phi3-mini --dtype fp32 --seq-len 256 [--no-cache] [--write]

Rows: benchmarks/results/real_saved.json (docs/validation.md, "Real steps at published width").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from published import MODELS

__all__ = ["DTYPES", "WIDE", "RealStep", "real_per_layer", "real_saved_bytes", "saved_storages"]

RESULTS = Path(__file__).parent / "results" / "real_saved.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

WIDE: dict[str, dict[str, Any]] = {
    "phi3-mini": {**MODELS["Phi-3-mini-4k"], "sliding_window": 2047},  # its config.json's window
    "pythia-6.9b": dict(  # EleutherAI/pythia-6.9b
        model_type="gpt_neox", hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
        num_attention_heads=32, vocab_size=50432, rotary_pct=0.25, max_position_embeddings=2048,
        use_parallel_residual=True, tie_word_embeddings=False,
    ),
}  # fmt: skip
"""The issue's two models at their published widths (config.json on the Hub)."""


@contextlib.contextmanager
def saved_storages(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Inside: every storage autograd saves, ``{data_ptr: nbytes}``, each once, parameters and buffers left out.

    The storages are held until the context exits, so no address is reused by a later one (a dropped branch's
    saved tensor counts as saved)."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    found: dict[int, int] = {}
    held: list[torch.UntypedStorage] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in weights and ptr not in found:
            found[ptr] = storage.nbytes()
            held.append(storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found
    held.clear()


def build(raw: dict[str, Any], *, n_layers: int, dtype: torch.dtype, attention: str = "sdpa") -> torch.nn.Module:
    """transformers' class for ``raw`` with ``n_layers`` layers, random weights in ``dtype``, in training mode."""
    key = "n_layer" if "n_layer" in raw else "num_hidden_layers"
    config = transformers.AutoConfig.for_model(**{**raw, key: n_layers})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    return model.train()


def real_saved_bytes(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes a real forward of ``model(input_ids=idx, labels=targets)`` saves for its backward (``saved_storages``)."""
    with saved_storages(model) as found:
        out = model(input_ids=idx, labels=targets)
        total = sum(found.values())
    del out
    return total


@dataclass(frozen=True)
class RealStep:
    """Saved bytes of a real forward at two layer counts, and what one layer adds."""

    model: str
    dtype: str
    micro_batch: int
    seq_len: int
    attention: str
    one_layer: int
    two_layers: int
    seconds: float

    @property
    def per_layer(self) -> int:
        return self.two_layers - self.one_layer

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_layer": self.per_layer}


def real_per_layer(
    name: str, raw: dict[str, Any], *, dtype: str, seq_len: int, micro_batch: int = 1, attention: str = "sdpa"
) -> RealStep:
    """``real_saved_bytes`` of ``raw``'s class at 1 and 2 layers, on the same token ids."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(int(raw["vocab_size"]), (2, micro_batch, seq_len), generator=g)
    counts = []
    for n in (1, 2):
        model = build(raw, n_layers=n, dtype=DTYPES[dtype], attention=attention)
        counts.append(real_saved_bytes(model, idx, targets))
        del model
    return RealStep(name, dtype, micro_batch, seq_len, attention, *counts, time.perf_counter() - start)


def traced_per_layer(name: str, raw: dict[str, Any], *, dtype: str, seq_len: int, micro_batch: int = 1) -> int:
    """What ``recompute trace`` says one more layer saves: its fake step of 2 layers less that of 1 (all saved
    bytes, embedding, head and loss included, as ``real_per_layer`` counts them)."""
    from recompute import Workload
    from recompute.models.source import ModelSource
    from recompute.trace import trace

    wl = Workload(seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, attention="flash", device="cpu")
    one, two = (
        trace(ModelSource.from_config({**raw, "num_hidden_layers": n}, name=name), wl, "none").activations
        for n in (1, 2)
    )
    return two - one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(WIDE))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--no-cache", action="store_true", help="use_cache=False (no DynamicCache in the forward)")
    parser.add_argument("--write", action="store_true", help=f"add the row to {RESULTS}")
    args = parser.parse_args()
    raw = {**WIDE[args.model], "use_cache": not args.no_cache}
    shape = {"dtype": args.dtype, "seq_len": args.seq_len, "micro_batch": args.micro_batch}
    row = real_per_layer(args.model, raw, **shape).to_dict()
    row["use_cache"] = raw["use_cache"]
    row["trace_per_layer"] = traced_per_layer(args.model, raw, **shape)
    row["trace_minus_real"] = row["trace_per_layer"] - row["per_layer"]
    print(json.dumps(row))
    if args.write:
        old = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
        key = ("model", "dtype", "seq_len", "micro_batch", "use_cache")
        rows = [r for r in old if tuple(r[k] for k in key) != tuple(row[k] for k in key)] + [row]
        meta = {"command": "python benchmarks/real_saved.py MODEL --dtype D --seq-len S [--no-cache] --write"}
        meta |= {"torch": torch.__version__, "transformers": transformers.__version__}
        RESULTS.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
