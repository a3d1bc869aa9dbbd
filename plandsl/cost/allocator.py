"""torch's CUDA caching allocator replayed over a sequence of allocations and frees: its peak reserved bytes.

Stage: cost model, after a step's tensors are listed as events (allocations and frees, in order). Contract:
`replay(events, expandable=..., capacity=...)` is a pure function of the events -> `Replay` (peak allocated and
reserved bytes, retries, out of memory, and the free holes at the peak reserve); no torch, bounded work (the state is
the blocks the allocator holds; each allocation and free is a bisection over the pool's free blocks).

The rules are those of c10/cuda/CUDACachingAllocator.cpp (read at pytorch commit 001074d2, and the same functions
checked in later versions, where the allocator's settings moved to `AcceleratorAllocatorConfig` and kLargeBuffer
became `large_segment_size`, 20 MiB by default), under its default configuration (no `max_split_size_mb`,
`roundup_power2_divisions`, `garbage_collection_threshold`, no CUDA graph pools), named after its functions:

- `round_size`: a request is rounded up to a multiple of 512 bytes (kMinBlockSize). Requests of at most 1 MiB
  (kSmallSize) go to the small pool, larger ones to the large pool (`get_pool`); pools are per stream (a block is never
  handed to another stream than the one it was allocated on).
- `get_free_block`: the smallest free block of the pool at least as large, ties by address (the free set is ordered
  by (stream, size, address); a generic rewrite, c10/core/CachingDeviceAllocator.h, orders it by size first, which
  is not modelled: docs/cost-model.md). Under expandable segments a block followed by unmapped address space counts as its
  size plus that space (`expandable_size`): a free tail is passed over for the next larger block that is not one.
- `should_split`: a block larger than the request is split when the rest is at least 512 bytes in the small pool
  or under expandable segments, more than 1 MiB (kSmallSize) in the large pool of classic segments; otherwise the
  whole block is handed out (and counted allocated).
- `free_block` / `try_merge_blocks`: a freed block merges with its free neighbours in the same segment.
- Classic segments (`alloc_block`): when no free block fits, cudaMalloc a new segment of `get_allocation_size`:
  2 MiB (kSmallBuffer) for a small request, 20 MiB (kLargeBuffer) below 10 MiB (kMinLargeAlloc), else the request
  rounded up to 2 MiB (kRoundLarge). Segments never merge with each other.
- Expandable segments (`try_allocate_expandable_block`, `find_expandable_block`, `map_block`): one segment per pool
  and stream reserves address space and maps physical pages as needed, 2 MiB pages in the small pool and 20 MiB in
  the large. The allocation takes the lowest address where free and unmapped space together fit the request (the
  free block before the first unmapped range, normally the segment's free tail), mapping the pages it lacks.
- Reserved bytes are the cudaMalloc'd segments and the mapped pages; nothing is given back but under pressure:
  with a `capacity`, a cudaMalloc or map that would exceed it fails, `release_cached_blocks` frees every free
  unsplit segment (classic) or unmaps every page wholly inside a free block (expandable, `unmap_block`), and the
  allocation is retried once (`num_alloc_retries`); if that fails too, torch raises out of memory, and the replay
  stops there. `capacity` is what the device has for the allocator (cudaMalloc's and cuMemCreate's limit); under
  `set_per_process_memory_fraction` torch compares its whole `get_allocation_size` instead, which is not modelled.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Hashable, Iterable

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment; its page under expandable segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a 1-10 MiB request's segment; the large pool's page under expandable segments
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a segment is the request rounded to ROUND_LARGE
ROUND_LARGE = 2 << 20  # kRoundLarge
ADDRESS_SPACE = LARGE_BUFFER << 30  # an expandable segment's address space, 20 PiB: never exhausted (torch: 1 1/8 of
# the device's memory, so that pages unmapped early in the segment can be mapped again at its end)
MAX_HOLES = 16  # free blocks listed at the peak reserve

Event = tuple  # (op, key, size) or (op, key, size, stream): op +1 allocates size bytes under key, -1 frees key


def round_size(size: int) -> int:
    """`round_size`: the bytes a request of `size` takes, a multiple of 512, at least 512."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment a classic cudaMalloc makes for a rounded request that no free block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True, slots=True)
