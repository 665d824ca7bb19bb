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

import json
from abc import ABC, abstractmethod

import numpy as np
import torch

MAX_PAYLOAD_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 16


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
