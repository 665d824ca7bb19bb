"""The operator end to end under kopf's KopfRunner, against kmock's in-memory Kubernetes API
emulator (no real API server can be installed here; opkit_emulator adds uids, generations
and the garbage collector to it). The tests play the remaining controllers: they mark
Deployments ready and scale a Deployment as an HPA would.

Each test gets its own emulated cluster (conftest.py), so no other InferenceService is
resumed and resynced beside its own. Timings: resync every 0.5 s, retries of "not ready yet" after 0.3 s."""

from __future__ import annotations

import contextlib
import json
import time

import kopf
from kopf.testing import KopfRunner
from opkit_kube import condition, create_isvc, mark_ready, stored, wait_for

from splitserve.operator import kube as K
from splitserve.operator.handlers import build_registry
from splitserve.operator.settings import OperatorSettings, ReconcileSettings

FAST = OperatorSettings(reconcile=ReconcileSettings(resync_seconds=0.5, not_ready_retry_seconds=0.3))
TINY = {"model": {"uri": "smollm2-135m"}, "kvTransfer": {"transport": "tcp"}}
CHILDREN = [
    ("ConfigMap", "svc-router"),
    ("ServiceAccount", "svc-router"),
    ("Role", "svc-router"),
    ("RoleBinding", "svc-router"),
    ("Service", "svc-prefill"),
    ("Service", "svc-decode"),
    ("Service", "svc-router"),
    ("Service", "svc"),
    ("Deployment", "svc-prefill"),
    ("Deployment", "svc-decode"),
    ("Deployment", "svc-router"),
    ("PodDisruptionBudget", "svc-prefill"),
    ("PodDisruptionBudget", "svc-decode"),
    ("PodDisruptionBudget", "svc-router"),
]
POOLS = ("svc-prefill", "svc-decode", "svc-router")


def quick_exit_settings() -> kopf.OperatorSettings:
    """kopf's own timings, shortened so that stopping the operator takes a fraction of a second."""
    settings = kopf.OperatorSettings()
    settings.queueing.exit_timeout = 0.2
    settings.queueing.idle_timeout = 0.5
    settings.background.instant_exit_timeout = 1.0  # lets a timer that is mid-reconcile finish
    return settings


@contextlib.contextmanager
def operator(cluster):
    registry = build_registry(FAST, kubeconfig=cluster.kubeconfig_path)
    with KopfRunner(
        ["run", "--standalone", "--all-namespaces"], registry=registry, settings=quick_exit_settings(), timeout=30
    ) as runner:
        yield runner
    assert runner.exit_code == 0 and runner.exception is None


# The tests read through the emulator's store (no HTTP), and write through the API like kubectl.
def child(cluster, namespace, kind, name):
    return stored(cluster, kind, namespace, name)


def children(cluster, namespace):
    return {key: obj for key in CHILDREN if (obj := child(cluster, namespace, *key)) is not None}


def isvc(cluster, namespace, name="svc"):
    return stored(cluster, "InferenceService", namespace, name)


def deployment(cluster, namespace, name):
    return stored(cluster, "Deployment", namespace, name)


def progress(cluster, namespace) -> dict:
    """kopf's record of the `reconcile` handler's state on the object (empty once it succeeded)."""
    annotations = isvc(cluster, namespace)["metadata"].get("annotations", {})
    return json.loads(annotations.get("serving.splitserve.io/reconcile", "{}"))


def children_writes(cluster, mark, namespace):
    """Writes to the children since `mark`, other than the tests' own status updates."""
    return [
        (w.method, w.plural, w.name)
        for w in cluster.writes_since(mark, namespace)
        if w.plural not in ("inferenceservices", "events") and w.subresource != "status"
    ]


def settle(cluster, namespace, name="svc"):
    """Wait until the service is Ready and kopf has no handler in progress (no retry pending),
    so that stopping the operator does not race a handler (kopf then waits 5 s for it)."""

    def settled():
        obj = isvc(cluster, namespace, name)
        busy = [
            k
            for k in obj["metadata"].get("annotations", {})
            if k.startswith("serving.splitserve.io/")
            and k.rsplit("/", 1)[1] not in ("kopf-managed", "last-handled-configuration")
        ]
        return (condition(obj) or {}).get("status") == "True" and not busy

    wait_for(settled, what="Ready with no handler in progress")


