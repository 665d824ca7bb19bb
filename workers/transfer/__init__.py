"""KV-block transfer from prefill to decode workers: one interface (base.py), three transports.

`make_receiver(kind, ...)` / `make_sender(kind)` build them; kind is "ucx" (UCXX; imported
only when used), "tcp" (asyncio streams) or "inproc" (in-process, for tests). See base.py for
the life of a transfer on each side and stream.py for the protocol on the wire.
"""

from __future__ import annotations

from splitserve.workers.transfer.base import (
    KVLayout,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    SendHandle,
    TransferError,
    TransferState,
    TransferStatus,
    UnknownTransferError,
)

KINDS = ("ucx", "tcp", "inproc")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown KV transport {kind!r}; allowed: {', '.join(KINDS)}")


def make_receiver(kind: str, host: str = "127.0.0.1", port: int = 0, *, name: str | None = None, **kw) -> KVReceiver:
    """A receiver that listens on host:port once started (port 0: a free one; inproc: `name`)."""
    _check_kind(kind)
    if kind == "ucx":
        from splitserve.workers.transfer.ucx import UcxReceiver

        return UcxReceiver(host, port, **kw)
    if kind == "tcp":
        from splitserve.workers.transfer.tcp import TcpReceiver

        return TcpReceiver(host, port, **kw)
    from splitserve.workers.transfer.inproc import InprocReceiver

    return InprocReceiver(name, **kw)


def make_sender(kind: str, **kw) -> KVSender:
    """A sender with a connection pool; kw: ack_timeout_s (and connect_timeout_s for ucx/tcp)."""
    _check_kind(kind)
    if kind == "ucx":
        from splitserve.workers.transfer.ucx import UcxSender

        return UcxSender(**kw)
    if kind == "tcp":
        from splitserve.workers.transfer.tcp import TcpSender

        return TcpSender(**kw)
    from splitserve.workers.transfer.inproc import InprocSender

    return InprocSender(**kw)


__all__ = [
    "KINDS",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "LayoutMismatchError",
    "SendHandle",
    "TransferError",
    "TransferState",
    "TransferStatus",
    "UnknownTransferError",
    "make_receiver",
    "make_sender",
]
