"""Communication: the links a job's GPUs talk over, what a collective costs there, and where its groups sit.
Torch-free.

A collective of S bytes (nccl-tests' size: the all-reduce buffer, the whole gathered or scattered array) over
n ranks moves S * f(n) bytes through each rank's link, f the bus-bandwidth factor nccl-tests defines
(``doc/PERFORMANCE.md``): 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
a send/receive. A link of bus bandwidth B then takes S f(n) / B, plus latency: NCCL's own tuning model
(``src/graph/tuning.cc``, Simple protocol) charges a base 8.4 us and, per ring step, the step latency of the
link crossed (2(n-1) steps for an all-reduce, n-1 for the others); its tree all-reduce takes 2 log2(nodes)
inter-node steps and 2(n/nodes - 1) intra-node ones, at 0.46 B (a tree moves each element twice, and NCCL
derates it by 0.92). A collective costs the faster of ring and tree, as NCCL picks. Across nodes, B is the
adapters of the group's ranks on one node side by side (NCCL runs one ring per adapter): k ranks per node
reach k times one GPU's InfiniBand bandwidth, at most the NVLink's.

Where a group sits decides its link (``Layout``): Megatron's rank order puts tensor parallelism innermost, then
data (and expert) parallelism, then pipeline stages, so a tensor-parallel group of t <= gpus-per-node ranks is
on one node's NVLink/NVSwitch (or PCIe), a data-parallel group strides t ranks and crosses nodes once t * d
exceeds a node, and pipeline neighbours are t * d ranks apart.

A measured profile (``recompute calibrate --collectives``) replaces the model within a node: bus bandwidth
against size per collective, interpolated log-log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from recompute.core.errors import ConfigError, positive_int, require
from recompute.core.timing import COLLECTIVES, COMM_PREFIX, Curve, Op

__all__ = [
    "BASE_LATENCY",
    "COMM_SHARE",
    "KINDS",
    "Comm",
    "Layout",
    "Link",
    "Network",
    "bus_factor",
    "comm_name",
    "comms_of",
    "parse_comm",
    "summarize",
]

KINDS = COLLECTIVES
"""The collectives priced (``send_recv``: a pipeline's point-to-point activations)."""

BASE_LATENCY = 8.4e-6
"""Seconds every collective pays once: NCCL's ``baseLat`` for ring and tree, Simple protocol
(NVIDIA/nccl src/graph/tuning.cc, commit b6475625)."""

TREE_SHARE = 0.5 * 0.92
"""The algorithm bandwidth of NCCL's tree all-reduce over the link's bus bandwidth (tuning.cc: busBw * .92,
then * .5 to algorithm bandwidth)."""

COMM_SHARE = 0.8
"""Share of a link's datasheet per-direction bandwidth that NCCL's bus bandwidth reaches on large messages:
240 of 300 GB/s on 8 A100 SXM over NVLink (published nccl-tests figures: 230-250 GB/s; NCCL's own tuning model
capped A100 at 235). A stated allowance for a link not measured."""


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes through each rank's link per byte of the collective's size."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "send_recv":
        return 1.0
    raise ConfigError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


def _ring_steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else 1 if kind == "send_recv" else n - 1


@dataclass(frozen=True)
class Link:
    """One kind of link between GPUs: its datasheet bandwidth per direction, its per-step latency, the source."""

    name: str
    """``NVLink 4 (NVSwitch)``, ``PCIe Gen5 x16``, ``InfiniBand NDR 400 Gb/s``, ..."""
    bandwidth: float
    """Bytes per second per direction per GPU, as the datasheet states."""
    latency: float
    """Seconds per ring step (NCCL's ``hwLat``, Simple protocol: NVLink 3.4 us, PCIe 5.7, network 14)."""
    source: str = ""
    busbw: float | None = None
    """Bus bandwidth NCCL reaches on it, where measured or published; else ``COMM_SHARE`` of the datasheet."""

    @property
    def achieved(self) -> float:
        return self.busbw if self.busbw is not None else COMM_SHARE * self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "source": self.source,
            "busbw": self.busbw,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Link:
        busbw = data.get("busbw")
        return cls(
            name=str(data["name"]),
            bandwidth=float(data["bandwidth"]),
            latency=float(data["latency"]),
            source=str(data.get("source", "")),
            busbw=None if busbw is None else float(busbw),
        )


@dataclass(frozen=True)
class Network:
    """How the GPUs of a job talk: each GPU's link within its node and to other nodes, the GPUs per node, and
    (from ``recompute calibrate --collectives``) the bus bandwidth measured per collective within a node."""

    intra: Link
    inter: Link
    gpus_per_node: int = 8
    measured: dict[str, Curve] = field(default_factory=dict)
    """Bus bandwidth (bytes/s) against the collective's size (bytes), by kind, measured on ``ranks`` ranks."""
    ranks: int = 0
    """How many ranks the measured curves were taken on (0: none measured)."""
    backend: str = ""
    """The process-group backend measured (``nccl``, ``gloo``)."""
    notes: tuple[str, ...] = ()

    def seconds(self, kind: str, nbytes: float, n: int, nodes: int = 1) -> float:
        """Seconds of one collective of ``nbytes`` over ``n`` ranks spread over ``nodes`` nodes."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        curve = self.measured.get(kind)
        if curve is not None and nodes == 1:
            return nbytes * bus_factor(kind, n) / curve(nbytes)
        return min(self._ring(kind, nbytes, n, nodes), self._tree(kind, nbytes, n, nodes))

    def _ring(self, kind: str, nbytes: float, n: int, nodes: int) -> float:
        steps = _ring_steps(kind, n)
        inter = 0 if nodes == 1 else (2 * nodes if kind == "all_reduce" else nodes - 1)
        inter = min(inter, steps)
        latency = BASE_LATENCY + (steps - inter) * self.intra.latency + inter * self.inter.latency
        return latency + nbytes * bus_factor(kind, n) / self.busbw(n, nodes)

    def _tree(self, kind: str, nbytes: float, n: int, nodes: int) -> float:
        if kind != "all_reduce":
            return math.inf
        per_node = max(1, n // nodes)
        latency = BASE_LATENCY + 2 * ((per_node - 1) * self.intra.latency + _log2(nodes) * self.inter.latency)
        return latency + nbytes / (TREE_SHARE * self.busbw(n, nodes))

    def busbw(self, n: int, nodes: int) -> float:
        """Bus bandwidth of a group of ``n`` ranks over ``nodes`` nodes: the intra-node link's; across nodes, the
        adapters of the group's ranks on a node side by side (NCCL runs a ring per adapter), at most the intra
        link's."""
        if nodes == 1:
            return self.intra.achieved
        return min(self.intra.achieved, max(1, n // nodes) * self.inter.achieved)

    def to_dict(self) -> dict[str, Any]:
        return {
            "intra": self.intra.to_dict(),
            "inter": self.inter.to_dict(),
            "gpus_per_node": self.gpus_per_node,
            "collectives": {k: [list(p) for p in c.points] for k, c in self.measured.items()},
            "ranks": self.ranks,
            "backend": self.backend,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Network:
        return cls(
            intra=Link.from_dict(data["intra"]),
            inter=Link.from_dict(data["inter"]),
            gpus_per_node=int(data.get("gpus_per_node", 8)),
            measured={k: Curve(tuple(tuple(p) for p in v)) for k, v in (data.get("collectives") or {}).items()},
            ranks=int(data.get("ranks", 0)),
            backend=str(data.get("backend", "")),
            notes=tuple(data.get("notes", ())),
        )


def _log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks sit, in Megatron's order (``tp-cp-ep-dp-pp``): tensor parallelism innermost, then
    data parallelism (expert-parallel groups are consecutive data-parallel ranks), then pipeline stages."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    gpus_per_node: int = 8

    @property
    def world(self) -> int:
        return self.tp * max(self.dp, self.ep) * self.pp

    def group(self, name: str) -> tuple[int, int]:
        """(ranks, nodes) of one group of ``name`` (``tp``, ``dp``, ``ep``, ``pp``)."""
        n, stride = {
            "tp": (self.tp, 1),
            "dp": (self.dp, self.tp),
            "ep": (self.ep, self.tp),
            "pp": (self.pp, self.tp * max(self.dp, self.ep)),
        }.get(name, (1, 1))
        return n, _nodes(n, stride, self.gpus_per_node)

    def check(self) -> None:
        """Refuse a layout whose groups do not tile the nodes.

        Raises:
            ConfigError: gpus_per_node not dividing (or divided by) the tensor-parallel size or the size of a
                tensor x data block, or a job larger than a node that does not fill whole nodes.
        """
        g = positive_int("gpus_per_node", self.gpus_per_node, at_most=2**16)
        for name, size in (("tp", self.tp), ("tp*dp", self.tp * max(self.dp, self.ep))):
            require(
                size % g == 0 or g % size == 0,
                f"a {name} group of {size} ranks does not divide into nodes of gpus_per_node {g} GPUs (nor do they "
                f"divide into it); use a gpus_per_node that {size} divides or that divides {size}",
                fields=("gpus_per_node",),
            )
        require(
            self.world <= g or self.world % g == 0,
            f"t*d*p = {self.world} GPUs do not fill whole nodes of gpus_per_node {g}; use a multiple of {g} GPUs, "
            "or set gpus_per_node to what a node holds",
            fields=("gpus_per_node",),
        )


def _nodes(n: int, stride: int, per_node: int) -> int:
    """Nodes a group of ``n`` ranks ``stride`` apart covers (ranks numbered node by node)."""
    if n <= 1:
        return 1
    if stride >= per_node:
        return n
    return len({(k * stride) // per_node for k in range(n)})


def comm_name(kind: str, group: str, n: int, *, replay: bool = False) -> str:
    """The work-signature name a traced collective is filed under: ``comm.all_reduce.tp.8`` (``.replay``: run
    again by a checkpoint's recomputation)."""
    return f"{COMM_PREFIX}{kind}.{group}.{n}" + (".replay" if replay else "")


def parse_comm(name: str) -> tuple[str, str, int, bool] | None:
    """(kind, group, ranks, replayed) of a collective's work-signature name, or None for a kernel."""
    if not name.startswith(COMM_PREFIX):
        return None
    parts = name[len(COMM_PREFIX) :].split(".")
    return parts[0], parts[1], int(parts[2]), len(parts) > 3 and parts[3] == "replay"


@dataclass(frozen=True)
class Comm:
    """Collectives of one kind, size and group filed in one phase of a traced step."""

    phase: str
    """``forward``, ``backward``, ``replay`` (a checkpoint's recomputation, in the backward) or ``optimizer``."""
    where: str
    """The step phase it ran in (``forward of layer 3``)."""
    kind: str
    group: str
    ranks: int
    nbytes: int
    count: int
    critical: bool
    """On the step's critical path (forward and replay); a backward one overlaps the weight-gradient matmuls."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "where": self.where,
            "kind": self.kind,
            "group": self.group,
            "ranks": self.ranks,
            "bytes": self.nbytes,
            "count": self.count,
            "critical": self.critical,
        }


def comms_of(phases: Mapping[str, Iterable[Op]]) -> list[Comm]:
    """Every collective of a traced step's phases (``StepWork.phases``), with its phase and overlap."""
    out = []
    for where, ops in phases.items():
        stage = "optimizer" if where.startswith("optimizer") else where.split(" ")[0]
        for name, _, _, nbytes, count in ops:
            parsed = parse_comm(name)
            if parsed is None:
                continue
            kind, group, n, replay = parsed
            phase = "replay" if replay else stage
            out.append(Comm(phase, where, kind, group, n, nbytes, count, phase in ("forward", "replay")))
    return out


def summarize(comms: Iterable[Comm]) -> list[dict[str, Any]]:
    """Collectives added up by phase, kind and group: count and bytes, in the step's order of phases."""
    out: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for c in comms:
        row = out.setdefault(
            (c.phase, c.kind, c.group, c.ranks),
            {"phase": c.phase, "kind": c.kind, "group": c.group, "ranks": c.ranks, "count": 0, "bytes": 0},
        )
        row["count"] += c.count
        row["bytes"] += c.count * c.nbytes
        row["critical"] = c.critical
    order = {"forward": 0, "backward": 1, "replay": 2, "optimizer": 3}
    return sorted(out.values(), key=lambda r: (order.get(r["phase"], 4), r["kind"], r["group"]))
