"""The Context every manifest builder takes: a parsed spec plus its InferenceService's identity,
and the naming, labelling and ownership rules all children share (see render.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.operator import constants as C
from splitserve.operator.settings import (
    Autoscaling,
    KvCacheDefaults,
    OperatorSettings,
    effective_autoscaling,
    effective_kv_cache,
)
from splitserve.operator.spec import InferenceServiceSpec

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Context:
    """Everything a builder needs: the spec plus the identity of its InferenceService."""

    spec: InferenceServiceSpec
    name: str
    namespace: str
    uid: str
    settings: OperatorSettings
    tls_revisions: dict[str, str] = field(default_factory=dict)
    """component -> fingerprint of the certificates the operator issued it (credentials.py); empty
    when render runs without a cluster (tests, --print) or the operator issues none."""

    @property
    def pools(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.spec.has_prefill_pool() else ("decode",)

    def child(self, component: str) -> str:
        return f"{self.name}-{component}"

    def selector(self, component: str) -> dict[str, str]:
        return {C.LABEL_NAME: C.APP_NAME, C.LABEL_INSTANCE: self.name, C.LABEL_COMPONENT: component}

    def labels(self, component: str) -> dict[str, str]:
        labels = {**self.selector(component), C.LABEL_MANAGED_BY: C.MANAGER}
        if component in ("prefill", "decode"):
            labels[C.LABEL_ROLE] = component
        return labels

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{C.API_GROUP}/{C.API_VERSION}",
            "kind": C.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def meta(self, name: str, component: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta = {
            "name": name,
            "namespace": self.namespace,
            "labels": self.labels(component),
            "ownerReferences": [self.owner_reference()],
        }
        if annotations:
            meta["annotations"] = annotations
        return meta

    def autoscaling(self, pool: str) -> Autoscaling:
        return effective_autoscaling(getattr(self.spec, pool).autoscaling, self.settings, pool)

    def kv_cache(self) -> KvCacheDefaults:
        return effective_kv_cache(self.spec.kv_cache, self.settings)

    def image(self, override: str | None, gpus: int) -> str:
        if override:
            return override
        repo = self.spec.image.repository or self.settings.image.repository
        tag = self.spec.image.tag or self.settings.image.tag
        return f"{repo}:{tag}{self.settings.image.cuda_suffix if gpus > 0 else ''}"

    def gateway_url(self) -> str:
        return f"http://{self.name}.{self.namespace}.svc:{self.spec.router.service.port}"


def instance_selector(name: str) -> str:
    """The label selector of every child of one InferenceService."""
    return f"{C.LABEL_INSTANCE}={name},{C.LABEL_MANAGED_BY}={C.MANAGER}"
