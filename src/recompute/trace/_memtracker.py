"""``PortableMemTracker``: PyTorch's MemTracker with one dispatch on every supported torch (2.13's), and no
path on which an error can abort the process.

MemTracker (``torch.distributed._tools.mem_tracker``) changed under the same name: 2.13 lets DTensor run
first (``NotImplemented`` for DTensor types, so the mode counts the local ops it runs), skips the ops DTensor's
sharding propagation runs under a nested fake mode (by comparing the active fake mode with the one at
entry), and overrides ``wait_tensor`` under fake tensors; 2.10-2.12 have the first and the last only; 2.8
instead enters the tracker again around DTensor's custom op handlers; 2.6 has none of it. Inheriting
``__torch_dispatch__`` gave a different count on each (and, on all but 2.13, an ``AttributeError`` for the
entry mode that 2.13's ``__enter__`` alone sets). So this class dispatches by itself, as 2.13 does, and
keeps its own entry mode; it uses MemTracker's bookkeeping (storages, categories, module and optimizer
hooks), whose private members ``__init__`` checks for: a torch without one is refused in one line.

Note: [hooks left behind] MemTracker's ModTracker marks each module's backward with
``register_multi_grad_hook`` on its inputs and outputs and keeps no handle; in ``all`` mode the hook holds the
grad_fn nodes it watches, so each such node and its hook form a cycle through C++ that Python's collector cannot
see, and the graph behind them stays alive, down to the ``AccumulateGrad`` nodes and so the parameters: every
real model a tracker had seen stayed in memory (``recompute bench`` ran its policies one after another, and each
memory step kept the last model's weights). This tracker records those hooks while it is entered and removes
them at its exit, which frees the graph.

Note: [no abort] every ``.device`` of a fake tensor that C++ asks is an op here (``prim.device``): the
autograd engine asks from code that cannot pass a Python exception on, and the process aborts (``terminate
called after throwing an instance of 'python_error'``). Nothing on that path may raise: an error there is
kept and raised at the next op or at ``__exit__``, as a Python error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed._tools.mod_tracker as mod_tracker
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from recompute._compat import member, missing

__all__ = ["PortableMemTracker", "propagating", "sharding_propagation"]

_DEVICE = torch.ops.prim.device.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default

_MEMBERS = (
    "_WINFO",
    "_curr_mem_snap",
    "_peak_mem",
    "_peak_mem_snap",
    "_mod_tracker",
    "_in_opt",
    "_in_ac",
    "_param_to_grad_hook_handles",
    "_track",
    "_update_snap",
    "_update_and_maybe_create_winfos",
    "_delete_callback",
    "_track_module_params_and_buffers",
    "_update_peak_stats",
)
"""MemTracker's private members that recompute's trackers use (present from 2.6 to 2.13)."""
_MOD_TRACKER_MEMBERS = ("parents", "is_bw", "get_known_fqn")
"""And its ModTracker's."""


_LEAVES = (torch.Tensor, int, float, bool, torch.SymInt)
"""What an op's flat tuple or list of outputs may hold to be walked without pytree (``_track_outputs``)."""

_PROPAGATING: list[None] = []
"""Non-empty while DTensor infers an op's output shape (``sharding_propagation``)."""


@contextlib.contextmanager
def sharding_propagation() -> Iterator[None]:
    """While tracing a rank of a parallel job: the ops DTensor runs to infer an op's global output shape are
    neither counted as kernels (``recompute.trace._flops``) nor as memory (``PortableMemTracker``).

    Note: [DTensor's shape propagation runs no kernel] for an op whose output shape it has not cached (a
    row-parallel matmul's Partial output, the first AdamW step on FSDP2's sharded parameters), DTensor's
    sharding propagation runs the op on fake tensors of the global shapes, under the trace's own fake mode
    (``_propagate_tensor_meta_non_cached``); the rank then runs the local kernel. Counting both filed a
    row-parallel matmul at t + 1 times its local FLOPs, and put whole-size tensors into the first AdamW step of
    an FSDP2 rank, which a real step makes under a fake mode of DTensor's own, counted by no tracker.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = member(ShardingPropagator, "_propagate_tensor_meta_non_cached", "tracing one rank of --tp or --fsdp")

    def quiet(self: Any, *args: Any, **kwargs: Any) -> Any:
        _PROPAGATING.append(None)
        try:
            return original(self, *args, **kwargs)
        finally:
            _PROPAGATING.pop()

    ShardingPropagator._propagate_tensor_meta_non_cached = quiet  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def propagating() -> bool:
    """Whether DTensor is inferring an op's output shape now (inside ``sharding_propagation``)."""
    return bool(_PROPAGATING)


