"""spec.flowControl: admitted and validated by the CRD (API-server admission emulated by
opkit_schemas), merged over the chart's flowControl values, rendered into router.yaml in the
router's own format (which the router then loads), the workers' priority scheduling, and the
decode pool's KEDA query counting the requests held in the routers."""

from __future__ import annotations

import re

import helm_python as helm
import promql_parser
import pytest
import yaml
from opkit_schemas import admit

from splitserve.operator.render import render
from splitserve.operator.settings import FlowControlDefaults, OperatorSettings, load_settings
from splitserve.operator.spec import parse_spec
from splitserve.router.config.file import from_dict

UID = "6f1c7c4e-0000-4000-8000-000000000001"
FLOW = {
    "enabled": True,
    "objectives": [{"name": "interactive", "priority": 10}, {"name": "batch", "priority": -1}],
    "defaultObjective": "batch",
    "maxRunningPerWorker": 8,
    "reservedRunning": 2,
}


def isvc(spec: dict) -> dict:
    return {
        "apiVersion": "serving.splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ns"},
        "spec": spec,
    }


def manifests(spec: dict, settings: OperatorSettings | None = None) -> dict[tuple[str, str], dict]:
    stored, errors = admit(isvc(spec))
    assert errors == []
    return {
        (m["kind"], m["metadata"]["name"]): m for m in render(parse_spec(stored["spec"]), "svc", "ns", UID, settings)
    }


def test_router_config_carries_flow_control_and_the_router_loads_it():
    spec = {"model": {"uri": "smollm2-135m"}, "flowControl": FLOW}
    config = yaml.safe_load(manifests(spec)[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    assert config["flow_control"] == {
        "enabled": True,
        "objectives": {"interactive": 10, "batch": -1},
        "default_objectives": {"smollm2-135m": "batch"},
        "fairness_header": "x-gateway-inference-fairness-id",
        "max_queued_per_band": 256,
        "max_queue_wait_s": 30.0,
        "max_running_per_worker": 8,
        "reserved_running": 2,
        "queue_depth_threshold": 5,
        "kv_cache_threshold": 0.8,
    }
    router = from_dict(config)
    assert router.flow_control.running_limit(0) == 6 and router.flow_control.running_limit(10) == 8


def test_off_by_default_renders_nothing_new():
    objs = manifests({"model": {"uri": "m"}})
    assert "flow_control" not in yaml.safe_load(objs[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    assert (
        "--scheduling-policy"
        not in objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_chart_defaults_apply_and_the_spec_wins():
    settings = OperatorSettings(
        flow_control=FlowControlDefaults(enabled=True, max_queue_wait_seconds=5, max_running_per_worker=4)
    )
    objs = manifests({"model": {"uri": "m"}, "flowControl": {"maxQueueWaitSeconds": 12}}, settings)
    flow = yaml.safe_load(objs[("ConfigMap", "svc-router")]["data"]["router.yaml"])["flow_control"]
    assert (flow["max_queue_wait_s"], flow["max_running_per_worker"], flow["objectives"]) == (12, 4, {})
    args = objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    off = manifests({"model": {"uri": "m"}, "flowControl": {"enabled": False}}, settings)
    assert "flow_control" not in yaml.safe_load(off[("ConfigMap", "svc-router")]["data"]["router.yaml"])


def test_decode_keda_query_adds_the_routers_queue():
    spec = {
        "model": {"uri": "m"},
        "flowControl": {"enabled": True},
        "decode": {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3}},
        "prefill": {"autoscaling": {"enabled": True}},
    }
    objs = manifests(spec)
    query = objs[("ScaledObject", "svc-decode")]["spec"]["triggers"][0]["metadata"]["query"]
    assert query == (
        '(sum(vllm:num_requests_waiting{namespace="ns",pod=~"svc-decode-[a-z0-9]+-[a-z0-9]+"}) or '
        'vector(0)) + (sum(splitserve_router_flow_queue_length{namespace="ns",'
        'pod=~"svc-router-[a-z0-9]+-[a-z0-9]+"}) or vector(0))'
    )
    promql_parser.parse(query)
    assert re.search(r'pod=~"([^"]+)"\}\) or vector\(0\)\)$', query).group(1) == "svc-router-[a-z0-9]+-[a-z0-9]+"
    prefill = objs[("ScaledObject", "svc-prefill")]["spec"]["triggers"][0]["metadata"]["query"]
    assert "flow_queue" not in prefill


@pytest.mark.parametrize(
    "flow, message",
    [
        ({"defaultObjective": "nope", "objectives": [{"name": "a", "priority": 1}]}, "must name one of"),
        ({"objectives": [{"name": "a", "priority": 1}, {"name": "a", "priority": 2}]}, "unique names"),
        ({"objectives": [{"name": "a", "priority": 2000000}]}, "maximum"),
        ({"kvCacheThreshold": 2}, "maximum"),
        ({"fairnessHeader": "X Bad"}, "does not match"),
    ],
)
def test_invalid_flow_control_is_rejected(flow, message):
    _, errors = admit(isvc({"model": {"uri": "m"}, "flowControl": flow}))
    assert len(errors) == 1 and message in errors[0], errors


def test_chart_values_reach_the_operator_settings(tmp_path):
    chart_dir = __import__("pathlib").Path(__file__).resolve().parents[2] / "helm" / "splitserve"
    with helm.Chart.load(chart_dir) as chart:
        rendered = chart.render(
            {"flowControl": {"enabled": True, "maxRunningPerWorker": 6, "reservedRunning": 1}},
            name="splitserve",
            namespace="splitserve-system",
        )
        with pytest.raises(Exception, match="flowControl"):
            chart.render({"flowControl": {"maxQueuedPerBand": -1}}, name="splitserve", namespace="splitserve-system")
    docs = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "defaults.yaml"
    path.write_text(cm["data"]["defaults.yaml"])
    assert load_settings(str(path)).flow_control == FlowControlDefaults(
        enabled=True, max_running_per_worker=6, reserved_running=1
    )
