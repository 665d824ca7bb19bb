"""The gateway end to end over HTTP, in front of fake workers that speak the real Worker gRPC
protocol (tests/router/routerkit.py): response formats, every documented error status,
request ids, retries, resumes, 503 and recovery, client disconnects. The real model is in
test_router_placement_workers.py, test_router_disruption.py and test_router_up.py."""

import json
import time

import grpc
import httpx
import pytest
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.router.config import ApiKey, GatewayConfig

KEY = "sk-test"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def stack(loop, tokenizer):
    workers = [loop.run(FakeWorker(tokenizer=tokenizer).start()) for _ in range(2)]
    prefill = loop.run(FakeWorker("prefill", tokenizer=tokenizer).start())
    gateway = GatewayConfig(
        api_keys=(ApiKey(KEY, "test", role="admin"), ApiKey("sk-limited", "limited", rate_per_s=0.1, burst=2))
    )  # the admin key also reads /metrics
    server = RouterServer(
        loop, router_config([w.address for w in workers] + [prefill.address], gateway=gateway), tokenizer=tokenizer
    ).start(num_decode=2, num_prefill=1)
    client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    yield server, workers, client
    client.close()
    server.stop()
    for w in workers + [prefill]:
        loop.run(w.stop())


@pytest.fixture
def healthy(stack, loop):
    """Every fake worker up and in the pool, failure backoffs cleared, no delays or faults."""
    server, workers, client = stack
    for w in workers:
        w.token_delay_s, w.fail_next, w.crash_after_tokens = 0.0, [], None
        w.stall_after_tokens, w.is_stalled = None, False
        if w.server is None:
            loop.run(w.start())

    def reset():
        for state in server.router.pool.workers.values():
            state.down_until, state.num_failures = 0.0, 0

    loop.call(reset)
    loop.run(server.router.wait_ready(10, num_decode=2))
    return stack


def chat_body(content="What is the capital of France?", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


def expected_text(tokenizer, prompt_ids, n):
    return tokenizer.decode([FakeWorker.token_at(len(prompt_ids) + i) for i in range(n)])


def sse_events(response):
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    return events


def worker_by_address(workers, address):
    return next(w for w in workers if w.address == address)


# ---- formats ------------------------------------------------------------------------------------
def test_chat_completion_and_usage(healthy, tokenizer):
    _, _, client = healthy
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": "Tell me a joke"}])
    first = client.post("/v1/chat/completions", json=chat_body("Tell me a joke"))
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected_text(tokenizer, prompt_ids, 8)}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["total_tokens"] == len(prompt_ids) + 8
    again = client.post("/v1/chat/completions", json=chat_body("Tell me a joke")).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt_ids) // 16 * 16 > 0


