"""``trace_compiled(model, workload)``: what the ``torch.compile``d step of a model saves, on fake tensors.

The model (a preset's reference model, transformers' class for a config.json, or a factory's module) is built
on the meta device, made fake, the policy applied (torchtitan's order: checkpointing, then compile), and the
whole model compiled with ``_compiled.capture_backend`` (or, ``per_block``, each layer on its own:
``_compiled.capture_blocks``): dynamo and AOTAutograd trace the real step's forward and backward, the partitioner
cuts them, and nothing of Inductor's code generation runs. Llama-3.1-8B at s = 8192 traces on a laptop.

Note: [the eager part's path] transformers chooses its attention path from values (``recompute.trace._hf_path``):
without a cache it asks whether the position ids hold packed sequences, which a compile trace cannot read, so a
whole model compiled takes the general path (a (b, s, s) mask to every layer, K and V repeated for grouped-query
attention), and the trace of the whole model lets dynamo take it too. Code that runs eagerly in a real step reads
the real position ids and takes the fast path: the eager step whose saved bytes the plan swaps out, and, per
block, everything outside the blocks, where the mask is made. Those run under ``real_step_path``; without it the
eager step counted a mask per layer more than the eager trace, and per block each compiled block took a mask the
real step does not make (``tests/test_compiled.py::test_a_transformers_model_without_a_cache_takes_the_real_steps_path``
fails without it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from recompute.checkpointing import apply, find_layers
from recompute.core.errors import require
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec
from recompute.core.table import render_table, size
from recompute.core.workload import Workload
from recompute.models.source import ModelSource, resolve_source
from recompute.runtime import TORCH_DTYPES, autocast_dtype, forward_autocast, random_batch
from recompute.trace._build import build_meta, fake_kernels, fakeify
from recompute.trace._compiled import (
    capture,
    capture_blocks,
    check_options,
    eager_step_peak,
    layer_paths,
    saved_by_eager,
)
from recompute.trace._cuda import cuda_rules
from recompute.trace._hf_path import real_step_path

__all__ = ["CHUNKED_WHOLE", "CompiledTrace", "render_compiled", "trace_budgets", "trace_compiled"]


@dataclass(frozen=True)
class CompiledTrace:
    """What one compiled training step saves for its backward (``trace_compiled``)."""

    model: str
    policy: str
    partitioner: str
    """``min_cut`` (Inductor's, ``torch.compile``'s default) or ``default`` (``aot_eager``'s)."""
    budget: float | None
    """``torch._functorch.config.activation_memory_budget`` the min cut ran under (None: PyTorch's, 1.0)."""
    workload: dict[str, Any]
    layers: tuple[int, ...]
    """Bytes each transformer layer's ops saved."""
    other: int
    """Bytes saved outside the layers: embedding, final norm, head and loss."""
    graphs: int
    """Forward/backward graph pairs dynamo made (the whole model: one where nothing breaks the graph; per block:
    one per kind of block)."""
    notes: tuple[str, ...]
    seconds: float
    flops: int = 0
    """FLOPs of the partitioned forward and backward graphs (``recompute.trace._compiled.graph_flops``): the
    step's matmuls and attention, with what the partition recomputes."""
    device: str = "cpu"
    """The step traced: ``cpu``, or ``cuda`` (CUDA's kernels and 512-byte blocks on fake CPU tensors)."""
    recomputed_bytes: int = 0
    """Bytes the backward's recomputed ops without FLOPs write, unfused (``Captured.recomputed_bytes``)."""
    eager_saved: int | None = None
    """Bytes the same step saves run eagerly, counted the same way (``trace_budgets(..., eager=True)``)."""
    per_block: bool = False
    """Each transformer layer compiled on its own, as torchtitan compiles (Note: [compiled per block] in
    ``recompute.trace._compiled``); else the whole model at once."""
    peak: int | None = None
    """The most bytes the step's forward and backward allocate at once beyond the parameters, buffers and batch
    (saved values, gradients, transients), the partitioned graphs run on fake tensors with the buffers Inductor
    fuses away or reuses left out (the min cut; the default partition's graphs run as they are): an
    approximation of the real step's, measured against it (Note: [compiled peak] in
    ``recompute.trace._compiled``). None: not traced, or a PyTorch whose dynamo runs no compiled code under a
    dispatch mode."""
    eager_layers: tuple[int, ...] = ()
    """Per block: the layers that ran no compiled graph (dynamo gave up on them, as at its recompile limit); their
    bytes are what they save eagerly, and no budget applies to them."""
    eager_note: str = ""
    """The note in ``notes`` that names ``eager_layers`` and why ("" when every layer ran compiled)."""
    eager_window: int | None = None
    """``peak``'s count of the same step run eagerly, on the same fake model (``trace_budgets(..., eager=True,
    peak=True)``; ``recompute.trace._compiled.eager_step_peak``): what the compiled step's peak is compared with."""

    @property
    def saved(self) -> int:
        """Every byte the compiled step holds for its backward, beyond parameters and inputs."""
        return sum(self.layers) + self.other

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saved": self.saved}


def trace_compiled(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    policy: Policy | str = "none",
    *,
    partitioner: str = "min_cut",
    budget: float | None = None,
    per_block: bool = False,
    peak: bool = False,
) -> CompiledTrace:
    """What the ``torch.compile``d step of ``model`` under ``wl`` and ``policy`` saves for its backward, traced
    on fake tensors (Note: [compiled saved values] in ``recompute.trace._compiled``).

    Args:
        model: a ``ModelSpec`` (recompute's reference model), a ``ModelSource`` or what ``--model`` takes.
        wl: batch, sequence, dtype, attention, device (``cpu``, or ``cuda``: CUDA's step on fake CPU tensors,
            ``recompute.trace._cuda``); one rank.
        policy: a recompute policy applied before compiling (checkpointed layers become dynamo's checkpoint
            regions, which the partitioner recomputes), a name, a ``Policy`` or a plan file.
        partitioner: ``min_cut`` (Inductor's) or ``default`` (``aot_eager``'s, CPU steps only).
        budget: ``torch._functorch.config.activation_memory_budget`` in (0, 1], for ``min_cut``.
        per_block: compile each transformer layer on its own, the rest eager (torchtitan's way; Note: [compiled
            per block] in ``recompute.trace._compiled``); the budget is then a fraction of each block's.
        peak: also trace the step's forward and backward, twice, for its peak (``CompiledTrace.peak``).

    Raises:
        ConfigError: an unknown partitioner or a budget outside (0, 1], a workload this trace does not run
            (parallelism; the chunked loss with the whole model compiled), an offload policy, or a model that
            cannot be built.
    """
    return trace_budgets(model, wl, policy, (budget,), partitioner=partitioner, per_block=per_block, peak=peak)[0]


def trace_budgets(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    policy: Policy | str = "none",
    budgets: Sequence[float | None] = (None,),
    *,
    partitioner: str = "min_cut",
    eager: bool = False,
    per_block: bool = False,
    peak: bool = False,
    unfused: bool = False,
) -> tuple[CompiledTrace, ...]:
    """``trace_compiled`` under each of ``budgets`` from one trace of the model (Note: [one trace, several
    budgets] in ``recompute.trace._compiled``), in their order. ``eager``: also what the same step saves run
    eagerly (``saved_by_eager``), first, on the same fake model. ``per_block``: each layer compiled on its own,
    one trace per budget (``capture_blocks``: what runs is what is counted). ``peak``: also the step's peak
    (``CompiledTrace.peak``), its forward and backward run twice per budget, one trace each (with ``eager``, the
    eager step's by the same count too: ``CompiledTrace.eager_window``); ``unfused``: that peak without Inductor's
    fusion modelled, the partitioned graphs' own liveness."""
    for b in budgets:
        check_options(partitioner, b)
    require(peak or not unfused, "unfused is the peak's; ask for the peak too (peak=True)")
    source = model if isinstance(model, ModelSource) else _source(model)
    pol = Policy.parse(policy)
    _check(wl, pol, partitioner)
    require(
        per_block or wl.loss != "chunked",
        f"{CHUNKED_WHOLE}; compile per block (per_block=True, --compiled block) or use the full loss",
        fields=("loss",),
    )
    cuda = wl.device == "cuda"
    start = time.perf_counter()
    with fake_kernels(), cuda_rules() if cuda else contextlib.nullcontext():
        built = build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype])
        # a checkpointed region's random ops replay in the backward from the real generator's state
        mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=peak)
        fakeify(built.model, mode, "cpu")
        built.model.train()
        stack = find_layers(built.model)
        _check_policy(pol, len(stack))
        apply(built.model, pol, loss=wl.loss, loss_chunk=wl.loss_chunk)
        with mode:
            batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len)

        def run(compiled: torch.nn.Module) -> Any:
            """The forward, its outputs returned (what they hold is held for the backward)."""
            with mode, forward_autocast(autocast_dtype(wl), "cpu"):
                return built.loss_fn(compiled, *batch)

        def step(compiled: torch.nn.Module) -> None:
            """A training step's forward and backward, the outputs held through the backward (as the eager
            trace's step holds them)."""
            with mode:
                with forward_autocast(autocast_dtype(wl), "cpu"):
                    kept, loss = built.loss_fn(compiled, *batch)
                loss.backward()
                del kept, loss

        weights = [*built.model.parameters(), *built.model.buffers(), *batch]
        eager_bytes = eager_window = None
        if eager:  # the eager step's path through transformers, as the eager trace takes it
            with real_step_path():
                eager_bytes = saved_by_eager(lambda: run(built.model), exclude=weights, cuda=cuda)
                if peak:
                    eager_window = eager_step_peak(lambda: step(built.model), exclude=weights, cuda=cuda)
                    built.model.zero_grad(set_to_none=True)

        each = step if peak else None
        fused = False if unfused else None
        if per_block:  # Note: [the eager part's path]
            with real_step_path():
                found = tuple(
                    capture_blocks(
                        built.model,
                        stack,
                        run,
                        partitioner=partitioner,
                        budget=b,
                        cuda=cuda,
                        exclude=weights,
                        step=each,
                        fused=fused,
                    )
                    for b in budgets
                )
        else:  # one trace for every budget's saved bytes; the peak runs one budget's graphs, so one trace each
            paths = layer_paths(built.model, stack)
            groups = [(b,) for b in budgets] if peak else [tuple(budgets)]
            found = tuple(
                got
                for group in groups
                for got in capture(
                    built.model,
                    run,
                    layers=paths,
                    partitioner=partitioner,
                    budgets=group,
                    cuda=cuda,
                    step=each,
                    exclude=weights,
                    fused=fused,
                )
            )
    seconds = time.perf_counter() - start
    on = "fake CPU tensors under CUDA's rules (recompute.trace._cuda)" if cuda else "fake CPU tensors"
    results = []
    for b, got in zip(budgets, found, strict=True):
        how = (
            "each transformer layer on its own, as torchtitan compiles; the embedding, final norm, head and loss eager"
            if per_block
            else "whole model"
        )
        notes = [
            f"compiled {built.class_name} built from {source.origin} with torch.compile ({how}, "
            f"dynamic=False) on {on}; partitioned by {_described(partitioner, b)}; no kernel generated or run",
            *built.notes,
        ]
        eager_note = ""
        if got.eager_layers:
            eager_note = (
                f"layers {', '.join(map(str, got.eager_layers))} ran no compiled graph (dynamo gave up on them, as at "
                "its recompile limit): their bytes are what they save eagerly, and no budget applies to them"
                + (
                    _CACHE_GUARDS
                    if per_block and getattr(getattr(built.model, "config", None), "use_cache", False)
                    else ""
                )
            )
            notes.append(eager_note)
        if got.graphs > 1 and not per_block:
            notes.append(f"dynamo broke the model into {got.graphs} graphs: what runs eagerly between is not counted")
        if cuda:
            notes.append(
                "a CUDA step: FlashAttention or memory-efficient attention as CUDA selects it (no decomposition, its "
                "output and log-sum-exp saved), fp32 LayerNorm statistics, 512-byte blocks; not yet held to a real "
                "compiled CUDA step"
            )
        results.append(
            CompiledTrace(
                model=source.name,
                policy=pol.describe(),
                partitioner=partitioner,
                budget=b,
                workload={k: getattr(wl, k) for k in ("micro_batch", "seq_len", "dtype", "precision", "attention")},
                layers=got.layers,
                other=got.other,
                graphs=got.graphs,
                notes=tuple(notes),
                seconds=seconds,
                flops=got.flops,
                device=wl.device,
                eager_saved=eager_bytes,
                recomputed_bytes=got.recomputed_bytes,
                per_block=per_block,
                peak=got.peak,
                eager_layers=got.eager_layers,
                eager_note=eager_note,
                eager_window=eager_window,
            )
        )
    return tuple(results)


