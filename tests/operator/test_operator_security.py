"""Secure by default: every InferenceService runs mutual TLS and authenticated KV transfer unless
its spec says `security.insecure: true`.

Judged on the rendered manifests (every shipped example), and with reconciles against kmock's
in-memory Kubernetes API emulator (not a real API server, see opkit_emulator): the Secrets the
operator creates, that a reconcile with nothing due writes none, that certificates are renewed
before they expire (time moved forward through `reconcile(now=...)`) and roll their pool, and
that the certificates it issues really carry a gRPC mutual-TLS handshake.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import pathlib

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opkit_kube import condition, create_isvc, isvc
from opkit_schemas import validate_manifest

from splitserve.operator import constants as C
from splitserve.operator import kube as K
from splitserve.operator import pki
from splitserve.operator.credentials import SECRET
from splitserve.operator.reconcile import reconcile
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.platform.wire import grpc_tls

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()
TINY = {"model": {"uri": "smollm2-135m"}, "kvTransfer": {"transport": "tcp"}}
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
TLS_ARGS = [
    "--tls-cert",
    "/etc/splitserve/tls/tls.crt",
    "--tls-key",
    "/etc/splitserve/tls/tls.key",
    "--tls-ca",
    "/etc/splitserve/tls/ca.crt",
]


def deployments(manifests):
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}


def secret_volumes(dep) -> dict[str, str]:
    return {
        v["name"]: v["secret"]["secretName"]
        for v in dep["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }


def args_of(dep) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


EXAMPLES = sorted(p for p in (ROOT / "deploy").glob("**/*.yaml") if f"kind: {C.KIND}" in p.read_text())


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_renders_secure(path):
    import yaml

    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != C.KIND:
            continue
        spec = parse_spec(doc["spec"])
        manifests = render(spec, "svc", "ns", "uid", SETTINGS)
        for name, dep in deployments(manifests).items():
            validate_manifest(dep)
            component = name.removeprefix("svc-")
            if spec.security.insecure:
                continue
            assert "tls" in secret_volumes(dep), f"{path.name}: {name} runs without mTLS"
            if component not in ("router", "epp"):  # the EPP, like the router, moves no KV
                assert "--kv-secret-file" in args_of(dep), f"{path.name}: {name} accepts unauthenticated KV"


def test_default_render_mounts_a_kv_secret_and_a_certificate_per_pool():
    manifests = render(parse_spec(TINY), "svc", "ns", "uid", SETTINGS)
    deps = deployments(manifests)
    for pool in ("prefill", "decode"):
        dep = deps[f"svc-{pool}"]
        assert secret_volumes(dep) == {"tls": f"svc-{pool}-tls", "kv-secret": "svc-kv"}
        assert args_of(dep)[-len(TLS_ARGS) - 3 :] == [
            "--kv-secret-file",
            "/etc/splitserve/kv/secret",
            *TLS_ARGS,
            "--tls-check-peer-roles",
        ]
    assert secret_volumes(deps["svc-router"]) == {"tls": "svc-router-tls", "api-keys": "svc-api-keys"}
    assert args_of(deps["svc-router"])[-len(TLS_ARGS) - 2 :] == [
        *TLS_ARGS,
        "--api-keys-file",
        "/etc/splitserve/api-keys/keys.yaml",
    ]
    assert not [m for m in manifests if m["kind"] in ("Secret", "Certificate")]  # credentials.py writes those


def test_insecure_renders_plaintext_and_the_users_own_secret_still_applies():
    insecure = render(parse_spec({**TINY, "security": {"insecure": True}}), "svc", "ns", "uid", SETTINGS)
    for name, dep in deployments(insecure).items():
        assert secret_volumes(dep) == ({"api-keys": "svc-api-keys"} if name == "svc-router" else {})
        assert "--kv-secret-file" not in args_of(dep) and "--tls-cert" not in args_of(dep)
    own = render(
        parse_spec(
            {
                **TINY,
                "security": {"insecure": True},
                "kvTransfer": {"transport": "tcp", "authSecret": {"name": "mine", "key": "k"}},
            }
        ),
        "svc",
        "ns",
        "uid",
        SETTINGS,
    )
    assert secret_volumes(deployments(own)["svc-decode"]) == {"kv-secret": "mine"}


def test_the_crd_defaults_to_secure_and_rejects_unknown_security_fields():
    assert parse_spec(TINY).security.insecure is False
    with pytest.raises(ValueError, match="insecur"):
        parse_spec({**TINY, "security": {"insecur": True}})


# --- against the emulated API (kmock) -------------------------------------------------------


def secret(kube, namespace, name):
    return kube.get(K.path(SECRET, namespace, name))


def data(obj, key) -> bytes:
    return base64.b64decode(obj["data"][key])


def cert_of(kube, namespace, name) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data(secret(kube, namespace, name), "tls.crt"))


def secret_writes(cluster, mark, namespace):
    return [w for w in cluster.writes_since(mark, namespace) if w.plural == "secrets"]


def revision(kube, namespace, pool):
    dep = kube.get(K.path(K.KIND_BY_NAME["Deployment"], namespace, f"svc-{pool}"))
    return dep["spec"]["template"]["metadata"]["annotations"][C.ANNOTATION_TLS_REVISION]


def test_reconcile_creates_the_kv_secret_ca_and_pool_certificates_once(cluster, kube, namespace):
    owner = create_isvc(kube, "svc", namespace, TINY)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    kv = secret(kube, namespace, "svc-kv")
    assert len(data(kv, "secret")) == 64 and kv["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    ca = data(secret(kube, namespace, "svc-ca"), "tls.crt")
    for component in ("prefill", "decode", "router"):
        leaf = secret(kube, namespace, f"svc-{component}-tls")
        assert leaf["type"] == "kubernetes.io/tls" and data(leaf, "ca.crt") == ca
        assert pki.is_signed_by(data(leaf, "tls.crt"), ca)
        cert = x509.load_pem_x509_certificate(data(leaf, "tls.crt"))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
        role_name = "splitserve-router" if component == "router" else "splitserve-worker"
        assert names == [role_name, f"svc-{component}"]  # per-role certificates
        assert cert.not_valid_after_utc - T0 > datetime.timedelta(days=89)
    assert condition(isvc(kube, namespace, "svc"), "Secure")["status"] == "True"
    mark = len(cluster.cluster.writes)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0 + datetime.timedelta(days=1))
    assert secret_writes(cluster, mark, namespace) == []


def test_certificates_are_renewed_before_expiry_and_roll_their_pools(cluster, kube, namespace):
    create_isvc(kube, "svc", namespace, TINY)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    ca0 = data(secret(kube, namespace, "svc-ca"), "tls.crt")
    serial0, rev0 = cert_of(kube, namespace, "svc-decode-tls").serial_number, revision(kube, namespace, "decode")
    kv0 = data(secret(kube, namespace, "svc-kv"), "secret")

    # 61 of 90 days: less than a third of the leaf's life is left -> new leaves, same CA.
    reconcile(kube, SETTINGS, namespace, "svc", now=T0 + datetime.timedelta(days=61))
    leaf = cert_of(kube, namespace, "svc-decode-tls")
    assert leaf.serial_number != serial0 and leaf.not_valid_after_utc > T0 + datetime.timedelta(days=150)
    assert data(secret(kube, namespace, "svc-ca"), "tls.crt") == ca0
    assert revision(kube, namespace, "decode") != rev0  # the pool rolls onto the new certificate
    assert data(secret(kube, namespace, "svc-kv"), "secret") == kv0

    # 250 of 365 days: the CA itself is renewed; leaves move to it, trusting old and new CA meanwhile.
    later = T0 + datetime.timedelta(days=250)
    reconcile(kube, SETTINGS, namespace, "svc", now=later)
    ca_secret = secret(kube, namespace, "svc-ca")
    ca1 = data(ca_secret, "tls.crt")
    assert ca1 != ca0 and data(ca_secret, "previous.crt") == ca0
    for component in ("prefill", "decode", "router"):
        leaf_secret = secret(kube, namespace, f"svc-{component}-tls")
        assert pki.is_signed_by(data(leaf_secret, "tls.crt"), ca1)
        assert data(leaf_secret, "ca.crt") == ca1 + ca0
    # Once the old CA has expired it leaves the bundle.
    reconcile(kube, SETTINGS, namespace, "svc", now=T0 + datetime.timedelta(days=366))
    assert data(secret(kube, namespace, "svc-router-tls"), "ca.crt") == ca1


def test_insecure_sets_a_warning_condition_and_creates_no_transport_secrets(cluster, kube, namespace):
    """Transport security off; the gateway's API key is a separate matter and stays (router.allowUnauthenticated)."""
    create_isvc(kube, "svc", namespace, {**TINY, "security": {"insecure": True}})
    mark = len(cluster.cluster.writes)
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    assert [w.plural for w in secret_writes(cluster, mark, namespace)] == ["secrets"]  # the API keys' create
    assert secret(kube, namespace, "svc-kv") is None and secret(kube, namespace, "svc-ca") is None
    secure = condition(isvc(kube, namespace, "svc"), "Secure")
    assert (secure["status"], secure["reason"]) == ("False", "InsecureByRequest")
    assert "plaintext" in secure["message"] and "KV blocks from anyone" in secure["message"]
    assert condition(isvc(kube, namespace, "svc"), "Ready")["status"] == "False"  # pods not ready; not because insecure


