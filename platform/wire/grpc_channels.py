"""One gRPC channel per worker address, shared by everything in a process that calls that worker.

The router's pool follows discovery: a worker that leaves is dropped by its watcher (`drop`).
A decode worker learns prefill workers only from the requests that name them, so it cannot be
told that one left: its pool drops a channel whose call failed with UNAVAILABLE (`drop`), and
any channel idle for `idle_s` (the next lookup sweeps them), so workers that scaled away do not
keep sockets and reconnect timers open forever.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.platform.wire.grpc_tls import TlsFiles, aio_channel


class ChannelPool:
    def __init__(
        self, tls: TlsFiles | None = None, options: list | tuple = (), idle_s: float | None = None, clock=time.monotonic
    ):
        self.tls = tls  # mutual TLS to every worker when set
        self.options = list(options)
        self.idle_s = idle_s
        self.clock = clock
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.WorkerStub] = {}
        self._last_used: dict[str, float] = {}
        self._closing: set[asyncio.Task] = set()

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    def stub(self, address: str) -> pb_grpc.WorkerStub:
        now = self.clock()
        self._sweep(now)
        self._last_used[address] = now
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._channels[address] = aio_channel(address, self.tls, self.options)
            stub = self._stubs[address] = pb_grpc.WorkerStub(channel)
        return stub

    async def drop(self, address: str) -> None:
        self._stubs.pop(address, None)
        self._last_used.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _sweep(self, now: float) -> None:
        if self.idle_s is None:
            return
        for address in [a for a, t in self._last_used.items() if now - t > self.idle_s and a in self._channels]:
            task = asyncio.get_running_loop().create_task(self.drop(address))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
