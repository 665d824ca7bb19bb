"""autoscaling.provider planner: the operator renders a KEDA ScaledObject with a metrics-api
trigger on the planner's JSON, and the replica count KEDA's HPA would compute from what the
real planner server returns equals the planner's decision. The operator renders the per-service
planner ConfigMap (config and capacity profile) that the cluster planner parses. The Kubernetes API is the kmock
emulator (no API server can run here); the planner's HTTP server is the real one."""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request

import pytest
from opkit_kube import create_isvc
from opkit_schemas import admit
from workerproc import free_port

from splitserve.operator import constants as C
from splitserve.operator import kube as K
from splitserve.operator.apply import apply_all
from splitserve.operator.checks import InvalidSpecError, check_spec
from splitserve.operator.context import instance_selector
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.planner.config import PlannerConfig, PoolBounds
from splitserve.planner.law import Observation, Planner, PoolObservation
from splitserve.planner.plan_loop import PLANNER_SELECTOR, ServicePlan
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.planner.server import DesiredStore, serve

SETTINGS = OperatorSettings()
AUTO = {"enabled": True, "provider": "planner", "minReplicas": 1, "maxReplicas": 9}
SPEC = {
    "model": {"uri": "smollm2-135m"},
    "kvTransfer": {"transport": "tcp"},
    "slo": {"ttftP90Ms": 2000, "itlP90Ms": 100},
    "prefill": {"autoscaling": AUTO},
    "decode": {"autoscaling": AUTO},
}
PROFILE = CapacityProfile(
    prefill=(PrefillPoint(512, 1000.0),),
    decode=(DecodePoint(512, 1, 20.0, 0.05), DecodePoint(512, 8, 80.0, 0.1)),
    kv_tokens=100_000,
)


def keda_replicas(trigger: dict, so_spec: dict, body: dict) -> int:
    """What KEDA's HPA aims for with a metrics-api trigger, metricType AverageValue:
    ceil(value / targetValue), within [minReplicaCount, maxReplicaCount]."""
    meta = trigger["metadata"]
    value = float(body[meta["valueLocation"]])  # a top-level GJSON path
    want = math.ceil(value / float(meta["targetValue"]))
    return max(so_spec["minReplicaCount"], min(so_spec["maxReplicaCount"], want))


def test_scaler_reads_the_planners_desired_count(cluster, kube, namespace):
    owner = create_isvc(kube, "svc", namespace, SPEC)
    spec = parse_spec(SPEC)
    check_spec(spec, "svc", SETTINGS)
    manifests = render(spec, "svc", namespace, owner["metadata"]["uid"], SETTINGS)
    apply_all(kube, manifests, namespace, instance_selector("svc"), owner["metadata"]["uid"])

    cfg = PlannerConfig(ttft_p90_s=2.0, itl_p90_s=0.1, prefill=PoolBounds(1, 9), decode=PoolBounds(1, 9))
    planner = Planner(cfg, PROFILE, initial={"prefill": 2, "decode": 2})
    decision = planner.tick(
        Observation(
            now=0.0,
            uncached_prompt_tokens_per_s=3000.0,
            output_tokens_per_s=250.0,
            prefill=PoolObservation(2),
            decode=PoolObservation(2),
            mean_prompt_tokens=512,
            mean_output_tokens=64,
        )
    )
    assert decision.desired() == {"prefill": 4, "decode": 4}  # ceil(3300/800) = 5 capped at ×2; ceil(275/64) = 5 → 4
    store = DesiredStore()
    store.publish(namespace, "svc", decision)
    server = serve(store, "127.0.0.1", free_port())
    try:
        for pool in ("prefill", "decode"):
            so = kube.get(K.path(K.KIND_BY_NAME["ScaledObject"], namespace, f"svc-{pool}"))
            assert so is not None and so["spec"]["scaleTargetRef"]["name"] == f"svc-{pool}"
            (trigger,) = so["spec"]["triggers"]
            assert trigger["type"] == "metrics-api" and trigger["metricType"] == "AverageValue"
            url = urllib.parse.urlsplit(trigger["metadata"]["url"])
            assert url.netloc == "splitserve-planner.splitserve-system.svc:8090"
            local = f"http://127.0.0.1:{server.server_port}{url.path}"
            body = json.loads(urllib.request.urlopen(local, timeout=30).read())
            assert keda_replicas(trigger, so["spec"], body) == decision.desired()[pool]
            # One writer: the operator leaves the Deployment's replicas to the scaler.
            dep = kube.get(K.path(K.KIND_BY_NAME["Deployment"], namespace, f"svc-{pool}"))
            assert dep["metadata"]["annotations"][C.ANNOTATION_REPLICAS_OWNER] == "planner"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30).read().decode()
        assert (
            f'splitserve_planner_desired_replicas{{name="svc",namespace="{namespace}",pool="prefill"}} 4.0' in metrics
        )
        assert 'reason="scale_up"} 1.0' in metrics
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/v1/desired/{namespace}/other", timeout=30)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_planner_without_slo_is_rejected_by_the_schema():
    spec = {k: v for k, v in SPEC.items() if k != "slo"}
    _, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "default"},
            "spec": spec,
        }
    )
    assert errors == [
        "spec: autoscaling.provider planner needs spec.slo (ttftP90Ms and itlP90Ms): "
        "the planner sizes the pools for them"
    ]