CHUNKED_WHOLE = (
    "the chunked loss takes its chunks' gradients inside the forward (torch.autograd.grad), where dynamo breaks a "
    "whole model's graph and the trace would miss what runs between"
)
"""Why the whole model compiled does not take the chunked loss (compiled per block, the loss runs eagerly)."""

_CACHE_GUARDS = (
    "; the model builds a key/value cache in training (config use_cache=True), and each block's part of it is a "
    "guard of its own, so dynamo compiles each block anew until its recompile limit: set use_cache=False (a training "
    "step reads no cache) before compiling per block"
)


def render_compiled(r: CompiledTrace) -> str:
    """``r`` as text: saved bytes by layer (runs of equal layers together), outside the layers, and in all."""
    rows: list[list[str]] = []
    i = 0
    while i < len(r.layers):
        j = i
        while j + 1 < len(r.layers) and r.layers[j + 1] == r.layers[i]:
            j += 1
        rows.append([f"layer {i}" if i == j else f"layers {i}-{j}", size(r.layers[i])])
        i = j + 1
    rows += [["outside the layers", size(r.other)], ["total", size(r.saved)]]
    if r.peak is not None:
        rows.append(["peak of the forward and backward", size(r.peak)])
    w = r.workload
    title = (
        f"{r.model}: b={w['micro_batch']} s={w['seq_len']} {w['dtype']}, {w['attention']} attention, {r.device} "
        f"step, policy {r.policy}, compiled{' per block' if r.per_block else ''} "
        f"({_described(r.partitioner, r.budget)}; traced in {r.seconds:.1f} s); "
        f"{r.flops / 1e12:.3f} TFLOPs forward and backward" + (" in the compiled blocks' graphs" if r.per_block else "")
    )
    table = render_table(["saved for the backward by", "bytes"], rows)
    notes = list(r.notes)
    if r.peak is not None:
        notes.append(
            "peak of the forward and backward: the most allocated at once beyond the parameters, optimizer state, "
            "buffers and batch (saved values, gradients, transients), the partitioned graphs run on fake tensors"
            + (
                " with the buffers Inductor fuses away or reuses left out: an approximation of Inductor's scheduler, "
                "measured against real Inductor CPU steps in benchmarks/compiled_peak.py"
                if r.partitioner == "min_cut"
                else ", as aot_eager runs them"
            )
        )
    return "\n".join([title, "", table, "", *(f"- {n}" for n in notes)])


