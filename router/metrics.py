"""Prometheus metrics of one router (its own registry: tests run several routers in a process).

splitserve_router_* names; the prefix hit ratio is matched_blocks / prompt_blocks of the
decode placements.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "splitserve_router_requests", "Gateway requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "splitserve_router_request_latency_seconds",
            "Gateway request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "splitserve_router_time_to_first_token_seconds",
            "Time to the first streamed token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "splitserve_router_decision_seconds",
            "Placement time per attempt (hash + index + filters + scorers)",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.prompt_blocks = Counter("splitserve_router_prompt_blocks", "Full prompt blocks placed", registry=r)
        self.matched_blocks = Counter(
            "splitserve_router_matched_blocks", "Prompt blocks the chosen decode worker held per the index", registry=r
        )
        self.disaggregation = Counter(
            "splitserve_router_disaggregation_decisions", "Prefill placement", ["decision"], registry=r
        )
        self.events = Counter(
            "splitserve_router_failovers", "Retries before the first token and resumes after", ["kind"], registry=r
        )
        self.rejected = Counter(
            "splitserve_router_rejected", "Requests refused before placement", ["reason"], registry=r
        )
        self.num_uncached_prompt_tokens = self.num_output_tokens = self.num_planned_requests = 0
        self.demand_tokens = Counter(
            "splitserve_router_demand_tokens",
            "Tokens the planner sizes pools for: uncached prompt tokens (prefill) and output tokens (decode)",
            ["kind"],
            registry=r,
        )
        self.held = Gauge(
            "splitserve_router_held_requests", "Requests waiting for a decode worker (scale from zero)", registry=r
        )
        self.workers = Gauge(
            "splitserve_router_workers", "Known workers by role and health", ["role", "state"], registry=r
        )
        # The gateway's admission (router/tenancy/admission.py), read when scraped (watch_admission): what the
        # chaos soak checks is empty once the load stops.
        self.admission = Gauge(
            "splitserve_router_admission_requests",
            "Requests holding an admission slot (running) or waiting for one (queued)",
            ["state"],
            registry=r,
        )
        self.inflight_calls = Gauge(
            "splitserve_router_inflight_worker_calls", "Generate calls this router has open on workers", registry=r
        )

    def watch_admission(self, admission, dispatcher) -> None:
        """Export the live admission counts and the open worker calls at each scrape."""
        self.admission.labels(state="running").set_function(lambda: admission.num_running)
        self.admission.labels(state="queued").set_function(lambda: admission.num_queued)
        self.inflight_calls.set_function(lambda: dispatcher.num_open_calls)

    def observe_decision(self, decision, num_prompt_blocks: int, seconds: float | None = None) -> None:
        self.prompt_blocks.inc(num_prompt_blocks)
        self.matched_blocks.inc(decision.num_cached_blocks)
        self.disaggregation.labels(decision="remote" if decision.prefill else "local").inc()
        if seconds is not None:
            self.decision.observe(seconds)

    def count_tokens(self, num_uncached_prompt: int, num_output: int, is_first: bool) -> None:
        """Demand the planner reads (`splitserve up --planner`): called for every chunk."""
        self.num_uncached_prompt_tokens += num_uncached_prompt
        self.num_output_tokens += num_output
        self.num_planned_requests += is_first
        if num_uncached_prompt:
            self.demand_tokens.labels(kind="uncached_prompt").inc(num_uncached_prompt)
        if num_output:
            self.demand_tokens.labels(kind="output").inc(num_output)

    def count(self, what: str) -> None:
        self.events.labels(kind=what).inc()

    def render(self, pool) -> bytes:
        now = pool.clock()
        self.workers.clear()
        for w in pool.workers.values():
            self.workers.labels(role=w.role or "unknown", state="healthy" if w.is_healthy(now) else "down").inc()
        return generate_latest(self.registry)