def ready_service(cluster, kube, namespace, spec=TINY):
    obj = create_isvc(kube, "svc", namespace, spec)
    wait_for(lambda: len(children(cluster, namespace)) == len(CHILDREN), what="all children")
    for name in POOLS:
        mark_ready(kube, namespace, name)
    settle(cluster, namespace)
    return obj


def test_create_makes_every_child_reports_status_then_writes_nothing(cluster, kube, namespace):
    with operator(cluster) as runner:
        obj = create_isvc(kube, "svc", namespace, TINY)
        uid = obj["metadata"]["uid"]
        found = wait_for(
            lambda: (c := children(cluster, namespace)) and len(c) == len(CHILDREN) and c, what="all children"
        )
        for (kind, name), live in found.items():
            assert live["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "serving.splitserve.io/v1alpha1",
                    "kind": "InferenceService",
                    "name": "svc",
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ], (kind, name)
            assert live["metadata"]["labels"]["app.kubernetes.io/instance"] == "svc"
        waiting = wait_for(lambda: condition(isvc(cluster, namespace)), what="a Ready condition")
        assert (waiting["status"], waiting["reason"], waiting["observedGeneration"]) == (
            "False",
            "ComponentsNotReady",
            1,
        )
        # kopf records the handler's TemporaryError (and its retry) on the object.
        retry = wait_for(
            lambda: (p := progress(cluster, namespace)).get("delayed") and p, what="the create handler's retry"
        )
        assert retry["message"].startswith("not ready yet: prefill: ") and retry["success"] is False
        for name in POOLS:
            mark_ready(kube, namespace, name)
        wait_for(lambda: condition(isvc(cluster, namespace))["status"] == "True", what="Ready")
        status = isvc(cluster, namespace)["status"]
        assert status["url"] == f"http://svc.{namespace}.svc:8000"
        assert [status[p]["ready"] for p in ("prefill", "decode", "router")] == ["1/1", "1/1", "1/1"]
        assert {c["type"]: c["status"] for c in status["conditions"]} == {
            "Ready": "True",
            "PrefillReady": "True",
            "DecodeReady": "True",
            "RouterReady": "True",
            "Secure": "True",
            "Authenticated": "True",
        }
        settle(cluster, namespace)
        time.sleep(0.5)  # the last status write and kopf's bookkeeping land
        mark = len(cluster.cluster.writes)
        time.sleep(1.6)  # three resync periods: each re-applies, none writes
        assert cluster.writes_since(mark, namespace) == []
    assert "Handler 'reconcile' failed temporarily: not ready yet: prefill: " in runner.output


def test_changing_decode_replicas_patches_only_that_deployment(cluster, kube, namespace):
    with operator(cluster):
        ready_service(cluster, kube, namespace)
        mark = len(cluster.cluster.writes)
        kube.merge_patch(K.path(K.ISVC, namespace, "svc"), {"spec": {"decode": {"replicas": 3}}})
        wait_for(
            lambda: deployment(cluster, namespace, "svc-decode")["spec"]["replicas"] == 3, what="3 decode replicas"
        )
        wait_for(lambda: isvc(cluster, namespace)["status"]["decode"]["ready"] == "1/3", what="decode 1/3")
        time.sleep(1.2)
        assert children_writes(cluster, mark, namespace) == [("PATCH", "deployments", "svc-decode")]
        assert condition(isvc(cluster, namespace))["observedGeneration"] == 2
        mark_ready(kube, namespace, "svc-decode")
        settle(cluster, namespace)
        assert isvc(cluster, namespace)["status"]["decode"]["ready"] == "3/3"


