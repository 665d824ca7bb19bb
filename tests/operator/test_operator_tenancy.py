"""Shared quotas in Kubernetes (issue 53): every gateway process (router replicas, the EPP, each
decode pod's sidecar) gets the quota store's Redis URL in its config and the password from the
Secret in its environment; a Redis URL with credentials never reaches a ConfigMap; a key file
served by more than one gateway process without Redis is refused with the reason."""

from __future__ import annotations

import pytest
import yaml
from opkit_schemas import admit

from splitserve.operator.checks import InvalidSpecError, check_spec
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.platform.errors import ConfigError
from splitserve.router.config.file import from_dict

UID = "6f1c7c4e-0000-4000-8000-000000000053"
REDIS = {"url": "redis://redis.data:6379/2", "passwordSecret": {"name": "redis", "key": "password"}}
PASSWORD_ENV = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}}
KEYS = {"name": "keys", "key": "keys.yaml"}


def rendered(**spec) -> dict[tuple[str, str], dict]:
    raw = {"model": {"uri": "smollm2-135m"}, **spec}
    return {(m["kind"], m["metadata"]["name"]): m for m in render(parse_spec(raw), "chat", "llm", UID)}


def container(out, deployment: str, name: str) -> dict:
    (found,) = [c for c in out["Deployment", deployment]["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def test_every_gateway_process_gets_the_quota_store_and_its_password(monkeypatch):
    out = rendered(
        router={"replicas": 2, "redis": REDIS, "apiKeys": KEYS},
        gateway={"mode": "inferencePool", "eppReplicas": 2},
        decode={"replicas": 3},
    )
    processes = {
        "router": (container(out, "chat-router", "router"), out["ConfigMap", "chat-router"]["data"]["router.yaml"]),
        "epp": (container(out, "chat-epp", "epp"), out["ConfigMap", "chat-epp"]["data"]["epp.yaml"]),
        "sidecar": (container(out, "chat-decode", "sidecar"), out["ConfigMap", "chat-epp"]["data"]["sidecar.yaml"]),
    }
    monkeypatch.setenv("REDIS_PASSWORD", "s3cr:t")
    for name, (c, text) in processes.items():
        assert PASSWORD_ENV in c["env"], name
        raw = yaml.safe_load(text)
        assert raw["gateway"]["rate_limit_redis_url"] == REDIS["url"], name
        assert "s3cr" not in text  # never in a ConfigMap
        config = from_dict(raw)  # what the process reads, REDIS_PASSWORD in its environment
        assert config.gateway.rate_limit_redis_url == "redis://:s3cr%3At@redis.data:6379/2", name
    assert "REDIS_PASSWORD" not in str(container(out, "chat-decode", "worker")["env"])  # the worker needs none


def test_without_redis_there_is_no_quota_store_and_no_password():
    out = rendered()
    raw = yaml.safe_load(out["ConfigMap", "chat-router"]["data"]["router.yaml"])
    assert "rate_limit_redis_url" not in raw["gateway"]
    assert "REDIS_PASSWORD" not in str(container(out, "chat-router", "router")["env"])


@pytest.mark.parametrize("url", ["redis://:hunter2@redis:6379", "rediss://user:pw@redis:6380/0"])
def test_a_redis_url_with_credentials_is_refused(url):
    spec = {"model": {"uri": "m"}, "router": {"redis": {"url": url}}}
    _, errors = admit({"apiVersion": "serving.splitserve.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": "svc", "namespace": "ns"}, "spec": spec})  # fmt: skip
    assert len(errors) == 1 and errors[0].startswith("spec.router.redis.url:") and "[^@]+" in errors[0], errors


def test_a_key_file_on_several_gateway_processes_needs_the_shared_store():
    settings = OperatorSettings()
    pool = {"model": {"uri": "m"}, "router": {"apiKeys": KEYS}, "gateway": {"mode": "inferencePool"}}
    with pytest.raises(InvalidSpecError, match=r"router.apiKeys with 3 gateway processes .* needs router.redis"):
        check_spec(parse_spec(pool), "svc", settings)
    check_spec(parse_spec({**pool, "router": {"apiKeys": KEYS, "redis": REDIS}}), "svc", settings)
    check_spec(parse_spec({"model": {"uri": "m"}, "router": {"apiKeys": KEYS}}), "svc", settings)  # one router
    autoscaled = {**pool, "decode": {"autoscaling": {"enabled": True, "maxReplicas": 8}}}
    with pytest.raises(InvalidSpecError, match="with 10 gateway processes"):
        check_spec(parse_spec(autoscaled), "svc", settings)


def test_the_sidecar_has_its_own_tmp_user_and_service_account():
    out = rendered(router={"apiKeys": KEYS, "redis": REDIS}, gateway={"mode": "inferencePool"})
    pod = out["Deployment", "chat-decode"]["spec"]["template"]["spec"]
    worker, sidecar = container(out, "chat-decode", "worker"), container(out, "chat-decode", "sidecar")
    tmp = {c["name"]: next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp") for c in (worker, sidecar)}
    assert tmp["worker"] != tmp["sidecar"]
    assert not {m["name"] for m in worker["volumeMounts"]} & {m["name"] for m in sidecar["volumeMounts"]}
    assert sidecar["securityContext"]["runAsUser"] != pod["securityContext"]["runAsUser"]
    # its own ServiceAccount, no automounted token: the projected token is the sidecar's alone
    assert pod["serviceAccountName"] == "chat-sidecar" and pod["automountServiceAccountToken"] is False
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert [m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == token] == ["sidecar-token"]
    assert all(m["mountPath"] != token for m in worker["volumeMounts"])
    (volume,) = [v for v in pod["volumes"] if v["name"] == "sidecar-token"]
    assert volume["projected"]["sources"][0]["serviceAccountToken"]["path"] == "token"
    assert out["ServiceAccount", "chat-sidecar"]["automountServiceAccountToken"] is False
    assert out["Role", "chat-sidecar"]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    ]
    binding = out["RoleBinding", "chat-sidecar"]
    assert binding["roleRef"]["name"] == "chat-sidecar" and binding["subjects"][0]["name"] == "chat-sidecar"
    # the router keeps its own account, which may also patch its ConfigMap
    assert out["Deployment", "chat-router"]["spec"]["template"]["spec"]["serviceAccountName"] == "chat-router"


def test_each_gateway_config_counts_the_processes_and_a_router_without_the_store_refuses(tmp_path):
    """Every gateway process's config says how many serve the keys (gateway.num_processes); a router
    reading one of them with the store taken out (a ConfigMap edited by hand) refuses to start when
    its key file has limits, and starts when no key has any."""
    out = rendered(
        router={"replicas": 2, "redis": REDIS, "apiKeys": KEYS},
        gateway={"mode": "inferencePool", "eppReplicas": 2},
        decode={"replicas": 3},
    )
    configs = [
        yaml.safe_load(out["ConfigMap", "chat-router"]["data"]["router.yaml"]),
        *(yaml.safe_load(text) for text in out["ConfigMap", "chat-epp"]["data"].values()),
    ]
    assert [c["gateway"]["num_processes"] for c in configs] == [7, 7, 7]  # 2 routers + 2 EPPs + 3 sidecars
    limited, unlimited = tmp_path / "limited.yaml", tmp_path / "unlimited.yaml"
    limited.write_text(yaml.safe_dump({"keys": [{"id": "team-a", "key": "sk-a", "rpm": 10}]}))
    unlimited.write_text(yaml.safe_dump({"keys": [{"id": "team-a", "key": "sk-a", "max_concurrent": 4}]}))
    for config in configs:
        without_store = {k: v for k, v in config["gateway"].items() if k != "rate_limit_redis_url"}
        with pytest.raises(ConfigError, match=r"7 gateway processes .*\(team-a\) without a shared quota store"):
            from_dict({**config, "gateway": {**without_store, "api_keys_file": str(limited)}})
        from_dict({**config, "gateway": {**without_store, "api_keys_file": str(unlimited)}})
        from_dict({**config, "gateway": {**config["gateway"], "api_keys_file": str(limited)}})


def test_the_status_says_what_to_set_when_several_processes_would_count_alone(cluster, kube, namespace):
    """Through the reconcile loop on the emulated API server (kmock, an in-memory emulator): two
    one router, the EPP and a decode pod's sidecar serving a key file without router.redis get
    Ready=False/InvalidSpec naming the number of processes and what to set, and nothing is created;
    with router.redis the spec is accepted. (Two router replicas without Redis are refused earlier,
    by the CRD schema, for the prefix index.)"""
    from opkit_kube import condition, create_isvc, isvc

    from splitserve.operator import kube as K
    from splitserve.operator.reconcile import reconcile

    spec = {"model": {"uri": "smollm2-135m"}, "router": {"apiKeys": KEYS}, "gateway": {"mode": "inferencePool"}}
    create_isvc(kube, "svc", namespace, spec)
    outcome = reconcile(kube, OperatorSettings(), namespace, "svc")
    ready = condition(isvc(kube, namespace, "svc"))
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "router.apiKeys with 3 gateway processes" in ready["message"]
    assert "set router.redis (url, passwordSecret)" in ready["message"] and outcome.result is None
    kube.merge_patch(K.path(K.ISVC, namespace, "svc"), {"spec": {"router": {"redis": REDIS}}})
    outcome = reconcile(kube, OperatorSettings(), namespace, "svc")
    assert outcome.invalid is None and condition(isvc(kube, namespace, "svc"))["reason"] != "InvalidSpec"
