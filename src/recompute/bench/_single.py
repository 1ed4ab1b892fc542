"""``recompute bench``: real training steps under each policy: peak memory, step time, tokens/s, overhead.

Every policy gets its own copy of the model (same seed, same weights) and the same batch. After warm-up,
the timed steps go round the policies in turn (policy A step 1, policy B step 1, A step 2, ...) so that a
machine whose speed drifts (a shared CPU) slows every policy alike. Times are medians, split into forward,
backward and optimizer step. Memory comes from one more step per policy: on the CPU under MemTracker (via
``recompute.trace.trace_module``), on a GPU from ``torch.cuda.max_memory_allocated`` as well.

The measured overhead (step time over the first policy's, minus one) is shown next to the prediction. The
model is the class ``--model`` names (``recompute.models.source``): for a preset the prediction is the analytic
model's (recomputed FLOPs over the step's model FLOPs; ``recompute estimate``'s peak); for a transformers
config.json or a factory, whose class the formulas do not describe, the predicted peak is the fake-tensor trace
of that same class (``recompute trace``) and the predicted overhead its FLOPs counted in a forward and
backward (``FlopCounterMode``) over the first policy's. The result's notes name the class built and say which.

Over 400 lines because one process's bench interleaves every policy's timed steps and holds each beside its
prediction; the distributed bench and the calibration live apart.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from recompute.check_gradients import CPU_PARAM_LIMIT, verify_spec
from recompute.checkpointing import apply, find_layers
from recompute.core.analytic import estimate
from recompute.core.errors import ConfigError, one_of, require
from recompute.core.policy import Policy
from recompute.core.progress import Progress, no_progress
from recompute.core.results import BenchResult, BenchRow
from recompute.core.spec import ModelSpec
from recompute.core.table import gib, render_table
from recompute.core.timing import Device, Timing, timing
from recompute.core.workload import LOSSES, Workload
from recompute.models.loss import LossFn
from recompute.models.source import BuiltModel, ModelSource, build_source, resolve_source
from recompute.runtime import (
    HEADROOM,
    TORCH_DTYPES,
    available_memory,
    device_name,
    random_batch,
    require_memory,
    resolve_device,
    sync,
)
from recompute.trace import TraceResult, flop_counter, step_work, trace, trace_module

__all__ = ["CPU_GPT2", "BenchResult", "BenchRow", "bench", "bench_source", "bench_spec", "render_bench"]

CPU_GPT2 = {"n_layers": 6, "hidden": 384, "n_heads": 6}
"""The default model: GPT-2 (vocabulary, context, LayerNorm, GELU, dropout) at a width and depth a CPU runs."""


def bench_spec(model: str | None, **overrides: int | None) -> tuple[ModelSpec, bool]:
    """The spec to benchmark and whether it is the Hugging Face model (``hf:`` prefix).

    ``model=None`` is GPT-2 shrunk to ``CPU_GPT2`` (overrides still apply). Models over a billion parameters
    are refused (``recompute.verify.verify_spec``): this runs real steps.
    """
    if model is None:
        model, overrides = "gpt2", {**CPU_GPT2, **{k: v for k, v in overrides.items() if v is not None}}
    return verify_spec(model, **overrides)


def bench_source(model: str | None, **overrides: int | None) -> ModelSource:
    """What ``bench --model`` names: a preset as ``bench_spec`` resizes it, a config.json or a factory as it is.

    Raises:
        ConfigError: as ``bench_spec``; a size override given for a config or factory (it is built as it is).
    """
    source = resolve_source(model) if model is not None else None
    if source is None or source.spec is not None:
        spec, hf = bench_spec(model, **overrides)
        return ModelSource.preset(spec, hf=hf)
    given = [k for k, v in overrides.items() if v is not None]
    require(
        not given,
        f"{given[0] if given else ''} resizes presets; {model} is built as it is: edit its config (or factory)",
        fields=tuple(given[:1]),
    )
    return source


@dataclass
class _Run:
    """One policy's model, optimizer and timings."""

    policy: Policy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    times: list[tuple[float, float, float]]
    loss: str = "full"
    """The loss mode it runs with (``Workload.loss``)."""
    flops: int = 0
    """FLOPs of a forward and backward (counted for a config or factory source only)."""


