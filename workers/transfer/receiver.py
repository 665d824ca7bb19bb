"""The receiver half every transport shares: a TransferTable plus the connections it serves.

A transport subclass only listens (`_listen`, `_stop_listening`) and hands each accepted
connection, wrapped as a Channel, to `_serve`, which runs a `Connection`: read a header, act on
it through the table (one handler per op), repeat (see stream.py for the messages). The decode
worker's calls go straight to the table, which is the one writer of transfer state.

Connection hardening (each closes the offending connection and leaves every other one alone):
- "layers", "ipc_layers" and "end" must name the transfer this connection opened (`_check_bound`):
  no payload is read (and no CUDA IPC write is counted) before an "open", and a peer cannot end,
  abort or fill a transfer bound on another connection.
- "ipc_hello" (cuda_ipc.py) comes after the handshake, before this connection's first "open" and
  only once: the cache's handles go out only over an authenticated connection (without a session
  key the offer is declined), and "ipc_ready" names only the blocks of the transfer just opened.
- At most `max_pending_handshakes` connections may wait for the handshake (auth.py) at once; more
  are closed on arrival, so idle sockets cannot pile up for the handshake's timeout each.
- A connection that sends nothing for `idle_timeout_s` is closed (`IdleTimeoutChannel`); the
  sender's pool notices and dials a fresh one next time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod

import torch

import splitserve.workers.transfer.auth as auth
import splitserve.workers.transfer.cuda_ipc as cuda_ipc
from splitserve.workers.transfer.base import KVLayout, KVReceiver, TransferStatus, WriteLayer
from splitserve.workers.transfer.quarantine import GRACE_S
from splitserve.workers.transfer.stream import MAX_LAYERS_PER_HEADER, MAX_PAYLOAD_BYTES, Channel, ChannelClosed
from splitserve.workers.transfer.table import TransferTable

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0  # a connection silent this long is closed
MAX_PENDING_HANDSHAKES = 64  # connections waiting for the handshake at once


def advertised(address: str, advertise_host: str) -> str:
    """A receiver's `scheme://host:port` with the host others should dial ("": the bound one)."""
    if not advertise_host:
        return address
    scheme, _, rest = address.partition("://")
    return f"{scheme}://{advertise_host}:{rest.rsplit(':', 1)[1]}"


class ProtocolError(Exception):
    """A header this connection may not send now (e.g. a payload before its "open")."""


def _check_bound(op: object, msg: dict, bound: str | None) -> None:
    """'layers', 'ipc_layers' and 'end' act only on the transfer this connection opened (ProtocolError otherwise)."""
    if op in ("layers", "end", "ipc_layers") and (bound is None or msg.get("transfer_id") != bound):
        raise ProtocolError(
            f"{op!r} for {msg.get('transfer_id')!r} on a connection that "
            + (f"opened {bound!r}" if bound is not None else "opened no transfer")
        )


class IdleTimeoutChannel(Channel):
    """A Channel whose recv() gives up (ChannelClosed) after `idle_timeout_s` without a header."""

    def __init__(self, channel: Channel, idle_timeout_s: float):
        self.inner, self.idle_timeout_s = channel, idle_timeout_s

    async def send(self, header, payloads=()):
        await self.inner.send(header, payloads)

    async def recv(self) -> dict:
        try:
            return await asyncio.wait_for(self.inner.recv(), self.idle_timeout_s)
        except TimeoutError:
            raise ChannelClosed(f"idle for {self.idle_timeout_s:g} s") from None

    async def recv_payload(self, out, is_last: bool) -> None:
        try:
            await asyncio.wait_for(self.inner.recv_payload(out, is_last), self.idle_timeout_s)
        except TimeoutError:
            raise ChannelClosed(f"payload stalled for {self.idle_timeout_s:g} s") from None

    async def close(self) -> None:
        await self.inner.close()

    @property
    def is_alive(self) -> bool:
        return self.inner.is_alive


