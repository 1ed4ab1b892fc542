"""What differs between the PyTorch releases recompute supports (``recompute.core.torch_range``), in one place.

Importing this module refuses a torch outside the range (``ConfigError``, before any work); the torch-using
modules import it, directly or through the pieces below.

Note: [private torch pieces] every private torch name recompute reads, and how it is guarded:

- modules imported by name (``torch._guards``, ``torch._subclasses.fake_tensor``, ``torch.utils._pytree``,
  ``torch.utils._python_dispatch``, ``torch.distributed._tools.mem_tracker``,
  ``torch.distributed._functional_collectives``, ``torch.distributed.tensor._sharding_prop``): present in
  every release of the range (``scripts/torch-matrix`` imports them all); the range check guards the rest;
- MemTracker's private members (``recompute.trace._memtracker``): checked when a tracker is made, one
  ``ConfigError`` naming what is missing; its dispatch is recompute's own (2.13's semantics on every release);
- ``torch._C._current_autograd_node``: ``current_autograd_node`` (None without it: the saver's op reads ``?``);
- ``torch._C._autograd._top_saved_tensors_default_hooks`` (2.8 and later): ``outer_saved_tensors_hooks``
  falls back to the hooks recompute itself installed through ``saved_tensors_hooks``;
- ``torch.library.Library._destroy``: ``drop_library`` (fallback: leave the registration to garbage collection);
- ``torch.testing._internal.distributed.fake_pg.FakeStore``: ``fake_store`` (refused in one line without it);
- ``ShardingPropagator._propagate_tensor_meta_non_cached``: ``member`` (refused in one line without it);
- ``torch.distributed.distributed_c10d._resolve_process_group``: ``resolve_process_group`` (None without it);
- ``torch.distributed._tools.fake_collectives`` (2.8 and later: c10d's collectives on fake tensors):
  ``fake_collectives`` registers the same rules itself without it (``_create_work_from_future`` for the work);
- ``torch.cpu.Stream.record_event`` and ``wait_event`` (2.8 and later), which FSDP2 calls on the CPU:
  ``cpu_stream_events`` adds them as no-ops for a trace on fake tensors (CPU work is synchronous: exact);
  ``require_fsdp`` refuses real steps of ``fully_shard`` on the CPU in one line without them (2.6's all-gather
  copy-out also bumps the version counter of the gathered parameters, which fails a real backward; fake tensors
  keep their counters at 0);
- FSDP2's own per-parameter records (``FSDPParam``) are never read: a shard's size comes from the shapes
  (``ceil(rows / d)`` rows);
- FlopCounterMode's attention formulas refuse grouped-query shapes before 2.13: ``recompute.trace._flops``
  registers its own (``flop_counter`` for a plain ``FlopCounterMode`` with them);
- ``TorchDispatchMode.ignore_compile_internals`` (2.8 and later), which ``recompute.trace._compiled``'s counting
  mode overrides so that dynamo runs compiled graphs under it: ``step_peak`` gives None without it;
- AOTAutograd's ``_boxed_call`` mark, set (not read) on recompute's own captured graphs so that they get the list
  of their inputs (Note: [boxed graphs] in ``recompute.trace._compiled``); a torch that stopped reading it would
  call them with the inputs unpacked, which they take too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from recompute.core.errors import ConfigError
from recompute.core.torch_range import require_supported_torch, supported_range

__all__ = [
    "cpu_stream_events",
    "current_autograd_node",
    "drop_library",
    "fake_collectives",
    "fake_store",
    "member",
    "missing",
    "outer_saved_tensors_hooks",
    "require_fsdp",
    "resolve_process_group",
    "saved_tensors_hooks",
]

require_supported_torch(torch.__version__)


def missing(what: str, name: str) -> ConfigError:
    """The one-line refusal of a torch that lacks a private piece ``name`` that ``what`` needs."""
    return ConfigError(
        f"{what} needs torch's {name}, which torch {torch.__version__} does not have; recompute supports "
        f"{supported_range()} (pip install a release in that range)"
    )


def member(owner: Any, name: str, what: str) -> Any:
    """``owner.name``, or a ``ConfigError`` (``missing``) saying that ``what`` needs it and this torch lacks it."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing(what, f"{getattr(owner, '__qualname__', type(owner).__qualname__)}.{name}") from None


def current_autograd_node() -> Any:
    """The autograd node running now (in a backward), or None (outside one, or without the private accessor)."""
    get = getattr(torch._C, "_current_autograd_node", None)
    return get() if get is not None else None


_HOOKS = threading.local()


