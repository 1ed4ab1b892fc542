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


def profile_dict(n_layers: int = 2) -> dict[str, Any]:
    """A ``recompute profile -o`` file's content with synthetic figures: one layer kind, two policies (a test
    input for the profile readers; ``tests/test_profile.py`` holds real profiles to the same schema)."""
    from recompute.core.profile import FORMAT
    from recompute.core.store import MEASURED_WORKLOAD

    policies = ("none", "block")
    work = [["mm", "float32", 1000, 4096, 2], ["add", "float32", 0, 1024, 3]]
    kind = {
        "name": "Block",
        "layers": list(range(n_layers)),
        "parameters": 1000,
        "kept": {"none": 4096, "block": 512},
        "held": {"none": 4096, "block": 512},
        "components": {p: {"attention": 256} for p in policies},
        "ops": {p: {"MmBackward0": 256} for p in policies},
        "forward_delta": {"none": 0, "block": -1024},
        "backward_delta": {"none": 0, "block": 512},
        "forward_flops": 10**6,
        "backward_flops": {"none": 2 * 10**6, "block": 3 * 10**6},
        "forward_ops": {"mm": 10**6},
        "backward_ops": {p: {"mm": 10**6} for p in policies},
        "forward_work": {p: work for p in policies},
        "backward_work": {p: work for p in policies},
        "refused": {"offload": "synthetic"},
    }
    wl = Workload(micro_batch=1, seq_len=32, device="cpu").to_dict()
    wl = {k: wl[k] for k in MEASURED_WORKLOAD}
    return {
        "format": FORMAT,
        "model": "synthetic",
        "origin": "tests/tiny.py",
        "class_name": "Synthetic",
        "key": "0" * 16,
        "workload": wl,
        "kinds": [kind],
        "layer_kind": [0] * n_layers,
        "links": {"0>0": {p: {q: [-512 if p == "block" else 0, 256, 0] for q in policies} for p in policies}},
        "last": {p: [0, 0, 0] for p in policies},
        "base_kept": [4096] * n_layers,
        "base_forward": [20000 + 4096 * i for i in range(n_layers)],
        "base_backward": [30000 + 4096 * i for i in range(n_layers)],
        "head_forward": 40000,
        "head_backward": 41000,
        "fixed": {"forward (embedding)": 10000, "optimizer step": 12000},
        "parameters": 8000,
        "gradients": 8000,
        "optimizer": 16000,
        "other": 0,
        "parameter_count": 2000,
        "embedding_kept": 512,
        "head_kept": 1024,
        "step_flops": 10**7,
        "outer_work": {"optimizer step": work},
        "tokens": 32,
        "notes": [],
        "versions": {},
        "seconds": 0.5,
        "phase_states": {"optimizer step": [8000, 4000], "backward (head and loss)": [1000, 0]},
    }
