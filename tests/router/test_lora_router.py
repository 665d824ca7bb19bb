"""Adapter-aware routing: the lora-affinity scorer (table-driven), placement only on workers that
have the request's adapter, adapter identity in the router's block hashes, and runtime loads
and unloads reaching every worker, including one that joins later.

Workers here are routerkit.FakeWorker: the real Worker gRPC protocol (Generate, WatchEvents with
load reports listing adapters, Load/UnloadLoraAdapter) in front of a fake engine.
"""

import asyncio
import random
import time

import httpx
import openai
import pytest
from routerkit import FakeWorker, RouterServer, free_port, router_config

from splitserve.platform.hashing import BlockHasher, lora_extra_keys
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import (
    DisaggregationConfig,
    PlacementConfig,
    ProfileConfig,
    ScorerSpec,
    default_decode_profile,
)
from splitserve.router.core.worker_messages import generate_request
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.placer import Decision, PlacementRequest, Placer
from splitserve.router.placement.pool import WorkerPool, WorkerState
from splitserve.router.placement.scorers import LoraAffinity, ScoringContext

MODEL = "smollm2-135m"


def worker(address, running=(), waiting=(), max_loras=2, load=True, resident=()):
    report = (
        pb.LoadReport(
            running_lora_adapters=list(running),
            waiting_lora_adapters=list(waiting),
            max_loras=max_loras,
            resident_lora_adapters=list(resident),
        )
        if load
        else None
    )
    return WorkerState(address, role="decode", is_connected=True, load=report)


@pytest.mark.parametrize(
    "lora, workers, expected",
    [
        # GIE semantics: active 1.0, a free slot 0.8, only waiting there 0.6, else 0
        (
            "a",
            [worker("w1", running=["a"]), worker("w2", running=["b"]), worker("w3", running=["b", "c"])],
            {"w1": 1.0, "w2": 0.8, "w3": 0.0},
        ),
        ("a", [worker("w1", running=["b", "c"], waiting=["a"]), worker("w2", waiting=["a"])], {"w1": 0.6, "w2": 0.8}),
        ("a", [worker("w1", running=["a", "b"], waiting=["c"])], {"w1": 1.0}),  # active beats a full worker
        ("a", [worker("w1", running=["b"], waiting=["c"])], {"w1": 0.0}),  # full: 2 adapters, 2 slots
        ("a", [worker("w1", max_loras=1)], {"w1": 0.8}),
        # a free slot where the adapter is still in memory beats one that must read it from disk
        ("a", [worker("w1", resident=["a", "b"]), worker("w2", resident=["b"])], {"w1": 0.9, "w2": 0.8}),
        ("a", [worker("w1", running=["b", "c"], resident=["a"])], {"w1": 0.0}),  # resident, but no slot
        ("a", [worker("w1", running=["a"], resident=["a"])], {"w1": 1.0}),
        ("a", [worker("w1", load=False)], {"w1": 0.5}),  # no report: neutral
        (None, [worker("w1", running=["b"]), worker("w2")], {"w1": 1.0, "w2": 1.0}),  # base: no preference
    ],
)
def test_lora_affinity_scores(lora, workers, expected):
    ctx = ScoringContext(num_prompt_tokens=10, num_prompt_blocks=0, lora_name=lora)
    assert LoraAffinity().score(ctx, workers) == expected


def hint(lora, workers, scorers=None):
    """The lora_evict_first a placement sends with a request placed on w1 (made the only candidate)."""
    pool = WorkerPool(MODEL, 16, clock=lambda: 0.0)
    for w in workers:
        pool.workers[w.address] = w
    profile = (
        default_decode_profile()
        if scorers is None
        else ProfileConfig(filters=("healthy",), scorers=tuple(ScorerSpec(n, 1.0) for n in scorers))
    )
    placer = Placer(
        PlacementConfig(decode=profile, disaggregation=DisaggregationConfig(mode="never")),
        pool,
        InMemoryPrefixIndex(ttl_s=10.0, clock=lambda: 0.0),
        random.Random(0),
    )
    others = frozenset(w.address for w in workers if w.address != "w1")
    decision = asyncio.run(placer.place(PlacementRequest(16, [], exclude=others, lora_name=lora)))
    assert decision.decode == "w1"
    return decision.lora_evict_first