@contextlib.contextmanager
def saved_tensors_hooks(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> Iterator[None]:
    """``torch.autograd.graph.saved_tensors_hooks``, remembered so that ``outer_saved_tensors_hooks`` can find
    them on a torch without the private accessor (before 2.8)."""
    stack = _HOOKS.__dict__.setdefault("stack", [])
    stack.append((pack, unpack))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        stack.pop()


def outer_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) saved-tensor hooks active now, which a nested pair of hooks would hide; None if none.

    torch 2.8 and later say so themselves; before, the ones installed through ``saved_tensors_hooks`` (a
    trace's tracker) are known, hooks installed directly with torch's are not.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None:
        return top(False)  # type: ignore[no-any-return]
    stack = getattr(_HOOKS, "stack", None)
    return stack[-1] if stack else None


def drop_library(lib: torch.library.Library) -> None:
    """Remove the kernels ``lib`` registered now (``Library._destroy``; without it they go with ``lib``)."""
    destroy = getattr(lib, "_destroy", None)
    if destroy is not None:
        destroy()


def fake_store() -> Any:
    """A store for PyTorch's fake process group (its testing ``FakeStore``), or a one-line refusal without it."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise missing("tracing one rank of --tp", "torch.testing._internal.distributed.fake_pg.FakeStore") from None
    return FakeStore()


def resolve_process_group(name: str) -> Any:
    """The process group named ``name`` (a functional collective's group argument), or None if none is."""
    import torch.distributed as dist

    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
    if resolve is None:
        return None
    try:
        return resolve(name)
    except (KeyError, RuntimeError, ValueError):
        return None


_RETURNS_INPUT: tuple[str, ...] = ("broadcast_", "allreduce_", "allgather_", "_allgather_base_", "reduce_scatter_")
_RETURNS_INPUT += ("_reduce_scatter_base_", "scatter_", "alltoall_")
_RETURNS_WORK = ("reduce_", "gather_", "alltoall_base_", "barrier", "send", "recv_", "recv_any_source_")
"""c10d's collectives: those that return (their first argument, a work) and those that return a work alone
(as ``torch.distributed._tools.fake_collectives`` has them)."""


@contextlib.contextmanager
def fake_collectives() -> Iterator[None]:
    """c10d's collectives runnable on fake tensors (moving nothing, finished at once), while inside.

    torch 2.8 and later register them (``torch.distributed._tools.fake_collectives``, which MemTracker imports);
    torch 2.6 has none, and ``distribute_tensor`` (a scatter, a broadcast) fails on fake tensors there.
    """
    if importlib.util.find_spec("torch.distributed._tools.fake_collectives") is not None:
        importlib.import_module("torch.distributed._tools.fake_collectives")
        yield
        return
    lib = torch.library.Library("c10d", "IMPL")
    for op in _RETURNS_INPUT:
        lib.impl(op, lambda *args, **kwargs: (args[0], _done_work()), "Meta")
    for op in _RETURNS_WORK:
        lib.impl(op, lambda *args, **kwargs: _done_work(), "Meta")
    try:
        yield
    finally:
        drop_library(lib)


def _done_work() -> Any:
    """A finished c10d work, as a collective's kernel returns it."""
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return _create_work_from_future(future).boxed()


@contextlib.contextmanager
def cpu_stream_events() -> Iterator[None]:
    """``torch.cpu.Stream.record_event`` and ``wait_event`` while inside, as no-ops where this torch lacks them
    (2.6), so that ``fully_shard`` runs on fake CPU tensors; nothing where it has them (2.8 and later).

    The CPU runs its work in order on one stream, so an event has nothing to wait for: the no-ops change no
    figure. For traces on fake tensors only: a real CPU step of 2.6 also fails in its backward (its all-gather
    bumps the version counters of the weights the forward saved), which ``require_fsdp`` refuses outside.
    """
    stream = torch.cpu.Stream
    added = [name for name in ("record_event", "wait_event") if not hasattr(stream, name)]
    for name in added:
        setattr(stream, name, _record_event if name == "record_event" else _wait_event)
    try:
        yield
    finally:
        for name in added:
            delattr(stream, name)


def _record_event(self: Any, event: Any = None) -> Any:
    return event if event is not None else torch.cpu.Event()


def _wait_event(self: Any, event: Any) -> None:
    return None


def require_fsdp(device_type: str) -> None:
    """Refuse FSDP2 (``fully_shard``) on the CPU where this torch cannot run it (2.6: its CPU streams record no
    events, and ``fully_shard``'s all-gather waits on one; inside ``cpu_stream_events``, a trace on fake tensors,
    they do)."""
    if device_type == "cpu" and not hasattr(torch.cpu.Stream, "record_event"):
        raise ConfigError(
            f"FSDP2 (dp > 1) on the CPU needs a later torch than {torch.__version__} (its fully_shard records events "
            "on CPU streams, which this one cannot; 2.8 can): run it on CUDA or upgrade torch"
        )
