"""Time from work: a per-op roofline over the kernels a traced step runs, calibrated per device. Torch-free.

The fake-tensor trace files every kernel of the step as a work signature (op, dtype, FLOPs, bytes read and
written) under the phase it ran in (``recompute.trace``; a layer's replay is part of its backward phase). A
``Device`` turns one into seconds:

    t(op) = max(FLOPs / rate_c(FLOPs), bytes / bandwidth_c(bytes))  then  + overhead (CPU)  or  max(., overhead) (GPU)

where c is the op's class: ``matmul`` and ``attention`` (the ops PyTorch's FLOP formulas cover, by dtype),
``math`` (transcendental element-wise ops, softmax and norms: exp, tanh, GELU, SiLU, ...) and ``memory``
(everything else: adds, multiplies, copies, casts, indexing). A rate is not one number but a curve of the
achieved rate against the op's size, interpolated log-log between calibrated points (``recompute
calibrate``): a 64x64 matmul does not run at the peak of an 8192x8192 one, nor does a 4 KiB add stream at
the bandwidth of a 1 GiB copy. A datasheet row (``recompute.core.hardware``) gives flat curves at the stated
peaks times an achievable share.

``overhead`` is the per-kernel cost of eager PyTorch: dispatch plus launch. On a GPU the host runs ahead of
the device, so an op costs the larger of its kernel time and the host's time to issue it; on the CPU the
two are in series. What the model ignores, by construction: overlap of communication or copies with
compute, kernel fusion (``torch.compile``), caches warmed by the previous op, clocks that change under
load, and the allocator. ``docs/time.md`` gives the figures it was held to.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require

__all__ = [
    "CLASSES",
    "COMM_PREFIX",
    "DEVICE_FORMAT",
    "Curve",
    "Device",
    "Op",
    "StepWork",
    "Timing",
    "by_class",
    "merge",
    "mixed_timing",
    "op_class",
    "scale_work",
    "timing",
    "work_list",
    "work_seconds",
]

DEVICE_FORMAT = "recompute.device/1"

CLASSES = ("matmul", "attention", "math", "memory")

COMM_PREFIX = "comm."
"""Work signatures of collectives (``comm.all_reduce.tp.8``): priced by ``recompute.core.comms``, not here."""

Op = tuple[str, str, int, int, int]
"""One work signature and how many kernels ran it: (op, dtype, FLOPs, bytes, count)."""

_ATTENTION = re.compile(r"attention|flash|cudnn_attention|efficient_attention")
_MATH = re.compile(r"exp|log|tanh|sigmoid|gelu|silu|softmax|erf|pow|sqrt|sin|cos|norm|reciprocal")


def op_class(name: str, flops: int) -> str:
    """The rate class of an op: ``matmul``/``attention`` when it has FLOPs, else ``math`` or ``memory``."""
    if flops:
        return "attention" if _ATTENTION.search(name) else "matmul"
    return "math" if _MATH.search(name) else "memory"


def _family(name: str) -> str:
    """Ops calibrated together: batched products (``bmm``, ``baddbmm``) apart from the others."""
    return "bmm" if name in ("bmm", "baddbmm") else name


@dataclass(frozen=True)
class Curve:
    """An achieved rate against an op's size (FLOPs or bytes): points sorted by size, log-log interpolated,
    flat beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        require(
            len(self.points) > 0 and all(x > 0 and r > 0 for x, r in self.points),
            "a rate curve needs at least one (size, rate) point, both positive",
        )
        object.__setattr__(self, "points", tuple(sorted((float(x), float(r)) for x, r in self.points)))

    @classmethod
    def flat(cls, rate: float) -> Curve:
        return cls(((1.0, rate),))

    def __call__(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1]
        i = bisect_left([x for x, _ in pts], size)
        (x0, r0), (x1, r1) = pts[i - 1], pts[i]
        w = (math.log(size) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))


