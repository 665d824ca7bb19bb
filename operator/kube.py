"""The kinds the operator writes and their URL paths, for the shared Kubernetes client.

The operator handles plain dicts (render.py's manifests) through `KubeClient`, the one typeless
client it shares with the planner (splitserve.planner.kube: get, list, create, merge-patch,
JSON-patch, delete; errors are `KubeError` with the HTTP status). GVK -> URL path uses the table
KINDS, which lists every kind the operator writes; `connection_info` hands the same credentials to
kopf's own API connection.
"""

from __future__ import annotations

from dataclasses import dataclass

import kopf
from kubernetes import client

from splitserve.operator import constants as C


@dataclass(frozen=True)
class KindInfo:
    api_version: str
    kind: str
    plural: str


# Every kind the operator creates, in apply order (see render.py).
KINDS = [
    KindInfo(*k)
    for k in [
        ("v1", "ConfigMap", "configmaps"),
        ("v1", "ServiceAccount", "serviceaccounts"),
        ("rbac.authorization.k8s.io/v1", "Role", "roles"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        ("v1", "Service", "services"),
        ("apps/v1", "Deployment", "deployments"),
        (C.LWS_API_VERSION, C.LWS_KIND, "leaderworkersets"),
        ("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes"),
        ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        ("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        ("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        ("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
        ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        ("cert-manager.io/v1", "Certificate", "certificates"),
    ]
]
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
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )
