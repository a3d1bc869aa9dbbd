"""cost.allocator: torch's caching allocator replayed, each rule on a case computed by hand from
c10/cuda/CUDACachingAllocator.cpp (the function each test names), and properties of any event sequence."""
import pytest
from hypothesis import given, settings, strategies as st

from plandsl.cost.allocator import allocation_size, replay, round_size

KiB, MiB = 1 << 10, 1 << 20


def classic(events, **kw):
    return replay(events, expandable=False, **kw)


def test_round_size_to_512_bytes():
    """`round_size`: a multiple of 512 bytes, at least 512 (not a power of two: roundup_power2_divisions is off)."""
    assert [round_size(n) for n in (1, 512, 513, 1000, 3 * MiB + 1)] == [512, 512, 1024, 1024, 3 * MiB + 512]
    assert classic([(1, "a", 1000)]).peak_allocated == 1024
    assert classic([(1, "a", 3 * MiB + 1)]).peak_allocated == 3 * MiB + 512


def test_small_and_large_pools_split_at_1_MiB():
    """`get_pool`: up to 1 MiB the small pool (2 MiB segments, 2 MiB pages), above it the large (20 MiB)."""
    assert classic([(1, "a", MiB)]).peak_reserved == 2 * MiB
    assert classic([(1, "a", MiB + 1)]).peak_reserved == 20 * MiB
    assert replay([(1, "a", MiB)]).peak_reserved == 2 * MiB
    assert replay([(1, "a", MiB + 1)]).peak_reserved == 20 * MiB
    # the pools do not share: a freed large block does not serve a small request
    assert classic([(1, "a", 3 * MiB), (-1, "a", 0), (1, "b", KiB)]).peak_reserved == 22 * MiB


def test_allocation_size():
    """`get_allocation_size`: 2 MiB for a small request, 20 MiB below 10 MiB, else rounded up to 2 MiB."""
    assert [allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 30 * MiB + 512)] == \
        [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 32 * MiB]
    assert classic([(1, "a", 7 * MiB)]).peak_reserved == 20 * MiB  # and its 13 MiB rest serves the next
    assert classic([(1, "a", 7 * MiB), (1, "b", 13 * MiB)]).peak_reserved == 20 * MiB
    assert classic([(1, "a", 30 * MiB)]).peak_reserved == 30 * MiB


def test_best_fit_takes_the_smallest_hole():
    """`get_free_block`: the smallest free block that fits, not the first. Segments of 40, 30 and 50 MiB, the first
    two freed; 25 MiB goes in the 30 MiB one, so that 38 MiB still finds the 40 (a first fit would have taken the
    40 MiB hole and cudaMalloc'd 38 more)."""
    events = [(1, "a", 40 * MiB), (1, "b", 30 * MiB), (1, "c", 50 * MiB), (-1, "a", 0), (-1, "b", 0),
              (1, "d", 25 * MiB), (1, "e", 38 * MiB)]
    assert classic(events).peak_reserved == 120 * MiB


def test_best_fit_ties_by_address():
    """`get_free_block`: of equal free blocks the lower address (the set is ordered by size, then address). One
    segment of four 20 MiB blocks; the first and third freed; 10 MiB goes in the first, so that freeing the second
    merges 10 + 20 + 20 MiB, where 45 MiB fits without mapping more (in the third it would leave 40 and 10)."""
    events = [(1, k, 20 * MiB) for k in "abcd"] + [(-1, "a", 0), (-1, "c", 0), (1, "x", 10 * MiB), (-1, "b", 0),
                                                  (1, "y", 45 * MiB)]
    result = replay(events)
    assert result.peak_reserved == 80 * MiB and result.end_allocated == 10 * MiB + 45 * MiB + 20 * MiB


def test_split_thresholds():
    """`should_split`: classic large blocks split only when more than 1 MiB is left (else the whole block is handed
    out and counted); the small pool and expandable segments split when 512 bytes are left."""
    assert classic([(1, "a", 11 * MiB + MiB // 2)]).peak_allocated == 12 * MiB  # 0.5 MiB left: not split
    assert classic([(1, "a", 11 * MiB)]).peak_allocated == 12 * MiB  # exactly 1 MiB left: not split
    assert classic([(1, "a", 10 * MiB + MiB // 2)]).peak_allocated == 10 * MiB + MiB // 2  # 1.5 MiB left: split
    assert classic([(1, "a", 19 * MiB)]).peak_allocated == 20 * MiB
    assert replay([(1, "a", 19 * MiB)]).peak_allocated == 19 * MiB
    assert replay([(1, "a", 20 * MiB - 512)]).peak_allocated == 20 * MiB - 512
    small = classic([(1, "a", MiB), (1, "b", MiB - 512), (1, "c", 512)])  # three blocks of one 2 MiB segment
    assert (small.peak_allocated, small.peak_reserved) == (2 * MiB, 2 * MiB)


@pytest.mark.parametrize("order", ["bc", "cb"])
def test_merge_on_free(order):
    """`free_block`/`try_merge_blocks`: a freed block merges with a free neighbour on either side. Three 20 MiB
    blocks of one 60 MiB segment; two adjacent ones freed make a 40 MiB hole that 40 MiB fits."""
    events = [(1, "s", 60 * MiB), (-1, "s", 0)] + [(1, k, 20 * MiB) for k in "bcd"]
    events += [(-1, k, 0) for k in order] + [(1, "e", 40 * MiB)]
    assert classic(events).peak_reserved == 60 * MiB


def test_expandable_growth_reuses_the_free_tail():
    """`find_expandable_block`: the free block before the unmapped space is extended. 30 MiB maps two 20 MiB pages
    (10 MiB free at the end); 25 MiB then maps one page more after those 10 (not two pages for 25)."""
    result = replay([(1, "a", 30 * MiB), (1, "b", 25 * MiB)])
    assert (result.peak_reserved, result.holes) == (60 * MiB, (5 * MiB,))


def test_a_hole_too_small_is_skipped_and_the_segment_grows():
    """`get_free_block` finds no block, `try_allocate_expandable_block` maps at the end: a freed 20 MiB hole between
    live blocks does not take 30 MiB, which maps two pages more. Fragmentation: reserved - allocated = the holes."""
    result = replay([(1, "a", 20 * MiB), (1, "b", 20 * MiB), (-1, "a", 0), (1, "c", 30 * MiB)])
    assert (result.peak_reserved, result.allocated_at_peak) == (80 * MiB, 50 * MiB)
    assert result.holes == (20 * MiB, 10 * MiB) and result.peak_event == 3


def test_raises_list_the_events_that_grew_the_reserve_and_the_hole_they_passed_over():
    """`replay(..., raises=)`: the loss's pattern in small. A 16-bit logits tensor (20 MiB) is freed between live
    blocks and its fp32 temporaries (40 MiB each) find no hole of their size: each maps two 20 MiB pages at the
    segment's end, the 20 MiB hole passed over (the largest free block then); a raise below the threshold is left
    out, and none are recorded unless asked."""
    events = [(1, "act", 20 * MiB), (1, "logits", 20 * MiB), (1, "fp32", 40 * MiB), (-1, "logits", 0),
              (1, "grad", 40 * MiB), (1, "small", 2 * MiB)]
    result = replay(events, raises=20 * MiB)
    assert [(r.event, r.request, r.raised, r.largest_hole) for r in result.raises] == [
        (0, 20 * MiB, 20 * MiB, 0), (1, 20 * MiB, 20 * MiB, 0), (2, 40 * MiB, 40 * MiB, 0),
        (4, 40 * MiB, 40 * MiB, 20 * MiB)]
    assert result.raises[-1].allocated == 100 * MiB and result.raises[-1].reserved == 120 * MiB
    assert replay(events).raises == ()


def test_a_free_tail_is_passed_over_for_a_hole_that_cannot_grow():
    """`get_free_block` under expandable segments: a block followed by unmapped space counts as all it can grow to,
    so 30 MiB takes a 60 MiB hole before the 40 MiB free tail. 55 MiB then finds no hole and extends the tail by a
    page (a plain best fit would have used the tail, and 55 MiB the 60 MiB hole: 120 MiB reserved)."""
    events = [(1, "a", 60 * MiB), (1, "b", 20 * MiB), (1, "c", 40 * MiB), (-1, "a", 0), (-1, "c", 0),
              (1, "d", 30 * MiB), (1, "e", 55 * MiB)]
    assert replay(events).peak_reserved == 140 * MiB


def test_classic_segments_never_merge():
    """`alloc_block`: each cudaMalloc is its own segment; two freed adjacent 30 MiB segments do not make a 60 MiB
    hole (an expandable segment does: one segment, its blocks merge)."""
    events = [(1, "a", 30 * MiB), (1, "b", 30 * MiB), (-1, "a", 0), (-1, "b", 0), (1, "c", 50 * MiB)]
    assert classic(events).peak_reserved == 110 * MiB
    assert replay(events).peak_reserved == 60 * MiB


@pytest.mark.parametrize("expandable, reserved", [(False, 60 * MiB), (True, 80 * MiB)])
def test_streams_do_not_share(expandable, reserved):
    """Pools per stream (`BlockComparatorSize` orders by stream first; one expandable segment per stream): a block
    freed on stream 0 does not serve stream 1."""
    events = [(1, "a", 30 * MiB, 0), (-1, "a", 0), (1, "b", 30 * MiB, 1)]
    assert replay(events, expandable=expandable).peak_reserved == reserved
    same = [(1, "a", 30 * MiB, 0), (-1, "a", 0), (1, "b", 30 * MiB, 0)]
    assert replay(same, expandable=expandable).peak_reserved == reserved // 2


def test_capacity_releases_cached_segments_then_runs_out():
    """`malloc`: a cudaMalloc over capacity frees every free unsplit segment (`release_cached_blocks`) and retries
    once (`num_alloc_retries`); when nothing more can be freed, out of memory, and the replay stops."""
    events = [(1, "a", 30 * MiB), (-1, "a", 0), (1, "b", 40 * MiB), (1, "c", 30 * MiB), (1, "d", MiB + 1)]
    result = classic(events, capacity=60 * MiB)
    assert (result.retries, result.out_of_memory, result.oom_event) == (2, True, 3)
    assert (result.peak_reserved, result.end_reserved, result.end_allocated) == (40 * MiB, 40 * MiB, 40 * MiB)
    assert classic(events[:3], capacity=60 * MiB).out_of_memory is False


def test_capacity_unmaps_free_pages_then_runs_out():
    """`release_cached_blocks` under expandable segments (`unmap_block`): a free hole's whole pages are unmapped and
    the pages mapped again at the end; a partly used page cannot be unmapped, and then out of memory."""
    events = [(1, "a", 20 * MiB), (1, "b", 20 * MiB), (-1, "a", 0), (1, "c", 30 * MiB), (1, "d", 30 * MiB)]
    result = replay(events, capacity=60 * MiB)
    assert (result.retries, result.out_of_memory, result.oom_event) == (2, True, 4)
    assert (result.peak_reserved, result.end_reserved, result.end_allocated) == (60 * MiB, 60 * MiB, 50 * MiB)


def test_unknown_frees_and_live_keys():
    """A free of an unknown key (or a second free) is ignored; an allocation under a live key frees it first; a
    size of 0 allocates nothing (torch returns a null pointer)."""
    plain = classic([(1, "a", 30 * MiB)])
    assert classic([(1, "a", 30 * MiB), (-1, "x", 0)]) == plain
    twice = classic([(1, "a", 30 * MiB), (-1, "a", 0), (-1, "a", 0), (1, "b", 30 * MiB)])
    assert (twice.peak_allocated, twice.peak_reserved, twice.end_allocated) == (30 * MiB, 30 * MiB, 30 * MiB)
    again = classic([(1, "a", 30 * MiB), (1, "a", 30 * MiB)])
    assert (again.peak_allocated, again.peak_reserved) == (30 * MiB, 30 * MiB)
    assert classic([(1, "z", 0)]).peak_reserved == 0
    with pytest.raises(ValueError, match="event 0"):
        replay([(0, "a", MiB)])


SIZES = st.one_of(st.integers(1, 2 * MiB), st.integers(MiB, 64 * MiB))
EVENTS = st.lists(st.tuples(st.sampled_from([1, 1, -1]), st.integers(0, 11), SIZES, st.integers(0, 1)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(events=EVENTS, expandable=st.booleans())
def test_reserved_covers_allocated_covers_requested(events, expandable):
    """For any sequence: peak reserved >= peak allocated >= the most requested bytes live at once, and without a
    capacity nothing is given back (the reserve ends at its peak, no retry)."""
    live, most = {}, 0
    for op, key, size, _ in events:
        live.pop(key, None)
        if op == 1:
            live[key] = size
        most = max(most, sum(live.values()))
    result = replay(events, expandable=expandable)
    assert result.peak_reserved >= result.peak_allocated >= most
    assert result.end_reserved == result.peak_reserved and result.retries == 0 and not result.out_of_memory
    assert result.end_reserved >= result.end_allocated >= sum(round_size(n) for n in live.values())


@settings(max_examples=100, deadline=None)
@given(events=EVENTS, expandable=st.booleans(), capacity=st.integers(64, 256))
def test_capacity_bounds_the_reserve(events, expandable, capacity):
    """Under a capacity the reserve never exceeds it, and an allocation that fails is the one the replay stopped at."""
    result = replay(events, expandable=expandable, capacity=capacity * MiB)
    assert result.peak_reserved <= capacity * MiB and result.end_reserved >= result.end_allocated
    assert result.out_of_memory == (result.oom_event is not None)
