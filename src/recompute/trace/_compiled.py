"""What a ``torch.compile``d training step saves for the backward: AOTAutograd's partition, on fake tensors.

Under ``torch.compile`` eager autograd does not run: AOTAutograd traces the forward and backward into one joint
graph, and a partitioner cuts it into a forward graph and a backward graph. The forward graph's outputs beyond
the user's (the loss, the logits) are the values the backward reads: what the compiled step holds between its
forward and its backward. ``capture`` compiles a model with a backend that only records those two graphs (its
compilers return each graph as it is, so nothing of Inductor runs) and counts the saved values from their
nodes' ``meta['val']``, which gives each value's shape, dtype and storage on fake tensors as on real ones.

Note: [compiled saved values] counted once per storage, and not at all where the storage is one of the graph's
inputs (parameters, token ids, or views of them: they exist whatever the backward keeps). A saved value may also
be a user output (the logits): it counts, as the real step holds it for the backward too. The partitioners:

- ``default``: AOTAutograd's ``default_partition`` over the graph without decompositions (``aot_eager``'s): it
  saves what the ops' own backward formulas read;
- ``min_cut``: ``min_cut_rematerialization_partition`` as Inductor calls it (``compiler="inductor"``, over
  Inductor's decomposition table): a min cut that recomputes cheap pointwise ops in the backward instead of
  saving them; ``budget`` in (0, 1) sets ``torch._functorch.config.activation_memory_budget`` for it, the
  fraction of that plan's activation memory to keep (recomputing the cheapest ops first).

What the real Inductor step saves is read back from its autograd graph (``saved_by_compiled``): each compiled
region's backward node holds the forward's saved tensors, real ones.
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from recompute.core.errors import ConfigError, require
from recompute.trace._cuda import BLOCK
from recompute.trace._flops import _leaves

__all__ = [
    "PARTITIONERS",
    "Captured",
    "Partition",
    "capture",
    "capture_backend",
    "capture_blocks",
    "graph_flops",
    "layer_paths",
    "saved_by_compiled",
    "saved_by_eager",
    "step_peak",
]

PARTITIONERS = ("min_cut", "default")
"""AOTAutograd's partitioners the compiled trace runs: Inductor's min cut (``torch.compile``'s default backend),
and the default partition (``aot_eager``'s)."""


@dataclass(frozen=True)
class Partition:
    """One compiled region's forward and backward graphs, as the partitioner cut them."""

    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    user_outputs: int | None
    """How many of the forward graph's outputs are the region's own (``num_fwd_outputs``); the rest are saved
    for the backward: values, random-number states, sizes. None: not given (saved values found by name)."""


Graphs = list[Partition]


@dataclass(frozen=True)
class Captured:
    """What the partitioned graphs of one compiled step save for the backward."""

    layers: tuple[int, ...]
    """Bytes saved by each transformer layer's ops (the whole model: the op's module path names the layer; per
    block: the layer running when the storage is first saved)."""
    other: int
    """Bytes saved by ops outside the layers: embedding, final norm, head and loss."""
    graphs: int
    """Forward/backward graph pairs (more than one: dynamo broke the model into several graphs)."""
    values: int
    """Saved values counted (one per storage; per block: each call's graph outputs saved beyond its inputs)."""
    flops: int = 0
    """FLOPs of the partitioned forward and backward graphs (matmuls and attention, by PyTorch's own formulas,
    ``torch.utils.flop_counter``): what a partition recomputes in the backward adds to them. Per block, the
    blocks' graphs only (the eager head's are in none)."""
    recomputed_bytes: int = 0
    """Bytes written by the ops without FLOPs (pointwise, reductions, views' copies) that the backward graph
    recomputes from the forward (``recomputed_ops``), counted unfused: at most what they cost in memory traffic."""
    eager_layers: tuple[int, ...] = ()
    """Per block: the layers that ran no compiled graph (dynamo gave up on them, e.g. at its recompile limit);
    their bytes are what they save eagerly."""
    peak: int | None = None
    """The most bytes the step's forward and backward allocated at once beyond the parameters, buffers and
    inputs: saved values, gradients, transients (``step_peak``); None: not traced."""

    @property
    def saved(self) -> int:
        return sum(self.layers) + self.other


def capture_backend(partitioner: str = "min_cut", budget: float | None = None) -> tuple[Callable[..., Any], Graphs]:
    """A ``torch.compile`` backend that partitions as ``partitioner`` (under ``budget``) and runs each graph as it
    is, and the list it appends each (forward, backward) graph pair to as it partitions.

    Raises:
        ConfigError: an unknown partitioner, a budget outside (0, 1] or with the default partitioner, or a
            PyTorch without these APIs.
    """
    backend, found = _backend(partitioner, (budget,))
    return backend, found[budget]


def _backend(
    partitioner: str, budgets: Sequence[float | None], *, cuda: bool = False, ran: list[int] | None = None
) -> tuple[Callable[..., Any], dict[float | None, Graphs]]:
    """``capture_backend`` partitioning each joint graph once per budget (Note: [one trace, several budgets]);
    the graphs of the first budget are the ones that run. ``cuda``: Inductor's decompositions as on CUDA
    (``_cuda_layer_norm``). ``ran``: appended the index of the partition each forward call runs (in the first
    budget's list)."""
    for b in budgets:
        check_options(partitioner, b)
    aot_autograd, partitions = _aot_apis()
    found: dict[float | None, Graphs] = {b: [] for b in budgets}
    cut = partitions[partitioner]

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        first: tuple[Any, Any] | None = None
        for i, b in enumerate(budgets):
            graph = joint if i == len(budgets) - 1 else _copy(joint)
            with _budget(b):
                fw, bw = cut(graph, inputs, **kwargs)
            found[b].append(Partition(fw, bw, kwargs.get("num_fwd_outputs")))
            first = first or (fw, bw)
        assert first is not None
        return first

    def as_is(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return _boxed(gm)

    def forward(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        index = len(found[budgets[0]]) - 1  # the forward compiler runs on the partition just made
        return _boxed(gm, None if ran is None else functools.partial(ran.append, index))

    decompositions = _inductor_decompositions(cuda=cuda) if partitioner == "min_cut" else None
    backend = aot_autograd(
        fw_compiler=forward, bw_compiler=as_is, partition_fn=partition, decompositions=decompositions
    )
    return backend, found


def _copy(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a joint graph a partitioner may change (Inductor's joint passes rewrite it in place): new nodes,
    the same ``meta`` values (fake tensors are not copied)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(joint.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(joint, graph)


def check_options(partitioner: str, budget: float | None) -> None:
    """Refuse an unknown partitioner and a budget that is not a fraction in (0, 1] of min cut's.

    Raises:
        ConfigError: as said.
    """
    require(
        partitioner in PARTITIONERS,
        f"partitioner must be one of {', '.join(PARTITIONERS)}, got {partitioner!r}",
    )
    if budget is None:
        return
    require(
        isinstance(budget, int | float) and 0 < budget <= 1,
        f"the memory budget is torch._functorch.config.activation_memory_budget, a fraction in (0, 1], got "
        f"{budget!r}; e.g. 0.5 keeps half of what min cut saves",
    )
    require(
        partitioner == "min_cut",
        f"the memory budget is the min-cut partitioner's knob, not the {partitioner} partitioner's; drop the "
        "budget or use partitioner min_cut",
    )
    require(
        hasattr(_functorch_config(), "activation_memory_budget"),
        f"this PyTorch ({torch.__version__}) has no torch._functorch.config.activation_memory_budget; "
        "upgrade to 2.6 or newer, or drop the budget",
    )


def capture(
    model: nn.Module,
    run: Callable[[Any], Any],
    *,
    layers: Sequence[str],
    partitioner: str = "min_cut",
    budgets: Sequence[float | None] = (None,),
    cuda: bool = False,
    step: Callable[[Any], Any] | None = None,
    exclude: Iterable[Tensor] = (),
    fused: bool | None = None,
) -> tuple[Captured, ...]:
    """Compile ``model`` with ``capture_backend`` and call ``run(compiled)`` once (a forward: the partition
    happens when the forward compiles), on real or fake tensors alike; what its graphs save under each of
    ``budgets`` (Note: [one trace, several budgets]). ``step``: instead of ``run``, a forward and backward, run
    twice, the second time under ``step_peak`` (``exclude``: the parameters, buffers and inputs), for
    ``Captured.peak``; the graphs that run are the first budget's, so one budget only. ``fused``: Inductor's
    fusion and in-place reuse modelled in the peak (Note: [compiled peak]); None: for the min cut only.

    ``layers``: the module path of each transformer layer (``layer_paths``). ``cuda``: a CUDA step traced on CPU
    tensors (``recompute.trace._cuda``): Inductor's CUDA decompositions, each saved storage in the caching
    allocator's 512-byte blocks. Resets dynamo's caches before and after (a model compiled before would not be
    partitioned again).

    Note: [one trace, several budgets] The memory budget changes only the partition: dynamo's graph and
    AOTAutograd's joint graph are the same under every budget, so each joint graph is partitioned once per
    budget, on a copy, and one trace answers them all (``tests/test_compiled.py`` holds it to a trace per budget).

    Raises:
        ConfigError: as ``capture_backend``, or dynamo compiled nothing.
    """
    require(step is None or len(budgets) == 1, "the compiled step's peak is traced under one budget at a time")
    backend, found = _backend(partitioner, budgets, cuda=cuda)
    torch._dynamo.reset()
    peak = None
    try:
        with _fake_models_refused():
            compiled = torch.compile(model, backend=backend, dynamic=False)
            if step is None:
                run(compiled)
            else:
                peak = _peak_of(model, lambda: step(compiled), exclude, cuda, _fuses(partitioner, fused))
    finally:
        torch._dynamo.reset()
    return tuple(_counted(found[b], layers, cuda=cuda, peak=peak) for b in budgets)


def _fuses(partitioner: str, fused: bool | None) -> bool:
    """Whether the peak models Inductor's buffers: as asked, else for Inductor's min cut only (the default
    partition is ``aot_eager``'s, which runs the graphs as they are)."""
    return partitioner == "min_cut" if fused is None else fused


def _peak_of(
    model: nn.Module, step: Callable[[], Any], exclude: Iterable[Tensor], cuda: bool, fused: bool
) -> int | None:
    """``step`` once to compile its graphs (forward and backward), then again under ``step_peak``, from no
    gradients each time (as after ``zero_grad(set_to_none=True)``)."""
    step()
    model.zero_grad(set_to_none=True)
    peak = step_peak(step, exclude=exclude, cuda=cuda, fused=fused)
    model.zero_grad(set_to_none=True)
    return peak


@contextlib.contextmanager
def _fake_models_refused() -> Iterator[None]:
    """Note: [fake models under dynamo] PyTorch 2.6's dynamo passes a model's fake tensors on as they are, in
    another fake mode than its own, which AOTAutograd refuses; 2.13's makes its own fakes of them. That error
    becomes one line here."""
    try:
        yield
    except Exception as e:
        if "fake mode" in str(e) and "doesn't match" in str(e):
            raise ConfigError(
                f"this PyTorch's dynamo ({torch.__version__}) does not compile a model made of fake tensors (its "
                "fake mode is not the model's); trace the compiled step under PyTorch 2.13, where it is tested"
            ) from e
        raise


def _counted(pairs: Graphs, layers: Sequence[str], *, cuda: bool, peak: int | None = None) -> Captured:
    require(bool(pairs), "torch.compile partitioned no graph: nothing of the step ran compiled with autograd on")
    per_layer = [0] * len(layers)
    other = values = flops = recomputed = 0
    for part in pairs:
        flops += graph_flops(part.fw) + graph_flops(part.bw)
        recomputed += sum(_written(n) for n in recomputed_ops(part) if _formula(n) is None)
        for node, nbytes in saved_values(part):
            values += 1
            nbytes = _in_blocks(nbytes, cuda)
            i = saver(node, layers)
            if i is None:
                other += nbytes
            else:
                per_layer[i] += nbytes
    return Captured(tuple(per_layer), other, len(pairs), values, flops, recomputed, peak=peak)


def capture_blocks(
    model: nn.Module,
    stack: nn.ModuleList,
    run: Callable[[Any], Any],
    *,
    partitioner: str = "min_cut",
    budget: float | None = None,
    cuda: bool = False,
    exclude: Iterable[Tensor] = (),
    step: Callable[[Any], Any] | None = None,
    fused: bool | None = None,
) -> Captured:
    """What the step saves with each layer of ``stack`` compiled on its own, as torchtitan compiles (Note:
    [compiled per block]); ``run(model)`` runs its forward, on real or fake tensors alike, and returns its output
    (Note: [saved and still held]). ``exclude``: the parameters, buffers and inputs (their storages are not
    counted). ``step(model)``: a forward and backward, for ``Captured.peak``, and ``fused``, as ``capture``'s. The
    layers are put back after.

    Note: [compiled per block] torchtitan compiles each transformer block on its own (``torch.compile(block)``,
    the embedding, final norm, head and loss eager), so AOTAutograd partitions one block's graph, and a memory
    budget is a fraction of each block's activations, not of the whole model's. The blocks of one kind share one
    compiled graph (dynamo's cache). The saved bytes are counted as the step runs, by the saved-tensor hooks
    that see every tensor autograd saves (a compiled region's ``save_for_backward`` included): once per storage,
    to the layer running when it is first saved (a layer's output is saved by the next layer that reads it,
    whose compiled graph takes it as an input), or outside the layers. FLOPs are each block's partitioned graphs'
    once per call (the eager head's are in none of them).

    Raises:
        ConfigError: as ``capture_backend``, or no layer ran compiled.
    """
    ran: list[int] = []
    backend, found = _backend(partitioner, (budget,), cuda=cuda, ran=ran)
    layers = list(stack)
    now: list[int | None] = [None]
    calls: list[tuple[int, int]] = []
    handles = []
    torch._dynamo.reset()
    try:
        for i, layer in enumerate(layers):
            block: nn.Module = torch.compile(layer, backend=backend, dynamic=False)  # type: ignore[assignment]
            handles.append(block.register_forward_pre_hook(functools.partial(_enter, now, i, ran)))
            handles.append(block.register_forward_hook(functools.partial(_leave, now, ran, calls)))
            stack[i] = block
        with _fake_models_refused():
            by = _saved_by(lambda: run(model), exclude=exclude, cuda=cuda, where=lambda: now[0])
            counted = len(calls)
            fuses = _fuses(partitioner, fused)
            peak = _peak_of(model, lambda: step(model), exclude, cuda, fuses) if step is not None else None
            del calls[counted:]  # the peak's steps ran the same graphs again
    finally:
        for handle in handles:
            handle.remove()
        for i, layer in enumerate(layers):
            stack[i] = layer
        torch._dynamo.reset()
    pairs = found[budget]
    require(bool(calls), "torch.compile partitioned no block: no layer ran compiled with autograd on")
    flops = sum(graph_flops(pairs[k].fw) + graph_flops(pairs[k].bw) for _, k in calls)
    recomputed = sum(_written(n) for _, k in calls for n in recomputed_ops(pairs[k]) if _formula(n) is None)
    per_layer = tuple(by.get(i, 0) for i in range(len(layers)))
    values = sum(1 for _, k in calls for _ in saved_values(pairs[k]))
    eager = tuple(sorted(set(range(len(layers))) - {i for i, _ in calls}))
    return Captured(per_layer, by.get(None, 0), len(pairs), values, flops, recomputed, eager, peak)


def _enter(now: list[int | None], i: int, ran: list[int], *args: Any) -> None:
    """A compiled block starts: layer ``i`` runs, no graph of it has yet."""
    now[0] = i
    ran.clear()


def _leave(now: list[int | None], ran: list[int], calls: list[tuple[int, int]], *args: Any) -> None:
    """A compiled block ends: (layer, partition) for each graph it ran."""
    layer = now[0]
    if layer is not None:
        calls.extend((layer, k) for k in ran)
    now[0] = None


def _in_blocks(nbytes: int, cuda: bool) -> int:
    """``nbytes`` as the CUDA caching allocator holds it (512-byte blocks), or as it is on the CPU."""
    return -(-nbytes // BLOCK) * BLOCK if cuda else nbytes


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of the ops of ``gm`` that PyTorch's flop counter counts (matmuls, convolutions, attention), from the
    shapes in each node's ``meta['val']``: what ``FlopCounterMode`` counts when the graph runs."""
    total = 0
    for node in gm.graph.nodes:
        formula = _formula(node)
        if formula is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        total += _concrete(formula(*args, **kwargs, out_val=node.meta.get("val")))
    return total


def recomputed_ops(part: Partition) -> list[torch.fx.Node]:
    """The backward graph's ops that recompute forward ones: the partitioner tags every node of the joint graph
    forward or backward (``partitioner_tag``) and copies the recomputed forward nodes into the backward graph
    with their tags. Empty where this PyTorch does not tag."""
    return [n for n in part.bw.graph.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"]


def _formula(node: torch.fx.Node) -> Callable[..., Any] | None:
    """PyTorch's flop formula for ``node``'s op (``torch.utils.flop_counter``), or None: an op without FLOPs."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
    return flop_registry.get(packet) if packet is not None else None


def _written(node: torch.fx.Node) -> int:
    """Bytes of the tensors ``node`` makes (views make none)."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, tuple | list) else (vals,)
    return sum(_concrete(v.numel()) * v.element_size() for v in vals if isinstance(v, Tensor) and v._base is None)


def saved_values(part: Partition) -> Iterator[tuple[torch.fx.Node, int]]:
    """The forward graph's outputs beyond the region's own (what the backward reads), with the bytes of their
    storages, once per storage and none that is an input's (Note: [compiled saved values])."""
    outputs = _outputs(part.fw)
    if part.user_outputs is not None:
        saved = outputs[part.user_outputs :]
    else:  # the backward's inputs are named as the forward's outputs they are
        read = {n.name for n in part.bw.graph.nodes if n.op == "placeholder"}
        saved = [n for n in outputs if n.name in read]
    inputs = {_storage(n) for n in part.fw.graph.nodes if n.op == "placeholder"} - {None}
    seen: set[StorageWeakRef] = set()
    for node in saved:
        key = _storage(node)
        if key is None or key in inputs or key in seen:
            continue
        seen.add(key)
        yield node, _concrete(node.meta["val"].untyped_storage().nbytes())


def saved_by_compiled(output: Tensor, *, exclude: Iterable[Tensor] = ()) -> int:
    """Bytes the compiled regions behind ``output`` (a loss) hold for their backward, read from its autograd
    graph: each region's backward node keeps its forward's saved tensors. Once per storage; ``exclude``'s
    storages (parameters, inputs) not counted. Works on real tensors after any backend (Inductor's too).

    Raises:
        ConfigError: no compiled region in ``output``'s autograd graph.
    """
    skip = {_key(t) for t in exclude}
    seen: set[StorageWeakRef] = set()
    total = 0
    regions = 0
    for node in _autograd_nodes(output):
        if "CompiledFunction" not in type(node).__name__:
            continue
        regions += 1
        for t in node.saved_tensors:
            key = _key(t)
            if key not in skip and key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    require(regions > 0, "found no compiled region in the output's autograd graph; compile the model with autograd on")
    return total


def compiled_regions(output: Tensor) -> int:
    """How many compiled regions (AOTAutograd's ``CompiledFunction`` nodes) ``output``'s autograd graph holds."""
    return sum("CompiledFunction" in type(node).__name__ for node in _autograd_nodes(output))


def saved_by_eager(run: Callable[[], Any], *, exclude: Iterable[Tensor] = (), cuda: bool = False) -> int:
    """Bytes the eager step ``run`` (a forward) saves for its backward, counted as ``saved_by_compiled`` counts the
    compiled step's: once per storage, ``exclude``'s (parameters, inputs) not at all; on fake tensors or real.
    A checkpointed region's own saves are its checkpoint's (dropped); what the region keeps to replay (its
    inputs) is counted. Only storages still held when ``run`` returns count (Note: [saved and still held]): it
    returns, or keeps, the forward's output. ``cuda``: each storage in 512-byte blocks."""
    return sum(_saved_by(run, exclude=exclude, cuda=cuda).values())


def _saved_by(
    run: Callable[[], Any],
    *,
    exclude: Iterable[Tensor] = (),
    cuda: bool = False,
    where: Callable[[], int | None] = lambda: None,
) -> dict[int | None, int]:
    """``saved_by_eager``'s bytes by where each storage was first saved (``where()`` as it is saved: a layer's
    index, or None), of the storages still held when ``run`` returns (its result kept while they are looked at).

    Note: [saved and still held] Every storage a saved-tensor hook sees is held while ``run`` runs, so that no
    freed storage's key is reused by another; then only those something else still holds count. A backward taken
    inside the forward (the chunked loss's chunks, ``recompute.chunked_loss``) saves its logits and frees them
    before the forward ends: they are no bytes the step holds for its backward. What a ``torch.autograd.Function``
    keeps on its ``ctx`` outside ``save_for_backward`` (the chunked loss's gradients) no hook sees, eagerly or
    compiled alike. A storage that only an uncollected reference cycle holds would still count; the collector is
    not run before the count (a full collection per count, on every compiled trace), as no count was seen to depend
    on it.
    """
    skip = {_key(t) for t in exclude}
    seen: set[StorageWeakRef] = set()
    held: list[Tensor] = []  # alive until run returns, so no storage is freed and its key reused
    found: list[tuple[StorageWeakRef, int | None, int]] = []

    def pack(t: Tensor) -> Tensor:
        key = _key(t)
        if key not in skip and key not in seen:
            seen.add(key)
            held.append(t)
            found.append((key, where(), _in_blocks(_concrete(t.untyped_storage().nbytes()), cuda)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    held.clear()
    out: dict[int | None, int] = {}
    for key, at, nbytes in found:
        if not key.expired():
            out[at] = out.get(at, 0) + nbytes
    del result
    return out


def step_peak(
    step: Callable[[], Any], *, exclude: Iterable[Tensor] = (), cuda: bool = False, fused: bool = True
) -> int | None:
    """The most bytes the compiled step ``step`` (its forward and backward, compiled already: a second call) has
    allocated at once, beyond ``exclude``'s storages and what was allocated before it (Note: [compiled peak]);
    None where this PyTorch's dynamo would not run compiled code under a dispatch mode.

    Note: [compiled peak] The partitioned graphs run on fake tensors, node by node, with the eager code around them
    (the loss, the gradients' accumulation), and every storage an op makes is counted from the op to its last
    reference. ``fused=False`` counts every node's output: the graphs' own liveness, which is what the real step of
    the same graphs run as they are (``aot_eager``'s) allocates (``tests/test_compiled.py``: equal, or the real step
    12 bytes above, a CPU kernel's own scratch). Inductor allocates less: it computes a chain of pointwise ops in
    one kernel, with no buffer for the intermediates (a decomposed cross-entropy's logits-sized temporaries), and
    writes a pointwise result over an input buffer read last there (a tied embedding's two gradients summed).
    ``fused=True`` leaves out the buffers of the nodes ``_fused_away`` and ``_in_place`` find: an approximation of
    Inductor's scheduler, not its code, held to real Inductor steps by the CPU allocator
    (``benchmarks/compiled_peak.py``); what it leaves out: Inductor's scheduler reorders and fuses kernels side by
    side (several large buffers made by one kernel), reuses a graph input's buffer in place, and realizes what a
    kernel without FLOPs (a scatter) reads. The backward's inputs (the saved values) are freed at their last read,
    as Inductor frees them (Note: [boxed graphs]). Either way the step's structure is there, which the substitution
    in ``recompute.compile_plan`` misses: a compiled backward that returns every gradient at its end, or recomputes
    a checkpointed layer beside them. Dynamo runs compiled code under a dispatch mode only if the mode ignores
    compile internals (``ignore_compile_internals``, PyTorch 2.8 on); under any other it would run the frame
    eagerly, so an older PyTorch gets None.
    """
    if not traces_compiled_peaks():
        return None
    live = _counted_step(step, exclude, cuda, fused)
    require(
        live.graphs > 0,
        "the compiled step ran no compiled graph under the counting mode (dynamo ran it eagerly): its peak would "
        "be the eager step's",
    )
    return live.peak


def traces_compiled_peaks() -> bool:
    """Whether this PyTorch's dynamo runs compiled code under a dispatch mode (2.8 and newer), which ``step_peak``
    needs (Note: [compiled peak])."""
    return hasattr(TorchDispatchMode, "ignore_compile_internals")


def eager_step_peak(step: Callable[[], Any], *, exclude: Iterable[Tensor] = (), cuda: bool = False) -> int | None:
    """``step_peak``'s count of the same step run eagerly (every op's output, from the op to its last reference):
    the eager step's forward and backward beyond ``exclude``'s storages, from no gradients. Equal to the eager
    trace's window (its largest forward or backward phase less the parameters, optimizer state, buffers and
    batch; ``tests/test_compile_plan.py``). None where ``step_peak`` gives None (the same PyTorch's)."""
    return _counted_step(step, exclude, cuda, fused=False).peak if traces_compiled_peaks() else None


def _counted_step(step: Callable[[], Any], exclude: Iterable[Tensor], cuda: bool, fused: bool) -> _Live:
    """``step`` run once under ``_Live``'s count (Note: [compiled peak])."""
    live = _Live(exclude, cuda=cuda, fused=fused)
    with live:
        step()
    return live


def _boxed(gm: torch.fx.GraphModule, count: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``gm`` as a compiled graph AOTAutograd calls with the list of its inputs, which the graph clears (the boxed
    convention) and runs node by node (``torch.fx.Interpreter.boxed_run``): each input, a saved value in the
    backward, is freed after its last read, as Inductor's code and ``aot_eager``'s do. While ``step_peak`` counts
    for Inductor, the nodes it fuses away are marked (``_Marked``). ``count``: called at each run.

    Note: [boxed graphs] AOTAutograd passes the list where the function has a true ``_boxed_call`` (the mark
    ``make_boxed_func`` and ``aot_eager``'s compiler set; ``make_boxed_func`` itself unpacks the list, so the
    inputs would live to the graph's end). A PyTorch that stopped reading the mark would call ``run(*inputs)``:
    taken too (a graph's inputs are tensors and sizes, never one list)."""

    def run(*args: Any) -> Any:
        inputs = args[0] if len(args) == 1 and type(args[0]) is list else list(args)
        if count is not None:
            count()
        live = _Live.active
        if live is not None:
            live.graphs += 1
        return (_Marked(gm, live) if live is not None and live.inductor else torch.fx.Interpreter(gm)).boxed_run(inputs)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _Marked(torch.fx.Interpreter):
    """Runs a graph telling ``live`` which nodes' outputs Inductor makes no buffer for."""

    def __init__(self, gm: torch.fx.GraphModule, live: _Live) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.live = live
        self.fused, self.reuses = live.plans.get(gm) or live.plans.setdefault(gm, _buffers(gm, cuda=live.cuda))

    def run_node(self, n: torch.fx.Node) -> Any:
        view = n.op == "call_function" and _is_view(n)  # a view makes no buffer
        self.live.skip = n in self.fused or view or n in self.reuses
        try:
            out = super().run_node(n)
        finally:
            self.live.skip = False
        reused = self.reuses.get(n)
        if reused is not None and isinstance(out, Tensor):
            self.live.moved(self.env[reused], out)
        return out


_FUSIBLE = {
    "_to_copy", "copy", "clone", "full", "full_like", "scalar_tensor", "zeros_like", "ones_like", "embedding",
    "rand", "rand_like", "randn_like", "bernoulli", "native_dropout", "inductor_random", "iota", "index",
}  # fmt: skip
"""Ops without PyTorch's pointwise tag that Inductor still lowers to a loop it can inline into its users."""


def _buffers(gm: torch.fx.GraphModule, *, cuda: bool) -> tuple[set[torch.fx.Node], dict[torch.fx.Node, torch.fx.Node]]:
    """``_fused_away`` and ``_in_place`` of ``gm``."""
    fused = _fused_away(gm, cuda=cuda)
    return fused, _in_place(gm, fused)


def _fused_away(gm: torch.fx.GraphModule, *, cuda: bool = False) -> set[torch.fx.Node]:
    """The nodes of ``gm`` whose outputs Inductor computes inside their users' kernels, with no buffer of their
    own: pointwise ops (and ``_FUSIBLE``) that are not the graph's outputs, not read by an op Inductor runs as an
    external kernel (one with FLOPs: matmuls, attention, convolutions, which read realized inputs), not the base
    of a view that is either, and not read by several ops where Inductor realizes them on reuse
    (``_realized_on_reuse``). An approximation of Inductor's scheduler (Note: [compiled peak])."""
    realized: set[torch.fx.Node] = set(_outputs(gm))
    for node in gm.graph.nodes:
        if node.op == "call_function" and _formula(node) is not None:
            realized.update(node.all_input_nodes)
    for node in reversed(gm.graph.nodes):  # a realized view needs its base realized
        if node in realized and node.op == "call_function" and _is_view(node):
            realized.update(node.all_input_nodes[:1])
    fused: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:  # in order: a producer's buffer is decided before its users'
        if node.op != "call_function" or node in realized or not _fusible(node):
            continue
        if len(node.users) > 1 and _realized_on_reuse(node, fused, cuda):
            continue
        fused.add(node)
    return fused


_HEAVY = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}
"""Ops whose pointwise result Inductor realizes on the CPU when several kernels read it (``should_realize_on_reuse``
in PyTorch 2.13's ``torch/_inductor/ir.py``), rather than compute it again in each."""


def _realized_on_reuse(node: torch.fx.Node, fused: set[torch.fx.Node], cuda: bool) -> bool:
    """Whether Inductor gives a pointwise result read by several ops its own buffer: on the CPU when its computation
    (with the fused producers it inlines) has a heavy op (``_HEAVY``), or when it is large (over 30 ops) or reads
    over 4 buffers (``config.realize_opcount_threshold`` and ``realize_reads_threshold``)."""
    inner, reads, todo = {node}, set(), [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in fused or (a.op == "call_function" and _is_view(a) and a not in inner):
                if a not in inner:
                    inner.add(a)
                    todo.append(a)
            else:
                reads.add(a)
    names = {getattr(getattr(n.target, "overloadpacket", None), "__name__", "") for n in inner}
    return (not cuda and bool(names & _HEAVY)) or len(inner) > 30 or len(reads) > 4


def _in_place(gm: torch.fx.GraphModule, fused: set[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Pointwise nodes whose buffer Inductor takes over from an input's (its in-place reuse), each with that input:
    a buffer made in the graph (not an input's: it may be held elsewhere; not a view, nor the base of one), of the
    same size and dtype, not an output, and read last by this node, counting a fused reader's reads as those of the
    kernel it is fused into (its first reader that has a buffer)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    kernel: dict[torch.fx.Node, int] = {}  # the position of the kernel that computes each node
    for node in reversed(gm.graph.nodes):
        users = [kernel[u] for u in node.users] if node in fused else []
        kernel[node] = min(users) if users else order[node]
    last: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        for a in node.all_input_nodes:
            last[a] = max(last.get(a, -1), kernel[node])
    views = [n for n in gm.graph.nodes if n.op == "call_function" and _is_view(n)]
    aliased = {n.all_input_nodes[0] for n in views if n.all_input_nodes} | set(views)
    outputs = set(_outputs(gm))
    out: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in fused or not _fusible(node):
            continue
        val = node.meta.get("val")
        for a in node.all_input_nodes:
            v = a.meta.get("val")
            if (
                a.op == "call_function" and a not in fused and a not in out.values() and a not in aliased
                and a not in outputs and last.get(a) == order[node] and isinstance(v, Tensor)
                and isinstance(val, Tensor) and v.dtype == val.dtype and _nbytes(v) == _nbytes(val)
            ):  # fmt: skip
                out[node] = a
                break
    return out


def _nbytes(t: Tensor) -> int:
    return _concrete(t.untyped_storage().nbytes())


def _fusible(node: torch.fx.Node) -> bool:
    target = node.target
    tags = getattr(target, "tags", ())
    packet = getattr(target, "overloadpacket", None)
    return torch.Tag.pointwise in tags or getattr(packet, "__name__", "") in _FUSIBLE


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


class _Live(TorchDispatchMode):
    """Bytes of the storages the ops make, alive at once, and the most of them (``step_peak``)."""

    active: _Live | None = None
    """The one counting now: the captured graphs see it as they run (``_boxed``)."""
    supports_higher_order_operators = True
    """A checkpointed region's random ops run as ``run_and_save_rng_state`` and ``run_with_rng_state``: run and
    counted like any op."""

    def __init__(self, exclude: Iterable[Tensor], *, cuda: bool, fused: bool) -> None:
        super().__init__()
        self.cuda = cuda
        self.inductor = fused
        self.now = self.peak = self.graphs = 0
        self.skip = False
        self.outer: _Live | None = None
        self.plans: dict[torch.fx.GraphModule, tuple[set[torch.fx.Node], dict[torch.fx.Node, torch.fx.Node]]] = {}
        self.alive: dict[StorageWeakRef, Any] = {_key(t): None for t in exclude}

    def __enter__(self) -> _Live:
        super().__enter__()
        self.outer, _Live.active = _Live.active, self
        return self

    def __exit__(self, *args: Any) -> None:
        _Live.active = self.outer
        for done in self.alive.values():
            if isinstance(done, weakref.finalize):
                done.detach()  # what the step leaves (its gradients) no longer keeps this mode alive
        super().__exit__(*args)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # run the compiled graphs under this mode, not the frame eagerly (Note: [compiled peak])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _leaves(out, []):  # a random op's replay returns (state, (output, mask))
            if isinstance(t, Tensor):
                self._made(t)
        return out

    def _made(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key in self.alive or self.skip:
            return
        nbytes = _in_blocks(_concrete(storage.nbytes()), self.cuda)
        self.alive[key] = weakref.finalize(storage, self._freed, key, nbytes)
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def moved(self, old: Tensor, new: Tensor) -> None:
        """``new`` (not counted as it was made) takes over ``old``'s buffer in place (``_in_place``): ``old``'s
        bytes are freed with ``new``'s storage, not with its own. Counted as made where ``old`` is not counted."""
        was, now = StorageWeakRef(old.untyped_storage()), StorageWeakRef(new.untyped_storage())
        gone = self.alive.get(was)
        counted = gone.peek() if isinstance(gone, weakref.finalize) and now not in self.alive else None
        if counted is None or counted[1] != self._freed:  # old was not counted (or was taken over already)
            self._made(new)
            return
        assert isinstance(gone, weakref.finalize)
        gone.detach()
        nbytes = counted[2][1]
        self.alive[was] = weakref.finalize(old.untyped_storage(), self._forget, was)
        self.alive[now] = weakref.finalize(new.untyped_storage(), self._freed, now, nbytes)

    def _forget(self, key: StorageWeakRef) -> None:
        self.alive.pop(key, None)

    def _freed(self, key: StorageWeakRef, nbytes: int) -> None:
        self.now -= nbytes
        self.alive.pop(key, None)


def layer_paths(model: nn.Module, stack: nn.ModuleList) -> list[str]:
    """The module path of each layer of ``stack`` in ``model`` (``layers.0``, ``model.layers.0``, ...)."""
    name = next((n for n, m in model.named_modules() if m is stack), None)
    if name is None:
        raise ConfigError(f"the layer list is not a submodule of {type(model).__name__}")
    return [f"{name}.{i}" if name else str(i) for i in range(len(stack))]


def saver(node: torch.fx.Node, layers: Sequence[str]) -> int | None:
    """The layer that saves ``node``'s value: that of its first user in the forward graph that runs in a layer
    (a layer's output is saved by the next layer that reads it, as in eager autograd), else of the op itself,
    else of the nearest op it is computed from (a value the min cut moved out of the backward has no module)."""
    for n in node.users:
        i = layer_of(n, layers)
        if i is not None:
            return i
    todo, seen = [node], {node}
    while todo:
        n = todo.pop(0)
        if n.meta.get("nn_module_stack"):
            return layer_of(n, layers)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return None


def layer_of(node: torch.fx.Node, layers: Sequence[str]) -> int | None:
    """The layer whose module ran ``node``'s op (from the module stack dynamo records on each node), or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for entry in reversed(list(stack.values())):
        path = "." + _plain(entry[0] if isinstance(entry, tuple) else str(entry)) + "."
        for i, layer in enumerate(layers):
            if f".{layer}." in path:
                return i
    return None


def _plain(path: str) -> str:
    """Dynamo's spelling of a module path in dots: ``L['self'].layers[0]`` -> ``L.self.layers.0`` (the root is
    ``L['self']``, or ``L['args'][0]`` where a decorator wraps the forward: a layer is matched as a dotted part)."""
    return re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path).replace("._modules.", ".")


def _concrete(n: Any) -> int:
    """A size as a number: a random-number state's is symbolic on fake tensors, with the real state's as hint."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)  # SymInt.node: its SymNode, whose hint is the value
    return int(hint) if hint is not None else int(n)


def _outputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return [a for a in (args if isinstance(args, tuple | list) else (args,)) if isinstance(a, torch.fx.Node)]


def _storage(node: torch.fx.Node) -> StorageWeakRef | None:
    val = node.meta.get("val")
    return _key(val) if isinstance(val, Tensor) else None


def _key(t: Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _autograd_nodes(output: Tensor) -> Iterator[Any]:
    todo, seen = [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(f for f, _ in node.next_functions)


def _functorch_config() -> Any:
    import torch._functorch.config as config

    return config


def _budget(budget: float | None) -> Any:
    if budget is None:
        return contextlib.nullcontext()
    return _functorch_config().patch(activation_memory_budget=float(budget))


def _aot_apis() -> tuple[Callable[..., Any], dict[str, Callable[..., Any]]]:
    """``aot_autograd`` and the partitioners, or one line naming what this PyTorch lacks."""
    try:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import default_partition
    except ImportError as e:
        raise ConfigError(
            f"tracing a compiled step needs AOTAutograd's backend API, which this PyTorch ({torch.__version__}) "
            f"lacks ({e}); use PyTorch 2.6 to 2.13"
        ) from e
    return aot_autograd, {"default": default_partition, "min_cut": _inductor_partition()}


def _inductor_partition() -> Callable[..., Any]:
    """Inductor's own partition function (its joint-graph passes, such as turning random ops into seeds, then the
    min cut) where this PyTorch exposes it (2.8 on), else the min cut as Inductor calls it, without those passes."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    try:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.virtualized import V
    except ImportError:
        return functools.partial(min_cut_rematerialization_partition, compiler="inductor")

    def inductor(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        with V.set_fake_mode(detect_fake_mode(inputs)):  # what Inductor's compile sets before it partitions
            return partition_fn(joint, inputs, **kwargs)

    return inductor


def _inductor_decompositions(*, cuda: bool = False) -> Any:
    """Inductor's decomposition table: the ops its min cut partitions (``None`` where this PyTorch lacks it);
    ``cuda``: with LayerNorm's as on CUDA (``_cuda_layer_norm``)."""
    try:
        from torch._inductor.decomposition import select_decomp_table
    except ImportError:
        return None
    table = select_decomp_table()
    if cuda:
        table = {**table, torch.ops.aten.native_layer_norm.default: _cuda_layer_norm}
    return table


def _cuda_layer_norm(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``native_layer_norm`` decomposed as on a CUDA tensor: ``torch._refs.native_layer_norm`` casts the mean and
    rstd back to a bf16 or fp16 input's dtype on the CPU only, so a CUDA step keeps them in fp32 (its eager
    kernel too, ``recompute.trace._cuda``). The same ops otherwise: the statistics in the computation dtype, the
    output in the input's."""
    dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    dims = list(range(input.dim() - len(normalized_shape), input.dim()))
    x = input.contiguous().to(dtype)
    var, mean = torch.var_mean(x, dim=dims, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(input.dtype), mean, rstd