def test_a_users_kv_secret_is_used_instead_of_a_generated_one(cluster, kube, namespace):
    create_isvc(
        kube, "svc", namespace, {**TINY, "kvTransfer": {"transport": "tcp", "authSecret": {"name": "mine", "key": "k"}}}
    )
    reconcile(kube, SETTINGS, namespace, "svc", now=T0)
    assert secret(kube, namespace, "svc-kv") is None
    assert secret(kube, namespace, "svc-decode-tls") is not None


def test_issued_certificates_carry_a_grpc_mutual_tls_handshake(cluster, kube, namespace, tmp_path):
    """The decode pool's certificate serves, the router's calls; a client without one is refused."""
    create_isvc(kube, "svc", namespace, TINY)
    reconcile(kube, SETTINGS, namespace, "svc", now=datetime.datetime.now(datetime.UTC))
    files = {}
    for component in ("decode", "router"):
        obj, folder = secret(kube, namespace, f"svc-{component}-tls"), tmp_path / component
        folder.mkdir()
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (folder / key).write_bytes(data(obj, key))
        files[component] = grpc_tls.TlsFiles(str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt"))

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", grpc_tls.server_credentials(files["decode"]))
        await server.start()
        try:
            async with grpc_tls.aio_channel(f"127.0.0.1:{port}", files["router"]) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            ca_only = grpc.ssl_channel_credentials(root_certificates=data(secret(kube, namespace, "svc-ca"), "tls.crt"))
            async with grpc.aio.secure_channel(
                f"127.0.0.1:{port}", ca_only, options=[("grpc.ssl_target_name_override", "splitserve-worker")]
            ) as anonymous:
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return reply.status
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.SERVING


def test_the_chart_can_forbid_insecure_services(tmp_path):
    """helm value security.allowInsecure reaches the operator, which then rejects insecure specs."""
    import helm_python as helm
    import yaml

    from splitserve.operator.checks import InvalidSpecError, check_spec
    from splitserve.operator.settings import load_settings

    with helm.Chart.load(ROOT / "helm" / "splitserve") as chart:
        rendered = chart.render({"security": {"allowInsecure": False}}, name="splitserve", namespace="ops")
    docs = [d for p, text in rendered.items() if p.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "defaults.yaml" in d.get("data", {})]
    (tmp_path / "defaults.yaml").write_text(cm["data"]["defaults.yaml"])
    strict = load_settings(str(tmp_path / "defaults.yaml"))
    assert strict.security.allow_insecure is False and SETTINGS.security.allow_insecure is True
    insecure = parse_spec({**TINY, "security": {"insecure": True}})
    check_spec(insecure, "svc", SETTINGS)
    with pytest.raises(InvalidSpecError, match="security.insecure is not allowed"):
        check_spec(insecure, "svc", strict)
    check_spec(parse_spec(TINY), "svc", strict)
