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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recompute.core.policy import OFFLOAD_POLICIES
from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase

__all__ = ["Site", "chain", "chain_positions", "chain_sites", "kind_keys", "lead_picks", "leads"]

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
    the layers below keep of the shared tensors beyond what the short model's keep (the module's note)."""


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
        out[key] = Site(rec, x, sum(left[x + 2 :]) + here - shared[key[3]])
    return out
