"""One cold start of the `splitserve serve --backend ray` command as a user runs it, observed from
outside: a local Ray (2 CPUs) with its temp dir under `temp_dir`, the default model in one prefill
and one decode replica, secured by default (throwaway mTLS and KV secret). Used by
tests/rayserve/test_ray_cli_lifecycle.py (one start) and e2e/ray_coldstarts.py (the twenty-start loop).

`cold_start()` polls /v1/models and /ready every POLL_S while the deployment comes up, sends the
first request the moment the model is listed, then SIGTERMs the process and waits for it; it
returns what it saw. `problems(result)` lists what a user must not see.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import yaml
from ports import free_port

MODEL = "smollm2-135m"
POLL_S = 0.1
START_S = 300.0
STOP_S = 120.0
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def write_config(temp_dir: str, port: int) -> str:
    config = {
        "backend": "ray",
        "model": MODEL,
        "kv_transport": "tcp",
        "worker_host": "127.0.0.1",
        "ray": {"address": "local", "num_cpus": 2, "include_dashboard": False, "temp_dir": temp_dir},
        "router": {"gateway": {"host": "127.0.0.1", "port": port}},
        "prefill": {"min_replicas": 1, "max_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
        "decode": {"min_replicas": 1, "max_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
    }
    path = pathlib.Path(temp_dir) / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@dataclasses.dataclass
class ColdStart:
    listed_at: float | None = None  # seconds from launch until /v1/models listed the model
    first_status: int | None = None  # the first request's HTTP status
    first_text: str = ""
    disagreements: list = dataclasses.field(default_factory=list)  # /v1/models listed, then /ready 503
    exit_code: int | None = None
    output: str = ""
    insecure_lines: list = dataclasses.field(default_factory=list)  # replicas that logged INSECURE


def cold_start(temp_dir: str, before_ready=None) -> ColdStart:
    """`before_ready(proc)` (optional) is called at the first poll: e.g. to SIGTERM during start-up."""
    port = free_port()
    config = write_config(temp_dir, port)
    cli = [sys.executable, "-m", "splitserve.platform.cli", "serve", "--backend", "ray", "--config", config]
    out = ColdStart()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            if before_ready is not None:
                before_ready(proc)
            while proc.poll() is None and time.monotonic() - t0 < START_S:
                try:
                    models = client.get("/v1/models")
                    listed = models.status_code == 200 and any(m["id"] == MODEL for m in models.json()["data"])
                except httpx.HTTPError:
                    listed = False
                if listed:
                    out.listed_at = time.monotonic() - t0
                    first = client.post("/v1/chat/completions", json=BODY)
                    out.first_status = first.status_code
                    out.first_text = first.text[:300]
                    ready = client.get("/ready")
                    if ready.status_code != 200:
                        out.disagreements.append(ready.text[:200])
                    break
                time.sleep(POLL_S)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out.exit_code = proc.wait(STOP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        time.sleep(0.2)
        out.output = "".join(lines)
    for log in pathlib.Path(temp_dir).glob("session_*/logs/*"):
        if log.is_file():
            out.insecure_lines += [ln for ln in log.read_text(errors="replace").splitlines() if "INSECURE" in ln]
    return out


def problems(result: ColdStart, expect_served: bool = True) -> list[str]:
    found = []
    if expect_served and result.listed_at is None:
        found.append("the model never appeared on /v1/models")
    if expect_served and result.first_status != 200:
        found.append(f"the first request got {result.first_status}: {result.first_text}")
    if result.disagreements:
        found.append(f"/v1/models listed the model while /ready said {result.disagreements}")
    if result.exit_code != 0:
        found.append(f"exit code {result.exit_code} after SIGTERM")
    for marker in ("Traceback", "SIGTERM received", "Aborted"):
        if marker in result.output:
            found.append(f"{marker!r} in the output")
    if result.insecure_lines:
        found.append(f"a replica ran without mTLS or KV auth: {result.insecure_lines[:2]}")
    return found
