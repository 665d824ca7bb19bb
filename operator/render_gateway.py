"""Builders for `spec.gateway.mode: inferencePool`: splitserve behind a Gateway API inference gateway.

    InferencePool (inference.networking.k8s.io/v1) <name>   selector: the decode pods (a multi-node pool's
                                                            leaders only); targetPorts: the
                                                            sidecar port; endpointPickerRef: <name>-epp:9002
                                                            with spec.gateway.failureMode
    ConfigMap  <name>-epp        epp.yaml (the router's config without its adapter duties: the router
                                 keeps loading adapters and reporting them) and sidecar.yaml (the same,
                                 discovering the prefill pool only)
    Deployment <name>-epp        `splitserve epp`: ext_proc + gRPC health on 9002, HTTP health and metrics
                                 on 9003; the router's ServiceAccount (EndpointSlices list/watch)
    Service    <name>-epp        the port the InferencePool names (appProtocol h2c when it is plaintext)
    HTTPRoute  <name>            an example: every path of spec.gateway.parentRefs to the InferencePool
    ServiceAccount, Role, RoleBinding <name>-sidecar   EndpointSlices list/watch, nothing else
    decode pods                  + container `sidecar` (`splitserve sidecar` on the sidecar port, the pod's
                                 decode worker on 127.0.0.1): its own /tmp, its own user, the sidecar's
                                 ServiceAccount, whose token is mounted into the sidecar alone

The decode pod mixes trust levels: the sidecar faces the gateway (the internet, through it), the
worker holds the model and the KV cache and loads native kernels from its own /tmp. So they share
no writable folder (the sidecar gets its own emptyDir at /tmp), run as different users, and the
pod's token is not automounted: a projected volume gives the sidecar container, and only it, the
token of a ServiceAccount that may list and watch EndpointSlices and nothing else (not the
router's, which may also patch its ConfigMap).

Security follows spec.security / spec.tls as everywhere else: the EPP talks mTLS to the workers
with the router's certificate and serves ext_proc over TLS with it (gateways connect to an EPP
with TLS and, as GIE specifies, without verifying its name), admitting only a client with a
certificate of the service's CA unless spec.gateway.eppClientAuth is false; its NetworkPolicy
admits the parentRefs' gateway proxies only (gateway_peers); each sidecar talks mTLS to its
worker and to the prefill pool with the router's certificate (workers admit Generate and
WatchEvents from the router role only) and checks the service's API keys as the router does. The gateway reaches the
sidecars over plain HTTP, as GIE's gateways reach model servers (a BackendTLSPolicy is the
gateway's business). The splitserve router stays: it loads the declared LoRA adapters onto the
workers and still serves clients that call it directly.
"""

from __future__ import annotations

import copy

import yaml

from splitserve.operator import constants as C
from splitserve.operator import render_pods as pods
from splitserve.operator.context import Context, Manifest
from splitserve.operator.render_services import router_config

SIDECAR_USER = C.RUN_AS_USER + 1  # not the worker's: no file of the worker's is the sidecar's
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
SIDECAR_PORT_NAME = "sidecar"
EPP_CONFIG_DIR = "/etc/splitserve/epp"
SIDECAR_TLS_DIR = "/etc/splitserve/sidecar-tls"
POOL_GROUP = "inference.networking.k8s.io"


def is_inference_pool(ctx: Context) -> bool:
    return ctx.spec.gateway.mode == "inferencePool"


def _config(ctx: Context, services: list[str]) -> str:
    config = router_config(ctx)
    config.pop("adapters", None)
    config["discovery"] = {**config["discovery"], "k8s_services": services}
    return yaml.safe_dump(config, sort_keys=False)


def epp_config_map(ctx: Context) -> Manifest:
    pools = [ctx.child(pool) for pool in ctx.pools]
    prefill = [ctx.child("prefill")] if "prefill" in ctx.pools else []
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.meta(ctx.child("epp"), "epp"),
        "data": {"epp.yaml": _config(ctx, pools), "sidecar.yaml": _config(ctx, prefill)},
    }


def inference_pool(ctx: Context) -> Manifest:
    return {
        "apiVersion": f"{POOL_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": ctx.meta(ctx.name, "inference-pool"),
        "spec": {
            "selector": {"matchLabels": ctx.serving_selector("decode")},
            "targetPorts": [{"number": ctx.spec.gateway.sidecar_port}],
            "endpointPickerRef": {
                "name": ctx.child("epp"),
                "kind": "Service",
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": ctx.spec.gateway.failure_mode,
            },
        },
    }


