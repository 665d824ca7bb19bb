"""`splitserve serve --backend ray`: the config file, validated, and its rendering into a Ray Serve
deploy config (the `applications:` document `serve run`/KubeRay's `serveConfigV2` take).

    backend: ray
    model: smollm2-135m
    kv_transport: tcp                 # ucx | tcp: how KV blocks travel between replicas
    worker_host: ""                   # "": replicas bind 0.0.0.0 and advertise their node IP
    ray:      {address: local, num_cpus: 2, include_dashboard: false, temp_dir: ""}
    router:   {gateway: {host: 127.0.0.1, port: 8000}, placement: ...}   # docs/router.md
    engine:   {dtype: float32, device: cpu, threads: 1, kv_cache_memory_gib: 0.25, ...}   # any worker setting
    prefill:  {min_replicas: 1, max_replicas: 2, target_queue_depth: 4, ray_actor_options: {num_cpus: 1}}
    decode:   {min_replicas: 1, max_replicas: 4, target_queue_depth: 8, ray_actor_options: {num_gpus: 1},
               tensor_parallel_size: 1}   # > 1: one placement group per replica, a bundle per rank (placement.py)
    autoscaling: {look_back_period_s: 10, upscale_delay_s: 5, downscale_delay_s: 60, metrics_interval_s: 1}
    security: {tls_cert, tls_key, tls_ca, kv_secret_file, insecure: false}   # local: throwaway if empty
    otlp_traces_endpoint: ""          # OTLP gRPC collector for request traces (observability/tracing.py); "": off
    otlp_traces_sample_ratio: 1.0     # for requests without a sampled traceparent

Three Serve applications come out of `render()`, wired only by names and import paths (so the
process that deploys them never imports the engine, and neither the ingress nor the replicas
import each other): `<name>` (the gateway ingress + the worker registry, routed at /),
`<name>-prefill` and `<name>-decode` (one `WorkerReplica` deployment each, no HTTP route).
Each pool autoscales on the engines' queue depth (rayserve/autoscale.py, docs/ray.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError
from splitserve.platform.settings.worker_args import LAUNCHER_DECIDES, WorkerArgs, for_role, with_flow_control
from splitserve.rayserve import placement
from splitserve.router.config import RouterConfig
from splitserve.router.config.file import checked_mapping, from_dict, read_mapping

BACKENDS = ("ray",)
TRANSPORTS = ("ucx", "tcp")
ACTOR_OPTIONS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "runtime_env")
POLICY = "splitserve.rayserve.autoscale:queue_depth_policy"
GiB = 1024**3
MAX_TENSOR_PARALLEL_SIZE = 64
# How long a request that finds no decode replica waits for one (router gateway.worker_wait_s):
# the router's 1 s default suits a fleet that is up; on Ray the gateway answers while replicas
# still load (Serve's proxy and the ingress come up first), and a replica Serve replaces takes
# as long as a start. A request in those seconds waits, then gets its 503.
RAY_WORKER_WAIT_S = 60.0


@dataclass(frozen=True)
class RayClusterConfig:
    """`address`: "local" starts a Ray instance owned by this process (stopped with it); "auto",
    "host:port" or "ray://..." joins a running cluster (KubeRay). The rest applies to "local"."""

    address: str = "local"
    num_cpus: int | None = None
    include_dashboard: bool = False
    temp_dir: str = ""
    namespace: str = "splitserve"

    def __post_init__(self) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"ray.num_cpus={self.num_cpus} must be >= 1 (or left out: all cores)")


# The worker settings the config decides with its own keys (model, kv_transport, worker_host,
# security) or per replica (role, port 0 everywhere); `engine:` takes every other worker setting
# (platform/settings/worker_args.py), over Ray's defaults: one thread and a small cache per replica.
# Tensor parallelism is a pool's (`prefill.tensor_parallel_size`: its placement group is sized by
# it), and a Ray replica's ranks share one node (STRICT_PACK), so the multi-node flags stay unset.
RAY_DECIDES = (*LAUNCHER_DECIDES, "tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port")
ENGINE_DEFAULTS = {"threads": 1, "kv_cache_memory_gib": 0.25, "max_num_batched_tokens": 512, "max_model_len": 2048}
# What every rendered `engine:` spells out, even at the worker's default.
ENGINE_EXPLICIT = ("dtype", "device", "threads", "quantization", "kv_cache_memory_gib", "block_size", "max_num_seqs")


def engine_settings(data: dict | None = None) -> WorkerArgs:
    """The config's `engine:` section as worker settings; a ConfigError names what is not allowed."""
    data = {} if data is None else checked_mapping(data, WorkerArgs, "engine")
    decided = sorted(set(data) & set(RAY_DECIDES))
    if decided:
        raise ConfigError(
            f"engine: {decided} are decided by the config's own keys (model, kv_transport, worker_host, "
            "security) and per replica; allowed in engine: every other `splitserve worker` setting"
        )
    return WorkerArgs.from_dict({**ENGINE_DEFAULTS, **data}, "engine")


