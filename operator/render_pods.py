"""Builders for the worker pools (a Deployment each, or a LeaderWorkerSet when a pool's workers span
nodes) and the router's Deployment.

Every pod runs as a non-root user on a read-only root filesystem with all capabilities
dropped; what must be writable is an emptyDir (/tmp, and /dev/shm in memory for torch and
UCX). Probes: a startup probe on /health gives model loading up to ten minutes, then
liveness on /health and readiness on /ready (a worker is ready once its model is loaded and
warmed up, and stops being ready when it drains). SIGTERM drains a worker; the pod's
terminationGracePeriodSeconds (from the spec) bounds the drain. Replicas of one pool prefer
different nodes (soft anti-affinity).

Replicas: a pool without autoscaling gets `spec.replicas`; an autoscaled pool gets
`minReplicas` and the annotation `serving.splitserve.io/replicas-owner: keda|hpa|planner`, which
tells apply.py to set replicas only when it creates the Deployment and never afterwards.

Tensor parallelism (spec.<pool>.tensorParallelSize, nodes): a worker is `nodes` pods that run
tensorParallelSize / nodes ranks each, so each pod gets that many GPUs (`gpus`, or an
`nvidia.com/gpu` in `resources`; checks.py makes sure every rank has one), a /dev/shm of 1 GiB
per rank, and the engine's TP flags (parallel_args). nodes 1 keeps the Deployment. nodes > 1
renders a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, `Context.workload`): `replicas` groups of
`size: nodes` pods, created together and recreated together when one of them restarts. Its
leader template is the pool's pod as a Deployment would run it (probes, ports, the P/D
sidecar); its worker template runs the same command without probes or ports, since only the
leader serves. Each pod passes `--node-rank $(LWS_WORKER_INDEX) --master-addr
$(LWS_LEADER_ADDRESS)`, the variables the LeaderWorkerSet webhook gives every container (the
leader's address is its name in the set's own headless Service, resolvable before it is ready).

Security (secure by default): every worker gets `--kv-secret-file` and every pod the mTLS
flags, from the spec's own Secrets or, where it names none, from the ones credentials.py
manages; only `spec.security.insecure: true` leaves them out. A pod template carries the
fingerprint of its issued certificate, so a renewal rolls the pool.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from splitserve.operator import constants as C
from splitserve.operator import credentials
from splitserve.operator.context import Context, Manifest
from splitserve.operator.render_services import config_hash
from splitserve.operator.settings import KvCacheDefaults, effective_flow_control
from splitserve.operator.spec import EnvVar, PoolSpec, Resources, Toleration
from splitserve.platform.settings.worker_args import WorkerArgs, for_role, with_flow_control

GPU_RESOURCE = "nvidia.com/gpu"
STARTUP_SECONDS = 600
# Defaults where the spec gives no resources (docs/security.md): (request, limit) in GiB.
CPU_WORKER_HEADROOM_GIB = (1.0, 2.0)  # over engine.kvCacheMemoryGiB: weights, activations, runtime
GPU_HOST_MEMORY_GIB = (16.0, 32.0)  # host memory of a GPU worker (weights pass through it on load)
ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
TMP_SIZE = {"worker": "4Gi", "router": "1Gi"}  # the /tmp emptyDir (compiler caches, HOME)
# Per extra rank of a tensor-parallel pod: its /dev/shm (torch's shared tensors, the step plan
# sent to the ranks, NCCL's buffers) and a process's runtime, in GiB of the pod's memory.
SHM_GIB_PER_RANK = 1
RANK_HEADROOM_GIB = 1.5


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(base: list[dict[str, Any]], user: list[EnvVar]) -> list[dict[str, Any]]:
    """Our variables, then the user's; a user variable replaces ours of the same name."""
    names = {e.name for e in user}
    return [e for e in base if e["name"] not in names] + [e.model_dump(by_alias=True, exclude_none=True) for e in user]


