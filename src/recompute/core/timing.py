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

The host's time is priced per phase of the step (the forward of a layer, its backward, the optimizer step):
an eager step spends, per kernel, Python, ``nn.Module`` calls, autograd's bookkeeping, dispatch and the launch,
and per kernel that a non-reentrant checkpoint replays, its saved-tensor hooks and re-entered forward too
(``HostCost``, measured on real training steps by ``recompute calibrate``). A phase costs

    host = kernels x host_c + replayed x host_replay      device = the sum of its kernels' rooflines
    max(host, device)  on a GPU (the host issues kernels ahead of the device)    host + device  on a CPU

A phase's replayed kernels are what it runs beyond the same phase of the step without recomputation (a
policy's backward of a layer runs the layer's backward, and its replay). Under ``torch.compile`` or CUDA
graphs (``Device.compiled``) the eager host work is gone: each kernel costs the host a bare launch
(``Device.overhead``) and no more. What the model ignores, by construction: overlap of communication or
copies with compute, the host running ahead across phases, kernel fusion (``torch.compile``), caches warmed
by the previous op (a CPU's rates are measured on cold operands, a GPU's on warm ones: ``recompute calibrate``),
clocks that change under load, and the allocator. ``docs/time.md`` gives the figures it
was held to.

Over 400 lines because it is one data model: the device (its rate curves, host costs and the schema its file is
checked against) and the step's kernels it prices; split, the schema would leave the type it checks.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require
from recompute.core.files import atomic_write, read_json_file

__all__ = [
    "CLASSES",
    "COMM_PREFIX",
    "DEVICE_FORMAT",
    "OPTIMIZER_PHASE",
    "Curve",
    "Device",
    "HostCost",
    "Op",
    "StepWork",
    "Timing",
    "affine_ops",
    "by_class",
    "check_device_dict",
    "kernels",
    "merge",
    "mixed_timing",
    "op_class",
    "replayed",
    "scale_work",
    "timing",
    "work_list",
    "work_seconds",
]

DEVICE_FORMAT = "recompute.device/1"

CLASSES = ("matmul", "attention", "math", "memory")

