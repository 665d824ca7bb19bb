"""Disruption with real worker processes: a decode worker SIGKILLed mid-stream, every worker
killed, a worker coming back. What the client sees is asserted, nothing else. The router
reaches the workers over mTLS and the workers authenticate KV transfers (workerproc.security)."""

import json
import time

import httpx
import pytest
from routerkit import RouterServer, router_config
from workerproc import ROUTER_STALE_AFTER_S, WorkerProc, security

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


@pytest.fixture(scope="module")
def stack(loop, tokenizer):
    workers = [WorkerProc("decode", "tcp") for _ in range(2)]
    for w in workers:
        w.start()
    server = RouterServer(
        loop,
        router_config([w.address for w in workers], tls=security().tls, stale_after_s=ROUTER_STALE_AFTER_S),
        tokenizer=tokenizer,
    ).start(num_decode=2)
    client = httpx.Client(base_url=server.url, timeout=120)
    yield server, workers, client
    client.close()
    server.stop()
    for w in workers:
        w.terminate()


def body(**kw):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **kw}


SEEDED = dict(temperature=0.8, top_p=0.95, seed=5, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1)


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded-with-penalties"])
def test_decode_worker_killed_mid_stream(stack, sampling):
    """The stream resumes on the other worker and the client gets exactly the undisturbed
    answer: the new worker continues after the tokens already sent as if it had made them
    (penalties count them, a seeded sampler skips their draws)."""
    server, workers, client = stack
    undisturbed = client.post("/v1/chat/completions", json=body(**sampling))
    assert undisturbed.status_code == 200, undisturbed.text
    expected = undisturbed.json()["choices"][0]["message"]["content"]
    home = undisturbed.headers["x-splitserve-decode-worker"]
    victim = next(w for w in workers if w.address == home)
    text, finish, usage = "", None, None
    with client.stream(
        "POST", "/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": True}, **sampling)
    ) as r:
        assert r.headers["x-splitserve-decode-worker"] == home  # the prompt is cached there
        num_deltas = 0
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content", "")
                finish = chunk["choices"][0]["finish_reason"] or finish
                num_deltas += 1
                if num_deltas == 6:
                    victim.kill()  # SIGKILL mid-stream
            else:
                usage = chunk["usage"]
    assert victim.proc.poll() is not None
    assert text == expected
    assert finish == "length" and usage["completion_tokens"] == 40
    victim.start()  # same ports: back for the next case
    deadline = time.monotonic() + 60
    while server.router.pool.num_healthy() < 2:
        assert time.monotonic() < deadline, "the restarted worker did not rejoin"
        time.sleep(0.2)


def test_every_worker_killed_gives_503_quickly_then_recovers(stack):
    server, workers, client = stack
    for w in workers:
        w.kill()  # a no-op for one the previous test killed
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json=body(max_tokens=4))
    elapsed = time.monotonic() - t0
    assert r.status_code == 503 and elapsed < 2.0 + server.config.gateway.worker_wait_s, (r.status_code, elapsed)
    assert r.json()["error"]["code"] == "no_worker_available" and int(r.headers["retry-after"]) >= 1
    workers[0].start()  # same ports: the router's watcher finds it again
    deadline = time.monotonic() + 30
    while True:
        r = client.post("/v1/chat/completions", json=body(max_tokens=4))
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.headers["x-splitserve-decode-worker"] == workers[0].address


def test_constrained_stream_resumed_after_a_kill_is_valid_and_undisturbed(stack):
    """A decode worker SIGKILLed mid-stream under a grammar: the new worker replays the tokens
    already sent into a fresh matcher, so the answer still matches and equals the undisturbed one."""
    import re

    server, workers, client = stack
    for w in workers:  # the test before leaves one worker down
        if w.proc is None or w.proc.poll() is not None:
            w.start()
    deadline = time.monotonic() + 60
    while server.router.pool.num_healthy() < 2:
        assert time.monotonic() < deadline, "both decode workers should be healthy"
        time.sleep(0.2)
    pattern = r"[a-z]{1,8}( [a-z]{1,8})*"
    request = body(structured_outputs={"regex": pattern}, max_tokens=30)
    undisturbed = client.post("/v1/chat/completions", json=request)
    assert undisturbed.status_code == 200, undisturbed.text
    expected = undisturbed.json()["choices"][0]["message"]["content"]
    victim = next(w for w in workers if w.address == undisturbed.headers["x-splitserve-decode-worker"])
    text, num_deltas = "", 0
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["delta"].get("content", "")
            num_deltas += 1
            if num_deltas == 6:
                victim.kill()
    assert victim.proc.poll() is not None
    assert text == expected
    assert re.fullmatch(pattern + " ?", text), text  # cut by max_tokens, maybe right after a space
    victim.start()
    deadline = time.monotonic() + 60
    while server.router.pool.num_healthy() < 2:
        assert time.monotonic() < deadline, "the restarted worker did not rejoin"
        time.sleep(0.2)
