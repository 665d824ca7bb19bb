"""The transfer protocol over a message channel, shared by the ucx, tcp and inproc transports.

A transport only supplies a `Channel`: an ordered, bidirectional pipe of small JSON headers,
each optionally followed by one binary payload whose size the header states. On it:

    sender -> receiver   {"op": "open", "transfer_id", "layout": KVLayout.to_dict(), "num_blocks"}
                         {"op": "layer", "transfer_id", "layer", "nbytes"} + nbytes of payload
                         ... one per layer, any order ...
                         {"op": "end", "transfer_id", "aborted": bool}
    receiver -> sender   {"type": "failed", ...} at most once, as soon as the receiver rejects
                         (layout mismatch, unknown id) or abandons (abort, deadline) the transfer
                         {"type": "final", "ok", ...} exactly once, in reply to "end"

The sender does not wait for the open to be accepted (no round trip before the first layer).
The receiver always reads a layer's payload, even one it discards, so the channel stays in
step; a header it cannot accept (payload larger than `max_payload_bytes`, unknown op) is a
protocol error and closes the connection. A channel carries one transfer at a time; the sender
leases it from a per-address pool on open() and returns it after the final reply, so an
endpoint is never closed while a message is in flight (UCX would reset it) and consecutive
transfers to one receiver reuse a connection. Concurrent transfers use separate connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from splitserve.workers.transfer.base import KVLayout, KVSender, LayoutMismatchError, SendHandle, TransferError
from splitserve.workers.transfer.table import TransferTable

MAX_PAYLOAD_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 16
log = logging.getLogger(__name__)


class ChannelClosed(Exception):
    """The peer went away (or the channel was closed locally)."""


class Channel(ABC):
    """One connection. send() may be called concurrently (implementations serialize it);
    recv()/recv_payload() only by one reader, in order."""

    @abstractmethod
    async def send(self, header: dict, payload: np.ndarray | None = None) -> None: ...

    @abstractmethod
    async def recv(self) -> dict: ...

    @abstractmethod
    async def recv_payload(self, out: np.ndarray) -> None:
        """Receive the payload announced by the last header into `out` (uint8, exact size)."""

    @abstractmethod
    async def close(self) -> None: ...

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...


def encode_header(header: dict) -> bytes:
    """A header on the wire: 4-byte little-endian length, then compact JSON."""
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES - 4:
        raise ValueError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES - 4}")
    return len(body).to_bytes(4, "little") + body


def payload_bytes(payload: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor (works for bfloat16 too)."""
    return payload.reshape(-1).view(torch.uint8).numpy()


