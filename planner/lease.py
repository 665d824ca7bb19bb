"""Leader election on a coordination.k8s.io/v1 Lease: one deciding planner per cluster.

Every planner replica calls `tick(now)` every `retry_s`; the one that holds the Lease decides,
the others wait. The rules are client-go's leaderelection, on the same Lease fields
(holderIdentity, leaseDurationSeconds, acquireTime, renewTime, leaseTransitions):

- No Lease: create it naming ourselves. Two replicas racing both POST; the API server stores
  one and answers the other 409, which is then a follower.
- The holder is someone else: they lead while the Lease keeps changing. Expiry is judged on
  this replica's own clock: the Lease has expired when its resourceVersion has not changed for
  leaseDurationSeconds since *we* first saw that version. No comparison of timestamps written
  by another machine, so clock skew between nodes cannot elect two leaders.
- Ours, expired, or released (empty holder): write ourselves in with a JSON patch whose first
  operation tests metadata.resourceVersion. Of two replicas taking over at once, the second
  patch fails the test (409/422) and that replica stays a follower.
- A leader that cannot renew (API unreachable) steps down once `renew_deadline_s` has passed
  since its last successful renewal, which is shorter than the lease duration: it stops
  deciding before anyone else may start.
- `release()` on shutdown empties holderIdentity so a standby takes over at its next retry
  instead of waiting out the lease.

In this project it is exercised against kmock, an emulator of the Kubernetes API
(tests/planner/test_cluster_planner.py).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

from splitserve.planner.kube import LEASES, KubeClient, KubeError, ns_path
from splitserve.platform.errors import ConfigError

log = logging.getLogger(__name__)
LOST_RACE = (409, 422)


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str = "splitserve-planner"
    identity: str = ""
    duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.namespace or not self.name or not self.identity:
            raise ConfigError("a lease needs a namespace, a name and this replica's identity")
        if not 0 < self.retry_s < self.renew_deadline_s < self.duration_s:
            raise ConfigError(
                f"lease timings must satisfy 0 < retry ({self.retry_s}) < renew deadline "
                f"({self.renew_deadline_s}) < duration ({self.duration_s})"
            )


def _micro_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, kube: KubeClient, cfg: LeaseConfig, clock=time.monotonic) -> None:
        self.kube, self.cfg, self.clock = kube, cfg, clock
        self.url = ns_path(LEASES, cfg.namespace, "leases", cfg.name)
        self._seen: tuple[str, float] | None = None  # (resourceVersion, when we first saw it)
        self._renewed_at: float | None = None
        self.holder: str | None = None

    @property
    def is_leader(self) -> bool:
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.cfg.renew_deadline_s

    def tick(self) -> bool:
        """One round of the election; returns whether this replica leads now."""
        now = self.clock()
        try:
            self._round(now)
        except (KubeError, OSError) as exc:
            log.warning("planner lease %s/%s: %s", self.cfg.namespace, self.cfg.name, exc)
        return self.is_leader

    def _round(self, now: float) -> None:
        lease = self.kube.get(self.url)
        if lease is None:
            return self._create(now)
        rv = lease["metadata"].get("resourceVersion", "")
        if self._seen is None or self._seen[0] != rv:
            self._seen = (rv, now)
        spec = lease.get("spec") or {}
        self.holder = spec.get("holderIdentity") or None
        duration = float(spec.get("leaseDurationSeconds") or self.cfg.duration_s)
        if self.holder not in (None, self.cfg.identity) and now - self._seen[1] < duration:
            self._renewed_at = None
            return
        mine = self.holder == self.cfg.identity
        new_spec = {
            "holderIdentity": self.cfg.identity,
            "leaseDurationSeconds": int(round(self.cfg.duration_s)),
            "acquireTime": spec.get("acquireTime") if mine else _micro_time(),
            "renewTime": _micro_time(),
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if mine else 1),
        }
        try:
            out = self.kube.json_patch(
                self.url,
                [
                    {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "replace" if "spec" in lease else "add", "path": "/spec", "value": new_spec},
                ],
            )
        except KubeError as exc:
            if exc.status in LOST_RACE:
                self._renewed_at = None
                return
            raise
        if not mine:
            log.warning(
                "planner: %s now leads (lease %s/%s, previous holder %s)",
                self.cfg.identity,
                self.cfg.namespace,
                self.cfg.name,
                self.holder or "none",
            )
        self._won(now, out)

    def _create(self, now: float) -> None:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.cfg.name, "namespace": self.cfg.namespace},
            "spec": {
                "holderIdentity": self.cfg.identity,
                "leaseDurationSeconds": int(round(self.cfg.duration_s)),
                "acquireTime": _micro_time(),
                "renewTime": _micro_time(),
                "leaseTransitions": 0,
            },
        }
        try:
            out = self.kube.create(ns_path(LEASES, self.cfg.namespace, "leases"), body)
        except KubeError as exc:
            if exc.status in LOST_RACE:
                self._renewed_at = None
                return
            raise
        log.warning("planner: %s leads (created lease %s/%s)", self.cfg.identity, self.cfg.namespace, self.cfg.name)
        self._won(now, out)

    def _won(self, now: float, lease: dict | None) -> None:
        self.holder = self.cfg.identity
        self._renewed_at = now
        rv = ((lease or {}).get("metadata") or {}).get("resourceVersion")
        if rv:
            self._seen = (rv, now)

    def release(self) -> None:
        """Give the lease up (on shutdown) so a standby need not wait for it to expire."""
        if not self.is_leader:
            return
        self._renewed_at = None
        try:
            self.kube.merge_patch(self.url, {"spec": {"holderIdentity": "", "leaseDurationSeconds": 1}})
        except (KubeError, OSError) as exc:
            log.warning("planner: could not release lease %s/%s: %s", self.cfg.namespace, self.cfg.name, exc)
