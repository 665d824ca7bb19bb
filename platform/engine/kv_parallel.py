"""KV transfer under tensor parallelism: the wire carries every KV head, each rank caches its own.

A transfer's payload is the same whatever the TP size at either end: one layer's K and V of some
blocks with all the model's KV heads, [2, n, block_size, kv_heads, head_dim] (workers/transfer).
A rank's cache holds only its heads (parallel/layout.py), so a TP-N prefill feeds a TP-M decode
with nothing to reshard on the wire. The block ids are the same on every rank (one scheduler on
rank 0 owns the one block table), and rank 0 is the only rank the worker's transport talks to.

Export (a prefill worker), inside the forward:

    rank 0   the step's StepMessage carries each export's block ids, in the order rank 0
             stages them (`ExportHook.block_ids`)
    every    after layer i, per export: read those blocks of its own cache, `gather` to rank 0
    rank 0   put the heads in order (a KV head replicated over ranks, tp > KV heads, is taken
             once) and stage the full payload as one process does (kv_connector.py)

Reading blocks between steps (a pull's holder, the KV tier's offload): a KVGather message names
the blocks; every rank gathers its heads of them, layer by layer, to rank 0 (`read_blocks`).

Import (a decode worker, a puller, the KV tier's restore):

    transport thread   `write_layer(ids, layer, payload)`: a copy of the full payload queued
    engine thread      before the next step (`before_step`): a KVWrites message names the queued
                       writes (ids, layer, shape); each payload is cut into the ranks' head
                       slices and `scatter`ed; every rank writes its slice into the same ids

A request reads imported KV only in a step after its transfer completed (or its restore), and
every queued write lands before that step's forward and before any `read_blocks`. Writes land
in the order they came, so one into blocks freed meanwhile (an aborted transfer) lands before
whatever is written into them next (a later queued write, or the forward that computes them),
as a late write does with one process.

Every byte goes through rank 0 (gathered to it, scattered from it): simple and enough on a CPU
and for a few GPUs on one node, but on GPUs rank 0's link carries all the heads. Each rank
sending its own slice to the peer is the known next step (docs/workers.md).

With `--tensor-parallel-size 1` none of this runs: the engine builds the plain KVConnector.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.platform.engine.kv_connector import KVConnector, export_layer, import_layer
from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.engine.kv_staging import StagedPayload
from splitserve.platform.parallel.group import TPGroup
from splitserve.platform.parallel.layout import ShardLayout

__all__ = ["ExportHook", "HeadShards", "KVGather", "KVWrites", "TPKVConnector"]


class HeadShards:
    """One rank's view of the KV heads: which slice of a full payload each rank caches, and the
    collectives that move a layer payload between all heads (rank 0) and each rank's."""

    def __init__(self, group: TPGroup, layout: ShardLayout, kv_caches, device: torch.device):
        self.group = group
        self.kv_caches = kv_caches
        self.device = device
        self.num_kv_heads = layout.config.num_kv_heads
        ranks = [ShardLayout(layout.config, r, group.size) for r in range(group.size)]
        self.heads = [(r.kv_head_start, r.kv_head_start + r.num_kv_heads) for r in ranks]
        # the first rank holding each run of heads: their slices, in rank order, are all the heads
        self.owners = [r for r, span in enumerate(self.heads) if span not in self.heads[:r]]

    def cut(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s heads of a full payload (a view; heads are the second-to-last dim)."""
        start, stop = self.heads[rank]
        return full[..., start:stop, :]

    def gather(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The full payload on rank 0 from every rank's `shard`; None on the other ranks."""
        parts = self.group.gather(shard)
        if parts is None:
            return None
        return torch.cat([parts[r] for r in self.owners], dim=-2)

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor | None:
        """Blocks `ids` of `layer` with all heads on rank 0 (None elsewhere); every rank calls it."""
        return self.gather(export_layer(self.kv_caches, layer, ids))

    def land(self, ids: Sequence[int], layer: int, shape: tuple[int, ...], full: torch.Tensor | None) -> None:
        """Scatter a full payload (rank 0's `full`) and write each rank's heads into blocks `ids`."""
        shard_shape = (*shape[:-2], self.heads[self.group.rank][1] - self.heads[self.group.rank][0], shape[-1])
        k_cache = self.kv_caches[layer][0]
        parts = None
        if full is not None:
            full = full.to(self.device, k_cache.dtype)
            parts = [self.cut(full, r) for r in range(self.group.size)]
        shard = self.group.scatter(parts, torch.empty(shard_shape, dtype=k_cache.dtype, device=self.device))
        import_layer(self.kv_caches, layer, torch.tensor(list(ids), dtype=torch.long, device=self.device), shard)

    def export_hook(self, block_ids: tuple[tuple[int, ...], ...]) -> Callable[[int], None]:
        """A rank > 0's side of rank 0's ExportHook: after each layer, its heads of each export."""
        ids = [torch.tensor(list(b), dtype=torch.long, device=self.device) for b in block_ids]

        def hook(layer: int) -> None:
            for each in ids:
                self.read(layer, each)

        return hook

    def follow(self, message: KVWrites | KVGather) -> None:
        """A rank > 0's side of rank 0's KVWrites or KVGather message."""
        if isinstance(message, KVGather):
            ids = torch.tensor(list(message.block_ids), dtype=torch.long, device=self.device)
            for layer in range(len(self.kv_caches)):
                self.read(layer, ids)
            return
        for ids, layer, shape in message.writes:
            self.land(ids, layer, shape, None)


@dataclass(frozen=True)
class ExportHook:
    """Rank 0's per-layer export hook under tensor parallelism, with the block ids of each
    export in the order it gathers them (the runner ships them in the StepMessage)."""

    run: Callable[[int], None]
    block_ids: tuple[tuple[int, ...], ...]

    def __call__(self, layer: int) -> None:
        self.run(layer)


@dataclass(frozen=True)
class KVWrites:
    """Rank 0 to the other ranks: receive and write these payloads' heads, in this order."""

    writes: tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...]  # (block ids, layer, full shape)


