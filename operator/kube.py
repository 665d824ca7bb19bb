"""A small typeless client for the Kubernetes API, on top of the official `kubernetes` package.

The operator handles plain dicts (render.py's manifests), so it needs only five verbs on any
kind: get, list, create, merge-patch, delete. `kubernetes` provides configuration (in-cluster
service account or kubeconfig), authentication and connection pooling; typed models are not
used. GVK -> URL path uses the table KINDS, which lists every kind the operator writes.

Errors: 404 on get/delete is None/False; 404 on list means the API itself is missing (KEDA
or the Prometheus operator not installed) and is None; any other error raises ApiException.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from splitserve.operator import constants as C
from splitserve.planner.kube import load_configuration  # noqa: F401  (the operator's API client config)


@dataclass(frozen=True)
class KindInfo:
    api_version: str
    kind: str
    plural: str


# Every kind the operator creates, in apply order (see render.py).
KINDS = [KindInfo(*k) for k in [
    ("v1", "ConfigMap", "configmaps"), ("v1", "ServiceAccount", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "Role", "roles"), ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ("v1", "Service", "services"), ("apps/v1", "Deployment", "deployments"),
    ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
    ("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ("cert-manager.io/v1", "Certificate", "certificates"),
]]
KIND_BY_NAME = {k.kind: k for k in KINDS}
ISVC = KindInfo(f"{C.API_GROUP}/{C.API_VERSION}", C.KIND, C.PLURAL)


def path(kind: KindInfo, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix = "/api/v1" if kind.api_version == "v1" else f"/apis/{kind.api_version}"
    out = f"{prefix}/namespaces/{namespace}/{kind.plural}"
    return out + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def connection_info(cfg: client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials for kopf's own API connection."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                               scheme=scheme or None, token=token or None,
                               certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


class Kube:
    """get / list / create / patch / delete of plain-dict objects by URL path."""

    def __init__(self, cfg: client.Configuration, timeout: float = 30.0):
        self.api = client.ApiClient(cfg)
        self.timeout = timeout

    def _call(self, method: str, url: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        request = self.api.param_serialize(method=method, resource_path=url, query_params=query or [],
                                           header_params={"Content-Type": content_type, "Accept": "application/json"},
                                           body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=response.reason,
                               body=(response.data or b"").decode(errors="replace"))
        return json.loads(response.data) if response.data else None

    def get(self, url: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", url)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, url: str, label_selector: str) -> list[dict[str, Any]] | None:
        try:
            return self._call("GET", url, query=[("labelSelector", label_selector)]).get("items") or []
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", url, body)

    def patch(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", url, body, content_type="application/merge-patch+json")

    def delete(self, url: str) -> bool:
        try:
            self._call("DELETE", url, {"propagationPolicy": "Background"})
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