def _resources(resources: Resources, defaults: dict[str, dict[str, str]], gpus: int = 0) -> dict[str, Any]:
    """The spec's requests and limits; where it gives none, `defaults` (a memory limit is never
    below the memory request the spec gives)."""
    requests = dict(resources.requests) or dict(defaults["requests"])
    limits = dict(resources.limits) or dict(defaults["limits"])
    if (
        not resources.limits
        and "memory" in requests
        and "memory" in limits
        and parse_quantity(requests["memory"]) > parse_quantity(limits["memory"])
    ):
        limits["memory"] = requests["memory"]
    if gpus:  # an nvidia.com/gpu the spec names overrides `gpus` (checks.py: at least one per rank)
        limits.setdefault(GPU_RESOURCE, requests.get(GPU_RESOURCE, gpus))
    return {"requests": requests, "limits": limits}


def _mib(gib: float) -> str:
    return f"{math.ceil(gib * 1024)}Mi"


def worker_resource_defaults(ctx: Context, pool_spec: PoolSpec) -> dict[str, dict[str, str]]:
    """Requests and limits of a worker whose spec gives none: the KV cache plus room for weights
    and runtime on CPU; a GPU worker's host memory for loading weights. A second tier in host
    memory (GPU pools) or in a memory-backed emptyDir (CPU pools) counts in the limit."""
    kv = ctx.kv_cache()
    host_tier = kv.tier_gib if (pool_spec.gpus > 0 or kv.tier_medium == "memory") else 0
    ranks = pool_spec.ranks_per_pod
    ranks_gib = (ranks - 1) * RANK_HEADROOM_GIB
    if pool_spec.gpus > 0:
        return {
            "requests": {"cpu": str(2 * ranks), "memory": _mib(GPU_HOST_MEMORY_GIB[0] + ranks_gib + host_tier)},
            "limits": {"memory": _mib(GPU_HOST_MEMORY_GIB[1] + ranks_gib + host_tier)},
        }
    kv_gib = ctx.spec.engine.kv_cache_memory_gib
    return {
        "requests": {"cpu": str(ranks), "memory": _mib(kv_gib + CPU_WORKER_HEADROOM_GIB[0] + ranks_gib)},
        "limits": {"memory": _mib(kv_gib + CPU_WORKER_HEADROOM_GIB[1] + ranks_gib + host_tier)},
    }


def _tolerations(tolerations: list[Toleration], gpus: int = 0) -> list[dict[str, Any]]:
    out = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    if gpus and not any(t.get("key") == GPU_RESOURCE for t in out):
        out.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return out


def _probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _probes(port: str) -> dict[str, Any]:
    return {
        "startupProbe": _probe("/health", port, 5, STARTUP_SECONDS // 5),
        "livenessProbe": _probe("/health", port, 10, 3),
        "readinessProbe": _probe("/ready", port, 5, 2),
    }


def _volumes(ctx: Context, tmp_size: str, shm_gib: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes = [
        {"name": "tmp", "emptyDir": {"sizeLimit": tmp_size}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
    ]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}]
    storage = ctx.spec.model.storage
    if storage is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": storage.pvc_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": storage.mount_path, "readOnly": True})
    return volumes, mounts


CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": C.RUN_AS_USER,
    "runAsGroup": C.RUN_AS_USER,
    "fsGroup": C.RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
BASE_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    {"name": "PYTHONUNBUFFERED", "value": "1"},
    _field_env("POD_NAME", "metadata.name"),
    _field_env("POD_NAMESPACE", "metadata.namespace"),
    _field_env("POD_IP", "status.podIP"),
]


KV_SECRET_DIR = "/etc/splitserve/kv"
TLS_DIR = "/etc/splitserve/tls"
API_KEYS_DIR = "/etc/splitserve/api-keys"
API_KEYS_FILE = "keys.yaml"
KV_TIER_DIR = "/var/cache/splitserve-kv"  # the kv-tier emptyDir (spec.kvCache.tierGiB on CPU pools)


def tls_secret_name(ctx: Context, component: str) -> str | None:
    """The Secret a component's certificate comes from: the spec's own (Secret or cert-manager
    Certificate), else the operator's per-component one (credentials.py), None when insecure."""
    tls = ctx.spec.tls
    if tls is not None:
        return tls.secret_name or ctx.child("tls")
    return credentials.tls_secret_name(ctx, component) if credentials.manages_tls(ctx) else None