def test_a_deleted_or_edited_child_comes_back(cluster, kube, namespace):
    with operator(cluster):
        ready_service(cluster, kube, namespace)
        router = deployment(cluster, namespace, "svc-router")
        kube.delete(K.path(K.KIND_BY_NAME["Deployment"], namespace, "svc-router"))
        svc_url = K.path(K.KIND_BY_NAME["Service"], namespace, "svc")
        kube.merge_patch(
            svc_url, {"spec": {"ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}
        )
        back = wait_for(
            lambda: (
                (d := deployment(cluster, namespace, "svc-router"))
                and d["metadata"]["uid"] != router["metadata"]["uid"]
                and d
            ),
            what="the router Deployment back",
        )
        assert back["spec"]["template"] == router["spec"]["template"]
        wait_for(
            lambda: child(cluster, namespace, "Service", "svc")["spec"]["ports"][0]["port"] == 8000,
            what="the gateway port restored",
        )
        mark_ready(kube, namespace, "svc-router")
        settle(cluster, namespace)


def test_an_autoscaled_pool_keeps_the_autoscalers_replicas(cluster, kube, namespace):
    spec = {**TINY, "decode": {"autoscaling": {"enabled": True, "provider": "hpa", "minReplicas": 2, "maxReplicas": 6}}}
    with operator(cluster):
        create_isvc(kube, "svc", namespace, spec)
        wait_for(lambda: child(cluster, namespace, "HorizontalPodAutoscaler", "svc-decode"), what="the HPA")
        url = K.path(K.KIND_BY_NAME["Deployment"], namespace, "svc-decode")
        assert deployment(cluster, namespace, "svc-decode")["spec"]["replicas"] == 2
        kube.merge_patch(url, {"spec": {"replicas": 5}})  # what the HPA does
        for name in POOLS:
            mark_ready(kube, namespace, name)
        mark = len(cluster.cluster.writes)
        wait_for(lambda: isvc(cluster, namespace)["status"]["decode"]["ready"] == "5/5", what="decode 5/5")
        time.sleep(1.2)
        assert deployment(cluster, namespace, "svc-decode")["spec"]["replicas"] == 5
        assert ("PATCH", "deployments", "svc-decode") not in children_writes(cluster, mark, namespace)
        kube.merge_patch(K.path(K.ISVC, namespace, "svc"), {"spec": {"decode": {"autoscaling": {"maxReplicas": 10}}}})
        wait_for(
            lambda: child(cluster, namespace, "HorizontalPodAutoscaler", "svc-decode")["spec"]["maxReplicas"] == 10,
            what="the HPA updated",
        )
        assert deployment(cluster, namespace, "svc-decode")["spec"]["replicas"] == 5
        settle(cluster, namespace)


def test_deleting_the_inference_service_removes_everything(cluster, kube, namespace):
    with operator(cluster):
        ready_service(cluster, kube, namespace)
        assert isvc(cluster, namespace)["metadata"]["finalizers"] == ["serving.splitserve.io/operator"]
        kube.delete(K.path(K.ISVC, namespace, "svc"))
        mark = len(cluster.cluster.writes)
        wait_for(lambda: isvc(cluster, namespace) is None, what="the InferenceService gone")
        wait_for(lambda: children(cluster, namespace) == {}, what="the children garbage-collected")
        time.sleep(1.2)
        assert [w for w in cluster.writes_since(mark, namespace) if w.method == "POST" and w.plural != "events"] == []


def test_invalid_spec_is_a_permanent_error_until_fixed(cluster, kube, namespace):
    bad = {**TINY, "decode": {"resources": {"limits": {"memory": "512Mi"}}}}
    with operator(cluster) as runner:
        create_isvc(kube, "svc", namespace, bad)
        ready = wait_for(lambda: condition(isvc(cluster, namespace)), what="a Ready condition")
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert "decode.resources.limits.memory is 512Mi" in ready["message"]
        time.sleep(1.2)
        assert children(cluster, namespace) == {}
        kube.merge_patch(
            K.path(K.ISVC, namespace, "svc"), {"spec": {"decode": {"resources": {"limits": {"memory": "2Gi"}}}}}
        )
        wait_for(lambda: len(children(cluster, namespace)) == len(CHILDREN), what="children after the fix")
        wait_for(lambda: condition(isvc(cluster, namespace))["reason"] == "ComponentsNotReady", what="progress")
        for name in POOLS:
            mark_ready(kube, namespace, name)
        settle(cluster, namespace)
    assert "failed permanently: invalid InferenceService: engine.kvCacheMemoryGiB=0.5" in runner.output
