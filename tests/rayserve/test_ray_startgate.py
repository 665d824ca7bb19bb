"""A truthful start on the Ray backend (rayserve/startgate.py): while no worker can serve the
model, the ingress app answers GET /v1/models with 503 (OpenAI error JSON, Retry-After), as
/ready does, never 200 with an empty list; once a worker is up, /v1/models lists the model.

The app is the one the Ray Serve ingress builds (`Gateway.__serve_build_asgi_app__`), served by
uvicorn in-process without a Ray cluster (a Ray start costs ~30 s here; the cold start through
Serve is test_ray_coldstart.py). The worker is routerkit's FakeWorker: the real Worker gRPC
protocol with a fake engine, started after the gateway as a cold start orders them."""

from __future__ import annotations

import asyncio
import pathlib
import sys
import time
import types

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "router"))  # routerkit's FakeWorker
from routerkit import FakeWorker, LoopThread, free_port, router_config  # noqa: E402

MODEL = "smollm2-135m"


def test_models_answers_503_until_the_model_can_be_served():
    from splitserve.platform.tokenizer import load_tokenizer
    from splitserve.rayserve.ingress import Gateway
    from splitserve.router.main import bind, uvicorn_server
    from splitserve.router.router import Router

    loop = LoopThread()
    worker = FakeWorker("decode", tokenizer=load_tokenizer(MODEL), port=free_port())
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    state = {}

    async def start_gateway():
        router = Router(router_config([worker.address]))
        gateway = types.SimpleNamespace(router=router)
        gateway._unready_reason = types.MethodType(Gateway._unready_reason, gateway)
        app = Gateway.__serve_build_asgi_app__(gateway)
        state["server"] = server = uvicorn_server(app)
        state["task"] = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)

    async def stop_gateway():
        state["server"].should_exit = True
        await asyncio.wait_for(state["task"], 30)

    loop.run(start_gateway())
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.get("/v1/models")
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["code"] == "no_worker_available" and "cannot be served yet" in error["message"]
            assert client.get("/ready").status_code == 503
            assert client.get("/health").status_code == 200  # the gate touches only the model list

            loop.run(worker.start())
            seen = set()
            deadline = time.monotonic() + 60
            while True:
                r = client.get("/v1/models")
                seen.add((r.status_code, bool(r.status_code == 200 and r.json()["data"])))
                if r.status_code == 200:
                    break
                assert time.monotonic() < deadline, "the model never appeared on /v1/models"
                time.sleep(0.02)
            assert [m["id"] for m in r.json()["data"]] == [MODEL]
            assert (200, False) not in seen  # never an empty list
            assert client.get("/ready").status_code == 200
    finally:
        loop.run(stop_gateway())
        loop.run(worker.stop())
        loop.stop()
