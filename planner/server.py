"""The planner's HTTP face: desired replicas as JSON for KEDA, and /metrics for people.

- GET /v1/desired/<namespace>/<name> → {"prefill": 3, "decode": 2, "reasons": {...}}: what
  KEDA's metrics-api trigger reads (valueLocation "prefill" or "decode"; the operator renders
  it, operator/render_scaling.py). 404 for a service the planner has not decided on yet, so
  KEDA keeps the current count instead of reading a zero.
- GET /ready → 200 while this replica leads (or runs without election), else 503: the cluster
  planner's readiness probe, so the Service sends KEDA only to the leader. A follower also
  answers /v1/desired with 503 rather than a stale or empty decision.
- GET /metrics → splitserve_planner_desired_replicas{namespace,name,pool}, the inputs of the
  last decision (demand tokens/s, capacity per replica, feed-forward need, latency trim) and
  splitserve_planner_decision{...,reason} = 1 for the reason of the last decision.

`DesiredStore.publish` is called by the planner loop after each tick; the store is the one
writer of what is served.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from splitserve.planner.law import REASONS, Decision


class DesiredStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._desired: dict[tuple[str, str], dict] = {}
        self.leader = True  # a planner without election always decides
        self._published: set[tuple[str, str, str]] = set()
        self.registry = CollectorRegistry()
        labels = ["namespace", "name", "pool"]
        gauges = {
            "desired": ("splitserve_planner_desired_replicas", "Replicas the planner wants"),
            "demand": (
                "splitserve_planner_demand_tokens_per_second",
                "Demand: uncached prompt (prefill) or output (decode) tokens/s",
            ),
            "capacity": (
                "splitserve_planner_capacity_tokens_per_second",
                "One replica's capacity at the SLO (profiled, corrected online)",
            ),
            "need": (
                "splitserve_planner_feedforward_replicas",
                "Replicas needed by demand over capacity, with the latency trim",
            ),
            "trim": ("splitserve_planner_latency_trim_replicas", "1 while the measured latency misses the SLO"),
        }
        self._g = {key: Gauge(name, doc, labels, registry=self.registry) for key, (name, doc) in gauges.items()}
        self._leader = Gauge(
            "splitserve_planner_leader", "1 while this replica holds the planner lease", registry=self.registry
        )
        self._leader.set(1)
        self._reason = Gauge(
            "splitserve_planner_decision",
            "1 for the reason of the last decision",
            labels + ["reason"],
            registry=self.registry,
        )

    def publish(self, namespace: str, name: str, decision: Decision) -> None:
        body = {**decision.desired(), "reasons": {p.pool: p.reason for p in (decision.prefill, decision.decode)}}
        with self._lock:
            self._desired[(namespace, name)] = body
        for p in (decision.prefill, decision.decode):
            lab = (namespace, name, p.pool)
            self._published.add(lab)
            self._g["desired"].labels(*lab).set(p.desired)
            self._g["demand"].labels(*lab).set(p.demand if p.demand is not None else float("nan"))
            self._g["capacity"].labels(*lab).set(p.capacity)
            self._g["need"].labels(*lab).set(p.need)
            self._g["trim"].labels(*lab).set(p.trim)
            for r in REASONS:
                self._reason.labels(*lab, r).set(1 if r == p.reason else 0)

    def set_leader(self, leader: bool) -> None:
        with self._lock:
            self.leader = leader
            if not leader:
                self._desired.clear()
        self._leader.set(1 if leader else 0)

    def forget(self, namespace: str, name: str) -> None:
        """A service no longer planned: stop serving (and exporting) its numbers."""
        with self._lock:
            self._desired.pop((namespace, name), None)
        for pool in ("prefill", "decode"):
            if (namespace, name, pool) in self._published:
                for g in self._g.values():
                    g.remove(namespace, name, pool)
                for r in REASONS:
                    self._reason.remove(namespace, name, pool, r)
        self._published -= {(namespace, name, "prefill"), (namespace, name, "decode")}

    def desired(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            return self._desired.get((namespace, name))


def serve(store: DesiredStore, host: str = "0.0.0.0", port: int = 8090) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; the caller owns the server (`shutdown()`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts == ["metrics"]:
                return self._send(200, generate_latest(store.registry), CONTENT_TYPE_LATEST)
            if parts == ["ready"] or (len(parts) == 4 and parts[:2] == ["v1", "desired"] and not store.leader):
                if not store.leader:
                    return self._send(
                        503, b'{"error": "not the leader: another planner replica decides"}', "application/json"
                    )
                return self._send(200, b'{"leader": true}', "application/json")
            if len(parts) == 4 and parts[:2] == ["v1", "desired"]:
                body = store.desired(parts[2], parts[3])
                if body is not None:
                    return self._send(200, json.dumps(body).encode(), "application/json")
                return self._send(
                    404,
                    json.dumps({"error": f"no decision yet for {parts[2]}/{parts[3]}"}).encode(),
                    "application/json",
                )
            self._send(404, b'{"error": "paths: /v1/desired/<namespace>/<name>, /ready, /metrics"}', "application/json")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="planner-http", daemon=True).start()
    return server
