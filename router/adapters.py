"""LoRA adapters across the pool: which exist, their identity, and loads/unloads fanned out.

Workers report the adapters they know in every LoadReport (name, sha256 digest, folder). The
gateway serves an adapter name as a model when a healthy decode worker reports it, and hashes
the prompt's blocks with the adapter's identity (platform/hashing.lora_extra_keys) so the
prefix index matches only that adapter's KV.

A runtime load (POST /v1/load_lora_adapter) is checked on one worker first (a bad folder is a
400 with the worker's reason, and nothing else changes), then sent to every other connected
worker and remembered; `reconcile()` (run after every load report) sends remembered adapters to
the workers that lack them: workers that join later or restart. An unload forgets the adapter,
is sent to every worker (requests running with it there finish with their copy), and a worker
still reporting it is told again.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.errors import APIError, NoWorkerError
from splitserve.router.pool import WorkerPool, WorkerState

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0


def reported(worker: WorkerState) -> dict[str, bytes]:
    """name -> digest of the adapters the worker's last load report lists."""
    return {} if worker.load is None else {a.name: a.digest for a in worker.load.adapters}


class AdapterCatalog:
    def __init__(self, pool: WorkerPool, channels):
        self.pool = pool
        self.channels = channels
        self.runtime: dict[str, tuple[str, bytes]] = {}   # loaded through the API: name -> (folder, digest)
        self.unloaded: set[str] = set()                     # unloaded through the API since
        self._pushing: set[tuple[str, str]] = set()        # (worker, name) reconcile calls in flight

    # -- reading ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Adapters a request may name: reported by a healthy decode worker, or loaded here."""
        now = self.pool.clock()
        names = set(self.runtime)
        for w in self.pool.decode_workers():
            if w.is_healthy(now):
                names.update(reported(w))
        return sorted(names - self.unloaded)

    def digest(self, name: str) -> bytes | None:
        """The adapter's digest (what block hashes carry), or None when no one reported it yet."""
        if name in self.runtime:
            return self.runtime[name][1]
        for w in self.pool.decode_workers():
            if name in reported(w):
                return reported(w)[name]
        return None

    def workers_with(self, name: str) -> set[str]:
        return {w.address for w in self.pool.workers.values() if name in reported(w)}

    # -- changing --------------------------------------------------------------------------
    async def load(self, name: str, path: str) -> bytes:
        """Load on every connected worker; the digest. APIError 400 (bad adapter) or 503."""
        workers = self._connected()
        if not workers:
            raise NoWorkerError("no connected worker to load the adapter on")
        info = await self._load_on(workers[0], name, path, strict=True)
        self.runtime[name] = (path, info.digest)
        self.unloaded.discard(name)
        await asyncio.gather(*(self._load_on(w, name, path, strict=False) for w in workers[1:]))
        log.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(workers))
        return info.digest

    async def unload(self, name: str) -> None:
        """Unload everywhere; APIError 404 for a name no one serves."""
        if name not in self.names():
            raise APIError(404, f"adapter {name!r} is not loaded; loaded: {', '.join(self.names()) or 'none'}",
                           param="lora_name", code="model_not_found")
        self.runtime.pop(name, None)
        self.unloaded.add(name)
        await asyncio.gather(*(self._unload_on(w, name) for w in self._connected()))
        log.info("LoRA adapter %s unloaded", name)

    async def reconcile(self, worker: WorkerState) -> None:
        """Bring one worker in line with the API's loads and unloads (after its load report)."""
        have = reported(worker)
        for name, (path, digest) in list(self.runtime.items()):
            if have.get(name) != digest and (worker.address, name) not in self._pushing:
                self._pushing.add((worker.address, name))
                try:
                    await self._load_on(worker, name, path, strict=False)
                finally:
                    self._pushing.discard((worker.address, name))
        for name in self.unloaded & set(have):
            await self._unload_on(worker, name)

    def _connected(self) -> list[WorkerState]:
        return sorted((w for w in self.pool.workers.values() if w.is_connected and not w.incompatible),
                      key=lambda w: (not w.can_decode, w.address))

    async def _load_on(self, worker: WorkerState, name: str, path: str, strict: bool) -> pb.LoraAdapterInfo | None:
        try:
            return await self.channels.stub(worker.address).LoadLoraAdapter(
                pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if strict and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise APIError(400, exc.details(), param="lora_path") from None
            if strict:
                raise NoWorkerError(f"loading the adapter on {worker.address} failed: {exc.code().name}") from None
            log.warning("loading adapter %s on %s failed (%s: %s); retried on its next load report", name,
                        worker.address, exc.code().name, exc.details())
            return None

    async def _unload_on(self, worker: WorkerState, name: str) -> None:
        try:
            await self.channels.stub(worker.address).UnloadLoraAdapter(
                pb.UnloadLoraAdapterRequest(lora_name=name), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("unloading adapter %s on %s failed (%s)", name, worker.address, exc.code().name)
