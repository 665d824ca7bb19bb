"""The engine's half of KV transfer: which blocks of which request go where, never the bytes.

Prefill/decode disaggregation splits into two halves that exchange only metadata (docs/design.md):
the engine decides which blocks to export or to fill; the worker's transport moves bytes.

* Export (prefill worker): a request added with a `KVExport` has, in every step that computes
  part of its prompt, each layer's K and V of the blocks that step completed copied out right
  after that layer is computed and handed to `sink(layer, payload, first_block)` — so the
  transport can send layer i while layer i+1 computes, and with chunked prefill one chunk's
  blocks while the next chunk computes. Over the steps every block of [start_block,
  num_prompt_blocks) goes exactly once per layer, in order; `first_block` counts from
  start_block. The payload is a `StagedPayload` (kv_staging.py) the sink owns: its `tensor`
  ([2, num_blocks, block_size, kv_heads, head_dim], K then V) is host memory, valid once its
  `ready` marker is, and `release()` goes back to the engine's buffer pool once the bytes left.
  On a CPU the tensor is a fresh copy, ready at once; on CUDA the blocks are copied on a side
  stream into a reused pinned buffer and `ready` is an event, so the engine thread never waits
  for an export: only the sender's thread does, before the bytes go on the wire. The next step
  is ordered after those copies (the engine may reuse the blocks as soon as the step ends).
* Import (decode worker): a request added with `remote_prefill=True` gets blocks for its whole
  prompt and waits; its first output carries `KVReady` (block ids, tokens already cached
  locally), and `write_layer` copies each arriving layer's payload into those blocks. On CUDA
  the payload is copied into a pinned buffer and from there to the device on a side stream;
  the engine's next step waits (on the device) for those copies, so the request's first decode
  step reads its KV after it landed, without a device-wide synchronize.

A model with several KV groups (platform/kv/groups.py): layer i's blocks are those of its group
(`layer_group`). Export reads each layer's K/V through its group's table and a sliding-window
layer sends only the blocks its window sees from the first decode step on (groups.
first_blocks_sent; KVReady.layer_skip tells the receiver). KVReady names group 0's blocks, and
`write_layer` maps them to the layer's group through `_group_ids` (filled by `kv_ready` on the
engine thread, read by the transport's thread: one dict get per block), dropping any block that
lands on a hole (a pulled block out of the window).

`KVExport` and `KVReady`, the two descriptors the engine and a worker hand each other, live in
kv_handoff.py: requests and outputs carry them without importing the connector.

`KVConnector` is the engine's side of both; the LLMEngine calls it once per step (the export
hook) and when a remote prefill starts (kv_ready). It reads the requests' states and plans; the
only state it writes is each exporting request's `num_exported_blocks`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from splitserve.platform.engine.kv_handoff import KVExport, KVReady
from splitserve.platform.engine.kv_staging import CopyStream, HostBufferPool, StagedPayload, make_copy_stream
from splitserve.platform.kv.groups import NULL_BLOCK_ID, KVLayout, first_blocks_sent

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
        f"payload {tuple(payload.shape)} does not match {block_ids.numel()} blocks"
    )
    k_cache.index_copy_(0, block_ids, payload[0].to(k_cache.dtype))
    v_cache.index_copy_(0, block_ids, payload[1].to(v_cache.dtype))


class KVConnector:
    """The engine's half of P/D for one engine: export hooks, KV writes, KVReady descriptors.

    `copy_stream` and `host_pool` default to the device's (kv_staging.py): staged through pinned
    buffers on a side stream on CUDA, the plain synchronous copies on a CPU. Tests pass their own
    to check the ordering on a CPU."""

    def __init__(
        self,
        kv_caches,
        kv_manager,
        block_size: int,
        device: torch.device,
        copy_stream: CopyStream | None = None,
        host_pool: HostBufferPool | None = None,
    ):
        self.kv_caches = kv_caches
        self.kv_manager = kv_manager
        self.block_size = block_size
        self.device = device
        self.copy_stream = copy_stream or make_copy_stream(device)
        # staged: through reused host buffers (CUDA, or a test's pool); else fresh tensors (CPU)
        self.host_pool = host_pool or (HostBufferPool(pin=True) if device.type == "cuda" else None)
        self.kv_layout: KVLayout | None = None  # the KV groups; None for one group
        self.layer_group: tuple[int, ...] = ()  # decoder layer -> KV group; () for one group
        self._group_ids: dict[int, tuple[int, ...]] = {}  # group 0's block id -> that block in every group

    def before_step(self) -> None:
        """Called by the engine before each step: that step's work waits (on the device) for the
        KV copies submitted so far (imports landing, exports of blocks it may reuse)."""
        self.copy_stream.order_compute_after()

    def check_export(self, export: KVExport, num_prompt_tokens: int) -> str | None:
        """Why `export` cannot serve a prompt this long (a message naming the allowed range), or None."""
        num_prompt_blocks = -(-num_prompt_tokens // self.block_size)
        if 0 <= export.start_block < num_prompt_blocks:
            return None
        return (
            f"skip_blocks={export.start_block} is invalid for a prompt of {num_prompt_tokens} tokens; "
            f"allowed: 0 to {num_prompt_blocks - 1}"
        )

    def transfer_refusal(self) -> str | None:
        """Why this engine cannot move a request's KV (P/D, the pull), or None: it can."""
        return None

    def hold_blocks(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on these blocks, so no request is given them until
        release_blocks(): an aborted CUDA IPC transfer's sender may still be writing them
        (workers/transfer/quarantine.py)."""
        pool = self.kv_manager.pool
        pool.touch(pool.blocks[i] for i in block_ids)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop the references hold_blocks() took (blocks nobody else holds become free)."""
        pool = self.kv_manager.pool
        pool.free(pool.blocks[i] for i in reversed(block_ids))

    def kv_ready(self, req: Request) -> KVReady:
        ready = KVReady(tuple(self.kv_manager.block_ids(req.req_id)), req.num_cached_tokens, self.block_size)
        if self.kv_layout is None:
            return ready
        self._group_ids.update((ids[0], ids) for ids in zip(*self.kv_manager.group_block_ids(req.req_id)))
        return replace(ready, layer_skip=self.layer_skip(req.num_tokens, ready.start_block))

    def layer_skip(self, num_prompt_tokens: int, start_block: int) -> tuple[int, ...]:
        """Per layer, the blocks from `start_block` on that P/D does not move for a prompt this long
        (a sliding-window layer's blocks before its window); () for a single-group model. Reads
        the layout only: safe from any thread."""
        if self.kv_layout is None:
            return ()
        firsts = first_blocks_sent(self.kv_layout, num_prompt_tokens, self.block_size)
        return tuple(max(0, firsts[g] - start_block) for g in self.layer_group)

    def _layer_ids(self, block_ids: Sequence[int], layer: int) -> Sequence[int]:
        """Group 0's `block_ids` as the blocks of `layer`'s group."""
        if not self.layer_group or self.layer_group[layer] == 0:
            return block_ids
        return [self._group_ids[b][self.layer_group[layer]] for b in block_ids]

    def _group_exports(self, seq, state, first: int, end: int) -> list:
        """Per KV group, (its first block counted from the export's start_block, block ids) of
        blocks [first, end) it sends, or None when it sends none of them this step."""
        if seq.group_block_ids is None:
            ids = torch.tensor(seq.block_ids[first:end], dtype=torch.long, device=self.device)
            return [(first - state.export.start_block, ids)]
        out = []
        firsts = first_blocks_sent(self.kv_layout, state.req.num_prompt_tokens, self.block_size)
        for table, group_first in zip(seq.group_block_ids, firsts):
            a = max(first, group_first)
            ids = torch.tensor(table[a:end], dtype=torch.long, device=self.device) if a < end else None
            out.append(None if ids is None else (a - state.export.start_block, ids))
        return out

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
            exports.append((state.export, self._group_exports(seq, state, first, end)))
        if not exports:
            return None
        return self._layer_hook(exports)

    def _layer_hook(self, exports: list[tuple[KVExport, list]]) -> Callable[[int], None]:
        """The hook the model calls after each layer: each export's blocks of that layer (its KV
        group's piece, see _group_exports), staged."""
        layer_group = self.layer_group

        def hook(layer: int) -> None:
            for export, pieces in exports:
                piece = pieces[layer_group[layer]] if len(pieces) > 1 else pieces[0]
                if piece is not None:
                    export.sink(layer, self._stage_export(layer, piece[1], export.on_device), piece[0])

        return hook

    def _stage_export(self, layer: int, ids: torch.Tensor, on_device: bool = False) -> StagedPayload:
        k_cache = self.kv_caches[layer][0]
        shape = (2, ids.numel(), *k_cache.shape[1:])
        return self._stage(lambda: export_layer(self.kv_caches, layer, ids), shape, k_cache.dtype, ids, on_device)

    def _stage(
        self, read: Callable[[], torch.Tensor], shape, dtype: torch.dtype, keep: torch.Tensor, on_device: bool
    ) -> StagedPayload:
        """`read()`'s payload of `shape` staged for the sink: copied on the copy stream into a
        pooled host buffer, or (no pool, or `on_device`) taken as it is. `keep`: the device
        tensor `read` uses, kept alive for the copy stream."""
        if self.host_pool is None or on_device:
            out: list[torch.Tensor] = []

            @torch.inference_mode()
            def gather() -> None:
                out.append(read())

            ready = self.copy_stream.submit(gather, keep=(keep,)) if on_device else self.copy_stream.submit(gather)
            return StagedPayload(out[0], ready)
        nbytes = torch.empty((), dtype=dtype).element_size() * torch.Size(shape).numel()
        buf = self.host_pool.acquire(nbytes)
        payload = buf[:nbytes].view(dtype).view(shape)

        @torch.inference_mode()
        def copy() -> None:
            payload.copy_(read(), non_blocking=True)

        ready = self.copy_stream.submit(copy, keep=(keep,))
        return StagedPayload(payload, ready, lambda: self.host_pool.release(buf, ready))

    def write_layer(self, block_ids: Sequence[int], layer: int, payload: torch.Tensor) -> None:
        """Copy one received layer (or piece of one) into a WAITING_FOR_KV request's blocks.

        Safe from another thread: those blocks belong to a request no step touches until
        the engine completes its remote prefill or falls back to a local one.
        """
        block_ids = self._layer_ids(block_ids, layer)
        if self.kv_layout is not None and NULL_BLOCK_ID in block_ids:  # holes: out of the window
            keep = [i for i, b in enumerate(block_ids) if b != NULL_BLOCK_ID]
            block_ids, payload = [block_ids[i] for i in keep], payload[:, keep]
            if not keep:
                return
        if self.host_pool is None:
            import_layer(
                self.kv_caches,
                layer,
                torch.tensor(block_ids, dtype=torch.long, device=self.device),
                payload.to(self.device),
            )
            return
        # `payload` is only valid during this call: land it in a pooled (pinned) buffer first
        nbytes = payload.numel() * payload.element_size()
        buf = self.host_pool.acquire(nbytes)
        staged = buf[:nbytes].view(payload.dtype).view(payload.shape)
        staged.copy_(payload)
        ids = torch.tensor(block_ids, dtype=torch.long)

        @torch.inference_mode()
        def copy() -> None:
            import_layer(
                self.kv_caches, layer, ids.to(self.device, non_blocking=True), staged.to(self.device, non_blocking=True)
            )

        ready = self.copy_stream.submit(copy)
        self.host_pool.release(buf, ready)
