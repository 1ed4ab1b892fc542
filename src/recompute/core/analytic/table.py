"""The analytic model's ``CostTable`` of a preset: what ``estimate`` computes, per layer and option.

The peak ``estimate`` gives for any per-layer policy is the table's composed peak (tests/test_plan.py holds
the two equal): a layer's backward holds everything the layer stores under ``none`` whatever its policy (the
replay brings the rest back), the layers below hold what their policies store, an offloaded layer below is
being copied back, and the gradients made so far exist; the loss phase holds every stored byte and the
logits; the embedding's backward and the optimizer step are the same for every plan. The analytic model
prices no layer's forward phase (the loss phase is above it). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from recompute.core.analytic.estimate import (
    after_backward,
    gradient_arrival,
    in_flight,
    resident_states,
)
from recompute.core.analytic.flops import layer_flops, model_flops
from recompute.core.analytic.memory import LayerActivations, layer_activations, outer_activations
from recompute.core.analytic.params import model_states
from recompute.core.analytic.sharding import gathered
from recompute.core.costs import NEVER, CostTable, KindCosts, LinkCost, TopCost
from recompute.core.identity import spec_id
from recompute.core.policy import POLICIES
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

__all__ = ["analytic_table", "analytic_tables", "with_loss"]


def analytic_table(
    spec: ModelSpec,
    wl: Workload,
    *,
    seconds: Mapping[str, float] | None = None,
    model_seconds: float | None = None,
    offload: float | None = None,
    cost_kind: str = "FLOPs",
    device: dict[str, Any] | None = None,
) -> CostTable:
    """The cost table of ``spec``'s first pipeline stage under ``wl``.

    Args:
        seconds: per recompute policy, the seconds it adds to one layer (priced on a device by
            ``recompute.core.pricing``); with ``model_seconds``, the step's seconds without recomputation.
            Without them the costs are FLOPs.
        offload: the cost of offloading one layer, in the table's unit (``recompute.core.pricing.offload_seconds``
            on a device); None leaves offload out.
    """
    wl.check(spec)
    n = -(-spec.n_layers // wl.pp)
    options = (*POLICIES, *(("offload",) if offload is not None else ()))
    k = in_flight(wl)
    outer = outer_activations(spec, wl, last_stage=wl.pp == 1)
    states = model_states(spec, wl)
    resident = resident_states(wl, states)
    grads = gradient_arrival(spec, wl, states)
    embedding = k * outer.embedding
    held_anyway = embedding + outer.kept_logits  # the training loop holds its logits to the end of the step
    if spec.transformers:  # the first layer keeps the tables the others share; MoE and dense layers differ
        layers = [layer_activations(spec, wl, i) for i in range(n)]
    else:
        layers = [layer_activations(spec, wl)] * n
    kinds, layer_kind = _kinds(spec, wl, layers, options, seconds, offload, k)
    after, phase = after_backward(spec, wl, states, held_anyway, logits=outer.kept_logits)
    sharded = gathered(spec, wl) if wl.fsdp else None  # FSDP's gathered parameters and unsharded gradients
    return CostTable(
        model=spec.name,
        model_hash=spec_id(spec).hash,
        workload=wl.to_dict(),
        kinds=kinds,
        layer_kind=layer_kind,
        links={
            (a, b): {p: {q: LinkCost(kinds[a].kept[p], 0.0) for q in options} for p in options}
            for a in set(layer_kind)
            for b in set(layer_kind)
        },
        last={p: TopCost(kinds[layer_kind[-1]].kept[p], 0.0, 0.0, 0.0) for p in options},
        base_forward=(NEVER,) * n,
        base_backward=tuple(
            resident
            + la.total
            + la.workspace
            + held_anyway
            + grads.before(i, n)
            + (sharded.backward(i) if sharded else 0)
            for i, la in enumerate(layers)
        ),
        head_forward=resident
        + embedding
        + outer.head
        + outer.logits
        + outer.loss_transient
        + (sharded.loss() if sharded else 0.0),
        head_backward=NEVER,
        fixed={phase: resident + after},
        model_layers=spec.n_layers,
        model_flops=model_flops(spec, wl),
        tokens=wl.tokens,
        in_flight=k,
        stages=wl.pp,
        model_seconds=model_seconds if seconds is not None else None,
        device=device,
        cost_kind=cost_kind if seconds is not None else "FLOPs",
        phase_names={"head_forward": "loss", "head_backward": "loss"},
        source="the analytic model (Korthikanti et al. 2022, by component)",
        states=states.total,
    )


def with_loss(wl: Workload, loss: str) -> Workload:
    """``wl`` in another loss mode (its chunk kept for the chunked loss, dropped for the full one)."""
    if loss == wl.loss:
        return wl
    return replace(wl, loss=loss, loss_chunk=wl.loss_chunk if loss == "chunked" else None)


def analytic_tables(
    spec: ModelSpec, wl: Workload, *, losses: Sequence[str] = (), offload: float | None = None
) -> tuple[CostTable, ...]:
    """The tables of ``wl``'s own loss mode and of each other mode in ``losses``, costs in FLOPs (``offload``:
    one offloaded layer's cost in FLOPs, None to leave offload out)."""
    modes = dict.fromkeys((wl.loss, *losses))
    return tuple(analytic_table(spec, with_loss(wl, mode), offload=offload) for mode in modes)


def _kinds(
    spec: ModelSpec,
    wl: Workload,
    layers: Sequence[LayerActivations],
    options: Sequence[str],
    seconds: Mapping[str, float] | None,
    offload: float | None,
    k: float,
) -> tuple[tuple[KindCosts, ...], tuple[int, ...]]:
    """The stage's layers grouped into kinds of equal figures (a transformers spec's first layer keeps the
    shared tables; MoE and dense layers differ)."""
    found: dict[Any, int] = {}
    kinds: list[KindCosts] = []
    layer_kind = []
    for i, la in enumerate(layers):
        lf = layer_flops(spec, wl, i)
        signature = (la, lf)
        if signature not in found:
            found[signature] = len(kinds)
            timed = dict(seconds or {})
            if seconds is not None and offload is not None:
                timed["offload"] = offload
            flops = {p: lf.recomputed(p) for p in options}
            if seconds is None and offload is not None:
                flops["offload"] = offload  # the offload price in the FLOP unit the caller chose
            kinds.append(
                KindCosts(
                    name="MoE layer" if spec.is_moe(i) else "layer",
                    options=tuple(options),
                    forward=dict.fromkeys(options, 0.0),
                    kept={p: la.stored(p) for p in options},
                    flops=flops,
                    seconds={p: timed[p] for p in options} if seconds is not None else {},
                    below={p: la.offloaded(p) for p in options},
                    host={p: k * la.offloaded(p) for p in options},
                )
            )
        layer_kind.append(found[signature])
    return tuple(kinds), tuple(layer_kind)
