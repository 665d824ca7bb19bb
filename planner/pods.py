"""What the API says about one pool: ready pods (with their age and address) and pending ones.

A pod counts as pending from creation until its Ready condition turns True (scheduling, image
pull, model load); a terminating pod counts as neither. Replicas the Deployment asks for that
have no pod yet (the ReplicaSet has not created it) are pending too, aged 0. The law uses the
pending count to ask for nothing more while pods are coming, and the oldest pending age to
notice a pod stuck Pending (no room in the cluster); the age of a ready pod since it turned
Ready decides whether its throughput is trusted yet (warm-up).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from splitserve.planner.law import PoolObservation


@dataclass(frozen=True)
class ReadyPod:
    name: str
    ip: str
    age_s: float  # since Ready


def parse_time(stamp: str | None) -> datetime.datetime | None:
    if not stamp:
        return None
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None


def _ready_since(pod: dict) -> datetime.datetime | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            if cond.get("status") != "True":
                return None
            return parse_time(cond.get("lastTransitionTime")) or parse_time(pod["metadata"].get("creationTimestamp"))
    return None


def pool_state(pods: list[dict], wanted: int, now: datetime.datetime) -> tuple[PoolObservation, list[ReadyPod]]:
    """`wanted`: the Deployment's spec.replicas; `now`: wall-clock time (UTC) to age the pods."""
    ready, pending_ages = [], []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        since = _ready_since(pod)
        if since is not None:
            ready.append(
                ReadyPod(
                    meta.get("name", ""),
                    (pod.get("status") or {}).get("podIP", ""),
                    max(0.0, (now - since).total_seconds()),
                )
            )
        else:
            created = parse_time(meta.get("creationTimestamp")) or now
            pending_ages.append(max(0.0, (now - created).total_seconds()))
    pending_ages += [0.0] * max(0, wanted - len(ready) - len(pending_ages))
    obs = PoolObservation(ready=len(ready), pending=len(pending_ages), oldest_pending_s=max(pending_ages, default=0.0))
    return obs, ready
