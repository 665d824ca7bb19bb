"""One InferenceService as the cluster planner sees it: its plan (from the operator's ConfigMap)
and its control loop (scrapes in, law.py's Observation out).

The operator renders, for every InferenceService whose pools use autoscaling provider planner,
a ConfigMap `<name>-planner` labelled component=planner (operator/render_planner.py) holding
- config.json: the SLO, each pool's workload (a Deployment, or a LeaderWorkerSet when its
  workers span nodes), the selector of its serving pods and replica bounds (after the chart's
  defaults; a LeaderWorkerSet's replicas and serving pods are its groups and their leaders, so
  a group of pods counts as one replica here), the router's pod selector, the metrics ports,
  the export (keda: KEDA reads the planner's JSON; scale: the planner writes the workloads'
  scale subresource) and, if the
  InferenceService names one, the ConfigMap holding its capacity profile;
- profile.json: the chart's default capacity profile, when the service names none.
The operator owns what is effective; the planner only reads it, so the two never disagree on
bounds or on who writes replicas.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from splitserve.planner import signals as S
from splitserve.planner.capacity import ReplicaSample
from splitserve.planner.config import POOLS, PlannerConfig, PoolBounds
from splitserve.planner.kube import ns_path
from splitserve.planner.law import Observation, Planner, PoolObservation
from splitserve.planner.pods import ReadyPod
from splitserve.planner.window import measured_latency
from splitserve.platform.errors import ConfigError

PLANNER_SELECTOR = "app.kubernetes.io/component=planner,app.kubernetes.io/managed-by=splitserve-operator"
CONFIG_KEY, PROFILE_KEY = "config.json", "profile.json"
EXPORTS = ("keda", "scale")


WORKLOAD_PLURALS = {"Deployment": "deployments", "LeaderWorkerSet": "leaderworkersets"}


@dataclass(frozen=True)
class Workload:
    """The object that owns a pool's replica count (spec.replicas and a scale subresource)."""

    api_version: str
    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_PLURALS:
            raise ConfigError(f"a pool's workload must be one of {', '.join(WORKLOAD_PLURALS)}, got {self.kind!r}")

    def path(self, namespace: str) -> str:
        return ns_path(f"/apis/{self.api_version}", namespace, WORKLOAD_PLURALS[self.kind], self.name)

    @classmethod
    def from_config(cls, pool: dict) -> Workload:
        """The pool's `workload`; a ConfigMap from an operator before LeaderWorkerSets names a `deployment`."""
        if "workload" not in pool:
            return cls("apps/v1", "Deployment", pool["deployment"])
        w = pool["workload"]
        return cls(w["apiVersion"], w["kind"], w["name"])


@dataclass(frozen=True)
class PoolPlan:
    workload: Workload
    selector: str
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class ServicePlan:
    namespace: str
    name: str
    ttft_p90_ms: int
    itl_p90_ms: int
    export: str
    prefill: PoolPlan
    decode: PoolPlan
    router_selector: str
    router_metrics_port: int
    worker_metrics_port: int
    profile_config_map: str | None = None
    profile_json: str | None = None

    def __post_init__(self) -> None:
        if self.export not in EXPORTS:
            raise ConfigError(f"planner export must be one of {', '.join(EXPORTS)}, got {self.export!r}")
        if self.ttft_p90_ms <= 0 or self.itl_p90_ms <= 0:
            raise ConfigError("the SLO's ttftP90Ms and itlP90Ms must be > 0")

    @classmethod
    def from_configmap(cls, cm: dict) -> ServicePlan:
        data = cm.get("data") or {}
        try:
            raw = json.loads(data[CONFIG_KEY])
            pools = {
                p: PoolPlan(
                    Workload.from_config(raw["pools"][p]),
                    raw["pools"][p]["selector"],
                    int(raw["pools"][p]["minReplicas"]),
                    int(raw["pools"][p]["maxReplicas"]),
                )
                for p in POOLS
            }
            return cls(
                namespace=cm["metadata"]["namespace"],
                name=raw["name"],
                ttft_p90_ms=int(raw["slo"]["ttftP90Ms"]),
                itl_p90_ms=int(raw["slo"]["itlP90Ms"]),
                export=raw["export"],
                prefill=pools["prefill"],
                decode=pools["decode"],
                router_selector=raw["router"]["selector"],
                router_metrics_port=int(raw["router"]["metricsPort"]),
                worker_metrics_port=int(raw["workerMetricsPort"]),
                profile_config_map=raw.get("profileConfigMap"),
                profile_json=data.get(PROFILE_KEY),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"ConfigMap {cm.get('metadata', {}).get('name')}: not a planner config: {e!r}") from e

    def pool(self, pool: str) -> PoolPlan:
        return self.prefill if pool == "prefill" else self.decode

    def planner_config(self, base: PlannerConfig) -> PlannerConfig:
        return dataclasses.replace(
            base,
            ttft_p90_s=self.ttft_p90_ms / 1000,
            itl_p90_s=self.itl_p90_ms / 1000,
            prefill=PoolBounds(self.prefill.min_replicas, self.prefill.max_replicas),
            decode=PoolBounds(self.decode.min_replicas, self.decode.max_replicas),
        )


