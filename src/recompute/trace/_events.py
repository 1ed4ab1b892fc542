"""``DeviceEvents``: MemTracker that also counts what CUDA does beyond the storages a step's ops return, and
records the step's allocations and frees in order.

- CUDA's 512-byte blocks on fake CPU tensors (MemTracker rounds CUDA tensors' storages itself);
- the scratch a CUDA kernel allocates and frees inside one call (``recompute.trace._cuda.kernel_scratch``),
  counted at the moment it runs, on fake CPU tensors under CUDA's rules and on CUDA tensors alike;
- every device storage allocated and freed, in order (``record_allocations``): the stream that
  ``recompute.core.allocator`` replays to predict what PyTorch's CUDA caching allocator reserves.

``StepTracker`` (``_tracker.py``) builds the step's phases and saved-tensor owners on top.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import _MemRefType, _ModState, _UpdateType
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from recompute.core.allocator import AllocationStream, stream_of
from recompute.trace._cuda import BLOCK, kernel_scratch
from recompute.trace._memtracker import PortableMemTracker

__all__ = ["DeviceEvents", "storages"]


class DeviceEvents(PortableMemTracker):
    """MemTracker with CUDA's blocks and kernel scratch counted, and the allocation stream recorded (module
    docstring). ``stage`` names the part of the step running (``setup`` until the forward begins)."""

    stage = "setup"

    def __init__(self, *, cuda: bool = False) -> None:
        super().__init__()
        self.cuda = cuda
        """CUDA's rules on fake CPU tensors (``recompute.trace._cuda``): 512-byte blocks, fp32 LayerNorm
        statistics, kernel scratch."""
        self._events: list[tuple[int, int]] | None = None  # ``record_allocations``
        self._marks: dict[str, int] = {}
        self._lazy: set[int] = set()
        self._rounding = False
        self._scratches = 0

    # --- the allocation stream -----------------------------------------------------------------------

    def record_allocations(self) -> None:
        """Record every device storage allocated and freed, in order, for ``allocation_stream`` (call before
        ``track_external``: what exists before the step is its resident part)."""
        self._events = []

    def mark(self, stage: str) -> None:
        """Note where ``stage`` begins in the stream (its first time)."""
        if self._events is not None:
            self._marks.setdefault(stage, len(self._events))

    def allocation_stream(self) -> AllocationStream | None:
        """What was recorded since ``record_allocations`` (None without it): the storages that existed before the
        forward (the optimizer's state apart), then the step, marked where its optimizer step began."""
        if self._events is None:
            return None
        n = len(self._events)
        start = self._marks.get("forward", n)
        return stream_of(self._events, start=start, optimizer_at=self._marks.get("optimizer", n), lazy=self._lazy)

    def _update_snap(
        self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None
    ) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
        events = self._events
        if events is None or u_type == _UpdateType.REF or (u_type == _UpdateType.SIZE and self._rounding):
            return
        key = id(winfo)
        if u_type != _UpdateType.ADD:  # freed, or resized (``UntypedStorage.resize_``: freed and allocated anew)
            events.append((key, 0))
        if u_type != _UpdateType.DEL and winfo.mem_consumed > 0:
            events.append((key, winfo.mem_consumed))
            if self.stage == "setup" and winfo.reftype == _MemRefType.OPT:
                self._lazy.add(key)

    # --- CUDA's blocks and kernel scratch ------------------------------------------------------------

    def count_scratch(self, func: Any, args: Any) -> None:
        """Count the scratch CUDA's kernel for ``func`` allocates inside the call just dispatched, if any."""
        if self._tracks_now() and self._on_cuda(args):
            self._scratch(kernel_scratch(func, args), args)

    def _tracks_now(self) -> bool:
        """Whether the op just dispatched was filed: only ops run under the fake mode the tracker was entered in
        (DTensor's shape propagation runs under another; ``PortableMemTracker``)."""
        return active_fake_mode() is self._entry_mode

    def _on_cuda(self, args: Any) -> bool:
        """Whether an op on ``args`` runs CUDA's kernel: under CUDA's rules, or on CUDA tensors (real ones too:
        MemTracker sees what a kernel returns, never what it allocates inside)."""
        first = args[0] if args else None
        return self.cuda or (isinstance(first, torch.Tensor) and first.device.type == "cuda")

    def _scratch(self, nbytes: int, args: Any) -> None:
        """Count ``nbytes`` that a kernel allocates and frees inside one call, on top of what is alive now and its
        outputs, at the peak of the moment (on the device of its first input)."""
        if nbytes <= 0:
            return
        device = args[0].device
        nbytes = -(-nbytes // BLOCK) * BLOCK
        snap = self._curr_mem_snap.get(device)
        empty = snap is None  # nothing else on the device: a snapshot only while the scratch lives
        if snap is None:
            snap = self._curr_mem_snap[device] = {}
        for key in (_MemRefType.TEMP, "Total"):
            snap[key] = snap.get(key, 0) + nbytes
        try:
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        finally:
            for key in (_MemRefType.TEMP, "Total"):
                snap[key] -= nbytes
            if empty:
                del self._curr_mem_snap[device]
        if self._events is not None:
            self._scratches -= 1  # negative keys: never an ``id``
            self._events += [(self._scratches, nbytes), (self._scratches, 0)]

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: Any, update_existing: bool = False) -> Any:
        new = [st for st in storages(t) if st not in self._WINFO] if self.cuda else []
        out = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        self._blocks(new)
        return out

    def _blocks(self, new: list[torch.UntypedStorage]) -> None:
        """Round storages just tracked up to CUDA's 512-byte blocks (MemTracker does for CUDA tensors)."""
        for st in new:
            info = self._WINFO.get(st)
            if info is None or info[0].mem_consumed % BLOCK == 0:
                continue
            winfo, old = info[0], info[0].mem_consumed
            winfo.mem_consumed = -(-old // BLOCK) * BLOCK
            self._rounding = True  # the allocator rounds requests itself: no new event
            try:
                self._update_snap(_UpdateType.SIZE, winfo, old_mem_consumed=old)
            finally:
                self._rounding = False


def storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding ``t``'s data in this process: a DTensor's local shard, any wrapper's inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for inner in (getattr(t, name) for name in names):
            if isinstance(inner, torch.Tensor):  # DTensor also flattens its DeviceMesh
                yield from storages(inner)
    else:
        yield t.untyped_storage()
