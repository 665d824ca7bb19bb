"""What the engine and a worker's KV transport hand each other: `KVExport` and `KVReady`.

Two small frozen descriptors, kept apart from the connector (kv_connector.py) that acts on them,
so a request's state (request_state.py) and an engine output (outputs.py) can carry them without
importing the connector: the engine's modules then import one another without a circle
(tests/test_layout.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.platform.engine.kv_staging import StagedPayload


@dataclass(frozen=True)
class KVExport:
    """Send this request's prompt KV from block `start_block` on, layer by layer, to `sink`.

    `sink(layer, payload, first_block)` runs on the engine thread and must not block (queue the
    send); `payload` is a StagedPayload (kv_staging.py); `first_block` its first block counted
    from `start_block`.
    """

    start_block: int
    sink: Callable[[int, StagedPayload, int], None]
    # the payloads stay on the device (a CUDA IPC transfer copies them device to device itself)
    on_device: bool = False


@dataclass(frozen=True)
class KVReady:
    """Blocks allocated for a remote prefill: the KV of blocks [start_block, len(block_ids)) is expected."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_size: int
    # Per layer, how many blocks from start_block on are not sent: a sliding-window layer's blocks
    # before its window (platform/kv/groups.py); () when every layer gets every block.
    layer_skip: tuple[int, ...] = ()

    @property
    def start_block(self) -> int:
        return self.num_cached_tokens // self.block_size