@dataclass(frozen=True)
class _Predicted:
    """The figures each row is measured against: a preset's analytic ones, or the traced ones of a real class."""

    peaks: tuple[float, ...]
    overheads: tuple[float, ...] | None
    """The analytic overheads; ``None``: from the FLOPs counted in a forward and backward per policy."""
    note: str


def bench(
    spec: ModelSpec | ModelSource,
    wl: Workload,
    policies: Sequence[str | Policy] = ("none", "block"),
    *,
    steps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    hf: bool = False,
    progress: Progress = no_progress,
    device_profile: Device | Callable[[], Device] | None = None,
    losses: Sequence[str] = (),
) -> BenchResult:
    """Time and measure real training steps of ``spec`` under each policy (see the module docstring).

    ``losses``: run every policy under each of these loss modes (``full``, ``chunked``), side by side, the
    chunked loss's rows after the full loss's (default: ``wl.loss`` alone). The reference row is the first
    policy under the first mode.

    ``device_profile``: this device's calibration (``recompute calibrate``); each row then also carries the time
    model's predicted step time and time overhead, from the fake-tensor trace of the same step. A function that
    returns one (a calibration of this device) is called once the memory check has passed.

    ``spec`` is a preset's ``ModelSpec`` or any ``ModelSource`` (a transformers config, a factory): the class it
    names is what runs. ``hf=True`` runs the ``transformers`` model of a ``ModelSpec`` instead of recompute's.
    ``wl.keep_grads`` measures the memory step with gradients kept allocated between steps (DDP's and
    Megatron's persistent buffers) instead of set to None (PyTorch's ``zero_grad()``); ``estimate`` models
    the same step.

    Raises:
        ConfigError: no policies, a bad policy, a sequence beyond the model's positions, or CUDA asked
            for without CUDA.
    """
    source = spec if isinstance(spec, ModelSource) else ModelSource.preset(spec, hf=hf)
    if source.spec is not None:
        wl.check(source.spec)
    require(len(policies) > 0, "give at least one policy, e.g. policies none,block", fields=("policies",))
    require(
        steps > 0 and warmup >= 0,
        f"steps must be > 0 and warmup >= 0, got {steps} and {warmup}",
        fields=("steps", "warmup"),
    )
    require(
        wl.tp == wl.pp == wl.dp == 1 and not wl.sp,
        "bench runs one process without parallelism; drop tp, pp, dp and sp (estimate models them)",
        fields=("tp", "pp", "dp", "sp"),
    )
    device = resolve_device(wl.device)
    pols = [Policy.parse(p) for p in policies]
    modes = tuple(dict.fromkeys(losses)) or (wl.loss,)
    for mode in modes:
        one_of("loss", mode, LOSSES)
    at = {mode: _with_loss(wl, mode) for mode in modes}
    if isinstance(device_profile, Device):
        gpu = torch.cuda.get_device_name() if device == "cuda" else None
        device_profile.check_runs_on(device, gpu, threads=torch.get_num_threads())
    if len(modes) > 1 and source.spec is not None:  # every run's model is resident: check them all together
        need = predicted_need(source.spec, wl, pols * len(modes))
        require_memory(need, device, what="bench", fix="use fewer policies or one loss mode", fields=SIZE_FIELDS)
    preflights = [_preflight(source, at[mode], pols, device) for mode in modes]
    predicted = _Predicted(
        tuple(peak for p in preflights for peak in p.peaks),
        None
        if any(p.overheads is None for p in preflights)
        else tuple(o for p in preflights for o in p.overheads or ()),
        preflights[0].note,
    )
    plan = [(mode, pol) for mode in modes for pol in pols]
    if callable(device_profile):
        device_profile = device_profile()  # measured only for a run that fits
    timings = _predicted_times(source, [(at[m], pol) for m, pol in plan], device_profile) if device_profile else None
    runs, built = [], None
    for mode, pol in plan:
        torch.manual_seed(seed)
        built = build_source(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.dtype], device=device)
        model = built.model.train()
        apply(model, pol, loss=mode, loss_chunk=at[mode].loss_chunk)
        runs.append(_Run(pol, model, torch.optim.AdamW(model.parameters()), built.loss_fn, [], mode))
    assert built is not None
    batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len, device=device, seed=seed)
    count = predicted.overheads is None
    total, done = len(runs) * (warmup + 1 + count + steps), 0
    for run in runs:
        for i in range(warmup):
            progress(f"{run.policy.describe()}: warm-up {i + 1}/{warmup}", done, total)
            _timed_step(run, batch, device)
            done += 1
    memory = []
    for run in runs:
        progress(f"{run.policy.describe()}: memory step", done, total)
        memory.append(_memory(run, batch, device, wl.keep_grads))
        done += 1
    for run in runs[: len(runs) * count]:
        progress(f"{run.policy.describe()}: FLOP count", done, total)
        run.flops = _count_flops(run, batch)
        done += 1
    for i in range(steps):
        for run in runs:
            progress(f"{run.policy.describe()}: step {i + 1}/{steps}", done, total)
            run.times.append(_timed_step(run, batch, device))
            done += 1
    progress("done", total, total)
    overheads = predicted.overheads or tuple(run.flops / runs[0].flops - 1 for run in runs)
    rows = tuple(
        _row(wl, run, mem, peak, over) for run, mem, peak, over in zip(runs, memory, predicted.peaks, overheads)
    )
    if timings is not None:
        rows = tuple(
            dataclasses.replace(row, predicted_step_s=t.step, predicted_time_overhead=t.overhead)
            for row, t in zip(rows, timings)
        )
    return BenchResult(
        model=source.name,
        spec=source.spec.to_dict() if source.spec is not None else _described(runs[0].model, built),
        workload=wl.to_dict(),
        steps=steps,
        warmup=warmup,
        device=device_name(device),
        rows=rows,
        notes=(
            f"ran {built.class_name} built from {source.origin}",
            *built.notes,
            predicted.note,
            *(
                [f"predicted times: {device_profile.source}; {device_profile.host_note()}"]
                if device_profile is not None
                else []
            ),
        ),
    )