def http_route(ctx: Context) -> Manifest:
    parents = [ref.model_dump(by_alias=True, exclude_none=True) for ref in ctx.spec.gateway.parent_refs]
    rule = {
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": ctx.name}],
        "timeouts": {"request": "0s"},
    }  # streams last as long as they generate
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": ctx.meta(ctx.name, "gateway"),
        "spec": {"parentRefs": parents, "rules": [rule]},
    }


def _is_secure(ctx: Context, component: str) -> bool:
    return pods.tls_secret_name(ctx, component) is not None


def epp_service(ctx: Context) -> Manifest:
    grpc = {"name": C.GRPC_PORT_NAME, "port": EPP_GRPC_PORT, "targetPort": C.GRPC_PORT_NAME, "protocol": "TCP"}
    if not _is_secure(ctx, "router"):
        grpc["appProtocol"] = "kubernetes.io/h2c"
    metrics = {
        "name": C.METRICS_PORT_NAME,
        "port": EPP_HEALTH_PORT,
        "targetPort": C.METRICS_PORT_NAME,
        "protocol": "TCP",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(ctx.child("epp"), "epp"),
        "spec": {"selector": ctx.selector("epp"), "ports": [grpc, metrics]},
    }


def epp_deployment(ctx: Context) -> Manifest:
    router = ctx.spec.router
    volumes, mounts = pods._volumes(ctx, pods.TMP_SIZE["router"])
    volumes.append({"name": "config", "configMap": {"name": ctx.child("epp")}})
    mounts.append({"name": "config", "mountPath": EPP_CONFIG_DIR, "readOnly": True})
    pods._add_tls(ctx, "router", volumes, mounts)
    args = [
        "epp",
        "--config",
        f"{EPP_CONFIG_DIR}/epp.yaml",
        "--sidecar-port",
        str(ctx.spec.gateway.sidecar_port),
        "--host",
        "0.0.0.0",
        "--grpc-port",
        str(EPP_GRPC_PORT),
        "--health-port",
        str(EPP_HEALTH_PORT),
        *pods.tls_args(ctx, "router"),
    ]
    if _is_secure(ctx, "router"):
        args += ["--serve-tls-cert", f"{pods.TLS_DIR}/tls.crt", "--serve-tls-key", f"{pods.TLS_DIR}/tls.key"]
        if ctx.spec.gateway.epp_client_auth:
            args += ["--serve-tls-client-ca", f"{pods.TLS_DIR}/ca.crt"]
    container = {
        "name": "epp",
        "image": ctx.image(router.image, 0),
        "imagePullPolicy": ctx.spec.image.pull_policy,
        "command": ["splitserve"],
        "args": args,
        "ports": [
            {"name": C.GRPC_PORT_NAME, "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": C.METRICS_PORT_NAME, "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
        ],
        "env": [*pods.BASE_ENV, *pods.redis_env(ctx)],
        "resources": pods._resources(router.resources, pods.ROUTER_RESOURCES),
        **pods._probes(C.METRICS_PORT_NAME),
        "securityContext": pods.CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    pod = {
        "serviceAccountName": ctx.child("router"),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": pods.POD_SECURITY,
        "affinity": pods._anti_affinity(ctx, "epp"),
        "nodeSelector": dict(router.node_selector),
        "tolerations": pods._tolerations(router.tolerations),
        "containers": [container],
        "volumes": volumes,
    }
    return pods._deployment(
        ctx, "epp", ctx.spec.gateway.epp_replicas, "operator", pods._drop_empty(pod), pods._tls_revision(ctx, "router")
    )


# The labels the gateway implementations put on the proxy pods of a Gateway: the Gateway API's
# own (Istio, kgateway, GKE), and Envoy Gateway's, whose proxies run in its own namespace.
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
ENVOY_GATEWAY_NAME_LABEL = "gateway.envoyproxy.io/owning-gateway-name"
ENVOY_GATEWAY_NAMESPACE_LABEL = "gateway.envoyproxy.io/owning-gateway-namespace"


def gateway_peers(ctx: Context) -> list[dict]:
    """NetworkPolicy peers for the proxy pods of spec.gateway.parentRefs, and nothing else: what
    may call the EPP and the sidecars when neither the service nor the chart names peers."""
    peers = []
    for ref in ctx.spec.gateway.parent_refs:
        namespace = ref.namespace or ctx.namespace
        peers.append(
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "podSelector": {"matchLabels": {GATEWAY_NAME_LABEL: ref.name}},
            }
        )
        envoy_gateway = {ENVOY_GATEWAY_NAME_LABEL: ref.name, ENVOY_GATEWAY_NAMESPACE_LABEL: namespace}
        peers.append({"namespaceSelector": {}, "podSelector": {"matchLabels": envoy_gateway}})
    return peers


def with_sidecar(ctx: Context, workload: Manifest) -> Manifest:
    """The decode pool with the P/D sidecar beside the worker of each serving pod (a Deployment's pods, a
    LeaderWorkerSet's leaders); a copy, the input is not changed."""
    out = copy.deepcopy(workload)
    pod = pods.serving_template(out)["spec"]
    port = ctx.spec.gateway.sidecar_port
    mounts = [
        {"name": "sidecar-tmp", "mountPath": "/tmp"},
        {"name": "epp-config", "mountPath": EPP_CONFIG_DIR, "readOnly": True},
        {"name": "sidecar-token", "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    volumes = pod.setdefault("volumes", [])
    volumes += [
        {"name": "sidecar-tmp", "emptyDir": {"sizeLimit": pods.TMP_SIZE["router"]}},
        {"name": "epp-config", "configMap": {"name": ctx.child("epp")}},
        _token_volume(),
    ]
    # The sidecar calls Generate and WatchEvents, which workers admit from the router role only:
    # it carries the router's certificate (mounted apart from the worker's), and, as the OpenAI
    # endpoint of the pod, checks the service's API keys as the router does.
    sidecar_volumes, sidecar_mounts = [], []
    pods._add_tls(ctx, "router", sidecar_volumes, sidecar_mounts)
    key_args = pods._add_api_keys(ctx, sidecar_volumes, sidecar_mounts)
    for v in sidecar_volumes:
        v["name"] = f"sidecar-{v['name']}"
    for m in sidecar_mounts:
        m["name"] = f"sidecar-{m['name']}"
        if m["mountPath"] == pods.TLS_DIR:
            m["mountPath"] = SIDECAR_TLS_DIR
    volumes += sidecar_volumes
    mounts += sidecar_mounts
    tls = [a.replace(pods.TLS_DIR, SIDECAR_TLS_DIR) for a in pods.tls_args(ctx, "router")]
    sidecar = {
        "name": "sidecar",
        "image": ctx.image(ctx.spec.router.image, 0),
        "imagePullPolicy": ctx.spec.image.pull_policy,
        "command": ["splitserve"],
        "args": [
            "sidecar",
            "--config",
            f"{EPP_CONFIG_DIR}/sidecar.yaml",
            "--decode",
            f"127.0.0.1:{C.GRPC_PORT}",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            *tls,
            *key_args,
        ],
        "ports": [{"name": SIDECAR_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": [*pods.BASE_ENV, *pods.redis_env(ctx)],
        # the router's pipeline for one pod: sized as the router is (spec.router.resources, else its defaults)
        "resources": pods._resources(ctx.spec.router.resources, pods.ROUTER_RESOURCES),
        **pods._probes(SIDECAR_PORT_NAME),
        "securityContext": {**pods.CONTAINER_SECURITY, "runAsUser": SIDECAR_USER},
        "volumeMounts": mounts,
    }
    pod["containers"].append(sidecar)
    # The sidecar discovers the prefill pool through EndpointSlices: its own ServiceAccount, its
    # token in the sidecar container only (the worker container gets none).
    pod["serviceAccountName"] = ctx.child("sidecar")
    pod["automountServiceAccountToken"] = False
    return out


def _token_volume() -> dict:
    """The ServiceAccount token, CA and namespace where client libraries look for them, as the
    automount would put them, for the one container that mounts this volume."""
    return {
        "name": "sidecar-token",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]
        },
    }


def sidecar_access(ctx: Context) -> list[Manifest]:
    """The sidecar's ServiceAccount (no automount), and its Role: EndpointSlices list and watch."""
    name = ctx.child("sidecar")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": ctx.meta(name, "sidecar"),
         "automountServiceAccountToken": False},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": ctx.meta(name, "sidecar"),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": ctx.meta(name, "sidecar"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]  # fmt: skip


def manifests(ctx: Context) -> list[Manifest]:
    """The children above, in apply order (none in splitserve mode); the decode pods via with_sidecar."""
    if not is_inference_pool(ctx):
        return []
    return [
        *sidecar_access(ctx),
        epp_config_map(ctx),
        epp_service(ctx),
        epp_deployment(ctx),
        inference_pool(ctx),
        http_route(ctx),
    ]
