"""Checks of an InferenceService that its CRD schema cannot express.

The API server has already enforced types, ranges, enums and the CEL rules of spec.py. What
remains needs knowledge the schema does not have:

- the object's name must make valid child names: Services need a DNS-1035 label (a letter
  first, no dots) and every child name plus its longest suffix must fit in 63 characters,
  which is also the limit of the `app.kubernetes.io/instance` label value;
- autoscaling after merging the chart's defaults (settings.py): minReplicas <= maxReplicas,
  and no HPA with minReplicas 0; the planner sizes both pools together, so provider planner
  (possibly the chart's default) needs spec.slo and must hold for every pool it applies to;
- quantity arithmetic: on a CPU pool (gpus 0) the KV cache lives in the container's memory,
  so it must fit in the memory limit with room for the weights and the runtime (at least
  256 MiB); on a GPU pool it lives in GPU memory and the limit does not bound it;
- GPUs are requested through `gpus`; a hand-written `nvidia.com/gpu` resource only overrides that
  count on a GPU pool. Either way every rank of a pod needs its own GPU: a pod runs
  tensorParallelSize / nodes ranks (spec.py rejects a tp that nodes does not divide), so it needs
  at least that many GPUs, and requests and limits of the resource must agree (Kubernetes'
  rule for extended resources);
- a multi-node pool (nodes > 1) is a LeaderWorkerSet `<name>-<pool>-group` whose StatefulSets
  are named `<lws>-<group index>`; a StatefulSet name must leave room for its pods'
  `controller-revision-hash` label (63 characters), which allows 52, so the InferenceService's
  name must be shorter than for a Deployment pool.
- GPUs are requested through `gpus`, not a hand-written `nvidia.com/gpu` resource;
- a key file (router.apiKeys) may give keys rpm, tpm, monthly_tokens and max_concurrent, which
  only hold when every gateway process counts them in one store: with more than one gateway
  process (router replicas; with gateway.mode inferencePool also the EPP replicas and a sidecar
  per decode pod, up to its autoscaling maximum) router.redis is required.

All problems are collected into one message, each with the numbers and the remedy.
"""

from __future__ import annotations

import re
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from splitserve.operator.settings import OperatorSettings, effective_autoscaling
from splitserve.operator.spec import InferenceServiceSpec, PoolSpec
from splitserve.platform.errors import ConfigError

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LONGEST_SUFFIX = "-prefill"
MAX_NAME_LENGTH = 63 - len(LONGEST_SUFFIX)
GiB = Decimal(1024**3)
MIN_HEADROOM = Decimal(256 * 1024**2)
GPU_RESOURCE = "nvidia.com/gpu"
GROUP_SUFFIX = "-group"  # a multi-node pool's LeaderWorkerSet: <name>-<pool>-group (render_pods.workload_name)
MAX_STATEFULSET_NAME = 52  # 63 for the controller-revision-hash label, minus "-" and a 10-character hash
MAX_GROUP_INDEX_DIGITS = 3  # replicas <= 1000: the worker StatefulSets <lws>-0 ... <lws>-999


class InvalidSpecError(ConfigError):
    """The InferenceService cannot be served as written; the message says why and how to fix it."""


def check_spec(spec: InferenceServiceSpec, name: str, settings: OperatorSettings) -> None:
    problems = _name_problems(name)
    for role in ("prefill", "decode") if spec.has_prefill_pool() else ("decode",):
        pool: PoolSpec = getattr(spec, role)
        problems += _autoscaling_problems(spec, role, settings)
        problems += _memory_problems(pool, role, spec.engine.kv_cache_memory_gib)
        problems += _gpu_problems(pool, role)
        problems += _group_name_problems(name, pool, role)
    problems += _planner_problems(spec, settings)
    problems += _shared_quota_problems(spec, settings)
    if spec.security.insecure and not settings.security.allow_insecure:
        problems.append(
            "security.insecure is not allowed in this cluster (the chart's security.allowInsecure is "
            "false): remove it; the operator then supplies mTLS and KV authentication"
        )
    if spec.router.allow_unauthenticated and not settings.security.allow_unauthenticated_gateway:
        problems.append(
            "router.allowUnauthenticated is not allowed in this cluster (the chart's "
            "security.allowUnauthenticatedGateway is false): remove it; the operator then generates "
            "an admin API key, or name your key file with router.apiKeys"
        )
    if problems:
        raise InvalidSpecError("; ".join(problems))


def _planner_problems(spec: InferenceServiceSpec, settings: OperatorSettings) -> list[str]:
    roles = ("prefill", "decode") if spec.has_prefill_pool() else ("decode",)
    autos = {r: effective_autoscaling(getattr(spec, r).autoscaling, settings, r) for r in roles}
    planned = [r for r, a in autos.items() if a.enabled and a.provider == "planner"]
    if not planned:
        return []
    problems = []
    if spec.slo is None:
        problems.append(
            "autoscaling provider planner (after the chart's defaults) needs spec.slo with ttftP90Ms and itlP90Ms"
        )
    if len(planned) != len(roles):
        other = [r for r in roles if r not in planned]
        problems.append(
            f"the planner sizes prefill and decode together: enable autoscaling with provider "
            f"planner on {', '.join(other)} too (now only {', '.join(planned)})"
        )
    return problems


