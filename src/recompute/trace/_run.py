"""``trace(model, workload, policy)``: the real PyTorch training step of a model, on fake tensors.

The model (a preset's reference model, transformers' class for a config.json, or a factory's module) is built
on the meta device, its parameters become ``FakeTensor``s, the policy is applied with
``recompute.apply``, and one steady-state step (forward, backward, AdamW step) runs under ``StepTracker``.
Nothing is allocated, so Llama-3.1-70B at s = 8192 traces on a laptop.

Over 400 lines because its entry points (``trace``, ``step_record``, ``trace_layer``, ``step_work(s)``,
``trace_module``) share one fake step: the model built on meta and made fake, the policy applied between the
parallel transforms; the scaling, layer kinds and fake process group live in ``_scale``, ``_kinds`` and ``_mesh``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from recompute.checkpointing import applied_policy, apply, find_layers
from recompute.core.errors import ConfigError, first_line, positive_int, require
from recompute.core.plan_file import Traced
from recompute.core.policy import Policy
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec
from recompute.core.timing import StepWork, scale_work, work_list
from recompute.core.workload import AMP, Workload
from recompute.models.loss import LossFn, lm_loss
from recompute.models.source import BuiltModel, ModelSource, build_source, resolve_source
from recompute.parallel import mixed_dtype, parallelize, reduce_dtype, shard
from recompute.runtime import TORCH_DTYPES, autocast_dtype, random_batch
from recompute.trace._build import build_meta, fake_kernels, fakeify
from recompute.trace._cuda import cuda_rules, fake_device_note, stands_in, trace_device
from recompute.trace._kinds import Kinds, Run, layer_kinds, runs_of, short_model
from recompute.trace._mesh import fake_group, initialize_fsdp, meshes, rank_notes, world
from recompute.trace._result import PartTrace, TraceResult, from_record, part_trace
from recompute.trace._scale import cut_counts, grown, scale_runs, scaled_runs
from recompute.trace._step import StepRecord, prime_optimizer, record_saved, run_step

__all__ = ["step_needs", "step_record", "step_work", "step_works", "trace", "trace_layer", "trace_module"]


def trace(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    policy: Policy | str = "none",
    *,
    layers: int | None = None,
    hf: bool = False,
) -> TraceResult:
    """Trace one training step of ``model`` under ``wl`` with ``policy``, allocating nothing.

    Args:
        model: a ``ModelSpec`` (recompute's reference model, or Hugging Face's with ``hf=True``), a
            ``ModelSource`` or what ``--model`` takes (a preset, a transformers config.json, ``module:factory``):
            the class the source names is what runs.
        wl: batch, sequence, dtype (parameters, gradients and AdamW state all in it), attention and device.
        policy: a policy name, a ``Policy``, or a plan file path.
        layers: trace this many layers (and one more) and scale to all of them, run by run of alike layers where
            the layers differ (``_scale.py``; the result says so). ``None`` traces every layer. Not for a factory
            (it builds what it builds).
        hf: with a ``ModelSpec``, trace the ``transformers`` implementation of it instead of recompute's.

    Raises:
        ConfigError: the sequence is longer than the model's positions, the policy does not fit the model,
            the model cannot be built, or ``layers`` of a model whose layers differ in runs too short to
            scale.

    A CUDA step on a machine without CUDA is traced on fake CPU tensors under CUDA's rules (its dropout,
    attention and norm kernels, its 512-byte blocks: ``recompute.trace._cuda``). With ``wl.tp`` > 1 or
    ``wl.fsdp`` it is rank 0's step on a fake process group: recompute's tensor parallelism, or FSDP2 full shard
    over ``wl.dp`` ranks (``recompute.parallel.shard`` after the policy; the states as traced; ``layers`` >= 3).
    """
    source = _source_of(model, hf)
    _check_traceable(source, wl)
    pol = Policy.parse(policy)
    device = trace_device(wl.device)
    n_layers = source.n_layers or _count_layers(source, wl)
    per_layer = pol.per_layer(n_layers)
    start = time.perf_counter()
    kinds = None
    if layers is None or layers >= n_layers - 1:
        counts: tuple[int, ...] = (n_layers,)
        record, built, n_params = _trace_layers(
            source, wl, pol, n_layers, device=device, allocations=wl.device == "cuda" and not wl.fsdp
        )
    else:
        _check_scalable(source, pol, layers, fsdp=wl.fsdp)
        cut = _cut(source, wl, layers, n_layers)
        kinds = cut.kinds
        record, built, n_params, counts = _scaled(cut, source, wl, pol, layers, device=device)
    return from_record(
        record,
        model=source.name,
        policy=pol.describe(),
        per_layer=per_layer,
        workload=_workload_dict(wl),
        traced=counts,
        notes=_notes(source, built, wl, counts, n_layers, kinds, layers or 0),
        seconds=time.perf_counter() - start,
        parameter_count=n_params,
    )


def step_record(
    model: ModelSpec | ModelSource | str, wl: Workload, policy: Policy | str = "none", *, rank: int = 0
) -> StepRecord:
    """The tracker's raw record of ``trace``'s whole step (every layer traced, nothing scaled or repriced): each
    phase's peak, each layer's forward and backward apart, and the states as traced; of ``rank`` of the job's
    ranks with ``wl.tp`` > 1 or ``wl.fsdp`` (``trace`` reports rank 0). What a real rank's ``run_step`` is held to.

    Raises:
        ConfigError: as ``trace``, and a rank outside the job's.
    """
    source = _source_of(model, False)
    _check_traceable(source, wl)
    require(0 <= rank < world(wl), f"rank {rank} is not one of the job's {world(wl)} ranks (0 to {world(wl) - 1})")
    n = source.n_layers or _count_layers(source, wl)
    return _trace_layers(source, wl, Policy.parse(policy), n, device=trace_device(wl.device), rank=rank)[0]


def step_needs(model: ModelSpec | ModelSource | str) -> Callable[[Policy, Workload], Traced]:
    """What a policy's step of ``model`` needs of the device at a workload, traced whole: its peak and, on CUDA,
    what the caching allocator reserves over its steps (``TraceResult.reserved``): ``plan --trace``'s check."""

    def needs(policy: Policy, wl: Workload) -> Traced:
        r = trace(model, wl, policy)
        return Traced(float(r.peak), float(r.reserved) if r.reserved is not None else None)

    return needs


