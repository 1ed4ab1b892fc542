"""``trace_compiled`` against real ``torch.compile``d CPU steps (issue 40 item 2).

For each model (recompute's GPT-2 and Llama presets and transformers' Llama and Qwen2 classes, all at small
width), each policy (none, and a per-layer recompute plan) and each memory budget, the bytes the compiled step
saves for its backward as traced on fake tensors (``recompute.trace.trace_compiled``) beside those of a real
step on real tensors: the model compiled with Inductor (``torch.compile``'s default backend: its kernels built
and run; the min cut under ``torch._functorch.config.activation_memory_budget``), the saved tensors read back
from the compiled regions' autograd nodes (``saved_by_compiled``), then its backward run. The default
partitioner is held to a real step of ``aot_eager_default_partitioner`` (which partitions with it). Writes
benchmarks/results/compiled_fidelity.json.

    python benchmarks/compiled_fidelity.py [--only gpt2,hf-llama] [--budgets 1.0,0.5,0.1]
    python benchmarks/compiled_fidelity.py --published --budgets 1.0,0.5   # published width, 2 layers, s = 256
    python benchmarks/compiled_fidelity.py --per-block --loss chunked      # recompute's chunked loss beside the blocks
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recompute import ModelSpec, Policy, Workload
from recompute.checkpointing import apply, find_layers
from recompute.core.table import render_table
from recompute.models.source import BuiltModel, ModelSource, build_source
from recompute.runtime import random_batch
from recompute.trace import saved_by_compiled, saved_by_eager, trace_compiled

OUT = Path(__file__).parent / "results" / "compiled_fidelity.json"
WL = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu")
"""Small enough for a real Inductor step of every case on a CPU in seconds (after its compile)."""
_SMALL = {"n_layers": 2, "hidden": 128, "n_heads": 4, "vocab": 512, "max_positions": 128}
_HF = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4}
MODELS: dict[str, ModelSource] = {
    "gpt2": ModelSource.preset(ModelSpec.from_name("gpt2", **_SMALL)),
    "llama": ModelSource.preset(ModelSpec.from_name("llama3.1-8b", **_SMALL, n_kv_heads=2, d_ff=344)),
    "hf-llama": ModelSource.from_config(
        {"model_type": "llama", **_HF, "num_key_value_heads": 2, "vocab_size": 512}, name="hf-llama"
    ),
    "hf-qwen2": ModelSource.from_config(
        {"model_type": "qwen2", **_HF, "num_key_value_heads": 2, "vocab_size": 512}, name="hf-qwen2"
    ),
}
"""GPT-2 keeps its dropout (0.1): the masks are saved values too."""
POLICIES: dict[str, Policy] = {"none": Policy("none"), "plan": Policy("none", layers=("block", "core_attn"))}
"""No policy, and a per-layer plan: layer 0 recomputed whole, layer 1's attention core."""
BUDGETS = (1.0, 0.5, 0.1)

PUBLISHED: dict[str, ModelSource] = {
    "gpt2": ModelSource.preset(ModelSpec.from_name("gpt2", n_layers=2)),
    "hf-qwen2": ModelSource.from_config(
        {
            "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 2,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        },
        name="hf-qwen2",
    ),
}  # fmt: skip
"""``--published``: GPT-2 small's width and Qwen2.5-0.5B's (the quickstart's model), cut to 2 layers."""
PUBLISHED_WL = Workload(micro_batch=1, seq_len=256, dtype="fp32", device="cpu")


def real_saved(
    source: ModelSource,
    wl: Workload,
    policy: Policy,
    backend: str | Callable[..., Any],
    budget: float | None,
    per_block: bool = False,
) -> tuple[int, int | None]:
    """Bytes a real compiled step of ``source`` (built on the CPU with random weights, ``policy`` applied, then
    compiled with ``backend`` under ``budget``: the whole model, or each layer on its own) holds for its backward:
    the compiled regions' saved tensors read from its autograd graph, and (``per_block``) every tensor autograd
    saves, eager ones too, as its saved-tensor hooks see them (None for the whole model)."""
    built, idx, targets = real_model(source, wl, policy)
    model = built.model
    weights = [*model.parameters(), *model.buffers(), idx, targets]
    torch._dynamo.reset()
    losses = []
    try:
        with budget_patch(budget):
            if per_block:
                compile_blocks(model, backend)
                forward = lambda: losses.append(built.loss_fn(model, idx, targets)[1])  # noqa: E731
                every: int | None = saved_by_eager(forward, exclude=weights)
            else:
                losses.append(built.loss_fn(torch.compile(model, backend=backend, dynamic=False), idx, targets)[1])
                every = None
            saved = saved_by_compiled(losses[0], exclude=weights)
            losses[0].backward()  # the step runs through: the backward reads what was saved
    finally:
        torch._dynamo.reset()
    return saved, every


def real_model(source: ModelSource, wl: Workload, policy: Policy) -> tuple[BuiltModel, Tensor, Tensor]:
    """``source`` built on the CPU in fp32 from seed 0 (random weights), in training mode, ``policy`` applied,
    and its batch."""
    torch.manual_seed(0)
    built = build_source(source, attention=wl.attention, dtype=torch.float32, device="cpu")
    built.model.train()
    apply(built.model, policy, loss=wl.loss, loss_chunk=wl.loss_chunk)
    idx, targets = random_batch(built.vocab, wl.micro_batch, wl.seq_len, seed=0)
    return built, idx, targets


def compile_blocks(model: torch.nn.Module, backend: str | Callable[..., Any]) -> None:
    """Each transformer layer of ``model`` compiled on its own with ``backend``, as torchtitan compiles."""
    stack = find_layers(model)
    for i, layer in enumerate(list(stack)):
        stack[i] = torch.compile(layer, backend=backend, dynamic=False)


def budget_patch(budget: float | None) -> contextlib.AbstractContextManager[Any]:
    """``activation_memory_budget`` set to ``budget`` (PyTorch's own where None)."""
    if budget is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=budget)


