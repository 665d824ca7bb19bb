"""The engine's half of KV transfer: which blocks of which request go where, never the bytes.

Prefill/decode disaggregation splits into two halves that exchange only metadata (docs/design.md):
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

`KVExport` and `KVReady`, the two descriptors the engine and a worker hand each other, live in
kv_handoff.py: requests and outputs carry them without importing the connector.

`KVConnector` is the engine's side of both; the LLMEngine calls it once per step (the export
hook) and when a remote prefill starts (kv_ready). It reads the requests' states and plans; the
only state it writes is each exporting request's `num_exported_blocks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from splitserve.platform.engine.kv_handoff import KVExport, KVReady

if TYPE_CHECKING:
    from splitserve.platform.engine.request_state import RequestState
    from splitserve.platform.sched.plan import SchedulerPlan
    from splitserve.platform.sched.request import Request


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


class KVConnector:
    """The engine's half of P/D for one engine: export hooks, KV writes, KVReady descriptors."""

    def __init__(self, kv_caches, kv_manager, block_size: int, device: torch.device):
        self.kv_caches = kv_caches
        self.kv_manager = kv_manager
        self.block_size = block_size
        self.device = device

    def check_export(self, export: KVExport, num_prompt_tokens: int) -> str | None:
        """Why `export` cannot serve a prompt this long (a message naming the allowed range), or None."""
        num_prompt_blocks = -(-num_prompt_tokens // self.block_size)
        if 0 <= export.start_block < num_prompt_blocks:
            return None
        return (f"skip_blocks={export.start_block} is invalid for a prompt of {num_prompt_tokens} tokens; "
                f"allowed: 0 to {num_prompt_blocks - 1}")

    def kv_ready(self, req: Request) -> KVReady:
        return KVReady(tuple(self.kv_manager.block_ids(req.req_id)), req.num_cached_tokens, self.block_size)

    def export_hook(self, plan: SchedulerPlan, states: Mapping[str, RequestState]):
        """A per-layer hook exporting the prompt blocks this step completes, or None.

        A chunk that is not the prompt's last exports the blocks it filled (whole blocks only:
        a block the chunk fills partly goes with the next chunk); the last chunk exports the
        rest, its partial tail block included. So with chunked prefill the first chunks' KV
        travels while later chunks compute.
        """
        bs = self.block_size
        exports = []
        for seq in plan.seqs:
            state = states.get(seq.req_id)
            if state is None or state.export is None:
                continue
            first = state.num_exported_blocks
            end = -(-seq.context_len // bs) if seq.do_sample else seq.context_len // bs
            if end <= first:
                continue
            state.num_exported_blocks = end
            ids = torch.tensor(seq.block_ids[first:end], dtype=torch.long, device=self.device)
            exports.append((state.export.sink, first - state.export.start_block, ids))
        if not exports:
            return None

        def hook(layer: int) -> None:
            for sink, first_block, ids in exports:
                sink(layer, export_layer(self.kv_caches, layer, ids), first_block)
        return hook

    def write_layer(self, block_ids: Sequence[int], layer: int, payload: torch.Tensor) -> None:
        """Copy one received layer (or piece of one) into a WAITING_FOR_KV request's blocks.

        Safe from another thread: those blocks belong to a request no step touches until
        the engine completes its remote prefill or falls back to a local one.
        """
        import_layer(self.kv_caches, layer, torch.tensor(block_ids, dtype=torch.long, device=self.device),
                     payload.to(self.device))
