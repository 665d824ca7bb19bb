"""Keeping the pool and the prefix index current from each worker's WatchEvents stream.

One `WorkerWatcher` task per known worker address. It subscribes, and per message:
WorkerInfo -> pool.on_info (a new worker_id means a new process: its index entries are
dropped), KV events -> index.apply (in stream order; the stream starts with AllCleared and a
snapshot, so a resubscription replaces whatever the router knew), LoadReport -> pool.on_load.

The stream ending, failing, or staying silent for `stale_after_s` (a live worker reports load
every 0.5 s) marks the worker down — placement skips it and its in-flight requests are moved by
the dispatcher — and the watcher retries after a backoff that starts at `backoff_initial_s` and
doubles up to `backoff_max_s`, reset once a subscription succeeds.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire.grpc_channels import ChannelPool
from splitserve.router.config import DiscoveryConfig
from splitserve.router.placement.index import PrefixIndex
from splitserve.router.placement.pool import WorkerPool

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class WorkerWatcher:
    def __init__(
        self,
        address: str,
        pool: WorkerPool,
        index: PrefixIndex,
        channels: ChannelPool,
        config: DiscoveryConfig,
        on_down=None,
        on_load=None,
    ):
        self.address = address
        self.pool = pool
        self.index = index
        self.channels = channels
        self.config = config
        self.on_down = on_down or (lambda address: None)
        self.on_load = on_load or (lambda address: None)  # after each load report (adapter reconcile)
        self.num_subscriptions = 0

    async def run(self) -> None:
        backoff = self.config.backoff_initial_s
        while True:
            subscribed_before = self.num_subscriptions
            try:
                await self._watch()
                reason = "event stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except TimeoutError:
                reason = f"no event for {self.config.stale_after_s:.1f} s"
            self.pool.on_disconnect(self.address, reason)
            self.on_down(self.address)
            if self.num_subscriptions > subscribed_before:
                backoff = self.config.backoff_initial_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    async def _watch(self) -> None:
        call = self.channels.stub(self.address).WatchEvents(pb.WatchEventsRequest())
        stream = call.__aiter__()
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(stream.__anext__(), timeout=self.config.stale_after_s)
                except StopAsyncIteration:
                    return
                if asyncio.current_task().cancelling():
                    # Python 3.11's wait_for returns the result when a cancel races a message
                    # (gh-86296): without this the watcher of a removed worker streams forever
                    # and whoever awaits it (Router._forget, the planner's tick) hangs.
                    raise asyncio.CancelledError
                await self._handle(msg)
        finally:
            call.cancel()

    async def _handle(self, msg: pb.WorkerEvent) -> None:
        kind = msg.WhichOneof("payload")
        if kind == "info":
            self.num_subscriptions += 1
            if self.pool.on_info(self.address, msg.info):
                await self.index.clear(self.address)
            log.info("worker %s connected: %s, worker_id %s", self.address, msg.info.role, msg.info.worker_id[:8])
        elif kind == "kv":
            await self.index.apply(self.address, msg.kv)
        elif kind == "load":
            self.pool.on_load(self.address, msg.load)
            self.on_load(self.address)
