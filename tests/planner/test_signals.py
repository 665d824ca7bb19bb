"""planner/signals.py and planner/pods.py on hand-computed cases: p90 from histogram bucket
deltas, counter restarts, per-replica tokens, and which pods count as ready or pending."""

from __future__ import annotations

import datetime

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from splitserve.planner import signals as S
from splitserve.planner.pods import pool_state


def test_p90_interpolates_inside_the_bucket_that_crosses_90_percent():
    reg = CollectorRegistry()
    h = Histogram("splitserve_inter_token_latency_seconds", "", ["role"], buckets=(0.1, 0.25, 0.5), registry=reg)
    old = S.flatten(generate_latest(reg).decode())
    for v, n in ((0.05, 50), (0.2, 30), (0.4, 20)):
        for _ in range(n):
            h.labels(role="decode").observe(v)
    d = S.delta(S.flatten(generate_latest(reg).decode()), old)
    # 100 samples; the 90th lies in (0.25, 0.5], which holds samples 81..100: 0.25 + 0.25 × 10/20
    assert abs(S.p90(d, "itl") - 0.375) < 1e-9
    assert S.p90({}, "itl") is None  # nothing observed: no latency signal


def test_delta_of_a_restarted_counter_is_its_new_value_and_tokens_per_pool():
    assert S.delta({"prompt_queries": 30.0}, {"prompt_queries": 100.0}) == {"prompt_queries": 30.0}
    assert S.delta({"x": 1.0}, None) == {}  # first scrape of a pod: a baseline only
    reg = CollectorRegistry()
    Counter("splitserve_router_demand_tokens", "", ["kind"], registry=reg).labels(kind="output").inc(64)
    assert S.flatten(generate_latest(reg).decode())["demand/output"] == 64.0
    assert S.replica_tokens({"prompt_queries": 1000.0, "prompt_hits": 300.0}, "prefill") == 700.0
    assert S.replica_tokens({"itl/count": 90.0, "ttft/count": 10.0}, "decode") == 100.0


def _pod(name, ready_since=None, created="2026-01-01T00:00:00Z", deleting=False, ip="10.0.0.1"):
    cond = {"type": "Ready", "status": "True" if ready_since else "False"}
    if ready_since:
        cond["lastTransitionTime"] = ready_since
    meta = {"name": name, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = created
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [cond]}}


def test_pool_state_counts_ready_pending_missing_and_skips_terminating_pods():
    now = datetime.datetime(2026, 1, 1, 0, 10, tzinfo=datetime.UTC)
    pods = [
        _pod("a", ready_since="2026-01-01T00:09:00Z"),
        _pod("b", created="2026-01-01T00:05:00Z"),
        _pod("c", ready_since="2026-01-01T00:00:00Z", deleting=True),
    ]
    obs, ready = pool_state(pods, wanted=4, now=now)
    # a is ready (60 s since Ready); b Pending for 300 s; c is terminating; 2 more asked for, no pod yet
    assert [(p.name, p.age_s) for p in ready] == [("a", 60.0)]
    assert (obs.ready, obs.pending, obs.oldest_pending_s) == (1, 3, 300.0)
