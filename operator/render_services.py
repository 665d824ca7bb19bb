"""Builders for what connects the pods: the router's config, identity and API access, and the
Services.

The pool Services are headless (`clusterIP: None`): the router talks to each worker
directly, so it needs every endpoint, not a virtual IP. A multi-node pool's Service selects
the group leaders only (Context.serving_selector): one endpoint per worker. Kubernetes' EndpointSlice controller
labels each slice of a Service with `kubernetes.io/service-name=<service>` and names its
ports after the Service's port names; the router's discovery lists the slices by that label
and takes the port named `grpc` (endpoints.py builds the same slices for tests). The router
may list and watch EndpointSlices in its namespace and nothing else.

The router config (router.yaml in the ConfigMap) is the router's whole view of the service:
model, block size (for hashing), scorer weights, disaggregation policy, Redis (the prefix index
and the quota store, so every gateway process counts a key's limits together; its password is
never in the ConfigMap but in each process's REDIS_PASSWORD), and where the two pools are. Its
hash goes on the router pod template, so a config change rolls the router.

The declared LoRA adapters (spec.adapters) are the ConfigMap's second key, adapters.yaml. It is
not hashed: the kubelet refreshes the mounted file in place and the running router follows it
(router/placement/adapter_sync.py), loading and unloading adapters on the workers without a new pod. The
router reports back what each pool holds in the ConfigMap's annotation
`serving.splitserve.io/adapters-loaded`, so its Role may also get and patch that one ConfigMap.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from splitserve.operator import constants as C
from splitserve.operator.checks import gateway_processes
from splitserve.operator.context import Context, Manifest
from splitserve.operator.settings import effective_flow_control


def router_config(ctx: Context) -> dict[str, Any]:
    """The content of router.yaml, in the router's own format (router/config/, docs/router.md):
    what `splitserve router --config` reads. Discovery: the EndpointSlices of the pool Services
    (label kubernetes.io/service-name), port `grpc`; `model` and `block_size` seed the block
    hashes and must equal the workers'."""
    spec = ctx.spec
    w = spec.router.scorer_weights
    pools = [ctx.child(pool) for pool in ctx.pools]
    config: dict[str, Any] = {
        "model": spec.model.uri,
        "block_size": spec.engine.block_size,
        "max_model_len": spec.model.max_model_len,
        "gateway": {
            "served_model_names": [spec.served_model_name],
            # quotas, usage and rate limits shared by every gateway process (password: REDIS_PASSWORD)
            **({"rate_limit_redis_url": spec.router.redis.url} if spec.router.redis else {}),
            # how many there are: with keys that have limits and no store above, each refuses to start
            "num_processes": gateway_processes(spec, ctx.settings),
        },
        "discovery": {"k8s_namespace": ctx.namespace, "k8s_services": pools, "k8s_port_name": C.GRPC_PORT_NAME},
        "index": (
            {"backend": "redis", "redis_url": spec.router.redis.url} if spec.router.redis else {"backend": "memory"}
        ),
        "placement": {
            "disaggregation": {
                "mode": spec.disaggregation.mode,
                "min_prefill_tokens": spec.disaggregation.min_prefill_tokens,
            },
            "decode": {
                "scorers": [
                    {"name": "prefix-overlap", "weight": w.prefix},
                    {"name": "queue-depth", "weight": w.queue},
                    {"name": "kv-usage", "weight": w.kv_usage},
                    {"name": "pending-assignments", "weight": w.pending},
                    {"name": "lora-affinity", "weight": w.lora},
                    {"name": "cache-room", "weight": w.cache_room},
                ]
            },
            "prefill": {
                "scorers": [
                    {"name": "prefix-overlap", "weight": w.prefix},
                    {"name": "queued-prefill-tokens", "weight": w.queue},
                    {"name": "pending-assignments", "weight": w.pending},
                ]
            },
        },
        "adapters": {
            "file": f"{C.ROUTER_CONFIG_DIR}/{C.ROUTER_ADAPTERS_FILE}",
            "report_namespace": ctx.namespace,
            "report_configmap": ctx.child("router"),
            "report_annotation": C.ANNOTATION_ADAPTERS_LOADED,
        },
    }
    if not ctx.kv_cache().pull:  # on by default in the router too (router/config/placement.py KVPullConfig)
        config["placement"]["kv_pull"] = {"enabled": False}
    flow = flow_control_config(ctx)
    if flow:
        config["flow_control"] = flow
    return config