def _described(partitioner: str, budget: float | None) -> str:
    if partitioner == "default":
        return "AOTAutograd's default partition"
    return "Inductor's min cut" + (f" under activation_memory_budget {budget:g}" if budget is not None else "")


def _source(model: ModelSpec | str) -> ModelSource:
    return ModelSource.preset(model) if isinstance(model, ModelSpec) else resolve_source(model)


def _check(wl: Workload, pol: Policy, partitioner: str) -> None:
    require(
        wl.device == "cpu" or partitioner == "min_cut",
        "the default partition is aot_eager's, a CPU debugging backend; a CUDA step is traced with Inductor's "
        "min cut (drop --partitioner default, or use --device cpu)",
        fields=("device",),
    )
    require(
        wl.tp == 1 and not wl.fsdp and wl.pp == 1,
        "the compiled trace runs one rank of the whole model; drop tp, pp and fsdp",
        fields=("tp", "pp", "fsdp"),
    )


def _check_policy(pol: Policy, n_layers: int) -> None:
    require(
        "offload" not in pol.per_layer(n_layers) and not pol.offload,
        "offload runs under torch.compile eagerly (a graph break) or through saved-tensor hooks, which the "
        f"compiled trace does not count; use a recompute policy without offload, got {pol.describe()}",
    )