def check(
    name: str,
    policy: str,
    partitioner: str,
    budget: float | None,
    models: dict[str, ModelSource] = MODELS,
    wl: Workload = WL,
    per_block: bool = False,
) -> dict[str, Any]:
    """One case: the fake trace beside the real step (Inductor for min cut, aot_eager for the default)."""
    source, pol = models[name], POLICIES[policy]
    start = time.perf_counter()
    fake = trace_compiled(source, wl, pol, partitioner=partitioner, budget=budget, per_block=per_block)
    traced_s = time.perf_counter() - start
    start = time.perf_counter()
    backend = "inductor" if partitioner == "min_cut" else "aot_eager_default_partitioner"
    regions, every = real_saved(source, wl, pol, backend, budget, per_block)
    # per block: the compiled regions are the layers (the rest runs eagerly); whole model: everything is
    traced = sum(fake.layers) if per_block else fake.saved
    row = {
        "model": name,
        "policy": policy,
        "partitioner": partitioner,
        "budget": budget,
        "per_block": per_block,
        "backend": backend,
        "traced": traced,
        "traced_layers": list(fake.layers),
        "real": regions,
        "error": (traced - regions) / regions,
        "graphs": fake.graphs,
        "trace_s": round(traced_s, 1),
        "real_s": round(time.perf_counter() - start, 1),
    }
    if every is not None:  # the whole step's, eager parts too: every saved tensor, as autograd's hooks see them
        row |= {"traced_step": fake.saved, "real_step": every, "step_error": (fake.saved - every) / every}
    return row


def cases(models: list[str], budgets: tuple[float, ...]) -> list[tuple[str, str, str, float | None]]:
    out: list[tuple[str, str, str, float | None]] = []
    for name in models:
        for policy in POLICIES:
            out.append((name, policy, "default", None))
            out += [(name, policy, "min_cut", b) for b in budgets]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated models of {', '.join(MODELS)}")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="memory budgets in (0, 1]")
    p.add_argument("--published", action="store_true", help="GPT-2 and Qwen2.5-0.5B at published width, 2 layers")
    p.add_argument("--per-block", action="store_true", help="each layer compiled on its own, as torchtitan compiles")
    p.add_argument("--loss", choices=("full", "chunked"), default="full", help="chunked: beside the blocks (per block)")
    p.add_argument("-o", "--out", type=Path)
    args = p.parse_args()
    known, wl = (PUBLISHED, PUBLISHED_WL) if args.published else (MODELS, WL)
    if args.loss == "chunked":
        if not args.per_block:
            p.error("--loss chunked runs beside compiled blocks only: add --per-block")
        wl = dataclasses.replace(wl, loss="chunked")
    name = "compiled_fidelity" + ("_published" if args.published else "") + ("_per_block" if args.per_block else "")
    name += "_chunked" if args.loss == "chunked" else ""
    out = args.out or OUT.with_name(f"{name}.json")
    models = args.only.split(",") if args.only else list(known)
    unknown = [m for m in models if m not in known]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    budgets = tuple(float(b) for b in args.budgets.split(","))
    if not all(0 < b <= 1 for b in budgets):
        p.error(f"--budgets are fractions in (0, 1], got {args.budgets}")
    torch.set_num_threads(1)
    rows = []
    for case in cases(models, budgets):
        rows.append(check(*case, models=known, wl=wl, per_block=args.per_block))
        r = rows[-1]
        step = ""
        if args.per_block:
            step = f"; whole step {r['traced_step']} vs {r['real_step']} ({100 * r['step_error']:+.2f} %)"
        print(
            f"{r['model']} {r['policy']} {r['partitioner']} {r['budget']}: {r['traced']} vs {r['real']} "
            f"({100 * r['error']:+.2f} %){step}",
            flush=True,
        )
    table = [
        [
            r["model"],
            r["policy"],
            r["partitioner"],
            str(r["budget"] or "-"),
            r["backend"],
            str(r["traced"]),
            str(r["real"]),
            f"{100 * r['error']:+.2f} %",
        ]
        for r in rows
    ]
    print(render_table(["model", "policy", "partitioner", "budget", "real backend", "traced", "real", "error"], table))
    meta = {"torch": torch.__version__, "python": platform.python_version(), "workload": wl.__dict__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