@pytest.mark.parametrize(
    "slo", [{"ttftP90Ms": 0, "itlP90Ms": 50}, {"ttftP90Ms": 500, "itlP90Ms": 0}, {"ttftP90Ms": 500}]
)
def test_bad_slo_values_are_rejected_by_the_schema(slo):
    _, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "default"},
            "spec": {**SPEC, "slo": slo},
        }
    )
    assert errors and all(e.startswith("spec.slo") for e in errors), errors


def test_admission_check_needs_both_pools_and_an_slo_after_chart_defaults():
    chart_planner = OperatorSettings.model_validate({"autoscaling": {"enabled": True, "provider": "planner"}})
    bare = parse_spec({"model": {"uri": "smollm2-135m"}})
    with pytest.raises(InvalidSpecError, match="needs spec.slo with ttftP90Ms and itlP90Ms"):
        check_spec(bare, "svc", chart_planner)
    mixed = parse_spec({**SPEC, "decode": {"autoscaling": {**AUTO, "provider": "keda"}}})
    with pytest.raises(InvalidSpecError, match="enable autoscaling with provider planner on decode too"):
        check_spec(mixed, "svc", SETTINGS)


def _render(spec: dict, settings: OperatorSettings) -> dict[tuple[str, str], dict]:
    parsed = parse_spec(spec)
    check_spec(parsed, "svc", settings)
    return {(m["kind"], m["metadata"]["name"]): m for m in render(parsed, "svc", "llm", "uid-1", settings)}


def _labels_match(selector: str, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (t.split("=", 1) for t in selector.split(",")))


def test_operator_renders_the_planner_configmap_the_planner_reads():
    settings = OperatorSettings.model_validate({"autoscaling": {"plannerProfile": PROFILE.to_json()}})
    objs = _render(SPEC, settings)
    cm = objs[("ConfigMap", "svc-planner")]
    assert _labels_match(PLANNER_SELECTOR, cm["metadata"]["labels"])  # the planner's LIST finds it
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # gone with the InferenceService
    plan = ServicePlan.from_configmap(cm)
    assert (plan.namespace, plan.name, plan.ttft_p90_ms, plan.itl_p90_ms, plan.export) == (
        "llm",
        "svc",
        2000,
        100,
        "keda",
    )
    for pool in ("prefill", "decode"):
        pp = plan.pool(pool)
        assert pp.workload.kind == "Deployment"
        dep = objs[("Deployment", pp.workload.name)]
        assert _labels_match(pp.selector, dep["spec"]["template"]["metadata"]["labels"])
        assert (pp.min_replicas, pp.max_replicas) == (1, 9)
        port = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert plan.worker_metrics_port == port["metrics"]
    router = objs[("Deployment", "svc-router")]
    assert _labels_match(plan.router_selector, router["spec"]["template"]["metadata"]["labels"])
    assert CapacityProfile.from_json(plan.profile_json) == PROFILE  # the chart's default profile
    assert plan.profile_config_map is None
    # the planner may scrape the metrics ports (NetworkPolicy), besides the monitoring peer
    workers = objs[("NetworkPolicy", "svc-workers")]
    metrics_rule = next(r for r in workers["spec"]["ingress"] if r["ports"] == [{"port": "metrics", "protocol": "TCP"}])
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "splitserve-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "splitserve-planner"}},
    } in metrics_rule["from"]


def test_a_service_profile_configmap_replaces_the_chart_default_and_scale_export_drops_keda():
    settings = OperatorSettings.model_validate(
        {"autoscaling": {"plannerProfile": PROFILE.to_json(), "plannerExport": "scale"}}
    )
    objs = _render({**SPEC, "slo": {**SPEC["slo"], "profileConfigMap": "h100-profile"}}, settings)
    cm = objs[("ConfigMap", "svc-planner")]
    plan = ServicePlan.from_configmap(cm)
    assert plan.profile_config_map == "h100-profile" and "profile.json" not in cm["data"]
    assert plan.export == "scale"
    assert not [k for k in objs if k[0] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert objs[("Deployment", "svc-decode")]["metadata"]["annotations"][C.ANNOTATION_REPLICAS_OWNER] == "planner"


def test_no_planner_configmap_without_provider_planner():
    keda = {
        **SPEC,
        "prefill": {"autoscaling": {**AUTO, "provider": "keda"}},
        "decode": {"autoscaling": {**AUTO, "provider": "keda"}},
    }
    objs = _render(keda, SETTINGS)
    assert ("ConfigMap", "svc-planner") not in objs
    metrics_rule = next(
        r
        for r in objs[("NetworkPolicy", "svc-workers")]["spec"]["ingress"]
        if r["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    )
    assert len(metrics_rule["from"]) == 1  # the monitoring peer only


@pytest.mark.parametrize("bad", ["Upper", "-x", "a" * 254])
def test_bad_profile_configmap_names_are_rejected_by_the_schema(bad):
    _, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "default"},
            "spec": {**SPEC, "slo": {**SPEC["slo"], "profileConfigMap": bad}},
        }
    )
    assert errors and all(e.startswith("spec.slo.profileConfigMap") for e in errors), errors
