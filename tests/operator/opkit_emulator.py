"""An emulated Kubernetes API for the operator tests: kmock's KubernetesEmulator, in a thread.

No real kube-apiserver can run on this machine, so these tests talk to kmock (by kopf's
author), an in-memory emulator of the Kubernetes API over HTTP: it stores objects, serves
get/list/watch/create/patch/delete and merge-patches like the API server. It is an emulator,
not Kubernetes: it runs no controllers and no admission. `Cluster` adds the few API-server
behaviours the operator relies on:

- metadata the API server assigns: uid, resourceVersion (bumped on every write), generation
  (bumped when `spec` changes), creationTimestamp;
- the garbage collector: an object whose controller owner no longer exists is deleted;
- optimistic concurrency: a JSON patch whose `test` of metadata.resourceVersion fails is
  answered 422, as Kubernetes does (kmock answers 500, which kopf would retry for seconds);
- a log of every write (method, plural, namespace, name, subresource) for assertions;
- label selectors on lists (`key=value` terms joined by commas; kmock ignores them);
- Leases (coordination.k8s.io) and Pods stored like any object, and the `scale` subresource of
  Deployments and LeaderWorkerSets: a merge patch of {"spec": {"replicas": n}} to `.../scale`
  lands on the object's spec.replicas, as with the API server's Scale object.

Tests act as the missing controllers themselves (e.g. marking a Deployment's pods ready).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import kmock

WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}
BUILTIN = [
    ("v1/namespaces", "Namespace", False),
    ("v1/events", "Event", True),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False),
    ("v1/configmaps", "ConfigMap", True),
    ("v1/secrets", "Secret", True),
    ("v1/serviceaccounts", "ServiceAccount", True),
    ("v1/services", "Service", True),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True),
    ("apps/v1/deployments", "Deployment", True),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True),
    ("serving.splitserve.io/v1alpha1/inferenceservices", "InferenceService", True),
    ("coordination.k8s.io/v1/leases", "Lease", True),
    ("v1/pods", "Pod", True),
]
KEDA = ("keda.sh/v1alpha1/scaledobjects", "ScaledObject", True)
PROMETHEUS_OPERATOR = ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True)
# An inference gateway's CRDs (GIE's InferencePool, the Gateway API's HTTPRoute): opt-in.
INFERENCE_GATEWAY = [
    ("inference.networking.k8s.io/v1/inferencepools", "InferencePool", True),
    ("gateway.networking.k8s.io/v1/httproutes", "HTTPRoute", True),
]
# The LeaderWorkerSet API (kubernetes-sigs/lws), for pools whose workers span nodes: opt-in.
LEADER_WORKER_SET = ("leaderworkerset.x-k8s.io/v1/leaderworkersets", "LeaderWorkerSet", True)
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]


@dataclass(frozen=True)
class Write:
    method: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None


class Cluster(kmock.KubernetesEmulator):
    """kmock's emulator plus uids, versions, generations, garbage collection and a write log."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.versions = itertools.count(1)
        self.writes: list[Write] = []

    async def _handle(self, request: kmock.Request):  # noqa: ANN201 (aiohttp response)
        if request.resource is not None and request.method.value in WRITE_METHODS:
            self._check_version(request)
            self.writes.append(
                Write(
                    request.method.value, request.resource.plural, request.namespace, request.name, request.subresource
                )
            )
            self._stamp(request)
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request):  # noqa: ANN202
        listed = await super()._serve_list(request)
        terms = [t.split("=", 1) for t in (request.params.get("labelSelector") or "").split(",") if "=" in t]
        if terms:
            listed["items"] = [
                o
                for o in listed["items"]
                if all((o.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in terms)
            ]
        return listed

    def _check_version(self, request: kmock.Request) -> None:
        if not isinstance(request.data, list):
            return
        current = self._current(request) or {}
        for op in request.data:
            if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion":
                if current.get("metadata", {}).get("resourceVersion") != op.get("value"):
                    raise kmock.KubernetesError(
                        status=422,
                        reason="Invalid",
                        message="the object has been modified (resourceVersion test failed)",
                    )

    def _stamp(self, request: kmock.Request) -> None:
        rv = str(next(self.versions))
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta.update(
                uid=str(uuid.uuid4()),
                resourceVersion=rv,
                generation=1,
                creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            meta.setdefault("namespace", request.namespace)
        elif request.action == kmock.action.UPDATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = rv
            current = self._current(request)
            if current is not None and "spec" in data and request.subresource is None:
                if json.dumps(current.get("spec"), sort_keys=True) != json.dumps(
                    _merged(current.get("spec"), data["spec"]), sort_keys=True
                ):
                    meta["generation"] = current["metadata"].get("generation", 1) + 1
        elif request.action == kmock.action.UPDATE and isinstance(data, list):
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    async def collect_garbage(self) -> None:
        """Delete objects whose controller owner is gone (Kubernetes' garbage collector)."""
        async with self._lock:
            alive = {obj.raw["metadata"].get("uid") for obj in self.objects.values() if not obj.deleted}
            for (resource, _, _), obj in list(self.objects.items()):
                refs = [] if obj.deleted else obj.raw["metadata"].get("ownerReferences", [])
                if refs and all(ref["uid"] not in alive for ref in refs):
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})


def _merged(old: Any, patch: Any) -> Any:
    if not isinstance(old, dict) or not isinstance(patch, dict):
        return patch
    out = dict(old)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(old.get(k), v)
    return out


class ClusterThread:
    """Runs a Cluster and its HTTP server on an event loop in a background thread."""

    def __init__(
        self,
        with_keda: bool = True,
        with_prometheus_operator: bool = True,
        with_inference_gateway: bool = False,
        with_leader_worker_set: bool = False,
    ):
        self.apis = (
            BUILTIN + ([KEDA] if with_keda else []) + ([PROMETHEUS_OPERATOR] if with_prometheus_operator else [])
        )
        self.apis += INFERENCE_GATEWAY if with_inference_gateway else []
        self.apis += [LEADER_WORKER_SET] if with_leader_worker_set else []
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with Cluster() as cluster, kmock.Server(cluster) as server:
            for resource, kind, namespaced in self.apis:
                cluster.resources[resource] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs=VERBS, subresources=["status", "scale"]
                )
            self.cluster, self.url = cluster, str(server.url).rstrip("/")
            gc = asyncio.ensure_future(self._collect_garbage())
            self._ready.set()
            await self._stop.wait()
            gc.cancel()

    async def _collect_garbage(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            await self.cluster.collect_garbage()

    def __enter__(self) -> ClusterThread:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def kubeconfig(self, path: str) -> str:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        }
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def _in_loop(self, fn):  # noqa: ANN001, ANN202
        """Run fn(cluster) on the emulator's loop: a consistent read without an HTTP round trip."""

        async def call():  # noqa: ANN202
            return fn(self.cluster)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (`resource` like "apps/v1/deployments"), None if absent or deleted."""
        key = (kmock.resource(resource), namespace, name)
        return self._in_loop(
            lambda c: copy.deepcopy(c.objects[key].raw) if key in c.objects and not c.objects[key].deleted else None
        )

    def history(self, resource: str, namespace: str, name: str) -> int:
        """How many versions of one object the emulator has stored (1 = created, never changed)."""
        key = (kmock.resource(resource), namespace, name)
        return self._in_loop(lambda c: len(c.objects[key].history) if key in c.objects else 0)

    def writes_since(self, mark: int, namespace: str) -> list[Write]:
        return [w for w in self.cluster.writes[mark:] if w.namespace == namespace]
