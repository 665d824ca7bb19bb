"""Builders for scaling and availability: PodDisruptionBudgets, per-pool autoscalers on queue
depth, and the optional ServiceMonitor.

Autoscaling signal: `vllm:num_requests_waiting`, the requests queued on a worker. Each pool
scales on its own queue so that the replicas average `targetQueueDepth` waiting requests:

- KEDA: a ScaledObject with a Prometheus trigger. The query sums the metric over the pool's
  pods, `sum(vllm:num_requests_waiting{namespace="<ns>",pod=~"<name>-<pool>-<hash>-<id>"})`
  (the regex matches exactly the pods of the Deployment `<name>-<pool>`); with flow control
  on, the decode pool's query adds the routers' `splitserve_router_flow_queue_length` (the
  requests held in the gateway, which no worker counts), and
  metricType AverageValue with threshold = targetQueueDepth makes KEDA's HPA aim for
  ceil(sum / threshold) replicas. KEDA can scale to zero (minReplicas 0).
- HPA: an autoscaling/v2 HPA with a Pods metric. prometheus-adapter must expose the metric
  as `vllm_num_requests_waiting` (':' is not allowed in custom-metric names); the target is
  AverageValue = targetQueueDepth. The cooldown becomes the scale-down stabilization window.

- planner: the SLA planner (planner/, one per cluster) computes both pools' replicas for
  spec.slo and serves them as JSON at `<plannerUrl>/v1/desired/<namespace>/<name>`
  ({"prefill": 3, "decode": 2, ...}). Each pool gets a KEDA ScaledObject with a metrics-api
  trigger reading its pool's number (valueLocation = the pool), metricType AverageValue with
  targetValue 1: KEDA's HPA then aims for ceil(value / 1) = exactly the planner's count, and
  the operator, as for any autoscaled pool, leaves the Deployment's replicas alone (one writer).
  HPA's 10 % tolerance swallows a ±1 change once a pool has more than 10 replicas; that is
  documented in docs/operator.md. With the chart's autoscaling.plannerExport `scale` (no KEDA)
  there is no autoscaler object: the planner writes the Deployments' scale subresource.

Multi-node pools (a LeaderWorkerSet, render_pods.py) scale by groups: the autoscaler targets the
LeaderWorkerSet's scale subresource, whose replicas are groups and whose pod selector
(status.hpaPodSelector) selects the leaders; the query sums the leaders' queues, since only a
leader serves and exports the group's metrics. So a worker of N pods counts once, for KEDA, the
HPA and the planner alike.

PodDisruptionBudgets allow one voluntary disruption per pool at a time (maxUnavailable 1),
so a node drain never takes a whole pool down while each drained worker finishes its work.
"""

from __future__ import annotations

from typing import Any

from splitserve.operator import constants as C
from splitserve.operator.context import Context, Manifest
from splitserve.operator.settings import Autoscaling, effective_flow_control