def api_keys_ref(ctx: Context) -> tuple[str, str] | None:
    """(Secret, key) of the gateway's key file: the spec's, else the operator's generated one, None
    when the spec sets router.allowUnauthenticated."""
    ref = ctx.spec.router.api_keys
    if ref is not None:
        return ref.name, ref.key
    return (
        (credentials.api_keys_secret_name(ctx), credentials.API_KEYS_FILE_KEY)
        if credentials.manages_api_keys(ctx)
        else None
    )


def _add_api_keys(ctx: Context, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> list[str]:
    """Mount the key file as a whole Secret volume (no subPath: the kubelet then swaps in an
    updated Secret and the router's reload-on-change sees it); the router's flags to read it."""
    ref = api_keys_ref(ctx)
    if ref is None:
        return []
    volumes.append(
        {
            "name": "api-keys",
            "secret": {"secretName": ref[0], "defaultMode": 0o440, "items": [{"key": ref[1], "path": API_KEYS_FILE}]},
        }
    )
    mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return ["--api-keys-file", f"{API_KEYS_DIR}/{API_KEYS_FILE}"]


def kv_secret_ref(ctx: Context) -> tuple[str, str] | None:
    """(Secret, key) of the KV-transfer secret: the spec's, else the operator's, None when insecure."""
    ref = ctx.spec.kv_transfer.auth_secret
    if ref is not None:
        return ref.name, ref.key
    return (credentials.kv_secret_name(ctx), credentials.KV_SECRET_KEY) if credentials.manages_kv_secret(ctx) else None


def tls_files(ctx: Context, component: str) -> dict[str, str]:
    """The certificate files a component's pod mounts (_add_tls), as tls_cert/tls_key/tls_ca."""
    if tls_secret_name(ctx, component) is None:
        return {}
    return {"tls_cert": f"{TLS_DIR}/tls.crt", "tls_key": f"{TLS_DIR}/tls.key", "tls_ca": f"{TLS_DIR}/ca.crt"}


def tls_args(ctx: Context, component: str) -> list[str]:
    return [arg for name, path in tls_files(ctx, component).items() for arg in (f"--{name.replace('_', '-')}", path)]


def _add_tls(ctx: Context, component: str, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> None:
    secret = tls_secret_name(ctx, component)
    if secret is not None:
        volumes.append({"name": "tls", "secret": {"secretName": secret, "defaultMode": 0o440}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})


def certificate(ctx: Context) -> Manifest | None:
    """The cert-manager Certificate of the service's mTLS, when spec.tls.issuer names an issuer."""
    tls = ctx.spec.tls
    if tls is None or tls.issuer is None:
        return None
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": ctx.meta(ctx.child("tls"), "tls"),
        "spec": {
            "secretName": ctx.child("tls"),
            "commonName": "splitserve-worker",
            "dnsNames": ["splitserve-worker"],
            "usages": ["server auth", "client auth", "digital signature", "key encipherment"],
            "duration": "2160h",
            "renewBefore": "360h",
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": {"name": tls.issuer.name, "kind": tls.issuer.kind, "group": "cert-manager.io"},
        },
    }


# What every worker pod spells out, even at the worker's default (the pod spec documents itself).
POD_EXPLICIT = (
    "role",
    "model",
    "dtype",
    "max_model_len",
    "block_size",
    "max_num_seqs",
    "kv_cache_memory_gib",
    "host",
    "advertise_host",
    "grpc_port",
    "metrics_port",
    "kv_transport",
    "kv_port",
)


def worker_args(ctx: Context, pool: str) -> list[str]:
    settings = worker_settings(ctx, pool)
    return ["worker", *settings.to_argv(explicit=POD_EXPLICIT), *parallel_args(getattr(ctx.spec, pool))]


def worker_settings(ctx: Context, pool: str) -> WorkerArgs:
    """The settings of a worker of `pool` (platform/settings/worker_args.py) from the spec."""
    spec, pool_spec = ctx.spec, getattr(ctx.spec, pool)
    settings = WorkerArgs(
        model=spec.model.uri,
        dtype=spec.model.dtype,
        max_model_len=spec.model.max_model_len,
        block_size=spec.engine.block_size,
        max_num_seqs=spec.engine.max_num_seqs,
        kv_cache_memory_gib=spec.engine.kv_cache_memory_gib,
        host="0.0.0.0",
        advertise_host="$(POD_IP)",
        grpc_port=C.GRPC_PORT,
        metrics_port=C.METRICS_PORT,
        kv_transport=spec.kv_transfer.transport,
        kv_port=C.KV_PORT,
        kv_secret_file=f"{KV_SECRET_DIR}/secret" if kv_secret_ref(ctx) is not None else "",
        **tls_files(ctx, pool),
        # per-role certificates: each RPC only for its callers' role
        tls_check_peer_roles=credentials.manages_tls(ctx),
        speculative_config=spec.speculative.config_json() if spec.speculative is not None else None,
        **kv_cache_settings(ctx.kv_cache(), pool_spec.gpus),
        device="cuda" if pool_spec.gpus > 0 else "cpu",
    )
    return for_role(with_flow_control(settings, effective_flow_control(spec.flow_control, ctx.settings).enabled), pool)


def parallel_args(pool_spec: PoolSpec) -> list[str]:
    """The engine's tensor-parallel flags: the ranks of one worker and, for a worker spanning pods, the group's
    size, this pod's node rank and the rendezvous on the leader (from the LeaderWorkerSet's variables, which
    the kubelet expands in `$(...)`). None at tensorParallelSize 1."""
    if pool_spec.tensor_parallel_size == 1:
        return []
    args = ["--tensor-parallel-size", str(pool_spec.tensor_parallel_size)]
    if pool_spec.is_multi_node:
        args += [
            "--nnodes",
            str(pool_spec.nodes),
            "--node-rank",
            f"$({C.LWS_WORKER_INDEX_ENV})",
            "--master-addr",
            f"$({C.LWS_LEADER_ADDRESS_ENV})",
            "--master-port",
            str(C.DIST_PORT),
        ]
    return args


def kv_cache_settings(kv: KvCacheDefaults, gpus: int) -> dict[str, Any]:
    """The worker settings of the effective spec.kvCache (chart defaults merged, Context.kv_cache): a
    host-memory tier on GPU pools, a file tier in the kv-tier emptyDir (_add_kv_tier) on CPU pools;
    pulls on or off and their limit."""
    tier = int(kv.tier_gib * 1024**3) if kv.tier_gib > 0 else None
    return {
        "kv_tier_bytes": tier,
        "kv_tier_dir": KV_TIER_DIR if tier is not None and gpus == 0 else None,
        "kv_pull": kv.pull,
        "max_pull_blocks": kv.max_pull_blocks if kv.pull else WorkerArgs.max_pull_blocks,
    }


def _add_kv_tier(
    ctx: Context, pool_spec: PoolSpec, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]
) -> None:
    kv = ctx.kv_cache()
    if kv.tier_gib > 0 and pool_spec.gpus == 0:
        # the tier's files plus headroom for one block being written and the folder itself
        size = f"{int(kv.tier_gib * 1024 + 64)}Mi"
        volumes.append(
            {
                "name": "kv-tier",
                "emptyDir": {"sizeLimit": size, **({"medium": "Memory"} if kv.tier_medium == "memory" else {})},
            }
        )
        mounts.append({"name": "kv-tier", "mountPath": KV_TIER_DIR})


