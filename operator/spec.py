"""The InferenceService spec: the one source of the CRD schema (see crd.py) and of the operator's
parsed view of an object.

Each field's docstring becomes its `description` in the CRD (`kubectl explain`). Defaults
declared here become schema defaults, applied by the API server. Fields the cluster's Helm
values supply (the autoscaling knobs) have *no* default here: absent means "use the chart's
value" (settings.py), so a schema default would hide the SRE's setting.

Rules where one field depends on another are CEL `x-kubernetes-validations` on the object
that holds both fields; the API server evaluates them. What no schema can know (the chart's
defaults, quantity arithmetic, child-name lengths) is checked in checks.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

# Kubernetes' resource.Quantity: an integer or a string like "500m", "16Gi", "1e3".
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    StrictInt | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)],
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
        }
    ),
]
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


def rule(expr: str, message: str) -> dict[str, str]:
    return {"rule": expr, "message": message}


class _Spec(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, use_attribute_docstrings=True
    )


class ModelStorage(_Spec):
    """A PersistentVolumeClaim holding the weights, mounted read-only into workers and router."""

    pvc_name: str = Field(min_length=1, max_length=253)
    """Name of the PersistentVolumeClaim in the InferenceService's namespace."""
    mount_path: str = Field("/models", pattern=r"^/")
    """Where the claim is mounted; `model.uri` usually points below it."""


class ModelSpec(_Spec):
    """The weights to serve and how."""

    uri: str = Field(min_length=1, max_length=1024)
    """An alias (`smollm2-135m`), a .gguf file, a Hugging Face folder, or `random:<preset>`. Never a hub: weights come
    with the image or from `storage`."""
    name: str | None = Field(None, min_length=1, max_length=256)
    """The model name clients send in OpenAI requests (default: the uri)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV cache dtype; prefill and decode always share it (their KV layouts must match)."""
    max_model_len: int = Field(4096, ge=16, le=1048576)
    """Longest prompt plus completion, in tokens."""
    storage: ModelStorage | None = None
    """Where the weights live when they are not in the image."""


class LoraAdapterSpec(_Spec):
    """A PEFT LoRA adapter every worker holds; clients select it with `model: <name>`."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    """The model name clients send for this adapter (listed in /v1/models with the base model as parent)."""
    uri: str = Field(min_length=2, max_length=1024, pattern=r"^/")
    """The adapter folder (adapter_config.json + adapter_model.safetensors) as the workers see it:
    a path on a mounted volume, e.g. below `model.storage.mountPath`."""


class EngineSpec(_Spec):
    """Engine settings shared by both pools (the router hashes blocks of the same size)."""

    block_size: Literal[8, 16, 32, 64, 128] = 16
    """Tokens per KV-cache block."""
    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Most sequences one worker batches at a time."""
    kv_cache_memory_gib: float = Field(0.5, alias="kvCacheMemoryGiB", gt=0, le=4096)
    """Memory for the KV cache per worker, in GiB; must fit in the pool's memory limit."""


class SpeculativeSpec(_Spec):
    """Speculative decoding on the decode pool, vLLM's `--speculative-config` (docs/engine.md)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "self.promptLookupMin <= self.promptLookupMax",
                    "speculative.promptLookupMin must be at most promptLookupMax",
                ),
            ]
        }
    )

    # An enum, not pydantic's `const` for a one-value Literal: structural CRD schemas drop const.
    method: Annotated[Literal["ngram"], WithJsonSchema({"type": "string", "enum": ["ngram"]})] = "ngram"
    """How proposals are made: ngram (prompt lookup: the tokens that followed the last n tokens' most recent earlier
    occurrence)."""
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    """Most tokens proposed per request and step."""
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    """Longest n-gram matched."""
    prompt_lookup_min: int = Field(2, ge=1, le=64)
    """Shortest n-gram matched."""

    def config_json(self) -> str:
        """The worker's --speculative-config value."""
        import json

        return json.dumps(
            {
                "method": self.method,
                "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max,
                "prompt_lookup_min": self.prompt_lookup_min,
            }
        )