def step_work(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    policy: Policy | str = "none",
    *,
    layers: int | None = None,
    hf: bool = False,
) -> StepWork:
    """Every kernel of one training step of ``model`` under ``policy``, by phase: the trace's step of the real
    class with each op's FLOPs and bytes filed (``recompute.core.timing`` prices it on a device).

    ``layers``: trace this many layers and one more and scale (``scale_work``), as ``trace`` does; identical
    layers only (a preset). With ``wl.tp`` > 1 or ``wl.fsdp`` it is rank 0's step on a fake process group, every
    collective filed with the kernels (``recompute.core.comms``; FSDP2's on the ``dp`` dim, traced whole). A CUDA
    step on a machine without CUDA is traced on fake CPU tensors under CUDA's rules, with CUDA's kernels
    (``recompute.trace._cuda``).

    Raises:
        ConfigError: as ``trace``.
    """
    source = _source_of(model, hf)
    pol = Policy.parse(policy)
    with _work_tracer(source, wl) as (work_of, n):
        tokens = wl.micro_batch * wl.seq_len
        if layers is not None and layers < n - 1:
            _check_scalable(source, pol, layers)
            require(
                not wl.fsdp,
                f"the step's work of an FSDP2 rank is traced whole: its first and last layers run other collectives "
                f"than the rest, which scaling {layers} and {layers + 1} layers would copy; drop the layer count",
            )
            kinds = _cut(source, wl, layers, n).kinds
            require(
                kinds is None,
                f"the step's work scales a trace of {layers} and {layers + 1} identical layers, but {source.name}'s "
                f"layers differ ({kinds.describe() if kinds else ''}); trace every layer instead (no layer count)",
            )
            small, big = (work_of(pol, k) for k in (layers, layers + 1))
            return scale_work(StepWork(small, tokens), StepWork(big, tokens), layers, n)
        return StepWork(work_of(pol, n), tokens)