class Connection:
    """One incoming connection: its state (the transfer it opened, whether its sender got the
    cache's CUDA IPC handles, its payload scratch buffer) and one handler per header op. `serve()`
    runs it until it closes; a bound transfer is failed if it drops. With the handshake's
    `session_key`, an "open" without the transfer's tag (auth.py) closes the connection before
    the transfer is bound. `ipc`: (kv_caches, backend) when this receiver offers its cache over
    CUDA IPC (cuda_ipc.py)."""

    def __init__(
        self,
        channel: Channel,
        table: TransferTable,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        session_key: bytes | None = None,
        ipc=None,
    ):
        self.channel, self.table, self.max_payload_bytes = channel, table, max_payload_bytes
        self.session_key, self.ipc = session_key, ipc
        self.bound: str | None = None  # the transfer this connection opened
        self.is_ipc = False  # this connection's sender got (and may use) the cache's IPC handles
        self.said_hello = False  # the one "ipc_hello" of this connection was answered
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.background: set[asyncio.Task] = set()
        self.handlers = {
            "open": self.on_open,
            "ipc_hello": self.on_ipc_hello,
            "ipc_layers": self.on_ipc_layers,
            "layers": self.on_layers,
            "end": self.on_end,
        }

    async def serve(self, on_auth_failure=None) -> None:
        """Read a header, run its op's handler, repeat; `on_auth_failure` is called when an
        "open" fails its tag check. Every way the connection ends closes it."""
        try:
            while True:
                msg = await self.channel.recv()
                op = msg.get("op")
                _check_bound(op, msg, self.bound)
                handler = self.handlers.get(op)
                if handler is None:
                    raise _unexpected(msg)
                await handler(msg)
        except (ChannelClosed, ConnectionError, asyncio.IncompleteReadError):
            pass
        except ProtocolError as e:
            log.warning("closing a KV transfer connection: %s", e)
        except auth.AuthError as e:
            log.warning("rejected a KV transfer connection: %s", e)
            if on_auth_failure is not None:
                on_auth_failure()
        except Exception as e:  # a malformed header, or the transport failing in its own way
            log.warning("closing a KV transfer connection: %r", e)
        finally:
            if self.bound is not None:
                self.table.disconnect(self.bound)
            with contextlib.suppress(Exception):
                await self.channel.close()

    async def on_open(self, msg: dict) -> None:
        if self.session_key is not None and not auth.is_valid_tag(self.session_key, msg["transfer_id"], msg.get("tag")):
            raise auth.AuthError(f"an open of {msg['transfer_id']!r} without this connection's tag")
        self.bound = msg["transfer_id"]
        reply = self.table.bind(self.bound, msg["layout"], msg["num_blocks"], self.notify, self.hang_up)
        if reply is not None:
            await self.channel.send(reply)
        elif msg.get("ipc"):  # where to write; None: this transfer goes as bytes
            block_ids = self.table.expose_blocks(self.bound) if self.is_ipc else None
            await self.channel.send({"transfer_id": self.bound, "type": "ipc_ready", "block_ids": block_ids})

    async def on_ipc_hello(self, msg: dict) -> None:
        if self.bound is not None or self.said_hello:
            raise ProtocolError(
                "'ipc_hello' "
                + ("after an 'open'" if self.bound is not None else "twice")
                + " on one connection (it comes once, before the first transfer)"
            )
        self.said_hello = True
        reply = (
            cuda_ipc.offer(*self.ipc, hello=msg, session_key=self.session_key)
            if self.ipc is not None
            else {
                "type": "ipc_declined",
                "reason": "this decode worker does not offer CUDA IPC (--kv-transport auto on a GPU does)",
            }
        )
        self.is_ipc = reply["type"] == "ipc_offer"
        await self.channel.send(reply)

    async def on_ipc_layers(self, msg: dict) -> None:
        if not self.is_ipc or not 1 <= len(msg["layers"]) <= MAX_LAYERS_PER_HEADER:
            raise _unexpected(msg)
        for layer in msg["layers"]:  # bound to this connection's transfer (_check_bound)
            self.table.mark_written(self.bound, layer, msg["first_block"], msg["num_blocks"])

    async def on_layers(self, msg: dict) -> None:
        nbytes, layers = msg["nbytes"], msg["layers"]
        if not 0 <= nbytes <= self.max_payload_bytes or not 1 <= len(layers) <= MAX_LAYERS_PER_HEADER:
            raise _unexpected(msg)
        if self.scratch.numel() < nbytes:
            self.scratch = torch.empty(nbytes, dtype=torch.uint8)
        view = self.scratch[:nbytes]
        for i, layer in enumerate(layers):
            await self.channel.recv_payload(view.numpy(), is_last=i == len(layers) - 1)
            if msg["transfer_id"] == self.bound:  # else: not this connection's transfer, discard
                self.table.write(self.bound, layer, int(msg.get("first_block", 0)), view)

    async def on_end(self, msg: dict) -> None:
        await self.channel.send(self.table.finish(msg["transfer_id"], bool(msg.get("aborted"))))
        self.bound = None

    def notify(self, reply: dict) -> None:  # called by the table, possibly from another task
        task = asyncio.ensure_future(self._send_quietly(reply))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def hang_up(self) -> None:  # called by the table: a quarantined transfer's sender never ended it
        log.warning("closing a KV transfer connection: no 'end' for %r within the quarantine's grace", self.bound)
        task = asyncio.ensure_future(self.channel.close())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _send_quietly(self, reply: dict) -> None:
        with contextlib.suppress(Exception):  # the peer is gone: the table already settled it
            await self.channel.send(reply)


def _unexpected(msg: dict) -> ValueError:
    return ValueError(f"protocol error: unexpected header {msg!r}")