@dataclass(frozen=True)
class Device:
    """What one device does per second: the rate curves by op class (and dtype for matmul and attention),
    the per-kernel overhead, the host link and the memory. Made from a datasheet row or ``recompute
    calibrate``; read from and written to ``device.json``."""

    name: str
    """``h100-80gb``, ``cpu``, ... (a datasheet row's id, or what calibration found)."""
    kind: str
    """``cuda``, ``rocm`` or ``cpu``: a profile measured on one kind never predicts another."""
    label: str
    compute: dict[str, Curve]
    """FLOP/s against the op's FLOPs, by ``matmul.<dtype>`` and ``attention.<dtype>``."""
    bandwidth: dict[str, Curve]
    """Bytes moved per second (read plus written) against the op's bytes, by ``memory`` and ``math``."""
    overhead: float
    """Seconds of host work per kernel (eager dispatch and launch)."""
    ops: dict[str, Curve] = field(default_factory=dict)
    """Bytes per second of named element-wise ops (``gelu_backward``, ``bernoulli_``, ...), measured one by one:
    their cost per byte varies tenfold on a CPU (a random number or an erf per element against an add)."""
    host_link: float | None = None
    """Host-to-device bytes per second (pinned), None on the CPU."""
    memory: int | None = None
    source: str = ""
    threads: int | None = None
    """CPU threads the calibration ran with (``torch.get_num_threads()``); None on a GPU."""
    measured: dict[str, Any] = field(default_factory=dict)
    """The calibration's raw points and settings, for the record."""
    network: dict[str, Any] = field(default_factory=dict)
    """The links between GPUs and the collectives measured (``recompute.core.comms.Network.to_dict``)."""

    @property
    def asynchronous(self) -> bool:
        """The host issues kernels ahead of the device (GPUs): an op costs max(kernel, overhead)."""
        return self.kind != "cpu"

    def rate(self, cls: str, dtype: str, size: float, name: str = "") -> float:
        """FLOP/s (matmul, attention) or bytes/s (math, memory) of an op of class ``cls`` and ``size``; a curve
        calibrated for the op itself (``bmm.float32``: attention-shaped batched products) comes first."""
        if cls in ("matmul", "attention"):
            curve = (
                self.compute.get(f"{_family(name)}.{dtype}")
                or self.compute.get(f"{cls}.{dtype}")
                or self.compute.get(f"matmul.{dtype}")
            )
            if curve is None:  # an integer matmul, or a dtype not calibrated: the slowest floating rate known
                curve = min(self.compute.values(), key=lambda c: c(size))
            return curve(size)
        return (self.bandwidth.get(cls) or self.bandwidth["memory"])(size)

    def kernel(self, op: Op) -> float:
        """The device time of one kernel of a work signature: the roofline, without the host's overhead."""
        name, dtype, flops, nbytes, _ = op
        if name.startswith(COMM_PREFIX):  # a collective: recompute.core.comms prices it
            return 0.0
        cls = op_class(name, flops)
        if cls in ("matmul", "attention"):
            return max(flops / self.rate(cls, dtype, flops, name), nbytes / self.bandwidth["memory"](nbytes))
        if not nbytes:
            return 0.0
        named = self.ops.get(name)
        return nbytes / (named(nbytes) if named is not None else self.rate(cls, dtype, nbytes))

    def seconds(self, op: Op) -> float:
        """Time of ``count`` kernels of one work signature, the host's overhead included."""
        if op[0].startswith(COMM_PREFIX):
            return 0.0
        kernel = self.kernel(op)
        return op[4] * (max(kernel, self.overhead) if self.asynchronous else kernel + self.overhead)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DEVICE_FORMAT,
            "name": self.name,
            "kind": self.kind,
            "label": self.label,
            "compute": {k: [list(p) for p in c.points] for k, c in self.compute.items()},
            "bandwidth": {k: [list(p) for p in c.points] for k, c in self.bandwidth.items()},
            "overhead": self.overhead,
            "ops": {k: [list(p) for p in c.points] for k, c in self.ops.items()},
            "host_link": self.host_link,
            "memory": self.memory,
            "source": self.source,
            "threads": self.threads,
            "measured": self.measured,
            "network": self.network,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        require(data.get("format") == DEVICE_FORMAT, f"not a {DEVICE_FORMAT} file (format {data.get('format')!r})")
        require(data.get("kind") in ("cuda", "rocm", "cpu"), f"unknown device kind {data.get('kind')!r}")
        require("memory" in data.get("bandwidth", {}), "a device profile needs a 'memory' bandwidth curve")
        return cls(
            name=str(data["name"]),
            kind=str(data["kind"]),
            label=str(data.get("label", data["name"])),
            compute={k: Curve(tuple(tuple(p) for p in v)) for k, v in data["compute"].items()},
            bandwidth={k: Curve(tuple(tuple(p) for p in v)) for k, v in data["bandwidth"].items()},
            overhead=float(data["overhead"]),
            ops={k: Curve(tuple(tuple(p) for p in v)) for k, v in (data.get("ops") or {}).items()},
            host_link=None if data.get("host_link") is None else float(data["host_link"]),
            memory=None if data.get("memory") is None else int(data["memory"]),
            source=str(data.get("source", "")),
            threads=data.get("threads"),
            measured=dict(data.get("measured") or {}),
            network=dict(data.get("network") or {}),
        )

    def save(self, path: str | Path) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Device:
        """Raises: ConfigError: a missing or unreadable file, or not a device profile (one line)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{path}: no such device profile; make one with `recompute calibrate -o {p.name}`")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}; make one with `recompute calibrate -o {p.name}`") from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(
                f"{path}: not a readable device profile ({type(e).__name__}); make one with "
                f"`recompute calibrate -o {p.name}`"
            ) from None

    def check_runs_on(self, kind: str, name: str | None = None, *, threads: int | None = None) -> None:
        """Refuse to predict a step measured on another kind of device (bench on a CPU with an H100's profile),
        another GPU than the one calibrated, or a CPU with other threads than calibrated.

        Raises:
            ConfigError: ``kind``, ``name`` (both calibrated GPUs) or ``threads`` (a CPU) differ.
        """
        if self.kind != kind:
            raise ConfigError(
                f"the device profile is of a {self.kind} device ({self.label}) but this step runs on {kind}; "
                "calibrate this device with `recompute calibrate -o device.json`"
            )
        if name and self.kind != "cpu" and self.source.startswith("calibrated") and name != self.label:
            raise ConfigError(
                f"the device profile was calibrated on {self.label}, this step runs on {name}; "
                "calibrate this device with `recompute calibrate -o device.json`"
            )
        if kind == "cpu" and threads and self.threads and threads != self.threads:
            raise ConfigError(
                f"the device profile was calibrated with {self.threads} CPU thread(s), this step runs with {threads}; "
                f"calibrate again with `recompute calibrate --threads {threads} -o device.json`"
            )


def work_seconds(work: Iterable[Op], device: Device) -> float:
    """Seconds of a list of work signatures on ``device``."""
    return sum(device.seconds(op) for op in work)


def merge(*works: Sequence[Op]) -> tuple[Op, ...]:
    """One list of signatures from several, counts added."""
    out: dict[tuple[str, str, int, int], int] = {}
    for work in works:
        for name, dtype, flops, nbytes, count in work:
            out[name, dtype, flops, nbytes] = out.get((name, dtype, flops, nbytes), 0) + count
    return tuple((*k, v) for k, v in sorted(out.items()))


def by_class(work: Iterable[Op], device: Device) -> dict[str, float]:
    """Seconds of ``work`` by op class (and ``overhead`` where the host's issue time is what costs)."""
    out = dict.fromkeys((*CLASSES, "overhead"), 0.0)
    for op in work:
        name, _, flops, _, count = op
        if name.startswith(COMM_PREFIX):
            continue
        kernel = device.kernel(op)
        if device.asynchronous:
            out["overhead" if kernel <= device.overhead else op_class(name, flops)] += device.seconds(op)
        else:
            out[op_class(name, flops)] += kernel * count
            out["overhead"] += device.overhead * count
    return out


def work_list(raw: Mapping[tuple[str, str, int, int], int]) -> tuple[Op, ...]:
    """The trace's ``{(op, dtype, flops, bytes): count}`` as a sorted list of ``Op``."""
    return tuple((*k, v) for k, v in sorted(raw.items()))


@dataclass(frozen=True)
class StepWork:
    """Every kernel of one training step by phase (``forward of layer 3``, ``optimizer step``, ...), as the
    fake-tensor trace of the real step ran them: what ``Device`` prices."""

    phases: dict[str, tuple[Op, ...]]
    tokens: int
    """Tokens the step trains on (micro-batch x sequence)."""

    def phase_seconds(self, device: Device) -> dict[str, float]:
        return {name: work_seconds(ops, device) for name, ops in self.phases.items()}

    def seconds(self, device: Device) -> float:
        """Predicted time of the step on ``device``."""
        return sum(self.phase_seconds(device).values())

    def flops(self) -> int:
        return sum(op[2] * op[4] for ops in self.phases.values() for op in ops)

    def kernels(self) -> int:
        return sum(op[4] for ops in self.phases.values() for op in ops)

    def by_class(self, device: Device) -> dict[str, float]:
        return by_class(merge(*self.phases.values()), device)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "phases": {k: [list(op) for op in v] for k, v in self.phases.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepWork:
        return cls(
            phases={k: tuple(_op(op) for op in v) for k, v in data["phases"].items()}, tokens=int(data["tokens"])
        )


def _op(raw: Sequence[Any]) -> Op:
    name, dtype, flops, nbytes, count = raw
    return str(name), str(dtype), int(flops), int(nbytes), int(count)


@dataclass(frozen=True)
class Timing:
    """A step's predicted time on one device and each policy's time overhead."""

    device: str
    step: float
    """Seconds of the step (forward, backward with any replay, optimizer step)."""
    tokens_per_second: float
    overhead: float
    """Replay time over the time of the same step without recomputation."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "step_seconds": self.step,
            "tokens_per_second": self.tokens_per_second,
            "time_overhead": self.overhead,
        }


def timing(work: StepWork, base: StepWork, device: Device) -> Timing:
    """``work``'s predicted step time, tokens/s and time overhead against ``base`` (the step under ``none``)."""
    step, plain = work.seconds(device), base.seconds(device)
    return Timing(device.label, step, work.tokens / step if step else 0.0, step / plain - 1 if plain else 0.0)


def scale_work(small: StepWork, big: StepWork, k: int, n: int) -> StepWork:
    """The work of an ``n``-layer step from steps of ``k`` and ``k + 1`` identical layers (as ``trace``'s
    scaling): layer phases past ``k`` copy layer ``k``'s; a phase outside the layers is affine in the layer
    count, signature by signature (the optimizer's per-parameter ops grow in count, its multi-tensor ops in
    bytes)."""
    phases: dict[str, tuple[Op, ...]] = {}
    for name, ops in big.phases.items():
        m = re.fullmatch(r"(forward|backward) of layer (\d+)", name)
        if m is None:
            phases[name] = _affine_ops(small.phases.get(name, ()), ops, k, n)
        elif int(m.group(2)) < k:
            phases[name] = ops
    for stage in ("forward", "backward"):
        template = big.phases.get(f"{stage} of layer {k}", ())
        for i in range(k, n):
            phases[f"{stage} of layer {i}"] = template
    order = sorted(phases, key=lambda p: _phase_order(p, n))
    return StepWork({p: phases[p] for p in order}, big.tokens)


def _phase_order(name: str, n: int) -> tuple[int, int]:
    m = re.fullmatch(r"(forward|backward) of layer (\d+)", name)
    if m:
        i = int(m.group(2))
        return (1, i) if m.group(1) == "forward" else (3, n - i)
    return ({"forward (embedding)": 0, "forward (head and loss)": 2, "backward (head and loss)": 2}.get(name, 4), 0)


def _affine_ops(small: Sequence[Op], big: Sequence[Op], k: int, n: int) -> tuple[Op, ...]:
    if tuple(small) == tuple(big):
        return tuple(big)
    groups: dict[tuple[str, str, int], tuple[list[Op], list[Op]]] = {}
    for side, ops in enumerate((small, big)):
        for op in ops:
            groups.setdefault(op[:3], ([], []))[side].append(op)
    out: list[Op] = []
    for (name, dtype, flops), (a, b) in groups.items():
        if len(a) == len(b) == 1 and a[0][4] == b[0][4]:  # one multi-tensor op: its bytes grow
            out.append((name, dtype, flops, max(0, a[0][3] + (n - k) * (b[0][3] - a[0][3])), b[0][4]))
            continue
        counts_a = {op[3]: op[4] for op in a}
        for _, _, _, nbytes, count in b:
            scaled = counts_a.get(nbytes, 0) + (n - k) * (count - counts_a.get(nbytes, 0))
            if scaled > 0:
                out.append((name, dtype, flops, nbytes, scaled))
    return tuple(sorted(out))


_TIMED_AS = {"offload": "none"}
"""Policies priced as another: their device kernels are that policy's."""


def mixed_timing(works: Mapping[str, StepWork], layers: Sequence[str], device: Device) -> Timing:
    """The timing of a per-layer assignment of a model with identical layers, from each policy's uniform step:
    the step under ``none`` plus, per layer, 1/L of what its policy's uniform step adds.

    An ``offload`` layer runs the kernels of ``none``: its copies go on a side stream, taken as hidden behind
    compute (not priced; unmeasured)."""
    base = works["none"].seconds(device)
    n = len(layers)
    extra = sum((works[_TIMED_AS.get(name, name)].seconds(device) - base) / n for name in layers)
    step = base + extra
    tokens = works["none"].tokens
    return Timing(device.label, step, tokens / step if step else 0.0, extra / base if base else 0.0)
