"""Closed by default in Kubernetes (issue 42's operator findings).

* Gateway API keys: every rendered router reads a key file from a Secret, the operator's generated
  one (a single admin key) unless spec.router.apiKeys names one; spec.router.allowUnauthenticated
  opts out with the condition Authenticated=False; the chart may forbid opting out.
* The key file's mount is reloaded when the kubelet swaps in an updated Secret.
* Least privilege: the chart's default RBAC is namespaced (a Role in the release namespace);
  cluster-wide needs operator.clusterWide.
* Per-role certificates: the router's certificate is a client-only router certificate, workers
  check roles, and a router certificate of the old kind (a worker's) is re-issued.
* Resource defaults: requests and limits on every container and a size limit on every emptyDir,
  for every shipped example, the default render and the chart's own pods.

Reconciles run against kmock's in-memory Kubernetes API emulator (not a real API server, see
opkit_emulator); renders are checked as YAML against the Kubernetes schemas.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import pathlib

import helm_python as helm
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from opkit_kube import condition, create_isvc, isvc
from opkit_schemas import validate_manifest

from splitserve.operator import constants as C
from splitserve.operator import kube as K
from splitserve.operator import pki
from splitserve.operator.checks import InvalidSpecError, check_spec
from splitserve.operator.credentials import SECRET
from splitserve.operator.reconcile import reconcile
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings, load_settings
from splitserve.operator.spec import parse_spec
from splitserve.router.tenancy.keyfile import KeyFile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "splitserve"
SETTINGS = OperatorSettings()
TINY = {"model": {"uri": "smollm2-135m"}, "kvTransfer": {"transport": "tcp"}}
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
EXAMPLES = sorted(p for p in (ROOT / "deploy").glob("**/*.yaml") if f"kind: {C.KIND}" in p.read_text())


def deployments(manifests) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}


def pod(dep) -> dict:
    return dep["spec"]["template"]["spec"]


def router_of(spec: dict, settings=SETTINGS) -> dict:
    return deployments(render(parse_spec(spec), "svc", "ns", "uid", settings))["svc-router"]


def secret(kube, namespace, name):
    return kube.get(K.path(SECRET, namespace, name))


def data(obj, key) -> bytes:
    return base64.b64decode(obj["data"][key])


def chart_objects(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="splitserve", namespace="splitserve-system")
    return [d for p, text in rendered.items() if p.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


# -- gateway API keys, rendered -------------------------------------------------------------------


def test_the_default_router_reads_the_generated_key_file():
    router = router_of(TINY)
    (volume,) = [v for v in pod(router)["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "svc-api-keys"
    assert volume["secret"]["items"] == [{"key": "keys.yaml", "path": "keys.yaml"}]
    (mount,) = [m for m in pod(router)["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    assert "subPath" not in mount and mount["readOnly"]  # a subPath mount would never see the Secret change
    args = pod(router)["containers"][0]["args"]
    assert args[args.index("--api-keys-file") + 1] == f"{mount['mountPath']}/keys.yaml"
    validate_manifest(router)


def test_a_users_key_file_secret_is_mounted_instead():
    router = router_of({**TINY, "router": {"apiKeys": {"name": "team-keys", "key": "gateway.yaml"}}})
    (volume,) = [v for v in pod(router)["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "team-keys"
    assert volume["secret"]["items"] == [{"key": "gateway.yaml", "path": "keys.yaml"}]


def test_allow_unauthenticated_renders_an_open_gateway_and_excludes_api_keys():
    router = router_of({**TINY, "router": {"allowUnauthenticated": True}})
    assert "--api-keys-file" not in pod(router)["containers"][0]["args"]
    assert not [v for v in pod(router)["volumes"] if v["name"] == "api-keys"]
    with pytest.raises(ValueError, match="set apiKeys or allowUnauthenticated, not both"):
        parse_spec({**TINY, "router": {"allowUnauthenticated": True, "apiKeys": {"name": "k", "key": "k"}}})
    crd = (CHART / "crds" / "inferenceservices.serving.splitserve.io.yaml").read_text()
    assert "router: set apiKeys or allowUnauthenticated, not both" in crd  # the API server checks it too


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_renders_a_closed_gateway(path):
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != C.KIND:
            continue
        spec = parse_spec(doc["spec"])
        router = deployments(render(spec, "svc", "ns", "uid", SETTINGS))["svc-router"]
        assert "--api-keys-file" in pod(router)["containers"][0]["args"], f"{path.name}: open gateway"


# -- gateway API keys, against the emulated API ----------------------------------------------------


def test_reconcile_generates_an_admin_key_the_router_accepts(cluster, kube, namespace, tmp_path):
    owner = create_isvc(kube, "svc", namespace, TINY)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    keys = secret(kube, namespace, "svc-api-keys")
    assert keys["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    admin_key = data(keys, "admin-key").decode()
    key_file = yaml.safe_load(data(keys, "keys.yaml"))
    assert key_file == {
        "keys": [{"id": "admin", "sha256": hashlib.sha256(admin_key.encode()).hexdigest(), "role": "admin"}]
    }
    assert admin_key not in data(keys, "keys.yaml").decode()  # the router's file holds the digest only
    (tmp_path / "keys.yaml").write_bytes(data(keys, "keys.yaml"))
    loaded = KeyFile(str(tmp_path / "keys.yaml"))  # the router's own loader (router/tenancy/keyfile.py)
    assert loaded.lookup(admin_key).name == "admin" and loaded.lookup("sk-guess") is None
    assert loaded.lookup(admin_key).role == "admin"  # may load LoRA adapters at run time
    authenticated = condition(isvc(kube, namespace, "svc"), "Authenticated")
    assert (authenticated["status"], authenticated["reason"]) == ("True", "GeneratedAdminKey")

    mark = len(cluster.cluster.writes)  # a second reconcile keeps the key
    reconcile(kube, SETTINGS, namespace, "svc", now=T0 + datetime.timedelta(days=1))
    assert not [w for w in cluster.writes_since(mark, namespace) if w.plural == "secrets"]
    assert data(secret(kube, namespace, "svc-api-keys"), "admin-key").decode() == admin_key


def test_allow_unauthenticated_sets_a_warning_condition_and_no_key(cluster, kube, namespace):
    create_isvc(kube, "svc", namespace, {**TINY, "router": {"allowUnauthenticated": True}})
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    assert secret(kube, namespace, "svc-api-keys") is None
    authenticated = condition(isvc(kube, namespace, "svc"), "Authenticated")
    assert (authenticated["status"], authenticated["reason"]) == ("False", "UnauthenticatedByRequest")
    assert "anyone who reaches the gateway" in authenticated["message"]


def test_a_users_key_secret_means_no_generated_one(cluster, kube, namespace):
    create_isvc(kube, "svc", namespace, {**TINY, "router": {"apiKeys": {"name": "team-keys", "key": "k"}}})
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    assert secret(kube, namespace, "svc-api-keys") is None
    assert condition(isvc(kube, namespace, "svc"), "Authenticated")["reason"] == "UserSuppliedKeys"


def test_the_chart_can_forbid_an_open_gateway(tmp_path):
    (cm,) = [
        d
        for d in chart_objects({"security": {"allowUnauthenticatedGateway": False}})
        if d["kind"] == "ConfigMap" and "defaults.yaml" in d.get("data", {})
    ]
    (tmp_path / "defaults.yaml").write_text(cm["data"]["defaults.yaml"])
    strict = load_settings(str(tmp_path / "defaults.yaml"))
    assert strict.security.allow_unauthenticated_gateway is False
    assert SETTINGS.security.allow_unauthenticated_gateway is True
    open_spec = parse_spec({**TINY, "router": {"allowUnauthenticated": True}})
    check_spec(open_spec, "svc", SETTINGS)
    with pytest.raises(InvalidSpecError, match="router.allowUnauthenticated is not allowed"):
        check_spec(open_spec, "svc", strict)


def test_the_key_file_mount_reloads_when_the_kubelet_swaps_the_secret(tmp_path):
    """The kubelet's atomic writer: keys.yaml -> ..data/keys.yaml, ..data -> a timestamped folder,
    replaced by renaming a new symlink over ..data. The router's KeyFile sees the new keys."""

    def version(name: str, key: str) -> None:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "keys.yaml").write_text(yaml.safe_dump({"keys": [{"id": name, "key": key}]}))

    version("..v1", "sk-first")
    os.symlink("..v1", tmp_path / "..data")
    os.symlink("..data/keys.yaml", tmp_path / "keys.yaml")
    keys = KeyFile(str(tmp_path / "keys.yaml"))
    assert keys.lookup("sk-first").name == "..v1"
    version("..v2", "sk-second")
    os.symlink("..v2", tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert keys.lookup("sk-second").name == "..v2" and keys.lookup("sk-first") is None


# -- least privilege ---------------------------------------------------------------------------


def rules_of(obj) -> set[tuple[str, str, str]]:
    return {
        (g, r, v) for rule in obj["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }


def test_the_default_install_is_namespaced():
    objs = chart_objects({})
    cluster_roles = [o for o in objs if o["kind"] == "ClusterRole"]
    assert [o["metadata"]["name"] for o in cluster_roles] == ["splitserve-observer"]
    assert {v for _, _, v in rules_of(cluster_roles[0])} == {"list", "watch"}  # no write anywhere cluster-wide
    (role,) = [o for o in objs if o["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "splitserve-system"
    assert ("", "secrets", "create") in rules_of(role)
    (deploy,) = [o for o in objs if o["kind"] == "Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=splitserve-system" in args and "--all-namespaces" not in args


def test_cluster_wide_needs_an_explicit_value():
    objs = chart_objects({"operator": {"clusterWide": True}})
    (role,) = [o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "splitserve"]
    assert ("", "secrets", "create") in rules_of(role) and not [o for o in objs if o["kind"] == "Role"]
    (deploy,) = [o for o in objs if o["kind"] == "Deployment"]
    assert "--all-namespaces" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    with pytest.raises(Exception, match="leave operator.watchNamespaces empty"):
        chart_objects({"operator": {"clusterWide": True, "watchNamespaces": ["llm"]}})


# -- per-role certificates ---------------------------------------------------------------------


def test_the_router_gets_a_client_only_router_certificate_and_workers_check_roles(cluster, kube, namespace):
    create_isvc(kube, "svc", namespace, TINY)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    router_cert = x509.load_pem_x509_certificate(data(secret(kube, namespace, "svc-router-tls"), "tls.crt"))
    sans = router_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["splitserve-router", "svc-router"]
    assert list(router_cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    for pool in ("prefill", "decode"):
        assert pki.role_of(data(secret(kube, namespace, f"svc-{pool}-tls"), "tls.crt")) == "worker"
        dep = kube.get(K.path(K.KIND_BY_NAME["Deployment"], namespace, f"svc-{pool}"))
        assert "--tls-check-peer-roles" in pod(dep)["containers"][0]["args"]


def test_a_router_certificate_of_the_worker_kind_is_reissued(cluster, kube, namespace):
    """Services created before per-role certificates hold a router leaf naming splitserve-worker."""
    create_isvc(kube, "svc", namespace, TINY)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    ca_secret = secret(kube, namespace, "svc-ca")
    ca = pki.KeyPair(data(ca_secret, "tls.crt"), data(ca_secret, "tls.key"))
    old = pki.issue_leaf(ca, "svc-router", T0, role="worker")
    encoded = {"tls.crt": base64.b64encode(old.cert).decode(), "tls.key": base64.b64encode(old.key).decode()}
    kube.merge_patch(K.path(SECRET, namespace, "svc-router-tls"), {"data": encoded})
    reconcile(kube, SETTINGS, namespace, "svc", now=T0 + datetime.timedelta(hours=1))
    assert pki.role_of(data(secret(kube, namespace, "svc-router-tls"), "tls.crt")) == "router"


# -- resource defaults -------------------------------------------------------------------------


def assert_bounded(dep_or_pod_spec: dict, where: str) -> None:
    for container in dep_or_pod_spec["containers"]:
        resources = container.get("resources", {})
        assert resources.get("requests") and resources.get("limits", {}).get("memory"), (
            f"{where}: container {container['name']} has no requests or memory limit: {resources}"
        )
    for volume in dep_or_pod_spec.get("volumes", []):
        if "emptyDir" in volume:
            assert volume["emptyDir"].get("sizeLimit"), f"{where}: emptyDir {volume['name']} has no size limit"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_has_resources_and_bounded_empty_dirs(path):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == C.KIND:
            for name, dep in deployments(render(parse_spec(doc["spec"]), "svc", "ns", "uid", SETTINGS)).items():
                assert_bounded(pod(dep), f"{path.name}/{name}")


def test_defaults_fill_in_only_what_the_spec_leaves_out():
    deps = deployments(render(parse_spec(TINY), "svc", "ns", "uid", SETTINGS))
    for name, dep in deps.items():
        assert_bounded(pod(dep), name)
    decode = pod(deps["svc-decode"])["containers"][0]["resources"]
    assert decode == {"requests": {"cpu": "1", "memory": "1536Mi"}, "limits": {"memory": "2560Mi"}}  # 0.5 GiB KV
    own = deployments(
        render(
            parse_spec({**TINY, "decode": {"resources": {"requests": {"memory": "6Gi"}}}}), "svc", "ns", "uid", SETTINGS
        )
    )
    resources = pod(own["svc-decode"])["containers"][0]["resources"]
    assert resources == {"requests": {"memory": "6Gi"}, "limits": {"memory": "6Gi"}}  # never a limit below the request
    gpu = deployments(render(parse_spec({**TINY, "decode": {"gpus": 1}}), "svc", "ns", "uid", SETTINGS))
    assert pod(gpu["svc-decode"])["containers"][0]["resources"]["limits"] == {"memory": "32768Mi", "nvidia.com/gpu": 1}


@pytest.mark.parametrize("values", [{}, {"planner": {"enabled": True}}], ids=["operator", "planner"])
def test_the_charts_own_pods_are_bounded(values):
    for obj in chart_objects(values):
        if obj["kind"] == "Deployment":
            assert_bounded(pod(obj), obj["metadata"]["name"])
