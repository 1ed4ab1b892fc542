"""Activation offload: a layer keeps everything it saves for the backward, in host memory (issue 15).

``Offloader`` runs an offloaded layer's forward under ``torch.autograd.graph.saved_tensors_hooks``. Its pack
hook copies each saved activation to host memory; the backward brings it back one layer ahead, so the copies
of layer i-1 overlap layer i's backward. Nothing is recomputed.

On CUDA (real tensors):

- forward: the copy to a pinned host buffer runs with ``non_blocking=True`` on a side stream that first waits
  for the compute stream; ``record_stream`` keeps the device block from being reused until the copy is done,
  so the device tensor is freed as soon as the model drops it;
- backward: when the gradient of layer i's output arrives (a hook on the output: layer i's backward is about
  to start, whatever layer i's policy), layer i's tensors are copied back if they are not yet, and layer
  i-1's, when it is offloaded, start copying back on the side stream; unpack makes the compute stream wait for
  that copy's event. At most two layers' worth is on the device at once: the one consumed, the one prefetched.

Elsewhere (the CPU, fake tensors in a trace) the same bookkeeping runs synchronously: pack copies into a
separate host tensor, the copy back (at the same moments) into a new device tensor, so the gradients come from
the copies and a trace sees the memory a GPU would hold. Host copies are made inside ``host_copies()``, which
``StepTracker`` reads to count them as host memory, not device memory.

What is kept where: parameters, tensors aliasing them (a weight's transpose), tensor subclasses (DTensor) and
tensors smaller than ``MIN_BYTES`` stay on the device. A storage several saved tensors share (views,
transposes, q/k/v splits, the layer's input that the previous layer made) is copied once, whole, and each view
rebuilt on it with its size, stride and offset. Outer saved-tensor hooks (a trace's tracker) see what stays
and, once per storage, the host copy.

Note: [limits] the top offloaded layer's copy back starts when its output gradient arrives, with nothing left
above it to overlap with. Several forwards before one backward (gradient accumulation) work, each prefetching
its own layers, but hold all their copies in host memory. Double backward (``create_graph=True``) is not
supported, as with ``save_on_cpu``. A copy is of the whole storage under a saved view.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from recompute._compat import outer_saved_tensors_hooks, saved_tensors_hooks

__all__ = ["MIN_BYTES", "Offloader", "copying_to_host", "host_copies"]

MIN_BYTES = 64 * 1024
"""Saved tensors whose storage is smaller than this stay on the device (norm statistics, masks of one row)."""

_HOST = threading.local()


@contextlib.contextmanager
def _marked(name: str) -> Iterator[None]:
    """Count this thread into the marker ``name`` of ``_HOST`` while inside (nested calls add up)."""
    setattr(_HOST, name, getattr(_HOST, name, 0) + 1)
    try:
        yield
    finally:
        setattr(_HOST, name, getattr(_HOST, name) - 1)


def host_copies() -> contextlib.AbstractContextManager[None]:
    """Mark the tensors made inside as host copies (a tracker on the CPU cannot tell them by device)."""
    return _marked("depth")


def copying_to_host() -> bool:
    """True while the offloader makes a host copy (for ``StepTracker``)."""
    return getattr(_HOST, "depth", 0) > 0


def _moving() -> contextlib.AbstractContextManager[None]:
    """Mark the ops run inside as the offloader's copies, out or back (``moving``)."""
    return _marked("moving")


def moving() -> bool:
    """True while the offloader copies a layer's tensors out or back: its copies run over the host link and are
    priced there (``recompute.core.pricing.offload_seconds``), not as the layer's kernels (for the FLOP and
    kernel counter of a trace)."""
    return getattr(_HOST, "moving", 0) > 0


def _async(t: Tensor) -> bool:
    """Whether ``t`` is copied with streams and events (real CUDA tensors) or synchronously."""
    return t.is_cuda and not is_fake(t)


