"""The chained step of a profile: every link between layers measured in one model (``profile``'s step 2).

Note: [one step for every link] A layer's figures depend on its own policy and the next layer's, not on where
it stands nor on the layers before it, given three things put right here:

- the layers above the next one leave gradients and what their forward keeps to the end of the step (a key and
  value cache's entries) allocated through the layer's backward: ``StepRecord.layer_left`` and ``layer_grads``
  say how much, and ``_Site.above`` takes it off;
- what the layers share (rotary tables, masks, position ids: made before the first layer) is kept for the
  backward by the first layer that saves it, so the chain starts with the first layer of each kind under every
  policy (``lead_picks``): no measured layer saves it first;
- how long those shared tensors live in the backward depends on the layers below (a checkpoint keeps its
  inputs): a short model's layers below run the measured layer's policy, the chain's leading layers keep all of
  it; an anchor step whose leading layers run that policy measures how much they keep (``_chain_sites``).

So the links are measured in one model whose layers walk an Euler path through the graph of transitions
(Hierholzer): about one layer per transition, where a short model per transition takes four.
tests/test_profile.py holds the result to short models of single transitions, byte for byte.

Note: [dropped as the forward ends] Under autocast over fp32 weights a layer's cast weights live to the end of
the forward (Note: [the weight cache]); a checkpointed layer saves none of them, so they are freed before the
backward begins (``StepRecord.layer_dropped``). Measured from the layer's start, its backward's peak would then
be lower by what the checkpointed layers below it dropped: a figure of its position, not of its own policy and
the next one's. The sites count it back in, as if the layers below had dropped nothing, which is how a cost
table composes the backward (what a layer holds is its forward's growth): the composed backward peaks of
checkpointed layers under amp are high by what the layers below them drop (their cast weights), never low.

Note: [the chain in parts] Since a layer's figures do not depend on where it stands, the walk can be cut into parts,
each a model of its own (the leading layers, its stretch of the walk, the last layer), traced side by side in worker
processes (Note: [steps in workers]): one long step would leave the other CPUs idle while it runs. Each stretch
starts with the node the one before it ends with, so every transition is in one part; a part repeats the leading
layers, so none is shorter than ``MIN_PART`` transitions. Within a step a layer's figures are the same wherever it
stands, but a step's length can shift every backward figure in it alike: Gemma 2's shared bytes alive through the
backward grow with the model's layer count (8 bytes between parts of 41 and 39 layers). So each part starts (after
its leading layers) with a walk of every pair of kinds under ``none``, its own references, and its backward figures
are moved by what its references measure beyond the first part's (``_profile._rebased``): every figure is then a
difference within one step, as in a single chain. The profile is the same however many parts
(``tests/test_profile.py``: one process and one part against workers and parts, for every zoo kind and under amp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recompute.core.policy import OFFLOAD_POLICIES
from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase

__all__ = [
    "MIN_PART",
    "Site",
    "chain",
    "chain_positions",
    "chain_sites",
    "cut",
    "dropped_below",
    "kind_keys",
    "lead_picks",
    "leads",
]

Node = tuple[int, str]
"""A layer of the chain: (kind, policy)."""


def leads(p: str, ok: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The leading layers (the first of each kind) run ``p`` where they take it: what layers share is then kept
    by them under that policy, as by the model's first layers when every layer runs it. Under offload they run
    ``none``: an offloaded first layer frees its input, the embedding's output, which a cost table counts in
    that layer's own held bytes, not in every offloaded layer's."""
    own = "none" if p in OFFLOAD_POLICIES else p
    return tuple(own if own in ok[k] else "none" for k in range(len(ok)))


def lead_picks(reps: Sequence[int], ok: Sequence[Sequence[str]]) -> list[int]:
    """The chain's leading layers: the first layer of each kind once per policy it takes, so that whatever the
    layers share is kept by one of them under every policy, before any measured layer."""
    return [reps[k] for k in range(len(reps)) for _ in ok[k]]


@dataclass(frozen=True)
class Site:
    """A layer measured in a step: the step's record and the layer's index in it."""

    rec: StepRecord
    x: int
    above: int = 0
    """Bytes at the peak of the layer's backward that a short model would not hold: what the layers beyond
    the next one leave allocated (their gradients, what their forward keeps to the end of the step), and what
    the layers below keep of the shared tensors beyond what the short model's keep (the module's note); less
    what the layers below dropped as the forward ended (``dropped_below``: negative in an anchor step)."""


