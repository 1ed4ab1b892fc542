"""``StepTracker``: MemTracker that also knows the phase of the step and who saved each tensor for backward.

Built on ``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode that counts every tensor
storage alive, real or fake, by category), through ``PortableMemTracker`` (one dispatch on every torch). On top
of it this class records

- the peak of every phase of the step (forward / backward / optimizer, and which layer), so the phase of the
  overall peak is known and a trace of a few identical layers can be scaled up (``_scale.py``);
- every storage autograd saves during the forward (a saved-tensor pack hook), with the layer and component
  (the layer's child module that was running) and the op that saved it;
- host memory apart: the copies an ``offload`` layer makes of what it saves (``recompute.offload`` makes them
  inside ``host_copies()``) are host memory, not device memory, even when both are the CPU; they count in
  ``host_bytes``/``host_peak`` and their saved records are marked ``host``. The device copies the backward
  brings them back in are device memory like any other, and also followed apart, by the layer that offloaded
  them (``phase_fetched``): a layer's backward holds the copies of the layer below it, prefetched.

Note: [lean peak tracking] MemTracker updates a peak snapshot for every module it has seen after every op,
which is quadratic in the layer count (minutes for a 32-layer model); only the global and per-phase peaks are
kept here.

Over 400 lines because it is one ``MemTracker`` subclass: phases, saved-tensor owners and host memory all hook the
same dispatch (CUDA's blocks, kernel scratch and the allocation stream are ``DeviceEvents``', its base).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from recompute._compat import current_autograd_node
from recompute.offload import copying_to_host
from recompute.trace._cuda import fp32_statistics
from recompute.trace._events import DeviceEvents, storages

__all__ = ["Phase", "SavedRecord", "StepTracker", "component_of", "python_saver", "storages"]

_WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module"})
_STATE_KINDS = frozenset({"Parameter", "Buffer"})
_DEVICE = torch.ops.prim.device.default
_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_TO_COPY = torch.ops.aten._to_copy.default


@dataclass(frozen=True, order=True)
class Phase:
    """Where in the step memory was measured: ``stage`` (forward, backward, optimizer) and ``part``."""

    stage: str
    """``forward``, ``backward`` or ``optimizer``."""
    part: str
    """``embedding``, ``layer``, ``head`` (output layer and loss) or ``step``."""
    layer: int = -1
    """Layer index when ``part == "layer"``."""

    def order(self) -> tuple[int, int, int]:
        """Position in the step: forward, backward, optimizer; parts and layers in the order they run."""
        stage = {"forward": 0, "backward": 1, "optimizer": 2}.get(self.stage, 3)
        part = {"embedding": 0, "layer": 1, "head": 2}.get(self.part, 0)
        if self.stage == "backward":
            return stage, 2 - part, -self.layer
        return stage, part, self.layer

    def __str__(self) -> str:
        if self.stage == "optimizer":
            return "optimizer step"
        if self.part == "layer":
            return f"{self.stage} of layer {self.layer}"
        return f"{self.stage} ({'head and loss' if self.part == 'head' else self.part})"


@dataclass
class SavedRecord:
    """One storage autograd saved for the backward (counted once, by its first saver)."""

    nbytes: int
    layer: int
    """Layer index, or -1 for the embedding and -2 for the head and loss."""
    component: str
    """The layer's child module that was running (``attention``, ``mlp``, ``norms``), ``checkpoint`` (the kept
    input of a whole-layer checkpoint) or ``other`` (saved by the layer itself, or outside the layers)."""
    op: str = "?"
    """The backward node that reads it (``MmBackward0``), or ``checkpoint`` for a checkpoint's kept inputs."""
    host: bool = False
    """Kept in host memory (an ``offload`` layer's copy), not on the device."""