class ChannelReceiver(KVReceiver):
    """`auth_key` (auth.py): every connection must answer a challenge before its first header is
    acted on; `on_auth_failure` is called once per rejected connection (the worker's metric).
    `identity` (set by start()) is the address senders dial this receiver by: `address` with
    `advertise_host` for its host (a pod IP; "" keeps the bound one); the handshake binds the
    sender's proof to it. `ipc`: (kv_caches, cuda_ipc backend) to offer the cache over CUDA IPC;
    `quarantine_grace_s`: how long an ended CUDA IPC transfer's blocks stay held back after its
    sender's connection closed (quarantine.py). `idle_timeout_s` and `max_pending_handshakes`: see the
    module docstring."""

    def __init__(
        self,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        auth_key: bytes | None = None,
        on_auth_failure=None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
        ipc=None,
        advertise_host: str = "",
        quarantine_grace_s: float = GRACE_S,
    ):
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be a positive number of seconds, got {idle_timeout_s!r}")
        if not isinstance(max_pending_handshakes, int) or max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be a positive integer, got {max_pending_handshakes!r}")
        self.auth_key = auth_key
        self.on_auth_failure = on_auth_failure
        self.num_auth_failures = 0
        self.idle_timeout_s = idle_timeout_s
        self.max_pending_handshakes = max_pending_handshakes
        self.num_pending_handshakes = 0
        self.num_refused_connections = 0  # closed on arrival: too many waiting for the handshake
        self.address = ""
        self.identity = ""
        self._table = TransferTable(quarantine_grace_s)
        self._channels: set[Channel] = set()
        self._max_payload_bytes = max_payload_bytes
        self._is_closed = False
        self.ipc = ipc
        self.advertise_host = advertise_host

    @abstractmethod
    async def _listen(self) -> str:
        """Start accepting connections; return the address."""

    @abstractmethod
    async def _stop_listening(self) -> None: ...

    async def start(self) -> None:
        self.address = await self._listen()
        self.identity = advertised(self.address, self.advertise_host)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True  # from here on, new connections are closed on arrival
        for channel in list(self._channels):
            with contextlib.suppress(Exception):
                await channel.close()
        for _ in range(200):  # let the serving loops see their channels close (UCX: ~ms)
            if not self._channels:
                break
            await asyncio.sleep(0.01)
        self._table.close_all("receiver closed")
        await self._stop_listening()

    async def _serve(self, channel: Channel) -> None:
        if self._is_closed:
            await channel.close()
            return
        if self.auth_key is not None and self.num_pending_handshakes >= self.max_pending_handshakes:
            self.num_refused_connections += 1
            if self.num_refused_connections == 1 or self.num_refused_connections % 1000 == 0:
                log.warning(
                    "refused a KV transfer connection: %d already wait for the handshake (%d refused so far)",
                    self.num_pending_handshakes,
                    self.num_refused_connections,
                )
            with contextlib.suppress(Exception):
                await channel.close()
            return
        channel = IdleTimeoutChannel(channel, self.idle_timeout_s)
        self._channels.add(channel)
        try:
            session_key = None
            if self.auth_key is not None:
                self.num_pending_handshakes += 1
                try:
                    session_key = await auth.challenge(channel, self.auth_key, self.identity or self.address)
                except (auth.AuthError, ChannelClosed, ValueError) as e:
                    log.warning("rejected a KV transfer connection: %s", e)
                    self._count_auth_failure()
                    with contextlib.suppress(Exception):
                        await channel.close()
                    return
                finally:
                    self.num_pending_handshakes -= 1
            connection = Connection(channel, self._table, self._max_payload_bytes, session_key, self.ipc)
            await connection.serve(self._count_auth_failure)
        finally:
            self._channels.discard(channel)

    def _count_auth_failure(self) -> None:
        self.num_auth_failures += 1
        if self.on_auth_failure is not None:
            self.on_auth_failure()

    @property
    def num_connections(self) -> int:
        return len(self._channels)

    @property
    def num_transfers(self) -> int:
        return len(self._table)

    def expect(
        self,
        transfer_id: str,
        layout: KVLayout,
        num_blocks: int,
        write_layer: WriteLayer,
        deadline_s: float,
        block_ids=None,
        layer_skip: tuple[int, ...] = (),
    ) -> None:
        self._table.expect(transfer_id, layout, num_blocks, write_layer, deadline_s, block_ids, layer_skip)

    def poll(self, transfer_id: str) -> TransferStatus:
        return self._table.poll(transfer_id)

    def abort(self, transfer_id: str) -> None:
        self._table.abort(transfer_id)

    async def wait(self, transfer_id: str) -> TransferStatus:
        return await self._table.wait(transfer_id)

    def release(self, transfer_id: str) -> None:
        self._table.release(transfer_id)

    def quarantine(self, transfer_id: str) -> asyncio.Event | None:
        return self._table.quarantine(transfer_id)

    @property
    def num_quarantined(self) -> int:
        return self._table.num_quarantined
