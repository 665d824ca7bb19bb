"""Readiness: can this gateway serve its model right now, and waiting until it can.

A gateway can serve when the router knows a healthy decode worker (WorkerPool.is_healthy: event
stream connected, same model and block size, no recent failed call) and, where prefill/decode
disaggregation is required (`placement.disaggregation.mode: always`), a healthy prefill worker.
Until then /ready answers 503 and /v1/models lists no model, so a client that waits for the
model list (as openai's clients and health checks do) never sends a request that cannot be served.

A request that arrives while no worker can take it (startup, every decode worker restarting or
backing off after a failure) waits up to `gateway.worker_wait_s` for one before its 503 with
Retry-After. The wait polls the pool (it changes on the same loop, from the watchers); the poll
interval is short next to a worker's start-up or backoff, so it adds no visible latency.
"""

from __future__ import annotations

from splitserve.router.errors import error_body

POLL_S = 0.05


def unready_reason(router) -> str:
    """'' when the router can serve its model; otherwise what is missing, in words."""
    pool = router.pool
    if pool.num_healthy() == 0:
        known = len(pool.decode_workers())
        return f"no healthy decode worker ({known} known)" if known else "no decode worker is known to the router"
    if (
        router.config.placement.disaggregation.mode == "always"
        and pool.num_healthy(lambda w: w.can_prefill and w.role != "decode") == 0
    ):
        return "no healthy prefill worker (placement.disaggregation.mode is always)"
    return ""


def ready_answer(router) -> tuple[int, dict]:
    """GET /ready's status and JSON body, the same from the gateway, the EPP and a sidecar: 200
    with the healthy worker counts, or 503 (the caller adds Retry-After: 1) with the reason."""
    reason = unready_reason(router)
    if reason:
        return 503, error_body(503, reason, code="no_worker_available")
    return 200, {
        "status": "ready",
        "healthy_decode_workers": router.pool.num_healthy(),
        "healthy_prefill_workers": router.pool.num_healthy(lambda w: w.role == "prefill"),
    }
