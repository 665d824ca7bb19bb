"""A cold start of `splitserve serve --backend ray` (a local Ray, Serve's proxy, one prefill and
one decode replica of the real model): a client polls /v1/models while the deployment comes up
and sends its first request the moment the model is listed; it must succeed. One start (a Ray
start costs ~30 s here); the 20-start race is test_router_readiness.py with fake workers."""

import threading
import time

import httpx
import pytest

from raykit import free_port, local_config

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def test_first_request_after_model_list_succeeds_during_a_cold_start(tmp_path_factory):
    from splitserve.rayserve.serve import RayServe

    app = RayServe(local_config(str(tmp_path_factory.mktemp("ray")), free_port()))   # short: AF_UNIX paths
    errors = []

    def start():
        try:
            app.start(timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=app.url.removesuffix("/v1"), timeout=60) as client:
            while True:
                assert not errors, errors
                assert time.monotonic() < deadline, "the model never appeared on /v1/models"
                try:
                    response = client.get("/v1/models")
                    models = response.json().get("data", []) if response.status_code == 200 else []
                except (httpx.TransportError, ValueError):
                    models = []
                if models:
                    break
                time.sleep(0.05)
            r = client.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 200, r.text
        starter.join(300)
        assert not errors, errors
    finally:
        starter.join(300)
        app.stop()
