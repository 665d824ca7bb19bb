"""NetworkPolicies of one InferenceService: only its router reaches its workers.

Two Ingress policies (egress is left open: the router needs the API server, Redis and DNS,
and a policy there adds breakage without protecting the workers):

    <name>-workers   pods: this service's prefill and decode workers
        grpc, kv      from this service's router pods and this service's worker pods
                      (prefill pushes KV to decode; both reach each other's gRPC); with the
                      ucx transport also UCX's TCP ports (constants.UCX_TCP_PORTS)
        metrics       from the monitoring peer (chart: networkPolicy.workloads.monitoring), and
                      with autoscaling provider planner from the planner (workloads.planner)
    <name>-router    pods: this service's router
        http          from spec.networkPolicy.gatewayFrom, else the chart's gatewayFrom
                      (default: every pod of the namespace and the ingress controller's namespace)
        metrics       from the monitoring peer

A pool whose workers span nodes (a LeaderWorkerSet) gets one more policy, because its ranks
talk to each other on ports torch.distributed and NCCL pick at run time:

    <name>-<pool>-ranks   pods: the pool's pods
        every port    from the pool's own pods

With spec.gateway.mode inferencePool (render_gateway.py) the inference gateway's proxies are
gateway peers (spec.networkPolicy.gatewayFrom, else the chart's workloads.inferenceGatewayFrom,
else the proxy pods of spec.gateway.parentRefs, by the labels Gateway API implementations put on
them: render_gateway.gateway_peers; never the namespace's every pod): the workers policy also
lets the EPP reach the workers' gRPC and the gateway peers reach the decode pods' sidecar port,
and a third policy guards the EPP:

    <name>-epp       pods: this service's EPP
        grpc          (ext_proc) from the gateway peers
        metrics       from the monitoring peer

Peers name pods by the labels every child carries (app.kubernetes.io/name, instance,
component), so the router of another InferenceService in the same namespace matches no
rule: its instance label differs. Kubelet probes come from the node and are not subject to
these policies on the common CNIs. A pod that can be created with this service's labels gets
through; the KV-transfer token and mTLS (docs/security.md) are the layer behind this one.
"""

from __future__ import annotations

from typing import Any

from splitserve.operator import constants as C
from splitserve.operator import render_gateway
from splitserve.operator.context import Context, Manifest


def _peer(peer: Any) -> dict[str, Any]:
    """A NetworkPolicyPeer from a spec PeerSpec or a settings Peer (same fields)."""
    if peer.cidr is not None:
        return {"ipBlock": {"cidr": peer.cidr}}
    out: dict[str, Any] = {}
    if peer.namespace_labels is not None:
        out["namespaceSelector"] = {"matchLabels": dict(peer.namespace_labels)} if peer.namespace_labels else {}
    if peer.pod_labels is not None:
        out["podSelector"] = {"matchLabels": dict(peer.pod_labels)} if peer.pod_labels else {}
    return out


def _workers_selector(ctx: Context) -> dict[str, Any]:
    return {
        "matchLabels": {C.LABEL_NAME: C.APP_NAME, C.LABEL_INSTANCE: ctx.name},
        "matchExpressions": [{"key": C.LABEL_COMPONENT, "operator": "In", "values": ["prefill", "decode"]}],
    }


def _ports(*names: str) -> list[dict[str, Any]]:
    return [{"port": name, "protocol": "TCP"} for name in names]


def _policy(ctx: Context, component: str, pods: dict[str, Any], ingress: list[dict[str, Any]]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.meta(ctx.child(component), component),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _ranks_policy(ctx: Context, pool: str) -> Manifest:
    """Every port between the pods of one multi-node pool (its ranks' collectives)."""
    group = {"matchLabels": ctx.selector(pool)}
    return _policy(ctx, f"{pool}-ranks", group, [{"from": [{"podSelector": group}]}])


def network_policies(ctx: Context) -> list[Manifest]:
    """The two policies above; none when spec.networkPolicy.enabled is false."""
    if not ctx.spec.network_policy.enabled:
        return []
    defaults = ctx.settings.network_policy.workloads
    scrapers = [_peer(defaults.monitoring)]
    if any(ctx.autoscaling(p).enabled and ctx.autoscaling(p).provider == "planner" for p in ctx.pools):
        scrapers.append(_peer(defaults.planner))  # the SLA planner reads every pod's /metrics
    monitoring = {"from": scrapers, "ports": _ports(C.METRICS_PORT_NAME)}
    router = {"podSelector": {"matchLabels": ctx.selector("router")}}
    workers = {"podSelector": _workers_selector(ctx)}
    gateway_from = ctx.spec.network_policy.gateway_from
    sources = [_peer(p) for p in (gateway_from if gateway_from is not None else defaults.gateway_from)]
    # An empty `from` would allow everyone: gatewayFrom [] means no rule for the port at all.
    gateway = [{"from": sources, "ports": _ports(C.HTTP_PORT_NAME)}] if sources else []
    worker_ports = _ports(C.GRPC_PORT_NAME, C.KV_PORT_NAME)
    if ctx.spec.kv_transfer.transport == "ucx":  # UCX's TCP transport listens on its own ports (render_pods)
        worker_ports.append({"port": C.UCX_TCP_PORTS[0], "endPort": C.UCX_TCP_PORTS[1], "protocol": "TCP"})
    worker_rules = [{"from": [router, workers], "ports": worker_ports}, monitoring]
    out = [_policy(ctx, "router", {"matchLabels": ctx.selector("router")}, [*gateway, monitoring])]
    if render_gateway.is_inference_pool(ctx):
        if gateway_from is None:  # not the router's callers (every pod of the namespace, by default)
            chart = defaults.inference_gateway_from
            sources = [_peer(p) for p in chart] if chart is not None else render_gateway.gateway_peers(ctx)
        worker_rules.insert(
            1, {"from": [{"podSelector": {"matchLabels": ctx.selector("epp")}}], "ports": _ports(C.GRPC_PORT_NAME)}
        )
        if sources:
            worker_rules.insert(2, {"from": sources, "ports": _ports(render_gateway.SIDECAR_PORT_NAME)})
        epp = [{"from": sources, "ports": _ports(C.GRPC_PORT_NAME)}] if sources else []
        out.append(_policy(ctx, "epp", {"matchLabels": ctx.selector("epp")}, [*epp, monitoring]))
    ranks = [_ranks_policy(ctx, pool) for pool in ctx.pools if getattr(ctx.spec, pool).is_multi_node]
    return [_policy(ctx, "workers", _workers_selector(ctx), worker_rules), *out, *ranks]