OPTIMIZER_PHASE = "optimizer step"
"""The phase whose kernels the host issues at ``HostCost.optimizer`` (no modules, no autograd)."""
COMM_PREFIX = "comm."
"""Work signatures of collectives (``comm.all_reduce.tp.8``): priced by ``recompute.core.comms``, not here."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives priced (``send_recv``: a pipeline's point-to-point activations); ``recompute.core.comms``
prices them, this module reads their measured curves from a device profile."""

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
class HostCost:
    """Seconds the host spends per kernel of an eager training step, measured on real steps of small models
    whose device work is negligible (``recompute calibrate``): the step's wall time less its kernels' predicted
    device time, over the kernels the fake-tensor trace of the same step files."""

    kernel: float
    """Per kernel of a forward and backward: Python, ``nn.Module`` calls, autograd, dispatch, launch."""
    replay: float
    """Per kernel a non-reentrant ``torch.utils.checkpoint`` replays: what a checkpointed step adds to the host's
    time over the same step without, per kernel it adds (the replay's dispatch, the checkpoint's saved-tensor
    hooks, its re-entered forward)."""
    optimizer: float
    """Per kernel of the optimizer step (a loop over parameters, or multi-tensor kernels)."""
    source: str = ""
    """How it was measured: the models, their kernels, the steps' times."""
    parallel: float = 0.0
    """Per kernel of a tensor-parallel rank's step, on top of ``kernel``, ``replay`` or ``optimizer``: DTensor's
    sharding propagation and redistribution, run in Python around the kernels of a split layer. Measured on real
    tensor-parallel steps under torchrun (``recompute calibrate --collectives``); 0 where not measured."""
    collective: float = 0.0
    """Per collective of a step, on top of its transfer on the measured curves: the functional collective's
    launch and wait, DTensor's redistribution around it, and the ranks arriving apart (the curves time each
    collective after a barrier). Measured with ``parallel``; 0 where not measured."""

    def __post_init__(self) -> None:
        require(
            min(self.kernel, self.replay, self.optimizer) > 0,
            f"host costs per kernel must be positive, got {self.kernel}, {self.replay}, {self.optimizer}",
        )
        require(
            min(self.parallel, self.collective) >= 0,
            f"host costs of parallel steps must be >= 0, got {self.parallel}, {self.collective}",
        )

    def tensor_parallel(self) -> HostCost:
        """The costs of a tensor-parallel rank's step: ``parallel`` added to every kernel's (and then 0, so that
        applying it twice changes nothing)."""
        p = self.parallel
        return replace(self, kernel=self.kernel + p, replay=self.replay + p, optimizer=self.optimizer + p, parallel=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "replay": self.replay,
            "optimizer": self.optimizer,
            "source": self.source,
            "parallel": self.parallel,
            "collective": self.collective,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HostCost:
        return cls(
            float(data["kernel"]),
            float(data["replay"]),
            float(data["optimizer"]),
            str(data.get("source", "")),
            float(data.get("parallel", 0.0)),
            float(data.get("collective", 0.0)),
        )


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
    """Seconds of host work per bare kernel launch (a one-element add called in a loop): what a kernel costs the
    host under ``torch.compile`` or CUDA graphs, and in eager steps where ``host`` is not calibrated."""
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
    host: HostCost | None = None
    """The host's time per kernel of an eager training step; None (a datasheet row, a profile calibrated before
    it was measured): the bare launch ``overhead`` stands in, and ``host_note`` says so."""
    compiled: bool = False
    """Price the step as run under ``torch.compile`` or CUDA graphs: no eager host work, a bare launch per
    kernel (a pricing choice, not a property of the device: ``recompute estimate --compiled``)."""
    network: dict[str, Any] = field(default_factory=dict)
    """The links between GPUs and the collectives measured (``recompute.core.comms.Network.to_dict``)."""

    @property
    def asynchronous(self) -> bool:
        """The host issues kernels ahead of the device (GPUs): a phase costs max(host, device)."""
        return self.kind != "cpu"

    def tensor_parallel(self) -> Device:
        """This device pricing a tensor-parallel rank's step (``HostCost.tensor_parallel``); itself where the
        host's parallel costs are not measured, or not priced (``compiled``)."""
        if self.compiled or self.host is None or not self.host.parallel:
            return self
        return replace(self, host=self.host.tensor_parallel())

    @property
    def collective_overhead(self) -> float:
        """Seconds each collective of a step costs beyond its transfer (``HostCost.collective``; 0 where not
        measured, or under ``compiled``)."""
        return 0.0 if self.compiled or self.host is None else self.host.collective

    def host_seconds(self, kernels: int, replayed: int = 0, *, phase: str = "") -> float:
        """The host's time to issue a phase of ``kernels`` kernels, ``replayed`` of them replayed by a checkpoint."""
        if self.compiled or self.host is None:
            return kernels * self.overhead
        per = self.host.optimizer if phase == OPTIMIZER_PHASE else self.host.kernel
        return (kernels - replayed) * per + replayed * self.host.replay

    def phase_seconds(self, work: Iterable[Op], *, phase: str = "", replayed: int = 0) -> float:
        """Time of one phase of a step: its kernels on the device and the host's time to issue them, the larger
        on a GPU, their sum on a CPU (the module docstring)."""
        ops = tuple(op for op in work if not op[0].startswith(COMM_PREFIX))  # collectives: recompute.core.comms
        device = sum(self.kernel(op) * op[4] for op in ops)
        host = self.host_seconds(sum(op[4] for op in ops), replayed, phase=phase)
        return max(host, device) if self.asynchronous else host + device

    def host_note(self) -> str:
        """What a kernel costs the host in these predictions, in words."""
        if self.compiled:
            return (
                f"host dispatch not priced (--compiled: torch.compile or CUDA graphs), "
                f"a bare launch of {self.overhead * 1e6:.1f} us per kernel"
            )
        if self.host is None:
            why = "a datasheet row" if self.source.startswith("datasheet") else "this device profile has no host costs"
            return (
                f"host dispatch: a bare launch of {self.overhead * 1e6:.1f} us per kernel ({why}; eager steps spend "
                "more: calibrate with `recompute calibrate -o device.json`)"
            )
        h = self.host
        parallel = (
            f"; tensor-parallel steps: +{h.parallel * 1e6:.1f} us per kernel, +{h.collective * 1e6:.1f} us per "
            "collective (calibrated on real ones)"
            if h.parallel or h.collective
            else ""
        )
        return (
            f"host dispatch: {h.kernel * 1e6:.1f} us per kernel, {h.replay * 1e6:.1f} us per replayed kernel, "
            f"{h.optimizer * 1e6:.1f} us per optimizer kernel (calibrated on eager training steps){parallel}"
        )

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
        """Time of ``count`` kernels of one work signature as a phase of their own, the host's time included."""
        return self.phase_seconds((op,))

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
            "host": None if self.host is None else self.host.to_dict(),
            "compiled": self.compiled,
            "network": self.network,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        """Inverse of ``to_dict``, the schema checked first (``check_device_dict``).

        Raises:
            ConfigError: not a device profile, or a field of the wrong type, out of range or not finite.
        """
        check_device_dict(data)
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
            host=None if data.get("host") is None else HostCost.from_dict(data["host"]),
            compiled=bool(data.get("compiled", False)),
            network=dict(data.get("network") or {}),
        )

    def save(self, path: str | Path) -> None:
        """Write the profile to ``path`` atomically (its folder is created)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, flag: str = "--device-profile") -> Device:
        """Raises: ConfigError: a missing or unreadable file, or not a device profile (one line)."""
        fix = "make one with `recompute calibrate -o device.json`"
        data = read_json_file(path, flag, what="a device profile", fix=fix, max_bytes=_DEVICE_BYTES)
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{flag} {str(path)!r}: {e}; {fix}") from None

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


_DEVICE_BYTES = 16 * 2**20
"""The largest device profile read: a calibration's curves and raw points take tens of KiB."""

