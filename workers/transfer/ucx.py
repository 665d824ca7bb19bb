"""The `ucx` transport: the stream protocol (stream.py) over UCXX tagged messages.

UCXX (PyPI `ucxx-cu12`) is the maintained successor of the ucx-py binding. Each connection is
one UCX endpoint (a listener on the receiver, `create_endpoint` on the sender) and every
message uses the endpoint's own tag, which UCX delivers in order. A header is one message
(stream.encode_header: a length prefix then JSON) received into a fixed buffer of
MAX_HEADER_BYTES, since a tagged receive may be larger than the message but does not report
its length; each payload it announces is one further message, sent from a zero-copy view of
the tensor and received straight into the receiver's scratch buffer (rendezvous above 8 KiB).

UCX closes an endpoint by resetting whatever is still in flight on it, so a connection is only
closed after the peer's acknowledgement (the stream protocol's final reply) or on failure.
A killed peer surfaces as a canceled receive within milliseconds (UCX's error handling is on).

UCX reads its configuration from the environment when the first endpoint or listener is
created; `configure_ucx_env` sets this project's defaults there without overriding the user's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Sequence

import numpy as np

from splitserve.workers.transfer.receiver import ChannelReceiver
from splitserve.workers.transfer.sender import ChannelSender
from splitserve.workers.transfer.stream import MAX_HEADER_BYTES, Channel, ChannelClosed, encode_header

_is_configured = False


def configure_ucx_env(environ=os.environ, has_gpu: bool | None = None) -> dict[str, str]:
    """Set UCX defaults in `environ` where unset; return the ones set.

    * UCXPY_ENABLE_PYTHON_FUTURE=1: UCXX completes requests through a notifier thread.
      Without it every pending request busy-polls the event loop (an idle process with one
      posted receive used 1.8 s of CPU in 2 s here) and a transfer ran at 0.43 instead of
      1.2 GB/s on this 2-core machine. The thread is stopped before interpreter shutdown.
    * Without a GPU, UCX_TLS=tcp,self: the data crosses the network stack even between two
      processes of one host (as between hosts), not shared memory. With a GPU, UCX picks its
      transports itself (RDMA, NVLink, cuda_ipc).
    * UCX_WARN_UNUSED_ENV_VARS=n: UCXX sets UCX_MEMTYPE_CACHE, which this UCX no longer knows.
    """
    if has_gpu is None:
        import torch

        has_gpu = torch.cuda.is_available()
    defaults = {"UCXPY_ENABLE_PYTHON_FUTURE": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if not has_gpu:
        defaults["UCX_TLS"] = "tcp,self"
    applied = {k: v for k, v in defaults.items() if k not in environ}
    environ.update(applied)
    return applied


LISTEN_RETRY_S = (0.1, 0.2, 0.4, 0.8, 1.6)  # waits between tries of a busy listening port


def _ucxx():
    """UCXX, configured; it binds to the event loop that first uses it (one loop per process)."""
    global _is_configured
    if not _is_configured:
        configure_ucx_env()
        # The notifier thread is not a daemon: stop it before threading joins threads at exit
        # (atexit would run too late and the interpreter would hang).
        threading._register_atexit(_stop_notifier_thread)
        _is_configured = True
    import ucxx

    return ucxx


def _stop_notifier_thread() -> None:
    import ucxx

    with contextlib.suppress(Exception):
        ucxx.stop_notifier_thread()


class UcxChannel(Channel):
    """Sends are submitted to UCX in call order without a lock (each send() creates its UCXX
    requests before its first await). While a payload is received, the next header's receive
    is already posted, so the loop does not have to wake up between a payload and the header
    after it."""

    def __init__(self, endpoint):
        self._ep = endpoint
        self._headers = [np.empty(MAX_HEADER_BYTES, dtype=np.uint8) for _ in range(2)]
        self._next_header: tuple[asyncio.Future, np.ndarray] | None = None  # prefetched receive
        self._turn = 0
        self._error_types = (_ucxx().exceptions.UCXError,)

    async def send(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        data = np.frombuffer(encode_header(header), dtype=np.uint8)
        requests = [asyncio.ensure_future(self._ep.send(buf)) for buf in (data, *payloads)]
        errors = [r for r in await asyncio.gather(*requests, return_exceptions=True) if isinstance(r, BaseException)]
        if errors:
            raise ChannelClosed(repr(errors[0])) from errors[0]

    def _post_header_recv(self) -> tuple[asyncio.Future, np.ndarray]:
        self._turn ^= 1
        buf = self._headers[self._turn]
        fut = asyncio.ensure_future(self._ep.recv(buf))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if never awaited
        return fut, buf

    async def recv(self) -> dict:
        pending, self._next_header = self._next_header, None
        fut, buf = pending if pending is not None else self._post_header_recv()
        try:
            await fut
        except self._error_types as e:
            raise ChannelClosed(repr(e)) from e
        n = int.from_bytes(buf[:4].tobytes(), "little")
        return json.loads(buf[4 : 4 + n].tobytes())

    async def recv_payload(self, out: np.ndarray, is_last: bool) -> None:
        payload = asyncio.ensure_future(self._ep.recv(out))
        if is_last:  # posted after the payload, so matched after it
            self._next_header = self._post_header_recv()
        try:
            await payload
        except self._error_types as e:
            raise ChannelClosed(repr(e)) from e

    async def close(self) -> None:
        if self._next_header is not None:
            self._next_header[0].cancel()
            self._next_header = None
        if not self._ep.closed:
            await self._ep.close()

    @property
    def is_alive(self) -> bool:
        return not self._ep.closed


class UcxReceiver(ChannelReceiver):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kw):
        super().__init__(**kw)
        self._host, self._port = host, port
        self._listener = None

    async def _listen(self) -> str:
        # UCX listens on every interface; `host` is what the address advertises. A port that a
        # process which just exited still holds reads as busy for a moment (a restarted pod, a
        # bench's next cluster on the same host): retry over about 3 s, then name the port.
        ucxx = _ucxx()
        for delay in (*LISTEN_RETRY_S, None):
            try:
                self._listener = ucxx.create_listener(self._on_endpoint, self._port)
                break
            except ucxx.exceptions.UCXBusyError as exc:
                if delay is None:
                    raise RuntimeError(
                        f"the KV transfer port {self._port} stayed busy for {sum(LISTEN_RETRY_S):g} s "
                        "(another process listens on it); choose a free --kv-port, or 0 for any"
                    ) from exc
                await asyncio.sleep(delay)
        return f"ucx://{self._host}:{self._listener.port}"

    async def _on_endpoint(self, endpoint) -> None:  # a coroutine function, as UCXX requires
        await self._serve(UcxChannel(endpoint))

    async def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxSender(ChannelSender):
    scheme = "ucx"

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
        ucxx = _ucxx()
        endpoint = await asyncio.wait_for(
            ucxx.create_endpoint(host, int(port), connect_timeout=self._connect_timeout_s),
            self._connect_timeout_s + 1.0,
        )
        return UcxChannel(endpoint)