def step_works(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    policies: Sequence[str],
    *,
    progress: Progress = no_progress,
) -> dict[str, StepWork]:
    """``step_work`` of a model with identical layers (a preset) under each uniform policy, in fewer traces:
    ``none`` at one and two layers, scaled; every other policy at one layer, its layer's kernels repeated over
    the model's layers and the rest of the step (embedding, head, loss, optimizer) taken from ``none``'s.

    That shortcut holds where a policy changes only its layers' kernels and the first layer's are the others'
    (both checked on the traces); where either fails, the policy is traced at one and two layers and scaled.
    Under ``wl.fsdp`` every policy is traced whole (an FSDP2 rank's first and last layers differ).

    Raises:
        ConfigError: as ``trace``.
    """
    source = _source_of(model, False)
    pols = [Policy.parse(name) for name in policies]
    for pol in pols:
        _check_scalable(source, pol, 1)
    with _work_tracer(source, wl) as (work_of, n):
        tokens = wl.micro_batch * wl.seq_len
        if wl.fsdp:  # FSDP2's first and last layers run other collectives: every policy traced whole
            return {pol.name: StepWork(work_of(pol, n), tokens) for pol in pols}
        progress("trace none", 0, len(pols) + 1)
        small, big = work_of(Policy("none"), 1), work_of(Policy("none"), 2)
        base = scale_work(StepWork(small, tokens), StepWork(big, tokens), 1, n)
        alike = all(big[f"{s} of layer 0"] == big[f"{s} of layer 1"] for s in ("forward", "backward"))
        out = {}
        for i, pol in enumerate(pols):
            progress(f"trace {pol.name}", i + 1, len(pols) + 1)
            if pol.name == "none" or n < 2:
                out[pol.name] = base if pol.name == "none" else StepWork(work_of(pol, n), tokens)
                continue
            one = work_of(pol, 1)
            if alike and all(ops == small.get(name) for name, ops in one.items() if "of layer" not in name):
                layer = {s: one[f"{s} of layer 0"] for s in ("forward", "backward")}
                phases = {
                    name: layer[name.split(" of layer ")[0]] if " of layer " in name else ops
                    for name, ops in base.phases.items()
                }
                out[pol.name] = StepWork(phases, tokens)
            else:
                out[pol.name] = scale_work(StepWork(one, tokens), StepWork(work_of(pol, 2), tokens), 1, n)
        progress("done", len(pols) + 1, len(pols) + 1)
        return out


@contextlib.contextmanager
def _work_tracer(
    source: ModelSource, wl: Workload
) -> Iterator[tuple[Callable[[Policy, int], dict[str, tuple[Any, ...]]], int]]:
    """A function tracing the step's work of the model at ``n`` layers under a policy, and the model's layer
    count (a CUDA step without CUDA under CUDA's rules: ``step_built``); with ``wl.tp`` > 1 or ``wl.fsdp``, rank 0
    of a fake process group, its collectives filed with its kernels."""
    # One rank of one micro-batch's whole model: the pipeline and data parallelism lay it out (recompute.core.pricing);
    # FSDP2's rank is traced, its all-gathers and reduce-scatters filed on the dp dim
    wl = dataclasses.replace(wl, pp=1, interleave=1, n_microbatches=None, dp=wl.dp if wl.fsdp else 1)
    _check_traceable(source, wl)
    device = trace_device(wl.device)
    n = source.n_layers or _count_layers(source, wl)

    def work_of(pol: Policy, k: int) -> dict[str, tuple[Any, ...]]:
        return _work(source, wl, pol, k, device)

    with fake_group(wl):
        yield work_of, n


def _work(source: ModelSource, wl: Workload, pol: Policy, n: int, device: str) -> dict[str, tuple[Any, ...]]:
    with fake_kernels():
        built = build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], n_layers=n)
        record, _, _ = step_built(built, wl, pol, device=device, flops=True)
    ordered = sorted(record.work.items(), key=lambda kv: kv[0].order())
    return {str(ph): work_list(w) for ph, w in ordered}


def _source_of(model: ModelSpec | ModelSource | str, hf: bool) -> ModelSource:
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, ModelSpec):
        return ModelSource.preset(model, hf=hf)
    return resolve_source(model)


