"""A static Envoy in front of `splitserve epp` and the decode pods' sidecars (deploy/envoy/).

    splitserve envoy-config --epp 127.0.0.1:9002 --sidecars 127.0.0.1:8201,127.0.0.1:8202 > envoy.yaml

What a GIE gateway programs for an InferencePool, written out, the pool's safety built in
(envoy_process.py runs it):

    listener :port -> header_mutation: the client's x-gateway-destination-endpoint(-subset) and
                      x-prefiller-host-port are removed before anything reads them
                   -> ext_proc (cluster `epp`, over mTLS when `tls` is given): request headers
                      SEND, body BUFFERED, trailers SEND (the EPP picks on the body whether or not
                      HTTP/2 trailers follow), response headers SEND, response body NONE (the
                      stream's end, with the response's, ends the pending count; no trip per token)
                   -> one route to cluster `pool`: the sidecars, and nothing else
    cluster `pool`  -> override_host load balancing: the hosts the EPP named in its dynamic
                      metadata `envoy.lb` / x-gateway-destination-endpoint ("primary,fallback,...",
                      GIE's fallback endpoints), each looked up among the pool's own members (an
                      address outside the pool is never dialled); none left: round robin over the
                      healthy members (fail-open's fallback)
                    -> retries: connect failure, reset, refused stream or a sidecar's 503, before a
                      response byte went out, at most `num_retries` times, each on the EPP's next
                      endpoint (then on a host not tried yet); outlier detection ejects a member
                      that fails to connect; an active /ready check every second
    EPP down        -> fail-closed: a 503 in OpenAI's error JSON at once; fail-open: round robin

No route or cluster leads to the admin listener (on `admin_host`, loopback by default); the
x-splitserve-*-worker response headers (internal addresses) go unless `debug_headers`. With
`epp=None`, no ext_proc: round robin over the pool. Route timeouts are off (streams are long).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from splitserve.router.epp.endpoints import check_address
from splitserve.router.epp.extproc import DESTINATION, LB_NAMESPACE, PREFILLER, SUBSET

EXT_PROC = "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HEADER_MUTATION = "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
ROUTER = "envoy.extensions.filters.http.router.v3.Router"
HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
OVERRIDE_HOST = "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
ROUND_ROBIN = "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
UPSTREAM_TLS = "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
PREVIOUS_HOSTS = "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
CEL_FILTER = "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
WORKER_HEADERS = ("x-splitserve-decode-worker", "x-splitserve-prefill-worker", "x-splitserve-pulled-tokens")
EPP_DOWN_MESSAGE = "the endpoint picker did not answer; try again shortly"


@dataclass(frozen=True)
class EppTls:
    """Envoy's client side of mTLS to the EPP: its certificate and key, and the CA of the EPP's."""

    cert: str
    key: str
    ca: str


def envoy_config(
    port: int,
    sidecars: list[str],
    epp: str | None,
    admin_port: int = 0,
    fail_open: bool = False,
    host: str = "127.0.0.1",
    message_timeout_s: float = 10.0,
    tls: EppTls | None = None,
    debug_headers: bool = False,
    max_body_bytes: int = 8 * 1024 * 1024,
    num_retries: int = 2,
    admin_host: str = "127.0.0.1",
) -> dict:
    """The bootstrap as a dict (yaml.safe_dump it). ConfigError on a bad address."""
    if not sidecars:
        raise ValueError("envoy_config needs at least one sidecar endpoint (the pool)")
    for s in sidecars:
        check_address(s, "sidecar endpoint")
    clusters = [_pool_cluster(sidecars)]
    filters = [_strip_filter(debug_headers)]
    if epp is not None:
        check_address(epp, "EPP address")
        filters.append(_ext_proc_filter(fail_open, message_timeout_s))
        clusters.append(_epp_cluster(epp, tls))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": f"type.googleapis.com/{ROUTER}"}})
    listener = {
        "name": "inference",
        "address": {"socket_address": {"address": host, "port_value": port}},
        "per_connection_buffer_limit_bytes": max_body_bytes,  # a whole body is buffered for the EPP
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": _hcm(filters, num_retries),
                    }
                ]
            }
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def _hcm(filters: list[dict], num_retries: int) -> dict:
    retry = {
        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
        "retriable_status_codes": [503],
        "num_retries": num_retries,
        "retry_host_predicate": [_typed("envoy.retry_host_predicates.previous_hosts", PREVIOUS_HOSTS)],
        "host_selection_retry_max_attempts": 5,
        "retry_back_off": {"base_interval": "0.02s", "max_interval": "0.2s"},
    }
    route = {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s", "retry_policy": retry}}
    return {
        "@type": f"type.googleapis.com/{HCM}",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "stream_idle_timeout": "0s",
        "route_config": {"name": "inference", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": filters,
        "local_reply_config": {"mappers": [_epp_down_mapper()]},
    }


def _strip_filter(debug_headers: bool) -> dict:
    """Ahead of ext_proc: a client names no destination, subset or prefill worker."""
    mutations: dict = {"request_mutations": [{"remove": h} for h in (DESTINATION, SUBSET, PREFILLER)]}
    if not debug_headers:
        mutations["response_mutations"] = [{"remove": h} for h in WORKER_HEADERS]
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {"@type": f"type.googleapis.com/{HEADER_MUTATION}", "mutations": mutations},
    }


def _ext_proc_filter(fail_open: bool, message_timeout_s: float) -> dict:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"type.googleapis.com/{EXT_PROC}",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": 503},
            "message_timeout": f"{message_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
        },
    }


def _epp_down_mapper() -> dict:
    """Envoy's own answer when the EPP fails (fail-closed): OpenAI's error JSON, not plain text."""
    body = (
        '{"error": {"message": "%LOCAL_REPLY_BODY%", "type": "service_unavailable", '
        '"param": null, "code": "endpoint_picker_unavailable"}}'
    )
    return {
        "filter": {
            "extension_filter": _typed("envoy.access_loggers.extension_filters.cel", CEL_FILTER, expression=_EPP_DOWN)
        },
        "body": {"inline_string": EPP_DOWN_MESSAGE},
        "body_format_override": {"text_format_source": {"inline_string": body}, "content_type": "application/json"},
    }


_EPP_DOWN = "response.code_details.startsWith('ext_proc_error')"  # ext_proc failed, not an EPP answer


def _pool_cluster(sidecars: list[str]) -> dict:
    metadata_key = {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}
    override = {
        "override_host_sources": [{"metadata": metadata_key}],
        "fallback_policy": {
            "policies": [{"typed_extension_config": _typed("envoy.load_balancing_policies.round_robin", ROUND_ROBIN)}]
        },
    }
    return {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": _typed(
                        "envoy.load_balancing_policies.override_host", OVERRIDE_HOST, **override
                    )
                }
            ]
        },
        "load_assignment": _endpoints("pool", sidecars),
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": "1s",
                "no_traffic_interval": "1s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/ready"},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "consecutive_gateway_failure": 2,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        },
    }


def _epp_cluster(epp: str, tls: EppTls | None) -> dict:
    cluster = {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            HTTP2: {"@type": f"type.googleapis.com/{HTTP2}", "explicit_http_config": {"http2_protocol_options": {}}}
        },
        "load_assignment": _endpoints("epp", [epp]),
    }
    if tls is not None:
        context = {
            "tls_certificates": [{"certificate_chain": {"filename": tls.cert}, "private_key": {"filename": tls.key}}],
            "validation_context": {"trusted_ca": {"filename": tls.ca}},
            "alpn_protocols": ["h2"],
        }
        cluster["transport_socket"] = _typed("envoy.transport_sockets.tls", UPSTREAM_TLS, common_tls_context=context)
    return cluster


def _typed(name: str, type_name: str, **fields) -> dict:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_name}", **fields}}


def _endpoints(name: str, addresses: list[str]) -> dict:
    lb = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        lb.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}]}


def register(subparsers) -> None:
    p = subparsers.add_parser("envoy-config", help="print a static Envoy config for splitserve epp + sidecars")
    p.add_argument("--port", type=int, default=8080, help="Envoy's listener port (default 8080)")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin port, on 127.0.0.1 only")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--sidecars", required=True, help="comma-separated sidecar host:port (the pool)")
    p.add_argument("--epp", default=None, help="the EPP's ext_proc host:port; without it: round robin only")
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="when the EPP does not answer, round robin over the pool's healthy members "
        "(default: fail closed, a 503 with an OpenAI error body)",
    )
    p.add_argument("--epp-tls-cert", default=None, help="mTLS to the EPP: Envoy's client certificate (PEM)")
    p.add_argument("--epp-tls-key", default=None, help="... its private key (PEM)")
    p.add_argument("--epp-tls-ca", default=None, help="... and the CA of the EPP's certificate")
    p.add_argument(
        "--debug-headers",
        action="store_true",
        help="keep the x-splitserve-*-worker response headers (internal addresses; default: removed)",
    )
    p.set_defaults(func=cmd_envoy_config)


def cmd_envoy_config(args) -> int:
    from splitserve.platform.errors import ConfigError

    sidecars = [s.strip() for s in args.sidecars.split(",") if s.strip()]
    parts = (args.epp_tls_cert, args.epp_tls_key, args.epp_tls_ca)
    if any(parts) and not all(parts):
        raise ConfigError("--epp-tls-cert, --epp-tls-key and --epp-tls-ca go together; allowed: all three or none")
    tls = EppTls(*parts) if all(parts) else None
    config = envoy_config(
        args.port,
        sidecars,
        args.epp,
        args.admin_port,
        args.fail_open,
        args.host,
        tls=tls,
        debug_headers=args.debug_headers,
    )
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0