class Replay:
    """What the allocator held over the events. `peak_allocated` counts the blocks handed out (rounded, and whole
    when not split: torch's `allocated_bytes.all.peak`, `max_memory_allocated`); `peak_reserved` the segments and
    mapped pages (`reserved_bytes.all.peak`, `max_memory_reserved`). Of the event that first raised the reserve to
    its peak: `peak_event`, its index, and once it was served, `allocated_at_peak` and `holes`, the free blocks then,
    largest first (at most 16): what fragmentation kept reserved. `out_of_memory` says an allocation failed
    even after the cache was released (`oom_event` its index); the replay stops there, as torch would raise.
    `raises`: where asked (`replay(..., raises=bytes)`), every event that raised the reserved bytes by at least that
    many, in order, as `Raise`s: where the reserve grew beyond the tensors and what holes it passed over."""

    peak_allocated: int
    peak_reserved: int
    end_allocated: int
    end_reserved: int
    retries: int
    out_of_memory: bool
    oom_event: int | None
    peak_event: int | None
    allocated_at_peak: int
    holes: tuple[int, ...]
    raises: tuple["Raise", ...] = ()


@dataclass(frozen=True, slots=True)
class Raise:
    """An event that raised the reserved bytes: its `event` index, the `request` (rounded), the bytes `raised`, and
    once it was served the bytes `allocated` and `reserved` and the `largest_hole`, the largest free block then (a
    request larger than every hole extends the segment, however much is free)."""

    event: int
    request: int
    raised: int
    allocated: int
    reserved: int
    largest_hole: int


class _Segment:
    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int):
        self.base, self.page = base, page


class _Block:
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "segment", "pool")

    def __init__(self, addr: int, size: int, segment: _Segment, pool: "_Pool", mapped: bool = True):
        self.addr, self.size, self.segment, self.pool, self.mapped = addr, size, segment, pool, mapped
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """One stream's small or large pool: its free mapped blocks by (size, address) and its unmapped ranges by
    address (`BlockPool.blocks`, `BlockPool.unmapped`)."""

    __slots__ = ("small", "free", "unmapped")

    def __init__(self, small: bool):
        self.small = small
        self.free: list[tuple[int, int, _Block]] = []
        self.unmapped: list[tuple[int, _Block]] = []


def _splice(block: _Block, before: _Block | None, after: _Block | None) -> None:
    block.prev, block.next = before, after
    if before is not None:
        before.next = block
    if after is not None:
        after.prev = block


