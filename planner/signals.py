"""The planner's inputs, read from the routers' and workers' Prometheus text.

`flatten` keeps the few series the planner needs from one scrape, summed over labels it does not
use, under short keys; `delta` turns two scrapes of one pod into what happened in between (a
counter that went down means the process restarted: the new value is the delta). From the
deltas of one tick:

- demand (routers, summed over replicas): uncached prompt tokens and output tokens
  (`splitserve_router_demand_tokens_total`); requests: the decode workers' first tokens
  (`splitserve_time_to_first_token_seconds_count`; the routers' TTFT counts only streams);
- TTFT p90 for prefill: the routers' TTFT histogram (the decode workers' when no response was
  streamed), minus the mean KV-transfer time the decode workers measured
  (`splitserve_kv_transfer_seconds`), since shipping KV is not prefill's work (window.py);
- ITL p90: the decode workers' `splitserve_inter_token_latency_seconds`;
- per replica, for the online capacity correction: prefill tokens computed (prefix-cache
  queries minus hits) or output tokens produced (ITL count + first tokens) per second, whether
  that replica met its SLO share, and whether it was busy (requests waiting);
- in-flight decode sequences: the decode workers' `vllm:num_requests_running`;
- requests waiting in the gateways' flow-control queues (`splitserve_router_flow_queue_length`,
  summed over bands, flows and routers): demand that has not reached a worker yet.

p90 is read from cumulative buckets by linear interpolation inside the bucket that crosses
90 %, as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

_HISTOGRAMS = {
    "splitserve_router_time_to_first_token_seconds": "rttft",
    "splitserve_time_to_first_token_seconds": "ttft",
    "splitserve_inter_token_latency_seconds": "itl",
    "splitserve_kv_transfer_seconds": "kvt",
}
_COUNTERS = {"vllm:prefix_cache_queries_total": "prompt_queries", "vllm:prefix_cache_hits_total": "prompt_hits"}
_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "splitserve_router_flow_queue_length": "queued",
}


def flatten(text: str) -> dict[str, float]:
    """The series the planner reads, summed over other labels: e.g. "demand/output",
    "itl/le/0.1", "itl/count", "kvt/sum", "waiting"."""
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "splitserve_router_demand_tokens_total":
                add(f"demand/{s.labels.get('kind', '')}", s.value)
            elif s.name in _COUNTERS:
                add(_COUNTERS[s.name], s.value)
            elif s.name in _GAUGES:
                add(_GAUGES[s.name], s.value)
            else:
                base, _, suffix = s.name.rpartition("_")
                key = _HISTOGRAMS.get(base)
                if key and suffix == "bucket":
                    add(f"{key}/le/{s.labels['le']}", s.value)
                elif key and suffix in ("count", "sum"):
                    add(f"{key}/{suffix}", s.value)
    return out


def delta(new: dict[str, float], old: dict[str, float] | None) -> dict[str, float]:
    """Counter deltas between two scrapes of one process (a restart counts from zero)."""
    if old is None:
        return {}
    out = {}
    for k, v in new.items():
        before = old.get(k, 0.0)
        out[k] = v - before if v >= before else v
    return out


def add_up(parts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in parts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def p90(d: dict[str, float], key: str) -> float | None:
    """The 90th percentile of histogram `key` in a delta; None when it saw nothing."""
    total = d.get(f"{key}/count", 0.0)
    if total <= 0:
        return None
    prefix = f"{key}/le/"
    bounds = sorted((float(k[len(prefix) :]), v) for k, v in d.items() if k.startswith(prefix))
    rank, lo, below = 0.9 * total, 0.0, 0.0
    for le, cum in bounds:
        if cum >= rank:
            if math.isinf(le):
                return lo  # beyond the last finite bucket: its bound is all we know
            return lo + (le - lo) * (rank - below) / max(cum - below, 1e-12)
        lo, below = le, cum
    return lo


def mean(d: dict[str, float], key: str) -> float:
    n = d.get(f"{key}/count", 0.0)
    return d.get(f"{key}/sum", 0.0) / n if n > 0 else 0.0


def replica_tokens(d: dict[str, float], pool: str) -> float:
    """Tokens one replica worked through in a delta: uncached prompt tokens (prefill) or
    output tokens (decode: every token after the first is one ITL sample)."""
    if pool == "prefill":
        return max(0.0, d.get("prompt_queries", 0.0) - d.get("prompt_hits", 0.0))
    return d.get("itl/count", 0.0) + d.get("ttft/count", 0.0)
