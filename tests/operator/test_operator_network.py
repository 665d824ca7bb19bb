"""The per-InferenceService NetworkPolicies, judged by what they let through.

`Cluster.allowed` below is a small NetworkPolicy evaluator written from the Kubernetes
semantics (networking.k8s.io/v1, Ingress only, which is all the operator renders): a pod no
policy selects accepts everything; a selected pod accepts a connection when some rule of some
selecting policy matches its port (by number, or by name through the pod's container ports)
and its source (podSelector alone: pods of the policy's namespace; namespaceSelector alone:
every pod of the matching namespaces; both: matching pods of matching namespaces; ipBlock:
addresses outside the pod network). Pods and their ports come from the rendered Deployments,
so a wrong label or port name shows up as a wrong path.

Two InferenceServices `a` and `b` share namespace `team`; beside them: another pod of `team`,
a pod of namespace `other`, Prometheus in `monitoring`, an ingress controller in
`ingress-nginx`, and a client outside the cluster. The expected matrix is written out rule by
rule from the issue and compared with the evaluator on every (source, destination, port).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import pytest
from opkit_schemas import admit, validate_manifest

from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings, Peer
from splitserve.operator.spec import parse_spec

UID = "6f1c7c4e-0000-4000-8000-000000000002"
NAMESPACES = {
    "team": {"kubernetes.io/metadata.name": "team"},
    "other": {"kubernetes.io/metadata.name": "other"},
    "monitoring": {"kubernetes.io/metadata.name": "monitoring"},
    "ingress-nginx": {"kubernetes.io/metadata.name": "ingress-nginx"},
}
EXTERNAL_IP = "203.0.113.7"


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: a client outside the cluster (address EXTERNAL_IP)
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    ports: dict[str, int] = field(default_factory=dict, hash=False)  # container port name -> number


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_ns: str, src: Pod) -> bool:
    if "ipBlock" in peer:
        net = ipaddress.ip_network(peer["ipBlock"]["cidr"])
        return (
            src.namespace is None
            and ipaddress.ip_address(EXTERNAL_IP) in net
            and not any(
                ipaddress.ip_address(EXTERNAL_IP) in ipaddress.ip_network(c) for c in peer["ipBlock"].get("except", [])
            )
        )
    if src.namespace is None:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], NAMESPACES[src.namespace])
    else:
        ns_ok = src.namespace == policy_ns
    return ns_ok and _selects(peer.get("podSelector", {}), src.labels)


def _port_matches(rule_port: dict[str, Any], dst: Pod, port: int) -> bool:
    want = rule_port["port"]
    if isinstance(want, str):
        return port == dst.ports.get(want)
    return want <= port <= rule_port.get("endPort", want)


class Cluster:
    def __init__(self, pods: list[Pod], policies: list[dict[str, Any]]):
        self.pods, self.policies = pods, policies

    def allowed(self, src: Pod, dst: Pod, port: int) -> bool:
        selecting = [
            p
            for p in self.policies
            if p["metadata"]["namespace"] == dst.namespace
            and "Ingress" in p["spec"]["policyTypes"]
            and _selects(p["spec"]["podSelector"], dst.labels)
        ]
        if not selecting:
            return True
        for policy in selecting:
            for rule in policy["spec"].get("ingress", []):
                ports_ok = not rule.get("ports") or any(_port_matches(rp, dst, port) for rp in rule["ports"])
                peers = rule.get("from")
                peers_ok = not peers or any(_peer_matches(peer, policy["metadata"]["namespace"], src) for peer in peers)
                if ports_ok and peers_ok:
                    return True
        return False


def _render(name: str, spec: dict[str, Any], settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    stored, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "team"},
            "spec": spec,
        }
    )
    assert errors == []
    return render(parse_spec(stored["spec"]), name, "team", UID, settings)


def _pods_of(manifests: list[dict[str, Any]]) -> dict[str, Pod]:
    """One pod per rendered Deployment, with the template's labels and named container ports."""
    out = {}
    for m in manifests:
        if m["kind"] == "Deployment":
            template = m["spec"]["template"]
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            env = {e["name"]: e.get("value") for c in template["spec"]["containers"] for e in c.get("env", [])}
            if "UCX_TCP_PORT_RANGE" in env:  # UCX's own TCP listeners: probe both ends of the range
                low, high = map(int, env["UCX_TCP_PORT_RANGE"].split("-"))
                ports.update({"ucx-low": low, "ucx-high": high})
            out[m["metadata"]["name"]] = Pod(
                m["metadata"]["name"], m["metadata"]["namespace"], template["metadata"]["labels"], ports
            )
    return out


