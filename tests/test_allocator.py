"""The caching allocator's replay (``recompute.core.allocator``) against sequences worked by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (quoted in each test)."""

from __future__ import annotations

import pytest

from recompute.core.allocator import (
    AllocationStream,
    CachingAllocator,
    OutOfMemory,
    replay,
    round_size,
    stream_of,
)

KiB, MiB = 1 << 10, 1 << 20


def test_requests_round_up_to_512_bytes() -> None:
    """``round_size``: below 512 B, 512 B; else the next multiple of 512 B."""
    assert [round_size(n) for n in (0, 1, 512, 513, 1000, 4096)] == [512, 512, 512, 1024, 1024, 4096]


def test_small_requests_pack_into_2_mib_segments() -> None:
    """Requests of at most 1 MiB share 2 MiB segments (``kSmallBuffer``), split down to 512 B."""
    a = CachingAllocator()
    for _ in range(4):
        a.malloc(512 * KiB)
    assert (a.allocated, a.reserved, a.segments) == (2 * MiB, 2 * MiB, 1)
    a.malloc(1)  # a fifth request opens a second segment
    assert (a.allocated, a.reserved, a.segments) == (2 * MiB + 512, 4 * MiB, 2)
    a.malloc(1 * MiB)  # exactly 1 MiB is still small: the second segment has room for it
    assert (a.reserved, a.segments) == (4 * MiB, 2)


@pytest.mark.parametrize(
    ("request_bytes", "segment", "allocated"),
    [
        (1 * MiB + 1, 20 * MiB, 1 * MiB + 512),  # 1-10 MiB: a 20 MiB segment, split (19 MiB left > 1 MiB)
        (9 * MiB, 20 * MiB, 9 * MiB),
        (10 * MiB, 10 * MiB, 10 * MiB),  # 10 MiB and up: rounded up to 2 MiB, nothing left
        (11 * MiB, 12 * MiB, 12 * MiB),  # 1 MiB left is not more than 1 MiB: no split, the block counts whole
        (13 * MiB + 1, 14 * MiB, 14 * MiB),  # ~1 MiB left: whole
        (100 * MiB + 512, 102 * MiB, 100 * MiB + 512),  # 2 MiB - 512 B left (> 1 MiB): split
    ],
)
def test_a_large_request_takes_a_new_segment_by_the_rules(request_bytes: int, segment: int, allocated: int) -> None:
    """``get_allocation_size`` and ``should_split`` for the large pool (remaining > kSmallSize)."""
    a = CachingAllocator()
    a.malloc(request_bytes)
    assert (a.reserved, a.allocated) == (segment, allocated)


def test_the_smallest_cached_block_that_fits_serves_a_request() -> None:
    """Best fit (``get_free_block``): of cached 30 and 40 MiB blocks a 25 MiB request takes the 30, split (5 MiB
    left); a 6 MiB request, too large for that rest, splits the 40; a 5 MiB request takes the rest exactly."""
    a = CachingAllocator()
    thirty, forty = a.malloc(30 * MiB), a.malloc(40 * MiB)
    a.free(thirty)
    a.free(forty)
    assert a.reserved == 70 * MiB and a.allocated == 0
    at = a.malloc(25 * MiB)
    assert at == thirty and a.reserved == 70 * MiB  # the 30 MiB segment, split into 25 + 5
    a.malloc(6 * MiB)  # the 5 MiB rest is too small; the 40 MiB block serves it
    a.malloc(5 * MiB)  # and the 5 MiB rest now fits exactly
    assert (a.reserved, a.allocated, a.segments) == (70 * MiB, 36 * MiB, 2)


def test_freed_neighbours_merge_and_serve_a_larger_request() -> None:
    """``free_block`` merges a freed block with free neighbours: two freed 5 MiB blocks of one 20 MiB segment
    serve a 9 MiB request without a new segment; apart (an allocated block between them) they cannot."""
    a = CachingAllocator()
    first, second, third = (a.malloc(5 * MiB) for _ in range(3))  # one 20 MiB segment: 5 + 5 + 5 + 5 free
    assert (a.reserved, a.segments) == (20 * MiB, 1)
    a.free(first)
    a.free(third)  # merges with the free 5 MiB at the end: 10 MiB free there
    a.malloc(9 * MiB)  # served by the merged 10 MiB (1 MiB left: not split, counted whole)
    assert (a.reserved, a.allocated) == (20 * MiB, 15 * MiB)
    a.malloc(6 * MiB)  # only 5 MiB free (the first block): a new 20 MiB segment
    assert (a.reserved, a.segments) == (40 * MiB, 2)
    a.free(second)
    assert a.allocated == 10 * MiB + 6 * MiB  # the 9 MiB request's whole 10 MiB block and the 6 MiB


