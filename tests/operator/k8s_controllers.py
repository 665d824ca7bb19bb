"""What Kubernetes makes of a rendered pool: its Pods and the EndpointSlices of its Service.

A pure model of two Kubernetes controllers, for tests on both sides of the discovery
contract (the operator renders Services; the router lists their EndpointSlices):

- `pods_of(deployment, ips)`: the Pods a Deployment's ReplicaSet creates (template labels
  and containers, one IP each, Running and Ready);
- `group_pods(lws, groups)`: the Pods a LeaderWorkerSet's controller creates: per group g a
  leader `<lws>-<g>` from the leader template and workers `<lws>-<g>-<w>` from the worker
  template, labelled with the set's name, the group index and the worker index (0 on the
  leader);
- `endpoint_slice(service, pods)`: the slice the EndpointSlice controller keeps for a
  Service: the pods its selector matches, each Service port named as in the Service with
  its targetPort resolved against the container ports, and the labels
  `kubernetes.io/service-name=<service>` and `endpointslice.kubernetes.io/managed-by`;
  a headless Service's slices also carry `service.kubernetes.io/headless`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from splitserve.operator import constants as C

MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
CONTROLLER = "endpointslice-controller.k8s.io"
HEADLESS_LABEL = "service.kubernetes.io/headless"


LWS_LABELS = ("leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/group-index", C.LABEL_LWS_WORKER_INDEX)


def _pod(
    name: str, namespace: str, template: dict[str, Any], ip: str, ready: bool, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**template["metadata"]["labels"], **(labels or {})},
        },
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pods_of(deployment: dict[str, Any], ips: list[str], ready: bool = True) -> list[dict[str, Any]]:
    template = deployment["spec"]["template"]
    base, namespace = deployment["metadata"]["name"], deployment["metadata"]["namespace"]
    digest = hashlib.sha256(base.encode()).hexdigest()
    return [
        _pod(f"{base}-{digest[:10]}-{digest[10 + i * 5 : 15 + i * 5]}", namespace, template, ip, ready)
        for i, ip in enumerate(ips)
    ]


def group_pods(lws: dict[str, Any], groups: list[list[str]], ready: bool = True) -> list[dict[str, Any]]:
    """`groups`: per group, the IPs of its pods, the leader's first (as many as the set's size)."""
    templates = lws["spec"]["leaderWorkerTemplate"]
    base, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]
    pods = []
    for g, ips in enumerate(groups):
        for w, ip in enumerate(ips):
            template = templates["leaderTemplate"] if w == 0 else templates["workerTemplate"]
            name = f"{base}-{g}" if w == 0 else f"{base}-{g}-{w}"
            pods.append(_pod(name, namespace, template, ip, ready, dict(zip(LWS_LABELS, (base, str(g), str(w))))))
    return pods


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _container_port(pods: list[dict[str, Any]], target: int | str) -> int:
    if isinstance(target, int):
        return target
    for pod in pods:
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                if port.get("name") == target:
                    return port["containerPort"]
    raise KeyError(f"no container port named {target!r}")


def endpoint_slice(service: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    meta, spec = service["metadata"], service["spec"]
    selector = spec["selector"]
    matched = [p for p in pods if all(p["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    labels = {**meta.get("labels", {}), C.LABEL_SERVICE_NAME: meta["name"], MANAGED_BY_LABEL: CONTROLLER}
    if spec.get("clusterIP") == "None":
        labels[HEADLESS_LABEL] = ""
    ports = (
        [
            {
                "name": p["name"],
                "protocol": p.get("protocol", "TCP"),
                "port": _container_port(matched, p.get("targetPort", p["port"])),
            }
            for p in spec["ports"]
        ]
        if matched
        else []
    )
    endpoints = [
        {
            "addresses": [p["status"]["podIP"]],
            "conditions": {"ready": _is_ready(p), "serving": _is_ready(p), "terminating": False},
            "targetRef": {"kind": "Pod", "name": p["metadata"]["name"], "namespace": p["metadata"]["namespace"]},
        }
        for p in matched
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{meta['name']}-{hashlib.sha256(meta['name'].encode()).hexdigest()[:5]}",
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": meta["name"],
                    "uid": meta.get("uid", "service-uid"),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    }
