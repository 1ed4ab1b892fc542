"""PyTorch's CUDA caching allocator, replayed on a stream of allocations and frees: the memory it reserves. Torch-free.

A trace counts the bytes of the tensors alive (what ``torch.cuda.max_memory_allocated`` reports); what a GPU must
hold is what the caching allocator has taken from CUDA (``torch.cuda.max_memory_reserved``): the segments it
``cudaMalloc``'d and keeps cached, partly free. ``CachingAllocator`` follows ``DeviceCachingAllocator`` of
c10/cuda/CUDACachingAllocator.cpp on one stream with the default settings (``PYTORCH_CUDA_ALLOC_CONF`` unset):

- a request is rounded up to a multiple of 512 bytes (``round_size``); one of at most 1 MiB is served from the
  small pool, a larger one from the large pool (``get_pool``);
- the smallest cached free block of the pool that is large enough serves it, the lowest address among equals
  (``get_free_block``: ``BlockComparatorSize`` orders by size, then address);
- without one, a new segment is taken from CUDA: 2 MiB for a small request, 20 MiB for a request under 10 MiB,
  else the request rounded up to 2 MiB (``get_allocation_size``);
- the block found is split when what is left is at least 512 bytes in the small pool, more than 1 MiB in the
  large pool (``should_split``); else the request gets the whole block, which ``memory_allocated`` counts whole;
- a freed block merges with the free blocks beside it in its segment (``free_block``, ``try_merge_blocks``);
  segments are never given back, unless
- a new segment would exceed the capacity: then every cached segment with nothing allocated in it is freed and the
  request tried again (``release_cached_blocks``); if it still does not fit, CUDA is out of memory.

``max_split_size`` (``max_split_size_mb``) is modelled: blocks that large are never split and serve a request only
when it is at least that large and the block less than 20 MiB larger; with a capacity, such cached blocks go back
first (``release_available_cached_blocks``). Not modelled: ``expandable_segments``, ``roundup_power2_divisions``,
``garbage_collection_threshold``, several streams (a block freed after use on a side stream waits for its events),
CUDA graphs' private pools.

``replay`` runs a training step's stream as a run does: the parameters first, the optimizer's state created by the
first optimizer step, then step after step until what is reserved stops growing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "AllocationStream",
    "AllocatorPeaks",
    "CachingAllocator",
    "OutOfMemory",
    "Replay",
    "replay",
    "round_size",
    "stream_of",
]

MIN_BLOCK = 512
"""Every request is rounded up to a multiple of this (``kMinBlockSize``)."""
SMALL_SIZE = 1 << 20
"""The largest request served from the small pool (``kSmallSize``, 1 MiB)."""
SMALL_BUFFER = 2 << 20
"""A small pool's segment (``kSmallBuffer``, 2 MiB)."""
MIN_LARGE_ALLOC = 10 << 20
"""Requests under this take a 20 MiB segment (``kMinLargeAlloc``, 10 MiB)."""
LARGE_BUFFER = 20 << 20
"""The segment of a request between 1 and 10 MiB (``kLargeBuffer``, 20 MiB)."""
ROUND_LARGE = 2 << 20
"""Larger requests' segments are rounded up to this (``kRoundLarge``, 2 MiB)."""

_NEVER = 1 << 62  # no max_split_size: every block may be split


class OutOfMemory(Exception):
    """The allocator could not take a new segment within its capacity, even after freeing the cached ones."""


