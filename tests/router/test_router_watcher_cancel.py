"""A worker's event watcher ends when it is cancelled, even when the cancel races a message.

Python 3.11's `asyncio.wait_for` returns the inner result when a cancel arrives just as the
awaited message does (gh-86296); the watcher then kept streaming, and `Router._forget` — and the
`splitserve up --planner` tick that removes a worker through it — waited forever (seen as an e2e
planner run whose pools never drained). The stub below answers every read at once, which makes
that race frequent; each round cancels a watcher mid-stream and needs it gone within a second.
"""

from __future__ import annotations

import asyncio

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import DiscoveryConfig
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.pool import WorkerPool
from splitserve.router.placement.watcher import WorkerWatcher


class _Stream:
    """WatchEvents' call: an endless stream of load reports, each ready at once."""

    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        return pb.WorkerEvent(load=pb.LoadReport())

    def cancel(self):
        self.cancelled = True


class _Channels:
    def __init__(self):
        self.streams: list[_Stream] = []

    def stub(self, address):
        channels = self

        class Stub:
            def WatchEvents(self, request):
                channels.streams.append(_Stream())
                return channels.streams[-1]

        return Stub()


def test_a_cancelled_watcher_ends_even_when_the_cancel_races_a_message():
    """(The loop runs in a daemon thread: a watcher that ignores its cancel would also hang
    asyncio.run's own shutdown, so the test fails on a deadline instead of hanging.)"""
    import threading

    outcome: list[BaseException | None] = []

    async def main():
        for _ in range(200):
            pool = WorkerPool("m", 16)
            pool.add("w:1")
            channels = _Channels()
            watcher = WorkerWatcher("w:1", pool, InMemoryPrefixIndex(), channels, DiscoveryConfig())
            task = asyncio.create_task(watcher.run())
            for _ in range(3):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            assert done, "the watcher kept running after it was cancelled"
            assert task.cancelled() and channels.streams[-1].cancelled

    def run():
        try:
            asyncio.run(main())
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread below
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert outcome, "a cancelled watcher kept its event loop running"
    if outcome[0] is not None:
        raise outcome[0]
