"""Declared adapters (router/placement/adapter_sync.py, AdapterCatalog's declared mode): the router follows
an adapters file, brings every worker in line with it (a worker that joins later, one holding
an adapter that is not declared, a change of the file), keeps the last good set when the file
breaks, refuses the load/unload API while the set is declared, and reports per pool what is
loaded, writing only when that changes.

Workers are routerkit.FakeWorker: the real Worker gRPC protocol (load reports listing adapters,
Load/UnloadLoraAdapter) in front of a fake engine.
"""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest
from routerkit import FakeWorker, RouterServer, free_port, router_config

from splitserve.platform.errors import ConfigError
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import AdaptersConfig
from splitserve.router.config.file import from_dict
from splitserve.router.placement import adapter_sync
from splitserve.router.placement.adapter_sync import parse_declared, pool_report
from splitserve.router.placement.pool import WorkerPool, WorkerState


def wait_for(condition, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not met in time"
        time.sleep(0.05)


def held(worker: FakeWorker) -> dict[str, str]:
    return {a.name: a.path for a in worker.load.adapters}


def folder(root, name):
    path = root / name
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(f'{{"r": 8, "name": "{name}"}}')
    return str(path)


def declare(path, **adapters):
    tmp = path.with_suffix(".tmp")
    tmp.write_text("adapters:\n" + "".join(f"  - {{name: {n}, path: '{p}'}}\n" for n, p in adapters.items()))
    tmp.replace(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("adapters: {sql: /a}", "must be a list"),
        ("adapters:\n  - {name: sql}", "each adapter is {name, path}"),
        ("adapters:\n  - {name: 'has space', path: /a}", "without spaces or commas"),
        ("adapters:\n  - {name: sql, path: /a}\n  - {name: sql, path: /b}", "declared twice"),
        ("other: 1", "the one key 'adapters'"),
        ("", "an empty set is 'adapters: \\[\\]'"),  # a half-written file never unloads everything
    ],
)
def test_a_bad_adapters_file_is_a_config_error_naming_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_declared(text)


def test_the_adapters_config_checks_its_keys():
    assert parse_declared("adapters: []") == {} and parse_declared("adapters:") == {}
    with pytest.raises(ConfigError, match="poll_s"):
        AdaptersConfig(file="/a", poll_s=0)
    with pytest.raises(ConfigError, match="both or neither"):
        AdaptersConfig(file="/a", report_configmap="cm")
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict({"adapters": {"fil": "/a"}})


def test_pool_report_counts_connected_workers_and_their_adapters():
    def state(address, role, names, connected=True):
        load = pb.LoadReport(adapters=[pb.LoraAdapterInfo(name=n) for n in names])
        return WorkerState(address, role=role, is_connected=connected, load=load)

    pool = WorkerPool("m", 16)
    pool.workers = {
        w.address: w
        for w in [
            state("a", "decode", ["sql", "chat"]),
            state("b", "decode", ["sql"]),
            state("c", "prefill", []),
            state("d", "decode", ["x"], connected=False),
        ]
    }
    assert pool_report(pool) == {
        "decode": {"workers": 2, "adapters": {"chat": 1, "sql": 2}},
        "prefill": {"workers": 1, "adapters": {}},
    }


class Reporter:
    def __init__(self):
        self.written: list[dict] = []

    def write(self, report):
        self.written.append(report)


@pytest.fixture()
def fleet(loop, tmp_path, tokenizer):
    folders = {n: folder(tmp_path, n) for n in ("sql", "chat", "stale")}
    adapters_file = tmp_path / "adapters.yaml"
    declare(adapters_file, sql=folders["sql"])
    w1 = loop.run(FakeWorker(tokenizer=tokenizer).start())
    w1._set_adapters([pb.LoraAdapterInfo(name="stale", path=folders["stale"])])  # left from an earlier set
    w2 = FakeWorker(role="prefill", tokenizer=tokenizer, port=free_port())  # joins later
    config = dataclasses.replace(
        router_config([w1.address, w2.address]), adapters=AdaptersConfig(file=str(adapters_file), poll_s=0.2)
    )
    server = RouterServer(loop, config, tokenizer=tokenizer).start(num_decode=1)
    yield server, w1, w2, folders, adapters_file
    server.stop()
    for w in (w1, w2):
        loop.run(w.stop())


def test_workers_follow_the_declared_file(loop, fleet):
    server, w1, w2, folders, adapters_file = fleet
    wait_for(lambda: held(w1) == {"sql": folders["sql"]}, what="sql loaded and the undeclared adapter unloaded")
    loop.run(w2.start())
    wait_for(lambda: held(w2) == {"sql": folders["sql"]}, what="the late worker gets the declared set")
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]][1:] == ["sql"]

    declare(adapters_file, chat=folders["chat"], sql=folders["stale"])  # sql now from another folder
    for w in (w1, w2):
        wait_for(lambda w=w: held(w) == {"chat": folders["chat"], "sql": folders["stale"]}, what="the new set")

    adapters_file.with_suffix(".tmp").write_text("adapters: [not, a, mapping")  # a broken file keeps the last set
    adapters_file.with_suffix(".tmp").replace(adapters_file)
    time.sleep(1.0)
    assert held(w1) == {"chat": folders["chat"], "sql": folders["stale"]}
    declare(adapters_file)  # an empty set unloads everything
    for w in (w1, w2):
        wait_for(lambda w=w: held(w) == {}, what="everything unloaded")


def test_the_api_cannot_change_a_declared_set(fleet):
    server, w1, w2, folders, _ = fleet
    wait_for(lambda: "sql" in held(w1))
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": folders["chat"]}),
        ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
    ):
        resp = httpx.post(server.url + path, json=body, timeout=30)
        assert resp.status_code == 409 and "spec.adapters" in resp.json()["error"]["message"], resp.text
    assert held(w1) == {"sql": folders["sql"]}


def test_a_declared_folder_that_fails_is_retried_later_not_on_every_report(loop, fleet, tmp_path, caplog):
    server, w1, w2, folders, adapters_file = fleet
    wait_for(lambda: "sql" in held(w1))
    declare(adapters_file, sql=folders["sql"], bad=str(tmp_path / "missing"))

    def failures():
        return [r for r in caplog.records if r.getMessage().startswith("loading adapter bad on")]

    wait_for(lambda: failures(), what="the failed load logged")
    time.sleep(3.0)  # six load reports at 0.5 s; the retry waits FAILED_RETRY_S (30 s)
    assert len(failures()) == 1 and "is not a folder" in failures()[0].getMessage()  # the worker's NOT_FOUND
    assert held(w1) == {"sql": folders["sql"]}


def test_the_report_is_written_when_it_changes(loop):
    import asyncio

    pool = WorkerPool("m", 16)
    w = pool.add("a")
    w.role, w.is_connected = "decode", True
    reporter = Reporter()
    config = AdaptersConfig(file="/unused", poll_s=0.1, report_namespace="ns", report_configmap="cm")

    async def run():
        task = asyncio.create_task(adapter_sync.report_loop(pool, config, reporter))
        await asyncio.sleep(0.35)
        w.load = pb.LoadReport(adapters=[pb.LoraAdapterInfo(name="sql")])
        await asyncio.sleep(0.35)
        task.cancel()

    loop.run(run())
    assert reporter.written == [
        {"decode": {"workers": 1, "adapters": {}}},
        {"decode": {"workers": 1, "adapters": {"sql": 1}}},
    ]
