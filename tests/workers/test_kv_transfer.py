"""KV transfer across processes (issue 3): the ucx, tcp and inproc transports end to end.

For ucx and tcp the receiver runs in a separate process on 127.0.0.1, driven over a pipe, and
the sender runs in the test's event loop; inproc runs both in the test process. UCX runs over
its TCP transport here (UCX_TLS=tcp,self, set by configure_ucx_env).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
from ports import free_port

from splitserve.workers.transfer import (
    KVLayout,
    LayoutMismatchError,
    TransferError,
    TransferState,
    UnknownTransferError,
    make_receiver,
    make_sender,
)

LAYOUT = KVLayout("smollm2-135m", "float32", block_size=16, num_layers=4, num_kv_heads=3, head_dim=64)
NUM_BLOCKS = 7
KINDS = ["inproc", "tcp", "ucx"]


def make_payloads(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = layout.layer_payload_shape(num_blocks)
    return [torch.randn(shape, generator=g).to(layout.torch_dtype) for _ in range(layout.num_layers)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# -- the receiver side, in another process (or in this one for inproc) --------------------------
def _append(layers: dict, layer: int, first: int, t: torch.Tensor) -> None:
    """Assemble a layer from its pieces (the receiver hands them over in block order)."""
    have = layers.get(layer)
    assert first == (0 if have is None else have.shape[1]), (layer, first)
    layers[layer] = t.clone() if have is None else torch.cat((have, t), dim=1)


async def _serve_commands(kind: str, conn) -> None:
    receiver = make_receiver(kind, "127.0.0.1", 0)
    await receiver.start()
    received: dict[str, dict[int, torch.Tensor]] = {}
    loop = asyncio.get_running_loop()

    async def handle(cmd: str, *args):
        if cmd == "expect":
            tid, layout, num_blocks, deadline_s = args
            received[tid] = {}
            receiver.expect(
                tid,
                KVLayout.from_dict(layout),
                num_blocks,
                lambda layer, t, first: _append(received[tid], layer, first, t),
                deadline_s,
            )
        elif cmd == "wait":
            t0 = time.monotonic()
            status = await receiver.wait(args[0])
            return status, time.monotonic() - t0
        elif cmd == "poll":
            return receiver.poll(args[0])
        elif cmd == "abort":
            receiver.abort(args[0])
        elif cmd == "release":
            receiver.release(args[0])
            received.pop(args[0], None)
        elif cmd == "received":
            return received[args[0]]
        elif cmd == "num_transfers":
            return receiver.num_transfers

    conn.send(receiver.address)
    while (msg := await loop.run_in_executor(None, conn.recv))[0] != "stop":
        try:
            conn.send(("ok", await handle(*msg)))
        except Exception as e:
            conn.send(("err", repr(e)))
    await receiver.close()
    conn.send(("ok", None))


def _peer_main(kind: str, conn) -> None:
    asyncio.run(_serve_commands(kind, conn))


def _processes():
    """Children forked from a fork server that imported torch and this module once: a fresh
    interpreter per child (no UCX or event loop state inherited) without re-importing torch."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "splitserve.workers.transfer", __name__])
    return ctx


class Remote:
    """The receiver's commands as coroutines, so the sender in the test's loop keeps running."""

    def __init__(self, kind: str, loop: asyncio.AbstractEventLoop):
        self.kind = kind
        self.conn, child = mp.Pipe()
        self._lock = threading.Lock()
        if kind == "inproc":  # same protocol, served by a task in the test's own loop
            self.proc = None
            self._task = loop.create_task(_serve_commands(kind, child))
            self.address = loop.run_until_complete(loop.run_in_executor(None, self._recv, 30))
        else:
            self.proc = _processes().Process(target=_peer_main, args=(kind, child), daemon=True)
            self.proc.start()
            self.address = self._recv(60)

    def _recv(self, timeout: float):
        assert self.conn.poll(timeout), "the receiver did not answer"
        return self.conn.recv()

    def _call(self, *msg):
        with self._lock:
            self.conn.send(msg)
            status, value = self._recv(30)
        if status == "err":
            raise RuntimeError(value)
        return value

    async def __call__(self, *msg):
        return await asyncio.get_running_loop().run_in_executor(None, self._call, *msg)

    def stop(self, loop) -> None:
        loop.run_until_complete(self("stop"))
        if self.proc is not None:
            self.proc.join(10)


@pytest.fixture(scope="module", params=KINDS)
def remote(request, loop):
    r = Remote(request.param, loop)
    yield r
    r.stop(loop)