def _check_traceable(source: ModelSource, wl: Workload) -> None:
    require(
        wl.pp == 1,
        "trace runs one tensor-parallel rank of one pipeline stage's model; drop pp "
        "(recompute estimate models pipeline parallelism)",
        fields=("pp",),
    )  # a data-parallel rank runs the same step: dp only shards a distributed optimizer's state
    require(
        wl.tp == 1 or not wl.fsdp,
        f"trace runs one rank of tensor parallelism or of FSDP2, not both (FSDP2 over TP joins their meshes, which "
        f"the fake process group cannot); drop tp {wl.tp} or fsdp",
        fields=("tp", "fsdp"),
    )
    require(
        wl.ep == 1 and wl.capacity_factor == 1.0,
        "trace runs transformers' experts on one rank, where every routed token copy is computed whatever the "
        "routing; drop ep and capacity_factor (recompute estimate models expert parallelism)",
        fields=("ep", "capacity_factor"),
    )
    if source.spec is not None and not source.hf:
        wl.check(source.spec)
        return
    if source.spec is not None:
        wl.check(source.spec)
    require(
        wl.tp == 1,
        f"tp {wl.tp} traces recompute's reference GPT/Llama (recompute.parallel); drop tp or use a preset",
        fields=("tp",),
    )
    limit = source.max_positions
    require(
        limit is None or wl.seq_len <= limit,
        f"seq_len {wl.seq_len} exceeds {source.name}'s {limit} positions; use seq_len <= {limit}",
        fields=("seq_len",),
    )


def _check_scalable(source: ModelSource, pol: Policy, layers: int, *, fsdp: bool = False) -> None:
    # Note: [prose, not fields] these messages say "layers" as a word, so they name no field for the CLI to
    # turn into its option; they say what to do in words.
    positive_int("layers", layers)
    scaling = f"scaling a trace of {layers} and {layers + 1} layers"
    require(
        pol.is_uniform,
        f"{scaling} needs the same policy in every layer, but it differs by layer ({pol.describe()}); "
        "trace every layer instead (no layer count)",
    )
    require(
        source.factory is None,
        f"{scaling} rebuilds the model with fewer layers, which a factory ({source.origin}) cannot; "
        "trace every layer instead (no layer count)",
    )
    require(
        layers >= 2 or "offload" not in pol.per_layer(layers),
        f"{scaling} misses offload's largest backward (layer 1's: it holds layer 0's copies too); "
        "trace at least 2 layers, or every layer (no layer count)",
    )
    require(
        layers >= 3 or not fsdp,
        f"{scaling} misses an FSDP2 rank's largest backward (its first two and last two layers hold other "
        "collective buffers than the rest); trace at least 3 layers, or every layer (no layer count)",
    )


def _count_layers(source: ModelSource, wl: Workload) -> int:
    """The transformer layer count of a source that does not state it: build it on the meta device and look."""
    built = build_source(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], device="meta")
    return len(find_layers(built.model))


def _trace_layers(
    source: ModelSource,
    wl: Workload,
    pol: Policy,
    n: int,
    *,
    device: str,
    build: Callable[[], BuiltModel] | None = None,
    allocations: bool = False,
    rank: int = 0,
) -> tuple[StepRecord, BuiltModel, int]:
    """One fake step of ``source`` cut to ``n`` layers (of ``rank``, with ``wl.tp`` > 1 or ``wl.fsdp``), and its
    parameter count; ``build`` makes the model instead (a short model of some of its layers); ``allocations``:
    record the step's allocation stream."""
    with fake_group(wl, rank), fake_kernels():
        if wl.tp > 1:
            # Note: [DTensor's first call] the first time DTensor meets an op and its shardings it works out
            # the output by running the op on whole-size tensors, which the tracker would count as memory (2 GiB
            # in the head's backward of Llama 3.1 8B at t = 8). A one-layer step per policy fills that cache.
            for name in dict.fromkeys(pol.per_layer(n)):
                _step(source, wl, Policy(name), 1, device=device)
        built = (
            build()
            if build is not None
            else build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], n_layers=n)
        )
        return step_built(built, wl, pol, device=device, allocations=allocations)