_DEVICE_KEYS = {
    "format", "name", "kind", "label", "compute", "bandwidth", "overhead", "ops", "host_link", "memory", "source",
    "threads", "measured", "host", "compiled", "network",
}  # fmt: skip


def check_device_dict(data: Mapping[str, Any]) -> None:
    """Refuse a device profile that would price a step wrongly: an unknown format or key, no compute curve or no
    ``memory`` bandwidth curve, an empty curve, a rate or size that is not a positive finite number, an overhead
    or host link that is negative or not finite (a negative overhead gave negative step times).

    Raises:
        ConfigError: the first problem found, in one line.
    """
    require(data.get("format") == DEVICE_FORMAT, f"not a {DEVICE_FORMAT} file (format {data.get('format')!r})")
    unknown = sorted(set(data) - _DEVICE_KEYS)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; a device profile has {', '.join(sorted(_DEVICE_KEYS))}")
    require(data.get("kind") in ("cuda", "rocm", "cpu"), f"unknown device kind {data.get('kind')!r}")
    require(isinstance(data.get("name"), str) and data["name"] != "", "'name' must be a non-empty string")
    for key in ("label", "source"):
        require(isinstance(data.get(key, ""), str), f"{key!r} must be a string")
    for key in ("compute", "bandwidth", "ops"):
        table = (data.get(key) or {}) if key == "ops" else data.get(key)
        if not isinstance(table, Mapping) or not (key == "ops" or len(table) > 0):
            raise ConfigError(f"{key!r} must map rate names to curves" + ("" if key == "ops" else ", at least one"))
        for name, curve in table.items():
            _check_curve(f"{key}.{name}", curve)
    require("memory" in data["bandwidth"], "a device profile needs a 'memory' bandwidth curve")
    _check_number("overhead", data.get("overhead"), low=0.0)
    if data.get("host_link") is not None:
        _check_number("host_link", data["host_link"], low=0.0, strict=True)
    for key in ("memory", "threads"):
        value = data.get(key)
        require(
            value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
            f"{key!r} must be a positive integer or null, got {value!r}",
        )
    require(isinstance(data.get("measured", {}) or {}, Mapping), "'measured' must be an object")
    host = data.get("host")
    require(host is None or isinstance(host, Mapping), "'host' must be an object of host costs per kernel or null")
    if host is not None:
        for key in ("kernel", "replay", "optimizer"):
            _check_number(f"host.{key}", host.get(key), low=0.0, strict=True)
        for key in ("parallel", "collective"):
            _check_number(f"host.{key}", host.get(key, 0.0), low=0.0)
    require(isinstance(data.get("compiled", False), bool), "'compiled' must be true or false")
    _check_network(data.get("network") or {})


