"""`splitserve sidecar`: the OpenAI endpoint of one decode pod, behind an inference gateway.

    splitserve sidecar --decode 127.0.0.1:50051 --workers <prefill pool> --port 8200

The gateway's whole request pipeline (router/api/app.py: access, admission, prompts, dispatch,
streaming, usage, errors) with one decode candidate: this pod's worker. The EPP already chose
the pod; the sidecar only honours the choice.

    x-prefiller-host-port: P   -> the decode worker has P prefill and ship the KV (P must be a
                                  prefill worker of the pool this sidecar discovers: a client
                                  cannot point the pod anywhere else; otherwise 400, counted
                                  in splitserve_sidecar_refused_prefillers_total)
    no header                  -> the decode worker prefills itself

Without a named prefill worker the sidecar may tell its worker to pull the prompt's prefix from
another worker of the pool that holds more of it (placement step 4a, router/placement/placer.py),
when its index says so and pulling is estimated cheaper than computing: the same decision the
splitserve gateway makes for the worker it chose. The holder is always one of the pool this
sidecar discovers (`--workers`), never an address a request names. A sidecar without a pool
(no `--workers`) never pulls.

The decode worker still applies its conditional threshold against its exact cache, as behind
the splitserve gateway. A failed decode worker is not replaced (there is no other candidate):
its requests fail with 503, and the gateway's health checks take the pod out.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging

from prometheus_client import Counter

from splitserve.router import logctx
from splitserve.router.core import readiness
from splitserve.router.core.readiness import POLL_S
from splitserve.router.epp.endpoints import check_address
from splitserve.router.epp.extproc import PREFILLER
from splitserve.router.errors import NoWorkerError, error_body
from splitserve.router.placement.placer import Decision, PlacementRequest, Placer
from splitserve.router.placement.scorers import ScoringContext
from splitserve.router.router import Router, make_discovery

log = logging.getLogger("splitserve.sidecar")

PROBE_PATHS = ("/health", "/ready")

prefiller: contextvars.ContextVar[str] = contextvars.ContextVar("prefiller", default="")


class LocalPlacer(Placer):
    """Placement with one decode candidate; the prefill worker is the one the request names, and
    without one, a pull from a pool worker holding more of the prefix when it pays."""

    def __init__(self, placer: Placer, local: str):
        super().__init__(placer.config, placer.pool, placer.index, placer.rng)
        self.local = local

    async def place(self, request: PlacementRequest) -> Decision:
        worker, now = self.pool.workers.get(self.local), self.pool.clock()
        if self.local in request.exclude or worker is None or not worker.is_healthy(now):
            raise NoWorkerError(f"this pod's decode worker {self.local} is not healthy")
        if request.lora_workers is not None and self.local not in request.lora_workers:
            raise NoWorkerError(f"this pod's decode worker has no adapter {request.lora_name!r} loaded")
        hashes, named = request.hashes, prefiller.get()
        holders = []
        if not named and request.lora_name is None:
            others = request.exclude | {self.local}
            holders = [w for w in self.pool.prefill_workers() if w.address not in others]
        addresses = [self.local, *(w.address for w in holders)]
        matches = await self.index.match(addresses, hashes) if hashes else {}
        matched = matches.get(self.local, 0)
        uncached = max(request.num_tokens - matched * self.pool.block_size, 0)
        pull = None
        if holders and hashes:
            ctx = ScoringContext(request.num_tokens, len(hashes), matches, now, None, self.pool.block_size)
            pull = self._pull_from(ctx, holders, self.local, matched, now)
        return Decision(self.local, (named,) if named else (), matched, uncached, pull=pull)


class UnionDiscovery:
    """This pod's decode worker, always, plus whatever the pool's discovery reports."""

    def __init__(self, local: str, pool):
        self.local = local
        self.pool = pool

    async def run(self, on_change) -> None:
        async def report(addresses: set[str]) -> None:
            await on_change(addresses | {self.local})

        await report(set())
        await self.pool.run(report)


class PrefillerGate:
    """ASGI middleware, the sidecar's outermost: answers the probes, reads x-prefiller-host-port
    and refuses a prefill worker outside the pool.

    GET /health and /ready are answered here, not by the gateway app behind: the EPP probes every
    sidecar five times a second and the gateway's health check once, and through the app's
    middleware and routing a probe cost the sidecar about 1.4 ms of CPU, a third of an idle
    sidecar's time (bench/epp_overhead.py). The answers are the app's own (readiness.ready_answer).
    """

    def __init__(self, app, router: Router, refused: Counter):
        self.app, self.router, self.refused = app, router, refused

    async def __call__(self, scope, receive, send):
        is_http = scope["type"] == "http"
        if not is_http:
            return await self.app(scope, receive, send)
        if scope["method"] == "GET" and scope["path"] in PROBE_PATHS:
            return await self._probe(scope["path"], send)
        headers = dict(scope.get("headers") or [])
        named = headers.get(PREFILLER.encode(), b"").decode("latin-1").strip()
        if named and not await self._in_pool(named):
            self.refused.inc()
            log.warning("refused %s naming prefill worker %r, which is not in the pool", scope.get("path"), named)
            await _send_json(
                send,
                400,
                error_body(
                    400,
                    f"{PREFILLER} {named!r} is not a prefill worker of this pool; "
                    "allowed: one of the pool's prefill workers, or no header",
                    param=PREFILLER,
                    code="invalid_prefiller",
                ),
            )
            return
        token = prefiller.set(named)
        try:
            await self.app(scope, receive, send)
        finally:
            prefiller.reset(token)

    async def _probe(self, path: str, send) -> None:
        if path == "/health":
            return await _send_json(send, 200, {"status": "ok"})
        status, body = readiness.ready_answer(self.router)
        await _send_json(send, status, body, [(b"retry-after", b"1")] if status != 200 else [])

    async def _in_pool(self, address: str) -> bool:
        """A discovered prefill worker other than this pod's. A worker discovery listed whose role
        is not known yet (this sidecar started a moment ago and its probe has not answered, while
        the EPP, running longer, already picks it) is waited for up to gateway.worker_wait_s, as a
        request finding no decode worker is; an address discovery never listed is refused at once."""
        if address == self.router.placer.local:
            return False
        pool, clock = self.router.pool, self.router.pool.clock
        deadline = clock() + self.router.config.gateway.worker_wait_s
        while (worker := pool.workers.get(address)) is not None and not worker.role and clock() < deadline:
            await asyncio.sleep(POLL_S)
        return worker is not None and worker.can_prefill


async def _send_json(send, status: int, body: dict, extra_headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": data})


def build(config, local: str):
    """The sidecar's Router (its placer replaced) and its ASGI app."""
    from splitserve.router.api.app import create_app

    router = Router(config, discovery=UnionDiscovery(local, make_discovery(config.discovery)))
    router.placer = router.dispatcher.placer = LocalPlacer(router.placer, local)
    refused = Counter(
        "splitserve_sidecar_refused_prefillers",
        "Requests refused for naming a prefill worker outside the pool",
        registry=router.metrics.registry,
    )
    return router, PrefillerGate(create_app(router), router, refused)