def flow_control_config(ctx: Context) -> dict[str, Any]:
    """router.yaml's flow_control section (router/config/flow.py) from spec.flowControl over the
    chart's flowControl values; {} while flow control is off."""
    spec = ctx.spec.flow_control
    eff = effective_flow_control(spec, ctx.settings)
    if not eff.enabled:
        return {}
    objectives = {o.name: o.priority for o in spec.objectives}
    return {
        "enabled": True,
        "objectives": objectives,
        "default_objectives": ({ctx.spec.served_model_name: spec.default_objective} if spec.default_objective else {}),
        "fairness_header": eff.fairness_header,
        "max_queued_per_band": eff.max_queued_per_band,
        "max_queue_wait_s": eff.max_queue_wait_seconds,
        "max_running_per_worker": eff.max_running_per_worker,
        "reserved_running": eff.reserved_running,
        "queue_depth_threshold": eff.queue_depth_threshold,
        "kv_cache_threshold": eff.kv_cache_threshold,
    }


def adapters_text(ctx: Context) -> str:
    """adapters.yaml: the declared adapters as the router reads them (router/placement/adapter_sync.py)."""
    return yaml.safe_dump({"adapters": [{"name": a.name, "path": a.uri} for a in ctx.spec.adapters]}, sort_keys=False)


def router_config_text(ctx: Context) -> str:
    return yaml.safe_dump(router_config(ctx), sort_keys=False)


def config_hash(ctx: Context) -> str:
    return hashlib.sha256(router_config_text(ctx).encode()).hexdigest()[:16]


def router_access(ctx: Context) -> list[Manifest]:
    """ConfigMap, ServiceAccount, Role (EndpointSlices: list, watch; its own ConfigMap: get, patch)
    and RoleBinding of the router."""
    name = ctx.child("router")
    subject = {"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": ctx.meta(name, "router"),
            "data": {C.ROUTER_CONFIG_FILE: router_config_text(ctx), C.ROUTER_ADAPTERS_FILE: adapters_text(ctx)},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": ctx.meta(name, "router"),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": ctx.meta(name, "router"),
            "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
                {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [name], "verbs": ["get", "patch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": ctx.meta(name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [subject],
        },
    ]


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def worker_ports() -> list[dict[str, Any]]:
    return [
        _port(C.GRPC_PORT_NAME, C.GRPC_PORT),
        _port(C.METRICS_PORT_NAME, C.METRICS_PORT),
        _port(C.KV_PORT_NAME, C.KV_PORT),
    ]


def headless_service(
    ctx: Context, component: str, ports: list[dict[str, Any]], selector: dict[str, str] | None = None
) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(ctx.child(component), component),
        "spec": {"clusterIP": "None", "selector": selector or ctx.selector(component), "ports": ports},
    }


def gateway_service(ctx: Context) -> Manifest:
    service = ctx.spec.router.service
    port = {**_port(C.HTTP_PORT_NAME, service.port), "targetPort": C.HTTP_PORT_NAME}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(ctx.name, "gateway"),
        "spec": {"type": service.type, "selector": ctx.selector("router"), "ports": [port]},
    }


def services(ctx: Context) -> list[Manifest]:
    router_ports = [_port(C.HTTP_PORT_NAME, C.ROUTER_HTTP_PORT), _port(C.METRICS_PORT_NAME, C.ROUTER_METRICS_PORT)]
    out = [headless_service(ctx, pool, worker_ports(), ctx.serving_selector(pool)) for pool in ctx.pools]
    return [*out, headless_service(ctx, "router", router_ports), gateway_service(ctx)]
