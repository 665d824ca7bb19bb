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

    def workload(self, pool: str) -> tuple[str, str, str]:
        """(apiVersion, kind, name) of a worker pool: a Deployment `<name>-<pool>` of one-pod workers, or, when
        the pool's workers span nodes, a LeaderWorkerSet `<name>-<pool>-group` (its own name: the LeaderWorkerSet
        controller creates a headless Service named after it, which the pool's Service `<name>-<pool>` must not be)."""
        if getattr(self.spec, pool).is_multi_node:
            return C.LWS_API_VERSION, C.LWS_KIND, self.child(f"{pool}-group")
        return "apps/v1", "Deployment", self.child(pool)

    def serving_selector(self, pool: str) -> dict[str, str]:
        """The pods of a pool that serve: every pod of a Deployment pool, the leaders (worker index 0, the label the
        LeaderWorkerSet controller sets) of a multi-node one. The pool's Service, the InferencePool, the planner and
        the autoscaler queries select these, so a group of pods counts as one worker."""
        selector = self.selector(pool)
        if getattr(self.spec, pool).is_multi_node:
            selector[C.LABEL_LWS_WORKER_INDEX] = "0"
        return selector

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
