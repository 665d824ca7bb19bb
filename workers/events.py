"""Fan-out of a worker's KV events and load reports to every WatchEvents subscriber.

The engine thread hands batches of KV events to `publish()` (thread-safe); the hub keeps a mirror of
the hashes the worker currently caches. A new subscriber first gets WorkerInfo (with this process's
worker_id), then AllCleared followed by one BlockStored of the whole mirror (and one more of the
second tier's, tier=2) — a snapshot that replaces whatever the subscriber knew, which is also how a
restarted worker (new worker_id, empty cache) tells routers to forget it; a model with several KV
groups gets one BlockStored per group, naming it and its window — and the latest load
report (so a resubscribing router does not score the worker as unknown until the next interval),
then live events and a load report every interval. A slow subscriber's queue is bounded; on overflow
it is disconnected and must resubscribe (getting a fresh snapshot) rather than silently missing
events.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from splitserve.platform.kv.block_pool import TIER_SECOND, AllCleared, BlockRemoved, BlockStored, KVEvent
from splitserve.platform.wire import worker_pb2 as pb

MAX_QUEUED = 10_000


class SubscriberOverflow(Exception):
    pass


class EventHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, info: pb.WorkerInfo):
        self.loop = loop
        self.info = info
        self._cached: dict[bytes, None] = {}  # insertion-ordered set: the KV cache (tier 1)
        self._second: dict[bytes, None] = {}  # the second tier (platform/kv/tier.py)
        self._groups: dict[int, tuple[int, dict[bytes, None]]] = {}  # KV group > 0 -> (window_blocks, its hashes)
        self._subscribers: set[asyncio.Queue] = set()
        self._seq = itertools.count(1)
        self._last_load: pb.LoadReport | None = None

    def publish(self, events: list[KVEvent]) -> None:
        """Called from the engine thread."""
        self.loop.call_soon_threadsafe(self._fan_out, events)

    def _fan_out(self, events: list[KVEvent]) -> None:
        for event in events:
            self._mirror(event)
            self._send(pb.WorkerEvent(kv=to_proto(event)))

    def _mirror(self, event: KVEvent) -> None:
        if isinstance(event, (BlockStored, BlockRemoved)):
            mirror = self._second if event.tier == TIER_SECOND else self._cached
            if event.group:
                window = event.window_blocks if isinstance(event, BlockStored) else 0
                window, mirror = self._groups.setdefault(event.group, (window, {}))
            if isinstance(event, BlockStored):
                mirror.update(dict.fromkeys(event.block_hashes))
            else:
                for h in event.block_hashes:
                    mirror.pop(h, None)
        else:
            self._cached.clear()
            self._second.clear()
            self._groups.clear()

    def _send(self, msg: pb.WorkerEvent) -> None:
        msg.seq, msg.timestamp = next(self._seq), time.time()
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_QUEUED:
                self._subscribers.discard(queue)
                queue.put_nowait(None)  # tells the subscriber loop it overflowed
            else:
                queue.put_nowait(msg)

    def send_load(self, load: pb.LoadReport) -> None:
        self._last_load = load
        self._send(pb.WorkerEvent(load=load))

    async def subscribe(self):
        """Yields WorkerEvents: info, snapshot, latest load, then live events until cancelled."""
        queue: asyncio.Queue = asyncio.Queue()
        first = [pb.WorkerEvent(info=self.info), pb.WorkerEvent(kv=pb.KVEvent(cleared=pb.AllCleared()))]
        if self._cached:
            first.append(pb.WorkerEvent(kv=pb.KVEvent(stored=pb.BlockStored(block_hashes=list(self._cached)))))
        if self._second:
            first.append(
                pb.WorkerEvent(kv=pb.KVEvent(stored=pb.BlockStored(block_hashes=list(self._second), tier=TIER_SECOND)))
            )
        for group, (window, hashes) in sorted(self._groups.items()):
            if hashes:
                stored = pb.BlockStored(block_hashes=list(hashes), group=group, window_blocks=window)
                first.append(pb.WorkerEvent(kv=pb.KVEvent(stored=stored)))
        if self._last_load is not None:
            first.append(pb.WorkerEvent(load=self._last_load))
        for msg in first:
            msg.seq, msg.timestamp = next(self._seq), time.time()
        self._subscribers.add(queue)
        try:
            for msg in first:
                yield msg
            while True:
                msg = await queue.get()
                if msg is None:
                    raise SubscriberOverflow(f"subscriber fell more than {MAX_QUEUED} events behind")
                yield msg
        finally:
            self._subscribers.discard(queue)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)


def to_proto(event: KVEvent) -> pb.KVEvent:
    if isinstance(event, BlockStored):
        return pb.KVEvent(
            stored=pb.BlockStored(
                block_hashes=list(event.block_hashes),
                parent_hash=event.parent_hash or b"",
                tier=event.tier,
                group=event.group,
                window_blocks=event.window_blocks,
            )
        )
    if isinstance(event, BlockRemoved):
        return pb.KVEvent(
            removed=pb.BlockRemoved(block_hashes=list(event.block_hashes), tier=event.tier, group=event.group)
        )
    assert isinstance(event, AllCleared)
    return pb.KVEvent(cleared=pb.AllCleared())
