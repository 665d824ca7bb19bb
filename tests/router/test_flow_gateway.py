"""Flow control through the gateway, with the official `openai` client, a real router and fake
workers that speak the real gRPC protocol (tests/router/routerkit.py): bands from objectives and
key files, dispatch held back while the worker is saturated, sheddable requests answered 503 with
Retry-After, a client that leaves its queue, and the metrics that count each request once."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import httpx
import openai
import pytest
import yaml
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.router.config import GatewayConfig
from splitserve.router.config.flow import FlowControlConfig

KEYS = [
    {"id": "team-a", "key": "sk-a", "priority": 0, "max_priority": 10},
    {"id": "team-b", "key": "sk-b", "priority": 10, "weight": 2},
    {"id": "prometheus", "key": "sk-prometheus", "role": "metrics"},  # reads /metrics, calls nothing else
]
MESSAGES = [{"role": "user", "content": "Count the stars."}]


@pytest.fixture(scope="module")
def stack(loop, tokenizer, tmp_path_factory):
    keys = tmp_path_factory.mktemp("flow") / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": KEYS}))
    worker = loop.run(FakeWorker(tokenizer=tokenizer, token_delay_s=0.02).start())
    flow = FlowControlConfig(
        enabled=True, objectives={"interactive": 10, "batch": -1}, max_running_per_worker=1, max_queue_wait_s=20
    )
    config = router_config([worker.address], gateway=GatewayConfig(api_keys_file=str(keys)), flow_control=flow)
    server = RouterServer(loop, config, tokenizer=tokenizer).start(num_decode=1)
    yield server, worker
    server.stop()
    loop.run(worker.stop())


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def chat(url: str, key: str, max_tokens: int, headers: dict | None = None, **extra):
    return client(url, key).chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=MESSAGES, max_tokens=max_tokens, extra_headers=headers or {}, **extra
    )


def metrics_text(url: str) -> str:
    """/metrics (it takes a metrics or admin key when keys are configured)."""
    return httpx.get(f"{url}/metrics", headers={"authorization": "Bearer sk-prometheus"}).raise_for_status().text


def flow_counts(url: str) -> dict[tuple[str, str], float]:
    text = metrics_text(url)
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("splitserve_router_flow_requests_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["band"].strip('"'), labels["outcome"].strip('"'))
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_until(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def queued_now(url: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text(url).splitlines()
        if line.startswith("splitserve_router_flow_queue_length{")
    )


def flood_then(server, worker, pool, key: str, headers: dict, max_tokens: int):
    """team-a: one long request running and three queued behind it; then one request with `key`
    and `headers`. Returns the futures (flood first) and the worker's request count before."""
    before = len(worker.requests)
    flood = [pool.submit(chat, server.url, "sk-a", 60)]
    wait_until(lambda: len(worker.requests) > before)
    flood += [pool.submit(chat, server.url, "sk-a", 20) for _ in range(3)]
    wait_until(lambda: queued_now(server.url) >= 3)
    assert len(worker.requests) == before + 1  # held back: the worker saw one, not four
    last = pool.submit(chat, server.url, key, max_tokens, headers)
    return flood, last, before


def test_interactive_band_overtakes_a_flood_and_the_flood_all_finishes(stack):
    server, worker = stack
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        flood, interactive, before = flood_then(
            server, worker, pool, "sk-a", {"x-gateway-inference-objective": "interactive"}, 4
        )
        answers = [f.result(60) for f in flood] + [interactive.result(60)]
    assert all(a.http_response.status_code == 200 for a in answers)
    max_tokens = [r.params.max_tokens for r in worker.requests[before:]]
    assert max_tokens == [60, 4, 20, 20, 20]  # the band-10 request went next, ahead of three


