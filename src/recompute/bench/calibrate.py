"""``calibrate``: measure the local device's rate curves for the time model (``recompute.core.timing``).

Each curve is measured at several sizes, because eager PyTorch reaches a device's peak only on large ops:

- matmul, per dtype: square products n x n x n (2n^3 FLOPs);
- attention, per dtype: ``scaled_dot_product_attention`` forward and backward together, FLOPs by PyTorch's
  own formulas (the ones the trace counts);
- memory: ``add(a, b, out=c)`` (bytes = 2 read + 1 written); math: the mean time per byte of ``exp``,
  tanh-GELU, SiLU and a last-dimension softmax (bytes = read + written);
- named element-wise ops (``ELEMENTWISE``: GELU and its backward, softmax, layer norm, dropout's random draw,
  ...), each on its own, bytes counted as the trace counts them: on a CPU an erf or a random number per
  element costs ten times an add, and these are what a replay repeats;
- overhead: the host's time per bare kernel launch (a tiny op in a loop);
- host: the host's time per kernel of real eager training steps, per kernel a checkpoint replays and per
  optimizer kernel (``recompute.bench._host``): what the time model prices the host's dispatch at;
- host link (GPUs): pinned host-to-device copies.

Every point is the best of three batches, each batch repeating the op until it has run a minimum time; GPU
batches are timed with CUDA events around enough work to hide the launch.

Note: [quick batches] A quick CPU calibration times batches of 15 ms, not 30 (issue 39): its 81 named-op
points took over half its time. Two runs apart in time do not tell the two apart on this shared 2-core machine (the
same code's rates moved 2x between runs), so ``python benchmarks/calibrate_speed.py --paired-batch 0.015`` times
every rate of the quick plan with batches of 30 ms and of 15 ms alternately in one process: at load 3.9 the 15 ms
rates came out a median 7.5 % higher (30 ms against 30 ms: -1.4 %), 24 % at the middle sizes, and the steps of
``benchmarks/time_model.py`` priced on them -14 % to +6 %, their time overheads within 1.5 points; at load 3.5 a
median of +0.6 %, at load 6 +29 %. The shift grows with the load because a short batch more often runs between
the other jobs' time slices, the best of three then nearer a quiet machine's rate; on a quiet machine the two
time the same calls. ``math`` stays timed apart, not taken from the named ops it is made of: a named op is called
through ``torch.ops.aten``, 1 to 2 us a call more than ``torch.exp`` (3.65 against 2.60 us on 4 KiB), which makes
the named ops' rates at 4 KiB a lower bound.

Note: [ranks in step] Under torchrun (``calibrate --collectives`` on a profile not made yet) every rank
calibrates at once, and each batch starts after a barrier: the ranks of a tensor-parallel step run the same
kernel at the same moment, and on a CPU whose cores they share a matmul then runs slower than beside another
rank's lighter op (the cores' clocks and the memory are shared). On a CPU each rank's batch is then as long in
time, not in calls: every rank is busy until the last has measured, as in a step (a batch of so many calls lets
the ranks that finish first leave their core to the others). The CPU is measured with the
threads torch uses (``torch.set_num_threads``): recorded, since a step with other threads runs at other rates.

Note: [cold operands] On a CPU each call of a measured op takes its operands, and leaves its result, in copies
it rotates through (``recompute.bench._cold``): twice the last-level cache the kernel reports, at most 512 MiB
(here 512 MiB, about the L3 it reports; ops under 512 KiB rotate through 1024 copies, less), the results kept as
long. An op called again and again on the same tensors finds them in the cache, and a training step's ops do
not: their working set (the saved activations, the weights and their gradients) is larger than the cache. On
this 2-core Xeon (``benchmarks/cold_operands.py``, fp32, one thread) an attention-shaped ``bmm`` (8 x 512 x 64
by 8 x 64 x 512) reached 176 GFLOP/s on the same operands and 100 on rotated ones, and the same products ran at
108 inside a tensor-parallel step (``benchmarks/tp_profile.py``); an add of 3 x 16 MiB streamed 29 GB/s warm, 15
cold. ``--operands warm`` (``calibrate(cold=False)``) times them on the same operands, as before: for a model
whose whole step stays in the cache. GPUs keep their operands (their steps' ops are mostly larger than the L2
cache; not measured yet).

Over 400 lines because the calibration of one device (compute, bandwidth, host costs per kernel, collectives) writes
one device profile.
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from recompute.bench._cold import Rotation, pool_bytes, rotation
from recompute.bench._host import HOST_MODELS, host_cost
from recompute.core import store
from recompute.core.errors import ConfigError
from recompute.core.progress import Progress, no_progress
from recompute.core.timing import Curve, Device
from recompute.trace._flops import span, tensors_of

__all__ = ["ELEMENTWISE", "cached_calibration", "calibrate", "local_device_label"]

aten = torch.ops.aten

ELEMENTWISE = (
    "gelu",
    "gelu_backward",
    "gelu[tanh]",
    "gelu_backward[tanh]",
    "silu",
    "silu_backward",
    "_softmax",
    "_safe_softmax",
    "_softmax_backward_data",
    "_log_softmax",
    "_log_softmax_backward_data",
    "native_layer_norm",
    "native_layer_norm_backward",
    "bernoulli_",
    "native_dropout",
    "pow",
    "mul",
    "add",
    "div",
    "neg",
    "sum",
    "mean",
    "clone",
    "copy_",
    "where",
    "exp",
    "rsqrt",
)
"""The ops calibrated one by one: the element-wise and normalising ops of transformer steps, forward and
backward (others are priced by their class: ``math`` or ``memory``)."""


def _elementwise(x: torch.Tensor) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """Each op of ``ELEMENTWISE`` as (function, arguments) on rows of ``x`` (the last dimension normalised)."""
    cols = x.shape[-1]
    g, y = torch.randn_like(x), torch.empty_like(x)
    w, b = torch.ones(cols, device=x.device, dtype=x.dtype), torch.zeros(cols, device=x.device, dtype=x.dtype)
    _, mean, rstd = aten.native_layer_norm(x, [cols], w, b, 1e-5)
    soft, log_soft = aten._softmax(x, -1, False), aten._log_softmax(x, -1, False)
    mask = x > 0
    return {
        "gelu": (aten.gelu, (x,)),
        "gelu_backward": (aten.gelu_backward, (g, x)),
        "gelu[tanh]": (partial(aten.gelu, approximate="tanh"), (x,)),
        "gelu_backward[tanh]": (partial(aten.gelu_backward, approximate="tanh"), (g, x)),
        "silu": (aten.silu, (x,)),
        "silu_backward": (aten.silu_backward, (g, x)),
        "_softmax": (aten._softmax, (x, -1, False)),
        "_safe_softmax": (aten._safe_softmax, (x, -1)),
        "_softmax_backward_data": (aten._softmax_backward_data, (g, soft, -1, x.dtype)),
        "_log_softmax": (aten._log_softmax, (x, -1, False)),
        "_log_softmax_backward_data": (aten._log_softmax_backward_data, (g, log_soft, -1, x.dtype)),
        "native_layer_norm": (aten.native_layer_norm, (x, [cols], w, b, 1e-5)),
        "native_layer_norm_backward": (
            aten.native_layer_norm_backward,
            (g, x, [cols], mean, rstd, w, b, [True, True, True]),
        ),
        "bernoulli_": (aten.bernoulli_.float, (y, 0.9)),
        "native_dropout": (aten.native_dropout, (x, 0.1, True)),
        "pow": (aten.pow.Tensor_Scalar, (x, 2)),
        "mul": (aten.mul.Tensor, (x, g)),
        "add": (aten.add.Tensor, (x, g)),
        "div": (aten.div.Tensor, (x, g)),
        "neg": (aten.neg, (x,)),
        "sum": (aten.sum.dim_IntList, (x, [-1], True)),
        "mean": (aten.mean.dim, (x, [-1], True)),
        "clone": (aten.clone, (x,)),
        "copy_": (aten.copy_, (y, x)),
        "where": (aten.where.self, (mask, x, g)),
        "exp": (aten.exp, (x,)),
        "rsqrt": (aten.rsqrt, (x,)),
    }


def _op_bytes(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """Bytes of one call as the trace files them: what it reads plus what it writes that it did not read."""
    inputs, outputs = tensors_of(args, fn(*args))
    return sum(span(t) for t in inputs + outputs)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def local_device_label(device: str) -> str:
    """What calibration calls the device: the GPU's name, or the CPU's model name."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def _timer(device: str, min_time: float) -> Callable[[Callable[[], Any]], float]:
    """Seconds per call of ``fn``: the best of three batches, each at least ``min_time`` long."""
    cuda = device == "cuda"

    def run(fn: Callable[[], Any], n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0

    together = dist.is_available() and dist.is_initialized()

    def batch(fn: Callable[[], Any], n: int) -> float:
        if not together:
            return run(fn, n) / n
        dist.barrier()  # Note: [ranks in step]
        if cuda:
            return run(fn, n) / n
        calls, start = 0, time.perf_counter()
        while (spent := time.perf_counter() - start) < min_time or not calls:
            fn()
            calls += 1
        return spent / calls

    def measure(fn: Callable[[], Any]) -> float:
        fn()
        fn()
        n = 1
        while (spent := run(fn, n)) < min_time / 4 and n < 1 << 20:
            n *= 4
        n = max(1, int(n * min_time / max(spent, 1e-9)))
        return min(batch(fn, n) for _ in range(3))

    return measure


@dataclass(frozen=True)
class _Plan:
    """What one calibration measures: matmul sizes, dtypes, element counts and attention sequence lengths."""

    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    elements: tuple[int, ...]
    seqs: tuple[int, ...]
    batch_seconds: float
    host_seconds: float
    """Seconds of real steps per model the host is timed on (``recompute.bench._host``)."""

    @property
    def steps(self) -> int:
        return len(self.sizes) * len(self.dtypes) + 2 * len(self.seqs) * len(self.dtypes) + 3 * len(self.elements) + 3


def _plan(gpu: bool, quick: bool) -> _Plan:
    if gpu:
        if quick:
            return _Plan((256, 1024, 4096), ("bfloat16", "float32"), _pow2(16, 22, 27), (512, 2048), 0.02, 0.4)
        return _Plan(
            (128, 256, 512, 1024, 2048, 4096, 8192),
            ("bfloat16", "float16", "float32"),
            _pow2(14, 16, 18, 20, 22, 24, 26, 28),
            (256, 1024, 4096),
            0.1,
            2.0,
        )
    if quick:
        return _Plan((64, 256, 1024), ("float32",), _pow2(10, 16, 22), (128, 512), 0.015, 0.6)  # Note: [quick batches]
    return _Plan(
        (32, 64, 128, 256, 512, 1024),
        ("float32", "bfloat16"),
        _pow2(8, 10, 12, 14, 16, 18, 20, 22, 24),
        (128, 256, 512, 1024),
        0.15,
        3.0,
    )


def _pow2(*exponents: int) -> tuple[int, ...]:
    return tuple(1 << k for k in exponents)


class _Bench:
    """The timer, the progress, the host overhead that rates on a CPU leave out (the model adds it per op), and
    the operands' rotation that keeps them out of the cache (Note: [cold operands])."""

    def __init__(self, device: str, plan: _Plan, progress: Progress, *, cold: bool = True) -> None:
        self.device, self.plan, self.progress = device, plan, progress
        self.timer = _timer(device, plan.batch_seconds)
        self.done = 0
        self.overhead = self._overhead()
        self.serial = 0.0 if device == "cuda" else self.overhead
        self.pool = pool_bytes() if cold and device != "cuda" else 0

    def cold(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """``fn(*args)`` as a call on a ring of copies of its operands, ``pool`` bytes of them and its results, so
        that each call finds them out of the cache as an op of a training step does (Note: [cold operands]);
        with no pool, ``fn`` on ``args`` themselves."""
        return rotation(fn, args, self.pool)

    def tick(self, what: str) -> None:
        self.done += 1
        self.progress(f"calibrate {what}", self.done, self.plan.steps)

    def _overhead(self) -> float:
        """Seconds of host work per tiny kernel: on a GPU the issue rate of many queued, then one wait."""
        x, y, z = (torch.ones(1, device=self.device) for _ in range(3))
        if self.device == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20000):
                torch.add(x, y, out=z)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - t0) / 20000
        else:
            seconds = self.timer(lambda: torch.add(x, y, out=z))
        self.tick("kernel overhead")
        return seconds

    def rate(self, size: float, *calls: Callable[[], Any], kernels: int = 1) -> float:
        """``size`` (FLOPs or bytes) per second of the calls together, each ``kernels`` kernels long; a rotation's
        copies are let go once it is timed, so that one pool at a time is held."""
        spent = 0.0
        for call in calls:
            try:
                t = self.timer(call)
            finally:
                if isinstance(call, Rotation):
                    call.close()
            spent += max(t - kernels * self.serial, t / 10)
        return size / spent


