"""The quarantine of an aborted CUDA IPC transfer's blocks (workers/transfer/quarantine.py,
workers/decode.py), checked on a CPU with the reference IPC backend (cuda_ipc.LocalIpcBackend).

A CUDA IPC sender writes the decode worker's blocks itself, so a copy under way at an abort can
still land. The receiver holds such a transfer's blocks back until the sender's "end", or its
connection's close plus a grace period (it hangs up on a sender that sends neither), and the
decode worker keeps them out of every other request meanwhile. First the receiver's three ways out
of a quarantine, against a raw peer over real TCP; then the whole decode path: a real prefill
worker service over gRPC, the decode worker's RemotePrefill and a real engine with a pool so small
that the next request needs the quarantined blocks.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from test_kv_transfer_hardening import KEY, LAYOUT, TID, authenticated, ipc_caches, ipc_hello, is_closed_by_receiver

from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.workers.config import WorkerConfig
from splitserve.workers.decode import RemotePrefill
from splitserve.workers.events import EventHub
from splitserve.workers.main import kv_layout
from splitserve.workers.servicer import WorkerService
from splitserve.workers.transfer import auth, cuda_ipc, make_receiver, make_sender

GRACE_S = 1.0
SLACK_S = 0.02  # asyncio may run a timer up to its clock resolution early


def ipc_open(session_key: bytes) -> dict:
    return {
        "op": "open",
        "transfer_id": TID,
        "layout": LAYOUT.to_dict(),
        "num_blocks": 1,
        "tag": auth.transfer_tag(session_key, TID),
        "ipc": True,
    }


@pytest.mark.parametrize("way_out", ["end", "close", "silence"])
def test_an_aborted_ipc_transfer_is_quarantined_until_its_sender_is_done(way_out):
    """The decode worker aborts a transfer whose blocks went to an IPC sender and releases it:
    the blocks stay quarantined until the sender's "end" (at once), its connection's close plus
    the grace period, or, when it neither ends nor closes, the receiver's hang-up after the grace
    period plus the grace period again. A transfer that went as bytes is never quarantined."""

    async def main():
        loop = asyncio.get_running_loop()
        receiver = make_receiver("tcp", auth_key=KEY, quarantine_grace_s=GRACE_S)
        receiver.ipc = (ipc_caches(), cuda_ipc.LocalIpcBackend())
        await receiver.start()
        receiver.expect("bytes", LAYOUT, 1, lambda *a: None, 30)  # no block ids: never an IPC write
        receiver.abort("bytes")
        bytes_quarantine = receiver.quarantine("bytes")
        receiver.expect(TID, LAYOUT, 1, lambda *a: None, 30, block_ids=[2])
        channel, key = await authenticated(receiver)
        await ipc_hello(channel)
        await channel.send(ipc_open(key))
        ready = await asyncio.wait_for(channel.recv(), 10)
        t0 = loop.time()
        receiver.abort(TID)
        failed = await asyncio.wait_for(channel.recv(), 10)  # the sender is told at once
        lifted = receiver.quarantine(TID)
        receiver.release(TID)
        held_after_release = lifted is not None and not lifted.is_set()
        hung_up = None
        if way_out == "end":
            await channel.send({"op": "end", "transfer_id": TID, "aborted": True})
            await asyncio.wait_for(channel.recv(), 10)  # the final reply: lifted before it was sent
            is_lifted_at_end = lifted.is_set()
        else:
            if way_out == "close":
                t0 = loop.time()
                await channel.close()
            else:
                hung_up = await is_closed_by_receiver(channel, timeout_s=30)
            is_lifted_at_end = lifted.is_set()
            await asyncio.wait_for(lifted.wait(), 30)
        elapsed = loop.time() - t0
        left = receiver.num_quarantined
        await channel.close()
        await receiver.close()
        return bytes_quarantine, ready, failed, held_after_release, hung_up, is_lifted_at_end, elapsed, left

    bytes_quarantine, ready, failed, held, hung_up, is_lifted_at_end, elapsed, left = asyncio.run(main())
    assert bytes_quarantine is None
    assert ready["block_ids"] == [2] and failed["type"] == "failed" and failed["state"] == "ABORTED"
    assert held and left == 0
    if way_out == "end":
        assert is_lifted_at_end
    elif way_out == "close":
        assert not is_lifted_at_end and elapsed >= GRACE_S - SLACK_S
    else:
        assert hung_up and not is_lifted_at_end and elapsed >= 2 * GRACE_S - SLACK_S


def test_the_grace_period_is_validated():
    with pytest.raises(ValueError, match="grace_s must be a positive number"):
        make_receiver("inproc", quarantine_grace_s=0)


# -- the decode path: a real prefill worker over gRPC, the decode engine's block pool ---------------
async def prefill_worker(engine: AsyncEngine, sender, layout) -> tuple[grpc.aio.Server, str]:
    """The real prefill service on a loopback port (the worker binary's servicer)."""
    info = pb.WorkerInfo(worker_id="p", role="prefill", model_id=layout.model_id)
    service = WorkerService(
        WorkerConfig(role="prefill"),
        engine,
        EventHub(asyncio.get_running_loop(), info),
        None,
        sender,
        layout,
        None,
    )
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_cancelled_ipc_transfers_blocks_go_to_no_request_until_the_sender_ends(make_engine, monkeypatch):
    """The prefill worker's IPC copy of layer 3 hangs; the client cancels the decode request. Its
    3 destination blocks stay held (the pool of 8 shows 5 free), so the next request, which needs
    7 blocks, waits instead of getting them. Once the copy completes the prefill worker ends the
    transfer: the blocks are freed, that request runs and answers as a fresh engine does, and every
    block is free again."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [(i * 7919) % 40000 + 100 for i in range(40)]  # 3 blocks of 16
    big = [(i * 104729) % 40000 + 100 for i in range(100)]  # 7 blocks with its 4 new tokens
    [ref] = make_engine().generate([big], greedy)
    d_llm, p_llm = make_engine(num_blocks=8, max_model_len=128), make_engine()
    gate, stuck = threading.Event(), threading.Event()
    real_write = cuda_ipc.BlockWriter.write

    def hanging_write(self, layer, block_ids, data):
        if layer == 3:
            stuck.set()
            assert gate.wait(60)
        return real_write(self, layer, block_ids, data)

    monkeypatch.setattr(cuda_ipc.BlockWriter, "write", hanging_write)

    async def main():
        backend, layout = cuda_ipc.LocalIpcBackend(), kv_layout(d_llm)
        d, p = AsyncEngine(d_llm), AsyncEngine(p_llm)
        receiver = make_receiver("inproc", auth_key=KEY, ipc=(d_llm.kv_connector.kv_caches, backend))
        await receiver.start()
        sender = make_sender("inproc", auth_key=KEY, ipc_backend=backend)
        server, address = await prefill_worker(p, sender, layout)
        remote = RemotePrefill(d, receiver, layout, deadline_s=60)
        held = []

        async def decode_request():  # what the decode worker's Generate does with a remote prefill
            async for out in d.generate(params=greedy, prompt_token_ids=prompt, req_id="r", remote_prefill=True):
                if out.kv_ready is not None:
                    held.append(out.kv_ready.block_ids[out.kv_ready.start_block :])
                    await remote.run("r", prompt, greedy, out.kv_ready, [address])

        try:
            task = asyncio.ensure_future(decode_request())
            assert await asyncio.to_thread(stuck.wait, 60)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(200):  # the request's own abort comes when its generator is closed
                if not await d.call(lambda e: e.kv.block_ids("r")):
                    break
                await asyncio.sleep(0.05)
            num_free_quarantined = await d.call(lambda e: e.pool.num_free_blocks)
            quarantined = receiver.num_quarantined
            stream = d.generate(params=greedy, prompt_token_ids=big, req_id="n")
            first = asyncio.ensure_future(anext(stream))
            for _ in range(3):  # steps run between these calls: the request is scheduled if it can be
                blocks_while_held = await d.call(lambda e: e.kv.block_ids("n"))
            gate.set()
            out = await asyncio.wait_for(first, 60)
            while not out.finished:
                out = await asyncio.wait_for(anext(stream), 60)
            num_free_after = await d.call(lambda e: (e.kv.check_invariants(), e.pool.num_free_blocks)[1])
            return held, num_free_quarantined, quarantined, blocks_while_held, out, num_free_after, receiver
        finally:
            gate.set()
            await server.stop(None)
            await remote.stubs.close()
            await sender.close()
            await receiver.close()
            d.shutdown()
            p.shutdown()

    held, num_free_quarantined, quarantined, blocks_while_held, out, num_free_after, receiver = asyncio.run(main())
    assert len(held) == 1 and len(held[0]) == 3
    assert quarantined == 1 and num_free_quarantined == 8 - 3
    assert blocks_while_held == []  # 7 blocks needed, 5 free: it waits rather than take the held ones
    assert out.output_token_ids == ref.output_token_ids
    assert num_free_after == 8 and receiver.num_quarantined == 0
