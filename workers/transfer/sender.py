"""The sender half every transport shares: pooled connections and the per-transfer handle.

Per connection (`_Conn`), a reader task routes the receiver's replies to the handle that holds
the connection; per transfer (`ChannelSendHandle`), a pump task is the one writer of the
channel: it sends "open", then the queued layers (all that are queued for the same blocks,
under one header),
dropping layers once the transfer is known to have failed. finish() ends the pump, sends
"end" and waits for the final reply (at most `ack_timeout_s`); only a connection that got its
final reply goes back to the pool, any other is closed. See stream.py for the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import torch

import splitserve.workers.transfer.auth as auth
import splitserve.workers.transfer.cuda_ipc as cuda_ipc
from splitserve.workers.transfer.base import (
    KVLayout,
    KVSender,
    LayoutMismatchError,
    SendHandle,
    TransferError,
    UnknownTransferError,
)
from splitserve.workers.transfer.stream import MAX_LAYERS_PER_HEADER, Channel, payload_bytes

log = logging.getLogger(__name__)
IPC_HELLO_TIMEOUT_S = 5.0


class _Conn:
    """A pooled sender-side connection; its reader task routes replies to the current handle."""

    def __init__(self, channel: Channel, session_key: bytes | None = None, ipc_writer=None):
        self.channel = channel
        self.session_key = session_key  # from the KV-auth handshake; tags every "open" (auth.py)
        self.ipc_writer = ipc_writer  # a cuda_ipc.BlockWriter into the receiver's cache, or None
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
    if reply.get("error_kind") == "unknown":
        return UnknownTransferError(reply["error"])
    return TransferError(reply.get("error") or f"transfer failed ({reply.get('state')})")


class ChannelSendHandle(SendHandle):
    def __init__(
        self, sender: ChannelSender, conn: _Conn, address: str, transfer_id: str, layout: KVLayout, num_blocks: int
    ):
        self._sender, self._conn, self._address = sender, conn, address
        self.transfer_id, self.layout, self.num_blocks = transfer_id, layout, num_blocks
        self.bytes_sent = 0
        self.error: TransferError | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._blocks_queued: dict[int, int] = {}  # layer -> blocks queued so far
        self._final: asyncio.Future = asyncio.get_running_loop().create_future()
        self._is_closed = False
        self._on_sent: list = []  # send_layer's callbacks, called once the transport is done with the payloads
        # CUDA IPC: the receiver's destination blocks, once its "ipc_ready" came (None: send bytes)
        self._ipc_blocks: asyncio.Future | None = (
            asyncio.get_running_loop().create_future() if conn.ipc_writer is not None else None
        )
        self.path = sender.scheme  # how the KV went: the transport's scheme, or "cuda_ipc"
        conn.handle = self
        self._pump = asyncio.ensure_future(self._send_all())

    def skip_leading(self, layer_skip: tuple[int, ...]) -> None:
        """Before any send_layer: layer i sends blocks from layer_skip[i] on (a sliding-window layer
        of a model with KV groups sends its window only; the receiver expects the same skip)."""
        assert not self._blocks_queued, "skip_leading after send_layer"
        self._blocks_queued = {layer: k for layer, k in enumerate(layer_skip) if k}

    @property
    def wants_device_payloads(self) -> bool:
        """Whether send_layer should get device tensors (a CUDA IPC connection copies them itself)."""
        return self._ipc_blocks is not None

    def _on_reply(self, reply: dict) -> None:
        if reply.get("type") == "ipc_ready":
            if self._ipc_blocks is not None and not self._ipc_blocks.done():
                self._ipc_blocks.set_result(reply.get("block_ids"))
            return
        if self._ipc_blocks is not None and not self._ipc_blocks.done():
            self._ipc_blocks.set_result(None)
        if not reply.get("ok") and self.error is None:
            self.error = _error_from_reply(reply)
        if reply.get("type") == "final" and not self._final.done():
            self._final.set_result(reply)

    def _on_lost(self, exc: Exception) -> None:
        if self._ipc_blocks is not None and not self._ipc_blocks.done():
            self._ipc_blocks.set_result(None)
        if self.error is None:
            self.error = TransferError(f"connection to {self._address} lost: {exc!r}")
        if not self._final.done():
            self._final.set_result(None)  # no final reply: the channel is out of step

    async def _send_all(self) -> None:
        """The one writer of this channel while the transfer is open: "open", then whatever
        layers are queued for the same blocks under one header each time, until the queue's end
        marker."""
        try:
            header = {
                "op": "open",
                "transfer_id": self.transfer_id,
                "layout": self.layout.to_dict(),
                "num_blocks": self.num_blocks,
            }
            if self._conn.session_key is not None:
                header["tag"] = auth.transfer_tag(self._conn.session_key, self.transfer_id)
            if self._ipc_blocks is not None:
                header["ipc"] = True
            await self._conn.channel.send(header)
            ipc_blocks = await self._ipc_blocks if self._ipc_blocks is not None else None
            if ipc_blocks is not None:
                self.path = "cuda_ipc"
            is_ended = False
            held = None  # an item taken from the queue that belongs under the next header
            while not is_ended:
                batch = [held if held is not None else await self._queue.get()]
                held = None
                while batch[-1] is not None and not self._queue.empty() and len(batch) < MAX_LAYERS_PER_HEADER:
                    item = self._queue.get_nowait()
                    if item is not None and (item[1].shape != batch[0][1].shape or item[2] != batch[0][2]):
                        held = item  # another block range: its own header
                        break
                    batch.append(item)
                if batch[-1] is None:
                    is_ended = True
                    batch.pop()
                if not batch or self.error is not None:  # nothing, or the receiver gave up: drop
                    continue
                if ipc_blocks is not None:
                    await self._write_ipc(batch, ipc_blocks)
                    continue
                if any(payload.device.type != "cpu" for _, payload, _ in batch):  # IPC fell back: stage here
                    batch = await asyncio.to_thread(lambda b=batch: [(i, p.cpu(), f) for i, p, f in b])
                data = [payload_bytes(payload) for _, payload, _ in batch]
                header = {
                    "op": "layers",
                    "transfer_id": self.transfer_id,
                    "layers": [layer for layer, _, _ in batch],
                    "first_block": batch[0][2],
                    "nbytes": data[0].nbytes,
                }
                await self._conn.channel.send(header, data)
                self.bytes_sent += sum(d.nbytes for d in data)
        except Exception as e:
            self._conn.is_dead = True
            self._on_lost(e)

    async def _write_ipc(self, batch: list, block_ids: list[int]) -> None:
        """Write the pieces straight into the receiver's blocks (in a worker thread, which waits for
        the copies), then tell it which blocks of which layers landed."""
        first, n = batch[0][2], batch[0][1].shape[1]
        dst = block_ids[first : first + n]
        for layer, payload, _ in batch:
            if self.error is not None:  # the receiver aborted (its "failed" reply came): no more writes
                return
            await asyncio.to_thread(self._conn.ipc_writer.write, layer, dst, payload)
            self.bytes_sent += payload.numel() * payload.element_size()
        await self._conn.channel.send(
            {
                "op": "ipc_layers",
                "transfer_id": self.transfer_id,
                "layers": [layer for layer, _, _ in batch],
                "first_block": first,
                "num_blocks": n,
            }
        )

    async def send_layer(self, layer: int, payload: torch.Tensor, first_block: int = 0, on_sent=None) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")
        queued = self._blocks_queued.get(layer, 0)
        n = payload.shape[1] if payload.dim() == 5 else 0
        shape = self.layout.layer_payload_shape(n)
        if (
            n < 1
            or tuple(payload.shape) != shape
            or payload.dtype != self.layout.torch_dtype
            or not payload.is_contiguous()
        ):
            raise ValueError(
                f"layer payload must be a contiguous {self.layout.dtype} tensor of shape "
                f"{self.layout.layer_payload_shape(self.num_blocks - queued)} (or fewer blocks), got "
                f"{payload.dtype} {tuple(payload.shape)} (contiguous={payload.is_contiguous()})"
            )
        if first_block != queued or queued + n > self.num_blocks:
            raise ValueError(
                f"layer {layer}: blocks {first_block}..{first_block + n - 1} do not continue its "
                f"{queued} blocks queued so far within the transfer's {self.num_blocks}"
            )
        if self._is_closed:
            raise RuntimeError(f"send_layer after finish/abort of transfer {self.transfer_id!r}")
        self._blocks_queued[layer] = queued + n
        if on_sent is not None:
            self._on_sent.append(on_sent)
        self._queue.put_nowait((layer, payload if self.wants_device_payloads else payload.cpu(), first_block))

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
        try:
            await self._settle(aborted, timeout_s)
        finally:  # the final reply came (every byte was read) or the connection is closed
            callbacks, self._on_sent = self._on_sent, []
            for on_sent in callbacks:
                on_sent()

    async def _settle(self, aborted: bool, timeout_s: float) -> None:
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
        except asyncio.CancelledError:  # the caller gave up: the channel may be mid-message
            self._on_lost(TransferError("finish() was cancelled"))
            self._conn.handle = None
            await self._conn.close()
            raise
        self._conn.handle = None
        await self._sender._give_back(self._address, self._conn, reusable=self._final.result() is not None)


class ChannelSender(KVSender):
    """Pools connections per address; a transport supplies `scheme` and `connect()`."""

    scheme: str

    def __init__(
        self,
        connect: Callable[[str], Awaitable[Channel]],
        ack_timeout_s: float = 30.0,
        auth_key: bytes | None = None,
        ipc_backend=None,
    ):
        self.auth_key = auth_key  # answer each new connection's challenge (auth.py)
        self.ipc_backend = ipc_backend  # a cuda_ipc backend: try CUDA IPC on each new authenticated connection
        self.ipc_fallbacks: list[str] = []  # why connections that tried CUDA IPC use bytes (most recent last)
        self._connect = connect
        self.ack_timeout_s = ack_timeout_s
        self._idle: dict[str, list[_Conn]] = {}
        self.num_connects = 0  # connections opened so far (pooling is visible in tests)

    def num_idle(self, address: str) -> int:
        return len(self._idle.get(address, []))

    async def open(self, address: str, transfer_id: str, layout: KVLayout, num_blocks: int) -> SendHandle:
        prefix = f"{self.scheme}://"
        if not address.startswith(prefix):
            # the two workers use different KV transports: like a layout mismatch, FAILED_PRECONDITION
            # to the decode worker, which tries its next prefill worker or prefills locally
            raise LayoutMismatchError(
                f"a {self.scheme} sender cannot send to {address!r} (expected {prefix}...)",
                {"kv_transport": (address.split("://", 1)[0], self.scheme)},
            )
        idle = self._idle.get(address, [])
        while idle:
            conn = idle.pop()
            if not conn.is_dead and conn.channel.is_alive:
                break
            await conn.close()
        else:
            try:
                channel = await self._connect(address[len(prefix) :])
            except Exception as e:
                raise TransferError(f"cannot connect to {address}: {e!r}") from e
            session_key = None
            if self.auth_key is not None:
                try:
                    session_key = await auth.answer(channel, self.auth_key, address)
                except Exception as e:
                    await channel.close()
                    raise TransferError(f"KV-transfer handshake with {address} failed: {e}") from e
            try:
                writer = await self._try_ipc(channel, session_key, layout) if self.ipc_backend is not None else None
            except Exception as e:  # the channel is out of step (no reply in time, closed): not reusable
                await channel.close()
                raise TransferError(f"CUDA IPC hello to {address} failed: {e!r}") from e
            conn = _Conn(channel, session_key, writer)
            self.num_connects += 1
        return ChannelSendHandle(self, conn, address, transfer_id, layout, num_blocks)

    async def _try_ipc(self, channel: Channel, session_key: bytes | None, layout: KVLayout):
        """Ask for the receiver's cache handles once on this connection (cuda_ipc.py): a BlockWriter,
        or None (the reason is logged and kept) when the connection is to carry bytes."""
        try:
            if session_key is None:
                raise cuda_ipc.IpcUnavailable("the KV channel is not authenticated (no --kv-secret-file)")
            await channel.send(cuda_ipc.hello())
            reply = await asyncio.wait_for(channel.recv(), IPC_HELLO_TIMEOUT_S)
            return cuda_ipc.BlockWriter(cuda_ipc.open_offer(reply, session_key, self.ipc_backend, layout))
        except cuda_ipc.IpcUnavailable as exc:
            log.info("KV over %s, not CUDA IPC: %s", self.scheme, exc)
            self.ipc_fallbacks = [*self.ipc_fallbacks[-9:], str(exc)]
            return None

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