def format_quantity(value: float) -> str:
    """A Kubernetes quantity for a non-negative number: "8", or milli-units like "2500m"."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def format_threshold(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def serving_pods(ctx: Context, pool: str) -> str:
    """A regex of the names of a pool's serving pods: `<deployment>-<hash>-<id>`, or a LeaderWorkerSet's leaders
    `<lws>-<group index>` (its other pods, `<lws>-<group index>-<worker index>`, do not match: the regex is whole)."""
    _, kind, name = ctx.workload(pool)
    return f"{name}-[0-9]+" if kind == C.LWS_KIND else f"{name}-[a-z0-9]+-[a-z0-9]+"


def queue_query(ctx: Context, pool: str) -> str:
    pods = serving_pods(ctx, pool)
    query = f'sum({C.QUEUE_METRIC}{{namespace="{ctx.namespace}",pod=~"{pods}"}})'
    if pool != "decode" or not effective_flow_control(ctx.spec.flow_control, ctx.settings).enabled:
        return query
    # With flow control the queue builds in the routers, not on the workers: the decode pool
    # scales on both (each `or vector(0)`: a sum over no series is empty, not 0).
    routers = f"{ctx.child('router')}-[a-z0-9]+-[a-z0-9]+"
    return (
        f'({query} or vector(0)) + (sum({C.FLOW_QUEUE_METRIC}{{namespace="{ctx.namespace}",pod=~"{routers}"}}) '
        "or vector(0))"
    )


def _target(ctx: Context, pool: str) -> dict[str, str]:
    api_version, kind, name = ctx.workload(pool)
    return {"apiVersion": api_version, "kind": kind, "name": name}


def scaled_object(ctx: Context, pool: str, auto: Autoscaling) -> Manifest:
    trigger = {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": auto.prometheus_address,
            "query": queue_query(ctx, pool),
            "threshold": format_threshold(auto.target_queue_depth),
        },
    }
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": ctx.meta(ctx.child(pool), pool),
        "spec": {
            "scaleTargetRef": _target(ctx, pool),
            "pollingInterval": auto.polling_interval,
            "cooldownPeriod": auto.cooldown_period,
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "triggers": [trigger],
        },
    }


def planner_url(ctx: Context, auto: Autoscaling) -> str:
    return f"{auto.planner_url.rstrip('/')}/v1/desired/{ctx.namespace}/{ctx.name}"


def planner_scaled_object(ctx: Context, pool: str, auto: Autoscaling) -> Manifest:
    trigger = {
        "type": "metrics-api",
        "metricType": "AverageValue",
        "metadata": {
            "url": planner_url(ctx, auto),
            "format": "json",
            "valueLocation": pool,
            "targetValue": "1",
            "activationTargetValue": "0",
        },
    }
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": ctx.meta(ctx.child(pool), pool),
        "spec": {
            "scaleTargetRef": _target(ctx, pool),
            "pollingInterval": auto.polling_interval,
            "cooldownPeriod": auto.cooldown_period,
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "triggers": [trigger],
            # the planner already waited out its own scale-down window
            "advanced": {
                "horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}
            },
        },
    }


def horizontal_pod_autoscaler(ctx: Context, pool: str, auto: Autoscaling) -> Manifest:
    metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": C.QUEUE_METRIC_ADAPTER},
            "target": {"type": "AverageValue", "averageValue": format_quantity(auto.target_queue_depth)},
        },
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": ctx.meta(ctx.child(pool), pool),
        "spec": {
            "scaleTargetRef": _target(ctx, pool),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [metric],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": auto.cooldown_period}},
        },
    }


def autoscaler(ctx: Context, pool: str) -> Manifest | None:
    auto = ctx.autoscaling(pool)
    if not auto.enabled or (auto.provider == "planner" and ctx.settings.autoscaling.planner_export == "scale"):
        return None
    build = {"keda": scaled_object, "planner": planner_scaled_object}.get(auto.provider, horizontal_pod_autoscaler)
    return build(ctx, pool, auto)


def disruption_budgets(ctx: Context) -> list[Manifest]:
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": ctx.meta(ctx.child(component), component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": ctx.selector(component)}},
        }
        for component in (*ctx.pools, "router")
    ]


def service_monitor(ctx: Context) -> Manifest:
    monitor = ctx.spec.monitoring.service_monitor
    selector: dict[str, Any] = {
        "matchLabels": {C.LABEL_NAME: C.APP_NAME, C.LABEL_INSTANCE: ctx.name},
        "matchExpressions": [{"key": C.LABEL_COMPONENT, "operator": "In", "values": [*ctx.pools, "router"]}],
    }
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": ctx.meta(ctx.name, "monitoring"),
        "spec": {
            "selector": selector,
            "namespaceSelector": {"matchNames": [ctx.namespace]},
            "endpoints": [{"port": C.METRICS_PORT_NAME, "path": "/metrics", "interval": monitor.interval}],
        },
    }
