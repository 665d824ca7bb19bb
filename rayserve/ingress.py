"""The gateway and router as the Ray Serve ingress deployment.

`Gateway` is the same FastAPI app and `Router` as `splitserve router` (router/api/app.py,
router/router.py), served by Serve's HTTP proxy; only discovery differs: `RayDiscovery` reads
the worker registry deployment, which lives in the same Serve application. The router's lifespan
(start/stop of discovery, watchers, channels) runs as the ingress replica starts and stops.
`StartGate` (rayserve/startgate.py) sits in front: while the replicas come up, /v1/models
answers 503 as /ready does, not 200 with an empty list.

`build_gateway(args)` is the Serve application builder named in the rendered config
(rayserve/config.py `render`).
"""

from __future__ import annotations

from ray import serve

from splitserve.rayserve.discovery import RayDiscovery
from splitserve.rayserve.registry import WorkerRegistry
from splitserve.router.config.file import from_dict


@serve.ingress()
class Gateway:
    def __init__(self, router: dict, registry, tracing_args: dict | None = None):
        from splitserve.platform.observability import tracing
        from splitserve.router import logctx
        from splitserve.router.router import Router

        logctx.install()
        t = tracing_args or {}  # the gateway's span export, as the replicas' (rayserve/config.py)
        tracing.configure(tracing.config_from("router", t.get("endpoint") or None, t.get("sample_ratio")))
        self.registry = registry
        self.router = Router(from_dict(router), discovery=RayDiscovery(lambda: registry.workers.remote()))

    def __serve_build_asgi_app__(self):
        from splitserve.rayserve.startgate import StartGate
        from splitserve.router.api.app import create_app

        return StartGate(create_app(self.router), self._unready_reason)

    def _unready_reason(self) -> str:
        if self.router.is_ready:
            return ""
        return "the router knows no healthy decode worker yet (the Ray deployments are starting)"


def build_gateway(args: dict):
    """Serve application builder: the ingress and the worker registry it reads."""
    registry = (
        serve.deployment(WorkerRegistry)
        .options(name=args["registry"]["deployment"], num_replicas=1, ray_actor_options={"num_cpus": 0})
        .bind()
    )
    gateway = serve.deployment(Gateway).options(
        name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000
    )
    return gateway.bind(args["router"], registry, args.get("tracing") or {})
