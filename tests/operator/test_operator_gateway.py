"""spec.gateway.mode inferencePool: the InferencePool, the EPP, the decode pods' sidecar, the
HTTPRoute example and the NetworkPolicies around them, rendered and checked against the shipped
upstream CRDs (tests/operator/schemas: GIE's InferencePool v1, the Gateway API's HTTPRoute)."""

from __future__ import annotations

import copy

import pytest
import yaml
from opkit_schemas import admit, crd_errors, validate_manifest

from splitserve.operator.render import render
from splitserve.operator.spec import parse_spec
from splitserve.router.config.file import load_config

UID = "6f1c7c4e-0000-4000-8000-000000000041"


def rendered(gateway: dict | None = None, **spec) -> dict[tuple[str, str], dict]:
    raw = {"model": {"uri": "smollm2-135m"}, **spec}
    if gateway is not None:
        raw["gateway"] = gateway
    return {(m["kind"], m["metadata"]["name"]): m for m in render(parse_spec(raw), "chat", "llm", UID)}


def containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def test_default_mode_renders_todays_objects_only():
    out = rendered()
    assert not [key for key in out if key[0] in ("InferencePool", "HTTPRoute") or key[1] == "chat-epp"]
    assert list(containers(out["Deployment", "chat-decode"])) == ["worker"]
    assert rendered({"mode": "splitserve"}).keys() == out.keys()


@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
def test_inference_pool_selects_the_decode_pods_on_the_sidecar_port(failure_mode):
    out = rendered({"mode": "inferencePool", "failureMode": failure_mode, "sidecarPort": 8300})
    for manifest in out.values():
        validate_manifest(manifest)  # built-in kinds strictly, InferencePool and HTTPRoute by their CRDs
    pool = out["InferencePool", "chat"]
    assert crd_errors(pool) == []
    decode = out["Deployment", "chat-decode"]
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert all(
        out["Deployment", f"chat-{c}"]["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        != "decode"
        for c in ("prefill", "router", "epp")
    )
    sidecar = containers(decode)["sidecar"]
    assert pool["spec"]["targetPorts"] == [{"number": 8300}]
    assert sidecar["ports"] == [{"name": "sidecar", "containerPort": 8300, "protocol": "TCP"}]
    assert sidecar["args"][:5] == [
        "sidecar",
        "--config",
        "/etc/splitserve/epp/sidecar.yaml",
        "--decode",
        "127.0.0.1:50051",
    ]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == failure_mode
    service = out["Service", ref["name"]]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    epp = out["Deployment", "chat-epp"]
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert "--sidecar-port" in containers(epp)["epp"]["args"]
    assert containers(epp)["epp"]["args"][containers(epp)["epp"]["args"].index("--sidecar-port") + 1] == "8300"


def test_http_route_attaches_the_pool_to_the_named_gateways():
    out = rendered(
        {"mode": "inferencePool", "parentRefs": [{"name": "edge", "namespace": "gateways", "sectionName": "https"}]}
    )
    route = out["HTTPRoute", "chat"]
    assert crd_errors(route) == []
    assert route["spec"]["parentRefs"] == [{"name": "edge", "namespace": "gateways", "sectionName": "https"}]
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}]
    broken = copy.deepcopy(route)
    broken["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    assert crd_errors(broken), "the shipped HTTPRoute schema must refuse a negative weight"


def test_shipped_inference_pool_schema_refuses_what_the_api_server_refuses():
    pool = rendered({"mode": "inferencePool"})["InferencePool", "chat"]
    for path, value in (
        (("targetPorts",), [{"number": 8200}, {"number": 8200}]),
        (("endpointPickerRef", "failureMode"), "Sometimes"),
        (("targetPorts",), []),
    ):
        broken = copy.deepcopy(pool)
        node = broken["spec"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert crd_errors(broken), f"{path} = {value!r} was accepted"


def test_epp_and_sidecar_configs_are_router_configs_without_adapter_duties():
    out = rendered({"mode": "inferencePool"})
    data = out["ConfigMap", "chat-epp"]["data"]
    epp, sidecar = yaml.safe_load(data["epp.yaml"]), yaml.safe_load(data["sidecar.yaml"])
    assert "adapters" not in epp and "adapters" not in sidecar  # the router alone loads and reports adapters
    assert epp["discovery"]["k8s_services"] == ["chat-prefill", "chat-decode"]
    assert sidecar["discovery"]["k8s_services"] == ["chat-prefill"]
    router = yaml.safe_load(out["ConfigMap", "chat-router"]["data"]["router.yaml"])
    assert {k: v for k, v in epp.items() if k not in ("adapters",)} == {
        k: v for k, v in router.items() if k not in ("adapters",)
    }
    for text in data.values():  # the data plane reads them with the router's own loader
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(text)
            f.flush()
            assert load_config(f.name).discovery.k8s_namespace == "llm"


def test_tls_follows_the_security_settings():
    secure = rendered({"mode": "inferencePool"})
    epp_args = containers(secure["Deployment", "chat-epp"])["epp"]["args"]
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--serve-tls-cert", "--serve-tls-key"):
        assert flag in epp_args
    # mutual TLS on ext_proc: only a gateway with a certificate of the service's CA is admitted
    assert epp_args[epp_args.index("--serve-tls-client-ca") + 1] == epp_args[epp_args.index("--tls-ca") + 1]
    assert "--host" in epp_args and epp_args[epp_args.index("--host") + 1] == "0.0.0.0"  # in a pod, behind the policy
    no_client_auth = rendered({"mode": "inferencePool", "eppClientAuth": False})
    assert "--serve-tls-client-ca" not in containers(no_client_auth["Deployment", "chat-epp"])["epp"]["args"]
    assert "appProtocol" not in secure["Service", "chat-epp"]["spec"]["ports"][0]
    sidecar_args = containers(secure["Deployment", "chat-decode"])["sidecar"]["args"]
    assert "--tls-ca" in sidecar_args and "--api-keys-file" in sidecar_args
    decode_volumes = {v["name"]: v for v in secure["Deployment", "chat-decode"]["spec"]["template"]["spec"]["volumes"]}
    # the sidecar calls Generate and WatchEvents, which workers admit from the router's certificate only
    assert decode_volumes["sidecar-tls"]["secret"]["secretName"] == "chat-router-tls"
    assert decode_volumes["tls"]["secret"]["secretName"] == "chat-decode-tls"
    volumes = {v["name"] for v in secure["Deployment", "chat-epp"]["spec"]["template"]["spec"]["volumes"]}
    assert "tls" in volumes
    insecure = rendered({"mode": "inferencePool"}, security={"insecure": True})
    epp_args = containers(insecure["Deployment", "chat-epp"])["epp"]["args"]
    assert not [a for a in epp_args if "tls" in a]
    assert insecure["Service", "chat-epp"]["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    assert not [a for a in containers(insecure["Deployment", "chat-decode"])["sidecar"]["args"] if "tls" in a]


def test_network_policies_let_the_gateway_reach_sidecars_and_epp():
    peer = {"namespaceLabels": {"kubernetes.io/metadata.name": "gateways"}}
    out = rendered({"mode": "inferencePool"}, networkPolicy={"gatewayFrom": [peer]})
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}]
    epp = out["NetworkPolicy", "chat-epp"]["spec"]
    assert epp["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "epp"
    assert {"from": gateway, "ports": [{"port": "grpc", "protocol": "TCP"}]} in epp["ingress"]
    workers = out["NetworkPolicy", "chat-workers"]["spec"]["ingress"]
    assert {"from": gateway, "ports": [{"port": "sidecar", "protocol": "TCP"}]} in workers
    epp_pods = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "splitserve",
                "app.kubernetes.io/instance": "chat",
                "app.kubernetes.io/component": "epp",
            }
        }
    }
    assert {"from": [epp_pods], "ports": [{"port": "grpc", "protocol": "TCP"}]} in workers
    # The gateway peers reach no worker's gRPC or KV port.
    assert not [r for r in workers if r["from"] == gateway and {p["port"] for p in r["ports"]} & {"grpc", "kv"}]
    assert ("NetworkPolicy", "chat-epp") not in rendered()


