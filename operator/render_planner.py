"""The SLA planner's view of one InferenceService: ConfigMap `<name>-planner`.

Rendered when both pools are autoscaled with provider planner (checks.py refuses one pool
only). The cluster planner (planner/cluster.py) lists these ConfigMaps in every namespace by
their labels (component=planner, managed-by=splitserve-operator) and plans one service per
ConfigMap; the operator's garbage collection removes it with the InferenceService, or when the
provider changes, so a service leaves the planner's care exactly when this object goes.

    config.json    what is effective after the chart's defaults: spec.slo, each pool's
                   workload (its Deployment, or LeaderWorkerSet when its workers span nodes),
                   the selector of its serving pods (a LeaderWorkerSet's leaders: a group of pods
                   is one replica) and min/max replicas, the router's pod selector,
                   the metrics ports, the export (keda | scale, chart autoscaling.plannerExport)
                   and spec.slo.profileConfigMap if the service names its own capacity profile
    profile.json   the chart's default capacity profile (autoscaling.plannerProfile, the JSON
                   of `splitserve profile`), when the service names none and the chart has one

Export `keda`: render_scaling.py adds a ScaledObject with a metrics-api trigger per pool.
Export `scale`: no autoscaler object at all; the planner writes the workloads' scale
subresource, and apply.py leaves their replicas alone (annotation replicas-owner: planner).
"""

from __future__ import annotations

import json

from splitserve.operator import constants as C
from splitserve.operator.context import Context, Manifest

CONFIG_KEY, PROFILE_KEY = "config.json", "profile.json"


def planned(ctx: Context) -> bool:
    autos = [ctx.autoscaling(p) for p in ctx.pools]
    return (
        len(ctx.pools) == 2 and ctx.spec.slo is not None and all(a.enabled and a.provider == "planner" for a in autos)
    )


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def planner_config(ctx: Context) -> dict:
    slo = ctx.spec.slo
    pools = {}
    for pool in ctx.pools:
        auto = ctx.autoscaling(pool)
        api_version, kind, name = ctx.workload(pool)
        pools[pool] = {
            "workload": {"apiVersion": api_version, "kind": kind, "name": name},
            "selector": _selector(ctx.serving_selector(pool)),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
        }
    return {
        "name": ctx.name,
        "slo": {"ttftP90Ms": slo.ttft_p90_ms, "itlP90Ms": slo.itl_p90_ms},
        "export": ctx.settings.autoscaling.planner_export,
        "pools": pools,
        "router": {"selector": _selector(ctx.selector("router")), "metricsPort": C.ROUTER_METRICS_PORT},
        "workerMetricsPort": C.METRICS_PORT,
        "profileConfigMap": slo.profile_config_map,
    }


def planner_config_map(ctx: Context) -> Manifest | None:
    if not planned(ctx):
        return None
    data = {CONFIG_KEY: json.dumps(planner_config(ctx), indent=1, sort_keys=True)}
    if ctx.spec.slo.profile_config_map is None and ctx.settings.autoscaling.planner_profile:
        data[PROFILE_KEY] = ctx.settings.autoscaling.planner_profile
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.meta(ctx.child("planner"), "planner"),
        "data": data,
    }
