"""Disruption and bad input against worker processes: nothing lost, nothing leaked.

Faults are injected with the switches in workers/faults.py (environment variables read by
the worker process); everything else is real: gRPC, UCX/TCP, SIGKILL, SIGTERM.
"""

import asyncio
import signal
import time

import grpc
import pytest
from test_worker_disaggregation import generate, prompt, run
from workerproc import WorkerProc, worker_channel

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def decode():
    d = WorkerProc("decode", "ucx", "--transfer-deadline", str(DEADLINE_S)).start()
    yield d
    d.terminate()


@pytest.fixture(scope="module")
def prefill():
    """A plain prefill worker, shared by the tests that need one that works."""
    p = WorkerProc("prefill", "ucx").start()
    yield p
    p.terminate()


def assert_clean(*workers):
    for w in workers:
        state = w.wait_idle()
        assert state["invariants_ok"] and state["num_free_blocks"] == state["num_blocks"], state


def test_prefill_worker_killed_mid_transfer(decode, reference):
    p = WorkerProc("prefill", "ucx", env={"SPLITSERVE_FAULT_KILL_AFTER_LAYERS": "5"}).start()
    tokens, last = run(generate(decode.address, prompt(600, salt=1), [p.address]))
    assert p.proc.wait(10) == -signal.SIGKILL, "the fault switch should have killed the prefill worker"
    assert tokens == reference(prompt(600, salt=1))
    assert last.prefill_worker == ""  # fell back to local prefill
    assert decode.metric('splitserve_remote_prefills_total{outcome="failed"}') >= 1
    assert_clean(decode)


def test_prefill_worker_that_never_answers(decode, reference):
    p = WorkerProc("prefill", "ucx", env={"SPLITSERVE_FAULT_PREFILL_HANG": "1"}).start()
    try:
        t0 = time.monotonic()
        tokens, last = run(generate(decode.address, prompt(300, salt=2), [p.address]))
        elapsed = time.monotonic() - t0
        assert tokens == reference(prompt(300, salt=2))
        assert last.prefill_worker == ""
        assert DEADLINE_S <= elapsed < DEADLINE_S + 30  # deadline plus local prefill and decode
        assert_clean(decode)
    finally:
        p.kill()


def test_next_prefill_worker_is_tried_before_local(decode, prefill, reference):
    dead = "127.0.0.1:1"  # nothing listens there
    tokens, last = run(generate(decode.address, prompt(300, salt=3), [dead, prefill.address]))
    assert last.prefill_worker == prefill.address
    assert tokens == reference(prompt(300, salt=3))