class KvCacheSpec(_Spec):
    """KV reuse across workers and tiers (docs/kv-tiers.md): a second tier per worker and pulls. Every unset field takes
    the cluster default from the Helm chart's `kvCache.*` values (built in: no tier, disk, pulls on, 1024 blocks)."""

    tier_gib: float | None = Field(None, alias="tierGiB", ge=0, le=4096)
    """Size of each worker's second KV tier, in GiB (0: none). Blocks the KV cache evicts go there and are copied back
    on a prefix hit: host memory on GPU pools, files in an emptyDir of this size on CPU pools (count it in the pool's
    memory limit when the emptyDir is in memory)."""
    tier_medium: Literal["disk", "memory"] | None = None
    """CPU pools: the emptyDir backing the file tier, on the node's disk or in memory (tmpfs)."""
    pull: bool | None = None
    """A worker pulls a prefix another worker holds instead of recomputing it, when the router estimates that cheaper.
    """
    max_pull_blocks: int | None = Field(None, ge=1, le=1048576)
    """The most KV blocks one pull fetches; the rest of the prompt is computed."""


class AutoscalingSpec(_Spec):
    """Queue-depth autoscaling of one pool. Every unset field takes the cluster default from the Helm chart's
    `autoscaling.*` values."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                    "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
                ),
                rule(
                    "!has(self.provider) || self.provider != 'hpa' || !has(self.minReplicas) || self.minReplicas >= 1",
                    "autoscaling.minReplicas 0 (scale to zero) needs provider keda; an HPA keeps at least 1 replica",
                ),
            ]
        }
    )

    enabled: bool | None = None
    """Let an autoscaler own this pool's replicas (the operator then leaves `replicas` alone)."""
    provider: Literal["keda", "hpa", "planner"] | None = None
    """keda: a KEDA ScaledObject with a Prometheus trigger; hpa: an autoscaling/v2 HPA on a Pods metric served by
    prometheus-adapter; planner: the SLA planner sizes both pools for `spec.slo` (KEDA metrics-api trigger on the
    planner's JSON)."""
    min_replicas: int | None = Field(None, ge=0, le=1000)
    """Fewest replicas (0 scales to zero, keda only)."""
    max_replicas: int | None = Field(None, ge=1, le=1000)
    """Most replicas."""
    target_queue_depth: float | None = Field(None, gt=0, le=100000)
    """Waiting requests per replica (`vllm:num_requests_waiting`) the autoscaler aims for."""
    polling_interval: int | None = Field(None, ge=1, le=3600)
    """Seconds between KEDA's Prometheus queries."""
    cooldown_period: int | None = Field(None, ge=0, le=3600)
    """Seconds load must stay low before scaling down (KEDA cooldownPeriod, HPA scale-down stabilization)."""


class SloSpec(_Spec):
    """Latency targets the SLA planner sizes the pools for (autoscaling.provider planner)."""

    ttft_p90_ms: int = Field(alias="ttftP90Ms", ge=10, le=600000)
    """90th percentile time to first token, in milliseconds."""
    itl_p90_ms: int = Field(alias="itlP90Ms", ge=1, le=60000)
    """90th percentile inter-token latency, in milliseconds."""
    profile_config_map: str | None = Field(
        None, alias="profileConfigMap", min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
    )
    """A ConfigMap in this namespace whose key profile.json is this service's capacity profile (`splitserve profile` on
    its hardware); default: the chart's autoscaling.plannerProfile."""