def engine_args(settings: WorkerArgs) -> dict:
    """The `engine` a replica gets (render): the non-default settings and ENGINE_EXPLICIT, as YAML values."""
    keep = {**{name: getattr(settings, name) for name in ENGINE_EXPLICIT}, **settings.non_defaults()}
    return {name: list(v) if isinstance(v, tuple) else v for name, v in keep.items() if name not in RAY_DECIDES}


def pool_engine_args(config: RayServeConfig, role: str) -> dict:
    """The engine settings a pool decides for its replicas: its tensor-parallel size."""
    tp = getattr(config, role).tensor_parallel_size
    return {"tensor_parallel_size": tp} if tp > 1 else {}


def replica_settings(
    role: str, model: str, kv_transport: str, engine: dict, host: str, advertise: str, security: dict
) -> WorkerArgs:
    """A replica's worker settings from its app's args (render). `host` "" binds all interfaces and
    advertises `advertise` (the replica's node IP). Port 0 everywhere: the worker binds what the
    kernel picks and says which once ready (a port probed free could be taken before it is bound)."""
    files = {k: v for k, v in security.items() if k in ("tls_cert", "tls_key", "tls_ca", "kv_secret_file")}
    settings = WorkerArgs.from_dict(engine, "engine").replace(
        model=model,
        kv_transport=kv_transport,
        host=host or "0.0.0.0",
        advertise_host="" if host else advertise,
        grpc_port=0,
        metrics_port=0,
        kv_port=0,
        drain_grace_s=10.0,
        **files,
    )
    return for_role(settings, role)


@dataclass(frozen=True)
class PoolConfig:
    """One worker pool as a Serve deployment: replicas between `min_replicas` and `max_replicas`,
    targeting `target_queue_depth` waiting+running requests per replica. `ray_actor_options`
    are passed to Serve as they are (CPUs, GPUs, memory, custom resources, runtime_env).
    `tensor_parallel_size` (the worker's --tensor-parallel-size): ranks per replica, each reserved
    as a bundle of the replica's placement group (rayserve/placement.py)."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_depth: float = 4.0
    ray_actor_options: dict = field(default_factory=lambda: {"num_cpus": 1})
    tensor_parallel_size: int = 1

    def check(self, role: str) -> None:
        if self.min_replicas < 1:
            raise ConfigError(
                f"{role}.min_replicas={self.min_replicas}: a pool needs at least 1 replica "
                "(the router cannot wake a pool from zero); allowed: >= 1"
            )
        if self.max_replicas < self.min_replicas:
            raise ConfigError(
                f"{role}.max_replicas={self.max_replicas} is below {role}.min_replicas="
                f"{self.min_replicas}; allowed: max_replicas >= min_replicas"
            )
        if self.target_queue_depth <= 0:
            raise ConfigError(f"{role}.target_queue_depth={self.target_queue_depth} must be > 0")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE:
            raise ConfigError(
                f"{role}.tensor_parallel_size={tp!r}; allowed: an integer from 1 to {MAX_TENSOR_PARALLEL_SIZE}"
            )
        if not isinstance(self.ray_actor_options, dict):
            raise ConfigError(f"{role}.ray_actor_options must be a mapping; allowed keys: {', '.join(ACTOR_OPTIONS)}")
        unknown = sorted(set(self.ray_actor_options) - set(ACTOR_OPTIONS))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {unknown} in {role}.ray_actor_options; allowed: {', '.join(ACTOR_OPTIONS)}"
            )


@dataclass(frozen=True)
class AutoscalingTiming:
    """How fast the pools react. `metrics_interval_s` is how often each replica reports its
    queue depth to the Serve controller; the policy averages over `look_back_period_s`."""

    look_back_period_s: float = 10.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    metrics_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.look_back_period_s <= self.metrics_interval_s or self.metrics_interval_s <= 0:
            raise ConfigError(
                f"autoscaling: need 0 < metrics_interval_s ({self.metrics_interval_s}) < "
                f"look_back_period_s ({self.look_back_period_s})"
            )
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ConfigError("autoscaling: upscale_delay_s and downscale_delay_s must be >= 0")


@dataclass(frozen=True)
class SecuritySettings:
    """mTLS on the replicas' gRPC (gateway -> replicas, decode -> prefill) and KV-transfer
    authentication, as `splitserve worker`'s --tls-cert/--tls-key/--tls-ca/--kv-secret-file: files
    the gateway and every replica can read (on a cluster, e.g. a Secret mounted on every node).
    All left empty with `ray.address: local`: `splitserve serve` makes a throwaway CA, key pair and
    KV secret for the run (as `splitserve up`). On a cluster they must be named, or `insecure: true`."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    kv_secret_file: str = ""
    insecure: bool = False
    """Plaintext gRPC and KV blocks from anyone who reaches a replica's port (the replicas log INSECURE)."""

    def __post_init__(self) -> None:
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ConfigError("security: tls_cert, tls_key and tls_ca go together (name all three, or none)")
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"security.insecure={self.insecure!r} must be true or false")

    @property
    def is_complete(self) -> bool:
        return bool(self.tls_cert and self.kv_secret_file)

    def worker_args(self) -> dict:
        """What each replica gets (render): the four files, or none when insecure."""
        if self.insecure:
            return {}
        return {
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
            "tls_ca": self.tls_ca,
            "kv_secret_file": self.kv_secret_file,
        }