def _worker_env(ctx: Context, pool_spec: PoolSpec) -> list[dict[str, Any]]:
    ucx = ctx.spec.kv_transfer.ucx
    extra = []
    if ctx.spec.kv_transfer.transport == "ucx":
        extra.append({"name": "UCX_TCP_PORT_RANGE", "value": f"{C.UCX_TCP_PORTS[0]}-{C.UCX_TCP_PORTS[1]}"})
    if ucx is not None and ucx.tls:
        extra.append({"name": "UCX_TLS", "value": ucx.tls})
    if ucx is not None and ucx.net_devices:
        extra.append({"name": "UCX_NET_DEVICES", "value": ucx.net_devices})
    return _env(BASE_ENV + extra, pool_spec.env)


def _anti_affinity(ctx: Context, component: str) -> dict[str, Any]:
    term = {"labelSelector": {"matchLabels": ctx.selector(component)}, "topologyKey": "kubernetes.io/hostname"}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        }
    }


def _template(ctx: Context, component: str, pod: dict[str, Any], annotations: dict[str, str] | None) -> Manifest:
    meta: dict[str, Any] = {"labels": ctx.labels(component)}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": pod}


def _deployment(
    ctx: Context,
    component: str,
    replicas: int,
    owner: str,
    pod: dict[str, Any],
    pod_annotations: dict[str, str] | None = None,
) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.meta(ctx.child(component), component, {C.ANNOTATION_REPLICAS_OWNER: owner}),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": ctx.selector(component)},
            "template": _template(ctx, component, pod, pod_annotations),
        },
    }