def _predicted_times(source: ModelSource, runs: Sequence[tuple[Workload, Policy]], device: Device) -> list[Timing]:
    """Each run's predicted step time and time overhead, against the predicted step under ``none`` with the
    first run's loss mode."""
    base = step_work(source, runs[0][0], "none")
    plain = Policy("none")
    return [
        timing(base if pol == plain and wl == runs[0][0] else step_work(source, wl, pol), base, device)
        for wl, pol in runs
    ]


def _with_loss(wl: Workload, loss: str) -> Workload:
    return wl if loss == wl.loss else dataclasses.replace(wl, loss=loss, loss_chunk=None)


def _preflight(source: ModelSource, wl: Workload, pols: Sequence[Policy], device: str) -> _Predicted:
    """Refuse a run the free memory cannot hold, before building anything; the figures rows are measured against.

    A preset is predicted by the analytic model. A config or factory by the fake-tensor trace of its own class,
    policy by policy (never by the formulas of a reference model it is not).
    """
    if source.spec is not None:
        spec = source.spec
        fix = _smaller(spec, wl, pols, device)
        require_memory(predicted_need(spec, wl, pols), device, what="bench", fix=fix, fields=SIZE_FIELDS)
        ests = [estimate(spec, _as_run(wl), p) for p in pols]
        note = "predicted peak and overhead: the analytic model (recompute estimate) of the preset"
        return _Predicted(tuple(e.peak for e in ests), tuple(e.overhead for e in ests), note)
    traces = [trace(source, wl, p) for p in pols]
    count = traces[0].parameter_count
    if count > CPU_PARAM_LIMIT:
        raise ConfigError(
            f"{source.name} has {count / 1e9:.1f}B parameters, too many to run real steps of here; "
            "pass a smaller config (fewer layers, a narrower hidden size), or use `recompute trace` (fake tensors)"
        )
    fix = "use a shorter seq_len, a smaller micro_batch, fewer policies, or a smaller config"
    require_memory(traced_need(traces), device, what="bench", fix=fix, fields=("seq_len", "micro_batch"))
    note = (
        "predicted peak: the fake-tensor trace of the same class (recompute trace); predicted overhead: its FLOPs "
        "counted (FlopCounterMode) in a forward and backward over the first policy's; the analytic model describes "
        "recompute's reference GPT-2 and Llama, not this class"
    )
    return _Predicted(tuple(float(t.peak) for t in traces), None, note)