@pytest.fixture
def run(loop):
    return lambda coro: loop.run_until_complete(asyncio.wait_for(coro, 30))


async def send_all(sender, remote, tid, payloads, layout=LAYOUT, num_blocks=NUM_BLOCKS):
    handle = await sender.open(remote.address, tid, layout, num_blocks)
    for layer, p in enumerate(payloads):
        await handle.send_layer(layer, p)
    await handle.finish()
    return handle


async def until(predicate, timeout_s=5.0):
    t0 = time.monotonic()
    while not await predicate():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_arrive_bit_identical(remote, run, dtype):
    layout = KVLayout(**{**LAYOUT.to_dict(), "dtype": dtype})
    payloads = make_payloads(layout, NUM_BLOCKS, seed=1)
    layer_bytes = 2 * NUM_BLOCKS * 16 * 3 * 64 * (4 if dtype == "float32" else 2)

    async def go():
        sender = make_sender(remote.kind)
        await remote("expect", "rt", layout.to_dict(), NUM_BLOCKS, 10.0)
        handle = await send_all(sender, remote, "rt", payloads, layout)
        status, _ = await remote("wait", "rt")
        received = await remote("received", "rt")
        await remote("release", "rt")
        await sender.close()
        return handle, status, received, await remote("num_transfers")

    handle, status, received, num_transfers = run(go())
    assert (status.state, status.num_layers_done, status.num_bytes, status.error) == (
        TransferState.DONE,
        4,
        4 * layer_bytes,
        None,
    )
    assert handle.bytes_sent == 4 * layer_bytes and handle.error is None
    assert sorted(received) == [0, 1, 2, 3]
    for layer, p in enumerate(payloads):
        assert received[layer].dtype == p.dtype and received[layer].shape == p.shape
        assert torch.equal(bits(received[layer]), bits(p))
    assert num_transfers == 0


def test_layers_in_pieces_arrive_bit_identical(remote, run):
    """Chunked prefill sends each layer in pieces (here blocks 0-2, then 3-6), every layer's
    first piece before any second one; the receiver assembles the same bytes."""
    payloads = make_payloads(LAYOUT, NUM_BLOCKS, seed=2)

    async def go():
        sender = make_sender(remote.kind)
        await remote("expect", "pc", LAYOUT.to_dict(), NUM_BLOCKS, 10.0)
        handle = await sender.open(remote.address, "pc", LAYOUT, NUM_BLOCKS)
        for first, end in ((0, 3), (3, NUM_BLOCKS)):
            for layer, p in enumerate(payloads):
                await handle.send_layer(layer, p[:, first:end].contiguous(), first)
        await handle.finish()
        status, _ = await remote("wait", "pc")
        received = await remote("received", "pc")
        await remote("release", "pc")
        await sender.close()
        return status, received

    status, received = run(go())
    assert (status.state, status.num_layers_done) == (TransferState.DONE, 4)
    for layer, p in enumerate(payloads):
        assert torch.equal(bits(received[layer]), bits(p))


def test_layout_mismatch_is_rejected_with_both_values(remote, run):
    theirs = KVLayout(**{**LAYOUT.to_dict(), "block_size": 32, "head_dim": 128})

    async def go():
        sender = make_sender(remote.kind)
        await remote("expect", "mm", LAYOUT.to_dict(), NUM_BLOCKS, 10.0)
        with pytest.raises(LayoutMismatchError) as err:
            await send_all(sender, remote, "mm", make_payloads(theirs, NUM_BLOCKS, seed=2), theirs)
        status = await remote("poll", "mm")
        received = await remote("received", "mm")
        await remote("release", "mm")
        with pytest.raises(RuntimeError, match="unknown transfer id 'mm'"):
            await remote("poll", "mm")
        after = await remote("num_transfers")
        # The connection is in step after a rejection: the next transfer reuses it.
        await remote("expect", "ok", LAYOUT.to_dict(), NUM_BLOCKS, 10.0)
        await send_all(sender, remote, "ok", make_payloads(LAYOUT, NUM_BLOCKS, seed=3))
        ok_status, _ = await remote("wait", "ok")
        await remote("release", "ok")
        num_connects = sender.num_connects
        await sender.close()
        return err.value, status, received, after, ok_status, num_connects

    err, status, received, after, ok_status, num_connects = run(go())
    expected = "KV layout mismatch: block_size: expected 16, got 32; head_dim: expected 64, got 128"
    assert str(err) == f"receiver rejected 'mm': {expected}"
    assert err.mismatches == {"block_size": (16, 32), "head_dim": (64, 128)}
    assert (status.state, status.num_layers_done, status.num_bytes) == (TransferState.FAILED, 0, 0)
    assert status.error == f"receiver rejected 'mm': {expected}"
    assert received == {}
    assert after == 0
    assert ok_status.state is TransferState.DONE and num_connects == 1