def calibrate(
    device: str = "cpu", *, quick: bool = False, cold: bool = True, progress: Progress = no_progress
) -> Device:
    """Measure this machine's ``device`` (``cpu`` or ``cuda``) and return its profile.

    ``quick``: fewer sizes and shorter batches, the host timed on one model (seconds; ``bench`` uses it when
    given no profile). ``cold=False``: a CPU's ops measured on the same operands call after call, warm in its
    cache, as before Note: [cold operands] (``benchmarks/cold_operands.py`` compares the two).

    Raises:
        ConfigError: an unknown device, or CUDA asked for without CUDA.
    """
    _require_device(device)
    gpu = device == "cuda"
    plan = _plan(gpu, quick)
    bench = _Bench(device, plan, progress, cold=cold)
    compute = _compute(bench)
    bandwidth = _bandwidth(bench)
    host_link = None
    if gpu:
        src = torch.empty(64 << 20, dtype=torch.float32, pin_memory=True)
        dst = torch.empty_like(src, device=device)
        host_link = bench.rate(src.numel() * 4.0, lambda: dst.copy_(src, non_blocking=True))
    bench.tick("host link")
    ops = _named_ops(bench)
    label = local_device_label(device)
    threads = None if gpu else torch.get_num_threads()
    rates = Device(
        name="cuda" if gpu else "cpu",
        kind="cuda" if gpu else "cpu",
        label=label,
        compute={k: Curve(tuple(v)) for k, v in compute.items()},
        bandwidth={k: Curve(tuple(v)) for k, v in bandwidth.items()},
        overhead=bench.overhead,
        ops={k: Curve(tuple(v)) for k, v in ops.items()},
        host_link=host_link,
        memory=torch.cuda.get_device_properties(0).total_memory if gpu else _host_memory(),
        source=f"calibrated by recompute calibrate{' --quick' if quick else ''} on {label}"
        + ("" if threads is None else f" with {threads} thread{'s' if threads != 1 else ''}"),
        threads=threads,
        measured={
            "torch": torch.__version__,
            "quick": quick,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "operand_pool_bytes": bench.pool,  # 0: measured on warm operands (Note: [cold operands])
        },
    )
    host = host_cost(rates, models=("gpt",) if quick else tuple(HOST_MODELS), seconds=plan.host_seconds)
    bench.tick("host dispatch")
    return replace(rates, host=host)