def test_by_default_only_the_parent_gateways_proxies_reach_the_epp_and_sidecars():
    """Without gatewayFrom (service or chart), the EPP's ext_proc port and the sidecars admit the
    proxy pods of spec.gateway.parentRefs only: by the Gateway API's gateway-name label in the
    Gateway's namespace, or Envoy Gateway's owning-gateway labels (its proxies live in its own
    namespace) - never the namespace's every pod, which the router's HTTP port admits."""
    out = rendered(
        {"mode": "inferencePool", "parentRefs": [{"name": "inference", "namespace": "gw"}, {"name": "edge"}]}
    )
    peers = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}},
            "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference"}},
        },
        {
            "namespaceSelector": {},
            "podSelector": {
                "matchLabels": {
                    "gateway.envoyproxy.io/owning-gateway-name": "inference",
                    "gateway.envoyproxy.io/owning-gateway-namespace": "gw",
                }
            },
        },
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm"}},
            "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"}},
        },
        {
            "namespaceSelector": {},
            "podSelector": {
                "matchLabels": {
                    "gateway.envoyproxy.io/owning-gateway-name": "edge",
                    "gateway.envoyproxy.io/owning-gateway-namespace": "llm",
                }
            },
        },
    ]
    epp = out["NetworkPolicy", "chat-epp"]["spec"]["ingress"]
    assert epp[0] == {"from": peers, "ports": [{"port": "grpc", "protocol": "TCP"}]}
    assert [r for r in epp if {p["port"] for p in r["ports"]} == {"grpc"}] == [epp[0]]  # no other rule opens it
    workers = out["NetworkPolicy", "chat-workers"]["spec"]["ingress"]
    assert {"from": peers, "ports": [{"port": "sidecar", "protocol": "TCP"}]} in workers
    every_pod = {"podSelector": {}}
    assert not [r for r in epp + workers if every_pod in r["from"]]
    for manifest in (out["NetworkPolicy", "chat-epp"], out["NetworkPolicy", "chat-workers"]):
        validate_manifest(manifest)


