"""The training loop: AdamW, warm-up + cosine, metrics per step, checkpoints, exact resume, a sample.

Everything random is reproducible from the seed: weights (``torch.manual_seed`` before building), the data
order (a pure function of seed and step, see ``TokenStream``) and dropout (the global RNG, whose state every
checkpoint saves). Recomputation replays dropout masks (``preserve_rng_state``), so runs under any policy
produce the same losses.

The model is the class ``--model`` names (``recompute.models.source``): a preset's reference GPT-2 or Llama
(``hf:NAME``: transformers' class of that shape), resized by ``--layers/--hidden/--heads`` and given the
tokenizer's vocabulary; or, built as it is, the class ``AutoModelForCausalLM.from_config`` makes for a
transformers config.json, or a factory's module. Its loss convention is ``BuiltModel.loss_fn``. Checkpoints
record the source (``source_id``: the config's content hash) and a resume with another one is refused.

Under torchrun (``--tp``/``--dp``, see ``distributed``) every rank builds the model from the same seed, then
``recompute.parallel.parallelize`` (tensor and sequence parallel, FSDP2 over dp), then ``recompute.apply``,
then the optimizer. Each rank draws its own dropout masks, so losses equal a single process's at dropout 0
only. Rank 0 alone prints and writes ``metrics.jsonl`` and ``sample.txt``; every rank writes its checkpoint
shards.

Over 400 lines because a reproducible run is one loop: its checkpoints, exact resume, metrics and sample share the
loop's state; data, configuration, run files and preflight live beside it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from recompute.checkpointing import applied_policy, apply
from recompute.core.errors import ConfigError, require
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec, hf_config_dict
from recompute.core.table import mib
from recompute.core.workload import parallel_sizes
from recompute.models.loss import LossFn
from recompute.models.source import BuiltModel, ModelSource, build_source, resolve_source
from recompute.parallel import parallelize
from recompute.runtime import autocast_dtype, forward_autocast
from recompute.train.checkpoint import load_latest, save_checkpoint
from recompute.train.config import TrainConfig, flag
from recompute.train.data import Tokenizer, TokenStream, load_text, make_tokenizer
from recompute.train.distributed import Ranks, start
from recompute.train.preflight import check_train_memory, preset_need, source_need
from recompute.train.run_files import (
    METRICS,
    SAMPLE,
    append_metrics,
    atomic_write,
    check_out,
    damaged_metrics,
    drop_aside,
    restore_aside,
    set_aside,
    write_metrics,
)

__all__ = ["RunResult", "StepMetrics", "build_spec", "lr_at", "source_id", "train", "train_source"]


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step."""

    step: int
    loss: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    peak_bytes: int | None
    """Peak memory of the step: the CUDA allocator's on a GPU; MemTracker's on the CPU (first step only)."""


@dataclass
class RunResult:
    """What a run produced: its metrics, where it wrote them, and the sample."""

    config: TrainConfig
    spec: ModelSpec | None
    """The preset's spec as trained (resized, the tokenizer's vocabulary); ``None`` for a config or factory."""
    metrics: list[StepMetrics] = field(default_factory=list)
    sample: str = ""
    resumed_from: int = 0
    rank: int = 0
    """This process's rank under torchrun (0 alone prints and writes the run's files)."""
    name: str = ""
    """The model's name: the preset, the config file's stem or folder, or ``module:factory``."""
    built: str = ""
    """The class built and its source: ``transformers.MixtralForCausalLM built from mixtral/config.json``."""

    @property
    def losses(self) -> list[float]:
        return [m.loss for m in self.metrics]

    @property
    def peak_bytes(self) -> int | None:
        peaks = [m.peak_bytes for m in self.metrics if m.peak_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def median_step_time(self) -> float:
        """Median step time after two warm-up steps (the first also ran under MemTracker on the CPU)."""
        times = sorted(m.step_time_s for m in self.metrics[2:]) or sorted(m.step_time_s for m in self.metrics)
        return times[len(times) // 2]


def train_source(config: TrainConfig) -> ModelSource:
    """What ``--model`` names (before the tokenizer is known): a preset, a config.json or a factory.

    Raises:
        ConfigError: an unknown model; for a config or factory, a size or dropout option (it is built as it is)
            or ``--tp/--dp`` (``recompute.parallel`` splits recompute's reference models).
    """
    source = resolve_source(config.model)
    if source.spec is not None and not source.hf:
        return source
    if source.spec is None:
        default = TrainConfig()
        sizes = ("n_layers", "hidden", "n_heads", "dropout")
        given = [n for n in sizes if getattr(config, n) not in (None, 0, getattr(default, n))]
        if given:
            raise ConfigError(
                f"{flag(given[0])} resizes presets; {config.model} is trained as it is: edit its config (or factory)"
            )
    shown, fields = parallel_sizes(config.workload, ("tp", "dp"))
    require(
        not config.parallel,
        f"{shown} train recompute's reference GPT/Llama (recompute.parallel), not {source.origin}; drop {shown}, "
        "or train a preset",
        fields=fields,
    )
    return source


def source_id(source: ModelSource, config: TrainConfig) -> str:
    """What a checkpoint records of the model's source, so that a resume with another one is refused.

    A preset: its name (the sizes are options, checked with the others). A config.json: a hash of its content
    (keys sorted; SHA-256, 16 hex digits), so the same path with an edited config is another model. A factory:
    its name and a hash of its parameters' names, shapes and dtypes.
    """
    if source.spec is not None:
        return f"{'hf:' if source.hf else ''}{source.spec.name}"
    if source.config is not None:
        text = json.dumps(hf_config_dict(config.model), sort_keys=True)
        return f"config sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    model = build_source(source, device="meta").model
    shapes = json.dumps([(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()])
    return f"factory {source.name} sha256:{hashlib.sha256(shapes.encode()).hexdigest()[:16]}"


def build_spec(config: TrainConfig, vocab: int) -> ModelSpec:
    """The preset with the size overrides and the tokenizer's vocabulary."""
    dropout = {} if config.dropout is None else {"dropout": config.dropout}
    source = resolve_source(config.model)
    assert source.spec is not None, "build_spec takes presets; train_source says what else --model names"
    preset = ModelSpec.from_name(source.spec.name, **dropout)
    sizes = {"n_layers": config.n_layers, "hidden": config.hidden, "n_heads": config.n_heads}
    spec = preset.resized(**{k: v or None for k, v in sizes.items()}, vocab=vocab)  # 0 keeps the preset's
    require(
        config.seq_len <= spec.max_positions,
        f"--seq-len {config.seq_len} exceeds the model's {spec.max_positions} positions",
    )
    return spec


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to lr/10 at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _device(config: TrainConfig) -> torch.device:
    if config.workload.device == "cuda":
        require(torch.cuda.is_available(), "--device cuda was asked for but CUDA is not available; use --device cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def _autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast over the fp32 weights for ``--dtype bf16`` (the amp precision); nothing for fp32."""
    return forward_autocast(autocast_dtype(config.workload), device)


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


class _Peak:
    """The peak bytes of one step: the CUDA allocator's, or MemTracker's on the CPU (``None`` when off)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, on: bool) -> None:
        self.device = device
        self.bytes: int | None = None
        self._tracker: Any = None
        if device.type == "cpu" and on:
            from torch.distributed._tools.mem_tracker import MemTracker

            self._tracker = MemTracker()
            self._tracker.track_external(model, opt)

    def __enter__(self) -> _Peak:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self._tracker is not None:
            self._tracker.__enter__()
        return self

    def next_micro_batch(self) -> None:
        """MemTracker follows one forward/backward per module: reset its module stats (the peak stays)."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.bytes = int(torch.cuda.max_memory_allocated())
        elif self._tracker is not None:
            self._tracker.__exit__(*exc)
            self.bytes = int(self._tracker.get_tracker_snapshot("peak")[self.device]["Total"])


def _step(
    model: nn.Module,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    stream: TokenStream,
    step: int,
    config: TrainConfig,
    peak: _Peak,
    ranks: Ranks,
) -> float:
    """One optimizer step; returns this rank's loss (mean over its micro-batches)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, config)
    device, total = peak.device, 0.0
    for micro in range(config.grad_accum):
        if micro:
            peak.next_micro_batch()
        rows = config.micro_batch * config.dp  # the micro-batch of every data-parallel rank, in one data order
        x, y = stream.batch(step=step, micro=micro, micro_batch=rows, seq_len=config.seq_len, seed=config.seed)
        x, y = ranks.share(x), ranks.share(y)  # this data-parallel rank's rows
        with _autocast(config, device):
            _, loss = loss_fn(model, x.to(device), y.to(device))
        (loss / config.grad_accum).backward()
        total += loss.item() / config.grad_accum
    if config.grad_clip:
        _clip_grad_norm(model, config.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _clip_grad_norm(model: nn.Module, max_norm: float) -> None:
    """``clip_grad_norm_``, with a DTensor norm (tensor parallel, FSDP2) made whole first, as torchtitan does."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)


def _label(m: StepMetrics) -> str:
    peak = f" peak {mib(m.peak_bytes, digits=0)}" if m.peak_bytes else ""
    return f"loss {m.loss:.4f} {m.tokens_per_s:,.0f} tok/s{peak}"


def _say(text: str) -> None:
    """Print ``text`` on stderr; when the reader has gone (``2>&1 | head``), drop it and train on.

    A closed pipe must not end the run before its last checkpoint: the descriptor is pointed at /dev/null (as
    ``cli.main_exit`` does for stdout), so this line, later ones and the flush at exit go nowhere.
    """
    try:
        print(text, file=sys.stderr, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def train(
    config: TrainConfig, *, on_step: Callable[[int], None] | None = None, progress: Progress = no_progress
) -> RunResult:
    """Train per ``config``; returns the metrics. ``on_step(step)`` runs after each step's checkpoint;
    ``progress(label, step, steps)`` after each step on rank 0 (the label holds the loss and tokens/s).

    With ``config.tp * config.dp > 1`` run it in every process torchrun starts: it starts the process group
    unless one is running (``distributed.start``), and every rank returns the same losses.

    Raises:
        ConfigError: an ``--out`` that holds a run, without --resume or --overwrite (before any work); bad
            data, a sequence longer than the model's positions, or a --resume without a checkpoint that
            verifies (never a silent restart from scratch); with --tp/--dp, not under torchrun with t * d
            processes, or t not dividing the heads (and the sequence, with --sp).
    """
    check_out(config)  # before any work: never mix this run's files with an earlier run's
    source = train_source(config)
    device = _device(config)
    text = load_text(config.data, config.dataset, seed=config.seed)
    tok = make_tokenizer(config.tokenizer, text)
    stream = TokenStream(torch.tensor(tok.encode(text), dtype=torch.long))
    spec = build_spec(config, tok.vocab_size) if source.spec is not None else None
    if spec is not None:
        source = ModelSource.preset(spec, hf=source.hf)
    ranks = start(config, spec) if spec is not None else Ranks()
    _check_memory(source, spec, config, device)
    torch.manual_seed(config.seed)  # the same weights, and dropout generator, on every rank
    built = _build(source, config, tok.vocab_size, device)
    model = built.model
    if ranks.mesh is not None:
        parallelize(model, ranks.mesh, sp=config.workload.sp)
    apply(model, config.policy, loss=config.workload.loss, loss_chunk=config.workload.loss_chunk)
    opt = _optimizer(model, config)
    result = RunResult(
        config=config,
        spec=spec,
        rank=ranks.rank,
        name=source.name,
        built=f"{built.class_name} built from {source.origin}",
    )
    _run(
        model,
        built.loss_fn,
        opt,
        stream,
        config,
        result,
        ranks,
        device,
        source=source_id(source, config),
        on_step=on_step,
        progress=progress if ranks.main else no_progress,
    )
    if config.workload.loss == "chunked":
        # a forward with targets (a factory's, in sample) returns no logits when chunked: the policy alone, full loss
        apply(model, applied_policy(model) or "none", loss="full")
    result.sample = sample(model, tok, config, device, hf=built.hf)
    if ranks.main:
        atomic_write(Path(config.out) / SAMPLE, lambda f: f.write((result.sample + "\n").encode()))
    ranks.wait_for_all()
    return result


def _check_memory(source: ModelSource, spec: ModelSpec | None, config: TrainConfig, device: torch.device) -> None:
    """The memory preflight (``preflight``): a preset by the analytic model, anything else by its parameters
    (counted on the meta device) and logits."""
    need: Callable[[int, int], float]
    if spec is not None:
        need = functools.partial(preset_need, spec, config, device.type)
    else:
        meta = build_source(source, attention=config.workload.attention, device="meta")
        need = functools.partial(source_need, meta.model, meta.vocab)
    check_train_memory(lambda b, s: need(micro_batch=b, seq_len=s), config, device.type)


def _build(source: ModelSource, config: TrainConfig, vocab: int, device: torch.device) -> BuiltModel:
    """``source`` built on ``device`` (random weights from the seed already set); its vocabulary checked.

    Raises:
        ConfigError: the sequence is longer than the model's positions, or its vocabulary is smaller than the
            tokenizer's.
    """
    limit = source.max_positions
    require(
        limit is None or config.seq_len <= limit,
        f"--seq-len {config.seq_len} exceeds the model's {limit} positions",
    )
    built = build_source(source, attention=config.workload.attention, device=device)
    require(
        built.vocab >= vocab,
        f"the {config.tokenizer} tokenizer makes ids below {vocab} but {source.origin} has a vocabulary of "
        f"{built.vocab}; give the model a vocab_size of {vocab} or more",
    )
    return built


def _run(
    model: nn.Module,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    stream: TokenStream,
    config: TrainConfig,
    result: RunResult,
    ranks: Ranks,
    device: torch.device,
    *,
    source: str,
    on_step: Callable[[int], None] | None,
    progress: Progress,
) -> None:
    """The steps from the newest checkpoint (with --resume) or from 0; fills ``result.metrics``.

    With --overwrite the earlier run is set aside before the first step and deleted once the first checkpoint
    is written; a run that fails before that puts it back (Note: [overwrite] in ``run_files``).
    """
    out = Path(config.out)
    first = 0
    if config.resume:
        first = _resume(out, config, model, opt, result, ranks, source)
    out.mkdir(parents=True, exist_ok=True)
    aside = set_aside(out) if config.overwrite and ranks.main else None
    ranks.wait_for_all()  # no rank writes into --out before the earlier run is out of the way
    model.train()
    try:
        for step in range(first, config.steps):
            t0 = time.perf_counter()
            with _Peak(model, opt, device, on=step == 0) as peak:
                loss = ranks.mean(_step(model, loss_fn, opt, stream, step, config, peak, ranks))
            dt = time.perf_counter() - t0
            m = StepMetrics(step, loss, lr_at(step, config), dt, config.tokens_per_step / dt, peak.bytes)
            require(math.isfinite(loss), f"the loss became {loss} at step {step}; lower --lr")
            result.metrics.append(m)
            if ranks.main:
                append_metrics(out / METRICS, m.__dict__)
            progress(_label(m), step + 1, config.steps)
            done = step + 1
            if done == config.steps or (config.checkpoint_every and done % config.checkpoint_every == 0):
                save_checkpoint(out, done, config, model, opt, [x.__dict__ for x in result.metrics], source=source)
                if aside is not None:
                    drop_aside(aside)  # the new run has a checkpoint: the earlier one can go
                    aside = None
            if on_step is not None:
                on_step(step)
    except BaseException:
        if aside is not None:
            restore_aside(out, aside)
        raise


def _resume(
    out: Path,
    config: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    result: RunResult,
    ranks: Ranks,
    source: str,
) -> int:
    """Restore the newest checkpoint that verifies; returns its step. Says on stderr which ones it passed over."""
    resumed = load_latest(out, config, model, opt, source=source)
    result.metrics, result.resumed_from = [StepMetrics(**m) for m in resumed.metrics], resumed.step
    if ranks.main:
        for line in resumed.passed_over:
            _say(f"recompute train: {line}; resuming from the older {str(resumed.path)!r} instead")
        for line in damaged_metrics(out / METRICS)[:3]:
            _say(f"recompute train: {str(out / METRICS)!r} {line}; rewritten from {str(resumed.path)!r}")
        write_metrics(out / METRICS, resumed.metrics)  # Note: [appending metrics] in run_files
    return resumed.step


@torch.no_grad()
def sample(
    model: nn.Module,
    tok: Tokenizer,
    config: TrainConfig,
    device: torch.device,
    prompt: str = "Once upon a time",
    *,
    hf: bool = False,
) -> str:
    """Generate ``config.sample_tokens`` tokens after ``prompt`` (temperature 0.8, top-40, seeded).

    ``hf``: ``model`` is a transformers causal LM (``model(input_ids=...).logits``).
    """
    was_training = model.training
    model.eval()
    g = torch.Generator(device=device).manual_seed(config.seed)
    ids = torch.tensor([tok.encode(prompt)], dtype=torch.long, device=device)
    for _ in range(config.sample_tokens):
        window = ids[:, -config.seq_len :]
        if hf:
            logits = model(input_ids=window, use_cache=False).logits[:, -1, :]
        else:
            logits = _last_logits(model, window, multiple=config.tp if config.workload.sp else 1)
        logits = logits.float() / 0.8  # (1, v)
        top = torch.topk(logits, min(40, logits.size(-1)))
        probs = torch.softmax(top.values, dim=-1)
        choice = top.indices.gather(-1, torch.multinomial(probs, 1, generator=g))
        ids = torch.cat([ids, choice], dim=1)
    model.train(was_training)
    return tok.decode(ids[0].tolist())


def _last_logits(model: nn.Module, ids: Tensor, *, multiple: int) -> Tensor:
    """The logits (b, v) after the last of ``ids`` (b, s), on every rank.

    With sequence parallelism the length must be a multiple of t: pad on the right, which the causal mask
    hides from the positions before. Vocabulary-parallel logits (a DTensor) are gathered.
    """
    s = ids.size(1)
    padded = F.pad(ids, (0, -s % multiple))
    logits, _ = model(padded) if hasattr(model, "spec") else model(padded, padded)  # a factory takes targets
    last = logits[:, s - 1, :]  # (b, v)
    return last.full_tensor() if isinstance(last, DTensor) else last