@dataclass(frozen=True)
class RayServeConfig:
    backend: str = "ray"
    name: str = "splitserve"
    model: str = "smollm2-135m"
    kv_transport: str = "tcp"
    worker_host: str = ""  # "" : bind all interfaces, advertise the replica's node IP
    ray: RayClusterConfig = field(default_factory=RayClusterConfig)
    router: dict = field(default_factory=dict)
    engine: WorkerArgs = field(default_factory=engine_settings)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    autoscaling: AutoscalingTiming = field(default_factory=AutoscalingTiming)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    otlp_traces_endpoint: str = ""
    otlp_traces_sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"backend={self.backend!r} is not supported by `splitserve serve`; allowed: "
                f"{', '.join(BACKENDS)} (Kubernetes: the operator, docs/ray.md)"
            )
        if self.kv_transport not in TRANSPORTS:
            raise ConfigError(f"kv_transport={self.kv_transport!r} is not supported; allowed: {', '.join(TRANSPORTS)}")
        self.prefill.check("prefill")
        self.decode.check("decode")
        for role in ("prefill", "decode"):
            try:
                deployment_options(self, role)  # a placement the pool cannot have fails now, not at deploy
            except ConfigError as exc:
                raise ConfigError(f"{role}: {exc}") from None
        if not (self.security.insecure or self.security.is_complete or self.ray.address == "local"):
            raise ConfigError(
                f"security: on a Ray cluster (ray.address {self.ray.address!r}) name tls_cert, tls_key, "
                "tls_ca and kv_secret_file (files every node can read, e.g. a mounted Secret), or set "
                "security.insecure: true (plaintext gRPC, unauthenticated KV transfer)"
            )
        self.router_config()  # fail now on a bad router section
        self.tracing("decode")  # fail now on a bad endpoint or ratio

    def tracing(self, role: str):
        """The TracingConfig of a replica of `role` (the OTEL_* variables of its process apply under it)."""
        from splitserve.platform.observability import tracing

        return tracing.config_from(role, self.otlp_traces_endpoint or None, self.otlp_traces_sample_ratio)

    def router_config_dict(self) -> dict:
        """The router section with what the engines decide (model, lengths, block size) on top, and
        the Ray default of gateway.worker_wait_s (RAY_WORKER_WAIT_S) unless the section sets one."""
        gateway = self.router.get("gateway") if isinstance(self.router.get("gateway"), dict) else {}
        out = {
            **self.router,
            "gateway": {"worker_wait_s": RAY_WORKER_WAIT_S, **gateway},
            "model": self.model,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.block_size,
        }
        if self.security.tls_cert and not self.security.insecure:  # the gateway dials replicas with mTLS
            discovery = self.router.get("discovery") if isinstance(self.router.get("discovery"), dict) else {}
            out["discovery"] = {
                **discovery,
                "tls_cert": self.security.tls_cert,
                "tls_key": self.security.tls_key,
                "tls_ca": self.security.tls_ca,
            }
        return out

    def router_config(self) -> RouterConfig:
        return from_dict(self.router_config_dict())

    @property
    def gateway(self) -> tuple[str, int]:
        gw = self.router_config().gateway
        return gw.host, gw.port


