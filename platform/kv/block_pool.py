"""The block pool: ref-counted KV blocks, two LRU free queues, and the prefix-cache map.

Every block is in exactly one of two states:
  * in use: ref_cnt > 0 (held by one or more requests; shared prefix blocks have ref_cnt > 1);
  * free: ref_cnt == 0 and in one of the two free queues below. A free block may still carry a
    hash: its KV is valid and a later request with the same prefix can revive it (a hit).

The free blocks form two LRU queues, a segmented LRU (SLRU): "probation" holds blocks without a
hash and cached blocks no request has hit since they were cached; "protected" holds cached blocks
a later request reused (a prefix-cache hit). Allocation takes the head (least recently freed) of
probation first and of protected only when probation is empty, and a block that still carries a
hash is evicted from the hash map first. A block without a hash holds nothing anyone can reuse:
it joins probation at its head, to be taken before any cached block. Protected holds at most
PROTECTED_FRACTION of the blocks; past that, its head moves to probation's tail (and must be hit
again to come back), so prefixes that stopped being used age out instead of pinning the cache.

Why not one LRU queue (vLLM's free-block queue): a request leaves blocks nobody will ask for again
(its unique question and answer), and under pure LRU they outlive an older shared prefix (a group's
system prompt between two of its requests), which the next request of that group then recomputes.
A prefix that has been hit once is the one likely to be hit again: 2Q's and SLRU's rule for
database buffer pools, applied to KV blocks. Requests free their blocks tail-first, so within one
chain, in either queue, the last block is evicted before the first: a chain keeps a usable prefix
for as long as possible.

Each change to the hash map is recorded as a KV event (BlockStored / BlockRemoved /
AllCleared) for the router's prefix index; `take_events()` drains them. Nothing may drain them
(an offline engine has no subscriber), so the pending list is bounded: past `max_pending_events`
it is compacted into a snapshot, AllCleared followed by one BlockStored per tier naming every hash
held now. Replaying the snapshot gives a subscriber the same view the dropped history would have,
and the list stays within a few entries of the bound however long the pool runs. Events carry the tier
they describe: 1 is this pool, 2 the second tier (platform/kv/tier.py), which an optional
`EvictionSink` fills with the KV of every block the pool evicts and whose own events the pool
appends to its stream right after the BlockRemoved of that eviction, so the order stays causal.

KV groups (platform/kv/groups.py) share the pool and its free queue, each with its own hash map:
the same token block is a different entry in each group (a sliding-window group may have released
and lost it while the full group still holds it). `group` names it in every lookup, cache call
and event; a single-group engine only ever uses group 0.

The pool is the only writer of ref counts, hashes and the free queue; callers hold Block
handles and go through these methods. `check_invariants()` verifies the whole state.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from splitserve.platform.hashing import BlockHash

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the KV group whose hash map holds block_hash
    reused: bool = False  # hit by a request since it was cached: protected when free (SLRU)


TIER_CACHE = 1  # the pool's own blocks (device memory)
TIER_SECOND = 2  # the second tier: host memory or a local file tier


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tier: int = TIER_CACHE
    group: int = 0  # the KV group (platform/kv/groups.py) whose blocks these are
    # a hit of L blocks needs this group's blocks [L - window_blocks, L); 0: all of [0, L)
    window_blocks: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    tier: int = TIER_CACHE
    group: int = 0


@dataclass(frozen=True)
class AllCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared


class EvictionSink(Protocol):
    """Where evicted blocks go (the second tier)."""

    def offload(self, evicted: list[tuple[int, BlockHash]]) -> list[KVEvent]:
        """Called inside `allocate`, before the evicted blocks are handed out (their KV is still
        intact): keep the KV of these (block_id, hash) pairs. Returns the events it caused."""

    def clear(self) -> list[KVEvent]:
        """Called by `reset_prefix_cache`: forget everything. Returns the events it caused."""

    def held_hashes(self) -> list[BlockHash]:
        """Every hash the sink holds now (for a compacted event snapshot); changes nothing."""


@dataclass
class PoolStats:
    """Counters for metrics and tests; monotonically increasing."""

    num_evictions: int = 0  # cached blocks reused for something else
    num_sink_failures: int = 0  # offloads the second tier raised on (its copy is lost, the blocks are not)
    num_event_compactions: int = 0  # times the undrained event list was replaced by a snapshot


MAX_PENDING_EVENTS = 4096  # undrained events kept before the list is compacted into a snapshot
PROTECTED_FRACTION = 0.8  # of the pool's blocks, at most this many free in the protected queue (SLRU)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_sink: EvictionSink | None = None,
        max_pending_events: int = MAX_PENDING_EVENTS,
        null_block: bool = False,
    ):
        """`null_block`: block 0 is set aside, held for ever, as what the holes of a KV group's
        table read (kv/grouped.py); the `num_blocks` usable blocks are 1..num_blocks."""
        assert num_blocks > 0
        if not isinstance(max_pending_events, int) or max_pending_events < 8:
            raise ValueError(f"max_pending_events must be an integer >= 8, got {max_pending_events!r}")
        self.max_pending_events = max_pending_events
        self.eviction_sink = eviction_sink
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks + null_block)]
        self.null_block = Block(-1)
        if null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1
        # block_id -> Block, head = next to allocate (LRU order): probation, then protected.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[null_block:])
        self._protected: OrderedDict[int, Block] = OrderedDict()
        self.max_protected = int(num_blocks * PROTECTED_FRACTION)
        self._cached: dict[BlockHash, Block] = {}  # group 0's hash map
        self._group_cached: dict[int, dict[BlockHash, Block]] = {}  # the other groups'
        self._window_blocks: dict[int, int] = {}  # group -> its events' window_blocks
        self._events: list[KVEvent] = []
        self.stats = PoolStats()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._protected)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (held by a request), 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, in use or free, every group (len()s: safe from another thread)."""
        return len(self._cached) + sum(len(m) for m in list(self._group_cached.values()))

    def num_cached_blocks_of(self, group: int) -> int:
        return len(self._map(group))

    def lookup(self, block_hash: BlockHash, group: int = 0) -> Block | None:
        """The cached block with this hash in `group`, or None. Changes nothing."""
        return self._map(group).get(block_hash)

    def peek(self, block_hash: BlockHash, group: int = 0) -> bool:
        """Whether the hash is cached; no stats, no mutation (safe to call from another thread)."""
        return block_hash in self._map(group)

    def cached_hashes(self, group: int = 0) -> list[BlockHash]:
        return list(self._map(group))

    def _map(self, group: int) -> dict[BlockHash, Block]:
        if group == 0:
            return self._cached
        return self._group_cached.setdefault(group, {})

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` blocks from the free queues' heads (probation first), evicting their
        cached KV."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        evicted = []
        for _ in range(num_blocks):
            _, block = (self._free or self._protected).popitem(last=False)
            if block.block_hash is not None:
                group = block.group
                evicted.append((block.block_id, self._uncache(block), group))
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self.stats.num_evictions += len(evicted)
            self._record_removed(evicted)
            if self.eviction_sink is not None:
                self._offload(evicted)
            self._bound_events()
        return out

    def touch(self, blocks: Iterable[Block], hit: bool = False) -> None:
        """Take one more reference on blocks, reviving free ones. `hit`: they are a request's
        prefix-cache hit, which makes each cached one protected when it is free again (SLRU)."""
        for block in blocks:
            if block.ref_cnt == 0:
                (self._protected if block.block_id in self._protected else self._free).pop(block.block_id)
            block.ref_cnt += 1
            if hit and block.block_hash is not None:
                block.reused = True

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference. A block reaching zero joins a free queue in the given order: the
        protected tail if it was reused, probation's head if it has no hash, probation's tail
        otherwise. Callers pass a request's blocks tail-first (see the module docstring).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self._free[block.block_id] = block
                self._free.move_to_end(block.block_id, last=False)
            elif block.reused:
                self._protected[block.block_id] = block
                if len(self._protected) > self.max_protected:
                    _, aged = self._protected.popitem(last=False)
                    aged.reused = False  # back on probation: it must be hit again to return
                    self._free[aged.block_id] = aged
            else:
                self._free[block.block_id] = block

    def cache_blocks(
        self,
        blocks: list[Block],
        hashes: list[BlockHash],
        parent_hash: BlockHash | None,
        group: int = 0,
        window_blocks: int = 0,
    ) -> None:
        """Register full, computed blocks under their hashes (in chain order) in `group`'s map.

        A hash that is already cached under another block keeps the older block: the new one
        stays a private copy and is simply not shared.
        """
        if not self.enable_caching:
            return
        stored = []
        cached = self._map(group)
        for block, block_hash in zip(blocks, hashes, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is cached already"
            if block_hash in cached:
                continue
            block.block_hash = block_hash
            block.group = group
            cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._window_blocks[group] = window_blocks
            self._events.append(BlockStored(tuple(stored), parent_hash, group=group, window_blocks=window_blocks))
            self._bound_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._free.update(self._protected)
        self._protected.clear()
        for block in self.blocks:
            block.block_hash = None
            block.reused = False
        self._cached.clear()
        self._group_cached.clear()
        self._events.append(AllCleared())
        if self.eviction_sink is not None:
            self.eviction_sink.clear()  # AllCleared covers every tier
        return True

    def record_events(self, events: list[KVEvent]) -> None:
        """Append events of the second tier (its entries dropped outside an eviction)."""
        self._events += events
        self._bound_events()

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _record_removed(self, evicted: list[tuple[int, BlockHash, int]]) -> None:
        """One BlockRemoved per group of the evicted (block_id, hash, group) triples."""
        groups = sorted({g for _, _, g in evicted})
        for group in groups:
            self._events.append(BlockRemoved(tuple(h for _, h, g in evicted if g == group), group=group))

    def _offload(self, evicted: list[tuple[int, BlockHash, int]]) -> None:
        """Hand evicted blocks to the second tier. The blocks are off the free list already and
        go to the caller whatever happens there: a failing tier loses its copy, never a block.
        (The tier serves single-group engines only: kv/tier.py refuses the others.)"""
        try:
            self._events += self.eviction_sink.offload([(b, h) for b, h, _ in evicted])
        except Exception:
            self.stats.num_sink_failures += 1
            log.exception("the second KV tier failed to take %d evicted blocks; they are dropped from it", len(evicted))

    @property
    def num_pending_events(self) -> int:
        return len(self._events)

    def _bound_events(self) -> None:
        """Past the bound, replace the undrained history by a snapshot of what is held now."""
        if len(self._events) <= self.max_pending_events:
            return
        snapshot: list[KVEvent] = [AllCleared()]
        if self._cached:
            snapshot.append(BlockStored(tuple(self._cached), None))
        for group, cached in sorted(self._group_cached.items()):
            if cached:
                snapshot.append(BlockStored(tuple(cached), None, group=group, window_blocks=self._window_blocks[group]))
        held = self.eviction_sink.held_hashes() if self.eviction_sink is not None else []
        if held:
            snapshot.append(BlockStored(tuple(held), None, tier=TIER_SECOND))
        self._events = snapshot
        self.stats.num_event_compactions += 1

    def _uncache(self, block: Block) -> BlockHash:
        block_hash = block.block_hash
        cached = self._map(block.group)
        assert cached.get(block_hash) is block
        del cached[block_hash]
        block.block_hash = None
        block.group = 0
        block.reused = False
        return block_hash

    # -- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_free, in_protected = block.block_id in self._free, block.block_id in self._protected
            assert not (in_free and in_protected), f"block {block.block_id} is in both free queues"
            assert (in_free or in_protected) == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_free or in_protected}"
            )
            if in_protected:
                assert block.reused and block.block_hash is not None, f"protected block {block.block_id} was never hit"
            if block.block_hash is not None:
                assert self._map(block.group).get(block.block_hash) is block, f"block {block.block_id} hash not mapped"
        for group, cached in ((0, self._cached), *self._group_cached.items()):
            for block_hash, block in cached.items():
                assert block.block_hash == block_hash and block.group == group, (
                    f"group {group}'s hash map points to block {block.block_id} with another hash or group"
                )
        assert all(self._free[i] is self.blocks[i] for i in self._free)
        assert all(self._protected[i] is self.blocks[i] for i in self._protected)
        assert len(self._protected) <= self.max_protected, f"{len(self._protected)} protected blocks"
