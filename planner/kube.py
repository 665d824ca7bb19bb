"""The few Kubernetes API calls the cluster planner makes, on plain dicts.

The planner may not import the operator (layering: it runs in its own small pod), so this is
its own minimal client on the official `kubernetes` package, which provides configuration
(in-cluster service account or kubeconfig), authentication and connection pooling. Verbs:
get, list (by label selector, one namespace or all), create, merge-patch and JSON-patch.

Errors: 404 on get is None; every other non-2xx raises `KubeError` with the status, so the
lease code can tell a lost race (409 on create, 409/422 on a failed resourceVersion test)
from an outage.
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
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """In-cluster service account if there is one, else the kubeconfig (argument, $KUBECONFIG, ~/.kube/config)."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig or os.environ.get("KUBECONFIG") or None,
                                client_configuration=cfg)
    return cfg


def ns_path(prefix: str, namespace: str | None, plural: str, name: str | None = None) -> str:
    """`prefix` is "/api/v1" or "/apis/<group>/<version>"; namespace None lists across all."""
    out = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return out + (f"/{name}" if name else "")


class PlannerKube:
    def __init__(self, cfg: client.Configuration, timeout: float = 10.0) -> None:
        self.api = client.ApiClient(cfg)
        self.timeout = timeout

    def _call(self, method: str, url: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        request = self.api.param_serialize(method=method, resource_path=url, query_params=query or [],
                                           header_params={"Content-Type": content_type, "Accept": "application/json"},
                                           body=body, auth_settings=["BearerToken"])
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
