"""The operator's cluster-wide defaults: what SREs set through the Helm chart's values.

The chart renders these values into a ConfigMap mounted at `--defaults`; the file has the
same shape as the `defaults` block the chart builds (see helm/splitserve/templates/
configmap.yaml). An InferenceService field always wins over the chart's value, which wins
over the built-in value here:

    effective = spec.<pool>.autoscaling.X  if set
           else chart autoscaling.<pool>.X  (pool-level knobs: min/max replicas, target depth)
           else chart autoscaling.X         (service-level knobs: enabled, provider, polling, cooldown)

and likewise each field of spec.kvCache over the chart's kvCache.X (effective_kv_cache).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from splitserve.operator import constants as C
from splitserve.operator.spec import AutoscalingSpec, FlowControlSpec, KvCacheSpec
from splitserve.platform.__about__ import __version__


class _Settings(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class PoolDefaults(_Settings):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_queue_depth: float = Field(4.0, gt=0)


class AutoscalingDefaults(_Settings):
    enabled: bool = False
    provider: str = Field("keda", pattern="^(keda|hpa|planner)$")
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"
    planner_url: str = Field("http://splitserve-planner.splitserve-system.svc:8090", pattern="^https?://")
    """Where the SLA planner serves desired replicas (KEDA's metrics-api trigger polls it)."""
    planner_export: str = Field("keda", pattern="^(keda|scale)$")
    """How the planner's counts reach the Deployments: keda (a ScaledObject with a metrics-api trigger
    on the planner's JSON) or scale (no KEDA: the planner writes the Deployments' scale subresource)."""
    planner_profile: str = ""
    """The default capacity profile (JSON of `splitserve profile`) for services naming none."""
    polling_interval: int = Field(15, ge=1)
    cooldown_period: int = Field(300, ge=0, le=3600)
    prefill: PoolDefaults = PoolDefaults()
    decode: PoolDefaults = PoolDefaults(max_replicas=8, target_queue_depth=8.0)


class ImageDefaults(_Settings):
    repository: str = C.DEFAULT_IMAGE_REPOSITORY
    tag: str = __version__
    cuda_suffix: str = C.CUDA_TAG_SUFFIX
    pull_policy: str = "IfNotPresent"


class ReconcileSettings(_Settings):
    resync_seconds: float = Field(60.0, gt=0)
    """Period of the timer that re-applies every InferenceService (a deleted child comes back)."""
    not_ready_retry_seconds: float = Field(15.0, gt=0)
    """Delay of kopf's TemporaryError while children are not ready."""


class Peer(_Settings):
    """A source of traffic, as in spec.networkPolicy.gatewayFrom (namespaceLabels/podLabels or cidr)."""

    namespace_labels: dict[str, str] | None = None
    pod_labels: dict[str, str] | None = None
    cidr: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Peer:
        if (self.cidr is not None) == (self.namespace_labels is not None or self.pod_labels is not None):
            raise ValueError("a peer is either a cidr or namespaceLabels/podLabels, not both and not neither")
        return self


class WorkloadPolicies(_Settings):
    """What the per-InferenceService NetworkPolicies let in (chart: networkPolicy.workloads)."""

    monitoring: Peer = Peer(namespace_labels={"kubernetes.io/metadata.name": "monitoring"}, pod_labels={})
    """Who may scrape the metrics ports (default: every pod of the namespace named monitoring)."""
    gateway_from: list[Peer] = [
        Peer(pod_labels={}),
        Peer(namespace_labels={"kubernetes.io/metadata.name": "ingress-nginx"}, pod_labels={}),
    ]
    """Who may call the router's HTTP port unless the InferenceService says (default: every pod of the
    service's namespace, and the ingress controller's namespace)."""
    inference_gateway_from: list[Peer] | None = None
    """With spec.gateway.mode inferencePool: who may call the EPP's ext_proc port and the decode pods'
    sidecar port unless the InferenceService sets gatewayFrom (the inference gateway's proxies, e.g. the
    namespace of Istio's, kgateway's or Envoy Gateway's Gateway pods); unset: gatewayFrom."""
    planner: Peer = Peer(
        namespace_labels={"kubernetes.io/metadata.name": "splitserve-system"},
        pod_labels={"app.kubernetes.io/name": "splitserve-planner"},
    )
    """Who else may scrape the metrics ports of a service with autoscaling provider planner: the SLA
    planner reads every router and worker pod's /metrics."""


class NetworkPolicyDefaults(_Settings):
    workloads: WorkloadPolicies = WorkloadPolicies()


class SecurityDefaults(_Settings):
    allow_insecure: bool = True
    """Whether an InferenceService may set spec.security.insecure (chart: security.allowInsecure);
    false makes such a spec invalid, so every service of the cluster runs mTLS and KV auth."""
    allow_unauthenticated_gateway: bool = True
    """Whether an InferenceService may set spec.router.allowUnauthenticated (chart:
    security.allowUnauthenticatedGateway); false makes such a spec invalid, so every gateway needs a key."""


class KvCacheDefaults(_Settings):
    """Every InferenceService's spec.kvCache where it leaves a field unset (chart: kvCache.*);
    also the effective kvCache of one service (effective_kv_cache)."""

    tier_gib: float = Field(0, alias="tierGiB", ge=0, le=4096)
    tier_medium: Literal["disk", "memory"] = "disk"
    pull: bool = True
    max_pull_blocks: int = Field(1024, ge=1, le=1048576)
    """1024 is also the worker's own default (--max-pull-blocks)."""


class FlowControlDefaults(_Settings):
    """Every InferenceService's spec.flowControl where it leaves a field unset (chart: flowControl.*);
    also the effective flowControl of one service (effective_flow_control). The built-in values
    are the router's own (router/config/flow.py)."""

    enabled: bool = False
    fairness_header: str = Field("x-gateway-inference-fairness-id", pattern=r"^[a-z0-9-]{1,64}$")
    max_queued_per_band: int = Field(256, ge=0, le=1000000)
    max_queue_wait_seconds: float = Field(30.0, ge=0, le=3600)
    max_running_per_worker: int = Field(0, ge=0, le=1000000)
    reserved_running: int = Field(0, ge=0, le=1000000)
    queue_depth_threshold: int = Field(5, ge=1, le=1000000)
    kv_cache_threshold: float = Field(0.8, ge=0.01, le=1)


class OperatorSettings(_Settings):
    image: ImageDefaults = ImageDefaults()
    autoscaling: AutoscalingDefaults = AutoscalingDefaults()
    reconcile: ReconcileSettings = ReconcileSettings()
    network_policy: NetworkPolicyDefaults = NetworkPolicyDefaults()
    security: SecurityDefaults = SecurityDefaults()
    kv_cache: KvCacheDefaults = KvCacheDefaults()
    flow_control: FlowControlDefaults = FlowControlDefaults()


def load_settings(path: str | None) -> OperatorSettings:
    """Settings from the chart's defaults file (None: the built-in defaults)."""
    if not path:
        return OperatorSettings()
    return OperatorSettings.model_validate(yaml.safe_load(pathlib.Path(path).read_text()) or {})


@dataclass(frozen=True)
class Autoscaling:
    """One pool's autoscaling after merging spec, chart values and built-ins."""

    enabled: bool
    provider: str
    min_replicas: int
    max_replicas: int
    target_queue_depth: float
    polling_interval: int
    cooldown_period: int
    prometheus_address: str
    planner_url: str = ""


def effective_autoscaling(spec: AutoscalingSpec, settings: OperatorSettings, role: str) -> Autoscaling:
    cluster = settings.autoscaling
    pool = cluster.prefill if role == "prefill" else cluster.decode
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return Autoscaling(
        enabled=pick(spec.enabled, cluster.enabled),
        provider=pick(spec.provider, cluster.provider),
        min_replicas=pick(spec.min_replicas, pool.min_replicas),
        max_replicas=pick(spec.max_replicas, pool.max_replicas),
        target_queue_depth=pick(spec.target_queue_depth, pool.target_queue_depth),
        polling_interval=pick(spec.polling_interval, cluster.polling_interval),
        cooldown_period=pick(spec.cooldown_period, cluster.cooldown_period),
        prometheus_address=cluster.prometheus_address,
        planner_url=cluster.planner_url,
    )


def effective_kv_cache(spec: KvCacheSpec, settings: OperatorSettings) -> KvCacheDefaults:
    """A service's KV tier and pull settings: each spec.kvCache field if set, else the chart's."""
    return settings.kv_cache.model_copy(update={k: v for k, v in spec.model_dump().items() if v is not None})


def effective_flow_control(spec: FlowControlSpec, settings: OperatorSettings) -> FlowControlDefaults:
    """A service's flow-control bounds: each spec.flowControl field if set, else the chart's
    (objectives and the default objective are the service's own)."""
    fields = set(FlowControlDefaults.model_fields)
    return settings.flow_control.model_copy(
        update={k: v for k, v in spec.model_dump().items() if v is not None and k in fields}
    )
