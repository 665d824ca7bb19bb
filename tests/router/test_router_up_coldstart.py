"""Cold starts of `splitserve up` with real workers and the real model: a client polls
/v1/models from the moment the gateway's port answers and sends its first request as soon as
the model is listed; that request must succeed. (The 20-start version of this race is
test_router_readiness.py against fake workers; a real start costs ~10 s of CPU here, so one.)"""

import signal
import subprocess
import time

import httpx
import pytest
from routerkit import free_port
from workerproc import CLI

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def first_request_after_model_list(base: str, proc: subprocess.Popen, timeout: float = 300) -> httpx.Response:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base, timeout=60) as client:
        while True:
            assert proc.poll() is None, "splitserve up exited during start-up"
            assert time.monotonic() < deadline, "the model never appeared on /v1/models"
            try:
                models = client.get("/v1/models").json()["data"]
            except httpx.TransportError:
                models = []
            if models:
                assert [m["id"] for m in models] == [MODEL]
                return client.post("/v1/chat/completions", json=BODY)
            time.sleep(0.02)


def test_up_first_request_after_model_list_succeeds():
    port = free_port()
    proc = subprocess.Popen([CLI, "up", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = first_request_after_model_list(f"http://127.0.0.1:{port}", proc)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