Points = dict[str, list[tuple[float, float]]]


def _compute(bench: _Bench) -> Points:
    """Matmul (four products of 2n^3 FLOPs: square, narrow, wide, transposed), attention-shaped batched
    products, and SDPA forward plus backward, per dtype."""
    device, plan = bench.device, bench.plan
    out: Points = {}
    for dt in plan.dtypes:

        def randn(*shape: int, dt: str = dt) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=_DTYPES[dt])

        for n in plan.sizes:
            pairs = [(randn(n, n), randn(n, n)), (randn(n, n // 4), randn(n // 4, 4 * n))]
            wide = randn(4 * n, n)
            pairs += [(wide, randn(n, n // 4)), (wide.t(), wide[:, : n // 4])]
            calls = [bench.cold(torch.mm, a, b) for a, b in pairs]
            out.setdefault(f"matmul.{dt}", []).append((2.0 * n**3, bench.rate(8.0 * n**3, *calls)))
            bench.tick(f"matmul {dt} {n}")
        for s in plan.seqs:  # per head: (s, d) x (d, s), then (s, s) x (s, d)
            q, p = randn(8, s, 64), randn(8, s, s)
            flops = 2.0 * 8 * s * s * 64
            rate = bench.rate(2 * flops, bench.cold(torch.bmm, q, q.mT), bench.cold(torch.bmm, p, q))
            out.setdefault(f"bmm.{dt}", []).append((flops, rate))
            bench.tick(f"bmm {dt} s={s}")
    heads, dim = (16, 128) if device == "cuda" else (4, 64)
    for dt in plan.dtypes:
        for s in plan.seqs:
            shape = (1, heads, s, dim)
            q, k, v = (torch.randn(shape, device=device, dtype=_DTYPES[dt], requires_grad=True) for _ in range(3))
            grad = torch.randn(shape, device=device, dtype=_DTYPES[dt])
            flops = float(sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape))
            rate = bench.rate(flops, bench.cold(_attention_step, q, k, v, grad), kernels=2)
            out.setdefault(f"attention.{dt}", []).append((flops, rate))
            bench.tick(f"attention {dt} s={s}")
    return out


def _attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)


def _add_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b, out=out)


def _bandwidth(bench: _Bench) -> Points:
    """``memory``: an add (two read, one written); ``math``: exp, tanh-GELU, SiLU and softmax, per byte."""
    out: Points = {"memory": [], "math": []}
    for n in bench.plan.elements:
        a, b, c = (torch.randn(n, device=bench.device) for _ in range(3))
        out["memory"].append((12.0 * n, bench.rate(12.0 * n, bench.cold(_add_into, a, b, c))))
        bench.tick(f"memory {4 * n} B")
    fns: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (
        torch.exp,
        partial(F.gelu, approximate="tanh"),
        F.silu,
        partial(torch.softmax, dim=-1),
    )
    for n in bench.plan.elements:
        x = torch.randn(max(n // 256, 1), min(n, 256), device=bench.device)
        nbytes = 8.0 * x.numel()
        out["math"].append((nbytes, bench.rate(len(fns) * nbytes, *(bench.cold(f, x) for f in fns))))
        bench.tick(f"math {4 * n} B")
    return out


def _named_ops(bench: _Bench) -> Points:
    """Each op of ``ELEMENTWISE`` at every size, bytes counted as the trace counts them."""
    out: Points = {}
    for n in bench.plan.elements:
        x = torch.randn(max(n // 1024, 1), min(n, 1024), device=bench.device)
        for name, (fn, args) in _elementwise(x).items():
            nbytes = float(_op_bytes(fn, args))
            out.setdefault(name, []).append((nbytes, bench.rate(nbytes, bench.cold(fn, *args))))
        bench.tick(f"element-wise ops {4 * n} B")
    return out


def _require_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"calibrate measures 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")


def cached_calibration(device: str, *, progress: Progress = no_progress) -> Device:
    """A quick calibration of this machine's ``device`` (and thread count), kept in the store
    (``recompute.core.store``): what ``bench`` predicts times with when given no device profile.

    Raises:
        ConfigError: an unknown device, or CUDA asked for without CUDA.
    """
    _require_device(device)
    label = local_device_label(device)
    threads = "" if device == "cuda" else f"-{torch.get_num_threads()}t"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{platform.node()}-{label}{threads}")
    found = store.load("devices", name, Device.from_dict)  # an unreadable entry is measured again
    warm = found is not None and device == "cpu" and "operand_pool_bytes" not in found.measured
    if found is None or warm:  # warm: a CPU timed on the same operands, before Note: [cold operands]
        found = calibrate(device, quick=True, progress=progress)
        store.save("devices", name, found.to_dict())
    return found


def _host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return None