class _Allocator:
    """One device's allocator (`DeviceCachingAllocator`) with its statistics."""

    def __init__(self, expandable: bool, capacity: int | None):
        self.expandable, self.capacity = expandable, capacity
        self.pools: dict[tuple[Hashable, bool], _Pool] = {}
        self.next_base = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = 0
        self.event = -1
        self.peak_event: int | None = None
        self.peak_raised = False  # by the event being served: look at the holes when it is done
        self.allocated_at_peak = 0
        self.holes: tuple[int, ...] = ()

    # -- the free sets

    def _add_free(self, block: _Block) -> None:
        insort(block.pool.free, (block.size, block.addr, block))

    def _drop_free(self, block: _Block) -> None:
        free = block.pool.free
        del free[bisect_left(free, (block.size, block.addr))]

    def _add_unmapped(self, block: _Block) -> None:
        insort(block.pool.unmapped, (block.addr, block))

    def _drop_unmapped(self, block: _Block) -> None:
        unmapped = block.pool.unmapped
        del unmapped[bisect_left(unmapped, (block.addr,))]

    # -- statistics

    def _reserve(self, size: int) -> None:
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved, self.peak_event, self.peak_raised = self.reserved, self.event, True

    def settle(self) -> None:
        """After an event that raised the peak reserve: what was allocated then, and the largest free blocks."""
        if self.peak_raised:
            self.peak_raised, self.allocated_at_peak = False, self.allocated
            largest = [entry[0] for pool in self.pools.values() for entry in pool.free[-MAX_HOLES:]]
            self.holes = tuple(sorted(largest, reverse=True)[:MAX_HOLES])

    def _fits(self, size: int) -> bool:
        return self.capacity is None or self.reserved + size <= self.capacity

    # -- blocks

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """`try_merge_blocks`: dst (in no set) absorbs src, its neighbour, when src is free and mapped alike."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        (self._drop_free if src.mapped else self._drop_unmapped)(src)
        if dst.prev is src:
            dst.addr = src.addr
            _splice(dst, src.prev, dst.next)
        else:
            _splice(dst, dst.prev, src.next)
        dst.size += src.size

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        """`get_free_block`: the smallest free block of at least `size`, ties by address; under expandable segments
        a block followed by unmapped space is passed over while the next larger one can grow less."""
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            return None
        if self.expandable:
            def reach(block: _Block) -> int:
                after = block.next
                return block.size + (after.size if after is not None and not after.mapped else 0)
            while i + 1 < len(free) and reach(free[i + 1][2]) < reach(free[i][2]):
                i += 1
        return free.pop(i)[2]

    def _split(self, block: _Block, size: int) -> _Block:
        """`should_split` and `alloc_found_block`: hand out the block's first `size` bytes, its rest stays free."""
        rest = block.size - size
        split = rest >= MIN_BLOCK if block.pool.small or self.expandable else rest > SMALL_SIZE
        if split:
            taken = _Block(block.addr, size, block.segment, block.pool)
            _splice(taken, block.prev, block)
            block.addr += size
            block.size = rest
            self._add_free(block)
            block = taken
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        """`free_block`: the block merges with its free neighbours and returns to its pool."""
        self.allocated -= block.size
        block.allocated = False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._add_free(block)

    # -- new memory

    def _cuda_malloc(self, pool: _Pool, size: int) -> _Block | None:
        """`alloc_block` without expandable segments: a new segment of `get_allocation_size`."""
        segment_size = allocation_size(size)
        if not self._fits(segment_size):
            return None
        block = _Block(self.next_base, segment_size, _Segment(self.next_base, segment_size), pool)
        self.next_base += segment_size
        self._reserve(segment_size)
        return block

    def _map(self, block: _Block, size: int) -> bool:
        """`map_block`: map the pages covering the unmapped block's first `size` bytes (all or none of them); the
        rest stays unmapped after it; the mapped block merges with its free neighbours and joins the free set."""
        page = block.segment.page
        mapped = -(-size // page) * page
        if not self._fits(mapped):
            return False
        self._drop_unmapped(block)
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.segment, block.pool, mapped=False)
            _splice(rest, block, block.next)
            self._add_unmapped(rest)
            block.size = mapped
        block.mapped = True
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._add_free(block)
        self._reserve(mapped)
        return True

    def _expandable_start(self, pool: _Pool, size: int) -> _Block:
        """`find_expandable_block`: the lowest address where free and unmapped blocks in a row hold `size` bytes
        (an unmapped range, or the free block before it); else a new segment."""
        for _, start in pool.unmapped:
            if start.prev is not None and not start.prev.allocated:
                start = start.prev
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return start
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        block = _Block(self.next_base, ADDRESS_SPACE, _Segment(self.next_base, page), pool, mapped=False)
        self.next_base += ADDRESS_SPACE
        self._add_unmapped(block)
        return block

    def _expand(self, pool: _Pool, size: int) -> _Block | None:
        """`try_allocate_expandable_block`: map pages after the start until it holds `size` bytes. Pages mapped by
        an earlier step stay mapped when a later one fails, as in torch."""
        block = self._expandable_start(pool, size)
        if not block.mapped and not self._map(block, min(block.size, size)):
            return None
        while block.size < size:
            after = block.next
            if not self._map(after, min(size - block.size, after.size)):
                return None
            block = after  # it absorbed the free block before it
        self._drop_free(block)
        return block

    def _new_block(self, pool: _Pool, size: int) -> _Block | None:
        return self._expand(pool, size) if self.expandable else self._cuda_malloc(pool, size)

    def _unmap(self, block: _Block) -> None:
        """`unmap_block`: unmap the pages wholly inside a free block; the partial pages either side stay free."""
        segment = block.segment
        page, offset = segment.page, block.addr - segment.base
        first, last = -(-offset // page), (offset + block.size) // page
        if first >= last:
            return
        self._drop_free(block)
        start, size = segment.base + first * page, (last - first) * page
        if start > block.addr:
            before = _Block(block.addr, start - block.addr, segment, block.pool)
            _splice(before, block.prev, block)
            self._add_free(before)
        if block.addr + block.size > start + size:
            after = _Block(start + size, block.addr + block.size - start - size, segment, block.pool)
            _splice(after, block, block.next)
            self._add_free(after)
        block.addr, block.size, block.mapped = start, size, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._add_unmapped(block)
        self.reserved -= size

    def release_cached(self) -> None:
        """`release_cached_blocks`: give back every free whole segment (classic), or unmap every free page and drop
        a segment left with nothing mapped (expandable), in every pool."""
        for pool in self.pools.values():
            for _, _, block in list(pool.free):
                if self.expandable:
                    self._unmap(block)
                    if not block.mapped and block.prev is None and block.next is None:
                        self._drop_unmapped(block)
                elif block.prev is None and block.next is None:
                    self._drop_free(block)
                    self.reserved -= block.size

    def malloc(self, size: int, stream: Hashable) -> _Block | None:
        """`malloc`: a free block, else new memory, else the cache released and new memory again (None: out of
        memory)."""
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self.pools.get((stream, small))
        if pool is None:
            pool = self.pools[(stream, small)] = _Pool(small)
        block = self._best_fit(pool, size) or self._new_block(pool, size)
        if block is None:
            self.release_cached()
            self.retries += 1
            block = self._new_block(pool, size)
            if block is None:
                return None
        return self._split(block, size)


def replay(events: Iterable[Event], *, expandable: bool = True, capacity: int | None = None,
           raises: int | None = None) -> Replay:
    """Replays `events`, each `(op, key, size)` or `(op, key, size, stream)`: op +1 allocates `size` bytes under
    `key` on `stream` (default 0), op -1 frees `key` (its size is not read). An allocation under a live key frees it
    first; a free of an unknown key is ignored; a size of 0 allocates nothing, as torch's allocator. `expandable`:
    `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (torchtitan's default), else classic segments. `capacity`:
    the bytes the allocator may reserve (None: unbounded). `raises`: record each event that raises the reserved bytes
    by at least this many (`Replay.raises`; None: none recorded)."""
    allocator = _Allocator(expandable, capacity)
    live: dict[Hashable, _Block] = {}
    oom_event = None
    recorded: list[Raise] = []
    for index, event in enumerate(events):
        allocator.event = index
        op, key, size = event[0], event[1], event[2]
        if op not in (1, -1):
            raise ValueError(f"event {index}: op is {op!r}, expected +1 (allocate) or -1 (free)")
        before = allocator.reserved
        block = live.pop(key, None)
        if block is not None:
            allocator.free(block)
        if op == 1 and size > 0:
            block = allocator.malloc(size, event[3] if len(event) > 3 else 0)
            if block is None:
                oom_event = index
                allocator.settle()
                break
            live[key] = block
        allocator.settle()
        if raises is not None and op == 1 and allocator.reserved - before >= max(raises, 1):
            largest = max((pool.free[-1][0] for pool in allocator.pools.values() if pool.free), default=0)
            recorded.append(Raise(index, round_size(size), allocator.reserved - before, allocator.allocated,
                                  allocator.reserved, largest))
    return Replay(peak_allocated=allocator.peak_allocated, peak_reserved=allocator.peak_reserved,
                  end_allocated=allocator.allocated, end_reserved=allocator.reserved, retries=allocator.retries,
                  out_of_memory=oom_event is not None, oom_event=oom_event, peak_event=allocator.peak_event,
                  allocated_at_peak=allocator.allocated_at_peak, holes=allocator.holes, raises=tuple(recorded))


__all__ = ["Replay", "Raise", "replay", "round_size", "allocation_size", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER",
           "MIN_LARGE_ALLOC", "ROUND_LARGE"]
