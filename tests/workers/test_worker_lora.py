"""LoRA adapters on real worker processes: real gRPC, KV over TCP between a prefill and a decode
worker (`splitserve worker` subprocesses on 127.0.0.1).

The decode worker loads an adapter at start (--lora-modules); the prefill worker does not have
it and must load it from the folder the decode worker names, so P/D with an adapter equals the
decode worker's own (colocated) answer; when the prefill worker cannot read the folder, the
request falls back to local prefill and is still right, as it is when the prefill worker holds
other weights under the adapter's name (the KV layout carries the adapter's digest). Workers
report their adapters in load reports and export vllm:lora_requests_info. An adapter evicted
from memory is read again off the engine thread: other streams keep decoding during the read
(a slow disk is injected with SPLITSERVE_FAULT_ADAPTER_READ_S).
"""

import asyncio
import shutil
import time

import grpc
import pytest
from lora_folders import write_adapter
from workerproc import WorkerProc, worker_channel

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(n)]


async def generate(address, token_ids, lora="", prefill_workers=(), mode=pb.DISAGGREGATION_MODE_ALWAYS, evict_first=()):
    async with worker_channel(address) as channel:
        request = pb.GenerateRequest(
            request_id=f"t-{time.monotonic_ns()}",
            prompt_token_ids=token_ids,
            lora_name=lora,
            lora_evict_first=list(evict_first),
            params=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            prefill_workers=list(prefill_workers),
            disaggregation=mode,
        )
        msgs = [m async for m in pb_grpc.WorkerStub(channel).Generate(request)]
    return [t for m in msgs for t in m.token_ids], msgs[-1]


async def call(address, method, request):
    async with worker_channel(address) as channel:
        return await getattr(pb_grpc.WorkerStub(channel), method)(request)


async def load_report(address, has: str, deadline_s: float = 30.0, resident: bool = False) -> pb.LoadReport:
    """The first of the worker's load reports that lists adapter `has` (among the resident ones
    with `resident`; or the last one seen when the deadline passes): a report is a periodic
    snapshot, so the first may predate a load just done."""
    last = pb.LoadReport()

    async def watch():
        nonlocal last
        async with worker_channel(address) as channel:
            async for msg in pb_grpc.WorkerStub(channel).WatchEvents(pb.WatchEventsRequest(load_interval_s=0.05)):
                if msg.WhichOneof("payload") == "load":
                    last = msg.load
                    if has in (last.resident_lora_adapters if resident else {a.name for a in last.adapters}):
                        return

    try:
        await asyncio.wait_for(watch(), deadline_s)
    except TimeoutError:
        pass
    return last


def assert_prefilled_locally(d, p, tokens, adapter: str) -> None:
    """A request with `adapter` offered the prefill worker `p` is prefilled on `d` instead (one more
    local fallback), with the answer a never-disaggregated request gets."""
    before = d.metric('splitserve_remote_prefills_total{outcome="local_fallback"}')
    out, last = asyncio.run(generate(d.address, tokens, adapter, [p.address]))
    assert last.prefill_worker == "" and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert d.metric('splitserve_remote_prefills_total{outcome="local_fallback"}') == before + 1
    assert out == asyncio.run(generate(d.address, tokens, adapter, mode=pb.DISAGGREGATION_MODE_NEVER))[0]


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-workers")
    sql = write_adapter(folder / "sql", r=8, modules=("q_proj", "k_proj", "v_proj", "down_proj"), seed=5)
    d = WorkerProc("decode", "tcp", "--lora-modules", f"sql={sql}", "--max-loras", "2").start()
    p = WorkerProc("prefill", "tcp").start()
    yield d, p, folder
    for w in (d, p):
        w.terminate()


