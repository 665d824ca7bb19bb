"""The second KV tier: blocks the pool evicts are kept here instead of vanishing.

    pool.allocate() evicts cached blocks -> KVTier.offload(): copy each block's KV (all layers)
        out of the cache tensors into the store, under its block hash, most recent at the LRU tail
    KVCacheManager.find_cached_prefix(): the prefix walk that misses the pool but hits the tier
        -> KVTier.restore(): read and verify the payloads, allocate fresh pool blocks, copy the
           KV back in and register them in the pool under their hashes (they become ordinary
           prefix-cache hits; the request then references them like any other hit)

The tier is inclusive: a restored block keeps its copy here, so evicting it again costs no
second write (its entry only moves to the LRU tail). The tier has its own LRU bounded by
`KVTierConfig.max_bytes`; past it the least recently stored or restored entries are dropped.

Stores (one interface: put / get / delete / close):
* `FileStore` (CPU workers): one file per block in a folder the tier creates under
  `--kv-tier-dir` and removes on close. Each file starts with a header naming the KV layout and
  the block hash and ends the header with an HMAC-SHA256 over the header and the payload, keyed
  with a key derived from the service's KV secret (`KVTierConfig.secret`; without one, a random
  key of this process). A file whose layout, hash, length or MAC does not match is rejected
  (deleted, reported as removed) and the prefix is recomputed from that block on: a forged file
  with a recomputed header fails, because writing one that passes needs the service's secret.
  The owning process holds an exclusive `flock` on `<folder>/.owner` for its lifetime. A folder
  left by a worker that died without cleaning up (SIGKILL, OOM) is one whose lock can be taken:
  the next store started under the same `--kv-tier-dir` removes it before creating its own, so
  a restarted worker stays within the tier's configured bound (in Kubernetes the `kv-tier`
  emptyDir survives container restarts and is sized for one tier).
* `MemoryStore` (GPU workers): host-memory tensors, pinned on CUDA so the copies are DMA.

Failures: a write that fails (disk full, I/O error) skips that block. It is counted in
`TierStats.num_write_failures`, its partial file removed, and the pool hands out the evicted
blocks as usual: the tier loses a cache entry, no request is touched.

Events: entering the tier is BlockStored(tier=2), leaving it BlockRemoved(tier=2); they go
into the pool's event stream, so the router's prefix index knows which worker holds which
prefix in which tier. The tier writes only its own LRU, its store and its stats; it reads the
cache tensors and calls the pool's public methods (the pool owns ref counts and hashes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import logging
import os
import shutil
import struct
import tempfile
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from splitserve.platform.config import KVTierConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.hashing import BlockHash
from splitserve.platform.kv.block_pool import TIER_SECOND, Block, BlockPool, BlockRemoved, BlockStored, KVEvent

_MAGIC = b"SSKV2\n"
_MAC_BYTES = 32
_FOLDER_PREFIX = "splitserve-kv-"
_OWNER_LOCK = ".owner"
_TIER_CONTEXT = b"splitserve-kv-tier-v1"
_UNLOCKED_GRACE_S = 60.0  # a folder without a lock file this old is a dead one (lock never created)

log = logging.getLogger(__name__)


def tier_key(secret: bytes | None) -> bytes:
    """The tier's MAC key: derived from the service's KV secret, or random for this process."""
    if secret is None:
        return os.urandom(32)
    return hmac.new(secret, _TIER_CONTEXT, hashlib.sha256).digest()


def reclaim_dead_folders(parent: str) -> list[str]:
    """Remove the tier folders under `parent` whose owner died (their lock can be taken);
    returns the folders removed. Live owners hold their lock, so their folders stay."""
    removed = []
    for name in sorted(os.listdir(parent)):
        folder = os.path.join(parent, name)
        if not name.startswith(_FOLDER_PREFIX) or not os.path.isdir(folder) or os.path.islink(folder):
            continue
        if _owner_is_alive(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.warning(
            "reclaimed %d KV tier folder(s) left by dead workers under %s: %s",
            len(removed),
            parent,
            ", ".join(os.path.basename(f) for f in removed),
        )
    return removed


def _owner_is_alive(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, _OWNER_LOCK), os.O_RDWR)
    except FileNotFoundError:  # being created right now, or its creator died before locking
        with contextlib.suppress(OSError):
            return time.time() - os.stat(folder).st_mtime < _UNLOCKED_GRACE_S
        return False
    except OSError:
        return True  # not ours to judge (permissions): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


@dataclass
class TierStats:
    """Counters for metrics (monotonically increasing) and the tier's size now."""

    num_stored: int = 0  # blocks written into the tier
    num_hits: int = 0  # blocks copied back into the pool
    num_evictions: int = 0  # blocks dropped by the tier's own LRU
    num_rejected: int = 0  # entries that failed verification (corrupt, forged, wrong layout)
    num_write_failures: int = 0  # blocks the store could not write (disk full, I/O error): skipped
    num_bytes: int = 0  # payload bytes held now
    num_blocks: int = 0  # entries held now