_NETWORK_KEYS = {
    "collectives", "ranks", "backend", "times", "notes", "intra", "inter", "gpus_per_node", "gpus_per_host_link",
}  # fmt: skip
"""What a device profile's ``network`` may hold: ``calibrate --collectives``'s measurement
(``recompute.bench.collectives.measure_collectives``) and ``recompute.core.comms.Network.to_dict``'s fields."""


def _check_network(network: Any) -> None:
    """Refuse a ``network`` section the time model would trip on: not an object, an unknown key, a collective
    that is not one ``recompute.core.comms`` prices or whose curve is not positive finite points, a rank count
    that is not a positive integer where collectives were measured, notes that are not strings."""
    require(isinstance(network, Mapping), f"'network' must be an object, got {network!r}")
    unknown = sorted(set(network) - _NETWORK_KEYS)
    if unknown:
        raise ConfigError(f"unknown key 'network.{unknown[0]}'; a network has {', '.join(sorted(_NETWORK_KEYS))}")
    for key in ("collectives", "times"):
        table = network.get(key) or {}
        require(isinstance(table, Mapping), f"'network.{key}' must map collectives to curves, got {table!r}")
        for kind, curve in table.items():
            require(kind in COLLECTIVES, f"unknown collective 'network.{key}.{kind}'; known: {', '.join(COLLECTIVES)}")
            _check_curve(f"network.{key}.{kind}", curve)
    ranks = network.get("ranks", 0)
    require(
        isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 0,
        f"'network.ranks' must be a non-negative integer, got {ranks!r}",
    )
    require(
        ranks >= 2 or not network.get("collectives"),
        f"'network.ranks' must be the ranks the collectives were measured on (at least 2), got {ranks}",
    )
    require(isinstance(network.get("backend", ""), str), "'network.backend' must be a string")
    for key in ("gpus_per_node", "gpus_per_host_link"):
        count = network.get(key, 1)
        require(
            isinstance(count, int) and not isinstance(count, bool) and count > 0,
            f"'network.{key}' must be a positive integer, got {count!r}",
        )
    for key in ("intra", "inter"):  # Network.from_dict's links: a string bandwidth was a ValueError (issue 38)
        link = network.get(key)
        if link is None:
            continue
        require(isinstance(link, Mapping), f"'network.{key}' must be a link object, got {link!r}")
        require(isinstance(link.get("name"), str), f"'network.{key}.name' must be a string")
        _check_number(f"network.{key}.bandwidth", link.get("bandwidth"), low=0.0, strict=True)
        _check_number(f"network.{key}.latency", link.get("latency"), low=0.0)
        if link.get("busbw") is not None:
            _check_number(f"network.{key}.busbw", link["busbw"], low=0.0, strict=True)
    notes = network.get("notes", [])
    require(
        isinstance(notes, list) and all(isinstance(n, str) for n in notes), "'network.notes' must be a list of strings"
    )


def _check_number(name: str, value: Any, *, low: float, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if strict else value >= low)
    require(ok, f"{name!r} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")


def _check_curve(name: str, curve: Any) -> None:
    require(
        isinstance(curve, list) and len(curve) > 0,
        f"the curve {name!r} must be a non-empty list of [size, rate] points, got {curve!r}",
    )
    for point in curve:
        require(
            isinstance(point, list) and len(point) == 2,
            f"the curve {name!r} has a point {point!r}; each point is [size, rate]",
        )
        for value in point:
            _check_number(f"a point of {name}", value, low=0.0, strict=True)


def work_seconds(work: Iterable[Op], device: Device, *, replayed: int = 0) -> float:
    """Seconds of one phase's work signatures on ``device``, ``replayed`` of its kernels replayed by a checkpoint."""
    return device.phase_seconds(work, replayed=replayed)


def kernels(work: Iterable[Op]) -> int:
    """How many kernels a list of work signatures runs (collectives apart)."""
    return sum(op[4] for op in work if not op[0].startswith(COMM_PREFIX))


def replayed(work: Iterable[Op], base: Iterable[Op]) -> int:
    """The kernels a phase runs beyond the same phase without recomputation (``base``): its replay."""
    return max(0, kernels(work) - kernels(base))