@dataclass(frozen=True)
class _Cut:
    """How a scaled trace cuts the model: its runs of alike layers, and a builder of it with fewer layers per run."""

    runs: tuple[Run, ...]
    build: Callable[[tuple[int, ...]], BuiltModel]
    """The model with ``counts[i]`` layers of run ``i``, on the meta device."""
    kinds: Kinds | None = None
    """The kinds of layer, where they differ (None: every layer alike)."""


def _cut(source: ModelSource, wl: Workload, k: int, n: int) -> _Cut:
    """The runs of alike layers of ``source`` (a config's built whole on the meta device and compared layer by
    layer, ``_kinds.layer_kinds``; a preset's layers are alike by construction).

    Raises:
        ConfigError: the layers differ and no run is longer than ``k + 1``, or so many runs are (Gemma 3's five
            sliding-window layers per global one) that scaling would trace over twice the model's layers.
    """
    dtype = TORCH_DTYPES[wl.param_dtype]

    def rebuilt(counts: tuple[int, ...]) -> BuiltModel:
        return build_meta(source, attention=wl.attention, dtype=dtype, n_layers=sum(counts))

    alike = _Cut((Run(0, 0, n),), rebuilt)
    if source.config is None:
        return alike
    whole = build_meta(source, attention=wl.attention, dtype=dtype)
    layers = find_layers(whole.model)
    kinds = layer_kinds(whole.model, layers)
    if len(kinds.reps) == 1:
        return alike
    runs = runs_of(kinds.kind_of)
    long = scaled_runs(runs, k)
    scaling = (
        f"scaling a trace of {k} and {k + 1} layers scales runs of alike layers, but {source.name}'s layers differ"
    )
    require(
        bool(long),
        f"{scaling} and no run is longer than {k + 1} ({kinds.describe()}); trace every layer instead (no layer count)",
    )
    total = sum(cut_counts(runs, k)) * (len(long) + 1) + len(long)
    require(
        total <= 2 * n,
        f"{scaling} in {len(runs)} runs ({kinds.describe()}): scaling would trace {total} layers, more than twice "
        f"the model's {n}; trace every layer instead (no layer count)",
    )

    def picked(counts: tuple[int, ...]) -> BuiltModel:
        picks = [run.start + j for run, c in zip(runs, counts) for j in range(c)]
        return short_model(whole, layers, picks)

    return _Cut(runs, picked, kinds)


def _scaled(
    cut: _Cut, source: ModelSource, wl: Workload, pol: Policy, k: int, *, device: str
) -> tuple[StepRecord, BuiltModel, int, tuple[int, ...]]:
    """The whole model's record from traces of it cut (``_scale.scale_runs``), a model built, its parameter
    count and the layer counts traced."""
    long = scaled_runs(cut.runs, k)
    shapes = [cut_counts(cut.runs, k), *(cut_counts(cut.runs, k, i) for i in long)]
    traced = [
        _trace_layers(source, wl, pol, sum(counts), device=device, build=functools.partial(cut.build, counts))
        for counts in shapes
    ]
    (base, built, p_base), bigs = traced[0], dict(zip(long, traced[1:]))
    record = scale_runs(base, {i: big[0] for i, big in bigs.items()}, cut.runs, k, fsdp=wl.fsdp)
    n_params = grown(p_base, {i: big[2] for i, big in bigs.items()}, cut.runs, k)
    return record, built, n_params, tuple(sum(counts) for counts in shapes)


def _step(source: ModelSource, wl: Workload, pol: Policy, n: int, *, device: str) -> tuple[StepRecord, BuiltModel, int]:
    built = build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], n_layers=n)
    return step_built(built, wl, pol, device=device)