class PortableMemTracker(MemTracker):
    """MemTracker whose dispatch is 2.13's on every supported torch; see the module docstring.

    Raises (when made):
        ConfigError: this torch's MemTracker lacks a member the tracker uses (one line naming it).
    """

    def __init__(self) -> None:
        super().__init__()
        for name in _MEMBERS:
            if name not in vars(self) and not hasattr(MemTracker, name):  # its state, or its own method
                raise missing("recompute's trace", f"MemTracker.{name}")
        for name in _MOD_TRACKER_MEMBERS:
            if not hasattr(self._mod_tracker, name):
                raise missing("recompute's trace", f"ModTracker.{name}")
        self._entry_mode: Any = None
        """The fake mode active when the tracker was entered (None outside one)."""
        self._entered = 0
        self._deferred: BaseException | None = None
        """An error raised where it could not propagate (Note: [no abort]), raised at the next chance."""
        self._hooks = contextlib.ExitStack()
        """Removes the ModTracker's multi-grad hooks at the outermost exit (Note: [hooks left behind])."""

    def __enter__(self) -> PortableMemTracker:
        if self._entered == 0:
            self._entry_mode = active_fake_mode()
            self._hooks.enter_context(_hooks_removed_at_exit())
        self._entered += 1
        try:
            super().__enter__()
        except BaseException:
            self._entered -= 1
            if self._entered == 0:
                self._hooks.close()
            raise
        return self

    def __exit__(self, *args: Any) -> None:
        self._entered -= 1
        try:
            super().__exit__(*args)
        finally:
            if self._entered == 0:
                self._hooks.close()
        if self._entered == 0 and args[0] is None:
            self._raise_deferred()

    def _track_dtensor_dispatch(self) -> None:
        """Not 2.8's re-entry around DTensor's custom op handlers: DTensor runs them through this mode anyway."""

    def _restore_dtensor_dispatch(self) -> None:
        """Nothing to restore (``_track_dtensor_dispatch``)."""

    def _raise_deferred(self) -> None:
        error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Run the op and count what it allocates: 2.13's MemTracker dispatch, on every supported torch."""
        if any(t == DTensor for t in types):
            return NotImplemented  # DTensor runs first; its local ops come back here
        kwargs = kwargs or {}
        if func is _DEVICE:
            return self._device_query(func, args, kwargs)
        self._raise_deferred()
        # A fake wait_tensor returns a new tensor; a real one returns its input.
        out = args[0] if func is _WAIT and active_fake_mode() is not None else func(*args, **kwargs)
        if active_fake_mode() is self._entry_mode and not propagating():  # not DTensor's shape propagation
            self._track_outputs(out)
            self._update_peak_stats(self._peak_state())
        return out

    def _track_outputs(self, out: Any) -> None:
        """MemTracker's ``_track`` of every tensor ``out`` holds, in order.

        Note: [outputs without pytree] an op returns a tensor or a flat tuple or list of them (with None or
        numbers) nearly always; those are walked here, without ``tree_map_only``'s flattening and rebuilding (a
        tenth of a fake step's time), in the order it visits them. Anything else goes through it as before."""
        reftype = self._reftype()
        if isinstance(out, torch.Tensor):
            self._track(reftype, out)
        elif type(out) in (tuple, list) and all(x is None or isinstance(x, _LEAVES) for x in out):
            for x in out:
                if isinstance(x, torch.Tensor):
                    self._track(reftype, x)
        else:
            tree_map_only(torch.Tensor, partial(self._track, reftype), out)

    def _device_query(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``prim.device``: allocates nothing; note the peak, and raise nothing (Note: [no abort]).

        Note: [a fake tensor's device, asked directly] most ops of a fake backward are these queries (130,000 in a
        cold plan of a 1.5B model); the fake mode answers each with the tensor's ``fake_device`` (``meta`` inside a
        kernel), after its dispatch's layers (about 50 us). The answer is read here as it does, and the other
        tensors (a real one, a subclass) are dispatched as before."""
        first = args[0] if len(args) == 1 and not kwargs else None
        if type(first) is FakeTensor and not first.fake_mode.in_kernel_invocation:
            out = first.fake_device
        else:
            out = func(*args, **kwargs)
        if self._deferred is None:
            try:
                if active_fake_mode() is self._entry_mode:
                    self._update_peak_stats(self._peak_state())
            except BaseException as e:
                self._deferred = e
        return out

    def _peak_state(self) -> Any:
        return _ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW

    def _reftype(self) -> Any:
        """MemTracker's category for what an op allocates now: optimizer state, backward temporaries, else
        activations (a checkpoint's replay in the backward included)."""
        if self._in_opt:
            return _MemRefType.OPT
        if self._mod_tracker.is_bw and not self._in_ac:
            return _MemRefType.TEMP
        return _MemRefType.ACT


@contextlib.contextmanager
def _hooks_removed_at_exit() -> Iterator[None]:
    """The multi-grad hooks ModTracker registers meanwhile, recorded and removed at the end (Note: [hooks left
    behind]); a torch whose ModTracker registers none this way is left as it is."""
    register = getattr(mod_tracker, "register_multi_grad_hook", None)
    if register is None:
        yield
        return
    handles: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        handle = register(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = recorded
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()