_SECTIONS = {
    "ray": RayClusterConfig,
    "prefill": PoolConfig,
    "decode": PoolConfig,
    "autoscaling": AutoscalingTiming,
    "security": SecuritySettings,
}


def load(path: str, **overrides) -> RayServeConfig:
    """The file (YAML) with top-level `overrides` (None: keep the file's) applied."""
    data = read_mapping(path, "config")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse(data)


def parse(data: dict) -> RayServeConfig:
    kwargs = dict(checked_mapping(data, RayServeConfig, "the config"))
    for key, cls in _SECTIONS.items():
        if key in kwargs:
            kwargs[key] = cls(**checked_mapping(kwargs[key], cls, key))
    if "engine" in kwargs:
        kwargs["engine"] = engine_settings(kwargs["engine"])
    if "router" in kwargs and not isinstance(kwargs["router"], dict):
        raise ConfigError(f"router must be a mapping (docs/router.md), got {type(kwargs['router']).__name__}")
    try:
        return RayServeConfig(**kwargs)
    except TypeError as exc:  # a value of the wrong type that a comparison tripped over
        raise ConfigError(f"bad value in the config: {exc}") from None


def registry_ref(config: RayServeConfig) -> dict:
    return {"app": config.name, "deployment": "WorkerRegistry"}


def render(config: RayServeConfig) -> dict:
    """The Serve deploy config (ServeDeploySchema as a dict): what `serve run`, `serve deploy`
    and a KubeRay RayService's `serveConfigV2` take. Pure: no Ray needed."""
    host, port = config.gateway
    engine = with_flow_control(config.engine, config.router_config().flow_control.enabled)
    apps = [
        {
            "name": config.name,
            "route_prefix": "/",
            "import_path": "splitserve.rayserve.ingress:build_gateway",
            "args": {
                "router": config.router_config_dict(),
                "registry": registry_ref(config),
                "tracing": {"endpoint": config.otlp_traces_endpoint, "sample_ratio": config.otlp_traces_sample_ratio},
            },
        }
    ]
    for role in ("prefill", "decode"):
        apps.append(
            {
                "name": f"{config.name}-{role}",
                "route_prefix": None,
                "import_path": "splitserve.rayserve.replica:build_pool",
                "args": {
                    "role": role,
                    "model": config.model,
                    "kv_transport": config.kv_transport,
                    "engine": {**engine_args(engine), **pool_engine_args(config, role)},
                    "registry": registry_ref(config),
                    "host": config.worker_host,
                    "security": config.security.worker_args(),
                    "tracing": {
                        "endpoint": config.otlp_traces_endpoint,
                        "sample_ratio": config.otlp_traces_sample_ratio,
                    },
                },
                # Serve's own per-deployment overrides: what a RayService user tunes.
                "deployments": [deployment_options(config, role)],
            }
        )
    return {"proxy_location": "HeadOnly", "http_options": {"host": host, "port": port}, "applications": apps}


def deployment_options(config: RayServeConfig, role: str) -> dict:
    pool: PoolConfig = getattr(config, role)
    timing = config.autoscaling
    return {
        "name": f"{role}",
        "ray_actor_options": dict(pool.ray_actor_options),
        **placement.placement_options(
            pool.tensor_parallel_size, config.engine.device, config.engine.threads, pool.ray_actor_options
        ),
        "autoscaling_config": {
            "min_replicas": pool.min_replicas,
            "max_replicas": pool.max_replicas,
            "initial_replicas": pool.min_replicas,
            "target_ongoing_requests": pool.target_queue_depth,
            "look_back_period_s": timing.look_back_period_s,
            "metrics_interval_s": timing.metrics_interval_s,
            "upscale_delay_s": timing.upscale_delay_s,
            "downscale_delay_s": timing.downscale_delay_s,
            # target_ongoing_requests above is read by the policy as the target queue depth.
            "policy": {"policy_function": POLICY},
        },
        # The router drives the replicas over gRPC, not through handles: no handle queueing.
        "max_ongoing_requests": 1000,
        "graceful_shutdown_timeout_s": 20,
        "health_check_period_s": 2,
        "health_check_timeout_s": 10,
    }
