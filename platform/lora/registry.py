"""The adapters an engine knows and the ones it holds in memory.

Three sets, as in vLLM: *known* adapters (name -> folder, from --lora-modules or a runtime load),
*loaded* adapters (read and packed, at most `max_cpu_loras`, least recently used evicted first)
and, per step, *active* adapters (at most `max_loras`, enforced by the scheduler). On a CPU an
active adapter needs no copy into a device slot: the loaded tensors are used directly, so a
"slot" is a limit on the distinct adapters one step mixes (each costs two small matmuls per
fused linear per run of rows), not a memory region.

A request holds its LoraAdapter object from admission to the end, so evicting or unloading an
adapter never changes a request that is running: it finishes with the weights it started with,
and new requests get a fresh read (a changed folder gets a new digest, hence new KV).

The registry's state belongs to the engine thread. A worker reads an evicted adapter again off
that thread (`lookup`, then `read` in another thread, then `install`), so the steps of every
other request go on during the read (a rank-64 adapter takes about 0.2 s to read and pack).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from splitserve.platform.config import LoraConfig, check_lora_name
from splitserve.platform.errors import ConfigError, InvalidRequestError
from splitserve.platform.lora.adapter import AdapterError, LinearLayout, LoraAdapter, read_adapter
from splitserve.platform.parallel.layout import ShardLayout


class AdapterNotFoundError(InvalidRequestError):
    """A request or an unload names an adapter this engine does not know (HTTP 404)."""


class LoraRegistry:
    def __init__(
        self, config: LoraConfig, layout: dict[str, LinearLayout], dtype: torch.dtype, shard: ShardLayout | None = None
    ):
        """`shard`: this rank's part of the model under tensor parallelism (adapters are cut to it)."""
        self.config = config
        self.layout = layout
        self.shard = shard
        self.dtype = dtype
        self._paths: dict[str, str] = {}
        self._digests: dict[str, bytes] = {}  # of the latest read of each known adapter
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.num_loads = 0
        self.num_hinted_evictions = 0  # evictions that followed the router's evict_first hint
        self.refusal: str | None = None  # why this model takes no adapter (models/features.py), if it does not

    def load_modules(self) -> None:
        """Load the adapters of --lora-modules; a bad one stops the start (ConfigError)."""
        for name, path in self.config.modules:
            try:
                self.add(name, path)
            except AdapterError as e:
                raise ConfigError(f"--lora-modules {name}={path}: {e}") from None

    def add(self, name: str, path: str) -> LoraAdapter:
        """Register `name` -> `path` and load it now (so a bad folder is reported to whoever
        adds it). Re-adding a known name replaces it (new requests get the new weights)."""
        if self.refusal is not None:
            raise AdapterError(self.refusal)
        try:
            check_lora_name(name)
        except ConfigError as e:
            raise AdapterError(str(e)) from None
        adapter = self._read(name, path)
        self._paths[name] = path
        self._remember(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Forget `name`: new requests for it are refused; running ones finish with their copy."""
        if name not in self._paths:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded; loaded: {', '.join(self.names()) or 'none'}")
        del self._paths[name]
        del self._digests[name]
        self._loaded.pop(name, None)

    def get(self, name: str) -> LoraAdapter:
        """The adapter for a request, read again from its folder if it was evicted."""
        adapter, path = self.lookup(name)
        if adapter is None:
            adapter = self._read(name, path)
            self._remember(adapter)
        return adapter

    def lookup(self, name: str) -> tuple[LoraAdapter | None, str]:
        """(the adapter if it is in memory, now the most recently used, else None; its folder).
        Raises AdapterNotFoundError for a name this engine does not know."""
        if name not in self._paths:
            raise AdapterNotFoundError(
                f"model {name!r} is neither the base model nor a loaded adapter; "
                f"adapters: {', '.join(self.names()) or 'none'}"
            )
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
        return adapter, self._paths[name]

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and pack an adapter; touches no state of the registry, so any thread may call it."""
        return read_adapter(name, path, self.layout, self.config.max_lora_rank, self.dtype, self.shard)

    def install(self, adapter: LoraAdapter, evict_first: Iterable[str] = ()) -> LoraAdapter:
        """Keep an adapter that `read` returned off the engine thread, and return the one new
        requests for its name get: the copy already in memory if another read won the race, a
        fresh read if the name was re-added with another folder meanwhile.

        `evict_first`: adapters other workers of the pool also hold (the router's hint). If
        memory is full, the least recently used of these goes before any other: an adapter
        only this worker holds costs the pool a disk read when it is next asked for, one held
        elsewhere too can be served there without one."""
        current, path = self.lookup(adapter.name)
        if current is not None:
            return current
        if path != adapter.path:
            return self.get(adapter.name)
        self.num_loads += 1
        self._remember(adapter, frozenset(evict_first))
        return adapter

    def digest(self, name: str) -> bytes:
        """The digest of `name`'s latest read, without touching the LRU (safe from any thread)."""
        digest = self._digests.get(name)
        if digest is None:
            raise AdapterNotFoundError(f"model {name!r} is neither the base model nor a loaded adapter")
        return digest

    def names(self) -> list[str]:
        return sorted(self._paths)

    def loaded(self) -> list[LoraAdapter]:
        """Adapters in memory, least recently used first."""
        return list(self._loaded.values())

    def known(self) -> list[tuple[str, bytes, str]]:
        """(name, digest of its latest read, folder) of every known adapter, by name."""
        return [(name, self._digests[name], self._paths[name]) for name in sorted(self._paths)]

    def _read(self, name: str, path: str) -> LoraAdapter:
        self.num_loads += 1
        return self.read(name, path)

    def _remember(self, adapter: LoraAdapter, evict_first: frozenset[str] = frozenset()) -> None:
        self._digests[adapter.name] = adapter.digest
        self._loaded[adapter.name] = adapter
        self._loaded.move_to_end(adapter.name)
        while len(self._loaded) > self.config.cpu_capacity:
            victim = next((n for n in self._loaded if n in evict_first and n != adapter.name), None)
            if victim is None:
                self._loaded.popitem(last=False)
            else:
                del self._loaded[victim]
                self.num_hinted_evictions += 1
