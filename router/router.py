"""The router: the pieces assembled, and their lifecycle.

    discovery -> addresses -> one WorkerWatcher each -> WorkerPool + PrefixIndex
    gateway -> prompts (tokenize) -> Dispatcher -> Placer (pool + index) -> workers

`start()` starts discovery (which starts the watchers); `stop()` cancels them and closes the
channels and the index. Everything runs on one asyncio loop (uvicorn's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.tokenizer import Tokenizer, load_tokenizer
from splitserve.platform.wire.grpc_channels import ChannelPool
from splitserve.platform.wire.grpc_tls import tls_from
from splitserve.router.config import DiscoveryConfig, IndexConfig, RouterConfig
from splitserve.router.core import readiness
from splitserve.router.core.dispatch import Dispatcher
from splitserve.router.core.hold import ColdStartHold
from splitserve.router.metrics import RouterMetrics
from splitserve.router.placement import adapter_sync
from splitserve.router.placement.adapters import AdapterCatalog
from splitserve.router.placement.discovery import Discovery, StaticDiscovery
from splitserve.router.placement.index import InMemoryPrefixIndex, PrefixIndex
from splitserve.router.placement.placer import Placer
from splitserve.router.placement.pool import WorkerPool
from splitserve.router.placement.watcher import CHANNEL_OPTIONS, WorkerWatcher

log = logging.getLogger(__name__)
FORGET_TIMEOUT_S = 5.0


def make_index(config: IndexConfig) -> PrefixIndex:
    if config.backend == "redis":
        from splitserve.router.placement.index_redis import RedisPrefixIndex
        from splitserve.router.placement.index_resilient import ResilientIndex

        return ResilientIndex(
            RedisPrefixIndex(
                config.redis_url, config.key_prefix, config.speculative_ttl_s, config.max_blocks_per_worker
            )
        )
    return InMemoryPrefixIndex(config.speculative_ttl_s, config.max_blocks_per_worker)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer | None = None,
        index: PrefixIndex | None = None,
        discovery: Discovery | None = None,
        rng: random.Random | None = None,
    ):
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.hasher = BlockHasher(config.model, config.block_size)
        self.pool = WorkerPool(config.model, config.block_size)
        self.index = index if index is not None else make_index(config.index)
        self.discovery = discovery if discovery is not None else make_discovery(config.discovery)
        d = config.discovery
        self.channels = ChannelPool(tls_from(d.tls_cert, d.tls_key, d.tls_ca, d.tls_server_name), CHANNEL_OPTIONS)
        self.metrics = RouterMetrics()
        self.adapters = AdapterCatalog(self.pool, self.channels)
        if config.adapters.file:  # declared adapters (router/placement/adapter_sync.py); a bad file stops the start
            self.adapters.declare(adapter_sync.read_declared(config.adapters.file))
        self._adapter_tasks: list[asyncio.Task] = []
        self._reconciles: dict[str, asyncio.Task] = {}
        self.placer = Placer(config.placement, self.pool, self.index, rng)
        self.dispatcher = Dispatcher(
            self.pool,
            self.placer,
            self.hasher,
            self.tokenizer,
            self.channels,
            config.gateway.max_attempts,
            self.metrics,
            ColdStartHold(config.gateway.cold_start_hold_s, config.gateway.cold_start_max_held, self.metrics.held),
            config.gateway.worker_wait_s,
            self.adapters,
        )
        self._watchers: dict[str, asyncio.Task] = {}
        self._discovery_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._discovery_task = asyncio.create_task(self.discovery.run(self._on_workers), name="discovery")
        a = self.config.adapters
        if a.file:
            self._adapter_tasks.append(
                asyncio.create_task(adapter_sync.follow_file(self.adapters, a), name="adapters file")
            )
        if a.report_configmap:
            self._adapter_tasks.append(
                asyncio.create_task(adapter_sync.report_loop(self.pool, a), name="adapters report")
            )

    async def _on_workers(self, addresses: set[str]) -> None:
        for address in sorted(addresses - set(self._watchers)):
            self.pool.add(address)
            watcher = WorkerWatcher(
                address,
                self.pool,
                self.index,
                self.channels,
                self.config.discovery,
                on_down=self.dispatcher.worker_down,
                on_load=self._on_load,
            )
            self._watchers[address] = asyncio.create_task(watcher.run(), name=f"watch {address}")
            log.info("watching worker %s", address)
        for address in sorted(set(self._watchers) - addresses):
            await self._forget(address)

    def _on_load(self, address: str) -> None:
        """A load report came: bring the worker's adapters in line (one reconcile at a time)."""
        task = self._reconciles.get(address)
        worker = self.pool.workers.get(address)
        if worker is None or (task is not None and not task.done()):
            return
        if not self.adapters.is_pending(worker):
            return
        self._reconciles[address] = asyncio.create_task(self.adapters.reconcile(worker), name=f"adapters {address}")

    async def _forget(self, address: str) -> None:
        task = self._watchers.pop(address)
        task.cancel()
        # Bounded: a watcher that does not end must not freeze the worker set (and with it a
        # planner tick waiting here); it is left cancelled and logged.
        done, _ = await asyncio.wait({task}, timeout=FORGET_TIMEOUT_S)
        if not done:
            log.warning("the watcher of worker %s did not stop within %.0f s; dropping it", address, FORGET_TIMEOUT_S)
        else:
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
        self.dispatcher.worker_down(address)
        self.pool.remove(address)
        await self.index.clear(address)
        await self.channels.drop(address)
        log.info("worker %s left", address)

    async def stop(self) -> None:
        tasks = [
            t
            for t in (self._discovery_task, *self._watchers.values(), *self._reconciles.values(), *self._adapter_tasks)
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._watchers.clear()
        await self.channels.close()
        await self.index.close()

    @property
    def is_ready(self) -> bool:
        """The router can serve its model (router/core/readiness.py)."""
        return not readiness.unready_reason(self)

    async def wait_ready(self, timeout_s: float = 60.0, num_decode: int = 1, num_prefill: int = 0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (
            self.pool.num_healthy() < num_decode or self.pool.num_healthy(lambda w: w.role == "prefill") < num_prefill
        ):
            if loop.time() > deadline:
                raise TimeoutError(
                    f"router: fewer than {num_decode} decode / {num_prefill} prefill workers "
                    f"healthy after {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.05)


def make_discovery(config: DiscoveryConfig) -> Discovery:
    """EndpointSlices of the pool Services when the config names them, else the static list."""
    if config.k8s_services:
        from splitserve.router.placement.discovery_k8s import EndpointSliceDiscovery, KubernetesSliceSource

        return EndpointSliceDiscovery(
            KubernetesSliceSource(config.k8s_namespace), config.k8s_services, config.k8s_port_name
        )
    return StaticDiscovery(config.workers)