def test_pd_with_an_adapter_equals_colocated(lora_pair):
    d, p, _ = lora_pair
    tokens = prompt(100, salt=1)
    local, _ = asyncio.run(generate(d.address, tokens, "sql", mode=pb.DISAGGREGATION_MODE_NEVER))
    base, _ = asyncio.run(generate(d.address, tokens, mode=pb.DISAGGREGATION_MODE_NEVER))
    assert local != base  # the adapter changes the answer
    other = prompt(100, salt=2)  # uncached on both workers
    local_other, _ = asyncio.run(generate(d.address, other, "sql", mode=pb.DISAGGREGATION_MODE_NEVER))
    d_fresh = prompt(100, salt=3)
    ref_fresh, _ = asyncio.run(generate(d.address, d_fresh, "sql", mode=pb.DISAGGREGATION_MODE_NEVER))
    # now through the prefill worker, which loads "sql" from the folder the decode worker names
    remote, last = asyncio.run(generate(d.address, other, "sql", [p.address]))
    assert last.prefill_worker == p.address and remote == local_other
    assert "sql" in {a.name for a in asyncio.run(load_report(p.address, "sql")).adapters}
    # the prefill worker's cache holds sql's blocks, never served to a base request
    remote_base, last_base = asyncio.run(generate(d.address, other, "", [p.address]))
    assert last_base.prefill_worker == p.address and last_base.usage.cached_tokens == 0
    assert remote_base == asyncio.run(generate(d.address, other, mode=pb.DISAGGREGATION_MODE_NEVER))[0]
    assert ref_fresh == asyncio.run(generate(d.address, d_fresh, "sql", [p.address]))[0]