def test_gateway_spec_is_checked_on_admission():
    obj = {
        "apiVersion": "serving.splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "llm"},
        "spec": {"model": {"uri": "smollm2-135m"}, "gateway": {"mode": "gie"}},
    }
    _, errors = admit(obj)
    assert errors and "splitserve" in " ".join(errors) and "inferencePool" in " ".join(errors)
    obj["spec"]["gateway"] = {"mode": "inferencePool", "sidecarPort": 80}
    _, errors = admit(obj)
    assert errors
    obj["spec"]["gateway"] = {"mode": "inferencePool"}
    stored, errors = admit(obj)
    assert errors == [] and stored["spec"]["gateway"]["failureMode"] == "FailOpen"


def test_chart_default_names_the_inference_gateway_peers():
    from splitserve.operator.settings import NetworkPolicyDefaults, OperatorSettings, Peer, WorkloadPolicies

    istio = Peer(namespace_labels={"kubernetes.io/metadata.name": "istio-ingress"}, pod_labels={})
    settings = OperatorSettings(
        network_policy=NetworkPolicyDefaults(workloads=WorkloadPolicies(inference_gateway_from=[istio]))
    )
    spec = parse_spec({"model": {"uri": "smollm2-135m"}, "gateway": {"mode": "inferencePool"}})
    out = {(m["kind"], m["metadata"]["name"]): m for m in render(spec, "chat", "llm", UID, settings)}
    peers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-ingress"}}, "podSelector": {}}
    ]
    assert {"from": peers, "ports": [{"port": "grpc", "protocol": "TCP"}]} in out["NetworkPolicy", "chat-epp"]["spec"][
        "ingress"
    ]
    assert {"from": peers, "ports": [{"port": "sidecar", "protocol": "TCP"}]} in out["NetworkPolicy", "chat-workers"][
        "spec"
    ]["ingress"]
    router = out["NetworkPolicy", "chat-router"]["spec"]["ingress"]  # the router keeps the chart's gatewayFrom
    assert not [r for r in router if r["from"] == peers]


def test_apply_creates_the_pool_and_prunes_it_when_the_mode_goes_back(tmp_path):
    """Against kmock's in-memory Kubernetes API emulator (opkit_emulator) with the InferencePool and
    HTTPRoute APIs installed: apply creates every child, and switching back to the splitserve mode
    deletes the InferencePool, the HTTPRoute and the EPP's objects (owned children no longer rendered)."""
    from opkit_emulator import ClusterThread
    from opkit_kube import create_isvc

    from splitserve.operator import kube as K
    from splitserve.operator.apply import apply_all
    from splitserve.operator.context import instance_selector
    from splitserve.planner.kube import KubeClient, load_configuration

    spec = {"model": {"uri": "smollm2-135m"}, "kvTransfer": {"transport": "tcp"}, "gateway": {"mode": "inferencePool"}}
    with ClusterThread(with_inference_gateway=True) as cluster:
        kube = KubeClient(load_configuration(cluster.kubeconfig(str(tmp_path / "kubeconfig"))))
        uid = create_isvc(kube, "chat", "llm", spec)["metadata"]["uid"]

        def apply(raw):
            return apply_all(kube, render(parse_spec(raw), "chat", "llm", uid), "llm", instance_selector("chat"), uid)

        result = apply(spec)
        assert {
            "InferencePool/chat",
            "HTTPRoute/chat",
            "Deployment/chat-epp",
            "Service/chat-epp",
            "ConfigMap/chat-epp",
            "NetworkPolicy/chat-epp",
        } <= set(result.created)
        pool = kube.get(K.path(K.KIND_BY_NAME["InferencePool"], "llm", "chat"))
        assert pool["spec"]["endpointPickerRef"]["name"] == "chat-epp"
        assert not apply(spec).changed  # level-based: a second apply writes nothing
        back = apply({**spec, "gateway": {"mode": "splitserve"}})
        assert {"InferencePool/chat", "HTTPRoute/chat", "Deployment/chat-epp"} <= set(back.deleted)
        assert kube.get(K.path(K.KIND_BY_NAME["InferencePool"], "llm", "chat")) is None
        assert kube.get(K.path(K.KIND_BY_NAME["HTTPRoute"], "llm", "chat")) is None
        assert kube.get(K.path(K.KIND_BY_NAME["Deployment"], "llm", "chat-epp")) is None
