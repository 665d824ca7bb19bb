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

Declared mode (`declare()`, fed by router/placement/adapter_sync.py from a file the operator renders out of
an InferenceService's spec.adapters): the declared set is the whole truth, level-based. Each
reconcile loads every declared adapter a worker lacks (or holds from another folder) and unloads
every adapter it holds that is not declared, so a worker that joins, restarts or missed a change
converges on its next load report, and a restarted router needs no memory of earlier sets. The
API's load and unload answer 409 then: one writer per adapter set. A load that failed on a worker
(a folder it cannot read) is retried after FAILED_RETRY_S, not on every report; one that worked
is not repeated for REPORT_GRACE_S (a report sent while it ran does not list it yet).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.errors import APIError, NoWorkerError
from splitserve.router.placement.pool import WorkerPool, WorkerState

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
FAILED_RETRY_S = 30.0
REPORT_GRACE_S = 5.0  # a load report sent while a load ran still lacks the adapter: no second load


def reported(worker: WorkerState) -> dict[str, bytes]:
    """name -> digest of the adapters the worker's last load report lists."""
    return {} if worker.load is None else {a.name: a.digest for a in worker.load.adapters}


class AdapterCatalog:
    def __init__(self, pool: WorkerPool, channels):
        self.pool = pool
        self.channels = channels
        self.runtime: dict[str, tuple[str, bytes]] = {}  # loaded through the API: name -> (folder, digest)
        self.unloaded: set[str] = set()  # unloaded through the API since
        self._pushing: set[tuple[str, str]] = set()  # (worker, name) reconcile calls in flight
        self.declared: dict[str, str] | None = None  # declared mode: name -> folder (None: off)
        self._hold: dict[tuple[str, str, str], float] = {}  # (worker, name, folder) -> no load before this time

    # -- reading ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Adapters a request may name: reported by a healthy decode worker, or loaded here."""
        now = self.pool.clock()
        names = set(self.runtime)
        for w in self.pool.decode_workers():
            if w.is_healthy(now):
                names.update(reported(w))
        if self.declared is not None:
            return sorted(names & set(self.declared))
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
    def declare(self, adapters: dict[str, str]) -> None:
        """Enter (or update) declared mode: `adapters` (name -> folder) is the whole set every
        worker should hold; the next load report of each worker brings it in line."""
        self.declared = dict(adapters)
        self._hold = {k: t for k, t in self._hold.items() if self.declared.get(k[1]) == k[2]}
        self.runtime.clear()
        self.unloaded.clear()

    def _refuse_in_declared_mode(self, verb: str) -> None:
        if self.declared is not None:
            raise APIError(
                409,
                f"this router's adapters are declared (an InferenceService's spec.adapters, or "
                f"the router's adapters.file); {verb} them there",
                param="lora_name",
                code="conflict",
            )

    async def load(self, name: str, path: str) -> bytes:
        """Load on every connected worker; the digest. APIError 400 (bad adapter), 409
        (declared mode) or 503."""
        self._refuse_in_declared_mode("load")
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
        """Unload everywhere; APIError 404 for a name no one serves, 409 in declared mode."""
        self._refuse_in_declared_mode("unload")
        if name not in self.names():
            raise APIError(
                404,
                f"adapter {name!r} is not loaded; loaded: {', '.join(self.names()) or 'none'}",
                param="lora_name",
                code="model_not_found",
            )
        self.runtime.pop(name, None)
        self.unloaded.add(name)
        await asyncio.gather(*(self._unload_on(w, name) for w in self._connected()))
        log.info("LoRA adapter %s unloaded", name)

    async def reconcile(self, worker: WorkerState) -> None:
        """Bring one worker in line with the API's loads and unloads, or with the declared set
        (after its load report)."""
        if self.declared is not None:
            await self._reconcile_declared(worker)
            return
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

    def is_pending(self, worker: WorkerState) -> bool:
        """Whether a reconcile of `worker` has anything to do (a cheap check per load report)."""
        if self.declared is None:
            return bool(self.runtime or self.unloaded)
        have = {} if worker.load is None else {a.name: a.path for a in worker.load.adapters}
        return have != self.declared

    async def _reconcile_declared(self, worker: WorkerState) -> None:
        declared = dict(self.declared or {})
        have = {} if worker.load is None else {a.name: a.path for a in worker.load.adapters}
        now = self.pool.clock()
        for name, path in declared.items():
            key = (worker.address, name, path)
            if have.get(name) == path or now < self._hold.get(key, now):
                continue
            if await self._load_on(worker, name, path, strict=False) is None:
                self._hold[key] = now + FAILED_RETRY_S
            else:
                self._hold[key] = self.pool.clock() + REPORT_GRACE_S
                log.info("declared LoRA adapter %s loaded on %s from %s", name, worker.address, path)
        for name in sorted(set(have) - set(declared)):
            await self._unload_on(worker, name)
            log.info("LoRA adapter %s unloaded from %s: no longer declared", name, worker.address)

    def _connected(self) -> list[WorkerState]:
        return sorted(
            (w for w in self.pool.workers.values() if w.is_connected and not w.incompatible),
            key=lambda w: (not w.can_decode, w.address),
        )

    async def _load_on(self, worker: WorkerState, name: str, path: str, strict: bool) -> pb.LoraAdapterInfo | None:
        try:
            return await self.channels.stub(worker.address).LoadLoraAdapter(
                pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if strict and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise APIError(400, exc.details(), param="lora_path") from None
            if strict and exc.code() == grpc.StatusCode.NOT_FOUND:  # no such folder on the worker
                raise APIError(404, exc.details(), param="lora_path", code="adapter_not_found") from None
            if strict:
                raise NoWorkerError(f"loading the adapter on {worker.address} failed: {exc.code().name}") from None
            log.warning(
                "loading adapter %s on %s failed (%s: %s); retried after its next load report",
                name,
                worker.address,
                exc.code().name,
                exc.details(),
            )
            return None

    async def _unload_on(self, worker: WorkerState, name: str) -> None:
        try:
            await self.channels.stub(worker.address).UnloadLoraAdapter(
                pb.UnloadLoraAdapterRequest(lora_name=name), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("unloading adapter %s on %s failed (%s)", name, worker.address, exc.code().name)
