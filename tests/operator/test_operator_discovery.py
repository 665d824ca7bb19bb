"""The discovery contract between the rendered Services and the router: the EndpointSlices
Kubernetes makes for the pool Services (modelled by k8s_controllers.py) carry the label the
router config selects on and a port named as the config says, so a router that reads only its
router.yaml finds exactly the workers of each pool at their gRPC port."""

from __future__ import annotations

import pytest
import yaml
from k8s_controllers import endpoint_slice, pods_of
from opkit_schemas import validate_manifest

from splitserve.operator import constants as C
from splitserve.operator.render import render
from splitserve.operator.spec import parse_spec
from splitserve.router.config.file import from_dict
from splitserve.router.placement.discovery_k8s import SERVICE_LABEL, label_selector, slice_addresses

SPEC = parse_spec({"model": {"uri": "smollm2-135m"}})
IPS = {"prefill": ["10.1.0.1", "10.1.0.2"], "decode": ["10.2.0.1", "10.2.0.2", "10.2.0.3"], "router": ["10.3.0.1"]}


@pytest.fixture(scope="module")
def cluster_view():
    """The rendered objects, plus the Pods and EndpointSlices Kubernetes would add."""
    manifests = {(m["kind"], m["metadata"]["name"]): m for m in render(SPEC, "svc", "ns", "uid")}
    pods = [p for component, ips in IPS.items() for p in pods_of(manifests[("Deployment", f"svc-{component}")], ips)]
    slices = [endpoint_slice(m, pods) for (kind, _), m in manifests.items() if kind == "Service"]
    return manifests, pods, slices


def router_side_discovery(config_text: str, slices: list[dict]) -> list[str]:
    """What the router does with its router.yaml: its own config loader and its own EndpointSlice
    reader (router/placement/discovery_k8s.py), fed the slices Kubernetes would make."""
    config = from_dict(yaml.safe_load(config_text))
    wanted = set(config.discovery.k8s_services)
    addresses = set()
    for s in slices:
        if s["metadata"]["labels"].get(SERVICE_LABEL) in wanted:
            addresses |= slice_addresses(s, config.discovery.k8s_port_name)
    return sorted(addresses)


def test_endpoint_slices_are_valid_kubernetes_objects(cluster_view):
    _, pods, slices = cluster_view
    assert len(slices) == 4 and len(pods) == 6
    for s in slices:
        validate_manifest(s)


def test_pool_slices_carry_the_service_name_label_and_named_ports(cluster_view):
    _, _, slices = cluster_view
    decode = next(s for s in slices if s["metadata"]["labels"][C.LABEL_SERVICE_NAME] == "svc-decode")
    assert decode["metadata"]["labels"][C.LABEL_ROLE] == "decode"
    assert decode["metadata"]["labels"]["service.kubernetes.io/headless"] == ""
    assert decode["ports"] == [
        {"name": "grpc", "protocol": "TCP", "port": 50051},
        {"name": "metrics", "protocol": "TCP", "port": 9090},
        {"name": "kv", "protocol": "TCP", "port": 13337},
    ]
    assert sorted(e["addresses"][0] for e in decode["endpoints"]) == IPS["decode"]
    assert all(e["targetRef"]["name"].startswith("svc-decode-") for e in decode["endpoints"])


def test_the_router_finds_each_pool_from_its_config_alone(cluster_view):
    manifests, _, slices = cluster_view
    text = manifests[("ConfigMap", "svc-router")]["data"]["router.yaml"]
    assert from_dict(yaml.safe_load(text)).discovery.k8s_namespace == "ns"
    assert (
        label_selector(from_dict(yaml.safe_load(text)).discovery.k8s_services)
        == "kubernetes.io/service-name in (svc-decode,svc-prefill)"
    )
    assert router_side_discovery(text, slices) == [
        "10.1.0.1:50051",
        "10.1.0.2:50051",
        "10.2.0.1:50051",
        "10.2.0.2:50051",
        "10.2.0.3:50051",
    ]


def test_the_router_role_allows_exactly_what_discovery_and_the_adapter_report_need(cluster_view):
    manifests, _, _ = cluster_view
    rule, report = manifests[("Role", "svc-router")]["rules"]
    assert (rule["apiGroups"], rule["resources"], sorted(rule["verbs"])) == (
        ["discovery.k8s.io"],
        ["endpointslices"],
        ["list", "watch"],
    )
    # the adapter report (router/placement/adapter_sync.py): its own ConfigMap only, read and patch only
    assert report == {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["svc-router"],
        "verbs": ["get", "patch"],
    }


def test_unready_workers_are_not_routed_to():
    manifests = {(m["kind"], m["metadata"]["name"]): m for m in render(SPEC, "svc", "ns", "uid")}
    ready = pods_of(manifests[("Deployment", "svc-decode")], ["10.2.0.1"])
    starting = pods_of(manifests[("Deployment", "svc-decode")], ["10.2.0.1", "10.2.0.9"], ready=False)[1:]
    s = endpoint_slice(manifests[("Service", "svc-decode")], ready + starting)
    text = manifests[("ConfigMap", "svc-router")]["data"]["router.yaml"]
    assert router_side_discovery(text, [s]) == ["10.2.0.1:50051"]
    assert [e["conditions"]["ready"] for e in s["endpoints"]] == [True, False]