def register(subparsers) -> None:
    from splitserve.router.main import add_discovery_args, add_router_args

    p = subparsers.add_parser("sidecar", help="OpenAI endpoint of one decode pod behind an inference gateway (P/D)")
    p.add_argument("--config", default=None, help="router config file (docs/router.md)")
    add_router_args(p)
    p.add_argument("--decode", required=True, help="this pod's decode worker, gRPC host:port")
    add_discovery_args(p, "prefill workers (the pool)")
    p.set_defaults(func=cmd_sidecar)


def cmd_sidecar(args) -> int:
    from splitserve.router.main import bind, config_from_args, url_host, uvicorn_server

    logctx.install()
    local = check_address(args.decode, "--decode")
    config = config_from_args(
        args,
        **{
            "discovery.workers": args.workers,
            "discovery.k8s_namespace": args.k8s_namespace,
            "discovery.k8s_services": args.k8s_services,
        },
    )
    router, app = build(config, local)
    sock = bind(config.gateway.host, config.gateway.port)
    print(
        f"splitserve sidecar: serving http://{url_host(config.gateway.host)}:{sock.getsockname()[1]}/v1 "
        f"for decode worker {local}",
        flush=True,
    )
    asyncio.run(uvicorn_server(app).serve(sockets=[sock]))
    return 0
