"""Helpers of the Ray Serve tests: a config for a small local Ray, Serve's view of a deployment,
and the Ray processes a test started."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import psutil
from ports import free_port

from splitserve.rayserve import config as ray_config

ROOT_CONFIG = "deploy/ray/serve.yaml"
RAY_PROCESS_NAMES = (
    "raylet",
    "gcs_server",
    "plasma_store",
    "dashboard",
    "log_monitor",
    "monitor.py",
    "default_worker",
    "ray::",
    "runtime_env_agent",
)


def local_config(temp_dir: str, port: int, **changes) -> ray_config.RayServeConfig:
    """deploy/ray/serve.yaml on a 2-CPU local Ray with its temp dir under the test's tmp path and
    quick autoscaling (the decode pool may grow to 2 replicas)."""
    base = ray_config.load(ROOT_CONFIG)
    return dataclasses.replace(
        base,
        ray=dataclasses.replace(base.ray, num_cpus=2, include_dashboard=False, temp_dir=temp_dir),
        router={
            "gateway": {"host": "127.0.0.1", "port": port},
            "placement": {"disaggregation": {"mode": "always"}},
        },  # every request goes through prefill
        decode=dataclasses.replace(base.decode, min_replicas=1, max_replicas=2, target_queue_depth=2),
        autoscaling=ray_config.AutoscalingTiming(
            look_back_period_s=2.0, upscale_delay_s=0.0, downscale_delay_s=4.0, metrics_interval_s=0.5
        ),
        **changes,
    )


def num_target_replicas(app: str, deployment: str) -> int:
    """Serve's status: replicas it wants for the deployment (starting or running, not stopping)."""
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    return sum(
        n
        for state, n in states.items()
        if str(state).rsplit(".", 1)[-1] in ("STARTING", "RUNNING", "UPDATING", "RECOVERING")
    )


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def ray_processes(since: float, temp_dir: str) -> list[psutil.Process]:
    """Ray's processes started after `since` (or naming our temp dir)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            text = f"{proc.info['name']} {cmdline}"
            if proc.pid == psutil.Process().pid:
                continue
            if temp_dir in cmdline or (
                proc.info["create_time"] >= since - 1 and any(name in text for name in RAY_PROCESS_NAMES)
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def start_local_serve(tmp_path_factory, attempts: int = 2, adjust=None):
    """RayServe on a fresh local Ray, its temp dir and start time kept on it. One more attempt
    when Ray's head never registers its raylet ("The current node timed out during startup",
    an open Ray start-up flake: ray-project/ray#62883): a fresh-clone `make test` hit it once,
    with the GCS up and no raylet log at all, and the same tests passed when run again. That is
    Ray failing to start, not splitserve; the failed attempt's processes are killed first.
    `adjust(config) -> config`: a test's changes to local_config's."""
    from splitserve.rayserve.serve import RayServe

    for attempt in range(1, attempts + 1):
        temp_dir = str(tmp_path_factory.mktemp("ray"))
        started_at = time.time()
        config = local_config(temp_dir, free_port())
        app = RayServe(adjust(config) if adjust else config)
        try:
            app.start(timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - only Ray's start-up timeout is retried
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            for proc in ray_processes(started_at, temp_dir):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            continue
        app.temp_dir, app.started_at = temp_dir, started_at
        return app