def step_built(
    built: BuiltModel,
    wl: Workload,
    pol: Policy,
    *,
    device: str,
    flops: bool = False,
    foreach: bool | None = None,
    step: bool = True,
    owners: bool = False,
    flop_layers: Collection[int] | None = None,
    allocations: bool = False,
) -> tuple[StepRecord, BuiltModel, int]:
    """One fake step of a model built on the meta device (made fake here, in place), and its parameter count.

    ``device``: where the fake tensors live (``trace_device``); a CUDA workload on CPU tensors runs under CUDA's
    rules (``recompute.trace._cuda``). ``foreach``: AdamW's implementation (None: PyTorch's default for the
    workload's device); ``step``: run its step; ``owners``: record ``StepRecord.layer_left`` and
    ``phase_shared``; ``flop_layers``, ``allocations``: as ``run_step``'s."""
    cuda = stands_in(wl.device, device)
    if foreach is None and cuda:
        foreach = True  # AdamW's multi-tensor kernels: PyTorch's default on CUDA
    with cuda_rules() if cuda else contextlib.nullcontext():
        stack, mode = _prepare(built, wl, pol, device=device)
        model = built.model
        n_params = sum(p.numel() for p in model.parameters())  # each parameter once, tied ones too
        with mode:
            optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach)
            prime_optimizer(model, optimizer)
            batch = random_batch(built.vocab, wl.micro_batch, wl.seq_len, device=device)
            try:
                record = run_step(
                    model,
                    batch,
                    optimizer,
                    stack,
                    loss_fn=built.loss_fn,
                    keep_grads=wl.keep_grads,
                    flops=flops,
                    step=step,
                    owners=owners,
                    flop_layers=flop_layers,
                    cuda=cuda,
                    allocations=allocations,
                    autocast=autocast_dtype(wl),
                )
            except (DataDependentOutputException, DynamicOutputShapeException) as e:
                # Note: [values decide sizes] a forward that reads a tensor's values (``.item()``, ``nonzero``)
                # to size what it allocates cannot run on fake tensors; no figure for a step not traced as it runs.
                raise ConfigError(
                    f"{built.class_name}'s step reads tensor values to decide its sizes ({type(e).__name__}: "
                    f"{first_line(e)}), which a trace on fake tensors cannot follow; measure it with "
                    "`recompute bench` (real steps) instead"
                ) from e
    return record, built, n_params


def _fake_model(
    source: ModelSource, wl: Workload, pol: Policy, n: int, *, device: str
) -> tuple[BuiltModel, nn.ModuleList, FakeTensorMode]:
    """``source`` cut to ``n`` layers, built with fake parameters, in training mode, with ``pol`` applied."""
    built = build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype], n_layers=n)
    stack, mode = _prepare(built, wl, pol, device=device)
    return built, stack, mode


def _prepare(built: BuiltModel, wl: Workload, pol: Policy, *, device: str) -> tuple[nn.ModuleList, FakeTensorMode]:
    """Make a meta-built model fake, in training mode, with ``pol`` applied (and the chunked loss, when ``wl.loss``
    says so), as rank 0 of ``wl``'s job (inside ``fake_group``), in torchtitan's order: tensor parallelism
    (``wl.tp``), the policy, then FSDP2 (``wl.fsdp``: ``recompute.parallel.shard``)."""
    model = built.model
    mode = FakeTensorMode()
    fakeify(model, mode, device)
    tp_mesh, dp_mesh = meshes(wl, device)  # outside the fake mode
    if tp_mesh is not None:
        with mode:
            parallelize(model, tp_mesh, sp=wl.sp)
    model.train()
    apply(model, pol, loss=wl.loss, loss_chunk=wl.loss_chunk)
    if dp_mesh is not None:
        with mode:
            shard(model, dp_mesh, mp_dtype=mixed_dtype(wl), reduce=reduce_dtype(wl))
            initialize_fsdp(model)
    return find_layers(model), mode


