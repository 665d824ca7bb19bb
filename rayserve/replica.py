"""A worker pool as a Ray Serve deployment: each replica runs one `Worker` (workers/main.py) —
the same engine, gRPC service, KV transport and drain as `splitserve worker`.

The router does not call replicas through Serve handles; it dials their gRPC address directly
(prefix-aware placement) and the KV blocks go from prefill to decode replica over the configured
transport (UCX or TCP). So a replica only has to make itself known and report its load:

- on start it picks free ports, serves, and heartbeats `{address, role, actor_name, ...}` to the
  registry deployment (rayserve/registry.py) every `HEARTBEAT_S` through a DeploymentHandle —
  the registry and this module know each other only by the names in the app's args;
- `record_autoscaling_stats()` reports the engine's waiting+running requests, which drives the
  pool's replica count (rayserve/autoscale.py);
- `check_health()` fails once the worker task has ended, so Serve replaces the replica;
- with `tensor_parallel_size` N the replica runs in the first of its N placement-group bundles and
  its engine starts the other ranks as child processes (on CUDA after making the bundles' GPUs
  visible, rayserve/placement.py);
- on a graceful stop (`__del__`, downscaling or `serve shutdown`) it unregisters, then drains as
  on SIGTERM: new requests get UNAVAILABLE (the router retries elsewhere), in-flight ones finish.

`build_pool(args)` is the Serve application builder named in the rendered config
(rayserve/config.py `render`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ray import serve

from splitserve.rayserve.autoscale import QUEUE_DEPTH
from splitserve.workers.config import WorkerConfig

log = logging.getLogger("splitserve.worker.ray")

HEARTBEAT_S = 1.0
READY_TIMEOUT_S = 600.0


class WorkerReplica:
    async def __init__(
        self,
        role: str,
        model: str,
        kv_transport: str,
        engine: dict,
        registry: dict,
        host: str = "",
        security: dict | None = None,
        tracing_args: dict | None = None,
    ):
        """`host`: the address to bind and advertise; "" binds all interfaces and advertises the
        replica's Ray node IP (what other nodes of the cluster reach). `security`: the worker's
        tls_cert/tls_key/tls_ca/kv_secret_file (rayserve/config.py SecuritySettings; {}: none).
        `tracing_args`: {"endpoint", "sample_ratio"} of its span export (platform/observability/tracing.py)."""
        import ray

        from splitserve.platform.engine.llm_engine import LLMEngine
        from splitserve.platform.observability import tracing
        from splitserve.rayserve import placement
        from splitserve.rayserve.config import replica_settings
        from splitserve.workers.main import Worker, trace_role

        advertise = "" if host else ray.util.get_node_ip_address()
        settings = replica_settings(role, model, kv_transport, engine, host, advertise, security or {})
        if settings.tensor_parallel_size > 1 and settings.device.startswith("cuda"):
            placement.claim_bundle_gpus(settings.tensor_parallel_size)  # the ranks see their bundles' GPUs
        t = tracing_args or {}
        tracing.configure(tracing.config_from(trace_role(role), t.get("endpoint") or None, t.get("sample_ratio")))
        self.worker = Worker(WorkerConfig.from_args(settings), LLMEngine(settings.engine_config()))
        self.task = asyncio.create_task(self.worker.run(handle_signals=False), name=f"{role} worker")
        await self._wait_ready()
        self.info = {
            "address": f"{advertise or settings.host}:{self.worker.grpc_port}",
            "role": role,
            "metrics": f"{advertise or settings.host}:{self.worker.metrics_port}",
            "actor_name": ray.get_runtime_context().get_actor_name() or "",
            "replica_id": serve.get_replica_context().replica_id.unique_id,
        }
        self.registry = registry
        self.heartbeat = asyncio.create_task(self._heartbeat(), name="registry heartbeat")
        log.info("%s replica serving on %s", role, self.info["address"])

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while not self.worker.ready:
            if self.task.done():
                self.task.result()  # raises the worker's own error
                raise RuntimeError("the worker stopped before it was ready")
            if loop.time() > deadline:
                raise TimeoutError(f"the worker was not ready after {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)

    async def _heartbeat(self) -> None:
        handle = None
        while True:
            try:
                if handle is None:
                    handle = serve.get_deployment_handle(self.registry["deployment"], self.registry["app"])
                await handle.register.remote(self.info)
            except Exception as exc:  # the registry is not deployed yet, or restarting: keep trying
                log.debug("registry heartbeat failed: %s", exc)
                handle = None
            await asyncio.sleep(HEARTBEAT_S)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        load = self.worker.engine.load
        return {QUEUE_DEPTH: float(load.num_waiting + load.num_running)}

    def address(self) -> dict:
        return self.info

    def check_health(self) -> None:
        if self.task.done():
            raise RuntimeError(f"the {self.info['role']} worker stopped")

    async def __del__(self) -> None:
        self.heartbeat.cancel()
        with contextlib.suppress(Exception):
            handle = serve.get_deployment_handle(self.registry["deployment"], self.registry["app"])
            await asyncio.wait_for(handle.unregister.remote(self.info["address"]), 5)
        self.worker.stopping.set()
        with contextlib.suppress(Exception):
            await self.task


def build_pool(args: dict):
    """Serve application builder: one pool, the deployment named for its role. Replicas, autoscaling
    and actor options come from the Serve config's `deployments:` overrides (rayserve/config.py `render`)."""
    deployment = serve.deployment(WorkerReplica).options(name=args["role"])
    return deployment.bind(
        args["role"],
        args["model"],
        args["kv_transport"],
        args["engine"],
        args["registry"],
        args.get("host", ""),
        args.get("security") or {},
        args.get("tracing") or {},
    )