def merge(*works: Sequence[Op]) -> tuple[Op, ...]:
    """One list of signatures from several, counts added."""
    out: dict[tuple[str, str, int, int], int] = {}
    for work in works:
        for name, dtype, flops, nbytes, count in work:
            out[name, dtype, flops, nbytes] = out.get((name, dtype, flops, nbytes), 0) + count
    return tuple((*k, v) for k, v in sorted(out.items()))


def by_class(work: Iterable[Op], device: Device, *, phase: str = "", replayed: int = 0) -> dict[str, float]:
    """Seconds of one phase's ``work`` by op class, and ``host``: the host's time where it adds to the device's
    (all of it on a CPU; on a GPU what it takes beyond the device's time)."""
    ops = tuple(op for op in work if not op[0].startswith(COMM_PREFIX))
    out = dict.fromkeys((*CLASSES, "host"), 0.0)
    for op in ops:
        out[op_class(op[0], op[2])] += device.kernel(op) * op[4]
    out["host"] = device.phase_seconds(ops, phase=phase, replayed=replayed) - sum(out.values())
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

    def replayed(self, base: StepWork | None) -> dict[str, int]:
        """Kernels each phase replays: what it runs beyond ``base``'s phase of the same name (none without one)."""
        if base is None:
            return dict.fromkeys(self.phases, 0)
        return {name: replayed(ops, base.phases.get(name, ())) for name, ops in self.phases.items()}

    def phase_seconds(self, device: Device, base: StepWork | None = None) -> dict[str, float]:
        """Seconds of each phase on ``device``; ``base``: the same step without recomputation, whose phases tell
        the replayed kernels apart (the host issues them at their own cost)."""
        again = self.replayed(base)
        return {name: device.phase_seconds(ops, phase=name, replayed=again[name]) for name, ops in self.phases.items()}

    def seconds(self, device: Device, base: StepWork | None = None) -> float:
        """Predicted time of the step on ``device`` (``base``: as ``phase_seconds``)."""
        return sum(self.phase_seconds(device, base).values())

    def flops(self) -> int:
        return sum(op[2] * op[4] for ops in self.phases.values() for op in ops)

    def kernels(self) -> int:
        return sum(op[4] for ops in self.phases.values() for op in ops)

    def by_class(self, device: Device, base: StepWork | None = None) -> dict[str, float]:
        """Seconds of the step by op class and the host's exposed time (``by_class``, phase by phase)."""
        out = dict.fromkeys((*CLASSES, "host"), 0.0)
        again = self.replayed(base)
        for name, ops in self.phases.items():
            for key, value in by_class(ops, device, phase=name, replayed=again[name]).items():
                out[key] += value
        return out

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
    step, plain = work.seconds(device, base), base.seconds(device)
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
            phases[name] = affine_ops(small.phases.get(name, ()), ops, k, n)
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


def affine_ops(small: Sequence[Op], big: Sequence[Op], k: int, n: int) -> tuple[Op, ...]:
    """The kernels of a phase outside the layers of an ``n``-layer step from those of steps of ``k`` (``small``)
    and ``k + 1`` (``big``) identical layers: each signature's count affine in the layer count, and a multi-tensor
    op's bytes."""
    if tuple(small) == tuple(big):
        return tuple(big)
    groups: dict[tuple[str, str, int], tuple[list[Op], list[Op]]] = {}
    for side, ops in enumerate((small, big)):
        for op in ops:
            groups.setdefault(op[:3], ([], []))[side].append(op)
    out: list[Op] = []
    for (name, dtype, flops), (a, b) in groups.items():
        paired = len(a) == len(b) and all(x[4] == y[4] and x[3] <= y[3] for x, y in zip(a, b))
        if paired and {op[3] for op in a} != {op[3] for op in b}:
            # multi-tensor ops (AdamW's foreach ones, one per state): as many, each over more bytes, paired in
            # the order of their bytes (none fewer)
            for x, y in zip(a, b):
                out.append((name, dtype, flops, max(0, x[3] + (n - k) * (y[3] - x[3])), y[4]))
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
    none = works["none"]
    base = none.seconds(device)
    n = len(layers)
    extra = sum((works[_TIMED_AS.get(name, name)].seconds(device, none) - base) / n for name in layers)
    step = base + extra
    tokens = works["none"].tokens
    return Timing(device.label, step, tokens / step if step else 0.0, extra / base if base else 0.0)