def _leader_worker_set(
    ctx: Context, pool: str, replicas: int, owner: str, leader: dict[str, Any], annotations: dict[str, str]
) -> Manifest:
    """A LeaderWorkerSet of `replicas` groups, `nodes` pods each: the leader serves, the others run ranks only."""
    api_version, kind, name = ctx.workload(pool)
    follower = copy.deepcopy(leader)
    for container in follower["containers"]:
        for key in ("ports", "startupProbe", "livenessProbe", "readinessProbe"):
            container.pop(key, None)
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": ctx.meta(name, pool, {C.ANNOTATION_REPLICAS_OWNER: owner}),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",  # the leader's address resolves before it is ready
            "rolloutStrategy": {"type": "RollingUpdate"},
            "leaderWorkerTemplate": {
                "size": getattr(ctx.spec, pool).nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",  # a lost rank takes its whole group down
                "leaderTemplate": _template(ctx, pool, leader, annotations),
                "workerTemplate": _template(ctx, pool, follower, annotations),
            },
        },
    }


def serving_template(workload: Manifest) -> Manifest:
    """The pod template of a pool's serving pods: a Deployment's, or a LeaderWorkerSet's leader template."""
    if workload["kind"] == C.LWS_KIND:
        return workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return workload["spec"]["template"]


def _worker_container(ctx: Context, pool: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    pool_spec: PoolSpec = getattr(ctx.spec, pool)
    return {
        "name": "worker",
        "image": ctx.image(pool_spec.image, pool_spec.gpus),
        "imagePullPolicy": ctx.spec.image.pull_policy,
        "command": ["splitserve"],
        "args": worker_args(ctx, pool),
        "ports": [
            {"name": C.GRPC_PORT_NAME, "containerPort": C.GRPC_PORT, "protocol": "TCP"},
            {"name": C.METRICS_PORT_NAME, "containerPort": C.METRICS_PORT, "protocol": "TCP"},
            {"name": C.KV_PORT_NAME, "containerPort": C.KV_PORT, "protocol": "TCP"},
        ],
        "env": _worker_env(ctx, pool_spec),
        "resources": _resources(pool_spec.resources, worker_resource_defaults(ctx, pool_spec), pool_spec.gpus),
        **_probes(C.METRICS_PORT_NAME),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }


def worker_workload(ctx: Context, pool: str) -> Manifest:
    """The pool's Deployment, or its LeaderWorkerSet when its workers span nodes (Context.workload)."""
    pool_spec: PoolSpec = getattr(ctx.spec, pool)
    auto = ctx.autoscaling(pool)
    volumes, mounts = _volumes(ctx, TMP_SIZE["worker"], SHM_GIB_PER_RANK * pool_spec.ranks_per_pod)
    _add_tls(ctx, pool, volumes, mounts)
    _add_kv_tier(ctx, pool_spec, volumes, mounts)
    auth = kv_secret_ref(ctx)
    if auth is not None:
        volumes.append(
            {
                "name": "kv-secret",
                "secret": {"secretName": auth[0], "defaultMode": 0o440, "items": [{"key": auth[1], "path": "secret"}]},
            }
        )
        mounts.append({"name": "kv-secret", "mountPath": KV_SECRET_DIR, "readOnly": True})
    pod = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": pool_spec.termination_grace_period_seconds,
        "securityContext": POD_SECURITY,
        "affinity": _anti_affinity(ctx, pool),
        "nodeSelector": dict(pool_spec.node_selector),
        "tolerations": _tolerations(pool_spec.tolerations, pool_spec.gpus),
        "containers": [_worker_container(ctx, pool, mounts)],
        "volumes": volumes,
    }
    replicas, owner = (auto.min_replicas, auto.provider) if auto.enabled else (pool_spec.replicas, "operator")
    if pool_spec.is_multi_node:
        return _leader_worker_set(ctx, pool, replicas, owner, _drop_empty(pod), _tls_revision(ctx, pool))
    return _deployment(ctx, pool, replicas, owner, _drop_empty(pod), _tls_revision(ctx, pool))