def test_a_request_tells_its_worker_which_adapters_others_also_hold():
    """Evict-first = what w1 holds in memory that another healthy decode worker holds, less the
    request's own adapter and those w1's requests use now; nothing for a base request, nothing
    without the lora-affinity scorer (a policy that ignores residency)."""
    w1 = dict(resident=["a", "b", "c", "d", "e"], running=["d"], waiting=["e"], max_loras=8)
    pool = [worker("w1", **w1), worker("w2", resident=["b", "c", "d", "e", "x"]), worker("w3", resident=["a"])]
    assert hint("c", pool) == ("a", "b")
    assert hint(None, pool) == ()
    assert hint("c", pool, scorers=["queue-depth"]) == ()
    assert hint("c", pool, scorers=["lora-affinity"]) == ("a", "b")
    down = WorkerState("w3", role="decode", is_connected=False, load=pb.LoadReport(resident_lora_adapters=["a"]))
    assert hint("c", [worker("w1", **w1), worker("w2", resident=["b"]), down]) == (
        "b",
    )  # a down worker's memory is gone
    assert hint("c", [worker("w1", **w1), worker("w2", load=False)]) == ()


def test_the_hint_reaches_the_worker_in_its_generate_request():
    decision = Decision("w1", lora_evict_first=("a", "b"))
    request = generate_request("r", [1, 2], SamplingParams(), decision, DisaggregationConfig(), lora_name="c")
    assert request.lora_name == "c" and list(request.lora_evict_first) == ["a", "b"]


@pytest.fixture()
def fleet(loop, tmp_path, tokenizer):
    folders = {}
    for name in ("sql", "late"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "adapter_config.json").write_text(f'{{"r": 8, "name": "{name}"}}')
    w1 = loop.run(FakeWorker(tokenizer=tokenizer).start())
    w2 = FakeWorker(tokenizer=tokenizer, port=free_port())  # joins later
    server = RouterServer(loop, router_config([w1.address, w2.address]), tokenizer=tokenizer).start(num_decode=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield server, client, w1, w2, folders
    server.stop()
    for w in (w1, w2):
        loop.run(w.stop())


def wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def names(worker: FakeWorker) -> set[str]:
    return {a.name for a in worker.load.adapters}


def test_loads_reach_every_worker_including_one_that_joins_later(loop, fleet, tokenizer):
    server, client, w1, w2, folders = fleet
    answer = client.post(
        "/load_lora_adapter", body={"lora_name": "sql", "lora_path": str(folders["sql"])}, cast_to=object
    )
    assert answer["status"] == "loaded" and names(w1) == {"sql"}
    loop.run(w2.start())
    wait_for(lambda: names(w2) == {"sql"})  # pushed after its first load report
    wait_for(lambda: "sql" in {m.id for m in client.models.list().data})
    out = client.completions.create(model="sql", prompt="one two three four five", max_tokens=3)
    sent = [r for w in (w1, w2) for r in w.requests][-1]
    assert sent.lora_name == "sql" and out.choices[0].finish_reason == "length"
    client.post("/unload_lora_adapter", body={"lora_name": "sql"}, cast_to=object)
    assert names(w1) == names(w2) == set()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt="x", max_tokens=1)


def test_requests_go_only_to_workers_with_the_adapter_and_hash_with_its_identity(loop, fleet, tokenizer):
    server, client, w1, w2, folders = fleet
    loop.run(w2.start())
    wait_for(lambda: server.router.pool.num_healthy() == 2)
    digest = b"\x01" * 32  # as if w2 alone had been started with --lora-modules sql=...
    w2._set_adapters([pb.LoraAdapterInfo(name="sql", digest=digest, path="/x")])
    wait_for(lambda: "sql" in {m.id for m in client.models.list().data})
    for _ in range(4):
        client.completions.create(model="sql", prompt="one two three four five", max_tokens=1)
    assert [r.lora_name for r in w2.requests] == ["sql"] * 4 and not w1.requests
    prompt = list(range(100, 140))
    want = BlockHasher(MODEL, 16).hash_blocks(prompt, lora_extra_keys("sql", digest))
    assert server.router.dispatcher._hashes(_job(prompt, "sql"), prompt) == want
    assert server.router.dispatcher._hashes(_job(prompt, None), prompt) == BlockHasher(MODEL, 16).hash_blocks(prompt)


def test_bad_load_is_400_missing_folder_404_and_neither_changes_anything(fleet, tmp_path):
    server, client, w1, w2, folders = fleet
    resp = httpx.post(
        server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=30
    )
    assert resp.status_code == 400 and "adapter_config.json" in resp.json()["error"]["message"]
    resp = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 404 and (error["code"], error["param"]) == ("adapter_not_found", "lora_path")
    assert "'/nope' is not a folder" in error["message"]
    assert names(w1) == set() and "x" not in {m.id for m in client.models.list().data}


def _job(prompt, lora):
    from splitserve.platform.sampling.params import SamplingParams
    from splitserve.router.core.job import Job

    return Job("r", prompt, SamplingParams(), lora_name=lora)
