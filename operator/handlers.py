"""The kopf wiring: which events run a reconcile, and what kopf is told about the outcome.

    create / update / resume  -> reconcile; invalid spec -> a Warning Event InvalidSpec with the
                                 status's message (`kubectl describe` shows it), then
                                 kopf.PermanentError (no retry until the spec changes);
                                 children not ready -> kopf.TemporaryError
                                 with a delay (kopf retries the handler, which re-observes)
    timer (resyncSeconds)     -> reconcile; a deleted or edited child is restored, the status
                                 follows the pods; problems are already in the status, so the
                                 timer only logs them

Handlers are synchronous (kopf runs them in a thread pool) and serialize per object with a
lock, because each reconcile reads the latest object itself and a timer run may overlap a
change handler. Deletion needs no handler: children carry owner references, and Kubernetes'
garbage collector removes them with the InferenceService. (kopf still adds its finalizer to
objects with a timer, so it can stop the timer before the object goes.)

kopf's own bookkeeping goes into annotations under the API group, never into the status.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf

from splitserve.operator import constants as C
from splitserve.operator.kube import connection_info
from splitserve.operator.reconcile import Outcome, reconcile
from splitserve.operator.settings import OperatorSettings
from splitserve.planner.kube import KubeClient, load_configuration

RESOURCE = (C.API_GROUP, C.API_VERSION, C.PLURAL)


class Reconciler:
    """Holds the API client and the per-object locks; one per operator process."""

    def __init__(self, settings: OperatorSettings, kubeconfig: str | None = None):
        self.settings = settings
        self.kubeconfig = kubeconfig
        self.cfg = None
        self.kube: KubeClient | None = None
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def connect(self) -> None:
        self.cfg = load_configuration(self.kubeconfig)
        self.kube = KubeClient(self.cfg, timeout=30.0)

    def run(self, namespace: str, name: str) -> Outcome:
        assert self.kube is not None, "connect() runs at operator startup"
        with self._guard:
            lock = self._locks.setdefault((namespace, name), threading.Lock())
        with lock:
            return reconcile(self.kube, self.settings, namespace, name)


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    settings.persistence.finalizer = f"{C.API_GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=C.API_GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # A resync timer that is mid-reconcile when its InferenceService is deleted runs on in its
    # thread; kopf keeps the finalizer until the timer has exited and re-checks only every
    # cancellation_polling seconds (60 by default), so the deletion would wait up to a minute.
    # A reconcile takes well under a second: check again every second.
    settings.background.cancellation_polling = 1.0


def build_registry(settings: OperatorSettings, kubeconfig: str | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    reconciler = Reconciler(settings, kubeconfig)
    retry = settings.reconcile.not_ready_retry_seconds

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings)
        reconciler.connect()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(reconciler.cfg or load_configuration(kubeconfig))

    @kopf.on.create(*RESOURCE, registry=registry, id="reconcile")
    @kopf.on.update(*RESOURCE, registry=registry, id="reconcile")
    @kopf.on.resume(*RESOURCE, registry=registry, id="reconcile")
    def on_change(namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
        outcome = reconciler.run(namespace, name)
        if outcome.invalid:
            kopf.warn(body, reason="InvalidSpec", message=outcome.invalid)
            raise kopf.PermanentError(f"invalid InferenceService: {outcome.invalid}")
        if outcome.waiting:
            raise kopf.TemporaryError(f"not ready yet: {outcome.waiting}", delay=retry)

    @kopf.timer(*RESOURCE, registry=registry, id="resync", interval=settings.reconcile.resync_seconds)
    def resync(namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        outcome = reconciler.run(namespace, name)
        if outcome.result is not None and outcome.result.changed:
            r = outcome.result
            logger.info("resync changed children: created %s, patched %s, deleted %s", r.created, r.patched, r.deleted)

    return registry
