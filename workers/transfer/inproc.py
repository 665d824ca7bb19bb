"""The `inproc` transport: the stream protocol (stream.py) between two objects of one process.

The reference implementation for tests: a module-level registry maps a name to a started
receiver (address "inproc://name"); connecting creates a pair of asyncio queues, one per
direction, and starts the receiver's serving loop on its end. Headers go through a JSON round
trip and payloads are copied at send time, so nothing is shared between the two sides, just
as on a wire. Both sides must run in the same event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence

import numpy as np

from splitserve.workers.transfer.receiver import ChannelReceiver
from splitserve.workers.transfer.sender import ChannelSender
from splitserve.workers.transfer.stream import Channel, ChannelClosed

_RECEIVERS: dict[str, InprocReceiver] = {}
_CLOSED = object()
_names = itertools.count()


class InprocChannel(Channel):
    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, state: dict):
        self._inbox, self._outbox, self._state = inbox, outbox, state  # state is shared by both ends
        self._payloads: list[np.ndarray] = []

    @classmethod
    def pair(cls) -> tuple[InprocChannel, InprocChannel]:
        a, b, state = asyncio.Queue(), asyncio.Queue(), {"closed": False}
        return cls(a, b, state), cls(b, a, state)

    async def send(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        if self._state["closed"]:
            raise ChannelClosed("inproc channel closed")
        copies = [np.array(p, dtype=np.uint8, copy=True) for p in payloads]
        self._outbox.put_nowait((json.loads(json.dumps(header)), copies))

    async def recv(self) -> dict:
        item = await self._inbox.get()
        if item is _CLOSED:
            raise ChannelClosed("inproc channel closed")
        header, self._payloads = item
        return header

    async def recv_payload(self, out: np.ndarray, is_last: bool) -> None:
        payload = self._payloads.pop(0)
        assert payload.nbytes == out.nbytes and is_last == (not self._payloads), "payload does not match its header"
        out[:] = payload

    async def close(self) -> None:
        if not self._state["closed"]:
            self._state["closed"] = True
            self._outbox.put_nowait(_CLOSED)
            self._inbox.put_nowait(_CLOSED)

    @property
    def is_alive(self) -> bool:
        return not self._state["closed"]


class InprocReceiver(ChannelReceiver):
    def __init__(self, name: str | None = None, **kw):
        super().__init__(**kw)
        self._name = name if name is not None else f"receiver-{next(_names)}"
        self._tasks: set[asyncio.Task] = set()

    async def _listen(self) -> str:
        if self._name in _RECEIVERS:
            raise ValueError(f"an inproc receiver named {self._name!r} is already started")
        _RECEIVERS[self._name] = self
        return f"inproc://{self._name}"

    async def _stop_listening(self) -> None:
        _RECEIVERS.pop(self._name, None)

    def _accept(self) -> Channel:
        ours, theirs = InprocChannel.pair()
        task = asyncio.ensure_future(self._serve(ours))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return theirs


class InprocSender(ChannelSender):
    scheme = "inproc"

    def __init__(self, ack_timeout_s: float = 30.0, auth_key: bytes | None = None, ipc_backend=None):
        super().__init__(self._open_channel, ack_timeout_s, auth_key, ipc_backend)

    async def _open_channel(self, name: str) -> Channel:
        receiver = _RECEIVERS.get(name)
        if receiver is None:
            raise ConnectionRefusedError(f"no inproc receiver named {name!r}")
        return receiver._accept()