@pytest.mark.parametrize(
    "flags, theirs", [(("--dtype", "bfloat16"), "bfloat16"), (("--kv-cache-dtype", "float32"), "float32")]
)
def test_layout_mismatch_is_a_clear_error_and_falls_back(decode, reference, flags, theirs):
    """A prefill worker whose KV cache holds another dtype (the decode worker's default is float16
    under --quantization auto) is refused with a message naming both, and the prompt is prefilled
    locally with the same answer."""
    bf16 = WorkerProc("prefill", "ucx", *flags).start()
    try:
        tokens, last = run(generate(decode.address, prompt(300, salt=4), [bf16.address]))
        assert last.prefill_worker == "" and tokens == reference(prompt(300, salt=4))
        assert "KV layout mismatch" in decode.log() and "dtype" in decode.log()

        async def direct():
            async with worker_channel(bf16.address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.WorkerStub(ch).Prefill(
                        pb.PrefillRequest(
                            request_id="x",
                            prompt_token_ids=[5, 6, 7],
                            transfer_id="t",
                            kv_address="tcp://127.0.0.1:1",
                            layout=pb.KVLayout(
                                model_id="smollm2-135m",
                                dtype="float16",
                                block_size=16,
                                num_layers=30,
                                num_kv_heads=3,
                                head_dim=64,
                            ),
                        )
                    )
                return err.value

        err = run(direct())
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype" in err.details() and "float16" in err.details() and theirs in err.details()
    finally:
        bf16.terminate()


@pytest.mark.parametrize(
    "request_kwargs, code, message",
    [
        (dict(request_id="", prompt_token_ids=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"),
        (dict(request_id="a", prompt_token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty"),
        (dict(request_id="b", prompt_token_ids=[1, 49152]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (
            dict(request_id="c", prompt_token_ids=[5] * 2048),
            grpc.StatusCode.INVALID_ARGUMENT,
            "the prompt has 2048 tokens but max_model_len is 2048",
        ),
        (
            dict(request_id="d", prompt_token_ids=[5], params=pb.SamplingParams(top_p=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p=0.0 is invalid",
        ),
        (
            dict(
                request_id="e",
                prompt_token_ids=[5],
                params=pb.SamplingParams(max_tokens=2),
                resume_output_token_ids=[6, 7],
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "2 resumed tokens leave nothing to generate under max_tokens=2",
        ),
    ],
)
def test_bad_generate_requests(decode, request_kwargs, code, message):
    async def call():
        async with worker_channel(decode.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(**request_kwargs)):
                    pass
            return err.value

    err = run(call())
    assert err.code() == code and message in err.details()
    tokens, _ = run(generate(decode.address, prompt(20), max_tokens=3))  # still serving
    assert len(tokens) == 3


def test_unknown_ids_are_not_found(decode, prefill):
    p = prefill
    info = run(first_event(decode.address)).info

    async def calls():
        async with worker_channel(p.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as prefill_err:
                await pb_grpc.WorkerStub(ch).Prefill(
                    pb.PrefillRequest(
                        request_id="x",
                        prompt_token_ids=[5, 6, 7],
                        transfer_id="no-such-transfer",
                        kv_address=info.kv_address,
                        layout=info.layout,
                        deadline_s=5,
                    )
                )
        async with worker_channel(decode.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as abort_err:
                await pb_grpc.WorkerStub(ch).Abort(pb.AbortRequest(request_id="no-such-request"))
        return prefill_err.value, abort_err.value

    prefill_err, abort_err = run(calls())
    assert prefill_err.code() == grpc.StatusCode.NOT_FOUND and "unknown transfer id" in prefill_err.details()
    assert abort_err.code() == grpc.StatusCode.NOT_FOUND and "no-such-request" in abort_err.details()
    assert_clean(decode, p)


async def first_event(address):
    async with worker_channel(address) as ch:
        async for msg in pb_grpc.WorkerStub(ch).WatchEvents(pb.WatchEventsRequest()):
            return msg


async def collect_events(address, seconds, stop: asyncio.Event | None = None):
    """WatchEvents messages until `stop` is set or `seconds` pass (load reports keep coming)."""
    out = []
    async with worker_channel(address) as ch:
        call = pb_grpc.WorkerStub(ch).WatchEvents(pb.WatchEventsRequest())
        try:
            async with asyncio.timeout(seconds):
                async for msg in call:
                    out.append(msg)
                    if stop is not None and stop.is_set():
                        break
        except TimeoutError:
            pass
        call.cancel()
    return out


def test_events_eviction_restart_and_graceful_drain():
    hasher = BlockHasher("smollm2-135m", 16)
    # A small pool (145 float16 blocks) so three 1,000-token prompts must evict.
    w = WorkerProc("both", "tcp", kv_cache_gib=0.05)
    w.start()

    try:
        events = run(events_during(w, [prompt(1000, salt=s) for s in (10, 11, 12)]))
        kinds = [m.WhichOneof("payload") for m in events]
        assert kinds[:2] == ["info", "kv"] and events[1].kv.WhichOneof("event") == "cleared"
        stored = [
            h
            for m in events
            if m.WhichOneof("payload") == "kv" and m.kv.WhichOneof("event") == "stored"
            for h in m.kv.stored.block_hashes
        ]
        removed = [
            h
            for m in events
            if m.WhichOneof("payload") == "kv" and m.kv.WhichOneof("event") == "removed"
            for h in m.kv.removed.block_hashes
        ]
        expected = hasher.hash_blocks(prompt(1000, salt=10))
        assert expected == stored[: len(expected)]  # the first prompt's 62 full blocks, in order
        assert set(removed) and set(removed) <= set(stored)
        assert any(m.WhichOneof("payload") == "load" for m in events)
        old_id = events[0].info.worker_id
        assert w.terminate() == 0
        w.start()
        events = run(collect_events(w.address, 2))
        assert events[0].info.worker_id != old_id
        assert events[1].kv.WhichOneof("event") == "cleared"
        run(drain_during_stream(w))
    finally:
        w.kill()


async def events_during(w, prompts):
    stop = asyncio.Event()
    watcher = asyncio.create_task(collect_events(w.address, 120, stop))
    await asyncio.sleep(0.5)
    for p in prompts:
        await generate(w.address, p, max_tokens=2)
    await asyncio.sleep(1.5)
    stop.set()
    return await watcher


async def drain_during_stream(w):
    async with worker_channel(w.address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        stream = stub.Generate(
            pb.GenerateRequest(
                request_id="long",
                prompt_token_ids=prompt(30),
                params=pb.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
            )
        )
        tokens, last = [], None
        async for msg in stream:
            tokens += msg.token_ids
            last = msg
            if len(tokens) == 5:
                w.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(pb.GenerateRequest(request_id="late", prompt_token_ids=[5, 6])):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
                assert w.get("/ready")[0] == 503
    assert len(tokens) == 200 and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert await asyncio.to_thread(w.proc.wait, 60) == 0
