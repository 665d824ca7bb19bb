"""KV staging (engine/kv_staging.py): the ordering of export and import copies, checked on a CPU.

On CUDA the copies run on a side stream and complete later; here a `DeferredCopyStream` plays
that device: what is submitted runs only when a consumer waits for its marker (the sender's
thread) or when the compute stream is ordered after it (the engine's next step). So a missing
wait or a missing ordering shows up as wrong KV — wrong tokens — exactly as it would on a GPU.
The buffer pool is the real one, with unpinned memory.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.engine.kv_staging import (
    MIN_BUFFER_BYTES,
    DoneReady,
    HostBufferPool,
    Ready,
    SyncCopyStream,
    size_class,
)
from splitserve.platform.sampling.params import SamplingParams
from splitserve.workers.transfer import KVLayout, make_receiver, make_sender

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class FlagReady(Ready):
    def __init__(self, stream: DeferredCopyStream, index: int):
        self.stream, self.index = stream, index

    def is_ready(self) -> bool:
        return self.stream.num_done > self.index

    def wait(self) -> None:
        self.stream.run_until(self.index + 1)


class DeferredCopyStream:
    """A side stream whose copies run in order, only when waited for or ordered before compute."""

    def __init__(self, orders_compute: bool = True):
        self.fns: list = []
        self.num_done = 0
        self.num_orderings = 0
        self.orders_compute = orders_compute  # False: a broken engine that forgets to wait

    def submit(self, fn, keep=()) -> Ready:
        self.fns.append(fn)
        return FlagReady(self, len(self.fns) - 1)

    def run_until(self, n: int) -> None:
        while self.num_done < n:
            self.fns[self.num_done]()
            self.num_done += 1

    def order_compute_after(self) -> None:
        self.num_orderings += 1
        if self.orders_compute:
            self.run_until(len(self.fns))

    @property
    def num_pending(self) -> int:
        return len(self.fns) - self.num_done


def staged(engine, orders_compute: bool = True):
    """Give the engine's connector a deferred stream and an unpinned pool, as CUDA would have."""
    stream, pool = DeferredCopyStream(orders_compute), HostBufferPool(pin=False)
    engine.kv_connector.copy_stream, engine.kv_connector.host_pool = stream, pool
    return stream, pool


# -- the pool ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes, size",
    [
        (1, MIN_BUFFER_BYTES),
        (MIN_BUFFER_BYTES, MIN_BUFFER_BYTES),
        (MIN_BUFFER_BYTES + 1, MIN_BUFFER_BYTES + MIN_BUFFER_BYTES // 8),
        (16_777_216, 16_777_216),
        (16_777_217, 18_874_368),
        (33_554_432 - 1, 33_554_432),
    ],
)
def test_size_class_rounds_up_within_an_eighth(nbytes, size):
    assert size_class(nbytes) == size
    assert nbytes <= size_class(nbytes) <= max(MIN_BUFFER_BYTES, nbytes * 1.125)


def test_a_released_buffer_is_lent_again_only_once_its_copy_completed():
    pool, stream = HostBufferPool(pin=False), DeferredCopyStream()
    a = pool.acquire(3 << 20)
    ready = stream.submit(lambda: None)
    pool.release(a, ready)
    b = pool.acquire(3 << 20)  # a's copy is still in flight: a new buffer
    assert b.data_ptr() != a.data_ptr() and pool.num_allocated == 2
    stream.run_until(1)
    pool.release(b)
    reused = {pool.acquire(3 << 20).data_ptr(), pool.acquire((3 << 20) - 5).data_ptr()}  # same size class
    assert reused == {a.data_ptr(), b.data_ptr()} and pool.num_allocated == 2 and pool.num_lent == 2


def test_the_pool_keeps_at_most_max_idle_bytes_and_validates():
    pool = HostBufferPool(pin=False, max_idle_bytes=MIN_BUFFER_BYTES)
    a, b = pool.acquire(10), pool.acquire(10)
    pool.release(a)
    pool.release(b)  # beyond the bound: dropped
    assert pool.idle_bytes == MIN_BUFFER_BYTES and pool.num_lent == 0
    with pytest.raises(ValueError, match="positive size"):
        pool.acquire(0)
    with pytest.raises(ValueError, match="max_idle_bytes must be >= 0"):
        HostBufferPool(pin=False, max_idle_bytes=-1)


def test_the_cpu_stream_copies_at_once():
    done = []
    ready = SyncCopyStream().submit(lambda: done.append(1))
    assert done == [1] and isinstance(ready, DoneReady) and ready.is_ready()