def component_of(child: str) -> str:
    """Component of a layer's child module, by name: ``norm1``/``ln_2`` -> norms, ``attn`` -> attention, ..."""
    name = child.lower()
    if "norm" in name or name.startswith("ln"):
        return "norms"
    if "attn" in name or "attention" in name:
        return "attention"
    if any(k in name for k in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "mlp"
    return "other"


class StepTracker(DeviceEvents):
    """MemTracker with per-phase peaks and attribution of saved tensors; see the module docstring.

    Call ``set_stage`` with ``forward``, ``backward`` and ``optimizer`` as the step goes; install ``pack`` and
    ``unpack`` as saved-tensor hooks around the forward (``_step.run_step`` does both).
    """

    def __init__(self, layers: Iterable[nn.Module], *, cuda: bool = False) -> None:
        super().__init__(cuda=cuda)
        self.stage = "setup"
        self.layers = list(layers)
        self.phase_peaks: dict[Phase, tuple[int, dict[str, int]]] = {}
        """Largest total bytes seen in each phase, with the breakdown by category at that moment."""
        self.saved: list[SavedRecord] = []
        self._saved_by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._fqns: dict[str, int] = {}
        self._layers_done: set[int] = set()
        self.host_bytes = 0
        """Host-memory bytes alive now (offloaded saved tensors), outside every device figure."""
        self.host_peak = 0
        """The most host-memory bytes alive at once."""
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._host_layer: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a host copy's storage -> its saver
        self._fetching: int | None = None  # the layer whose host copy the op being dispatched copies back
        self._fetched: dict[int, int] = {}
        self.phase_fetched: dict[Phase, dict[int, int]] = {}
        """Bytes alive at each phase's peak of the device copies of offloaded tensors that the backward brought
        back, by the layer that saved them (phases without any left out)."""
        self.counter: Any = None
        """Handed every op after it ran (``PhaseFlops.count``), when set."""
        self._owners: WeakIdKeyDictionary | None = None
        self._shared: dict[int, int] = {}  # id of a shared storage's winfo -> its bytes
        self.shared_bytes = 0
        """Bytes alive now of what the forward allocated before the first layer (``track_owners``)."""
        self.phase_shared: dict[Phase, int] = {}
        """``shared_bytes`` at each phase's peak (``track_owners``)."""

    def track_owners(self) -> None:
        """Also note which layer's forward allocated each storage (``left_by_layer``), and follow what the
        forward allocated before the first layer, which the layers share (``shared_bytes``, ``phase_shared``)."""
        self._owners = WeakIdKeyDictionary()

    def left_by_layer(self) -> tuple[int, ...]:
        """Bytes alive now that each layer's forward allocated (after ``track_owners``; zeros without it)."""
        out = [0] * len(self.layers)
        for st, j in (self._owners or {}).items():
            info = self._WINFO.get(st)
            if j >= 0 and info is not None:
                out[j] += info[0].mem_consumed
        return tuple(out)

    def _own(self, new: list[torch.UntypedStorage]) -> None:
        """Note the owner of storages just allocated: the layer running the forward, or -1 before the first."""
        phase = self.phase()
        if phase.stage != "forward" or phase.part not in ("layer", "embedding"):
            return
        owner = phase.layer if phase.part == "layer" else -1
        for st in new:
            self._owners[st] = owner  # type: ignore[index]
            info = self._WINFO.get(st)
            if owner == -1 and info is not None:
                self._shared[id(info[0])] = info[0].mem_consumed
                self.shared_bytes += info[0].mem_consumed

    def _delete_callback(self, winfo: Any, w_st: Any) -> None:
        self.shared_bytes -= self._shared.pop(id(winfo), 0)
        super()._delete_callback(winfo, w_st)

    # --- phases ---------------------------------------------------------------------------------------

    def set_stage(self, stage: str) -> None:
        """Enter ``forward``, ``backward`` or ``optimizer``."""
        self.stage = stage
        self._layers_done = set()
        self.mark(stage)

    def current_total(self) -> int:
        """Bytes tracked right now, over all devices."""
        return sum(snap["Total"] for snap in self._curr_mem_snap.values())

    def _layer_now(self) -> int:
        """Index of the layer running (forward) or being differentiated (backward); -1 outside the layers."""
        if len(self._fqns) < len(self.layers):
            known = [self._mod_tracker.get_known_fqn(m) for m in self.layers]
            self._fqns = {fqn: i for i, fqn in enumerate(known) if fqn is not None}
        active = [self._fqns[p] for p in self._mod_tracker.parents if p in self._fqns]
        if not active:
            return -1
        return min(active) if self.stage == "backward" else max(active)

    def phase(self) -> Phase:
        """The phase the step is in now."""
        if self.stage not in ("forward", "backward"):
            return Phase(self.stage, "step")
        j = self._layer_now()
        if j >= 0:
            self._layers_done.add(j)
            return Phase(self.stage, "layer", j)
        before = not self._layers_done
        if self.stage == "forward":
            return Phase("forward", "embedding" if before else "head")
        return Phase("backward", "head" if before else "embedding")

    def _update_peak_stats(self, peak_state: Any) -> None:
        total = self.current_total()
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)
        phase = self.phase()
        best = self.phase_peaks.get(phase)
        if best is None or total > best[0]:
            self.phase_peaks[phase] = (total, _merged(self._curr_mem_snap))
            if self._owners is not None:
                self.phase_shared[phase] = self.shared_bytes
            fetched = {j: v for j, v in self._fetched.items() if v}
            if fetched:
                self.phase_fetched[phase] = fetched
            elif phase in self.phase_fetched:
                del self.phase_fetched[phase]

    # --- dispatch ------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """``PortableMemTracker``'s, and each op handed to ``counter`` (a ``PhaseFlops``) when one is set.

        Note: [device queries] Every ``.device`` of a fake tensor that C++ asks (the autograd engine does, for
        each gradient) is an op, ``prim.device``: most of the ops of a fake backward. It allocates nothing and
        runs no kernel: the base notes the peak, and nothing else is done for it."""
        if func is _DEVICE:
            return super().__torch_dispatch__(func, types, args, kwargs)
        run = fp32_statistics(func) if self.cuda and func is _LAYER_NORM else func
        if func is _TO_COPY and len(self._host_layer) and isinstance(args[0], torch.Tensor):
            self._fetching = self._host_layer.get(args[0].untyped_storage())  # a host copy coming back
        try:
            out = super().__torch_dispatch__(run, types, args, kwargs)
        finally:
            self._fetching = None
        if out is not NotImplemented:
            self.count_scratch(func, args)
        if self.counter is not None and out is not NotImplemented:
            self.counter.count(self.phase(), func, args, kwargs or {}, out)
        return out

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        """MemTracker's, but for frozen parameters (``requires_grad=False``, such as a router's correction bias):
        they never get a gradient, and a gradient hook cannot be registered on them."""
        for p in module.parameters():
            if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    # --- host memory ---------------------------------------------------------------------------------

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if copying_to_host():
            self._track_host(t)
            return
        wanted = self._owners is not None or self.cuda or self._fetching is not None
        new = [st for st in storages(t) if st not in self._WINFO] if wanted else []
        super()._track(reftype, t)
        if self.cuda:
            self._blocks(new)
        if new and self._owners is not None:
            self._own(new)
        if new and self._fetching is not None:
            self._fetched_back(new, self._fetching)

    def _track_host(self, t: torch.Tensor) -> None:
        for st in storages(t):
            if st in self._host:
                continue
            nbytes = st.nbytes()
            self._host[st] = nbytes
            self.host_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)
            weakref.finalize(st, self._host_freed, nbytes)

    def _host_freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _fetched_back(self, new: list[torch.UntypedStorage], layer: int) -> None:
        """Follow the device copies just made of layer ``layer``'s host copies, until they are freed."""
        for st in new:
            info = self._WINFO.get(st)
            nbytes = info[0].mem_consumed if info is not None else 0
            self._fetched[layer] = self._fetched.get(layer, 0) + nbytes
            weakref.finalize(st, self._fetched_freed, layer, nbytes)

    def _fetched_freed(self, layer: int, nbytes: int) -> None:
        self._fetched[layer] -= nbytes

    # --- who saved what -------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: record ``t``'s storage the first time it is saved (see ``unpack``)."""
        if self.stage != "forward":
            return t
        st = next(storages(t))
        if st in self._saved_by_storage:
            return t
        info = self._WINFO.get(st)
        if info is not None and str(info[0].reftype.value) in _STATE_KINDS:
            return t  # a parameter or buffer (a weight saved by a matmul), not an activation
        record = self._new_record(st, info)
        if record.nbytes == 0 and record.op == "checkpoint":
            return t  # the empty tensor torch <= 2.11's checkpoint saves besides its inputs: not an activation
        record.host = st in self._host
        if record.host:
            self._host_layer[st] = record.layer
        self._saved_by_storage[st] = record
        self.saved.append(record)
        weakref.finalize(st, self._saved_freed, record)
        return _Packed(t, record)

    def _saved_freed(self, record: SavedRecord) -> None:
        """A saved storage freed during the forward was not kept for the backward: its record is dropped.

        Note: [dropped branches] autograd saves for every op that records, but a branch whose output the loss
        does not use (DeepSeek-V3's router picks its groups by ``topk`` of scores it then discards) is freed with
        its graph during the forward: 896 B per MoE layer of a small DeepSeek-V3 (issue 28).
        """
        if self.stage == "forward":
            self._drop(record)

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the backward node that first reads a record's tensor names its saver.

        Note: [saver by grad_fn] autograd saves an op's inputs before the op runs and its outputs after, so
        the op being dispatched cannot tell who saves; the node that unpacks in the backward can. A tensor
        read back during the forward (the chunked loss takes its gradients there) was not kept for the
        backward: its record is dropped.
        """
        if not isinstance(packed, _Packed):
            return packed
        if self.stage == "forward":
            self._drop(packed.record)
        if packed.record.op == "?":
            node = current_autograd_node()
            packed.record.op = node.name() if node is not None else "?"
        return packed.tensor

    def _drop(self, record: SavedRecord) -> None:
        """Forget ``record`` (the very object: records of equal fields are other tensors)."""
        for i in range(len(self.saved) - 1, -1, -1):  # a record read back in the forward is a recent one
            if self.saved[i] is record:
                del self.saved[i]
                return

    def _new_record(self, st: torch.UntypedStorage, info: Any) -> SavedRecord:
        nbytes = info[0].mem_consumed if info is not None else st.nbytes()
        layer, child = self._context()
        saver = python_saver()
        if child is not None:
            component = component_of(child)
        else:
            component = "checkpoint" if saver == "checkpoint" and layer >= 0 else "other"
        return SavedRecord(nbytes=nbytes, layer=layer, component=component, op=saver or "?")

    def _context(self) -> tuple[int, str | None]:
        """(layer index or -1/-2 outside the layers, name of the layer's child module running or None)."""
        phase = self.phase()
        if phase.part != "layer":
            return (-1 if phase.part == "embedding" else -2), None
        prefix = next(f for f, i in self._fqns.items() if i == phase.layer) + "."
        children = [p[len(prefix) :].split(".") for p in self._mod_tracker.parents if p.startswith(prefix)]
        names = [next((n for n in parts if n not in _WRAPPER_NAMES), None) for parts in children]
        named = sorted({n for n in names if n is not None})
        return phase.layer, (named[0] if named else None)


class _NoHook:
    """A hook handle for a hook never registered (``StepTracker._track_module_params_and_buffers``)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


@dataclass
class _Packed:
    """What the pack hook hands autograd: the tensor itself and its record."""

    tensor: torch.Tensor
    record: SavedRecord


def _merged(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """One ``{category: bytes}`` over all devices, with plain string keys (``Activation``, ``Total``, ...)."""
    out: dict[str, int] = {}
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = str(getattr(key, "value", key))
            out[name] = out.get(name, 0) + value
    return out


def python_saver(depth: int = 3) -> str | None:
    """``checkpoint`` or the autograd Function's name when the save comes from Python, else None.

    Non-reentrant ``torch.utils.checkpoint`` keeps its inputs through a saved tensor made in Python (through
    its own autograd Function, ``_NoopSaveInputs``, before torch 2.12: also ``checkpoint``); custom
    ``autograd.Function``s save theirs from ``Function.apply``. aten ops save from C++ (no Python frame).
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith("torch/utils/checkpoint.py"):
            return "checkpoint"
        cls = frame.f_locals.get("cls") if frame.f_code.co_name == "apply" else None
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            return "checkpoint" if cls.__module__ == "torch.utils.checkpoint" else cls.__name__
        frame = frame.f_back
    return None
