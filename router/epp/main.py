"""`splitserve epp`: the router's placement as a Gateway API Inference Extension Endpoint Picker.

    splitserve epp --workers 10.0.0.5:50051,10.0.0.6:50051,10.0.0.7:50051 --sidecar-port 8200
    splitserve epp --workers 127.0.0.1:50051,... --endpoint 127.0.0.1:50051=127.0.0.1:8201 ...
    splitserve epp --k8s-namespace llm --k8s-services m-prefill,m-decode --sidecar-port 8200

Serves Envoy's ext_proc API and gRPC health (`grpc.health.v1`, service "" and
"envoy.service.ext_proc.v3.ExternalProcessor": SERVING once a decode worker is healthy) on
--grpc-port (9002, GIE's default), and HTTP /health, /ready and /metrics on --health-port. The
workers come from the same discovery as `splitserve router` (a static list or EndpointSlices);
roles come from the workers themselves. Placement settings (scorer weights, disaggregation)
come from --config, the router's file (docs/router.md). Both ports bind --host, 127.0.0.1 by
default; --serve-tls-cert/--serve-tls-key serve ext_proc over TLS and --serve-tls-client-ca
admits only callers with a client certificate of that CA (the gateway). ext_proc is served once
a decode worker with a ready sidecar exists (a gateway failing open places requests until then).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, Gauge

from splitserve.platform.observability import tracing
from splitserve.router import logctx
from splitserve.router.config.file import load_config
from splitserve.router.core import readiness
from splitserve.router.epp.endpoints import EndpointMap
from splitserve.router.epp.extproc import ExternalProcessor, Metrics, add_to_server
from splitserve.router.epp.picker import Picker
from splitserve.router.epp.probes import EndpointProbe
from splitserve.router.main import bind, uvicorn_server

log = logging.getLogger("splitserve.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_POLL_S = 0.5
START_WAIT_S = 60.0


def register(subparsers) -> None:
    p = subparsers.add_parser("epp", help="the router's placement as a Gateway API Inference Extension endpoint picker")
    p.add_argument("--config", default=None, help="router config file: placement, index, discovery (docs/router.md)")
    p.add_argument("--model", default=None, help="the model the workers serve (seeds the block hashes)")
    p.add_argument("--served-model-name", default=None, help="comma-separated names clients use (default: --model)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--workers", default=None, help="comma-separated worker gRPC addresses host:port")
    p.add_argument("--k8s-namespace", default=None, help="discover workers from EndpointSlices in this namespace")
    p.add_argument("--k8s-services", default=None, help="comma-separated pool Service names")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="WORKER=SIDECAR",
        help="a decode worker's sidecar endpoint, e.g. 127.0.0.1:50051=127.0.0.1:8201 (repeatable)",
    )
    p.add_argument(
        "--sidecar-port",
        type=int,
        default=None,
        help="the sidecars listen on this port of their worker's host (the InferencePool's targetPort)",
    )
    p.add_argument("--redis-url", default=None, help="share the prefix index with other EPP or router replicas")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address of both ports (default 127.0.0.1; in a pod: 0.0.0.0 behind a NetworkPolicy)",
    )
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc + gRPC health port (default 9002)")
    p.add_argument("--health-port", type=int, default=9003, help="HTTP /health, /ready, /metrics (default 9003)")
    p.add_argument("--tls-cert", default=None, help="mTLS to the workers: this EPP's certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="mTLS to the workers: its private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="mTLS to the workers: the CA of the workers' certificates")
    p.add_argument("--serve-tls-cert", default=None, help="serve ext_proc over TLS with this certificate (PEM)")
    p.add_argument("--serve-tls-key", default=None, help="... and this private key (PEM)")
    p.add_argument(
        "--serve-tls-client-ca",
        default=None,
        help="... and admit only gateways whose client certificate this CA signed (mTLS)",
    )
    tracing.add_tracing_args(p)
    p.set_defaults(func=cmd_epp)


def config_from_args(args):
    overrides = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "gateway.served_model_names": args.served_model_name,
        "discovery.workers": args.workers,
        "discovery.k8s_namespace": args.k8s_namespace,
        "discovery.k8s_services": args.k8s_services,
        "discovery.tls_cert": args.tls_cert,
        "discovery.tls_key": args.tls_key,
        "discovery.tls_ca": args.tls_ca,
    }
    if args.redis_url:
        overrides.update({"index.backend": "redis", "index.redis_url": args.redis_url})
    return load_config(args.config, **overrides)


def cmd_epp(args) -> int:
    from splitserve.platform.errors import ConfigError

    logctx.install()
    tracing.configure(tracing.config_from_args("epp", args))
    endpoints = EndpointMap.parse(args.endpoint, args.sidecar_port)
    if not endpoints.pairs and endpoints.sidecar_port is None:
        raise ConfigError(
            "splitserve epp needs --sidecar-port or --endpoint: where the decode workers' sidecars listen"
        )
    if bool(args.serve_tls_cert) != bool(args.serve_tls_key):
        raise ConfigError("--serve-tls-cert and --serve-tls-key go together; allowed: both or neither")
    if args.serve_tls_client_ca and not args.serve_tls_cert:
        raise ConfigError("--serve-tls-client-ca needs --serve-tls-cert and --serve-tls-key (mTLS is TLS first)")
    config = config_from_args(args)
    health_sock = bind(args.host, args.health_port)
    asyncio.run(
        serve(
            config,
            endpoints,
            args.host,
            args.grpc_port,
            health_sock,
            (args.serve_tls_cert, args.serve_tls_key, args.serve_tls_client_ca) if args.serve_tls_cert else None,
        )
    )
    return 0


async def serve(config, endpoints: EndpointMap, host: str, grpc_port: int, health_sock, tls=None) -> None:
    """Run until SIGINT/SIGTERM: the router's watchers, the ext_proc server, the health server."""
    from splitserve.router.router import Router

    router = Router(config)
    metrics = Metrics(router.metrics.registry)
    # Envoy buffers a whole body (up to the gateway's max_body_bytes) into one message.
    size = config.gateway.max_body_bytes + (1 << 16)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size)])
    picker = Picker(router, endpoints)
    ready = Gauge(
        "splitserve_epp_endpoint_ready",
        "1 while the endpoint (a decode pod's sidecar) answers /ready, 0 while it does not",
        ["endpoint"],
        registry=router.metrics.registry,
    )
    picker.probe = probe = EndpointProbe(picker.all_endpoints, gauge=ready)
    add_to_server(server, ExternalProcessor(picker, metrics))
    status = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    address = f"{host}:{grpc_port}"
    port = server.add_secure_port(address, _server_credentials(*tls)) if tls else server.add_insecure_port(address)
    await router.start()
    probe.start()
    await _until_pickable(router, picker)
    await server.start()
    print(
        f"splitserve epp: ext_proc on {host}:{port}, health on http://{host}:{health_sock.getsockname()[1]}/ready",
        flush=True,
    )
    http = uvicorn_server(health_app(router))
    watch = asyncio.create_task(_follow_readiness(router, status), name="epp readiness")
    try:
        await http.serve(sockets=[health_sock])
    finally:
        watch.cancel()
        await server.stop(5)
        await probe.stop()
        picker.close()
        await router.stop()