def _policies(manifests):
    return [m for m in manifests if m["kind"] == "NetworkPolicy"]


BYSTANDERS = [
    Pod("team-shell", "team", {"app": "shell"}),
    Pod("other-shell", "other", {"app": "shell"}),
    Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
    Pod("ingress", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
    Pod("internet", None),
]


def _expected(src: str, dst: str, port_name: str, gateway_sources: set[str]) -> bool:
    """The issue's rules: worker grpc/kv only from the same service's router and workers; metrics
    only from monitoring; the router's http from `gateway_sources`; nothing else."""
    src_svc = src.split("-")[0] if src.startswith(("a-", "b-")) else None
    dst_svc, dst_component = dst.split("-", 1)
    if port_name == "metrics":
        return src == "prometheus"
    if dst_component == "router":
        return src in gateway_sources
    return src_svc == dst_svc  # grpc, kv: its own router, prefill and decode


def _matrix(spec_b: dict[str, Any], gateway_sources_b: set[str] | None = None, settings=None):
    """(evaluated, expected) for every path to every port of both services' pods; service a is
    rendered with defaults, b from `spec_b`; None: b's gateway admits the default sources."""
    manifests = {"a": _render("a", {"model": {"uri": "m"}}, settings), "b": _render("b", spec_b, settings)}
    pods = {**_pods_of(manifests["a"]), **_pods_of(manifests["b"])}
    everyone = {**pods, **{p.name: p for p in BYSTANDERS}}
    cluster = Cluster(list(everyone.values()), _policies(manifests["a"]) + _policies(manifests["b"]))
    team = {n for n, p in everyone.items() if p.namespace == "team"}
    default_gateway = team | {"ingress"}
    got, want = {}, {}
    for dst in pods.values():
        for port_name, port in dst.ports.items():
            sources = default_gateway if dst.name.startswith("a-") or gateway_sources_b is None else gateway_sources_b
            for src in everyone.values():
                if src is dst:
                    continue
                key = (src.name, dst.name, port_name)
                got[key] = cluster.allowed(src, dst, port)
                want[key] = _expected(src.name, dst.name, port_name, sources)
    return got, want, manifests


def _diff(got, want):
    return sorted((k, got[k]) for k in want if got[k] != want[k])


def test_two_services_side_by_side_every_path():
    got, want, manifests = _matrix({"model": {"uri": "m"}})
    assert _diff(got, want) == []
    # The matrix really contains both kinds of path, for each port kind.
    assert got[("a-router", "a-decode", "grpc")] and not got[("b-router", "a-decode", "grpc")]
    assert got[("a-prefill", "a-decode", "kv")] and not got[("b-prefill", "a-decode", "kv")]
    assert got[("a-prefill", "a-decode", "ucx-high")] and not got[("b-prefill", "a-decode", "ucx-low")]
    assert not got[("team-shell", "a-prefill", "grpc")] and not got[("other-shell", "b-decode", "kv")]
    assert got[("prometheus", "b-decode", "metrics")] and not got[("a-router", "b-decode", "metrics")]
    assert got[("ingress", "a-router", "http")] and got[("team-shell", "b-router", "http")]
    assert not got[("other-shell", "a-router", "http")] and not got[("internet", "a-router", "http")]
    assert sum(want.values()) and sum(not v for v in want.values())
    for m in manifests["a"] + manifests["b"]:
        if m["kind"] == "NetworkPolicy":
            validate_manifest(m)


def test_gateway_from_a_cidr_and_configured_monitoring():
    settings = OperatorSettings.model_validate(
        {
            "networkPolicy": {
                "workloads": {
                    "monitoring": {
                        "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"},
                        "podLabels": {"app.kubernetes.io/name": "prometheus"},
                    }
                }
            }
        }
    )
    spec_b = {"model": {"uri": "m"}, "networkPolicy": {"gatewayFrom": [{"cidr": "203.0.113.0/24"}]}}
    got, want, manifests = _matrix(spec_b, {"internet"}, settings)
    assert _diff(got, want) == []
    assert got[("internet", "b-router", "http")] and not got[("team-shell", "b-router", "http")]
    for m in manifests["b"]:
        if m["kind"] == "NetworkPolicy":
            validate_manifest(m)