def test_streamed_chat_equals_whole_answer(healthy):
    _, _, client = healthy
    whole = client.post("/v1/chat/completions", json=chat_body(seed=3)).json()
    with client.stream(
        "POST", "/v1/chat/completions", json=chat_body(seed=3, stream=True, stream_options={"include_usage": True})
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completions_several_prompts_n_and_sampling_fields(healthy, tokenizer):
    server, workers, client = healthy
    for w in workers:
        w.requests.clear()
    body = {
        "model": MODEL,
        "prompt": ["Once upon a time", "The weather today"],
        "n": 2,
        "max_tokens": 4,
        "seed": 11,
        "stop": ["\n\n", "END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "min_tokens": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "logprobs": 1,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    ids_a, ids_b = tokenizer.encode("Once upon a time"), tokenizer.encode("The weather today")
    assert out["choices"][0]["text"] == expected_text(tokenizer, ids_a, 4)
    assert out["choices"][3]["text"] == expected_text(tokenizer, ids_b, 4)
    assert out["usage"]["prompt_tokens"] == len(ids_a) + len(ids_b) and out["usage"]["completion_tokens"] == 16
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and lp["token_logprobs"] == [-0.5] * 4 and len(lp["top_logprobs"][0]) == 1
    assert lp["text_offset"][0] == 0
    sent = sorted((r for w in workers for r in w.requests), key=lambda r: r.request_id)
    assert [r.request_id.rsplit("-", 1)[1] for r in sent] == ["0", "1", "2", "3"]
    assert [r.params.seed for r in sent] == [11, 12, 11, 12]  # choice i: seed + i
    p = sent[0].params
    assert list(p.stop) == ["\n\n", "END"] and p.top_k == 5 and p.min_tokens == 2 and p.ignore_eos
    assert p.max_tokens == 4 and p.logprobs == 1 and p.temperature == pytest.approx(0.5)


def test_chat_logprobs_format(healthy):
    _, _, client = healthy
    out = client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=1, max_tokens=3)).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_models_health_ready_metrics_openapi(healthy):
    _, _, client = healthy
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 2048
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready").json()
    assert ready["healthy_decode_workers"] == 2 and ready["healthy_prefill_workers"] == 1
    metrics = client.get("/metrics").text
    assert 'splitserve_router_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "splitserve_router_decision_seconds_bucket" in metrics
    assert 'splitserve_router_workers{role="decode",state="healthy"} 2.0' in metrics
    spec = client.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


def test_request_id_flows_to_the_worker(healthy):
    _, workers, client = healthy
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "trace-42"
    served = worker_by_address(workers, r.headers["x-splitserve-decode-worker"])
    assert served.requests[-1].request_id.startswith("trace-42-")  # unique per request on the worker
    assert served.metadata[-1]["x-request-id"] == "trace-42"
    generated = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert (
        generated.headers["x-request-id"].startswith("cmpl-")
        and generated.json()["id"] == generated.headers["x-request-id"]
    )


# ---- errors (acceptance 5): status, OpenAI error JSON with a message, and the gateway keeps serving ------
LONG = list(range(100, 2200))  # 2100 token ids: over the 2048-token context

BAD_INPUTS = [
    ("malformed JSON", dict(content=b'{"model": "smollm2-135m", "messages": ['), 400, "not valid JSON"),
    ("wrong type", dict(json=chat_body(max_tokens="ten")), 400, "max_tokens: Input should be a valid integer"),
    ("wrong type (messages)", dict(json={"model": MODEL, "messages": "hi"}), 400, "messages"),
    ("wrong type (temperature)", dict(json=chat_body(temperature="hot")), 400, "temperature"),
    ("missing field", dict(json={"model": MODEL}), 400, "messages: required field missing"),
    ("missing model", dict(json={"messages": [{"role": "user", "content": "x"}]}), 400, "model: required field"),
    ("negative max_tokens", dict(json=chat_body(max_tokens=-5)), 400, "max_tokens=-5 is invalid"),
    ("temperature out of range", dict(json=chat_body(temperature=-1.0)), 400, "temperature=-1.0 is invalid"),
    (
        "prompt over the context",
        dict(path="/v1/completions", json={"model": MODEL, "prompt": LONG}),
        400,
        "maximum context length is 2048 tokens, but the prompt has 2100 tokens",
    ),
    (
        "prompt + max_tokens over",
        dict(path="/v1/completions", json={"model": MODEL, "prompt": LONG[:2000], "max_tokens": 100}),
        400,
        "2100 were requested (2000 in the prompt, 100 for the completion)",
    ),
    (
        "token id outside the vocabulary",
        dict(path="/v1/completions", json={"model": MODEL, "prompt": [10**7]}),
        400,
        "outside the vocabulary",
    ),
    (
        "prompt of another type",
        dict(path="/v1/completions", json={"model": MODEL, "prompt": {"text": "hi"}}),
        400,
        "prompt: Input should be a string, a list of strings, a list of token ids or a list of lists of token ids",
    ),
    (
        "a text among token ids",
        dict(path="/v1/completions", json={"model": MODEL, "prompt": [1, 2, "three"]}),
        400,
        "prompt.2: Input should be a valid integer (got 'three')",
    ),
    (
        "a fractional token id",
        dict(path="/v1/completions", json={"model": MODEL, "prompt": [[1, 2.5]]}),
        400,
        "prompt.0.1: Input should be a valid integer (got 2.5)",
    ),
    ("malformed tool", dict(json=chat_body(tools=[{"type": "function"}])), 400, "tools[0] must be"),
    ("unknown model", dict(json={**chat_body(), "model": "gpt-9"}), 404, "the model 'gpt-9' does not exist"),
    ("20 MB body", dict(content=b'{"model": "' + b"x" * (20 << 20) + b'"}'), 413, "request body too large"),
    (
        "invalid UTF-8",
        dict(content=b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        400,
        "",
    ),
    ("missing key", dict(json=chat_body(), headers={"Authorization": ""}), 401, "missing API key"),
    ("wrong key", dict(json=chat_body(), headers={"Authorization": "Bearer sk-nope"}), 401, "incorrect API key"),
    ("unknown path", dict(path="/v1/audio/speech", json={}), 404, "Not Found"),
]


@pytest.mark.parametrize("name,request_kw,status,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_status_and_the_gateway_keeps_serving(healthy, name, request_kw, status, message):
    _, _, client = healthy
    kw = dict(request_kw)
    path = kw.pop("path", "/v1/chat/completions")
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    r = client.post(path, headers=headers, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert message in error["message"]
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_rate_limited_key_gets_429_with_retry_after(healthy):
    _, _, client = healthy
    limited = {"Authorization": "Bearer sk-limited"}
    statuses = [client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=limited) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert int(statuses[2].headers["retry-after"]) >= 1
    assert statuses[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=1)).status_code == 200  # other keys


def test_worker_rejecting_input_is_a_400_not_a_retry(healthy):
    server, workers, client = healthy
    for w in workers:
        w.fail_next = [grpc.StatusCode.INVALID_ARGUMENT]
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.status_code == 400 and "injected failure" in r.json()["error"]["message"]
    assert sum(len(w.fail_next) for w in workers) == 1  # exactly one worker was asked


# ---- failures: retry, resume, 503 and recovery, disconnects ------------------------------------
def test_failure_before_the_first_token_is_retried_elsewhere(healthy):
    _, workers, client = healthy
    body = chat_body("a prompt that lands on one worker, twice", max_tokens=4)
    first = client.post("/v1/chat/completions", json=body)
    home = worker_by_address(workers, first.headers["x-splitserve-decode-worker"])
    home.fail_next = [grpc.StatusCode.UNAVAILABLE]
    second = client.post("/v1/chat/completions", json=body)
    assert second.status_code == 200
    assert second.headers["x-splitserve-decode-worker"] != home.address
    assert home.fail_next == [] and second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def test_decode_worker_crash_mid_stream_resumes_on_the_other(healthy, tokenizer, loop):
    server, workers, client = healthy
    prompt = "The history of the city of Rome, told from its founding to the fall of the empire"
    prompt_ids = tokenizer.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12}
    crashed = worker_by_address(
        workers, client.post("/v1/completions", json=body).headers["x-splitserve-decode-worker"]
    )
    crashed.crash_after_tokens = 5  # the prompt is cached there, so the stream lands there again
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.headers["x-splitserve-decode-worker"] == crashed.address
        events = sse_events(r)
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == expected_text(tokenizer, prompt_ids, 12)
    other = next(w for w in workers if w is not crashed)
    resumed = other.requests[-1]
    # The worker sent 5 tokens then died; how many reached the router before the stream broke
    # depends on timing (a broken HTTP/2 stream drops what was still buffered), so the
    # invariant is: the resume carries exactly the tokens the client already got.
    k = len(resumed.resume_output_token_ids)
    assert 1 <= k <= 5
    assert list(resumed.prompt_token_ids) == prompt_ids
    assert list(resumed.resume_output_token_ids) == [FakeWorker.token_at(len(prompt_ids) + i) for i in range(k)]
    assert resumed.params.max_tokens == 12 and not resumed.prefill_workers  # the worker counts what was sent
    assert 'splitserve_router_failovers_total{kind="resumes"}' in client.get("/metrics").text


def test_silent_worker_is_marked_down_and_its_stream_moves(healthy, tokenizer):
    """A worker that stops answering (no tokens, no load reports: a SIGSTOPped process) is marked
    down after stale_after_s (2 s here); the stream in flight on it resumes elsewhere."""
    server, workers, client = healthy
    # Long enough for full blocks: the prefix scorer then sends the second request to the worker
    # that served the first (a prompt under one block scores neutral everywhere: a coin flip).
    prompt = (
        "A silent worker should not hold a stream hostage, so the router moves it to another worker "
        "once the silent one has been quiet for longer than the staleness limit of the watcher"
    )
    prompt_ids = tokenizer.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10}
    silent = worker_by_address(workers, client.post("/v1/completions", json=body).headers["x-splitserve-decode-worker"])
    silent.stall_after_tokens = 4
    t0 = time.monotonic()
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200 and 1.5 < time.monotonic() - t0 < 10
    assert out.json()["choices"][0]["text"] == expected_text(tokenizer, prompt_ids, 10)
    other = next(w for w in workers if w is not silent)
    resumed = other.requests[-1]
    assert list(resumed.prompt_token_ids) == prompt_ids and len(resumed.resume_output_token_ids) == 4


def test_all_workers_down_gives_503_quickly_then_recovers(healthy, loop):
    server, workers, client = healthy
    for w in workers:
        loop.run(w.stop())
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.status_code == 503 and time.monotonic() - t0 < 3 + server.config.gateway.worker_wait_s
    assert r.json()["error"]["code"] == "no_worker_available" and "retry-after" in r.headers
    assert client.get("/ready").status_code == 503
    loop.run(workers[0].start())
    deadline = time.monotonic() + 10
    while client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code != 200:
        assert time.monotonic() < deadline, "the router did not take the restarted worker back"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_worker_call(healthy, stream):
    server, workers, client = healthy
    for w in workers:
        w.token_delay_s = 0.05
        w.cancelled.clear()
    body = chat_body(f"disconnect me {stream}", max_tokens=500, stream=stream)
    rid = f"gone-{stream}"
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": rid}, timeout=0.5
    ) as short:
        if stream:
            with short.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
        else:
            with pytest.raises(httpx.ReadTimeout):
                short.post("/v1/chat/completions", json=body)
    deadline = time.monotonic() + 5
    while not any(c.startswith(rid) for w in workers for c in w.cancelled):
        assert time.monotonic() < deadline, "the worker call was not cancelled"
        time.sleep(0.05)


def test_full_admission_queue_gets_429(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer, token_delay_s=0.05).start())
    gateway = GatewayConfig(max_concurrent_requests=1, max_queued_requests=0)
    server = RouterServer(loop, router_config([worker.address], gateway=gateway), tokenizer=tokenizer).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=40, stream=True)) as r:
                lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
                next(lines)
                busy = client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
                assert len(list(lines)) > 40
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
            assert busy.headers["retry-after"] == "1"
    finally:
        server.stop()
        loop.run(worker.stop())
