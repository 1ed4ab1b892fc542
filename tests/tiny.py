"""Tiny model specs the torch tests share: a GPT-2 with dropout and a Llama with GQA, fast on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recompute import ModelSpec, Workload, estimate
from recompute.core.results import BenchResult, BenchRow


def tiny_gpt(n_layers: int = 2, **changes: Any) -> ModelSpec:
    """GPT-2 style: LayerNorm, GELU, learned positions, tied embeddings, dropout 0.1."""
    return ModelSpec(
        **{
            "hidden": 64,
            "n_layers": n_layers,
            "n_heads": 4,
            "vocab": 128,
            "max_positions": 64,
            "dropout": 0.1,
            **changes,
        }
    )


def tiny_llama(n_layers: int = 2, **changes: Any) -> ModelSpec:
    """Llama style: RMSNorm, SwiGLU, 2 KV heads for 4 query heads, rotary positions, no dropout or biases."""
    return tiny_gpt(
        n_layers,
        **{
            "n_kv_heads": 2,
            "mlp": "swiglu",
            "norm": "rmsnorm",
            "position": "rotary",
            "dropout": 0.0,
            "bias": False,
            "tied_embeddings": False,
            **changes,
        },
    )


TRAIN = {
    "model": "gpt2",
    "n_layers": 2,
    "hidden": 64,
    "n_heads": 4,
    "seq_len": 32,
    "micro_batch": 4,
    "steps": 6,
    "warmup": 2,
    "sample_tokens": 8,
    "device": "cpu",
}
"""``recompute train`` options for a small GPT-2 (dropout 0.1, the preset's), fp32 on the CPU: seconds a run."""


def write_bench(
    path: Path, spec: ModelSpec, wl: Workload, times: dict[str, float], *, peaks: dict[str, float] | None = None
) -> Path:
    """A ``recompute bench --json`` file with synthetic "measured" step times and peaks (a test input).

    The predictions are the analytic ones for ``wl``, as ``bench`` fills them in.
    """
    rows = tuple(
        BenchRow(
            policy=p,
            peak=(peaks or {}).get(p, 10**9),  # type: ignore[arg-type]  # synthetic, may be fractional
            traced_peak=(peaks or {}).get(p, 10**9),  # type: ignore[arg-type]
            activations=0,
            step_s=t,
            forward_s=t / 3,
            backward_s=2 * t / 3,
            optimizer_s=0.0,
            tokens_per_s=wl.tokens / t,
            predicted_overhead=estimate(spec, wl, p).overhead,
            predicted_peak=estimate(spec, wl, p).peak,
        )
        for p, t in times.items()
    )
    result = BenchResult(spec.name, spec.to_dict(), wl.to_dict(), steps=1, warmup=0, device="synthetic", rows=rows)
    path.write_text(json.dumps(result.to_dict()))
    return path
