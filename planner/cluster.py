"""The cluster planner: one process (leader-elected) sizes every planner-managed InferenceService.

`step()` runs every few seconds (`LeaseConfig.retry_s`):
1. Leader election (lease.py). A follower forgets its loops and serves nothing (its /ready and
   /v1/desired answer 503, so KEDA's requests through the Service reach only the leader).
2. Every `tick_s`, the leader lists the operator's planner ConfigMaps in all namespaces
   (plan_loop.py): one control loop per InferenceService, created on first sight with the
   Deployments' current replicas as its targets, so a new leader continues where the old one
   stopped instead of restarting from the floor. A loop whose ConfigMap is gone is dropped.
3. Per service: the workloads (Deployments, or LeaderWorkerSets counted in groups) and serving
   pods of both pools (pods.py: ready, pending, ages), the
   /metrics of every ready router and worker pod at its pod IP (signals.py), the law's decision,
   published to the store (KEDA reads it) and, with export `scale`, written to each Deployment's
   scale subresource when it differs. The operator leaves a planner pool's replicas alone after
   creating it, so the planner is that workload's one writer.
One service's failure (a bad ConfigMap, an API error) is logged and held; the others go on.
"""

from __future__ import annotations

import datetime
import logging
import time
import urllib.request
from collections.abc import Callable

from splitserve.planner import signals as S
from splitserve.planner.config import POOLS, PlannerConfig
from splitserve.planner.kube import KubeClient, ns_path
from splitserve.planner.law import Planner
from splitserve.planner.lease import LeaderElector
from splitserve.planner.plan_loop import PLANNER_SELECTOR, PROFILE_KEY, PodScrape, ServiceLoop, ServicePlan
from splitserve.planner.pods import pool_state
from splitserve.planner.profile import CapacityProfile
from splitserve.planner.server import DesiredStore
from splitserve.platform.errors import ConfigError

log = logging.getLogger(__name__)


def http_fetch(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


class ClusterPlanner:
    def __init__(
        self,
        kube: KubeClient,
        elector: LeaderElector,
        store: DesiredStore,
        base: PlannerConfig,
        fetch: Callable[[str], str] = http_fetch,
        clock=time.monotonic,
    ) -> None:
        self.kube, self.elector, self.store, self.base = kube, elector, store, base
        self.fetch, self.clock = fetch, clock
        self.loops: dict[tuple[str, str], ServiceLoop] = {}
        self._next_tick = 0.0
        self.scale_writes = 0

    def step(self) -> bool:
        leader = self.elector.tick()
        self.store.set_leader(leader)
        if not leader:
            if self.loops:
                log.warning("planner: not the leader any more; dropping %d service loops", len(self.loops))
            self.loops.clear()
            self._next_tick = 0.0
            return False
        now = self.clock()
        if now >= self._next_tick:
            self._next_tick = now + self.base.tick_s
            self.decide_all(now)
        return True

    def decide_all(self, now: float) -> None:
        seen = set()
        for cm in self.kube.list(ns_path("/api/v1", None, "configmaps"), PLANNER_SELECTOR):
            key = (cm["metadata"]["namespace"], cm["metadata"]["name"])
            try:
                plan = ServicePlan.from_configmap(cm)
                seen.add((plan.namespace, plan.name))
                self.decide(plan, now)
            except Exception as exc:  # one service's trouble must not stop the others
                log.warning("planner: %s/%s: %s (holding)", *key, exc)
        for key in set(self.loops) - seen:
            del self.loops[key]
            self.store.forget(*key)

    def _profile_text(self, plan: ServicePlan) -> str:
        text = plan.profile_json
        if plan.profile_config_map:
            cm = self.kube.get(ns_path("/api/v1", plan.namespace, "configmaps", plan.profile_config_map))
            text = ((cm or {}).get("data") or {}).get(PROFILE_KEY)
            if text is None:
                raise ConfigError(f"ConfigMap {plan.namespace}/{plan.profile_config_map} has no {PROFILE_KEY}")
        if not text:
            raise ConfigError("no capacity profile: set spec.slo.profileConfigMap or the chart's planner.profile")
        return text

    def decide(self, plan: ServicePlan, now: float) -> None:
        key = (plan.namespace, plan.name)
        workloads = {p: self.kube.get(plan.pool(p).workload.path(plan.namespace)) for p in POOLS}
        if any(w is None for w in workloads.values()):
            raise ConfigError("its workloads (Deployments or LeaderWorkerSets) do not exist yet")
        replicas = {p: int(w["spec"].get("replicas") or 0) for p, w in workloads.items()}
        profile = self._profile_text(plan)  # read every tick: an edited profile takes effect
        loop = self.loops.get(key)
        if loop is None or loop.plan != plan or loop.profile_text != profile:
            planner = Planner(plan.planner_config(self.base), CapacityProfile.from_json(profile), initial=replicas)
            loop = self.loops[key] = ServiceLoop(plan, planner)
            loop.profile_text = profile
        wall = datetime.datetime.now(datetime.UTC)
        pools, scrapes = {}, []
        for p in POOLS:
            pods = self.kube.list(ns_path("/api/v1", plan.namespace, "pods"), plan.pool(p).selector)
            pools[p], ready = pool_state(pods, replicas[p], wall)
            scrapes += [PodScrape(p, pod, self._scrape(pod.ip, plan.worker_metrics_port)) for pod in ready]
        routers = self.kube.list(ns_path("/api/v1", plan.namespace, "pods"), plan.router_selector)
        _, ready_routers = pool_state(routers, 0, wall)
        scrapes += [PodScrape("router", pod, self._scrape(pod.ip, plan.router_metrics_port)) for pod in ready_routers]
        decision = loop.planner.tick(loop.observe(now, pools, scrapes))
        self.store.publish(plan.namespace, plan.name, decision)
        if plan.export == "scale":
            for p, want in decision.desired().items():
                if want != replicas[p]:
                    self._write_scale(plan, p, want, replicas[p], getattr(decision, p).reason)

    def _scrape(self, ip: str, port: int) -> dict[str, float] | None:
        if not ip:
            return None
        try:
            return S.flatten(self.fetch(f"http://{ip}:{port}/metrics"))
        except (OSError, ValueError) as exc:
            log.warning("planner: cannot read http://%s:%d/metrics (%s)", ip, port, exc)
            return None

    def _write_scale(self, plan: ServicePlan, pool: str, want: int, have: int, reason: str) -> None:
        url = plan.pool(pool).workload.path(plan.namespace) + "/scale"
        self.kube.merge_patch(url, {"spec": {"replicas": want}})
        self.scale_writes += 1
        log.warning("planner: %s/%s %s %d -> %d (%s)", plan.namespace, plan.name, pool, have, want, reason)
