"""The transfer protocol over a message channel, shared by the ucx, tcp and inproc transports.

A transport only supplies a `Channel`: an ordered, bidirectional pipe of small JSON headers,
each followed by the binary payloads it announces. On it:

    sender -> receiver   {"op": "open", "transfer_id", "layout": KVLayout.to_dict(), "num_blocks"}
                         {"op": "layers", "transfer_id", "layers": [i, ...], "first_block", "nbytes"}
                             + one payload of nbytes per listed layer, in that order: blocks
                             first_block... of each (as many as nbytes holds)
                         ... until every block of every layer went: layers in any order,
                         each layer's blocks in order (one piece per prefill chunk) ...
                         {"op": "end", "transfer_id", "aborted": bool}
    receiver -> sender   {"type": "failed", ...} at most once, as soon as the receiver rejects
                         (layout mismatch, unknown id) or abandons (abort, deadline) the transfer
                         {"type": "final", "ok", ...} exactly once, in reply to "end"

The sender does not wait for the open to be accepted (no round trip before the first layer).
A "layers" header lists every layer queued when the sender got to it with the same block
range: one while compute is the bottleneck (each layer goes as soon as it is computed),
several when the wire is (then a header and its wake-ups are shared; at most
MAX_LAYERS_PER_HEADER). "first_block" may be absent (0). The receiver always reads
a payload, even one it discards, so the channel stays in step; a header it cannot accept
(too many layers, payload above `max_payload_bytes`, unknown op) is a protocol error that
closes the connection. A channel carries one transfer at a time: the sender leases it from a
per-address pool on open() and returns it after the final reply, so an endpoint is never
closed while a message is in flight (UCX would reset it) and consecutive transfers to one
receiver reuse a connection. Concurrent transfers use separate connections.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

MAX_PAYLOAD_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 16
MAX_LAYERS_PER_HEADER = 64


class ChannelClosed(Exception):
    """The peer went away (or the channel was closed locally)."""


class Channel(ABC):
    """One connection. send() may be called concurrently: each call's messages go out whole
    and in call order. recv()/recv_payload() are called by one reader, in order."""

    @abstractmethod
    async def send(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        """Send a header and the payloads (uint8 arrays) it announces; returns once sent."""

    @abstractmethod
    async def recv(self) -> dict: ...

    @abstractmethod
    async def recv_payload(self, out: np.ndarray, is_last: bool) -> None:
        """Receive the next announced payload into `out` (uint8, its exact size); `is_last`:
        the last payload of its header, so a header comes next."""

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