def traced_need(traces: Sequence[TraceResult]) -> float:
    """Bytes ``bench`` will hold, from the traces of its policies: as ``predicted_need``, traced."""
    resident = traces[0].parameters + traces[0].optimizer
    return float(max(t.peak for t in traces) + (len(traces) - 1) * resident)


def _described(model: nn.Module, built: BuiltModel) -> dict[str, object]:
    """What the result says of a model that has no spec: its class, parameter count, layers and vocabulary."""
    return {
        "class": built.class_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "n_layers": len(find_layers(model)),
        "vocab": built.vocab,
    }


def _as_run(wl: Workload) -> Workload:
    """What runs here is plain training in one dtype: AdamW's state is in the parameters' dtype."""
    return dataclasses.replace(wl, precision="fp32" if wl.dtype == "fp32" else "bf16")


SIZE_FIELDS = ("seq_len", "micro_batch", "n_layers", "hidden", "vocab")
"""The fields the memory advice names."""


def predicted_need(spec: ModelSpec, wl: Workload, policies: Sequence[Policy]) -> float:
    """Bytes ``bench`` will hold: the largest step's predicted peak, plus the other policies' models.

    Every policy keeps its own model and AdamW state for the whole benchmark (gradients are freed between
    steps); one step runs at a time.
    """
    ests = [estimate(spec, _as_run(wl), p) for p in policies]
    resident = ests[0].states.parameters + ests[0].states.optimizer
    return max(e.peak for e in ests) + (len(ests) - 1) * resident


def _smaller(spec: ModelSpec, wl: Workload, policies: Sequence[Policy], device: str) -> str:
    """The fix to suggest: the longest sequence that fits (halving), else a smaller model."""
    have = HEADROOM * available_memory(device)
    s = wl.seq_len // 2
    while s >= 16:
        if predicted_need(spec, dataclasses.replace(wl, seq_len=s), policies) <= have:
            return f"use seq_len {s} or less, fewer policies, or a smaller model (n_layers, hidden)"
        s //= 2
    return "use a smaller model (n_layers, hidden, vocab), a smaller micro_batch, or fewer policies"


def _timed_step(run: _Run, batch: tuple[Tensor, Tensor], device: str) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds of one training step."""
    sync(device)
    t0 = time.perf_counter()
    _, loss = run.loss_fn(run.model, *batch)
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    t2 = time.perf_counter()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    sync(device)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _count_flops(run: _Run, batch: tuple[Tensor, Tensor]) -> int:
    """FLOPs of one forward and backward of ``run`` (recomputation included); no optimizer step.

    A step of its own: under ``FlopCounterMode`` the memory step's peak grew (module hooks keep tensors alive).
    """
    with flop_counter() as counter:  # FlopCounterMode that takes grouped-query attention on every torch
        _, loss = run.loss_fn(run.model, *batch)
        loss.backward()
    run.model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def _memory(run: _Run, batch: tuple[Tensor, Tensor], device: str, keep_grads: bool = False) -> tuple[int, int, int]:
    """(device peak, traced peak, saved activation bytes) of one step of ``run``."""
    traced = trace_module(run.model, batch, optimizer=run.optimizer, loss_fn=run.loss_fn, keep_grads=keep_grads)
    if device != "cuda":
        return traced.peak, traced.peak, traced.activations
    own = _resident_bytes(run)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _timed_step(run, batch, device)
    peak = own + torch.cuda.max_memory_allocated() - base  # other policies' models stay resident: leave them out
    return peak, traced.peak, traced.activations


def _resident_bytes(run: _Run) -> int:
    """Bytes of ``run``'s parameters and optimizer state (what it holds between steps)."""
    tensors = list(run.model.parameters()) + [
        v for state in run.optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
    ]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