def test_prefill_worker_that_cannot_load_the_adapter_falls_back_to_local(lora_pair):
    d, p, folder = lora_pair
    gone = write_adapter(folder / "gone", r=4, seed=9)
    info = asyncio.run(call(d.address, "LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name="gone", lora_path=gone)))
    assert info.name == "gone" and len(info.digest) == 32
    shutil.rmtree(gone)  # the decode worker keeps it in memory; the prefill worker cannot read it
    tokens = prompt(80, salt=4)
    assert_prefilled_locally(d, p, tokens, "gone")


def test_same_adapter_name_with_other_weights_is_a_layout_mismatch_and_falls_back(lora_pair):
    """The prefill worker holds "twin" from one folder, the decode worker "twin" from another
    (other weights) that the prefill worker cannot read: the KV layout's adapter digest differs,
    the prefill is refused with a layout error naming it, and the decode worker prefills locally."""
    d, p, folder = lora_pair
    theirs = write_adapter(folder / "twin-p", r=8, seed=11)
    mine = write_adapter(folder / "twin-d", r=8, seed=12)
    p_info = asyncio.run(
        call(p.address, "LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name="twin", lora_path=theirs))
    )
    d_info = asyncio.run(
        call(d.address, "LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name="twin", lora_path=mine))
    )
    assert p_info.digest != d_info.digest
    shutil.rmtree(mine)
    tokens = prompt(80, salt=6)
    assert_prefilled_locally(d, p, tokens, "twin")
    assert (
        f"lora_digest: expected '{p_info.digest.hex()}', got '{d_info.digest.hex()}'" in d.log()
        and "could not be loaded here" in d.log()
    ), d.log()[-3000:]
    # the prefill worker kept its own "twin"
    held = {a.name: a.digest for a in asyncio.run(load_report(p.address, "twin")).adapters}
    assert held["twin"] == p_info.digest


def test_adapters_in_load_reports_metrics_and_unload(lora_pair):
    d, _, folder = lora_pair
    report = asyncio.run(load_report(d.address, "sql"))
    assert "sql" in {a.name for a in report.adapters} and report.max_loras == 2
    assert all(len(a.digest) == 32 for a in report.adapters)
    text = d.get("/metrics")[1].decode()
    assert 'vllm:lora_requests_info{max_lora="2"' in text
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(generate(d.address, prompt(20), "nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    bad = folder / "bad"
    bad.mkdir()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call(d.address, "LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name="bad", lora_path=str(bad))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json" in err.value.details()
    # two more adapters on a worker that holds 2 in memory (--max-loras 2, no --max-cpu-loras):
    # the least recently used, sql, leaves the resident set but stays known; a request for it
    # reads it again and it is resident once more (what the router's lora-affinity scores)
    temp = write_adapter(folder / "temp", seed=11)
    temp2 = write_adapter(folder / "temp2", seed=12)
    asyncio.run(call(d.address, "LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name="temp", lora_path=temp)))
    asyncio.run(call(d.address, "LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name="temp2", lora_path=temp2)))
    report = asyncio.run(load_report(d.address, "temp2"))
    assert list(report.resident_lora_adapters) == ["temp", "temp2"]
    assert {"sql", "temp", "temp2"} <= {a.name for a in report.adapters}
    asyncio.run(generate(d.address, prompt(20), "sql"))
    report = asyncio.run(load_report(d.address, "sql", resident=True))
    assert list(report.resident_lora_adapters) == ["sql", "temp2"]
    # the router's hint: sql is held elsewhere too, so reading temp back evicts sql, not the
    # least recently used temp2 that only this worker holds
    assert d.metric("splitserve_lora_adapter_hinted_evictions_total") == 0
    asyncio.run(generate(d.address, prompt(20), "temp", evict_first=["sql", "not-here"]))
    report = asyncio.run(load_report(d.address, "temp", resident=True))
    assert sorted(report.resident_lora_adapters) == ["temp", "temp2"]
    assert d.metric("splitserve_lora_adapter_hinted_evictions_total") == 1
    asyncio.run(call(d.address, "UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name="temp2")))
    asyncio.run(call(d.address, "UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name="temp")))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call(d.address, "UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name="temp")))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_evicted_adapter_is_read_again_while_other_streams_keep_decoding(tmp_path):
    modules = ("q_proj", "k_proj", "v_proj", "down_proj")
    a = write_adapter(tmp_path / "a", alpha=64, modules=modules, seed=21)
    b = write_adapter(tmp_path / "b", alpha=64, modules=modules, seed=22)
    # one adapter in memory: b, read last at start, evicted a; reading a again takes 2 s more
    w = WorkerProc(
        "both",
        "tcp",
        "--lora-modules",
        f"a={a}",
        f"b={b}",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "1",
        env={"SPLITSERVE_FAULT_ADAPTER_READ_S": "2"},
    ).start()
    try:
        asyncio.run(evicted_read_beside_a_stream(w.address))
        assert w.metric("splitserve_lora_adapter_reads_total") == 1  # a, once; then from memory
        assert w.metric("splitserve_lora_adapter_read_seconds_total") >= 2.0
    finally:
        w.terminate()


async def evicted_read_beside_a_stream(address):
    arrivals: list[float] = []

    async def base_stream():
        async with worker_channel(address) as channel:
            request = pb.GenerateRequest(
                request_id="base",
                prompt_token_ids=prompt(20),
                params=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True),
            )
            async for msg in pb_grpc.WorkerStub(channel).Generate(request):
                arrivals.extend([time.monotonic()] * len(msg.token_ids))

    stream = asyncio.create_task(base_stream())
    while len(arrivals) < 3:
        await asyncio.sleep(0.01)
    sent = time.monotonic()
    out, last = await generate(address, prompt(30, salt=4), "a")
    took = time.monotonic() - sent
    stream.cancel()
    assert took >= 2.0  # a was read again (the injected 2 s), not served from memory
    during_read = sum(1 for t in arrivals if sent + 0.3 < t < sent + 1.8)
    assert during_read >= 5, f"the base stream got {during_read} tokens during the adapter's read"
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(out) == 8
    again, _ = await generate(address, prompt(30, salt=4), "a")  # in memory now
    assert again == out
    base, _ = await generate(address, prompt(30, salt=4))
    assert base != out  # the adapter was applied
