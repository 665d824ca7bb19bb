"""`splitserve router`: the OpenAI gateway and KV-cache-aware router, in front of workers.

    splitserve router --workers 127.0.0.1:50051,127.0.0.1:50052 --port 8000
    splitserve router --config router.yaml          # the file format is in docs/router.md
    splitserve router --k8s-namespace llm --k8s-services m-prefill,m-decode

Flags override the config file. Roles come from the workers themselves.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from prometheus_client import start_http_server

from splitserve.platform.errors import ConfigError
from splitserve.platform.observability import tracing
from splitserve.router import logctx
from splitserve.router.config import RouterConfig
from splitserve.router.config.file import load_config
from splitserve.router.flow import cli as flow_cli

log = logging.getLogger("splitserve.router")


def register(subparsers) -> None:
    p = subparsers.add_parser("router", help="run the OpenAI gateway + KV-aware router")
    p.add_argument("--config", default=None, help="YAML/JSON router config (docs/router.md)")
    add_router_args(p)
    add_discovery_args(p, "workers")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve /metrics on this port (the gateway port always serves it)",
    )
    p.set_defaults(func=cmd_router)


def add_discovery_args(p, pool: str) -> None:
    """Where the `pool`'s workers are: a static list, or the EndpointSlices of its Services."""
    p.add_argument("--workers", default=None, help=f"comma-separated {pool} gRPC addresses host:port")
    p.add_argument("--k8s-namespace", default=None, help=f"discover the {pool} from EndpointSlices in this namespace")
    p.add_argument("--k8s-services", default=None, help=f"comma-separated Service names of the {pool}")


def add_router_args(p) -> None:
    """Flags `router` and `up` share."""
    p.add_argument("--host", default=None, help="gateway address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gateway port (default 8000; 0 picks a free one)")
    p.add_argument("--model", default=None, help="the model the workers serve (seeds the block hashes)")
    p.add_argument("--served-model-name", default=None, help="comma-separated names clients use (default: --model)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--api-key", action="append", default=None, help="accepted API key (repeatable)")
    p.add_argument("--rate-limit", type=float, default=None, help="requests/s per API key (0: off)")
    p.add_argument("--redis-url", default=None, help="share the prefix index and rate limits through Redis")
    p.add_argument("--tls-cert", default=None, help="mTLS to the workers: this router's certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="mTLS to the workers: this router's private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="mTLS to the workers: the CA that signed the workers' certificates")
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="YAML key file: hashed keys, model scopes, rpm/tpm/monthly "
        "token limits (reloaded on change; see router/tenancy/)",
    )
    p.add_argument(
        "--lora-roots",
        default=None,
        help="comma-separated folders runtime LoRA loads may read from "
        "(a lora_path elsewhere is 403; with API keys and no roots, runtime loads are off)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=("hermes", "json"),
        help="how tool_choice=auto answers are read (default hermes)",
    )
    tracing.add_tracing_args(p)
    flow_cli.add_args(p)


def config_from_args(args, **extra) -> RouterConfig:
    overrides = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "gateway.host": args.host,
        "gateway.port": args.port,
        "gateway.served_model_names": args.served_model_name,
        "gateway.api_keys": args.api_key,
        "gateway.rate_per_s": args.rate_limit,
        "gateway.api_keys_file": getattr(args, "api_keys_file", None),
        "discovery.tls_cert": getattr(args, "tls_cert", None),
        "discovery.tls_key": getattr(args, "tls_key", None),
        "discovery.tls_ca": getattr(args, "tls_ca", None),
        "gateway.tool_call_parser": args.tool_call_parser,
        "gateway.lora_roots": getattr(args, "lora_roots", None),
        **flow_cli.overrides(args),
        **extra,
    }
    if args.redis_url:
        overrides.update(
            {
                "index.backend": "redis",
                "index.redis_url": args.redis_url,
                "gateway.rate_limit_redis_url": args.redis_url,
            }
        )
    return load_config(getattr(args, "config", None), **overrides)


def cmd_router(args) -> int:
    logctx.install()
    tracing.configure(tracing.config_from_args("router", args))
    config = config_from_args(
        args,
        **{
            "discovery.workers": args.workers,
            "discovery.k8s_namespace": args.k8s_namespace,
            "discovery.k8s_services": args.k8s_services,
        },
    )
    from splitserve.router.router import Router

    router = Router(config)
    sock = bind(config.gateway.host, config.gateway.port)
    if args.metrics_port:
        # A scrape port apart from the gateway, as the operator's ServiceMonitor expects.
        start_http_server(args.metrics_port, addr=config.gateway.host, registry=router.metrics.registry)
    print(f"splitserve router: serving http://{url_host(config.gateway.host)}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        asyncio.run(serve(router, sock))
    finally:
        tracing.tracer().shutdown()  # export the spans still buffered
    return 0


def bind(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound and listening before the app serves (so port 0
    resolves, and a port in use fails before any model is loaded)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pass another --port (0 picks a free one)"
        ) from None
    # Accepted connections inherit this; without it each response's second write waits out the
    # client's delayed ACK (+40 ms per request, measured).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(2048)  # early clients wait in the backlog instead of being refused
    sock.set_inheritable(True)
    return sock


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; that would kill `splitserve
    up` before it stops its workers. Here a signal means "stop cleanly and return"."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def uvicorn_server(app, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    return _Server(config)


async def serve(router, sock: socket.socket, on_started=None) -> None:
    """Run the gateway (and the router through its lifespan) until SIGINT/SIGTERM."""
    from splitserve.router.api.app import create_app

    server = uvicorn_server(create_app(router))
    if on_started is not None:
        asyncio.get_running_loop().create_task(_when_started(server, on_started))
    await server.serve(sockets=[sock])


async def _when_started(server: uvicorn.Server, callback) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    await callback()