def test_over_capacity_the_cached_segments_go_back() -> None:
    """``release_cached_blocks``: a new segment beyond the capacity first frees the cached whole segments; if it
    still does not fit, out of memory."""
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(32 * MiB)  # the cached 30 MiB is too small; 30 + 32 > 40, so the 30 goes back first
    assert (a.reserved, a.reserved_peak, a.segments) == (32 * MiB, 32 * MiB, 1)
    with pytest.raises(OutOfMemory):
        a.malloc(10 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    """With ``max_split_size_mb``: a block that large is never split, serves no smaller request, and serves a
    large one only within 20 MiB of its size."""
    a = CachingAllocator(max_split_size=64 * MiB)
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)  # not from the oversize cached block: a new 30 MiB segment
    assert a.reserved == 130 * MiB
    a.malloc(90 * MiB)  # within 20 MiB of 100: served whole
    assert (a.reserved, a.allocated) == (130 * MiB, 130 * MiB)
    b = CachingAllocator(max_split_size=64 * MiB)
    b.free(b.malloc(100 * MiB))
    b.malloc(70 * MiB)  # 100 >= 70 + 20: not served by it
    assert b.reserved == 170 * MiB


def test_a_replayed_step_reserves_what_its_pattern_leaves_cached() -> None:
    """Worked by hand. The resident 2 MiB parameter takes a 20 MiB segment (S1: 2 + 18 free). Step 1: the 12 MiB
    activation comes from S1's 18 (6 left); the 8 MiB scratch fits in no free block: a new 20 MiB segment (S2);
    both are freed (S1: 2 + 18 free, S2: 20 free); the 14 MiB gradient takes S1's 18 (4 left); a 1 KiB tensor
    takes a 2 MiB small segment; the optimizer's 4 MiB state, made at the first optimizer step, takes S1's 4 MiB
    exactly. Step 2 reuses every segment (the 12 MiB from S1's free 14, the 8 MiB from S2), so the replay stops
    there: 42 MiB reserved; allocated at most 26 MiB, in step 2 with the optimizer's state (2 + 4 + 12 + 8)."""
    stream = AllocationStream(
        resident=((1, 2 * MiB),),
        lazy=((2, 4 * MiB),),
        step=((10, 12 * MiB), (11, 8 * MiB), (11, 0), (10, 0), (12, 14 * MiB), (13, 1 * KiB), (13, 0), (12, 0)),
        optimizer_at=6,
    )
    peaks = replay(stream)
    assert (peaks.reserved, peaks.allocated) == (42 * MiB, 26 * MiB)
    assert (peaks.steps, peaks.segments, peaks.out_of_memory) == (2, 3, False)
    assert peaks.cached == 16 * MiB


def test_a_replay_over_capacity_frees_the_cache_or_fails() -> None:
    stream = AllocationStream(resident=(), lazy=(), step=((1, 12 * MiB), (1, 0), (2, 14 * MiB), (2, 0)), optimizer_at=4)
    assert replay(stream).reserved == 26 * MiB
    assert replay(stream, capacity=14 * MiB).reserved == 14 * MiB  # the cached 12 MiB went back for the 14
    assert replay(stream, capacity=13 * MiB).out_of_memory


def test_a_recorded_list_splits_into_a_stream() -> None:
    events = [(1, 100), (2, 200), (3, 0), (5, 50), (5, 0), (6, 60)]
    stream = stream_of(events, start=3, optimizer_at=5, lazy={2})
    assert stream == AllocationStream(
        resident=((1, 100),), lazy=((2, 200),), step=((5, 50), (5, 0), (6, 60)), optimizer_at=2
    )
