"""One level-based reconcile of one InferenceService: read, check, render, apply, observe, report.

    body   = GET the InferenceService            (always the latest, whoever triggered us)
    spec   = parse + check(spec)                 invalid -> status InvalidSpec, Outcome.invalid
    creds  = ensure_credentials(spec, now)       KV secret, CA, per-pool certificates (credentials.py)
    wanted = render(spec, creds' fingerprints)   pure
    result = apply_all(wanted)                   idempotent: no request when nothing differs
    status = build_status(live workloads,        written only when it changed
                          the router's adapter report on its ConfigMap)

Every trigger (create, update, resume, the periodic timer) runs the same function, so a child
someone deleted or edited is restored by the next run, and a run with nothing to do makes no
write at all. Runs for one object are serialized by the caller (handlers.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from splitserve.operator import constants as C
from splitserve.operator import kube as K
from splitserve.operator.apply import ApplyResult, MissingApiError, apply_all
from splitserve.operator.checks import InvalidSpecError, check_spec
from splitserve.operator.context import Context, instance_selector
from splitserve.operator.credentials import ensure_credentials
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.operator.status import (
    authentication_condition,
    blocked_status,
    build_status,
    is_ready,
    now_rfc3339,
    observe_workload,
    parse_adapter_report,
    security_condition,
)
from splitserve.planner.kube import KubeClient


@dataclass(frozen=True)
class Outcome:
    """The result of one reconcile; `gone` when the object no longer exists or is being deleted."""

    gone: bool = False
    invalid: str | None = None
    waiting: str | None = None
    result: ApplyResult | None = None

    @property
    def ready(self) -> bool:
        return not (self.gone or self.invalid or self.waiting)


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in ("spec", *err["loc"]))
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning `old` into `new` at the top level (keys dropped from new become null)."""
    return {**{k: None for k in (old or {}) if k not in new}, **new}


def _write_status(kube: KubeClient, body: dict[str, Any], status: dict[str, Any]) -> None:
    old = body.get("status") or {}
    if old == status:
        return
    meta = body["metadata"]
    kube.merge_patch(K.path(K.ISVC, meta["namespace"], meta["name"], "status"), {"status": status_patch(old, status)})


def _gateway_url(ctx: Context, result: ApplyResult) -> str:
    service = result.live.get(("Service", ctx.name)) or {}
    ingress = (service.get("status", {}).get("loadBalancer", {}).get("ingress") or [{}])[0]
    host = ingress.get("ip") or ingress.get("hostname")
    return f"http://{host}:{ctx.spec.router.service.port}" if host else ctx.gateway_url()


def reconcile(
    kube: KubeClient, settings: OperatorSettings, namespace: str, name: str, now: datetime.datetime | None = None
) -> Outcome:
    """`now` (default: the clock) decides which certificates are due for renewal (credentials.py)."""
    body = kube.get(K.path(K.ISVC, namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        return Outcome(gone=True)
    meta, generation = body["metadata"], body["metadata"].get("generation")
    try:
        spec = parse_spec(body.get("spec") or {})
        check_spec(spec, name, settings)
    except (ValidationError, InvalidSpecError) as exc:
        message = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        _write_status(kube, body, blocked_status("InvalidSpec", message, generation, body.get("status"), now_rfc3339()))
        return Outcome(invalid=message)
    ctx = Context(spec, name, namespace, meta["uid"], settings)
    revisions = ensure_credentials(kube, ctx, now or datetime.datetime.now(datetime.UTC))
    try:
        result = apply_all(
            kube,
            render(spec, name, namespace, meta["uid"], settings, revisions),
            namespace,
            instance_selector(name),
            meta["uid"],
        )
    except MissingApiError as exc:
        message = f"{exc}: install it or change the InferenceService"
        _write_status(kube, body, blocked_status("MissingAPI", message, generation, body.get("status"), now_rfc3339()))
        return Outcome(waiting=message)
    observations = {}
    for pool in ctx.pools:
        _, kind, name = ctx.workload(pool)
        observations[pool] = observe_workload(result.live.get((kind, name)), kind)
    observations["router"] = observe_workload(result.live.get(("Deployment", ctx.child("router"))))
    observations.setdefault("prefill", None)
    router_cm = result.live.get(("ConfigMap", ctx.child("router"))) or {}
    annotations = router_cm.get("metadata", {}).get("annotations") or {}
    report = parse_adapter_report(annotations.get(C.ANNOTATION_ADAPTERS_LOADED))
    status = build_status(
        observations,
        generation,
        _gateway_url(ctx, result),
        body.get("status"),
        now_rfc3339(),
        [a.name for a in spec.adapters],
        report,
        security_condition(spec),
        authentication_condition(spec),
    )
    _write_status(kube, body, status)
    waiting = None if is_ready(status) else status["conditions"][0]["message"]
    return Outcome(waiting=waiting, result=result)