def _tls_revision(ctx: Context, component: str) -> dict[str, str]:
    """The pod annotation that rolls a pool onto renewed certificates (none without issued ones)."""
    revision = ctx.tls_revisions.get(component)
    return {C.ANNOTATION_TLS_REVISION: revision} if revision else {}


def redis_env(ctx: Context) -> list[dict]:
    """REDIS_PASSWORD from its Secret, for every gateway process (router, EPP, sidecar): the router
    config's Redis URLs carry none (router/config_file.py puts it in)."""
    redis = ctx.spec.router.redis
    if redis is None or redis.password_secret is None:
        return []
    ref = redis.password_secret
    return [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def router_deployment(ctx: Context) -> Manifest:
    router = ctx.spec.router
    volumes, mounts = _volumes(ctx, TMP_SIZE["router"])
    volumes.append({"name": "config", "configMap": {"name": ctx.child("router")}})
    mounts.append({"name": "config", "mountPath": C.ROUTER_CONFIG_DIR, "readOnly": True})
    _add_tls(ctx, "router", volumes, mounts)
    key_args = _add_api_keys(ctx, volumes, mounts)
    if ctx.spec.model.storage is not None:  # runtime LoRA loads (admin keys) may read the model volume only
        key_args += ["--lora-roots", ctx.spec.model.storage.mount_path]
    env = [*BASE_ENV, *redis_env(ctx)]
    container = {
        "name": "router",
        "image": ctx.image(router.image, 0),
        "imagePullPolicy": ctx.spec.image.pull_policy,
        "command": ["splitserve"],
        "args": [
            "router",
            "--config",
            f"{C.ROUTER_CONFIG_DIR}/{C.ROUTER_CONFIG_FILE}",
            "--host",
            "0.0.0.0",
            "--port",
            str(C.ROUTER_HTTP_PORT),
            "--metrics-port",
            str(C.ROUTER_METRICS_PORT),
            *tls_args(ctx, "router"),
            *key_args,
        ],
        "ports": [
            {"name": C.HTTP_PORT_NAME, "containerPort": C.ROUTER_HTTP_PORT, "protocol": "TCP"},
            {"name": C.METRICS_PORT_NAME, "containerPort": C.ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": _env(env, router.env),
        "resources": _resources(router.resources, ROUTER_RESOURCES),
        **_probes(C.HTTP_PORT_NAME),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    pod = {
        "serviceAccountName": ctx.child("router"),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": POD_SECURITY,
        "affinity": _anti_affinity(ctx, "router"),
        "nodeSelector": dict(router.node_selector),
        "tolerations": _tolerations(router.tolerations),
        "containers": [container],
        "volumes": volumes,
    }
    return _deployment(
        ctx,
        "router",
        router.replicas,
        "operator",
        _drop_empty(pod),
        {C.ANNOTATION_CONFIG_HASH: config_hash(ctx), **_tls_revision(ctx, "router")},
    )


def _drop_empty(pod: dict[str, Any]) -> dict[str, Any]:
    """Leave out empty optional lists and maps (the API server drops them too)."""
    pod = {k: v for k, v in pod.items() if v not in ({}, [])}
    pod["containers"] = [{k: v for k, v in c.items() if v not in ({}, [])} for c in pod["containers"]]
    return pod