@dataclass(frozen=True)
class PodScrape:
    """One pod's /metrics this tick (`flat` None: it could not be read)."""

    role: str  # "router", "prefill" or "decode"
    pod: ReadyPod
    flat: dict[str, float] | None


class ServiceLoop:
    """The planner and the previous scrape of every pod of one service."""

    def __init__(self, plan: ServicePlan, planner: Planner) -> None:
        self.plan, self.planner = plan, planner
        self.profile_text = ""
        self._prev: dict[str, tuple[float, dict[str, float]]] = {}

    def observe(self, now: float, pools: dict[str, PoolObservation], scrapes: list[PodScrape]) -> Observation:
        deltas: dict[str, list[tuple[PodScrape, dict[str, float], float]]] = {"router": [], "prefill": [], "decode": []}
        routers_missing = not any(s.role == "router" for s in scrapes)
        for s in scrapes:
            if s.flat is None:
                routers_missing |= s.role == "router"
                continue
            prev = self._prev.get(s.pod.name)
            if prev is not None and now > prev[0]:
                deltas[s.role].append((s, S.delta(s.flat, prev[1]), now - prev[0]))
            self._prev[s.pod.name] = (now, s.flat)
        seen = {s.pod.name for s in scrapes}
        self._prev = {k: v for k, v in self._prev.items() if k in seen}

        routers = deltas["router"]
        prompt_rate = output_rate = None
        if routers and not routers_missing:
            prompt_rate = sum(d.get("demand/uncached_prompt", 0.0) / dt for _, d, dt in routers)
            output_rate = sum(d.get("demand/output", 0.0) / dt for _, d, dt in routers)
        r = S.add_up([d for _, d, _ in routers])
        dec = S.add_up([d for _, d, _ in deltas["decode"]])
        # Requests in the tick: every one gets its first token on a decode worker; the router's
        # TTFT histogram counts only streamed ones.
        n = dec.get("ttft/count", 0.0) or r.get("rttft/count", 0.0)
        ttft, itl = measured_latency(r, dec)
        return Observation(
            now=now,
            uncached_prompt_tokens_per_s=prompt_rate,
            output_tokens_per_s=output_rate,
            prefill=pools["prefill"],
            decode=pools["decode"],
            mean_prompt_tokens=r.get("demand/uncached_prompt", 0.0) / n if n else 512.0,
            mean_output_tokens=r.get("demand/output", 0.0) / n if n else 128.0,
            inflight_decode_seqs=sum(s.flat.get("running", 0.0) for s in scrapes if s.role == "decode" and s.flat),
            queued_requests=sum(s.flat.get("queued", 0.0) for s in scrapes if s.role == "router" and s.flat),
            ttft_p90_s=ttft,
            itl_p90_s=itl,
            samples=tuple(self._samples(deltas)),
        )

    def _samples(self, deltas: dict) -> list[ReplicaSample]:
        out = []
        targets = (("prefill", "ttft", self.plan.ttft_p90_ms), ("decode", "itl", self.plan.itl_p90_ms))
        for pool, latency_key, slo_ms in targets:
            for s, d, dt in deltas[pool]:
                lat = S.p90(d, latency_key)
                out.append(
                    ReplicaSample(
                        pool=pool,
                        replica_id=s.pod.name,
                        age_s=s.pod.age_s,
                        tokens_per_s=S.replica_tokens(d, pool) / dt,
                        within_slo=lat is None or lat <= slo_ms / 1000,
                        saturated=s.flat.get("waiting", 0.0) > 0,
                    )
                )
        return out
