"""Idempotent apply and one reconcile, against kmock's in-memory Kubernetes API emulator (no real
API server can run here; opkit_emulator adds uids, versions, generations and garbage
collection to it). Idempotence is asserted on the emulator's write log and on the number of
versions it stored of each object."""

from __future__ import annotations

import pytest
from opkit_emulator import ClusterThread
from opkit_kube import condition, create_isvc, deployment, isvc, mark_ready

from splitserve.operator import kube as K
from splitserve.operator.apply import apply_all, is_subset
from splitserve.operator.context import instance_selector
from splitserve.operator.reconcile import reconcile
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.planner.kube import KubeClient, load_configuration

SETTINGS = OperatorSettings()
TINY = {"model": {"uri": "smollm2-135m"}, "kvTransfer": {"transport": "tcp"}}


def apply(kube, namespace, spec, name="svc"):
    """Render and apply `spec` for the InferenceService `name` (created first if absent: the
    emulated garbage collector deletes children whose owner does not exist)."""
    owner = isvc(kube, namespace, name) or create_isvc(kube, name, namespace, TINY)
    uid = owner["metadata"]["uid"]
    manifests = render(parse_spec(spec), name, namespace, uid, SETTINGS)
    return apply_all(kube, manifests, namespace, instance_selector(name), uid), manifests


@pytest.mark.parametrize(
    "want,have,expected",
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1, 2], "c": 3}}, True),
        ({"a": [1, 2]}, {"a": [1, 2, 3]}, False),
        ({"a": [{"x": 1}]}, {"a": [{"x": 1, "defaulted": "y"}]}, True),
        ({"memory": "1024Mi", "cpu": "1"}, {"memory": "1Gi", "cpu": "1000m"}, True),
        ({"memory": "1Gi"}, {"memory": "2Gi"}, False),
        ({"nodeSelector": {}}, {}, True),
        ({"tolerations": []}, {"tolerations": None}, True),
        ({"a": "grpc"}, {"a": "http"}, False),
        ({"a": True}, {"a": 1}, False),
        ({"a": 1}, {}, False),
    ],
)
def test_is_subset(want, have, expected):
    assert is_subset(want, have) is expected


def test_second_apply_makes_no_request_that_writes(cluster, kube, namespace):
    first, manifests = apply(kube, namespace, TINY)
    assert len(first.created) == len(manifests) == 16 and not first.patched
    mark = len(cluster.cluster.writes)
    second, _ = apply(kube, namespace, TINY)
    assert not second.changed and len(second.unchanged) == 16
    assert cluster.writes_since(mark, namespace) == []
    for m in manifests:
        plural = K.KIND_BY_NAME[m["kind"]].plural
        assert cluster.history(f"{m['apiVersion']}/{plural}", namespace, m["metadata"]["name"]) == 1


def test_fields_the_api_server_adds_do_not_cause_patches(cluster, kube, namespace):
    apply(kube, namespace, TINY)
    dep = K.KIND_BY_NAME["Deployment"]
    url = K.path(dep, namespace, "svc-decode")
    live = kube.get(url)
    container = {
        **live["spec"]["template"]["spec"]["containers"][0],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    }
    container["resources"]["requests"]["ephemeral-storage"] = "1Gi"  # a request we did not set (a LimitRange's)
    kube.merge_patch(
        url,
        {
            "spec": {
                "progressDeadlineSeconds": 600,
                "strategy": {"type": "RollingUpdate"},
                "template": {"spec": {"dnsPolicy": "ClusterFirst", "containers": [container]}},
            }
        },
    )
    svc = K.path(K.KIND_BY_NAME["Service"], namespace, "svc-decode")
    kube.merge_patch(svc, {"spec": {"clusterIPs": ["None"], "sessionAffinity": "None", "ipFamilies": ["IPv4"]}})
    mark = len(cluster.cluster.writes)
    result, _ = apply(kube, namespace, TINY)
    # Our render sets no ephemeral-storage request, so the added one is someone else's.
    assert not result.changed
    assert cluster.writes_since(mark, namespace) == []


def test_an_edited_child_is_patched_back_and_nothing_else(cluster, kube, namespace):
    apply(kube, namespace, TINY)
    url = K.path(K.KIND_BY_NAME["Deployment"], namespace, "svc-prefill")
    live = kube.get(url)
    container = dict(live["spec"]["template"]["spec"]["containers"][0], image="evil:latest")
    kube.merge_patch(url, {"spec": {"template": {"spec": {"containers": [container]}}}})
    result, _ = apply(kube, namespace, TINY)
    assert (result.created, result.patched, result.deleted) == ([], ["Deployment/svc-prefill"], [])
    assert kube.get(url)["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/splitserve/splitserve:0.1.0"


def test_an_autoscaled_pool_keeps_the_autoscalers_replicas(cluster, kube, namespace):
    spec = {**TINY, "decode": {"autoscaling": {"enabled": True, "provider": "hpa", "minReplicas": 2}}}
    apply(kube, namespace, spec)
    url = K.path(K.KIND_BY_NAME["Deployment"], namespace, "svc-decode")
    assert kube.get(url)["spec"]["replicas"] == 2  # created at minReplicas
    kube.merge_patch(url, {"spec": {"replicas": 7}})  # the HPA scales up
    mark = len(cluster.cluster.writes)
    result, _ = apply(kube, namespace, spec)
    assert not result.changed and cluster.writes_since(mark, namespace) == []
    spec["decode"]["autoscaling"]["targetQueueDepth"] = 3
    result, _ = apply(kube, namespace, spec)
    assert result.patched == ["HorizontalPodAutoscaler/svc-decode"]
    assert kube.get(url)["spec"]["replicas"] == 7


def test_switching_provider_prunes_only_our_old_autoscaler(cluster, kube, namespace):
    keda = {**TINY, "decode": {"autoscaling": {"enabled": True, "provider": "keda"}}}
    apply(kube, namespace, keda)
    so = K.KIND_BY_NAME["ScaledObject"]
    foreign = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": "someone-elses",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/instance": "svc", "app.kubernetes.io/managed-by": "splitserve-operator"},
        },
        "spec": {"scaleTargetRef": {"name": "x"}, "triggers": []},
    }
    kube.create(K.path(so, namespace), foreign)
    hpa = {**TINY, "decode": {"autoscaling": {"enabled": True, "provider": "hpa"}}}
    result, _ = apply(kube, namespace, hpa)
    assert result.created == ["HorizontalPodAutoscaler/svc-decode"]
    assert result.deleted == ["ScaledObject/svc-decode"]
    assert kube.get(K.path(so, namespace, "svc-decode")) is None
    assert kube.get(K.path(so, namespace, "someone-elses")) is not None  # not owned by this uid