# -- receiver ----------------------------------------------------------------------------------
async def serve_channel(channel: Channel, table: TransferTable, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
    """Run one incoming connection until it closes; a bound transfer is failed if it drops."""
    bound: str | None = None
    scratch = torch.empty(0, dtype=torch.uint8)
    background: set[asyncio.Task] = set()

    async def send_quietly(reply: dict) -> None:
        with contextlib.suppress(Exception):  # the peer is gone: the table already settled it
            await channel.send(reply)

    def notify(reply: dict) -> None:  # called by the table, possibly from another task
        task = asyncio.ensure_future(send_quietly(reply))
        background.add(task)
        task.add_done_callback(background.discard)

    try:
        while True:
            msg = await channel.recv()
            op = msg.get("op")
            if op == "open":
                bound = msg["transfer_id"]
                reply = table.bind(bound, msg["layout"], msg["num_blocks"], notify)
                if reply is not None:
                    await channel.send(reply)
            elif op == "layer" and 0 <= msg["nbytes"] <= max_payload_bytes:
                nbytes = msg["nbytes"]
                if scratch.numel() < nbytes:
                    scratch = torch.empty(nbytes, dtype=torch.uint8)
                view = scratch[:nbytes]
                await channel.recv_payload(view.numpy())
                if msg["transfer_id"] == bound:  # else: not this connection's transfer, discard
                    table.write(bound, msg["layer"], view)
            elif op == "end":
                await channel.send(table.finish(msg["transfer_id"], bool(msg.get("aborted"))))
                bound = None
            else:
                raise ChannelClosed(f"protocol error: unexpected header {msg!r}")
    except (ChannelClosed, ConnectionError, asyncio.IncompleteReadError):
        pass
    except Exception as e:  # a malformed header, or the transport failing in its own way
        log.warning("closing a KV transfer connection: %r", e)
    finally:
        if bound is not None:
            table.disconnect(bound)
        with contextlib.suppress(Exception):
            await channel.close()


# -- sender ----------------------------------------------------------------------------------
class _Conn:
    """A pooled sender-side connection; its reader task routes replies to the current handle."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.handle: ChannelSendHandle | None = None
        self.is_dead = False
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while True:
                reply = await self.channel.recv()
                h = self.handle
                if h is not None and reply.get("transfer_id") == h.transfer_id:
                    h._on_reply(reply)
        except Exception as e:  # any way the channel ends
            self.is_dead = True
            if self.handle is not None:
                self.handle._on_lost(e)

    async def close(self) -> None:
        self.is_dead = True
        self.reader.cancel()
        with contextlib.suppress(Exception):
            await self.channel.close()


def _error_from_reply(reply: dict) -> TransferError:
    if reply.get("error_kind") == "layout":
        mismatches = {k: tuple(v) for k, v in (reply.get("mismatches") or {}).items()}
        return LayoutMismatchError(reply["error"], mismatches)
    return TransferError(reply.get("error") or f"transfer failed ({reply.get('state')})")


class ChannelSendHandle(SendHandle):
    def __init__(self, sender: ChannelSender, conn: _Conn, address: str, transfer_id: str,
                 layout: KVLayout, num_blocks: int):
        self._sender, self._conn, self._address = sender, conn, address
        self.transfer_id, self.layout, self.num_blocks = transfer_id, layout, num_blocks
        self.bytes_sent = 0
        self.error: TransferError | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._final: asyncio.Future = asyncio.get_running_loop().create_future()
        self._is_closed = False
        conn.handle = self
        self._pump = asyncio.ensure_future(self._send_all())

    def _on_reply(self, reply: dict) -> None:
        if not reply.get("ok") and self.error is None:
            self.error = _error_from_reply(reply)
        if reply.get("type") == "final" and not self._final.done():
            self._final.set_result(reply)

    def _on_lost(self, exc: Exception) -> None:
        if self.error is None:
            self.error = TransferError(f"connection to {self._address} lost: {exc!r}")
        if not self._final.done():
            self._final.set_exception(self.error)

    async def _send_all(self) -> None:
        """The one writer of this channel while the transfer is open: layers in queue order."""
        try:
            await self._conn.channel.send({"op": "open", "transfer_id": self.transfer_id,
                                           "layout": self.layout.to_dict(), "num_blocks": self.num_blocks})
            while (item := await self._queue.get()) is not None:
                layer, payload = item
                if self.error is not None:
                    continue  # the receiver gave up on it: drop
                data = payload_bytes(payload)
                await self._conn.channel.send({"op": "layer", "transfer_id": self.transfer_id,
                                               "layer": layer, "nbytes": data.nbytes}, data)
                self.bytes_sent += data.nbytes
        except Exception as e:
            self._conn.is_dead = True
            self._on_lost(e)

    async def send_layer(self, layer: int, payload: torch.Tensor) -> None:
        shape = self.layout.layer_payload_shape(self.num_blocks)
        if tuple(payload.shape) != shape or payload.dtype != self.layout.torch_dtype or not payload.is_contiguous():
            raise ValueError(f"layer payload must be a contiguous {self.layout.dtype} tensor of shape {shape}, got "
                             f"{payload.dtype} {tuple(payload.shape)} (contiguous={payload.is_contiguous()})")
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")
        if self._is_closed:
            raise RuntimeError(f"send_layer after finish/abort of transfer {self.transfer_id!r}")
        self._queue.put_nowait((layer, payload.cpu()))

    async def finish(self) -> None:
        await self._end(aborted=False, timeout_s=self._sender.ack_timeout_s)
        if self.error is not None:
            raise self.error

    async def abort(self) -> None:
        if self.error is None:
            self.error = TransferError(f"transfer {self.transfer_id!r} aborted by the sender")
        await self._end(aborted=True, timeout_s=min(5.0, self._sender.ack_timeout_s))

    async def _end(self, aborted: bool, timeout_s: float) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if aborted:
            while not self._queue.empty():
                self._queue.get_nowait()
        self._queue.put_nowait(None)
        try:
            await self._pump
            if not self._conn.is_dead:
                await self._conn.channel.send({"op": "end", "transfer_id": self.transfer_id, "aborted": aborted})
            await asyncio.wait_for(asyncio.shield(self._final), timeout_s)
        except TimeoutError:
            self._on_lost(TimeoutError(f"no acknowledgement within {timeout_s:g} s"))
        except Exception as e:
            self._on_lost(e)
        self._conn.handle = None
        await self._sender._give_back(self._address, self._conn, reusable=self._final.done()
                                      and not self._final.cancelled() and self._final.exception() is None)


class ChannelSender(KVSender):
    """Pools connections per address; a transport supplies `scheme` and `connect()`."""

    scheme: str

    def __init__(self, connect: Callable[[str], Awaitable[Channel]], ack_timeout_s: float = 30.0):
        self._connect = connect
        self.ack_timeout_s = ack_timeout_s
        self._idle: dict[str, list[_Conn]] = {}
        self.num_connects = 0  # connections opened so far (pooling is visible in tests)

    def num_idle(self, address: str) -> int:
        return len(self._idle.get(address, []))

    async def open(self, address: str, transfer_id: str, layout: KVLayout, num_blocks: int) -> SendHandle:
        prefix = f"{self.scheme}://"
        if not address.startswith(prefix):
            raise ValueError(f"a {self.scheme} sender cannot send to {address!r} (expected {prefix}...)")
        idle = self._idle.get(address, [])
        while idle:
            conn = idle.pop()
            if not conn.is_dead and conn.channel.is_alive:
                break
            await conn.close()
        else:
            try:
                conn = _Conn(await self._connect(address[len(prefix):]))
            except Exception as e:
                raise TransferError(f"cannot connect to {address}: {e!r}") from e
            self.num_connects += 1
        return ChannelSendHandle(self, conn, address, transfer_id, layout, num_blocks)

    async def _give_back(self, address: str, conn: _Conn, reusable: bool) -> None:
        if reusable and not conn.is_dead:
            self._idle.setdefault(address, []).append(conn)
        else:
            await conn.close()

    async def close(self) -> None:
        conns = [c for lst in self._idle.values() for c in lst]
        self._idle.clear()
        for conn in conns:
            await conn.close()
