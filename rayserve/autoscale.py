"""Autoscaling a Ray Serve worker pool on the engines' queue depth.

Serve's default policy counts requests that pass through DeploymentHandles. The router does not
send work that way: it places each request on a specific worker by prefix hash and load and
talks gRPC to it directly (docs/router.md), so the handle count of a pool is always ~0.
Instead each replica reports its engine's queue depth, `num_waiting + num_running` (the same
numbers as `vllm:num_requests_waiting` + `vllm:num_requests_running`), from
`record_autoscaling_stats()` under the key `QUEUE_DEPTH`; the controller averages each
replica's reports over `look_back_period_s`, and this policy asks for

    desired = sum over running replicas of their average queue depth / target_ongoing_requests

replicas (the config's `target_queue_depth` is passed as `target_ongoing_requests`). Serve's
wrapper then applies upscale/downscale delays, the scaling factors and min/max replicas.
Before any replica has reported, the current target stands. Torch-free: the Serve controller
imports this module.
"""

from __future__ import annotations

QUEUE_DEPTH = "splitserve_queue_depth"


def queue_depth_policy(ctx) -> tuple[float, dict]:
    """Called by the Serve controller every control-loop tick with an AutoscalingContext."""
    per_replica = ctx.aggregated_metrics.get(QUEUE_DEPTH, {})
    if not per_replica:
        return ctx.target_num_replicas, {}
    total = float(sum(per_replica.values()))
    return total / ctx.config.get_target_ongoing_requests(), {"queue_depth": total}