def test_released_transfer_is_forgotten(remote, run):
    async def go():
        await remote("expect", "gone", LAYOUT.to_dict(), NUM_BLOCKS, 10.0)
        await remote("release", "gone")
        with pytest.raises(RuntimeError, match="KeyError.*unknown transfer id 'gone'"):
            await remote("poll", "gone")
        return await remote("num_transfers")

    assert run(go()) == 0


def test_deadline_without_sender_times_out(remote, run):
    async def go():
        await remote("expect", "late", LAYOUT.to_dict(), NUM_BLOCKS, 0.5)
        status, elapsed = await remote("wait", "late")
        sender = make_sender(remote.kind)  # a sender arriving after the deadline is told so
        with pytest.raises(TransferError) as err:
            await send_all(sender, remote, "late", make_payloads(LAYOUT, NUM_BLOCKS, seed=4))
        await remote("release", "late")
        await sender.close()
        return status, elapsed, err.value

    status, elapsed, err = run(go())
    message = "transfer not complete within its deadline of 0.5 s (0 of 4 layers landed)"
    assert (status.state, status.num_layers_done, status.error) == (TransferState.TIMED_OUT, 0, message)
    assert elapsed < 0.5 + 0.5  # measured from wait(), which started after expect()
    assert str(err) == message


def test_abort_on_receiver_mid_transfer(remote, run):
    payloads = make_payloads(LAYOUT, NUM_BLOCKS, seed=5)

    async def go():
        sender = make_sender(remote.kind)
        await remote("expect", "ab", LAYOUT.to_dict(), NUM_BLOCKS, 10.0)
        handle = await sender.open(remote.address, "ab", LAYOUT, NUM_BLOCKS)
        await handle.send_layer(0, payloads[0])
        await until(lambda: _layers_done(remote, "ab", 1))
        await remote("abort", "ab")
        await until(lambda: _is_set(handle))  # the receiver told the sender at once
        early = handle.error
        for layer in (1, 2, 3):
            await handle.send_layer(layer, payloads[layer])  # dropped: the transfer is dead
        with pytest.raises(TransferError) as err:
            await handle.finish()
        status, _ = await remote("wait", "ab")
        await remote("release", "ab")
        await sender.close()
        return early, err.value, handle.bytes_sent, status, await remote("num_transfers")

    early, err, bytes_sent, status, num_transfers = run(go())
    assert str(early) == str(err) == "transfer aborted by the receiver"
    assert bytes_sent == LAYOUT.layer_payload_nbytes(NUM_BLOCKS)
    assert (status.state, status.num_layers_done) == (TransferState.ABORTED, 1)
    assert num_transfers == 0


async def _layers_done(remote, tid, n):
    return (await remote("poll", tid)).num_layers_done == n


async def _is_set(handle):
    return handle.error is not None


def test_unknown_transfer_id(remote, run):
    async def go():
        sender = make_sender(remote.kind)
        with pytest.raises(TransferError) as err:
            await send_all(sender, remote, "never-expected", make_payloads(LAYOUT, NUM_BLOCKS, seed=6))
        await sender.close()
        return err.value, await remote("num_transfers")

    err, num_transfers = run(go())
    assert type(err) is UnknownTransferError
    assert str(err) == "unknown transfer id 'never-expected' (never expected by the receiver, or released)"
    assert num_transfers == 0