def trace_layer(spec: ModelSpec, wl: Workload, policy: Policy | str = "none", *, hf: bool = False) -> PartTrace:
    """What one layer saves for the backward under a uniform ``policy``: a fake forward of two layers.

    The second layer is returned (the first also saves tensors the layers share, such as rotary tables).
    Faster than ``trace`` (no backward, no optimizer); the bytes are the same, the ops are not named.

    Raises:
        ConfigError: as ``trace``, and for a policy that is not the same in every layer.
    """
    source = ModelSource.preset(spec, hf=hf)
    _check_traceable(source, wl)
    pol = Policy.parse(policy)
    require(pol.is_uniform, f"trace_layer needs one policy for every layer, got {pol.describe()}")
    device = trace_device(wl.device)
    cuda = stands_in(wl.device, device)
    with fake_group(wl), cuda_rules() if cuda else contextlib.nullcontext():
        built, stack, mode = _fake_model(source, wl, pol, 2, device=device)
        with mode:
            saved = record_saved(
                built.model,
                random_batch(built.vocab, wl.micro_batch, wl.seq_len, device=device),
                stack,
                loss_fn=built.loss_fn,
                cuda=cuda,
                autocast=autocast_dtype(wl),
            )
    return part_trace("layer 1", [r for r in saved if r.layer == 1])


def trace_module(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn = lm_loss,
    name: str = "model",
    keep_grads: bool = False,
    autocast: torch.dtype | None = None,
) -> TraceResult:
    """Trace one step of an existing module (real or fake tensors) with whatever policy it has applied.

    ``batch`` is (token ids, targets); ``loss_fn(model, idx, targets) -> (kept outputs, loss)``. Creates an
    AdamW optimizer when none is given, and primes it (see ``_step``'s note on the steady state). ``autocast``:
    the forward and loss under ``torch.autocast`` to this dtype (``precision`` amp).
    """
    stack = find_layers(model)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
        prime_optimizer(model, optimizer)
    start = time.perf_counter()
    cuda = batch[0].device.type == "cuda"
    record = run_step(
        model, batch, optimizer, stack, loss_fn=loss_fn, keep_grads=keep_grads, allocations=cuda, autocast=autocast
    )
    pol = applied_policy(model) or Policy("none")
    idx = batch[0]
    return from_record(
        record,
        model=name,
        policy=pol.describe(),
        per_layer=pol.per_layer(len(stack)),
        workload={"micro_batch": idx.size(0), "seq_len": idx.size(1), "device": idx.device.type},
        traced=(len(stack),),
        seconds=time.perf_counter() - start,
        parameter_count=sum(p.numel() for p in model.parameters()),
    )


def _workload_dict(wl: Workload) -> dict[str, Any]:
    keys = ("micro_batch", "seq_len", "dtype", "attention", "device", "tp", "sp", "keep_grads", "loss", "loss_chunk")
    states = ("precision", "dp", "fsdp")  # priced for them (``recompute.core.states``), but under fsdp: traced
    return {k: getattr(wl, k) for k in (*keys, *states)}


def _autocast_rules(wl: Workload) -> str:
    """Whose autocast policy the trace ran, when it is not the device's own (a CUDA step on CPU tensors)."""
    return " (CUDA's autocast policy on the CPU tensors)" if stands_in(wl.device, trace_device(wl.device)) else ""


def _notes(
    source: ModelSource,
    built: BuiltModel,
    wl: Workload,
    counts: tuple[int, ...],
    n: int,
    kinds: Kinds | None = None,
    k: int = 0,
) -> tuple[str, ...]:
    notes = [
        f"traced {built.class_name} built from {source.origin} {fake_device_note(wl.device)}: "
        "exact sizes, nothing allocated",
        *built.notes,
        "steady-state step: AdamW state exists, gradients "
        + ("stay allocated (zero_grad(set_to_none=False))" if wl.keep_grads else "start as None (zero_grad())")
        + f"; traced with parameters, gradients and AdamW state in {wl.param_dtype}"
        + (f"; forward and loss under {wl.dtype} autocast{_autocast_rules(wl)}" if wl.precision == AMP else ""),
    ]
    notes += rank_notes(wl)
    if len(counts) == 2 and kinds is None:
        notes.append(
            f"layers are identical: traced {counts[0]} and {counts[1]} layers and scaled every figure to "
            f"{n} (exact for identical layers)"
        )
    elif kinds is not None:
        notes.append(
            f"layers differ ({kinds.describe()}): traced {', '.join(map(str, counts[:-1]))} and {counts[-1]} "
            f"layers, every run of more than {k + 1} alike layers cut to {k} (and one run at a time to {k + 1}), "
            f"and scaled every figure to {n} (exact: every figure is affine in each run's length)"
        )
    return tuple(notes)
