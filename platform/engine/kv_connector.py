"""The engine's half of KV transfer: which blocks of which request go where, never the bytes.

Prefill/decode disaggregation splits into two halves that exchange only metadata (STYLE.md):
the engine decides which blocks to export or to fill; the worker's transport moves bytes.

* Export (prefill worker): a request added with a `KVExport` has, in every step that computes
  part of its prompt, each layer's K and V of the blocks that step completed copied out right
  after that layer is computed and handed to `sink(layer, payload, first_block)` — so the
  transport can send layer i while layer i+1 computes, and with chunked prefill one chunk's
  blocks while the next chunk computes. Over the steps every block of [start_block,
  num_prompt_blocks) goes exactly once per layer, in order; `first_block` counts from
  start_block. The payload ([2, num_blocks, block_size, kv_heads, head_dim], K then V) is a
  fresh tensor the sink owns: the engine may free and reuse the blocks as soon as the step ends.
* Import (decode worker): a request added with `remote_prefill=True` gets blocks for its whole
  prompt and waits; its first output carries `KVReady` (block ids, tokens already cached
  locally), and `write_layer` copies each arriving layer's payload into those blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVExport:
    """Send this request's prompt KV from block `start_block` on, layer by layer, to `sink`.

    `sink(layer, payload, first_block)` runs on the engine thread and must not block (queue the
    send); `first_block` is the payload's first block counted from `start_block`.
    """

    start_block: int
    sink: Callable[[int, torch.Tensor, int], None]


@dataclass(frozen=True)
class KVReady:
    """Blocks allocated for a remote prefill: the KV of blocks [start_block, len(block_ids)) is expected."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_size: int

    @property
    def start_block(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def num_blocks_to_receive(self) -> int:
        return len(self.block_ids) - self.start_block


def export_layer(kv_caches, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
    """A copy of one layer's K and V for `block_ids`: [2, num_blocks, block_size, kv_heads, head_dim]."""
    k_cache, v_cache = kv_caches[layer]
    return torch.stack((k_cache.index_select(0, block_ids), v_cache.index_select(0, block_ids)))


def import_layer(kv_caches, layer: int, block_ids: torch.Tensor, payload: torch.Tensor) -> None:
    """Write a received layer payload into the blocks `block_ids` of this engine's cache."""
    k_cache, v_cache = kv_caches[layer]
    assert payload.shape[0] == 2 and payload.shape[1] == block_ids.numel(), (
        f"payload {tuple(payload.shape)} does not match {block_ids.numel()} blocks")
    k_cache.index_copy_(0, block_ids, payload[0].to(k_cache.dtype))
    v_cache.index_copy_(0, block_ids, payload[1].to(v_cache.dtype))