# -- export and import through the engines ------------------------------------------------------
def run_pd(p_engine, d_engine, prompt, req_id="r"):
    """D allocates; P exports; the "sender" waits on each marker, copies the payload out of its
    pooled buffer (as the wire does) and releases it; D writes, completes and decodes."""
    d_engine.add_request(params=GREEDY, prompt_token_ids=prompt, req_id=req_id, remote_prefill=True)
    [ready] = [o.kv_ready for o in d_engine.step() if o.kv_ready is not None]
    received = []

    def sink(layer, staged_payload, first_block):  # the engine thread: must not wait
        assert not staged_payload.ready.is_ready(), "the export copy ran on the engine thread"
        received.append((layer, staged_payload, first_block))

    p_engine.add_request(
        params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        prompt_token_ids=prompt,
        req_id=req_id + "-p",
        kv_export=KVExport(ready.start_block, sink),
    )
    p_outs = []
    while p_engine.has_work():
        p_outs += p_engine.step()
    [p_out] = [o for o in p_outs if o.finished]
    for layer, staged_payload, first_block in received:  # the sender's thread
        staged_payload.ready.wait()
        dst = ready.block_ids[ready.start_block + first_block :][: staged_payload.num_blocks]
        d_engine.write_kv_layer(dst, layer, staged_payload.tensor.clone())
        staged_payload.release()
    out = d_engine.complete_remote_prefill(req_id, p_out.new_token_ids[0])
    outs = [out]
    while d_engine.has_work():
        outs += d_engine.step()
    return outs[-1], received


def test_staged_export_and_import_give_the_colocated_tokens_and_return_every_buffer(make_engine):
    p_engine, d_engine, local = make_engine(), make_engine(), make_engine()
    p_stream, p_pool = staged(p_engine)
    d_stream, d_pool = staged(d_engine)
    prompt = [(i * 7919) % 40000 + 100 for i in range(70)]
    [ref] = local.generate([prompt], GREEDY)
    final, received = run_pd(p_engine, d_engine, prompt)
    assert final.finished and final.output_token_ids == ref.output_token_ids
    assert len(received) == 30 and p_pool.num_lent == 0 and d_pool.num_lent == 0
    assert d_stream.num_pending == 0 and d_stream.num_orderings >= 1  # D's steps waited for the imports
    # a second request of another length reuses the buffers: no new allocation on either side
    allocated = (p_pool.num_allocated, d_pool.num_allocated)
    final, _ = run_pd(p_engine, d_engine, [(i * 31) % 40000 + 100 for i in range(60)], req_id="r2")
    assert final.finished and (p_pool.num_allocated, d_pool.num_allocated) == allocated


def test_a_decode_step_not_ordered_after_the_imports_reads_missing_kv(make_engine):
    """The check above can fail: if the engine's step did not wait for the import copies, the
    first decode step would read blocks that were never written."""
    p_engine, d_engine, local = make_engine(), make_engine(), make_engine()
    staged(p_engine)
    staged(d_engine, orders_compute=False)
    prompt = [(i * 7919) % 40000 + 100 for i in range(70)]
    [ref] = local.generate([prompt], GREEDY)
    final, _ = run_pd(p_engine, d_engine, prompt)
    assert final.output_token_ids != ref.output_token_ids


# -- the sender releases buffers once the transport is done with them ------------------------------
LAYOUT = KVLayout("m", "float32", block_size=16, num_layers=2, num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("ending", ["finish", "abort"])
def test_on_sent_runs_once_per_payload_after_the_final_reply_or_an_abort(ending):
    async def go():
        receiver = make_receiver("inproc")
        await receiver.start()
        receiver.expect("t", LAYOUT, 1, lambda layer, payload, first: None, 10.0)
        sender = make_sender("inproc")
        handle = await sender.open(receiver.address, "t", LAYOUT, 1)
        calls = []
        for layer in range(2 if ending == "finish" else 1):
            await handle.send_layer(layer, torch.zeros(LAYOUT.layer_payload_shape(1)), on_sent=lambda: calls.append(1))
        before = len(calls)
        await (handle.finish() if ending == "finish" else handle.abort())
        status = await receiver.wait("t")
        receiver.release("t")
        await sender.close()
        await receiver.close()
        return before, len(calls), status.state.name

    before, after, state = asyncio.run(go())
    assert before == 0  # nothing is released while the transport may still read it
    assert after == (2 if ending == "finish" else 1)
    assert state == ("DONE" if ending == "finish" else "FAILED")