def test_reconcile_sets_status_then_does_nothing(cluster, kube, namespace):
    obj = create_isvc(kube, "svc", namespace, TINY)
    outcome = reconcile(kube, SETTINGS, namespace, "svc")
    assert outcome.waiting and len(outcome.result.created) == 16
    status = isvc(kube, namespace, "svc")["status"]
    assert condition({"status": status})["reason"] == "ComponentsNotReady"
    assert status["observedGeneration"] == obj["metadata"]["generation"] == 1
    assert status["url"] == f"http://svc.{namespace}.svc:8000"
    assert deployment(kube, namespace, "svc-decode")["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    for name in ("svc-prefill", "svc-decode", "svc-router"):
        mark_ready(kube, namespace, name)
    assert reconcile(kube, SETTINGS, namespace, "svc").ready
    ready = isvc(kube, namespace, "svc")
    assert condition(ready)["status"] == "True"
    assert ready["status"]["decode"] == {"replicas": 1, "readyReplicas": 1, "ready": "1/1"}
    mark = len(cluster.cluster.writes)
    versions = cluster.history("serving.splitserve.io/v1alpha1/inferenceservices", namespace, "svc")
    again = reconcile(kube, SETTINGS, namespace, "svc")
    assert again.ready and not again.result.changed
    assert cluster.writes_since(mark, namespace) == []
    assert cluster.history("serving.splitserve.io/v1alpha1/inferenceservices", namespace, "svc") == versions


def test_invalid_spec_sets_a_condition_and_creates_nothing(cluster, kube, namespace):
    create_isvc(kube, "svc", namespace, {**TINY, "decode": {"resources": {"limits": {"memory": "512Mi"}}}})
    mark = len(cluster.cluster.writes)
    outcome = reconcile(kube, SETTINGS, namespace, "svc")
    assert outcome.invalid.startswith("engine.kvCacheMemoryGiB=0.5 plus 0.25 GiB")
    ready = condition(isvc(kube, namespace, "svc"))
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == outcome.invalid
    assert [(w.method, w.plural, w.subresource) for w in cluster.writes_since(mark, namespace)] == [
        ("PATCH", "inferenceservices", "status")
    ]


def test_reconcile_of_a_missing_object_is_a_no_op(kube, namespace):
    assert reconcile(kube, SETTINGS, namespace, "nothing-here").gone


def test_missing_keda_api_is_reported_in_the_status(tmp_path):
    with ClusterThread(with_keda=False) as bare:
        kube = KubeClient(load_configuration(bare.kubeconfig(str(tmp_path / "config"))))
        create_isvc(kube, "svc", "ns", {**TINY, "decode": {"autoscaling": {"enabled": True, "provider": "keda"}}})
        outcome = reconcile(kube, SETTINGS, "ns", "svc")
        assert outcome.waiting == (
            "the cluster has no keda.sh/v1alpha1 ScaledObject API: install it or change the InferenceService"
        )
        assert condition(isvc(kube, "ns", "svc"))["reason"] == "MissingAPI"
        hpa = {"decode": {"autoscaling": {"enabled": True, "provider": "hpa"}}}
        kube.merge_patch(K.path(K.ISVC, "ns", "svc"), {"spec": hpa})
        assert reconcile(kube, SETTINGS, "ns", "svc").waiting.startswith(
            "prefill: the prefill Deployment has not observed its latest template yet"
        )


def test_status_url_follows_the_load_balancer(cluster, kube, namespace):
    create_isvc(kube, "svc", namespace, {**TINY, "router": {"service": {"type": "LoadBalancer", "port": 80}}})
    reconcile(kube, SETTINGS, namespace, "svc")
    assert isvc(kube, namespace, "svc")["status"]["url"] == f"http://svc.{namespace}.svc:80"
    gateway = K.path(K.KIND_BY_NAME["Service"], namespace, "svc")
    kube.merge_patch(gateway + "/status", {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}})
    reconcile(kube, SETTINGS, namespace, "svc")
    assert isvc(kube, namespace, "svc")["status"]["url"] == "http://203.0.113.7:80"