def chain(pairs: Sequence[tuple[int, int]], ok: Sequence[Sequence[str]]) -> list[Node]:
    """Layers as (kind, policy) in an order in which every measured transition (a layer of kind a under p, then
    one of kind b under q, for each pair of kinds (a, b) that follow each other in the model) occurs: an Euler
    path. Where the graph is unbalanced or falls apart, transitions no link needs are added (a layer each)."""
    adj: dict[Node, list[Node]] = {}
    surplus: dict[Node, int] = {}  # edges out minus edges in
    for a, b in pairs:
        for p in ok[a]:
            for q in ok[b]:
                adj.setdefault((a, p), []).append((b, q))
                adj.setdefault((b, q), [])
                surplus[a, p] = surplus.get((a, p), 0) + 1
                surplus[b, q] = surplus.get((b, q), 0) - 1
    needs_out = [v for v in adj for _ in range(-surplus.get(v, 0))]
    needs_in = [v for v in adj for _ in range(surplus.get(v, 0))]
    for u, v in zip(needs_out, needs_in):
        adj[u].append(v)
    for v in adj:
        adj[v].reverse()  # popped from the end: in the order added
    order: list[Node] = []
    for v in list(adj):
        if adj[v]:
            order += _circuit(v, adj)
    return order


def _circuit(start: Node, adj: dict[Node, list[Node]]) -> list[Node]:
    """Hierholzer's walk from ``start`` over every edge of its (balanced) component, consuming them."""
    stack, path = [start], []
    while stack:
        v = stack[-1]
        if adj[v]:
            stack.append(adj[v].pop())
        else:
            path.append(stack.pop())
    return path[::-1]


MIN_PART = 8
"""Transitions a part of the chain walks at least (Note: [the chain in parts])."""


def cut(order: Sequence[Node], n: int) -> list[tuple[Node, ...]]:
    """``order`` cut into up to ``n`` walks of about as many transitions each, at least ``MIN_PART`` (Note: [the
    chain in parts]), each starting with the node the one before ends with."""
    steps = len(order) - 1
    n = max(1, min(n, steps // MIN_PART))
    size = -(-steps // n) if steps > 0 else 1
    return [tuple(order[i : i + size + 1]) for i in range(0, max(steps, 1), size)]


def chain_positions(chain: Sequence[Node], first: int, pairs: set[tuple[int, int]]) -> dict[tuple[Any, ...], int]:
    """Where each transition ``("pair", a, b, p, q)`` of ``chain`` is measured: the index of its first layer
    in the chained model (whose layers from ``first`` on are the chain's); the first occurrence of each."""
    out: dict[tuple[Any, ...], int] = {}
    for i in range(len(chain) - 1):
        (a, p), (b, q) = chain[i], chain[i + 1]
        key = ("pair", a, b, p, q)
        if (a, b) in pairs and key not in out:
            out[key] = first + i
    return out


def kind_keys(pairs: Sequence[tuple[int, int]], ok: Sequence[Sequence[str]]) -> list[tuple[Any, ...]]:
    """The transitions a kind's own figures come from (``_profile._kind``): a layer of it under each policy,
    then one of the last kind to follow it under ``none``."""
    follow = {a: b for a, b in sorted(pairs)}
    return [("pair", a, b, p, "none") for a, b in follow.items() for p in ok[a]]


def chain_sites(
    rec: StepRecord, positions: dict[tuple[Any, ...], int], shared: dict[str, int]
) -> dict[tuple[Any, ...], Site]:
    """Every transition measured in the chained step as a site (the module's note).

    ``shared[p]``: bytes of what the layers share alive at the peak of a layer's backward when the layers
    below it run ``p`` (an anchor step's), for the chain's amount to be replaced by it."""
    left = [g + a for g, a in zip(rec.layer_grads, rec.layer_left)]
    out = {}
    for key, x in positions.items():
        here = rec.phase_shared.get(Phase("backward", "layer", x), 0)
        out[key] = Site(rec, x, sum(left[x + 2 :]) + here - shared[key[3]] - dropped_below(rec, x))
    return out


def dropped_below(rec: StepRecord, x: int) -> int:
    """Bytes the layers below layer ``x`` allocated in their forward and freed as the forward ended: in the
    memory at its start, gone by its backward (Note: [dropped as the forward ends])."""
    return sum(rec.layer_dropped[:x])
