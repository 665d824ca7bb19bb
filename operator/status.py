"""The InferenceService status: its schema (a pydantic model, rendered into the CRD) and the pure
functions that compute it from the observed children.

Algorithm: each pool's live workload (a Deployment, or a LeaderWorkerSet when its workers span
nodes: the same fields, counted in groups) is reduced to a PoolObservation (desired replicas as
the workload says, which is the autoscaler's choice when one owns the pool; ready replicas;
whether its controller has seen the latest template). A pool is ready when it exists, its
controller observed the current generation, and at least `desired` replicas are ready (a
pool scaled to zero by KEDA counts as ready). Ready is the conjunction of PrefillReady,
DecodeReady and RouterReady. Every condition carries the InferenceService generation it was
computed from (`observedGeneration`), and keeps its lastTransitionTime until its status flips.

LoRA adapters: the router reports per pool how many workers are connected and how many hold
each adapter (an annotation on its ConfigMap, router/placement/adapter_sync.py). `<pool>.adapters` lists
the adapters every connected worker of the pool holds; the condition AdaptersLoaded is True when
each pool holds exactly spec.adapters on every worker, False while a load or unload is under
way or failed (the message names what is missing or extra where), Unknown before any report;
it is left out while no adapter is declared or loaded. It is not part of Ready: a pool serves
the base model and the adapters it has meanwhile.

Secure: True when every pool runs mutual TLS and authenticated KV transfer (the default);
False, reason InsecureByRequest, when spec.security.insecure turned either off, with a message
saying which. It is a warning, not part of Ready: the service still serves.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

ROLES = ("prefill", "decode", "router")
CONDITION_OF_ROLE = {"prefill": "PrefillReady", "decode": "DecodeReady", "router": "RouterReady"}
CONDITION_TYPES = ("Ready", *CONDITION_OF_ROLE.values())


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True)


class Condition(_Status):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024)
    message: str = Field(max_length=32768)
    observed_generation: int | None = None
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})


class PoolStatus(_Status):
    replicas: int
    """Desired replicas (the autoscaler's choice when one owns the pool)."""
    ready_replicas: int
    ready: str
    """ready/desired, for `kubectl get`."""
    adapters: list[str] | None = None
    """LoRA adapters every connected worker of this pool holds, as the router reports (worker pools only)."""


class InferenceServiceStatus(_Status):
    """What the operator last observed."""

    observed_generation: int | None = None
    url: str | None = None
    """The OpenAI-compatible endpoint (in-cluster, or the load balancer's address)."""
    prefill: PoolStatus | None = None
    decode: PoolStatus | None = None
    router: PoolStatus | None = None
    conditions: list[Condition] = Field(
        [], json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )


@dataclass(frozen=True)
class PoolObservation:
    """One pool as its live workload shows it (exists False: the workload does not exist)."""

    exists: bool
    desired: int = 0
    ready: int = 0
    rolled_out: bool = False
    kind: str = "Deployment"


def observe_workload(live: dict[str, Any] | None, kind: str = "Deployment") -> PoolObservation:
    """A Deployment or a LeaderWorkerSet: both keep spec.replicas, status.readyReplicas (a LeaderWorkerSet counts
    groups whose pods are all ready) and status.observedGeneration."""
    if live is None:
        return PoolObservation(exists=False, kind=kind)
    status = live.get("status") or {}
    generation = live.get("metadata", {}).get("generation")
    seen = status.get("observedGeneration")
    rolled_out = generation is None or (seen is not None and seen >= generation)
    return PoolObservation(
        exists=True,
        desired=int(live.get("spec", {}).get("replicas", 1)),
        ready=int(status.get("readyReplicas") or 0),
        rolled_out=rolled_out,
        kind=live.get("kind", kind),
    )


def pool_condition(role: str, obs: PoolObservation | None) -> tuple[bool, str, str]:
    """(ready, reason, message) of one pool; None means the pool is not part of this service."""
    if obs is None:
        return True, "NotRequired", f"no {role} pool: disaggregation.mode is never"
    if not obs.exists:
        return False, "Creating", f"the {role} {obs.kind} does not exist yet"
    if not obs.rolled_out:
        return False, "RollingOut", f"the {role} {obs.kind} has not observed its latest template yet"
    if obs.desired == 0:
        return True, "ScaledToZero", f"the {role} pool is scaled to zero"
    if obs.ready < obs.desired:
        return False, "PodsNotReady", f"{obs.ready} of {obs.desired} {role} replicas are ready"
    return True, "Ready", f"{obs.ready} of {obs.desired} {role} replicas are ready"


def _condition(
    ctype: str, ok: bool | str, reason: str, message: str, generation: int | None, previous: dict[str, dict], now: str
) -> dict[str, Any]:
    """One condition; `ok` is a bool or the status itself ("Unknown")."""
    status = ok if isinstance(ok, str) else ("True" if ok else "False")
    old = previous.get(ctype)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else None
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since or now,
    }


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_adapter_report(text: str | None) -> dict[str, dict[str, Any]] | None:
    """The router's report (pool -> {workers, adapters: {name: count}}); None when absent or unreadable."""
    if not text:
        return None
    try:
        report = json.loads(text)
        return {
            pool: {"workers": int(v["workers"]), "adapters": {str(n): int(c) for n, c in v["adapters"].items()}}
            for pool, v in report.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def loaded_everywhere(entry: dict[str, Any] | None) -> list[str]:
    if not entry or entry["workers"] == 0:
        return []
    return sorted(n for n, c in entry["adapters"].items() if c >= entry["workers"])


def adapters_condition(declared: list[str], pools: list[str], report: dict[str, dict] | None) -> tuple[str, str, str]:
    """(status, reason, message) of AdaptersLoaded."""
    if report is None:
        return "Unknown", "NoReport", "the router has not reported the workers' adapters yet"
    problems = []
    for pool in pools:
        entry = report.get(pool) or {"workers": 0, "adapters": {}}
        n = entry["workers"]
        missing = [f"{a} ({entry['adapters'].get(a, 0)}/{n})" for a in declared if entry["adapters"].get(a, 0) < n]
        extra = sorted(set(entry["adapters"]) - set(declared))
        if missing:
            problems.append(f"{pool}: not yet on every worker: {', '.join(missing)}")
        if extra:
            problems.append(f"{pool}: still loaded, no longer declared: {', '.join(extra)}")
    if problems:
        return "False", "Reconciling", "; ".join(problems)
    return "True", "Loaded", f"{len(declared)} adapter(s) on every worker of {', '.join(pools)}"


def authentication_condition(spec: Any) -> tuple[bool, str, str]:
    """(authenticated, reason, message) of the condition Authenticated: whether the gateway needs an API key."""
    router = spec.router
    if router.allow_unauthenticated:
        return (
            False,
            "UnauthenticatedByRequest",
            "spec.router.allowUnauthenticated is true: anyone who reaches the "
            "gateway may call every endpoint, including LoRA load and unload",
        )
    if router.api_keys is not None:
        return True, "UserSuppliedKeys", f"the gateway takes the keys of Secret {router.api_keys.name}"
    return True, "GeneratedAdminKey", "the gateway takes the operator's generated admin key (Secret <name>-api-keys)"


def security_condition(spec: Any) -> tuple[bool, str, str]:
    """(secure, reason, message) of the condition Secure, from a parsed InferenceServiceSpec."""
    if spec.is_secure:
        return True, "MutualTLSAndKVAuth", "every pool runs mutual TLS and authenticated KV transfer"
    off = []
    if spec.tls is None:
        off.append("worker gRPC is plaintext (no mTLS)")
    if spec.kv_transfer.auth_secret is None:
        off.append("decode workers accept KV blocks from anyone who reaches their port")
    return (
        not off,
        "InsecureByRequest" if off else "UserSuppliedSecurity",
        "spec.security.insecure is true: "
        + ("; ".join(off) if off else "only the spec's own tls and kvTransfer.authSecret apply"),
    )


def build_status(
    observations: dict[str, PoolObservation | None],
    generation: int | None,
    url: str,
    previous: dict[str, Any] | None,
    now: str,
    declared_adapters: list[str] | None = None,
    adapter_report: dict[str, dict] | None = None,
    security: tuple[bool, str, str] | None = None,
    authentication: tuple[bool, str, str] | None = None,
) -> dict[str, Any]:
    """The status of a valid spec from its pools (role -> observation; None = pool not wanted),
    the router's adapter report (parse_adapter_report) and security_condition (None: left out)."""
    old = {c["type"]: c for c in (previous or {}).get("conditions", [])}
    conditions, not_ready = [], []
    for role in ROLES:
        ok, reason, message = pool_condition(role, observations.get(role))
        conditions.append(_condition(CONDITION_OF_ROLE[role], ok, reason, message, generation, old, now))
        if not ok:
            not_ready.append(f"{role}: {message}")
    ready = _condition(
        "Ready",
        not not_ready,
        "Ready" if not not_ready else "ComponentsNotReady",
        "; ".join(not_ready) or "all pools are ready",
        generation,
        old,
        now,
    )
    worker_pools = [role for role in ROLES[:2] if observations.get(role) is not None]
    if declared_adapters or any(e["adapters"] for e in (adapter_report or {}).values()):
        conditions.append(
            _condition(
                "AdaptersLoaded",
                *adapters_condition(declared_adapters or [], worker_pools, adapter_report),
                generation,
                old,
                now,
            )
        )
    if security is not None:
        conditions.append(_condition("Secure", *security, generation, old, now))
    if authentication is not None:
        conditions.append(_condition("Authenticated", *authentication, generation, old, now))
    status: dict[str, Any] = {"observedGeneration": generation, "url": url, "conditions": [ready, *conditions]}
    for role in ROLES:
        obs = observations.get(role)
        if obs is not None:
            status[role] = {"replicas": obs.desired, "readyReplicas": obs.ready, "ready": f"{obs.ready}/{obs.desired}"}
            if role in worker_pools and adapter_report is not None:
                status[role]["adapters"] = loaded_everywhere(adapter_report.get(role))
    return status


def blocked_status(
    reason: str, message: str, generation: int | None, previous: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """Ready=False for a reason that stops the operator before it applies anything (InvalidSpec,
    MissingAPI); the pool conditions and replica counts of the last good run are kept."""
    old = {c["type"]: c for c in (previous or {}).get("conditions", [])}
    ready = _condition("Ready", False, reason, message, generation, old, now)
    kept = [c for c in (previous or {}).get("conditions", []) if c["type"] != "Ready"]
    return {**(previous or {}), "observedGeneration": generation, "conditions": [ready, *kept]}


def is_ready(status: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