def test_an_empty_gateway_from_admits_nobody_not_everybody():
    spec_b = {"model": {"uri": "m"}, "networkPolicy": {"gatewayFrom": []}}
    got, want, _ = _matrix(spec_b, set())
    assert not any(v for k, v in got.items() if k[1] == "b-router" and k[2] == "http")
    assert [k for k in _diff(got, want) if k[0][1].startswith("b-")] == []


def test_disabled_renders_no_policy_and_the_service_is_open():
    manifests = _render(
        "b", {"model": {"uri": "m"}, "disaggregation": {"mode": "never"}, "networkPolicy": {"enabled": False}}
    )
    assert _policies(manifests) == []
    decode = _pods_of(manifests)["b-decode"]
    assert Cluster([decode], []).allowed(BYSTANDERS[1], decode, decode.ports["grpc"])


def test_a_peer_must_be_labels_or_a_cidr():
    with pytest.raises(ValueError, match="either a cidr or namespaceLabels/podLabels"):
        Peer()
    with pytest.raises(ValueError, match="either a cidr or namespaceLabels/podLabels"):
        Peer(cidr="10.0.0.0/8", pod_labels={})
    _, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "x", "namespace": "team"},
            "spec": {"model": {"uri": "m"}, "networkPolicy": {"gatewayFrom": [{}]}},
        }
    )
    assert any("either a cidr" in e for e in errors)


def test_kv_auth_secret_is_mounted_and_passed_to_the_workers():
    manifests = _render(
        "b", {"model": {"uri": "m"}, "kvTransfer": {"transport": "tcp", "authSecret": {"name": "b-kv", "key": "token"}}}
    )
    for m in manifests:
        validate_manifest(m)
    for pool in ("b-prefill", "b-decode"):
        (dep,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == pool]
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        i = container["args"].index("--kv-secret-file")
        assert container["args"][i : i + 2] == ["--kv-secret-file", "/etc/splitserve/kv/secret"]
        assert {"name": "kv-secret", "mountPath": "/etc/splitserve/kv", "readOnly": True} in container["volumeMounts"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-secret"]
        assert volume["secret"]["secretName"] == "b-kv" and volume["secret"]["items"] == [
            {"key": "token", "path": "secret"}
        ]
    (router,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "b-router"]
    assert "kv-secret" not in str(router)


@pytest.mark.parametrize(
    "tls,secret", [({"issuer": {"name": "internal-ca"}}, "b-tls"), ({"secretName": "mine"}, "mine")]
)
def test_mtls_mounts_the_secret_into_router_and_workers(tls, secret):
    manifests = _render("b", {"model": {"uri": "m"}, "tls": tls})
    for m in manifests:
        validate_manifest(m)
    certs = [m for m in manifests if m["kind"] == "Certificate"]
    if "issuer" in tls:
        (cert,) = certs
        assert cert["spec"]["secretName"] == "b-tls" and cert["spec"]["dnsNames"] == ["splitserve-worker"]
        assert cert["spec"]["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert set(cert["spec"]["usages"]) >= {"server auth", "client auth"}
    else:
        assert certs == []
    for name in ("b-prefill", "b-decode", "b-router"):
        (dep,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name]
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert args[args.index("--tls-cert") + 1] == "/etc/splitserve/tls/tls.crt"
        assert args[args.index("--tls-ca") + 1] == "/etc/splitserve/tls/ca.crt"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == secret


def test_tls_needs_exactly_one_source():
    _, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "x", "namespace": "team"},
            "spec": {"model": {"uri": "m"}, "tls": {"secretName": "a", "issuer": {"name": "i"}}},
        }
    )
    assert any("exactly one of secretName or issuer" in e for e in errors)