class Toleration(_Spec):
    """A Kubernetes toleration."""

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Spec):
    """An environment variable: a literal value or a Kubernetes valueFrom source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule("!(has(self.value) && has(self.valueFrom))", "env: set value or valueFrom, not both")
            ]
        }
    )

    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME)
    value: str | None = None
    value_from: dict[str, Any] | None = None
    """As in a Pod spec (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


class Resources(_Spec):
    """CPU and memory requests and limits of one container. GPUs: use `gpus`; a GPU pool may name `nvidia.com/gpu`
    here to override that count (at least the ranks each pod runs)."""

    requests: dict[str, Quantity] = {}
    limits: dict[str, Quantity] = {}


class PoolSpec(_Spec):
    """One worker pool (prefill or decode). A replica is one worker: a group of `nodes` pods that together run
    `tensorParallelSize` ranks of one engine (docs/operator.md, "Models larger than one device")."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "self.tensorParallelSize % self.nodes == 0",
                    "tensorParallelSize must be divisible by nodes: each pod of a worker runs "
                    "tensorParallelSize / nodes ranks",
                ),
            ]
        }
    )

    replicas: int = Field(1, ge=0, le=1000)
    """Replicas (workers) when not autoscaled; with autoscaling the autoscaler owns the count. A worker with
    `nodes` > 1 counts once, however many pods it has."""
    gpus: int = Field(0, ge=0, le=16)
    """NVIDIA GPUs per pod; > 0 selects the CUDA image and adds the GPU toleration. With tensor parallelism every rank
    needs its own GPU: at least tensorParallelSize / nodes."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Ranks one worker splits the model across (the engine's --tensor-parallel-size): one GPU each on a GPU pool,
    one process each on CPU."""
    nodes: int = Field(1, ge=1, le=64)
    """Pods (nodes) one worker spans. 1: a Deployment of single-pod workers. > 1: a LeaderWorkerSet whose groups of
    `nodes` pods each run tensorParallelSize / nodes ranks; the leader pod (worker index 0) is the one the router,
    the EPP and the KV peers talk to."""
    resources: Resources = Resources()
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE)]] = {}
    tolerations: list[Toleration] = Field([], max_length=32)
    env: list[EnvVar] = Field([], max_length=128)
    """Extra environment variables for the worker container."""
    image: str | None = Field(None, min_length=1, max_length=512)
    """Overrides the image the operator picks (the chart's image, `-cuda` tag when gpus > 0)."""
    termination_grace_period_seconds: int = Field(120, ge=0, le=3600)
    """SIGTERM drains a worker: no new requests, in-flight ones finish within this time."""
    autoscaling: AutoscalingSpec = AutoscalingSpec()

    @model_validator(mode="after")
    def _ranks_fit_the_pods(self) -> PoolSpec:
        if self.tensor_parallel_size % self.nodes:
            divisors = [n for n in range(1, self.tensor_parallel_size + 1) if self.tensor_parallel_size % n == 0]
            raise ValueError(
                f"tensorParallelSize {self.tensor_parallel_size} is not divisible by nodes {self.nodes}: each pod "
                f"of a worker runs tensorParallelSize / nodes ranks; allowed nodes: {', '.join(map(str, divisors))}"
            )
        return self

    @property
    def ranks_per_pod(self) -> int:
        """Engine ranks in each pod of a worker (each owns one GPU on a GPU pool)."""
        return self.tensor_parallel_size // self.nodes

    @property
    def is_multi_node(self) -> bool:
        """A worker spans several pods: the pool is a LeaderWorkerSet, not a Deployment."""
        return self.nodes > 1


class ScorerWeights(_Spec):
    """Weights of the router's placement scorers (each scores in [0, 1]; the weighted sum picks)."""

    prefix: float = Field(3.0, ge=0, le=1000)
    """Prefix-cache overlap."""
    queue: float = Field(2.0, ge=0, le=1000)
    """Queue depth (fewer waiting requests score higher)."""
    kv_usage: float = Field(2.0, ge=0, le=1000)
    """Free KV cache."""
    pending: float = Field(1.0, ge=0, le=1000)
    """Requests the router just sent and the worker has not reported yet."""
    lora: float = Field(2.0, ge=0, le=1000)
    """LoRA adapter affinity (decode only): the request's adapter already runs on the worker, or it has a free adapter
    slot."""
    cache_room: float = Field(0.5, ge=0, le=1000)
    """Room in the worker's prefix cache for the blocks the request adds (decode only): a prefix no worker holds goes
    where it evicts the least."""


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class RedisSpec(_Spec):
    """The Redis every gateway process (router replicas, the EPP, the decode pods' sidecars) shares
    its prefix index, rate limits, quotas and usage through. The URL lands in a ConfigMap, so it
    may not carry credentials (no `user:password@`): the password comes from `passwordSecret`."""

    url: str = Field(pattern=r"^rediss?://[^@]+$", max_length=1024)
    """redis:// or rediss:// host, port and database, without credentials (no '@')."""
    password_secret: SecretKeyRef | None = None
    """A Secret key holding the password (passed to each gateway process as REDIS_PASSWORD)."""


class GatewayService(_Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535)


class RouterSpec(_Spec):
    """The KV-cache-aware router and OpenAI gateway."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "self.replicas <= 1 || has(self.redis)",
                    "router.redis is required when router.replicas > 1: "
                    "the replicas share one prefix index through Redis",
                ),
                rule(
                    "!has(self.apiKeys) || !has(self.allowUnauthenticated) || !self.allowUnauthenticated",
                    "router: set apiKeys or allowUnauthenticated, not both",
                ),
            ]
        }
    )

    replicas: int = Field(1, ge=1, le=100)
    scorer_weights: ScorerWeights = ScorerWeights()
    redis: RedisSpec | None = None
    resources: Resources = Resources()
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE)]] = {}
    tolerations: list[Toleration] = Field([], max_length=32)
    env: list[EnvVar] = Field([], max_length=128)
    image: str | None = Field(None, min_length=1, max_length=512)
    service: GatewayService = GatewayService()
    """The gateway Service clients call."""
    api_keys: SecretKeyRef | None = None
    """A Secret key holding the gateway's key file (YAML: `keys: [{id, sha256 or key, models, rpm, tpm,
    ...}]`, docs/security.md), mounted into the router and reloaded when the Secret changes. Absent: the
    operator generates `<name>-api-keys` with one key, id `admin` (its plaintext under the Secret key
    `admin-key`), so no gateway is open by default."""
    allow_unauthenticated: bool = False
    """Serve the gateway without API keys: anyone who reaches it may call every endpoint. The status then
    carries the condition Authenticated=False; the chart's `security.allowUnauthenticatedGateway: false`
    forbids it."""

    @model_validator(mode="after")
    def _keys_or_open(self) -> RouterSpec:
        if self.api_keys is not None and self.allow_unauthenticated:
            raise ValueError("router: set apiKeys or allowUnauthenticated, not both")
        return self


class UcxSpec(_Spec):
    tls: str | None = Field(None, max_length=256, pattern=r"^[a-z_0-9,^]+$")
    """UCX_TLS, e.g. `rc,cuda_copy,cuda_ipc` on RDMA clusters (default: UCX picks)."""
    net_devices: str | None = Field(None, max_length=256)
    """UCX_NET_DEVICES, e.g. `mlx5_0:1`."""


class KvTransferSpec(_Spec):
    """How prefill workers ship KV blocks to decode workers."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule("self.transport == 'ucx' || !has(self.ucx)", "kvTransfer.ucx applies only to transport ucx")
            ]
        }
    )

    transport: Literal["ucx", "tcp"] = "ucx"
    ucx: UcxSpec | None = None
    auth_secret: SecretKeyRef | None = None
    """A Secret key holding this service's KV-transfer secret (at least 16 bytes, e.g. `openssl rand -hex 32`):
    a decode worker then accepts blocks only from peers that prove they hold it (docs/security.md).
    Absent: the operator creates a random one in the Secret `<name>-kv` (unless `security.insecure`)."""


class DisaggregationSpec(_Spec):
    """When the router sends a prompt to a separate prefill worker."""

    mode: Literal["always", "conditional", "never"] = "conditional"
    """never: decode workers prefill locally and no prefill pool runs."""
    min_prefill_tokens: int = Field(256, ge=0, le=1048576)
    """conditional: prompts with fewer uncached tokens than this prefill on the decode worker."""


class ServiceMonitorSpec(_Spec):
    enabled: bool = False
    """Create a Prometheus-operator ServiceMonitor for the workers and the router."""
    interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m|h)$")


class MonitoringSpec(_Spec):
    service_monitor: ServiceMonitorSpec = ServiceMonitorSpec()


class PeerSpec(_Spec):
    """One allowed source of traffic: pods matching `podLabels` in namespaces matching
    `namespaceLabels` (either alone: any namespace's matching pods in this namespace / every pod of
    the matching namespaces), or an address range `cidr`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "has(self.cidr) != (has(self.namespaceLabels) || has(self.podLabels))",
                    "a peer is either a cidr or namespaceLabels/podLabels, not both and not neither",
                )
            ]
        }
    )

    namespace_labels: dict[str, Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE)]] | None = None
    """Labels of the source namespaces ({} = every namespace)."""
    pod_labels: dict[str, Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE)]] | None = None
    """Labels of the source pods ({} = every pod)."""
    cidr: str | None = Field(None, max_length=64, pattern=r"^[0-9a-fA-F.:]+/[0-9]{1,3}$")
    """An address range, e.g. a load balancer's subnet."""


class IssuerRef(_Spec):
    name: str = Field(min_length=1, max_length=253)
    kind: Literal["Issuer", "ClusterIssuer"] = "ClusterIssuer"


class TlsSpec(_Spec):
    """Mutual TLS on the Worker gRPC API (router -> workers, decode -> prefill). The certificate, its
    key and the CA come from a Secret with cert-manager's keys `tls.crt`, `tls.key`, `ca.crt`:
    `secretName`, or the Secret of the cert-manager Certificate `<name>-tls` the operator renders
    when `issuer` is set. The certificate must name `splitserve-worker` and allow server and client auth."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule("has(self.secretName) != has(self.issuer)", "tls: set exactly one of secretName or issuer")
            ]
        }
    )

    secret_name: str | None = Field(None, min_length=1, max_length=253)
    """An existing Secret (tls.crt, tls.key, ca.crt)."""
    issuer: IssuerRef | None = None
    """A cert-manager issuer: the operator renders a Certificate `<name>-tls` signed by it."""


class SecuritySpec(_Spec):
    """Transport security of the service. By default every pool runs mutual TLS on the worker gRPC
    API and authenticated KV transfer: the operator creates the KV secret (`<name>-kv`) and, unless
    `tls` names a Secret or a cert-manager issuer, its own CA (`<name>-ca`) and one certificate per
    pool (`<name>-<pool>-tls`), renewed before they expire (docs/security.md)."""

    insecure: bool = False
    """Turn the operator's default mTLS and KV authentication off (plaintext gRPC, KV blocks from anyone who
    reaches the port). Only for a trusted, isolated network; the status then carries the condition
    Secure=False. An explicit `tls` or `kvTransfer.authSecret` still applies."""


class NetworkPolicySpec(_Spec):
    """NetworkPolicies around this service's pods: worker gRPC and KV-transfer ports only from this
    service's router and workers; metrics only from the monitoring namespace (chart value
    `networkPolicy.workloads.monitoring`); the gateway port from `gatewayFrom`."""

    enabled: bool = True
    """Render the NetworkPolicies (needs a CNI that enforces them)."""
    gateway_from: list[PeerSpec] | None = Field(None, max_length=32)
    """Who may call the router's HTTP port (default: the chart's `networkPolicy.workloads.gatewayFrom`,
    which is every pod of this namespace and the ingress controller's namespace)."""


class ImageSpec(_Spec):
    repository: str | None = Field(None, min_length=1, max_length=512)
    tag: str | None = Field(None, min_length=1, max_length=128)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ParentRef(_Spec):
    """A Gateway the rendered HTTPRoute attaches to (Gateway API ParentReference)."""

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Default: the InferenceService's namespace."""
    section_name: str | None = Field(None, min_length=1, max_length=253)
    """One listener of the Gateway (default: all)."""


class GatewaySpec(_Spec):
    """How clients reach the service. `splitserve` (default): the splitserve router is the OpenAI
    gateway. `inferencePool`: an existing Gateway API inference gateway (Istio, kgateway, Envoy
    Gateway, GKE) routes to the decode pods through an InferencePool, and `splitserve epp` is its
    Endpoint Picker; each decode pod gets the P/D sidecar on `sidecarPort` (docs/operator.md)."""

    mode: Literal["splitserve", "inferencePool"] = "splitserve"
    failure_mode: Literal["FailOpen", "FailClose"] = "FailOpen"
    """What the gateway does when the EPP does not answer (InferencePool endpointPickerRef.failureMode).
    FailOpen (default): the gateway picks one of the pool's pods itself, so an EPP restart costs no
    request (the pick is only placed without prefix or load awareness, and the sidecars still check
    keys and limits); FailClose: a quick 503 until the EPP answers again (docs/router.md)."""
    epp_client_auth: bool = True
    """With TLS on (spec.security / spec.tls): the EPP admits only an ext_proc client presenting a
    certificate of the service's CA (mutual TLS), so only the gateway configured with one can make it
    work. false: TLS without client certificates (gateways that cannot present one, e.g. Istio's); the
    NetworkPolicy is then the only gate (docs/security.md)."""
    sidecar_port: int = Field(8200, ge=1024, le=65535)
    """The decode pods' sidecar port: the InferencePool's targetPort."""
    epp_replicas: int = Field(1, ge=1, le=100)
    """EPP replicas; each watches every worker, so each holds the whole prefix index."""
    parent_refs: list[ParentRef] = Field(default_factory=lambda: [ParentRef(name="inference-gateway")], max_length=16)
    """The Gateways the rendered HTTPRoute attaches to."""


class FlowObjectiveSpec(_Spec):
    """An objective clients name in the `x-gateway-inference-objective` header (GIE's InferenceObjective)."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    priority: int = Field(ge=-1000000, le=1000000)
    """The request's band: higher is more important; negative is sheddable (turned away first under saturation)."""


class FlowControlSpec(_Spec):
    """Flow control at the gateway (docs/router.md; GIE's flow control).

    Requests wait in the router by priority band and tenant while the decode pool is saturated,
    tenants of a band share fairly, sheddable bands are turned away first. Every unset field takes
    the Helm chart's `flowControl.*` value."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "!has(self.defaultObjective) || (has(self.objectives) && "
                    "self.objectives.exists(o, o.name == self.defaultObjective))",
                    "flowControl.defaultObjective must name one of flowControl.objectives",
                ),
                rule(
                    "!has(self.objectives) || self.objectives.all(a, self.objectives.exists_one(b, b.name == a.name))",
                    "flowControl.objectives must have unique names",
                ),
            ]
        }
    )

    enabled: bool | None = None
    """Queue requests in the router while the workers are saturated (off: dispatch at once, first come first served)."""
    objectives: list[FlowObjectiveSpec] = Field(default_factory=list, max_length=64)
    """Objectives and their bands. Without the header: `defaultObjective`, else the key's priority, else 0."""
    default_objective: str | None = Field(None, min_length=1, max_length=63)
    """The objective of requests that name none."""
    fairness_header: str | None = Field(None, pattern=r"^[a-z0-9-]{1,64}$")
    """The header naming the tenant (flow) (chart default x-gateway-inference-fairness-id); absent, the API key's id."""
    max_queued_per_band: int | None = Field(None, ge=0, le=1000000)
    """Requests each band's queue holds; past it 503, or 429 for a tenant over its share."""
    max_queue_wait_seconds: float | None = Field(None, ge=0, le=3600)
    """How long a request may wait in the queue before its 503."""
    max_running_per_worker: int | None = Field(None, ge=0, le=1000000)
    """Requests one router replica runs on one decode worker before the worker counts as saturated (0: no cap)."""
    reserved_running: int | None = Field(None, ge=0, le=1000000)
    """Of maxRunningPerWorker, slots only bands of 1 and above may take."""
    queue_depth_threshold: int | None = Field(None, ge=1, le=1000000)
    """A decode worker with this many waiting requests is saturated (GIE's queueDepthThreshold)."""
    kv_cache_threshold: float | None = Field(None, ge=0.01, le=1)
    """A decode worker with this fraction of its KV cache in use is saturated (GIE's kvCacheUtilThreshold)."""

    @model_validator(mode="after")
    def _objectives_are_consistent(self) -> FlowControlSpec:
        names = [o.name for o in self.objectives]
        if len(set(names)) != len(names):
            raise ValueError("flowControl.objectives must have unique names")
        if self.default_objective is not None and self.default_objective not in names:
            raise ValueError(
                f"flowControl.defaultObjective {self.default_objective!r} is not one of the objectives "
                f"({', '.join(names) or 'none'})"
            )
        return self


class InferenceServiceSpec(_Spec):
    """A disaggregated LLM service: a prefill pool, a decode pool and a router in front."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "self.disaggregation.mode != 'always' || self.prefill.replicas >= 1 || "
                    "(has(self.prefill.autoscaling.enabled) && self.prefill.autoscaling.enabled)",
                    "disaggregation.mode always needs a prefill pool: "
                    "set prefill.replicas >= 1 or enable its autoscaling",
                ),
                rule(
                    "self.decode.replicas >= 1 || "
                    "(has(self.decode.autoscaling.enabled) && self.decode.autoscaling.enabled)",
                    "decode.replicas must be at least 1 unless an autoscaler owns the pool",
                ),
                rule(
                    "has(self.slo) || "
                    "!((has(self.prefill.autoscaling.provider) && self.prefill.autoscaling.provider == 'planner')"
                    " || (has(self.decode.autoscaling.provider) && self.decode.autoscaling.provider == 'planner'))",
                    "autoscaling.provider planner needs spec.slo (ttftP90Ms and itlP90Ms): "
                    "the planner sizes the pools for them",
                ),
            ]
        }
    )

    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    image: ImageSpec = ImageSpec()
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()
    router: RouterSpec = RouterSpec()
    kv_transfer: KvTransferSpec = KvTransferSpec()
    disaggregation: DisaggregationSpec = DisaggregationSpec()
    monitoring: MonitoringSpec = MonitoringSpec()
    slo: SloSpec | None = None
    """Latency targets; required when a pool's autoscaling provider is planner."""
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    gateway: GatewaySpec = GatewaySpec()
    """The splitserve gateway (default) or an InferencePool behind your own inference gateway."""
    tls: TlsSpec | None = None
    """mTLS between router and workers from your own Secret or cert-manager issuer (absent: the operator's own CA, see
    `security`)."""
    security: SecuritySpec = SecuritySpec()
    """Secure by default: mTLS and KV authentication unless `security.insecure` is true."""
    speculative: SpeculativeSpec | None = None
    """Speculative decoding on the decode pool (absent: off)."""
    kv_cache: KvCacheSpec = KvCacheSpec()
    """KV reuse across workers and tiers: the second tier's size and pulls between workers. Unset fields take the Helm
    chart's kvCache.* values."""
    adapters: list[LoraAdapterSpec] = Field(default_factory=list, max_length=256)
    """LoRA adapters every worker of both pools holds. The router loads them on each worker when it joins, and loads and
    unloads them in place when this list changes: no pod restarts. status.<pool>.adapters lists what is loaded."""
    flow_control: FlowControlSpec = FlowControlSpec()
    """Flow control at the gateway: priority bands, tenants' fair share, dispatch held while saturated."""

    @property
    def served_model_name(self) -> str:
        return self.model.name or self.model.uri

    @property
    def is_secure(self) -> bool:
        """Whether the operator supplies mTLS and KV authentication where the spec names none."""
        return not self.security.insecure

    def has_prefill_pool(self) -> bool:
        return self.disaggregation.mode != "never"


def parse_spec(raw: dict[str, Any]) -> InferenceServiceSpec:
    """The spec of an InferenceService object (raises pydantic.ValidationError)."""
    return InferenceServiceSpec.model_validate(raw)