@dataclass(eq=False)
class _Stash:
    """One storage's bytes in host memory, and its copy back on the device once fetched."""

    host: Tensor
    """uint8, the whole storage (pinned on CUDA)."""
    device: torch.device
    version: int
    """The saved tensor's version counter when copied: a storage changed in place since is copied again."""
    streamed: bool = False
    """Copied on a CUDA side stream (else synchronously)."""
    observed: Any = None
    """What the outer pack hook returned for the host copy, unpacked once so that it can name the reader."""
    fetched: Tensor | None = None
    """uint8 on the device, once copied back."""
    ready: Any = None
    """CUDA event of the copy back (None when synchronous)."""
    layers: set[int] = field(default_factory=set)


_Forward = dict[int, list["weakref.ref[_Stash]"]]
"""One forward's stashes by layer (weak: a stash lives as long as autograd keeps a handle to it)."""


@dataclass(frozen=True, eq=False)
class _Handle:
    """What autograd keeps for one offloaded saved tensor: its stash and how to rebuild it on the bytes."""

    stash: _Stash
    forward: _Forward
    """The forward it was saved in, whose layer below is prefetched from it."""
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Kept:
    """A saved tensor left on the device (or the outer hook's packing of it)."""

    packed: Any


class Offloader:
    """Moves what the offloaded layers of one model save to host memory, and back one layer ahead.

    ``apply(model, "offload")`` makes one per model; each offloaded layer's forward runs in ``run``, and
    ``watch`` hooks the layers whose backward starts a copy back.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], *, min_bytes: int | None = None) -> None:
        """``layers``: indices of the offloaded layers in the model's layer list."""
        self._model = weakref.ref(model)
        self.layers = tuple(sorted(layers))
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self._stashes: _Forward = {}
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._state: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._streams: dict[torch.device, Any] = {}

    # --- forward --------------------------------------------------------------------------------------

    def watch(self, layers: nn.ModuleList) -> list[RemovableHandle]:
        """Forward hooks on the offloaded layers and the layers just above them: the gradient of their output
        starts the copies back (``backward_begins``). Remove the handles to undo."""
        wanted = sorted({j for i in self.layers for j in (i, i + 1) if j < len(layers)})
        # A gradient hook from a compiled frame: left to eager. Disabled here, not by a decorator: that would
        # import torch._dynamo (seconds) with this module, for every run, offloaded or not.
        on_output = torch.compiler.disable(self._on_output)
        return [layers[j].register_forward_hook(partial(on_output, j)) for j in wanted]

    def _on_output(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        watched = next((t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad), None)
        if watched is not None:
            forward = self._stashes  # this forward's, not the stashes of a later one when the hook fires
            watched.register_hook(lambda grad: self.backward_begins(index, forward))

    def run(self, index: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call layer ``index``'s forward ``fn`` with what it saves for the backward offloaded."""
        if index == self.layers[0]:
            self._new_forward()
        self._stashes[index] = []
        outer = _outer_hooks()
        hooks = partial(self._pack, index, outer), partial(self._unpack, index, outer)
        with saved_tensors_hooks(*hooks):
            return fn(*args, **kwargs)

    def _new_forward(self) -> None:
        """Start a new forward's bookkeeping; note the storages of parameters and buffers (never offloaded)."""
        self._stashes = {}
        self._by_storage = WeakIdKeyDictionary()
        self._state = WeakIdKeyDictionary()
        model = self._model()
        if model is not None:
            for t in (*model.parameters(), *model.buffers()):
                if not is_traceable_wrapper_subclass(t):
                    self._state[t.untyped_storage()] = True

    def _pack(self, index: int, outer: tuple[Any, Any] | None, t: Tensor) -> Any:
        if not self._offloads(t):
            return _Kept(outer[0](t) if outer else t)
        st = t.untyped_storage()
        ref = self._by_storage.get(st)
        stash = ref() if ref is not None else None
        if stash is None or stash.version != t._version:
            stash = self._copy_out(t)
            if outer:
                stash.observed = outer[0](stash.host)
            self._by_storage[st] = weakref.ref(stash)  # a stash lives as long as autograd keeps a handle to it
        if index not in stash.layers:
            stash.layers.add(index)
            self._stashes[index].append(weakref.ref(stash))
        return _Handle(stash, self._stashes, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _offloads(self, t: Tensor) -> bool:
        """Whether ``t`` goes to host memory: an activation (not a parameter or an alias of one) worth a copy."""
        if is_traceable_wrapper_subclass(t) or t.layout != torch.strided or t.is_quantized:
            return False
        if t.is_leaf and t.requires_grad:
            return False  # a parameter, or an input the caller differentiates: not the layer's to move
        st = t.untyped_storage()
        nbytes = st.nbytes()
        return nbytes >= max(self.min_bytes, 1) and nbytes % t.element_size() == 0 and st not in self._state

    def _copy_out(self, t: Tensor) -> _Stash:
        """Start copying ``t``'s whole storage to host memory."""
        with _moving():
            return self._copy_out_now(t)

    def _copy_out_now(self, t: Tensor) -> _Stash:
        flat = _storage_bytes(t)
        if not _async(t):
            with torch.no_grad(), host_copies():
                host = flat.to("cpu", copy=True)
            return _Stash(host, t.device, t._version)
        side = self._side_stream(t.device)
        with torch.no_grad(), host_copies():
            host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
            side.wait_stream(torch.cuda.current_stream(t.device))  # the tensor is written on the compute stream
            with torch.cuda.stream(side):
                host.copy_(flat, non_blocking=True)
        flat.record_stream(side)  # its block is not reused before the copy ends, though the model may drop it
        return _Stash(host, t.device, t._version, streamed=True)

    # --- backward -------------------------------------------------------------------------------------

    def backward_begins(self, index: int, forward: _Forward | None = None) -> None:
        """Layer ``index``'s backward is about to start: have its tensors back, start the layer below's.

        ``forward``: the stashes of the forward being differentiated (default: the last one)."""
        forward = self._stashes if forward is None else forward
        for i in (index, index - 1):
            for ref in forward.get(i, ()):
                stash = ref()
                if stash is not None:
                    self._copy_in(stash)

    def _copy_in(self, stash: _Stash) -> None:
        if stash.fetched is not None:
            return
        with _moving():
            self._copy_in_now(stash)

    def _copy_in_now(self, stash: _Stash) -> None:
        if not stash.streamed:
            with torch.no_grad():
                stash.fetched = stash.host.to(stash.device, copy=True)
            return
        side = self._side_stream(stash.device)
        with torch.no_grad(), torch.cuda.stream(side):
            # Allocated on the side stream: its blocks were last used there or are guarded by record_stream.
            stash.fetched = stash.host.to(stash.device, non_blocking=True)
            stash.ready = torch.cuda.Event()
            stash.ready.record(side)

    def _unpack(self, index: int, outer: tuple[Any, Any] | None, packed: Any) -> Tensor:
        if isinstance(packed, _Kept):
            return outer[1](packed.packed) if outer else packed.packed
        handle: _Handle = packed
        stash = handle.stash
        if stash.fetched is None:  # no output hook fired: fetch now, and start the layer below
            self.backward_begins(index, handle.forward)
            self._copy_in(stash)
        if outer and stash.observed is not None:
            outer[1](stash.observed)
            stash.observed = None
        fetched = stash.fetched
        assert fetched is not None
        if stash.ready is not None:
            compute = torch.cuda.current_stream(stash.device)
            compute.wait_event(stash.ready)
            fetched.record_stream(compute)  # freed by autograd on the compute stream
        return fetched.view(handle.dtype).as_strided(handle.size, handle.stride, handle.offset)

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # --- for tests and debugging ----------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Host bytes the live stashes take (what the last forward offloaded and the backward has not freed)."""
        seen = {id(s): s.host.nbytes for refs in self._stashes.values() for r in refs if (s := r()) is not None}
        return sum(seen.values())


def _storage_bytes(t: Tensor) -> Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (a view, no copy)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.detach().as_strided((n,), (1,), 0).view(torch.uint8)


def _outer_hooks() -> tuple[Any, Any] | None:
    """The saved-tensor hooks active around the layer (a trace's tracker), which ours would otherwise hide."""
    return outer_saved_tensors_hooks()
