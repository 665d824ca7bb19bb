"""The `tcp` transport: the stream protocol (stream.py) over asyncio TCP streams.

Framing on the byte stream: each header is a 4-byte little-endian length plus JSON
(stream.encode_header); a "layers" header is followed directly by its payloads' bytes.
Payload bytes are written from a zero-copy view of the sender's tensor and read straight into
the receiver's scratch buffer. Always available (no native dependency); UCX is the fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence

import numpy as np

from splitserve.workers.transfer.receiver import ChannelReceiver
from splitserve.workers.transfer.sender import ChannelSender
from splitserve.workers.transfer.stream import MAX_HEADER_BYTES, Channel, ChannelClosed, encode_header

STREAM_LIMIT = 4 << 20  # the StreamReader's buffer: large enough not to stall a layer


class TcpChannel(Channel):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()

    async def send(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        async with self._lock:  # one message at a time, never interleaved
            try:
                self._writer.write(encode_header(header))
                for payload in payloads:  # drain each: what the socket does not take is copied
                    self._writer.write(memoryview(payload).cast("B"))
                    await self._writer.drain()
                await self._writer.drain()
            except (ConnectionError, RuntimeError) as e:
                raise ChannelClosed(repr(e)) from e

    async def recv(self) -> dict:
        try:
            n = int.from_bytes(await self._reader.readexactly(4), "little")
            if n > MAX_HEADER_BYTES:
                raise ChannelClosed(f"protocol error: header of {n} bytes")
            return json.loads(await self._reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ChannelClosed(repr(e)) from e

    async def recv_payload(self, out: np.ndarray, is_last: bool) -> None:
        view, pos = memoryview(out).cast("B"), 0
        try:
            while pos < len(view):
                chunk = await self._reader.read(len(view) - pos)
                if not chunk:
                    raise ChannelClosed(f"connection closed after {pos} of {len(view)} payload bytes")
                view[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
        except ConnectionError as e:
            raise ChannelClosed(repr(e)) from e

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    @property
    def is_alive(self) -> bool:
        return not self._writer.is_closing() and not self._reader.at_eof()


class TcpReceiver(ChannelReceiver):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kw):
        super().__init__(**kw)
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None

    async def _listen(self) -> str:
        self._server = await asyncio.start_server(
            lambda r, w: self._serve(TcpChannel(r, w)), self._host, self._port, limit=STREAM_LIMIT
        )
        port = self._server.sockets[0].getsockname()[1]
        return f"tcp://{self._host}:{port}"

    async def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()


class TcpSender(ChannelSender):
    scheme = "tcp"

    def __init__(
        self,
        ack_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        auth_key: bytes | None = None,
        ipc_backend=None,
    ):
        super().__init__(self._open_channel, ack_timeout_s, auth_key, ipc_backend)
        self._connect_timeout_s = connect_timeout_s

    async def _open_channel(self, hostport: str) -> Channel:
        host, port = hostport.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), limit=STREAM_LIMIT), self._connect_timeout_s
        )
        return TcpChannel(reader, writer)
