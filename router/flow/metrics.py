"""Flow-control metrics, per band and flow (GIE exports the like as its flow-control queue
metrics). Each request is counted once in `splitserve_router_flow_requests{outcome}` when it
leaves flow control: dispatched, shed (503: saturated, sheddable, queue full or waited too
long), rejected (429: its flow is over its share of a full queue) or cancelled (its client left
while it was queued). The queue gauge and the wait histogram are what the planner and KEDA read.

The flow label is the key's id (router/flow/classify.py: never a header or a client's address;
keyless requests are "anonymous"), so its values are bounded by the key file; as a guard against
a huge key file, at most `MAX_FLOW_LABELS` distinct labels exist, later ones counted as "other".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OUTCOMES = ("dispatched", "shed", "rejected", "cancelled")
MAX_FLOW_LABELS = 100


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.queue = Gauge(
            "splitserve_router_flow_queue_length",
            "Requests waiting in the gateway's flow-control queues, by band and flow",
            ["band", "flow"],
            registry=registry,
        )
        self.wait = Histogram(
            "splitserve_router_flow_queue_wait_seconds",
            "Time a request spent in flow control before it was dispatched or turned away, by band",
            ["band"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "splitserve_router_flow_requests",
            "Requests leaving flow control, by band, flow and outcome (each request once)",
            ["band", "flow", "outcome"],
            registry=registry,
        )
        self.saturated = Gauge(
            "splitserve_router_flow_saturated",
            "1 while the saturation detector finds no room for band 0",
            registry=registry,
        )
        self._flows: set[str] = set()

    def flow_label(self, flow_id: str) -> str:
        if flow_id in self._flows:
            return flow_id
        if len(self._flows) < MAX_FLOW_LABELS:
            self._flows.add(flow_id)
            return flow_id
        return "other"

    def queued(self, band: int, flow_id: str, delta: int) -> None:
        self.queue.labels(str(band), self.flow_label(flow_id)).inc(delta)

    def left(self, band: int, flow_id: str, outcome: str, waited_s: float) -> None:
        assert outcome in OUTCOMES, outcome
        self.requests.labels(str(band), self.flow_label(flow_id), outcome).inc()
        self.wait.labels(str(band)).observe(max(waited_s, 0.0))