def round_size(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of ``nbytes`` (``round_size`` without power-of-two divisions)."""
    return MIN_BLOCK * max(1, -(-nbytes // MIN_BLOCK))


def _segment_size(size: int) -> int:
    """Bytes of the segment a rounded request takes when no cached block serves it (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    """A piece of a segment, free or allocated; ``prev``/``next`` are its neighbours in the segment."""

    addr: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def split(self) -> bool:
        return self.prev is not None or self.next is not None


class CachingAllocator:
    """One device's caching allocator on one stream (the module docstring's rules).

    Args:
        capacity: bytes CUDA can give it (None: unlimited); a segment beyond it first frees the cached segments.
        max_split_size: ``max_split_size_mb`` in bytes (None: PyTorch's default, no limit).
    """

    def __init__(self, *, capacity: int | None = None, max_split_size: int | None = None) -> None:
        self.capacity = capacity
        self.max_split = max_split_size if max_split_size is not None else _NEVER
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, addr), by pool
        self._blocks: dict[int, _Block] = {}  # every block, free or allocated, by address
        self._top = 0  # the next segment's address
        self.allocated = 0
        """Bytes of the blocks allocated now (``memory_allocated``: whole blocks, as the allocator counts them)."""
        self.reserved = 0
        """Bytes of the segments held now (``memory_reserved``)."""
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.segments = 0
        """Segments held now."""

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns the block's address (its handle for ``free``).

        Raises:
            OutOfMemory: a new segment does not fit the capacity even with every cached segment freed.
        """
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small) or self._new_segment(size, small)
        if self._should_split(block, size):
            rest = _Block(block.addr + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._blocks[rest.addr] = rest
            self._insert_free(rest)
        block.allocated = True
        self.allocated += block.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return block.addr

    def free(self, addr: int) -> None:
        """Give back the block at ``addr``: cached, merged with the free blocks beside it."""
        block = self._blocks[addr]
        if not block.allocated:
            raise ValueError(f"block at {addr} is not allocated")
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._merge(block, other)
        self._insert_free(block)

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        """The smallest free block of the pool that serves ``size``, taken out of the free set."""
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        found, addr = free[i]
        if size < self.max_split <= found or (size >= self.max_split and found >= size + LARGE_BUFFER):
            return None  # an oversize block serves only a request of nearly its size
        del free[i]
        return self._blocks[addr]

    def _new_segment(self, size: int, small: bool) -> _Block:
        """A new segment for ``size`` (``alloc_block``), after freeing cached segments when over the capacity."""
        nbytes = _segment_size(size)
        if not self._room(nbytes) and not (self._release_oversize(size, small) and self._room(nbytes)):
            self._release_cached()
            if not self._room(nbytes):
                raise OutOfMemory(
                    f"cannot reserve {nbytes} B more beyond {self.reserved} B reserved within {self.capacity} B"
                )
        block = _Block(self._top, nbytes, small)
        self._top += nbytes
        self._blocks[block.addr] = block
        self.reserved += nbytes
        self.segments += 1
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        return block

    def _room(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _should_split(self, block: _Block, size: int) -> bool:
        rest = block.size - size
        if block.small:
            return rest >= MIN_BLOCK
        return size < self.max_split and rest > SMALL_SIZE

    def _merge(self, block: _Block, other: _Block) -> None:
        """Fold the free ``other`` (a neighbour) into ``block`` (``try_merge_blocks``)."""
        self._remove_free(other)
        del self._blocks[other.addr]
        if other is block.prev:
            del self._blocks[block.addr]
            block.addr, block.prev = other.addr, other.prev
            if block.prev is not None:
                block.prev.next = block
            self._blocks[block.addr] = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size

    def _release_oversize(self, size: int, small: bool) -> bool:
        """Free cached blocks of at least ``max_split_size``: the smallest one covering ``size``, else the largest
        ones until ``size`` is covered (``release_available_cached_blocks``); False where there is no such limit
        or not enough (what was freed stays freed)."""
        if self.max_split == _NEVER:
            return False
        wanted, free = max(size, self.max_split), self._free[small]
        i = bisect.bisect_left(free, (wanted, -1))
        if i < len(free):
            self._release(self._blocks[free[i][1]])
            return True
        released = 0
        for found, addr in reversed(list(free)):
            if released >= wanted or found < self.max_split:
                break
            self._release(self._blocks[addr])
            released += found
        return released >= wanted

    def _release_cached(self) -> None:
        """Free every cached segment with nothing allocated in it (``release_cached_blocks``)."""
        for pool in (False, True):
            for _, addr in list(self._free[pool]):
                block = self._blocks[addr]
                if not block.split:
                    self._release(block)

    def _release(self, block: _Block) -> None:
        self._remove_free(block)
        del self._blocks[block.addr]
        self.reserved -= block.size
        self.segments -= 1

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr))

    def _remove_free(self, block: _Block) -> None:
        free = self._free[block.small]
        del free[bisect.bisect_left(free, (block.size, block.addr))]


@dataclass(frozen=True)
class AllocationStream:
    """A training step's device allocations in the order they happen, as a trace records them.

    Events are ``(key, nbytes)``: ``nbytes > 0`` allocates a storage under ``key``, ``0`` frees it; a key is
    unique while its storage lives.
    """

    resident: tuple[tuple[int, int], ...]
    """What exists before the step and lives on: parameters, buffers, the batch."""
    lazy: tuple[tuple[int, int], ...]
    """What the first optimizer step creates and keeps (AdamW's moments and step counters)."""
    step: tuple[tuple[int, int], ...]
    """One step's events: forward, backward, optimizer step and the gradients freed after it."""
    optimizer_at: int
    """Index in ``step`` where the optimizer step begins (where the first step creates ``lazy``)."""


@dataclass(frozen=True)
class AllocatorPeaks:
    """What the caching allocator holds at its most over a run of steps (``replay``)."""

    allocated: int
    """The most bytes allocated at once, in whole blocks (``max_memory_allocated``)."""
    reserved: int
    """The most bytes reserved at once (``max_memory_reserved``)."""
    segments: int
    """Segments held at the end."""
    steps: int
    """Steps replayed: until a step reserved nothing new (at most ``replay``'s ``steps``)."""
    out_of_memory: bool = False
    """The capacity was exceeded (the figures are those up to the failing request)."""

    @property
    def cached(self) -> int:
        """Reserved beyond allocated at their peaks: what fragmentation and caching cost."""
        return self.reserved - self.allocated


@dataclass
class Replay:
    """A replay in progress: the allocator and the handles of the storages alive."""

    allocator: CachingAllocator
    handles: dict[int, int] = field(default_factory=dict)

    def run(self, events: Iterable[tuple[int, int]]) -> None:
        """Apply events; freeing a key not alive (a storage of an earlier step, freed already) does nothing."""
        handles, alloc = self.handles, self.allocator
        for key, nbytes in events:
            if nbytes:
                handles[key] = alloc.malloc(nbytes)
            elif key in handles:
                alloc.free(handles.pop(key))


def replay(
    stream: AllocationStream, *, steps: int = 4, capacity: int | None = None, max_split_size: int | None = None
) -> AllocatorPeaks:
    """Replay a run of ``stream``'s step: the resident storages, then steps (the first creating the optimizer's
    state at its optimizer step), each step's leftovers freed at its end (a training loop's locals), until a step
    reserves nothing new or ``steps`` have run.

    Args:
        capacity: bytes the allocator may reserve (the GPU's memory less what CUDA and others hold); exceeding it
            is ``out_of_memory`` in the result, not an exception.
    """
    allocator = CachingAllocator(capacity=capacity, max_split_size=max_split_size)
    state = Replay(allocator)
    done = 0
    try:
        state.run(stream.resident)
        keep = set(state.handles)
        for done in range(1, steps + 1):
            before = allocator.reserved_peak
            state.run(stream.step[: stream.optimizer_at])
            if done == 1:
                state.run(stream.lazy)
                keep |= {key for key, _ in stream.lazy}
            state.run(stream.step[stream.optimizer_at :])
            state.run((key, 0) for key in list(state.handles) if key not in keep)
            if done > 1 and allocator.reserved_peak == before:
                break
    except OutOfMemory:
        return _peaks(allocator, done, out_of_memory=True)
    return _peaks(allocator, done)


def _peaks(allocator: CachingAllocator, steps: int, *, out_of_memory: bool = False) -> AllocatorPeaks:
    return AllocatorPeaks(
        allocated=allocator.allocated_peak,
        reserved=allocator.reserved_peak,
        segments=allocator.segments,
        steps=steps,
        out_of_memory=out_of_memory,
    )


def stream_of(events: Sequence[tuple[int, int]], *, start: int, optimizer_at: int, lazy: set[int]) -> AllocationStream:
    """An ``AllocationStream`` from one recorded list: events before ``start`` are the resident storages (those
    under a key in ``lazy`` the optimizer's state), the rest the step, whose optimizer step begins at index
    ``optimizer_at`` of the list."""
    before = [(k, n) for k, n in events[:start] if n]
    return AllocationStream(
        resident=tuple((k, n) for k, n in before if k not in lazy),
        lazy=tuple((k, n) for k, n in before if k in lazy),
        step=tuple(events[start:]),
        optimizer_at=max(0, optimizer_at - start),
    )