def _row(wl: Workload, run: _Run, memory: tuple[int, int, int], peak: float, overhead: float) -> BenchRow:
    fwd, bwd, opt = (statistics.median(t[i] for t in run.times) for i in range(3))
    steps = tuple(sum(t) for t in run.times)
    step = statistics.median(steps)
    return BenchRow(
        policy=run.policy.describe(),
        loss=run.loss,
        peak=memory[0],
        traced_peak=memory[1],
        activations=memory[2],
        step_s=step,
        forward_s=fwd,
        backward_s=bwd,
        optimizer_s=opt,
        tokens_per_s=wl.tokens / step,
        predicted_overhead=overhead,
        predicted_peak=peak,
        step_times=steps,
    )


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def render_bench(r: BenchResult) -> str:
    """The policy table, then the headline pair (peak drop, step-time increase) of each policy."""
    ref = r.reference
    timed = all(row.predicted_step_s is not None for row in r.rows)
    losses = len({row.loss for row in r.rows}) > 1

    def name(row: BenchRow) -> str:
        return row.policy + (", chunked loss" if losses and row.loss == "chunked" else "")

    def time_cells(row: BenchRow) -> list[str]:
        if not timed:
            return []
        assert row.predicted_step_s is not None and ref.predicted_step_s is not None
        over = "ref" if row is ref else _pct(row.predicted_step_s / ref.predicted_step_s - 1)
        return [f"{row.predicted_step_s * 1e3:,.0f}", over]

    rows = [
        [
            name(row),
            gib(row.peak),
            "ref" if row is ref else _pct(-r.peak_drop(row)),
            gib(row.activations),
            f"{row.step_s * 1e3:,.0f}",
            f"{row.forward_s * 1e3:,.0f} / {row.backward_s * 1e3:,.0f} / {row.optimizer_s * 1e3:,.0f}",
            f"{row.tokens_per_s:,.0f}",
            "ref" if row is ref else _pct(r.overhead(row)),
            *time_cells(row),
            "ref" if row is ref else _pct(row.predicted_overhead - ref.predicted_overhead),
            gib(row.predicted_peak),
        ]
        for row in r.rows
    ]
    headers = [
        "policy", "peak", "vs ref", "activations", "step ms", "fwd / bwd / opt ms", "tokens/s", "overhead",
        *(["predicted ms", "predicted (time)"] if timed else []), "predicted (FLOPs)", "predicted peak",
    ]  # fmt: skip
    w, sp = r.workload, r.spec
    size = (
        f"{sp['n_layers']} layers, h={sp['hidden']}, {sp['n_heads']} heads, vocab {sp['vocab']}"
        if "hidden" in sp
        else f"{sp['class']}, {sp['n_layers']} layers, {sp['parameters']:,} parameters, vocab {sp['vocab']}"
    )
    lines = [
        f"{r.model} ({size}): "
        f"b={w['micro_batch']} s={w['seq_len']} {w['dtype']}, {w['attention']} attention, on {r.device}; "
        f"median of {r.steps} steps after {r.warmup} warm-up",
        *(f"note: {n}" for n in r.notes),
        "",
        render_table(headers, rows),
        "",
    ]
    for row in r.rows[1:]:
        predicted = f"predicted from FLOPs: {100 * (row.predicted_overhead - ref.predicted_overhead):.1f}%"
        if timed:
            assert row.predicted_step_s is not None and ref.predicted_step_s is not None
            predicted = f"predicted time: {100 * (row.predicted_step_s / ref.predicted_step_s - 1):.1f}%, {predicted}"
        lines.append(
            f"{name(row)} vs {name(ref)}: peak memory {100 * r.peak_drop(row):.1f}% lower, "
            f"step time {100 * r.overhead(row):.1f}% higher ({predicted})"
        )
    return "\n".join(lines)
