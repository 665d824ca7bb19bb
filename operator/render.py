"""`render(spec) -> manifests`: the pure half of the operator.

Given a parsed InferenceService spec, its name, namespace and uid, and the chart's defaults,
render returns every child object as a plain dict, in apply order (things a Pod mounts or
uses before the Pods; autoscalers after the Deployments they scale). It reads no clock, no
cluster and no environment, so the same input always gives the same output; apply.py makes
the cluster match it.

Children of an InferenceService `<name>` (pool = prefill, decode; no prefill pool when
disaggregation.mode is never):

    ConfigMap, ServiceAccount, Role, RoleBinding   <name>-router   router config, EndpointSlice read access
    Service (headless)                             <name>-<pool>, <name>-router
    Service (gateway)                              <name>
    Deployment                                     <name>-<pool>, <name>-router
    LeaderWorkerSet (instead of the Deployment)    <name>-<pool>-group   when the pool's workers span nodes
    PodDisruptionBudget                            <name>-<pool>, <name>-router
    ScaledObject (KEDA) or HorizontalPodAutoscaler <name>-<pool>   when the pool is autoscaled (none with
                                                   provider planner and chart autoscaling.plannerExport scale)
    ConfigMap                                      <name>-planner  with provider planner (render_planner)
    ServiceMonitor                                 <name>          when monitoring.serviceMonitor.enabled
    NetworkPolicy                                  <name>-workers, <name>-router   unless networkPolicy.enabled is false
    Certificate (cert-manager)                     <name>-tls      when tls.issuer is set (mTLS, see render_pods)
    ServiceAccount, Role, RoleBinding              <name>-sidecar  with gateway.mode inferencePool: the sidecar's
                                                                   EndpointSlice read access
    ConfigMap, Service, Deployment                 <name>-epp      with gateway.mode inferencePool (render_gateway),
    InferencePool, HTTPRoute                       <name>          which also adds the sidecar to the decode pods

Not rendered here, because their content is random or time-bound: the Secrets of the default
security (spec.security), which credentials.py creates and renews before each render:
<name>-kv (KV-transfer secret), <name>-ca and <name>-<component>-tls (the operator's own CA).

Every child carries the common labels and a controller owner reference to the
InferenceService, so Kubernetes' garbage collector deletes it with its owner.
"""

from __future__ import annotations

from splitserve.operator import (
    render_gateway,
    render_network,
    render_planner,
    render_pods,
    render_scaling,
    render_services,
)
from splitserve.operator.context import Context, Manifest
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import InferenceServiceSpec


def render(
    spec: InferenceServiceSpec,
    name: str,
    namespace: str,
    uid: str,
    settings: OperatorSettings | None = None,
    tls_revisions: dict[str, str] | None = None,
) -> list[Manifest]:
    ctx = Context(spec, name, namespace, uid, settings or OperatorSettings(), dict(tls_revisions or {}))
    out = [*render_services.router_access(ctx)]
    if (cert := render_pods.certificate(ctx)) is not None:
        out.append(cert)
    out += render_services.services(ctx)
    gateway = render_gateway.manifests(ctx)
    out += [m for m in gateway if m["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service")]
    workers = {pool: render_pods.worker_workload(ctx, pool) for pool in ctx.pools}
    if gateway:
        workers["decode"] = render_gateway.with_sidecar(ctx, workers["decode"])
    out += workers.values()
    out.append(render_pods.router_deployment(ctx))
    out += [m for m in gateway if m["kind"] not in ("ConfigMap", "Service")]
    out += render_scaling.disruption_budgets(ctx)
    out += [a for pool in ctx.pools if (a := render_scaling.autoscaler(ctx, pool)) is not None]
    if (planner := render_planner.planner_config_map(ctx)) is not None:
        out.append(planner)
    if spec.monitoring.service_monitor.enabled:
        out.append(render_scaling.service_monitor(ctx))
    out += render_network.network_policies(ctx)
    return out