async def _until_pickable(router, picker: Picker) -> None:
    """Hold ext_proc back until a decode worker is healthy and its endpoint ready (at most
    START_WAIT_S): until then a gateway failing open places requests itself, where an EPP that
    answered would refuse them with 503."""
    deadline = asyncio.get_running_loop().time() + START_WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        if router.is_ready and any(picker.probe.is_ready(e) for e in picker.all_endpoints()):
            return
        await asyncio.sleep(0.1)
    log.warning("no decode worker with a ready endpoint after %.0f s; serving ext_proc anyway", START_WAIT_S)


async def _follow_readiness(router, status) -> None:
    while True:
        serving = (
            health_pb2.HealthCheckResponse.SERVING if router.is_ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", EXT_PROC_SERVICE):
            await status.set(service, serving)
        await asyncio.sleep(HEALTH_POLL_S)


def health_app(router) -> FastAPI:
    app = FastAPI(title="splitserve epp", openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def healthz():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        status, body = readiness.ready_answer(router)
        return JSONResponse(body, status, headers={"Retry-After": "1"} if status != 200 else None)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(router.pool), media_type=CONTENT_TYPE_LATEST)

    return app


def _server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for the gateway's ext_proc calls; with `client_ca`, mutual: a caller without a client
    certificate that CA signed is refused in the handshake, before any message is read."""
    with open(key, "rb") as k, open(cert, "rb") as c:
        pair = [(k.read(), c.read())]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    with open(client_ca, "rb") as ca:
        return grpc.ssl_server_credentials(pair, root_certificates=ca.read(), require_client_auth=True)