class MemoryStore:
    """Block payloads in host memory (pinned when the cache lives on a GPU)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._data: dict[BlockHash, torch.Tensor] = {}

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=self.pin)
        host.copy_(payload)
        self._data[block_hash] = host

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return self._data.get(block_hash)

    def delete(self, block_hash: BlockHash) -> None:
        self._data.pop(block_hash, None)

    def close(self) -> None:
        self._data.clear()


class FileStore:
    """One file per block under a private folder; verified on every read."""

    def __init__(self, parent: str, layout: str, shape: tuple[int, ...], dtype: torch.dtype, key: bytes):
        os.makedirs(parent, exist_ok=True)
        self.reclaimed = reclaim_dead_folders(parent)
        self.directory = tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=parent)
        self._lock_fd = os.open(os.path.join(self.directory, _OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process exits or closes
        # removes the folder on close(), when the store is collected, or at interpreter exit
        self._remove = weakref.finalize(self, _remove_folder, self.directory, self._lock_fd)
        self.key = key
        self.layout = layout.encode()
        self.shape = shape
        self.dtype = dtype
        self.num_payload_bytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()

    def path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.directory, block_hash.hex())

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Write one block; OSError (disk full, ...) leaves no file behind and propagates."""
        data = payload.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        prefix = _MAGIC + struct.pack("<I", len(self.layout)) + self.layout + block_hash
        tmp = self.path(block_hash) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(prefix)
                f.write(self._mac(prefix, data))
                f.write(data)
            os.replace(tmp, self.path(block_hash))  # a reader never sees a half-written file
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _mac(self, prefix: bytes, data: bytes) -> bytes:
        mac = hmac.new(self.key, prefix, hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The payload, or None when the file is missing or fails verification."""
        try:
            with open(self.path(block_hash), "rb") as f:
                raw = f.read()
        except OSError:
            return None
        head = len(_MAGIC) + 4
        if raw[: len(_MAGIC)] != _MAGIC or len(raw) < head:
            return None
        (n,) = struct.unpack("<I", raw[len(_MAGIC) : head])
        layout, stored_hash = raw[head : head + n], raw[head + n : head + n + len(block_hash)]
        mac_at = head + n + len(block_hash)
        mac, data = raw[mac_at : mac_at + _MAC_BYTES], raw[mac_at + _MAC_BYTES :]
        if (
            layout != self.layout
            or stored_hash != block_hash
            or len(data) != self.num_payload_bytes
            or not hmac.compare_digest(mac, self._mac(raw[:mac_at], data))
        ):
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.shape)

    def delete(self, block_hash: BlockHash) -> None:
        try:
            os.unlink(self.path(block_hash))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._remove()


def _remove_folder(directory: str, lock_fd: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(lock_fd)


class KVTier:
    """The pool's EvictionSink and the prefix walk's second chance (see the module docstring)."""

    def __init__(self, config: KVTierConfig, kv_caches, layout: str, copier=None):
        self.config = config
        self.kv_caches = kv_caches
        # under tensor parallelism rank 0's TPKVConnector (engine/kv_parallel.py): the tier keeps
        # every KV head of a block, gathered from the ranks and scattered back to them
        self.copier = copier
        k0 = kv_caches[0][0]
        self.device = k0.device
        block_shape = tuple(k0.shape[1:]) if copier is None else copier.block_shape
        self.shape = (len(kv_caches), 2, *block_shape)  # [layers, K/V, block_size, kv_heads, head_dim]
        self.block_bytes = torch.Size(self.shape).numel() * k0.element_size()
        if config.max_bytes < self.block_bytes:
            raise ConfigError(
                f"the KV tier holds {config.max_bytes} bytes, less than one block "
                f"({self.block_bytes} bytes); raise --kv-tier-bytes to at least {self.block_bytes}"
            )
        self.max_blocks = config.max_bytes // self.block_bytes
        if config.directory is not None:
            self.store = FileStore(config.directory, layout, self.shape, k0.dtype, tier_key(config.secret))
        else:
            self.store = MemoryStore(pin=self.device.type == "cuda")
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # head = next to drop
        self.stats = TierStats()

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def held_hashes(self) -> list[BlockHash]:
        return list(self._lru)

    # -- EvictionSink ----------------------------------------------------------------------
    def offload(self, evicted: list[tuple[int, BlockHash]]) -> list[KVEvent]:
        stored, dropped = [], []
        for block_id, block_hash in evicted:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)  # inclusive: the copy here is the same KV
                continue
            while len(self._lru) >= self.max_blocks:
                dropped.append(self._drop_oldest())
            try:
                self.store.put(block_hash, self._gather(block_id))
            except OSError as e:  # disk full, I/O error: skip this block, the pool goes on
                self.stats.num_write_failures += 1
                if self.stats.num_write_failures == 1 or self.stats.num_write_failures % 1000 == 0:
                    log.warning(
                        "KV tier write failed (%s); the block is skipped (%d failures so far)",
                        e,
                        self.stats.num_write_failures,
                    )
                continue
            self._lru[block_hash] = None
            stored.append(block_hash)
        self.stats.num_stored += len(stored)
        self._sync_size()
        events: list[KVEvent] = []
        if dropped:
            events.append(BlockRemoved(tuple(dropped), tier=TIER_SECOND))
        if stored:
            events.append(BlockStored(tuple(stored), None, tier=TIER_SECOND))
        return events

    def clear(self) -> list[KVEvent]:
        for block_hash in self._lru:
            self.store.delete(block_hash)
        self._lru.clear()
        self._sync_size()
        return []

    # -- restore ---------------------------------------------------------------------------
    def restore(
        self, pool: BlockPool, hashes: list[BlockHash], parent: BlockHash | None, held: list[Block]
    ) -> list[Block]:
        """Copy the tier's blocks for the leading run of `hashes` back into `pool`.

        `held`: the pool hits found before these (they must survive the allocation, so they are
        referenced during it). Returns the restored blocks, registered in the pool and free
        (ref_cnt 0), like any other cached block; the caller references them. Stops at the first
        hash the tier lacks or whose entry fails verification (that entry is dropped)."""
        payloads, rejected = [], []
        for block_hash in hashes[: pool.num_free_blocks - sum(b.ref_cnt == 0 for b in held)]:
            if block_hash not in self._lru or pool.peek(block_hash):
                break
            payload = self.store.get(block_hash)
            if payload is None:
                rejected.append(block_hash)
                break
            payloads.append(payload)
        if rejected:
            self.stats.num_rejected += 1
            self._forget(rejected[0])
            pool.record_events([BlockRemoved(tuple(rejected), tier=TIER_SECOND)])
        blocks: list[Block] = []
        if payloads:
            pool.touch(held)
            blocks = pool.allocate(len(payloads))
            self._scatter([b.block_id for b in blocks], payloads)
            pool.cache_blocks(blocks, hashes[: len(blocks)], parent)
            pool.free(reversed(held + blocks))
            for block_hash in hashes[: len(blocks)]:
                if block_hash in self._lru:  # the allocation's own offload may have dropped it
                    self._lru.move_to_end(block_hash)
            self.stats.num_hits += len(blocks)
        self._sync_size()
        return blocks

    def close(self) -> None:
        self.store.close()
        self._lru.clear()
        self._sync_size()

    # -- internals -------------------------------------------------------------------------
    def _gather(self, block_id: int) -> torch.Tensor:
        if self.copier is not None:  # every rank's heads: [2, 1, block_size, kv_heads, head_dim] per layer
            return torch.stack([layer[:, 0] for layer in self.copier.read_blocks([block_id])])
        return torch.stack([torch.stack((k[block_id], v[block_id])) for k, v in self.kv_caches])

    def _scatter(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        if self.copier is not None:  # lands on every rank before the step that reads it
            stacked = torch.stack(payloads)  # [n, layers, 2, ...]
            for layer in range(len(self.kv_caches)):
                self.copier.write_layer(block_ids, layer, stacked[:, layer].transpose(0, 1))
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        stacked = torch.stack(payloads).to(self.device, non_blocking=True)  # [n, layers, 2, ...]
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, ids, stacked[:, layer, 0].to(k.dtype))
            v.index_copy_(0, ids, stacked[:, layer, 1].to(v.dtype))

    def _drop_oldest(self) -> BlockHash:
        block_hash, _ = self._lru.popitem(last=False)
        self.store.delete(block_hash)
        self.stats.num_evictions += 1
        return block_hash

    def _forget(self, block_hash: BlockHash) -> None:
        self._lru.pop(block_hash, None)
        self.store.delete(block_hash)

    def _sync_size(self) -> None:
        self.stats.num_blocks = len(self._lru)
        self.stats.num_bytes = len(self._lru) * self.block_bytes


def attach_tier(
    config: KVTierConfig | None, pool: BlockPool, kv_manager, kv_caches, model_id: str, copier=None
) -> KVTier | None:
    """Build the second tier named by `config` (None: none) and hook it into the pool (evictions)
    and the KV manager (prefix lookups). `copier`: see KVTier (tensor parallelism)."""
    if config is None:
        return None
    if kv_manager.is_grouped:
        raise ConfigError(
            "--kv-tier needs a model with one KV group; this one mixes layer types (sliding-window and "
            "full layers: one KV group per type, platform/kv/groups.py) and the tier moves one block "
            "table per request; allowed: no --kv-tier for this model"
        )
    k0 = kv_caches[0][0]
    block_shape = tuple(k0.shape[1:]) if copier is None else copier.block_shape
    layout = f"{model_id}|{k0.dtype}|{len(kv_caches)}x{block_shape}"
    tier = KVTier(config, kv_caches, layout, copier)
    pool.eviction_sink = tier
    kv_manager.tier = tier
    return tier