def test_key_file_priority_sets_the_band(stack):
    server, worker = stack
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        flood, team_b, before = flood_then(server, worker, pool, "sk-b", {}, 3)  # team-b's key: priority 10
        for f in [*flood, team_b]:
            assert f.result(60).http_response.status_code == 200
    assert [r.params.max_tokens for r in worker.requests[before:]] == [60, 3, 20, 20, 20]
    assert [r.band for r in worker.requests[before:]] == [0, 10, 0, 0, 0]


def test_sheddable_is_503_with_retry_after_while_saturated_and_counted_once(stack):
    server, worker = stack
    counts0 = flow_counts(server.url)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    before = len(worker.requests)
    running = pool.submit(chat, server.url, "sk-a", 100)
    wait_until(lambda: len(worker.requests) > before)
    with pytest.raises(openai.APIStatusError) as exc:
        chat(server.url, "sk-a", 5, {"x-gateway-inference-objective": "batch"})
    assert exc.value.status_code == 503
    assert exc.value.response.headers["retry-after"] == "1"
    assert "sheddable" in exc.value.message
    with pytest.raises(openai.BadRequestError, match="interactive"):
        chat(server.url, "sk-a", 5, {"x-gateway-inference-objective": "nope"})
    assert running.result(60).http_response.status_code == 200
    idle = chat(server.url, "sk-a", 2, {"x-gateway-inference-objective": "batch"})  # room again: served
    assert idle.http_response.status_code == 200
    counts = flow_counts(server.url)
    delta = {k: counts.get(k, 0) - counts0.get(k, 0) for k in counts}
    assert delta == {
        ("0", "dispatched"): 1,
        ("-1", "shed"): 1,
        ("-1", "dispatched"): 1,
        **{k: 0 for k in counts if k not in {("0", "dispatched"), ("-1", "shed"), ("-1", "dispatched")}},
    }
    pool.shutdown()


def test_a_client_that_leaves_the_queue_is_gone_at_once(stack):
    server, worker = stack
    counts0 = flow_counts(server.url)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    before = len(worker.requests) + 1
    running = pool.submit(chat, server.url, "sk-a", 150)  # 3 s or more
    wait_until(lambda: len(worker.requests) == before)
    done = threading.Event()

    def leave_early():
        try:
            client(server.url, "sk-a").with_options(timeout=0.5).chat.completions.create(
                model="smollm2-135m", messages=MESSAGES, max_tokens=5
            )
        except openai.APITimeoutError:
            done.set()

    leave_early()
    assert done.is_set()
    wait_until(lambda: flow_counts(server.url).get(("0", "cancelled"), 0) > counts0.get(("0", "cancelled"), 0), 5)
    assert 'splitserve_router_flow_queue_length{band="0",flow="team-a"} 0.0' in metrics_text(server.url)
    assert running.result(60).http_response.status_code == 200
    time.sleep(0.2)
    assert len(worker.requests) == before  # the one that left never reached the worker
    pool.shutdown()


def test_key_file_rejects_a_bad_weight(tmp_path):
    from splitserve.platform.errors import ConfigError
    from splitserve.router.config.keys import parse_keys

    with pytest.raises(ConfigError, match="weight"):
        parse_keys({"keys": [{"id": "a", "key": "k", "weight": 0}]}, "keys.yaml")
    with pytest.raises(ConfigError, match="priority"):
        parse_keys({"keys": [{"id": "a", "key": "k", "priority": 1.5}]}, "keys.yaml")
    ((_, key),) = parse_keys({"keys": [{"id": "a", "key": "k", "priority": -1, "weight": 3}]}, "keys.yaml")
    assert (key.priority, key.weight) == (-1, 3.0)


def test_config_section_from_yaml():
    from splitserve.router.config.file import from_dict

    config = from_dict({"flow_control": {"enabled": True, "objectives": {"chat": 10}}})
    assert config.flow_control.objectives == {"chat": 10}
    assert dataclasses.replace(config.flow_control, max_queued_per_band=3).max_queued_per_band == 3
