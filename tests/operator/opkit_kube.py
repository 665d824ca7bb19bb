"""Test-side helpers for the emulated cluster: creating InferenceServices as the API server would
store them, acting as the Deployment controller, and waiting for the operator."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opkit_schemas import admit

from splitserve.operator import kube as K
from splitserve.planner.kube import KubeClient

DEPLOYMENT = K.KIND_BY_NAME["Deployment"]


def isvc_body(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def create_isvc(kube: KubeClient, name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Create an InferenceService the way the API server stores it (defaults applied)."""
    stored, errors = admit(isvc_body(name, namespace, spec))
    assert errors == []
    return kube.create(K.path(K.ISVC, namespace), stored)


def mark_ready(kube: KubeClient, namespace: str, name: str) -> None:
    """Act as the Deployment controller: every desired replica of `name` is up and ready."""
    url = K.path(K.KIND_BY_NAME["Deployment"], namespace, name)
    live = kube.get(url)
    n = live["spec"]["replicas"]
    kube.merge_patch(
        url + "/status",
        {
            "status": {
                "observedGeneration": live["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": n,
                "availableReplicas": n,
                "updatedReplicas": n,
            }
        },
    )


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def stored(cluster, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """Read an object straight from the emulator's store (polling without loading the API)."""
    info = K.ISVC if kind == K.ISVC.kind else K.KIND_BY_NAME[kind]
    return cluster.get(f"{info.api_version}/{info.plural}", namespace, name)


def deployment(kube: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get(K.path(DEPLOYMENT, namespace, name))


def isvc(kube: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get(K.path(K.ISVC, namespace, name))


def condition(obj: dict[str, Any] | None, ctype: str = "Ready") -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions", []):
        if c["type"] == ctype:
            return c
    return None
