"""The gateway's /openapi.json is honest (router/api/openapi.py): schemathesis, in-process against a
real gateway in front of fake workers (routerkit.FakeWorker: the real Worker gRPC protocol, a
fake engine), generates valid and invalid requests for every operation and runs all its checks
with schemathesis' own settings (no 5xx, status codes, content types, response schemas and
headers as documented, invalid data rejected, valid data accepted: a schema-valid request answered
400 is a finding, ST202). The two it found against `splitserve up` are fixed in the server: a
whole-number float such as `"n": 2.0` for an `integer` field (JSON Schema counts it as one), and a
`lora_path` that is no folder, now 404 as vLLM answers a missing adapter. Then the
boundary inputs LLM servers are known to mishandle (research: planner-chaos-fuzz.md, table in
section 3), each answered 4xx with a message, never 5xx."""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.router.config import GatewayConfig

MODEL = "smollm2-135m"
OBSERVED: set[tuple[str, str, int]] = set()


@pytest.fixture(scope="module")
def gateway(loop, tokenizer):
    workers = [
        loop.run(FakeWorker(tokenizer=tokenizer).start()),
        loop.run(FakeWorker("prefill", tokenizer=tokenizer).start()),
    ]
    server = RouterServer(
        loop,
        router_config([w.address for w in workers], gateway=GatewayConfig(max_body_bytes=256 * 1024, worker_wait_s=0)),
        tokenizer=tokenizer,
    ).start(num_decode=1, num_prefill=1)
    yield server
    server.stop()
    for w in workers:
        loop.run(w.stop())


@pytest.fixture(scope="module")
def api_schema(gateway):
    return schemathesis.openapi.from_url(gateway.url + "/openapi.json")


def operations(api_schema):
    return [result.ok() for result in api_schema.get_all_operations()]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_every_answer_matches_the_openapi_document(api_schema, gateway, mode):
    """Driven through hypothesis directly (schemathesis' pytest plugin does not load under this
    pytest); `call_and_validate` runs every check schemathesis has."""
    ops = operations(api_schema)
    assert {op.path for op in ops} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/ready",
        "/metrics",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/version",
    }
    for op in ops:
        if mode == schemathesis.GenerationMode.NEGATIVE and op.method.lower() == "get":
            continue  # no parameters or body: nothing can be made invalid

        @given(op.as_strategy(mode))
        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call_and_validate(base_url=gateway.url, timeout=60)
            OBSERVED.add((case.path, case.method.lower(), response.status_code))

        check()


def test_the_document_lists_every_status_observed(gateway):
    doc = httpx.get(gateway.url + "/openapi.json").json()
    for path, method, status in OBSERVED:
        assert str(status) in doc["paths"][path][method]["responses"], (path, method, status)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(chat) and "422" not in chat
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


# ---- boundary inputs (research table) -----------------------------------------------------
def chat(content="Hi", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def nested(depth: int) -> str:
    return '{"model": "smollm2-135m", "prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"


BOUNDARY = {
    "huge max_tokens": ("/v1/chat/completions", json.dumps(chat(max_tokens=10**12))),
    "max_tokens past int64": ("/v1/chat/completions", json.dumps(chat(max_tokens=2**70))),
    "n large": ("/v1/chat/completions", json.dumps(chat(n=10**6))),
    "empty prompt": ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""})),
    "empty prompt list": ("/v1/completions", json.dumps({"model": MODEL, "prompt": []})),
    "prompt over the context": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hello " * 5000})),
    "body over the limit": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 300_000})),
    "invalid UTF-8": (
        "/v1/chat/completions",
        b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    ),
    "lone surrogate": (
        "/v1/chat/completions",
        '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    ),
    "NaN temperature": (
        "/v1/chat/completions",
        '{"model": "smollm2-135m", "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}',
    ),
    "Infinity top_p": (
        "/v1/chat/completions",
        '{"model": "smollm2-135m", "top_p": Infinity, "messages": [{"role": "user", "content": "hi"}]}',
    ),
    "float overflowing to inf": (
        "/v1/chat/completions",
        '{"model": "smollm2-135m", "temperature": 1e999, "messages": [{"role": "user", "content": "hi"}]}',
    ),
    "nested content parts": (
        "/v1/chat/completions",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": [{"type": "text"}]}]}]}
        ),
    ),
    "deeply nested JSON": ("/v1/completions", nested(100_000)),
    "negative logprobs": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "logprobs": -1})),
    "token id out of vocabulary": ("/v1/completions", json.dumps({"model": MODEL, "prompt": [2**40]})),
    "not an object": ("/v1/completions", "[1, 2, 3]"),
}


def test_integer_fields_take_whole_number_floats_and_nothing_else(gateway):
    """JSON Schema's `integer` (what the document promises) includes 2.0; 2.5 and "2" are not integers."""

    def post(**fields):
        body = {"model": MODEL, "prompt": [1.0, 2.0, 3.0], "max_tokens": 2.0, **fields}
        return httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)

    ok = post(n=2.0, seed=7.0, stop_token_ids=[5.0])
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
    for bad in ({"n": 2.5}, {"n": "2"}, {"n": True}, {"seed": 1.5}):
        r = post(**bad)
        assert r.status_code == 400 and "valid integer" in r.json()["error"]["message"], (bad, r.text)


@pytest.mark.parametrize("name", list(BOUNDARY))
def test_boundary_input_is_a_clear_4xx(gateway, name):
    path, body = BOUNDARY[name]
    r = httpx.post(gateway.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"] and len(error["message"]) < 2000, error