def test_three_interleaved_transfers(remote, run):
    sizes = {"c0": 7, "c1": 3, "c2": 5}
    payloads = {tid: make_payloads(LAYOUT, n, seed=10 + i) for i, (tid, n) in enumerate(sizes.items())}

    async def go():
        sender = make_sender(remote.kind)
        for tid, n in sizes.items():
            await remote("expect", tid, LAYOUT.to_dict(), n, 10.0)
        handles = {tid: await sender.open(remote.address, tid, LAYOUT, n) for tid, n in sizes.items()}
        for layer in range(4):  # c2 sends its layers in reverse order
            for tid, h in handles.items():
                send = 3 - layer if tid == "c2" else layer
                await h.send_layer(send, payloads[tid][send])
        await asyncio.gather(*(h.finish() for h in handles.values()))
        out = {tid: (await remote("wait", tid))[0] for tid in sizes}
        got = {tid: await remote("received", tid) for tid in sizes}
        for tid in sizes:
            await remote("release", tid)
        pooled = (sender.num_connects, sender.num_idle(remote.address))
        await remote("expect", "c3", LAYOUT.to_dict(), 7, 10.0)  # reuses a pooled connection
        await send_all(sender, remote, "c3", payloads["c0"])
        await remote("release", "c3")
        reused = sender.num_connects
        await sender.close()
        return out, got, pooled, reused, await remote("num_transfers")

    out, got, pooled, reused, num_transfers = run(go())
    for tid, n in sizes.items():
        assert (out[tid].state, out[tid].num_layers_done, out[tid].num_bytes) == (
            TransferState.DONE,
            4,
            4 * LAYOUT.layer_payload_nbytes(n),
        )
        for layer in range(4):
            assert torch.equal(bits(got[tid][layer]), bits(payloads[tid][layer]))
    assert pooled == (3, 3) and reused == 3
    assert num_transfers == 0


# -- a sender that dies mid-transfer --------------------------------------------------------
def _doomed_sender_main(kind: str, address: str, conn) -> None:
    async def go():
        sender = make_sender(kind)
        handle = await sender.open(address, "doomed", LAYOUT, NUM_BLOCKS)
        await handle.send_layer(0, make_payloads(LAYOUT, NUM_BLOCKS, seed=7)[0])
        while handle.bytes_sent == 0:
            await asyncio.sleep(0.005)
        conn.send("sent one layer")
        await asyncio.sleep(3600)  # SIGKILLed here

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
def test_sender_killed_mid_transfer_fails_the_transfer(kind, loop, run):
    remote = Remote(kind, loop)
    try:
        run(remote("expect", "doomed", LAYOUT.to_dict(), NUM_BLOCKS, 30.0))
        here, there = mp.Pipe()
        proc = _processes().Process(target=_doomed_sender_main, args=(kind, remote.address, there))
        proc.start()
        assert here.poll(60) and here.recv() == "sent one layer"
        run(until(lambda: _layers_done(remote, "doomed", 1)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        status, elapsed = run(remote("wait", "doomed"))
        run(remote("release", "doomed"))
        assert (status.state, status.num_layers_done) == (TransferState.FAILED, 1)
        assert status.error == "sender disconnected after 1 of 4 layers"
        assert elapsed < 3.0  # seen at once, long before the 30 s deadline
        assert run(remote("num_transfers")) == 0
    finally:
        remote.stop(loop)


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
def test_receiver_killed_mid_transfer_fails_finish(kind, loop, run):
    remote = Remote(kind, loop)
    payloads = make_payloads(LAYOUT, NUM_BLOCKS, seed=8)

    async def go():
        sender = make_sender(kind, ack_timeout_s=30.0)
        await remote("expect", "orphan", LAYOUT.to_dict(), NUM_BLOCKS, 30.0)
        handle = await sender.open(remote.address, "orphan", LAYOUT, NUM_BLOCKS)
        await handle.send_layer(0, payloads[0])
        await until(lambda: _layers_done(remote, "orphan", 1))
        os.kill(remote.proc.pid, signal.SIGKILL)
        remote.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            for layer in (1, 2, 3):
                await handle.send_layer(layer, payloads[layer])
            await handle.finish()
        elapsed = time.monotonic() - t0
        await sender.close()
        return err.value, elapsed, sender.num_idle(remote.address)

    err, elapsed, num_idle = run(go())
    assert str(err).startswith(f"connection to {remote.address} lost: ")
    assert elapsed < 3.0  # the lost connection is noticed, not the 30 s acknowledgement timeout
    assert num_idle == 0  # a broken connection is never pooled


@pytest.mark.parametrize("kind", KINDS)
def test_unreachable_receiver_fails_open(kind, run):
    address = "inproc://nobody" if kind == "inproc" else f"{kind}://127.0.0.1:{free_port()}"

    async def go():
        sender = make_sender(kind, connect_timeout_s=1.0) if kind != "inproc" else make_sender(kind)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=f"cannot connect to {address}") as err:
            await sender.open(address, "x", LAYOUT, NUM_BLOCKS)
        return time.monotonic() - t0, err

    elapsed, _ = run(go())
    assert elapsed < 3.0
