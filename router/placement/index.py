"""The prefix index: which KV blocks each worker holds, by block hash.

Two kinds of entries per worker:

- *stored*: fed by the worker's WatchEvents stream (BlockStored / BlockRemoved / AllCleared),
  so it follows the worker's own cache and eviction. Bounded per worker: past
  `max_blocks_per_worker` the least recently stored hashes are dropped, the tail of a chain
  before its head (a block is useless without its parent), as the engine evicts. This is a
  guard against missed removals; a worker's own pool is normally far smaller.
- *second tier*: blocks the worker evicted from its cache into its second tier (events with
  tier=2; docs/kv-tiers.md). The worker copies them back on a hit, so they count for `match`
  like stored ones; they have their own LRU bound.
- *speculative*: the full prompt blocks of a request just routed to the worker, valid for
  `ttl_s`. They cover the gap between routing a request and its KV events arriving, so a burst
  of requests sharing a prefix follows the first one instead of scattering.

`match(workers, hashes)` returns, per worker, the number of *consecutive* blocks from block 0
that the worker holds (stored or unexpired speculative): a block whose parent is missing cannot
be reused by the engine, so a hole ends the match. The walk stops at the first miss, so a worker
holding nothing costs one lookup.

KV groups (a model mixing layer types, docs/engine.md): events of group g > 0 name the group and
its `window_blocks` w. The engine reuses L blocks only if every such group holds blocks
[L - w, L) (w = 0: all of [0, L)), so the match shrinks from group 0's run until every group's
window before it is held (speculative entries count for every group). A worker whose sliding
group dropped a window's old blocks is then not scored for a prefix that ends among them.

Backends: `InMemoryPrefixIndex` (one router) here, `RedisPrefixIndex` (router replicas share
one view) in index_redis.py. Both are written only by the router's event watchers and the
placement's speculative inserts; the methods are async because the Redis backend is.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

from splitserve.platform.wire import worker_pb2 as pb

SECOND_TIER = 2  # KV events' tier of a worker's second tier (0 or 1: its cache)


class PrefixIndex(Protocol):
    async def apply(self, worker: str, event: pb.KVEvent) -> None:
        """Apply one KV event of `worker` (called by its watcher, in stream order)."""

    async def clear(self, worker: str) -> None:
        """Forget everything about `worker` (it restarted or left)."""

    async def add_speculative(self, worker: str, hashes: list[bytes]) -> None:
        """Count `hashes` as held by `worker` for the TTL (called when a request is routed)."""

    async def match(self, workers: list[str], hashes: list[bytes]) -> dict[str, int]:
        """Consecutive matched blocks from block 0, per worker in `workers`."""

    async def num_blocks(self, worker: str) -> int:
        """Stored (not speculative) entries of `worker`."""

    async def close(self) -> None:
        """Release connections."""


class _WorkerEntries:
    """One worker's hashes: stored (LRU order) and speculative (hash -> expiry time)."""

    __slots__ = ("stored", "second", "speculative", "groups")

    def __init__(self):
        self.stored: OrderedDict[bytes, None] = OrderedDict()
        self.second: OrderedDict[bytes, None] = OrderedDict()  # the worker's second tier
        self.speculative: dict[bytes, float] = {}
        self.groups: dict[int, tuple[int, OrderedDict[bytes, None]]] = {}  # KV group > 0 -> (window_blocks, hashes)

    def tier(self, tier: int, group: int = 0, window_blocks: int = 0) -> OrderedDict[bytes, None]:
        if group:
            return self.groups.setdefault(group, (window_blocks, OrderedDict()))[1]
        return self.second if tier == SECOND_TIER else self.stored


class InMemoryPrefixIndex:
    def __init__(self, ttl_s: float = 10.0, max_blocks_per_worker: int = 262_144, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_blocks_per_worker = max_blocks_per_worker
        self.clock = clock
        self._workers: dict[str, _WorkerEntries] = {}

    def _entries(self, worker: str) -> _WorkerEntries:
        entries = self._workers.get(worker)
        if entries is None:
            entries = self._workers[worker] = _WorkerEntries()
        return entries

    async def apply(self, worker: str, event: pb.KVEvent) -> None:
        self.apply_now(worker, event)

    def apply_now(self, worker: str, event: pb.KVEvent) -> None:
        kind = event.WhichOneof("event")
        entries = self._entries(worker)
        if kind == "stored":
            s = event.stored
            self._store(entries, s.block_hashes, entries.tier(s.tier, s.group, s.window_blocks))
        elif kind == "removed":
            stored = entries.tier(event.removed.tier, event.removed.group)
            for h in event.removed.block_hashes:
                stored.pop(h, None)
        elif kind == "cleared":
            entries.stored.clear()
            entries.second.clear()
            entries.speculative.clear()
            entries.groups.clear()

    def _store(self, entries: _WorkerEntries, hashes, stored: OrderedDict[bytes, None]) -> None:
        for h in reversed(hashes):  # a chain's head ends most recent: its tail is dropped first
            stored[h] = None
            stored.move_to_end(h)
            entries.speculative.pop(h, None)  # confirmed
        excess = len(stored) - self.max_blocks_per_worker
        for _ in range(max(excess, 0)):
            stored.popitem(last=False)

    async def clear(self, worker: str) -> None:
        self._workers.pop(worker, None)

    async def add_speculative(self, worker: str, hashes: list[bytes]) -> None:
        if self.ttl_s <= 0 or not hashes:
            return
        entries = self._entries(worker)
        now = self.clock()
        if len(entries.speculative) > self.max_blocks_per_worker:
            entries.speculative = {h: t for h, t in entries.speculative.items() if t > now}
        expiry = now + self.ttl_s
        for h in hashes:
            if h not in entries.stored:
                entries.speculative[h] = expiry

    async def match(self, workers: list[str], hashes: list[bytes]) -> dict[str, int]:
        return self.match_now(workers, hashes)

    def match_now(self, workers: list[str], hashes: list[bytes]) -> dict[str, int]:
        now = self.clock()
        out = {}
        for worker in workers:
            entries = self._workers.get(worker)
            n = 0
            if entries is not None:
                stored, second, spec = entries.stored, entries.second, entries.speculative
                for h in hashes:
                    if h not in stored and h not in second and spec.get(h, 0.0) <= now:
                        break
                    n += 1
                if entries.groups:
                    n = _group_match(entries, hashes, n, now)
            out[worker] = n
        return out

    async def num_blocks(self, worker: str) -> int:
        entries = self._workers.get(worker)
        return len(entries.stored) if entries else 0

    async def close(self) -> None:
        pass


def _group_match(entries: _WorkerEntries, hashes: list[bytes], n: int, now: float) -> int:
    """Shrink group 0's match `n` until every other KV group holds its window before it."""
    spec = entries.speculative
    for window_blocks, held in entries.groups.values():
        while n and not all(
            h in held or spec.get(h, 0.0) > now for h in hashes[max(0, n - window_blocks) if window_blocks else 0 : n]
        ):
            n -= 1
    return n