@dataclass(frozen=True)
class KVGather:
    """Rank 0 to the other ranks: send your heads of these blocks, every layer in order (a pull)."""

    block_ids: tuple[int, ...]


class TPKVConnector(KVConnector):
    """Rank 0's KVConnector when the engine runs tensor-parallel: full-head payloads in and out,
    each rank's heads gathered from it and scattered to it (see the module docstring)."""

    def __init__(self, kv_caches, kv_manager, block_size: int, device: torch.device, executor, layout: ShardLayout):
        super().__init__(kv_caches, kv_manager, block_size, device)
        self.executor = executor
        self.shards = HeadShards(executor.group, layout, kv_caches, device)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()  # (ids, layer, full payload), from any thread

    def transfer_refusal(self) -> str | None:
        if self.kv_layout is None:
            return None
        return (
            "P/D of a model with several KV groups (sliding-window layers) is not supported with "
            "--tensor-parallel-size > 1 yet; allowed: local prefill, or --tensor-parallel-size 1"
        )

    def _layer_hook(self, exports: list[tuple[KVExport, list]]) -> ExportHook:
        # one KV group under TP (a grouped model's P/D is refused: input_processor.py), so each
        # export has one piece, the same block ids for every layer
        ids = tuple(tuple(pieces[0][1].tolist()) for _, pieces in exports)
        return ExportHook(super()._layer_hook(exports), ids)

    def _stage_export(self, layer: int, ids: torch.Tensor, on_device: bool = False) -> StagedPayload:
        full = self.shards.read(layer, ids)  # on the engine thread, in the forward: every rank is here
        return self._stage(lambda: full, full.shape, full.dtype, full, on_device)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one layer's K (or V) with every KV head: [block_size, kv_heads, head_dim]."""
        k_cache = self.kv_caches[0][0]
        return (k_cache.shape[1], self.shards.num_kv_heads, k_cache.shape[3])

    def write_layer(self, block_ids: Sequence[int], layer: int, payload: torch.Tensor) -> None:
        """Queue a received full-head layer (a transfer's, or the KV tier's restore); it lands on
        every rank before the next step (or the next read_blocks)."""
        self._writes.put((tuple(block_ids), layer, payload.to("cpu", copy=True)))

    def before_step(self) -> None:
        self._land_writes()
        super().before_step()

    def _land_writes(self) -> None:
        writes = []
        while not self._writes.empty():
            writes.append(self._writes.get_nowait())
        if not writes:
            return
        self.executor.send_step(KVWrites(tuple((ids, layer, tuple(p.shape)) for ids, layer, p in writes)))
        with _or_group_down(self.executor, "landing received KV"):
            for ids, layer, payload in writes:
                self.shards.land(ids, layer, tuple(payload.shape), payload)

    def read_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Every layer's K and V of `block_ids` with all heads, [2, n, block_size, kv_heads,
        head_dim] each (a pull's holder, the KV tier's offload; on the engine thread). Writes
        still queued land first, so what is read is what the blocks hold."""
        self._land_writes()
        self.executor.send_step(KVGather(tuple(block_ids)))
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        with _or_group_down(self.executor, "gathering KV (a pull, the KV tier)"):
            return [self.shards.read(layer, ids) for layer in range(len(self.kv_caches))]


@contextlib.contextmanager
def _or_group_down(executor, what: str):
    """A collective that raises takes the group down (the ranks are out of step for good)."""
    try:
        yield
    except Exception as exc:
        executor.fail(f"{what} failed on rank 0: {type(exc).__name__}: {exc}")
        executor.check()
        raise
