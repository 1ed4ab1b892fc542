"""What autograd keeps per layer on this rank, by component: the measured side of the per-rank memory model."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from recompute._compat import saved_tensors_hooks
from recompute.checkpointing import find_layers
from recompute.trace._tracker import component_of, python_saver, storages

__all__ = ["saved_bytes_per_layer"]


def saved_bytes_per_layer(
    model: nn.Module, batch: tuple[Tensor, Tensor], *, backward: bool = True
) -> list[dict[str, int]]:
    """Run ``model(*batch)`` (and its backward) and return the bytes each layer's forward left to autograd here.

    Unique storages, counted once, by the first layer that saved them; a storage several layers save (Llama's
    rotary tables) and parameters (also FSDP's gathered ones) are left out, as the analytic per-layer figure
    leaves them out. A DTensor counts its local shard. Only what is kept counts: of a checkpointed region,
    non-reentrant checkpoint keeps its inputs and nothing else.

    Components: ``attention`` (with the Q/K/V input), ``mlp`` and ``norms`` by the layer child that saved
    them, as ``layer_activations`` groups them; ``checkpoint``, the inputs checkpoints keep: the layer input
    (``block``), the sub-block inputs (``attn``, ``mlp``), or Q, K and V (``core_attn``, which
    ``layer_activations`` counts under attention, as ``qkv``).

    Args:
        model: a model whose ``forward(idx, targets)`` returns ``(logits, loss)``, parallel or not.
        batch: ``(idx, targets)``, the token ids this rank sees.
        backward: run the backward too (recomputed regions replay there; gradients accumulate).

    Returns:
        One ``{component: bytes}`` per layer, in layer order.
    """
    layers = find_layers(model)
    tracker = _Tracker(model)
    handles = []
    for i, layer in enumerate(layers):
        handles += [
            layer.register_forward_pre_hook(lambda m, a, i=i: tracker.enter(i)),
            layer.register_forward_hook(lambda m, a, o: tracker.leave()),
        ]
        for name, child in layer.named_children():
            handles += [
                child.register_forward_pre_hook(lambda m, a, name=name: tracker.enter_child(name)),
                child.register_forward_hook(lambda m, a, o: tracker.leave_child()),
            ]
    try:
        with saved_tensors_hooks(tracker.pack, lambda t: t):
            _, loss = model(*batch)
        if backward:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return tracker.per_layer(len(layers))


@dataclass
class _Saved:
    nbytes: int
    component: str
    layers: set[int] = field(default_factory=set)


class _Tracker:
    """Which layer and which of its children runs, and every storage saved meanwhile."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layer: int | None = None
        self.child: list[str] = []
        self.weights: set[StorageWeakRef] = set()
        self.saved: dict[StorageWeakRef, _Saved] = {}

    def enter(self, i: int) -> None:
        self.layer, self.child = i, []
        # Read here, not once: FSDP swaps in gathered parameters in its pre-forward hook (which runs first).
        state = [*self.model.parameters(), *self.model.buffers()]
        self.weights = {StorageWeakRef(s) for t in state for s in storages(t)}

    def leave(self) -> None:
        self.layer = None

    def enter_child(self, name: str) -> None:
        self.child.append(name)

    def leave_child(self) -> None:
        self.child.pop()

    def pack(self, t: Tensor) -> Tensor:
        if self.layer is None:
            return t
        component = component_of(self.child[0]) if self.child else "other"
        if python_saver(depth=4) == "checkpoint":
            component = "checkpoint"
        for storage in storages(t):
            key = StorageWeakRef(storage)
            if key not in self.weights:
                self.saved.setdefault(key, _Saved(storage.nbytes(), component)).layers.add(self.layer)
        return t

    def per_layer(self, n: int) -> list[dict[str, int]]:
        out: list[dict[str, int]] = [{} for _ in range(n)]
        for s in self.saved.values():
            if len(s.layers) == 1:
                parts = out[next(iter(s.layers))]
                parts[s.component] = parts.get(s.component, 0) + s.nbytes
        return out
