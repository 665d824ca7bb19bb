"""The one Kubernetes API client of splitserve, on plain dicts; the planner and the operator share it.

It sits in the planner because the planner is the lower layer (it runs in its own small pod and
may not import the operator); the operator imports it from here. It is a thin, typeless layer over
the official `kubernetes` package, which provides configuration (in-cluster service account or
kubeconfig), authentication and connection pooling; typed models are not used. Verbs: get, list
(by label selector, one namespace or all), create, merge-patch, JSON-patch and delete, each on a
URL path (`ns_path` here, `splitserve.operator.kube.path` for the kinds the operator writes).

Errors: 404 on get is None and on delete is False; every other non-2xx, and a 404 on list (the
API itself is missing, e.g. KEDA not installed), raises `KubeError` carrying the HTTP status, so
callers match on `status`: the lease code tells a lost race (409 on create, 409/422 on a failed
resourceVersion test) from an outage, and the operator tells a missing API from a failure.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

LEASES = "/apis/coordination.k8s.io/v1"
ISVC_GROUP = "/apis/serving.splitserve.io/v1alpha1"


class KubeError(Exception):
    """A non-2xx answer from the API server; `status` is the HTTP status (0 when none came back)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """In-cluster service account if there is one, else the kubeconfig (argument, $KUBECONFIG, ~/.kube/config)."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(
            config_file=kubeconfig or os.environ.get("KUBECONFIG") or None, client_configuration=cfg
        )
    return cfg


def ns_path(prefix: str, namespace: str | None, plural: str, name: str | None = None) -> str:
    """`prefix` is "/api/v1" or "/apis/<group>/<version>"; namespace None lists across all."""
    out = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return out + (f"/{name}" if name else "")


class KubeClient:
    """get / list / create / merge_patch / json_patch / delete of plain-dict objects by URL path."""

    def __init__(self, cfg: client.Configuration, timeout: float = 10.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.api = client.ApiClient(cfg)
        self.timeout = timeout

    def _call(
        self,
        method: str,
        url: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        request = self.api.param_serialize(
            method=method,
            resource_path=url,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*request, _request_timeout=self.timeout)
            response.read()
        except ApiException as exc:
            raise KubeError(exc.status or 0, str(exc.reason)) from exc
        if not 200 <= response.status <= 299:
            raise KubeError(response.status, (response.data or b"").decode(errors="replace")[:300])
        return json.loads(response.data) if response.data else None

    def get(self, url: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", url)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, url: str, label_selector: str = "") -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        return self._call("GET", url, query=query).get("items") or []

    def create(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", url, body)

    def merge_patch(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", url, body, content_type="application/merge-patch+json")

    def json_patch(self, url: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        return self._call("PATCH", url, ops, content_type="application/json-patch+json")

    def delete(self, url: str) -> bool:
        """Delete with background propagation; False when the object was already gone."""
        try:
            self._call("DELETE", url, {"propagationPolicy": "Background"})
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
