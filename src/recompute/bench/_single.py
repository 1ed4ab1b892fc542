"""``recompute bench``: real training steps under each policy: peak memory, step time, tokens/s, overhead.

Policies run one after another, with one model and optimizer alive at a time (``recompute.bench._block``): each
is built from the same seed (the same weights), steps the same batch, warms up, runs its timed steps in one block
and measures one more step's memory (on the CPU under MemTracker via ``recompute.trace.trace_module``, or c10's
allocator for a compiled step; on a GPU ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` too), and
is released before the next is built. So
anything whose largest step fits alone can be benched, every policy in one command.

Note: [drift] Timed steps in blocks are fair to a machine whose speed holds; one that drifts (a shared CPU, a
GPU's clocks) slows the later blocks. So when there is more than one run, the first (the reference) runs again
after the last, and the result says by how much its median step moved (``BenchResult.drift``): the drift over the
whole run, against which the overheads are to be read; it costs one policy's warm-up and timed steps. Where that
is not close enough, ``rounds`` shares the timed steps out over rounds, each of which builds every policy again
from the seed and warms it up: with one step per round, each policy's i-th step runs beside the others' i-th
(paired ratios, as when every model stayed resident and the steps were interleaved), at the price of a build and
warm-up per policy per round; the drift is then the reference's last round against its first.

Every prediction is of the step bench runs (``recompute.bench._predict``): plain training in ``wl.dtype``, the
predicted peak from that step's fake-tensor trace (``recompute trace``) of the class ``--model`` names
(``recompute.models.source``), on CUDA with the caching allocator's predicted reserve. A preset's overhead (and its
analytic peak, shown beside) is the analytic model's (recomputed FLOPs over the step's model FLOPs, ``recompute
estimate``); a transformers config.json's or a factory's is its FLOPs counted in a forward and backward
(``FlopCounterMode``) over the first policy's. The result's notes name the class built, the precision run and say
which.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
from collections.abc import Callable, Sequence

import torch

from recompute.bench._block import Measured, run_block
from recompute.bench._predict import MAX_MINUTES, Predicted, as_run, precision_note, predict
from recompute.check_gradients import named_spec
from recompute.core.errors import ConfigError, one_of, require
from recompute.core.policy import OFFLOAD_POLICIES, Policy
from recompute.core.progress import Progress, no_progress
from recompute.core.results import BenchResult, BenchRow
from recompute.core.spec import ModelSpec
from recompute.core.table import gib, render_table
from recompute.core.timing import Device, Timing, timing
from recompute.core.torch_range import torch_release
from recompute.core.workload import AMP, LOSSES, Workload, parallel_sizes
from recompute.models.source import ModelSource, resolve_source
from recompute.runtime import device_name, resolve_device
from recompute.trace import CHUNKED_WHOLE, step_work

__all__ = ["CPU_GPT2", "BenchResult", "BenchRow", "bench", "bench_source", "bench_spec", "render_bench"]

CPU_GPT2 = {"n_layers": 6, "hidden": 384, "n_heads": 6}
"""The default model: GPT-2 (vocabulary, context, LayerNorm, GELU, dropout) at a width and depth a CPU runs."""


def bench_spec(model: str | None, **overrides: int | None) -> tuple[ModelSpec, bool]:
    """The spec to benchmark and whether it is the Hugging Face model (``hf:`` prefix).

    ``model=None`` is GPT-2 shrunk to ``CPU_GPT2`` (overrides still apply). Any size is taken: ``bench`` refuses
    a run by the memory (and, on the CPU, the time) it is predicted to need, not by a parameter count.
    """
    if model is None:
        model, overrides = "gpt2", {**CPU_GPT2, **{k: v for k, v in overrides.items() if v is not None}}
    return named_spec(model, **overrides)


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
    max_minutes: float = MAX_MINUTES,
    rounds: int = 1,
    compiled: str | None = None,
    memory_budget: float | None = None,
) -> BenchResult:
    """Time and measure real training steps of ``spec`` under each policy, one policy at a time (see the module
    docstring).

    ``rounds``: share the ``steps`` timed steps out over this many rounds, each building every policy afresh
    (Note: [drift]); 1 runs each policy's timed steps in one block, then the reference again.

    ``losses``: run every policy under each of these loss modes (``full``, ``chunked``), the chunked loss's rows
    after the full loss's (default: ``wl.loss`` alone). The reference row is the first policy under the first mode.

    ``device_profile``: this device's calibration (``recompute calibrate``); each row then also carries the time
    model's predicted step time and time overhead, from the fake-tensor trace of the same step. A function that
    returns one (a calibration of this device) is called once the memory check has passed.

    ``spec`` is a preset's ``ModelSpec`` or any ``ModelSource`` (a transformers config, a factory): the class it
    names is what runs. ``hf=True`` runs the ``transformers`` model of a ``ModelSpec`` instead of recompute's.
    ``wl.keep_grads`` measures the memory step with gradients kept allocated between steps (DDP's and
    Megatron's persistent buffers) instead of set to None (PyTorch's ``zero_grad()``); the prediction traces the
    same step. The step runs in ``wl.dtype`` throughout (``recompute.bench._predict.run_precision``); a workload
    asking for ``mixed`` or ``distributed`` precision is run and priced as that step, and a note says so.

    ``compiled``: ``model`` or ``block``, each run's model ``torch.compile``d after its policy (the whole model, or
    each layer on its own as torchtitan compiles; Note: [compiled blocks] in ``recompute.bench._block``), under
    ``memory_budget`` (``activation_memory_budget``; None: PyTorch's own); each row is then held to the compiled
    step's trace (``trace_compiled``): its peak and, from its graphs' FLOPs, its overhead. No step time is
    predicted for it (the time model prices eager kernels).

    Raises:
        ConfigError: no policies, a bad policy, a sequence beyond the model's positions, CUDA asked for without
            CUDA, a step predicted not to fit the free memory, or on the CPU runs predicted to take over
            ``max_minutes``; ``compiled`` not ``model`` or ``block``, a memory budget without it (or a plan's other
            than it), no warm-up step for it to compile in, a device profile or ``keep_grads`` beside it, an
            offloading policy, or a PyTorch before 2.8.
    """
    source = spec if isinstance(spec, ModelSource) else ModelSource.preset(spec, hf=hf)
    _check_compiled(compiled, memory_budget, warmup, device_profile, wl, policies, losses)
    runs, device = _runs(source, wl, policies, losses, steps=steps, warmup=warmup, rounds=rounds)
    # a preset's overheads are the analytic model's (one dtype); another's, or any under amp, are counted; a
    # compiled step's are its graphs' FLOPs (predict)
    count = compiled is None and (source.spec is None or any(w.precision == AMP for w, _ in runs))
    per_run = rounds * warmup + 1 + count + steps
    again = (warmup + steps) * (len(runs) > 1 and rounds == 1)  # Note: [drift]
    taken = [per_run + again] + [per_run] * (len(runs) - 1)
    if isinstance(device_profile, Device):
        gpu = torch.cuda.get_device_name() if device == "cuda" else None
        device_profile.check_runs_on(device, gpu, threads=torch.get_num_threads())
    predicted = predict(
        source, runs, device, steps=taken, max_minutes=max_minutes, compiled=compiled, budget=memory_budget
    )
    if callable(device_profile):
        device_profile = device_profile()  # measured only for a run that fits
    timings = _predicted_times(source, runs, device_profile) if device_profile else None
    block = functools.partial(
        run_block, source, seed=seed, device=device, warmup=warmup, tick=_ticker(progress, sum(taken)),
        compiled=compiled, budget=memory_budget,
    )  # fmt: skip
    measured, drift = _measure(block, runs, steps=steps, rounds=rounds, count=count)
    progress("done", sum(taken), sum(taken))
    result = _result(source, wl, measured, predicted, timings, drift=drift, seed=seed, rounds=rounds, device=device,
                     steps=steps, warmup=warmup, device_profile=device_profile)  # fmt: skip
    if compiled is None:
        return result
    how = "the whole model" if compiled == "model" else "each layer on its own, the rest eager (torchtitan's way)"
    budget = f"activation_memory_budget {memory_budget:g}" if memory_budget is not None else "PyTorch's own budget"
    line = f"compiled: torch.compile (Inductor) of {how}, after the policy, under {budget}; compiled in the warm-up"
    return dataclasses.replace(
        result, compiled=compiled, memory_budget=memory_budget, notes=(result.notes[0], line, *result.notes[1:])
    )


def _check_compiled(
    compiled: str | None,
    budget: float | None,
    warmup: int,
    device_profile: Device | Callable[[], Device] | None,
    wl: Workload,
    policies: Sequence[str | Policy],
    losses: Sequence[str] = (),
) -> None:
    """``bench``'s compiled options, checked before anything is traced or built."""
    if compiled is None:
        require(budget is None, "memory_budget is torch.compile's; bench with compiled 'model' or 'block' too",
                fields=("memory_budget",))  # fmt: skip
        return
    one_of("compiled", compiled, ("model", "block"))
    require(
        budget is None or 0 < budget <= 1, f"memory_budget must be in (0, 1], got {budget}", fields=("memory_budget",)
    )
    require(warmup >= 1, "warmup must be 1 or more under compile: the first step compiles", fields=("warmup",))
    require(
        compiled == "block" or "chunked" not in {wl.loss, *losses},
        f"{CHUNKED_WHOLE}; bench the chunked loss with compiled 'block', not 'model', or bench the full loss alone",
        fields=("loss",),
    )
    require(
        device_profile is None,
        "a compiled bench predicts no step time (the time model prices eager kernels, not Inductor's); drop the "
        "device profile",
        fields=("device_profile",),
    )
    require(
        not wl.keep_grads,
        "keep_grads is not run under compile (its steps set the gradients to None); drop it",
        fields=("keep_grads",),
    )
    for given in policies:
        pol = Policy.parse(given)
        names = {pol.name, *(pol.layers or ())}
        require(
            not pol.offload and not names & set(OFFLOAD_POLICIES),
            f"the policy {pol.describe()} moves saved tensors to host memory, which runs eagerly under "
            "torch.compile; bench it without compile",
            fields=("policies",),
        )
        if pol.memory_budget is not None and pol.memory_budget != budget:
            raise ConfigError(
                f"the plan {pol.describe()} runs under memory_budget {pol.memory_budget:g}; bench it with that "
                "memory_budget",
                fields=("memory_budget",),
            )
    require(
        (torch_release(torch.__version__) or (0, 0)) >= (2, 8),
        f"bench under compile predicts the compiled step's peak by running its graphs under a dispatch mode, which "
        f"this PyTorch ({torch.__version__}) does not do (2.8 and newer do); upgrade, or bench without compile",
    )


def _measure(
    block: Callable[..., Measured], runs: Sequence[tuple[Workload, Policy]], *, steps: int, rounds: int, count: bool
) -> tuple[list[Measured], float | None]:
    """Every run's block (``rounds`` of them, the timed steps shared out), each run's times joined, and the drift:
    the reference's median step in the last round, or when it ran again after the others, over its first's."""
    shares = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    done = [[block(w, pol, steps=shares[0], count=count) for w, pol in runs]]
    for r, share in enumerate(shares[1:], start=2):
        name = f"round {r}/{rounds}"
        done.append([block(w, pol, steps=share, measure=False, name=f"{pol.describe()}, {name}") for w, pol in runs])
    joined = [dataclasses.replace(m, times=sum((rnd[i].times for rnd in done), ())) for i, m in enumerate(done[0])]
    last = done[-1][0] if rounds > 1 else None
    if rounds == 1 and len(runs) > 1:  # Note: [drift]
        last = block(*runs[0], steps=steps, measure=False, name=f"{runs[0][1].describe()} (again)")
    return joined, _median_step(last) / _median_step(done[0][0]) - 1 if last is not None else None


def _runs(
    source: ModelSource,
    wl: Workload,
    policies: Sequence[str | Policy],
    losses: Sequence[str],
    *,
    steps: int,
    warmup: int,
    rounds: int,
) -> tuple[list[tuple[Workload, Policy]], str]:
    """Each run's workload (its loss mode, the precision bench runs) and policy, in order, and the device.

    Raises:
        ConfigError: as ``bench``'s argument checks.
    """
    if source.spec is not None:
        wl.check(source.spec)
    require(len(policies) > 0, "give at least one policy, e.g. policies none,block", fields=("policies",))
    require(
        steps > 0 and warmup >= 0,
        f"steps must be > 0 and warmup >= 0, got {steps} and {warmup}",
        fields=("steps", "warmup"),
    )
    require(
        0 < rounds <= steps,
        f"rounds must be from 1 to steps ({steps}), got {rounds}: each round runs at least one timed step",
        fields=("rounds", "steps"),
    )
    sizes, fields = parallel_sizes(wl)
    require(
        not fields, f"bench runs one process without parallelism; drop {sizes} (estimate models them)", fields=fields
    )
    device = resolve_device(wl.device)
    pols = [Policy.parse(p) for p in policies]
    modes = tuple(dict.fromkeys(losses)) or (wl.loss,)
    for mode in modes:
        one_of("loss", mode, LOSSES)
    return [(as_run(_with_loss(wl, mode)), pol) for mode in modes for pol in pols], device


def _ticker(progress: Progress, total: int) -> Callable[[str], None]:
    """A callback that reports each step started, counting them."""
    done = itertools.count()

    def tick(label: str) -> None:
        progress(label, next(done), total)

    return tick


def _median_step(m: Measured) -> float:
    return statistics.median(sum(t) for t in m.times)


def _result(
    source: ModelSource,
    wl: Workload,
    measured: Sequence[Measured],
    predicted: Predicted,
    timings: list[Timing] | None,
    *,
    drift: float | None,
    seed: int,
    rounds: int,
    device: str,
    steps: int,
    warmup: int,
    device_profile: Device | None,
) -> BenchResult:
    """The rows, each beside its prediction, and the notes that say what ran and where the figures come from."""
    if predicted.compiled is not None:
        overheads = tuple(c.flops / predicted.compiled[0].flops - 1 for c in predicted.compiled)
    elif predicted.analytic is not None:
        overheads = tuple(e.overhead for e in predicted.analytic)
    else:
        overheads = tuple(m.flops / measured[0].flops - 1 for m in measured)
    rows = tuple(_row(wl, m, predicted, i, overheads[i]) for i, m in enumerate(measured))
    if timings is not None:
        rows = tuple(
            dataclasses.replace(row, predicted_step_s=t.step, predicted_time_overhead=t.overhead)
            for row, t in zip(rows, timings)
        )
    first = measured[0]
    return BenchResult(
        model=source.name,
        spec=source.spec.to_dict() if source.spec is not None else first.about,
        workload=as_run(wl).to_dict(),
        steps=steps,
        warmup=warmup,
        device=device_name(device),
        rows=rows,
        notes=(
            f"ran {first.class_name} built from {source.origin}",
            *first.notes,
            precision_note(wl),
            predicted.note,
            _order_note(first, seed, rounds, drift),
            *([f"predicted times: {device_profile.source}; {device_profile.host_note()}"] if device_profile else []),
        ),
        drift=drift,
    )


def _order_note(first: Measured, seed: int, rounds: int, drift: float | None) -> str:
    """How the runs were laid out in time, and the drift the reference measured (Note: [drift])."""
    built = f"one model alive at a time, each built from seed {seed} (the same weights and batch)"
    ref = first.policy.describe()
    if rounds > 1:
        line = f"{built} in each of {rounds} rounds, which share out the timed steps"
        moved = f"{ref}'s median step in the last round {drift or 0:+.1%} against the first round's"
    else:
        line = f"{built}, its timed steps in one block"
        moved = f"{ref} ran again last, its median step {drift or 0:+.1%} against its first block's"
    if drift is None:
        return line
    return f"{line}; {moved}: the machine's drift over the run, within which the overheads are noise"


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


def _row(wl: Workload, m: Measured, predicted: Predicted, i: int, overhead: float) -> BenchRow:
    """Run ``i``'s row: what its block measured, beside what was predicted for it."""
    fwd, bwd, opt = (statistics.median(t[k] for t in m.times) for k in range(3))
    steps = tuple(sum(t) for t in m.times)
    step = statistics.median(steps)
    reserved = predicted.traces[i].reserved if predicted.compiled is None else None  # the eager step's replay
    return BenchRow(
        policy=m.policy.describe(),
        loss=m.loss,
        peak=m.memory[0],
        traced_peak=m.memory[1],
        activations=m.memory[2],
        step_s=step,
        forward_s=fwd,
        backward_s=bwd,
        optimizer_s=opt,
        tokens_per_s=wl.tokens / step,
        predicted_overhead=overhead,
        predicted_peak=predicted.peaks[i],
        step_times=steps,
        reserved=m.reserved,
        predicted_reserved=float(reserved) if reserved is not None else None,
        analytic_peak=predicted.analytic[i].peak if predicted.analytic is not None else None,
    )


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def render_bench(r: BenchResult) -> str:
    """The policy table, then the headline pair (peak drop, step-time increase) of each policy."""
    ref = r.reference
    timed = all(row.predicted_step_s is not None for row in r.rows)
    analytic = all(row.analytic_peak is not None for row in r.rows)
    reserved = all(row.reserved is not None and row.predicted_reserved is not None for row in r.rows)
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
            *([gib(row.analytic_peak or 0)] if analytic else []),
            *([gib(row.reserved or 0), gib(row.predicted_reserved or 0)] if reserved else []),
        ]
        for row in r.rows
    ]
    headers = [
        "policy", "peak", "vs ref", "activations", "step ms", "fwd / bwd / opt ms", "tokens/s", "overhead",
        *(["predicted ms", "predicted (time)"] if timed else []), "predicted (FLOPs)", "predicted peak",
        *(["analytic peak"] if analytic else []), *(["reserved", "predicted reserved"] if reserved else []),
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
