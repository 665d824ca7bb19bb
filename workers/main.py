"""`splitserve worker`: one process = one engine behind the Worker gRPC service.

    splitserve worker --role prefill|decode|both --model smollm2-135m --grpc-port 50051 \
        --metrics-port 9090 --kv-transport ucx|tcp --kv-port 13337

Lifecycle: load the model, warm it up with one tiny request, start the KV receiver (decode
roles), the gRPC server, the health/metrics port; /ready turns 200. On SIGTERM (or SIGINT):
/ready turns 503, new requests get UNAVAILABLE, requests in flight finish within
--drain-grace seconds, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.kv.cache import bytes_per_block
from splitserve.platform.observability import tracing
from splitserve.platform.parallel.agent import run_node
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.settings import worker_args
from splitserve.platform.settings.worker_args import WorkerArgs
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire.grpc_tls import server_credentials, tls_from
from splitserve.workers.config import WorkerConfig
from splitserve.workers.decode import RemotePrefill
from splitserve.workers.events import EventHub
from splitserve.workers.grpc_guard import add_worker_servicer
from splitserve.workers.http import HealthServer
from splitserve.workers.kv_pull import KVPuller
from splitserve.workers.metrics import WorkerMetrics
from splitserve.workers.servicer import WorkerService, publish_load
from splitserve.workers.transfer import make_receiver, make_sender
from splitserve.workers.transfer.auth import load_key
from splitserve.workers.transfer.base import KVLayout
from splitserve.workers.transfer.cuda_ipc import CudaIpcBackend, choose_path

log = logging.getLogger("splitserve.worker")


def register(subparsers) -> None:
    p = subparsers.add_parser("worker", help="run a prefill / decode / colocated gRPC worker")
    worker_args.add_arguments(p)  # every flag: platform/settings/worker_args.py
    tracing.add_tracing_args(p)
    p.set_defaults(func=cmd_worker)


def trace_role(role: str) -> str:
    """The tracing role (service.name splitserve-<role>) of a worker role."""
    return {"both": "worker"}.get(role, role)


def cmd_worker(args) -> int:
    settings = WorkerArgs.from_namespace(args)
    if settings.node_rank > 0:  # another node of a tensor-parallel group: its ranks, no server
        return run_node(settings.engine_config())
    config = WorkerConfig.from_args(settings)
    # Before the model loads: a bad value fails fast.
    tracing.configure(tracing.config_from_args(trace_role(settings.role), args))
    engine = LLMEngine(settings.engine_config())
    return asyncio.run(Worker(config, engine).run())  # run() shuts the tracer down, exporting what is buffered


def kv_layout(engine: LLMEngine) -> KVLayout:
    m = engine.model_config
    return KVLayout(
        model_id=m.model_id,
        dtype=engine.kv_cache_dtype,
        block_size=engine.config.cache.block_size,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        weights=engine.quantization,
    )


def kv_state(engine: LLMEngine) -> dict:
    """The block pool as /debug/kv reports it (runs on the engine thread)."""
    try:
        engine.kv.check_invariants()
        error = ""
    except AssertionError as exc:
        error = str(exc) or "invariant violated"
    return dict(
        num_blocks=engine.pool.num_blocks,
        num_free_blocks=engine.pool.num_free_blocks,
        num_cached_blocks=engine.pool.num_cached_blocks,  # hashed prefix blocks, in use or evictable
        num_requests=engine.scheduler.num_unfinished,
        num_requests_holding_blocks=engine.kv.num_requests,
        groups=engine.kv.group_usage(),  # per KV group (platform/kv/groups.py): one for most models
        invariants_ok=not error,
        error=error,
    )


def kv_tier_report(engine: LLMEngine) -> tuple:
    """(the second tier's stats or None, bytes of the prefix-cache blocks in the cache) for the metrics
    (plain counters: read from any thread)."""
    per_block = (
        engine.kv_tier.block_bytes
        if engine.kv_tier is not None
        else bytes_per_block(
            engine.model_config,
            engine.config.cache.block_size,
            engine.kv_dtype,
            None if engine.kv_layout.is_single else engine.kv_layout,  # a block of one KV group's layers
        )
    )
    return engine.kv_tier.stats if engine.kv_tier is not None else None, engine.pool.num_cached_blocks * per_block


def warn_if_insecure(cfg: WorkerConfig, logger: logging.Logger) -> None:
    """A worker started by hand without a secret or certificates says so, once, loudly (the
    operator and `splitserve up` always pass both; the metrics splitserve_kv_auth_enabled and
    splitserve_grpc_tls_enabled say it too)."""
    if not cfg.kv_secret_file and cfg.role != "prefill":
        logger.warning(
            "INSECURE: no --kv-secret-file: this %s worker accepts KV blocks from anyone who can reach "
            "port %d (splitserve_kv_auth_enabled 0); give every worker of the service the same secret "
            "file, e.g. `openssl rand -hex 32 > kv-secret`",
            cfg.role,
            cfg.kv_port,
        )
    elif not cfg.kv_secret_file:
        logger.warning(
            "INSECURE: no --kv-secret-file: this prefill worker cannot prove itself to decode workers "
            "that require KV authentication, and sends to any that do not (splitserve_kv_auth_enabled 0)"
        )
    if not cfg.tls_cert:
        logger.warning(
            "INSECURE: no --tls-cert/--tls-key/--tls-ca: the worker gRPC API on port %d is plaintext and "
            "accepts any caller (splitserve_grpc_tls_enabled 0)",
            cfg.grpc_port,
        )


class Worker:
    """One worker's parts, built by `_build` (metrics, KV transport, event hub, async engine,
    remote prefill and pulls, the gRPC service) and `_start` (gRPC server, health port, load
    reports, warm-up), and run by `run` under one AsyncExitStack: each part registers its close
    as it is made, so whatever was built is closed once, in reverse order, however run() ends."""

    def __init__(self, config: WorkerConfig, engine: LLMEngine):
        self.config = config
        self.llm = engine
        self.ready = False
        self.stopping = asyncio.Event()
        self.fatal: Exception | None = None  # why the engine can never step again, if it cannot
        self.engine: AsyncEngine | None = None  # set by run(); its `load` is the queue depth
        self.grpc_port = self.metrics_port = 0  # the ports bound (port 0: the kernel's pick), once ready
        self.kv_address = ""  # what KV senders dial (the receiver's advertised address), once built

    async def run(self, handle_signals: bool = True) -> int:
        """Serve until SIGTERM/SIGINT (or `stopping` is set by the owner when `handle_signals` is
        False, as in a Ray Serve replica, whose event loop is not the main thread's)."""
        async with contextlib.AsyncExitStack() as parts:
            parts.callback(tracing.tracer().shutdown)  # last: export the spans still buffered
            parts.callback(self._shutdown_engine)  # after every part that calls into the engine
            service, tls = await self._build(parts)
            health_servicer = await self._start(service, tls, parts)
            self._announce(handle_signals)
            await self.stopping.wait()
            await self._drain(service, health_servicer)
        if self.fatal is not None:  # the engine can never step again: exit non-zero, so it is restarted
            log.error("worker stopped: %s", self.fatal)
            return 1
        return 0

    def _on_fatal(self, loop: asyncio.AbstractEventLoop, exc: Exception) -> None:
        """The engine thread's report that the engine is gone (a tensor-parallel rank failed): stop."""
        self.fatal = exc
        loop.call_soon_threadsafe(self.stopping.set)

    async def _build(self, parts: contextlib.AsyncExitStack) -> tuple[WorkerService, object]:
        """Every part but the servers, each registered with `parts`; the service and the TLS files."""
        cfg = self.config
        layout = kv_layout(self.llm)
        metrics = WorkerMetrics(cfg.role, self.llm.config.model)
        metrics.cache_info.labels(
            block_size=str(layout.block_size), num_gpu_blocks=str(self.llm.pool.num_blocks), role=cfg.role
        ).set(1)
        auth_key = load_key(cfg.kv_secret_file) if cfg.kv_secret_file else None
        metrics.kv_auth_enabled.set(1 if auth_key else 0)
        metrics.grpc_tls_enabled.set(1 if cfg.tls_cert else 0)
        warn_if_insecure(cfg, log)
        receiver, sender = await self._transport(auth_key, metrics, parts)
        self.kv_address = receiver.identity if receiver is not None else ""
        info = pb.WorkerInfo(
            worker_id=uuid.uuid4().hex,
            role=cfg.role,
            model_id=layout.model_id,
            layout=pb.KVLayout(**layout.to_dict()),
            kv_address=self.kv_address,
            num_total_blocks=self.llm.pool.num_blocks,
        )
        hub = EventHub(asyncio.get_running_loop(), info)
        engine = self.engine = AsyncEngine(self.llm, on_kv_events=hub.publish)
        engine.on_fatal = functools.partial(self._on_fatal, asyncio.get_running_loop())
        tls = tls_from(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        remote = puller = None
        if receiver is not None:
            deadline, address = cfg.transfer_deadline_s, self.kv_address
            remote = RemotePrefill(engine, receiver, layout, deadline, metrics, kv_address=address, tls=tls)
            parts.push_async_callback(remote.stubs.close)
        if receiver is not None and cfg.kv_pull:
            puller = KVPuller(
                engine, receiver, layout, cfg.transfer_deadline_s, cfg.max_pull_blocks, metrics, self.kv_address, tls
            )
            parts.push_async_callback(puller.close)
        return WorkerService(cfg, engine, hub, remote, sender, layout, metrics, puller), tls

    async def _transport(self, auth_key: bytes | None, metrics: WorkerMetrics, parts: contextlib.AsyncExitStack):
        """The KV receiver (decode roles; started, so its address is known) and sender (prefill
        roles), each with its CUDA IPC backend when the path takes one; None for a role without."""
        cfg = self.config
        path = choose_path(cfg.kv_transport, self.llm.device.type == "cuda", auth_key is not None)
        log.info("KV path: %s%s (%s)", path.wire, " + CUDA IPC" if path.ipc else "", path.reason)
        metrics.kv_path_info.labels(transport=path.wire, cuda_ipc=str(path.ipc).lower(), reason=path.reason).set(1)
        receiver = sender = None
        receive_ipc = path.ipc and self.llm.tensor_parallel_size == 1
        if path.ipc and not receive_ipc:
            log.info("KV path: no CUDA IPC into this worker's cache (--tensor-parallel-size > 1: KV lands via rank 0)")
        if cfg.role != "prefill":
            receiver = make_receiver(
                path.wire,
                cfg.host,
                cfg.kv_port,
                auth_key=auth_key,
                on_auth_failure=metrics.kv_auth_failures.inc,
                # a rank's cache holds its heads only: under TP the KV lands through rank 0 (kv_parallel.py)
                ipc=(self.llm.kv_connector.kv_caches, CudaIpcBackend()) if receive_ipc else None,
                advertise_host=cfg.advertise_host,  # the KV handshake binds proofs to what senders dial
            )
            await receiver.start()
            parts.push_async_callback(receiver.close)
        if cfg.role != "decode":
            sender = make_sender(path.wire, auth_key=auth_key, ipc_backend=CudaIpcBackend() if path.ipc else None)
            parts.push_async_callback(sender.close)
        return receiver, sender

    async def _start(self, service: WorkerService, tls, parts: contextlib.AsyncExitStack):
        """The gRPC server, the health/metrics port and the load reports, registered with `parts`;
        then the warm-up, and the health service says SERVING. Returns the health servicer."""
        engine, metrics = self.engine, service.metrics
        server, health_servicer, grpc_port = await self._start_grpc(service, tls)
        parts.push_async_callback(server.stop, 1.0)
        http = HealthServer(
            self.config.host,
            self.config.metrics_port,
            lambda: self._readiness(service),
            lambda: metrics.render(engine.load, kv_tier_report(self.llm)),
            debug_kv=lambda: engine.call(kv_state),
            debug_request=service.records.get,
        )
        await http.start()
        parts.push_async_callback(http.close)
        load_task = asyncio.create_task(publish_load(service, self.config.load_interval_s))
        parts.callback(load_task.cancel)
        await self._warm_up(engine)
        self.grpc_port, self.metrics_port = grpc_port, http.port
        self.ready = True
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return health_servicer

    def _announce(self, handle_signals: bool) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if handle_signals else ():
            loop.add_signal_handler(sig, self.stopping.set)
        # The ports bound: with port 0 the kernel picks them, and the READY line tells a launcher
        # (launch/up.py) which, so no port is probed free and then taken by someone else.
        log.info(
            "worker %s ready: grpc %s:%d, metrics %d, kv %s",
            cfg.role,
            cfg.host,
            self.grpc_port,
            self.metrics_port,
            self.kv_address or "-",
        )
        print(f"READY grpc={cfg.host}:{self.grpc_port} metrics={self.metrics_port} kv={self.kv_address}", flush=True)

    def _shutdown_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    async def _start_grpc(self, service: WorkerService, tls):
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)])
        # malformed bytes: INVALID_ARGUMENT; a caller of the wrong role: PERMISSION_DENIED (workers/grpc_guard.py)
        add_worker_servicer(service, server, check_peer_roles=self.config.tls_check_peer_roles)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if tls is None:
            port = server.add_insecure_port(f"{self.config.host}:{self.config.grpc_port}")
        else:  # mutual TLS: a caller without a certificate from our CA fails the handshake
            port = server.add_secure_port(f"{self.config.host}:{self.config.grpc_port}", server_credentials(tls))
        await server.start()
        return server, health_servicer, port

    async def _warm_up(self, engine: AsyncEngine) -> None:
        async for _ in engine.generate(
            prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=2), req_id="warmup"
        ):
            pass

    def _readiness(self, service: WorkerService) -> tuple[bool, str]:
        if service.draining:
            return False, "draining"
        return (True, "ready") if self.ready else (False, "loading")

    async def _drain(self, service: WorkerService, health_servicer) -> None:
        service.draining = True
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: %d requests in flight, grace %.0f s", service.num_inflight, self.config.drain_grace_s)
        try:
            await asyncio.wait_for(service.idle.wait(), timeout=self.config.drain_grace_s)
        except TimeoutError:
            log.warning("drain grace expired with %d requests in flight; aborting them", service.num_inflight)
