"""Idempotent apply: make the cluster hold the rendered children, changing only what differs.

For each kind the operator manages (kube.KINDS, in order), one LIST by the instance's
labels gives the live children. Then, for each rendered manifest:

- absent -> POST it (a 409 means it exists without our labels: GET it and go on);
- present and every field we render already has our value in the live object
  (`is_subset`) -> leave it alone: no request at all;
- otherwise -> JSON merge-patch with the rendered fields. Maps merge, lists are replaced
  whole, so fields the API server defaulted are kept and our lists are exact.

`is_subset` compares only what we render: fields the API server or other controllers add
(defaults, status, clusterIP) never cause a patch. Quantities compare by value ("1024Mi" ==
"1Gi"). An empty map, empty list or null we render matches an absent field.

Autoscaled pools: a Deployment or LeaderWorkerSet annotated `replicas-owner: keda|hpa|planner` gets `spec.replicas`
only when created; later patches and comparisons leave it out, so the operator never
fights the autoscaler.

Pruning: live children of this kind, owned (controller reference) by this InferenceService's
uid and no longer rendered, are deleted (e.g. a ScaledObject after switching to an HPA).
A LIST that answers 404 means the API is not installed: fine if nothing of that kind is
rendered, MissingApiError otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from decimal import InvalidOperation
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from splitserve.operator import constants as C
from splitserve.operator.kube import KINDS, KindInfo, path
from splitserve.planner.kube import KubeClient, KubeError

AUTOSCALERS = ("keda", "hpa", "planner")  # who owns an autoscaled pool's replicas (render_pods)
SCALABLE = ("Deployment", C.LWS_KIND)  # the kinds a pool is: their spec.replicas is what autoscalers write


class MissingApiError(Exception):
    """A rendered child's API (e.g. KEDA's ScaledObject) is not installed in the cluster."""

    def __init__(self, kind: KindInfo):
        super().__init__(f"the cluster has no {kind.api_version} {kind.kind} API")
        self.kind = kind


@dataclass
class ApplyResult:
    """What one apply did, and the live state of every rendered child afterwards."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    live: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted)


def _scalar_equal(want: Any, have: Any) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return type(want) is type(have) and want == have  # True == 1 in Python, not in JSON
    if want == have:
        return True
    if not isinstance(want, (str, int, float)):
        return False
    try:
        return parse_quantity(want) == parse_quantity(have)
    except (ValueError, InvalidOperation, TypeError):
        return False


def is_subset(want: Any, have: Any) -> bool:
    """Whether every field of `want` is in `have` with an equal value (see the module doc)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        return all(
            have.get(k) in (None, {}, []) if v in (None, {}, []) else k in have and is_subset(v, have[k])
            for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return _scalar_equal(want, have)


def patch_body(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest without fields that belong to someone else once the object exists."""
    owner = manifest["metadata"].get("annotations", {}).get(C.ANNOTATION_REPLICAS_OWNER)
    if manifest["kind"] not in SCALABLE or owner not in AUTOSCALERS:
        return manifest
    body = copy.deepcopy(manifest)
    del body["spec"]["replicas"]
    return body


def _key(manifest: dict[str, Any]) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def _apply_one(
    kube: KubeClient, kind: KindInfo, manifest: dict[str, Any], live: dict[str, Any] | None, result: ApplyResult
) -> dict[str, Any]:
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    if live is None:
        try:
            created = kube.create(path(kind, ns), manifest)
            result.created.append(_key(manifest))
            return created
        except KubeError as exc:
            if exc.status != 409:
                raise
            live = kube.get(path(kind, ns, name)) or {}
    body = patch_body(manifest)
    if is_subset(body, live):
        result.unchanged.append(_key(manifest))
        return live
    result.patched.append(_key(manifest))
    return kube.merge_patch(path(kind, ns, name), body)


def _list_if_installed(kube: KubeClient, url: str, selector: str) -> list[dict[str, Any]] | None:
    """The live objects, or None when the API server does not serve this kind (404 on the list)."""
    try:
        return kube.list(url, selector)
    except KubeError as exc:
        if exc.status == 404:
            return None
        raise


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences", []))


def apply_all(
    kube: KubeClient, manifests: list[dict[str, Any]], namespace: str, selector: str, owner_uid: str
) -> ApplyResult:
    """Create, patch or prune so that the children of one InferenceService match `manifests`."""
    result = ApplyResult()
    for kind in KINDS:
        wanted = [m for m in manifests if m["kind"] == kind.kind and m["apiVersion"] == kind.api_version]
        items = _list_if_installed(kube, path(kind, namespace), selector)
        if items is None:
            if wanted:
                raise MissingApiError(kind)
            continue
        live = {item["metadata"]["name"]: item for item in items}
        for manifest in wanted:
            name = manifest["metadata"]["name"]
            result.live[(kind.kind, name)] = _apply_one(kube, kind, manifest, live.get(name), result)
        names = {m["metadata"]["name"] for m in wanted}
        for name, item in live.items():
            if name not in names and _owned_by(item, owner_uid) and kube.delete(path(kind, namespace, name)):
                result.deleted.append(f"{kind.kind}/{name}")
    return result