def gateway_processes(spec: InferenceServiceSpec, settings: OperatorSettings) -> int:
    """How many processes may answer the OpenAI API at once (each checks the keys and their limits)."""
    count = spec.router.replicas
    if spec.gateway.mode == "inferencePool":
        auto = effective_autoscaling(spec.decode.autoscaling, settings, "decode")
        count += spec.gateway.epp_replicas + (auto.max_replicas if auto.enabled else spec.decode.replicas)
    return count


def _shared_quota_problems(spec: InferenceServiceSpec, settings: OperatorSettings) -> list[str]:
    if spec.router.api_keys is None or spec.router.redis is not None:
        return []
    count = gateway_processes(spec, settings)
    if count <= 1:
        return []
    return [
        f"router.apiKeys with {count} gateway processes (router replicas, and with gateway.mode inferencePool "
        "the EPP and a sidecar per decode pod) needs router.redis: without a shared store each process counts "
        "every key's rpm, tpm, monthly_tokens and max_concurrent alone, so a key gets up to "
        f"{count}x its limits and usage resets on every restart; set router.redis (url, passwordSecret) "
        "or run one router replica in splitserve mode"
    ]


def _name_problems(name: str) -> list[str]:
    if len(name) > MAX_NAME_LENGTH:
        return [
            f"metadata.name {name!r} has {len(name)} characters; at most {MAX_NAME_LENGTH} leave room for "
            f"child names like '{name[:8]}...{LONGEST_SUFFIX}' (63 characters at most): choose a shorter name"
        ]
    if not DNS_1035.match(name):
        return [
            f"metadata.name {name!r} must be a DNS-1035 label (lower-case letters, digits and '-', starting "
            "with a letter, no dots) because the operator names Services after it"
        ]
    return []


def _autoscaling_problems(spec: InferenceServiceSpec, role: str, settings: OperatorSettings) -> list[str]:
    auto = effective_autoscaling(getattr(spec, role).autoscaling, settings, role)
    if not auto.enabled:
        return []
    problems = []
    if auto.min_replicas > auto.max_replicas:
        problems.append(
            f"{role}.autoscaling: minReplicas {auto.min_replicas} exceeds maxReplicas "
            f"{auto.max_replicas} (after the chart's defaults): set both in the InferenceService"
        )
    if auto.provider == "hpa" and auto.min_replicas < 1:
        problems.append(
            f"{role}.autoscaling: an HPA cannot scale to zero (minReplicas 0): set minReplicas >= 1 or provider keda"
        )
    return problems


def _memory_problems(pool: PoolSpec, role: str, kv_cache_gib: float) -> list[str]:
    limit = pool.resources.limits.get("memory")
    if limit is None or pool.gpus > 0:
        return []
    limit_bytes = parse_quantity(limit)
    needed = Decimal(str(kv_cache_gib)) * GiB + MIN_HEADROOM
    if needed <= limit_bytes:
        return []
    return [
        f"engine.kvCacheMemoryGiB={kv_cache_gib} plus 0.25 GiB for weights and runtime needs "
        f"{needed / GiB:.2f} GiB but {role}.resources.limits.memory is {limit} ({limit_bytes / GiB:.2f} GiB): "
        "raise the memory limit or lower kvCacheMemoryGiB"
    ]


def _gpu_problems(pool: PoolSpec, role: str) -> list[str]:
    named = {
        k: v.get(GPU_RESOURCE) for k, v in (("requests", pool.resources.requests), ("limits", pool.resources.limits))
    }
    counts = {k: int(parse_quantity(v)) for k, v in named.items() if v is not None}
    if counts and pool.gpus == 0:
        return [f"{role}.resources must not name {GPU_RESOURCE}: set {role}.gpus instead"]
    if len(set(counts.values())) > 1:
        return [
            f"{role}.resources names {GPU_RESOURCE} {counts['requests']} in requests but {counts['limits']} in "
            "limits: Kubernetes needs them equal (or name it in limits only)"
        ]
    ranks = pool.ranks_per_pod
    have, source = (min(counts.values()), f"{role}.resources {GPU_RESOURCE}") if counts else (pool.gpus, f"{role}.gpus")
    if pool.gpus == 0 or have >= ranks:
        return []
    return [
        f"{source} is {have} but each pod runs {ranks} ranks (tensorParallelSize {pool.tensor_parallel_size} / "
        f"nodes {pool.nodes}) and every rank needs its own GPU: set it to {ranks} (or {role}.gpus to 0 to run the "
        "ranks on CPU)"
    ]


def _group_name_problems(name: str, pool: PoolSpec, role: str) -> list[str]:
    if not pool.is_multi_node:
        return []
    lws = f"{name}-{role}{GROUP_SUFFIX}"
    longest = MAX_STATEFULSET_NAME - 1 - MAX_GROUP_INDEX_DIGITS
    if len(lws) <= longest:
        return []
    return [
        f"{role}.nodes {pool.nodes} makes a LeaderWorkerSet {lws!r} ({len(lws)} characters) whose StatefulSets "
        f"'<name>-<group index>' must fit in {MAX_STATEFULSET_NAME} characters: at most {longest} characters "
        f"for it, so metadata.name may have at most {longest - len(lws) + len(name)}; choose a shorter name"
    ]
