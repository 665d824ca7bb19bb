"""Same-node KV over CUDA IPC (workers/transfer/cuda_ipc.py), checked on a CPU.

What runs here is the real protocol over the inproc transport with the real KV handshake:
the choice `--kv-transport auto` makes, the offer of the decode worker's cache handles once
per connection, its authentication by the session key, the writes straight into the
destination blocks with no payload on the wire, and every fallback to bytes. Only the
handles themselves are the reference backend's (`LocalIpcBackend`: keys into this process'
registry), since a CPU has no cudaIpc; the device check (bench/gpu_check.sh) runs the CUDA
backend between two processes on one GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.sampling.params import SamplingParams
from splitserve.workers.transfer import KVLayout, TransferError, TransferState, cuda_ipc, make_receiver, make_sender
from splitserve.workers.transfer.auth import derive_key

KEY = derive_key(b"a-service-secret-for-the-ipc-tests")
LAYOUT = KVLayout("m", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# -- the choice ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "requested, has_cuda, has_auth, wire, ipc, why",
    [
        ("auto", False, True, "tcp", False, "not on a CUDA device"),
        ("auto", True, False, "tcp", False, "no --kv-secret-file"),
        ("auto", True, True, "tcp", True, "CUDA IPC to decode workers on this node"),
        ("tcp", True, True, "tcp", False, "--kv-transport tcp"),
        ("ucx", False, False, "ucx", False, "--kv-transport ucx"),
    ],
)
def test_auto_chooses_tcp_on_a_cpu_and_cuda_ipc_on_a_gpu_with_auth(requested, has_cuda, has_auth, wire, ipc, why):
    choice = cuda_ipc.choose_path(requested, has_cuda, has_auth)
    assert (choice.wire, choice.ipc) == (wire, ipc) and why in choice.reason


# -- the offer and its authentication -------------------------------------------------------------
def caches(num_blocks=6, layout=LAYOUT):
    return [
        (
            torch.zeros(num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim),
            torch.zeros(num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim),
        )
        for _ in range(layout.num_layers)
    ]


def test_an_offer_maps_the_decode_cache_and_only_for_its_session():
    backend, kv = cuda_ipc.LocalIpcBackend(), caches()
    offer = cuda_ipc.offer(kv, backend, hello=cuda_ipc.hello(), session_key=b"s" * 32)
    mapped = cuda_ipc.open_offer(offer, b"s" * 32, backend, LAYOUT)
    assert all(m is t for pair, mine in zip(mapped, kv, strict=True) for m, t in zip(pair, mine, strict=True))
    with pytest.raises(cuda_ipc.IpcUnavailable, match="tag does not match"):  # another session's key
        cuda_ipc.open_offer(offer, b"t" * 32, backend, LAYOUT)
    forged = {**offer, "tensors": list(reversed(offer["tensors"]))}  # altered on the way
    with pytest.raises(cuda_ipc.IpcUnavailable, match="tag does not match"):
        cuda_ipc.open_offer(forged, b"s" * 32, backend, LAYOUT)
    other = KVLayout("m", "float32", block_size=4, num_layers=3, num_kv_heads=1, head_dim=8)
    with pytest.raises(cuda_ipc.IpcUnavailable, match="does not match the layout"):
        cuda_ipc.open_offer(offer, b"s" * 32, backend, other)


def test_the_decode_worker_declines_without_auth_from_another_node_or_version():
    kv, backend = caches(), cuda_ipc.LocalIpcBackend()
    assert "not authenticated" in cuda_ipc.offer(kv, backend, hello=cuda_ipc.hello(), session_key=None)["reason"]
    remote = {**cuda_ipc.hello(), "node": "another-host/boot"}
    assert "another node" in cuda_ipc.offer(kv, backend, hello=remote, session_key=b"k" * 32)["reason"]
    old = {**cuda_ipc.hello(), "version": 0}
    assert "version" in cuda_ipc.offer(kv, backend, hello=old, session_key=b"k" * 32)["reason"]
    declined = {"type": "ipc_declined", "reason": "no"}
    with pytest.raises(cuda_ipc.IpcUnavailable, match="declined: no"):
        cuda_ipc.open_offer(declined, b"k" * 32, backend, LAYOUT)


# -- transfers over the protocol --------------------------------------------------------------------
def payload(value: float, num_blocks: int, layout=LAYOUT) -> torch.Tensor:
    return torch.full(layout.layer_payload_shape(num_blocks), float(value))


async def transfer(
    kv,
    backend: cuda_ipc.LocalIpcBackend,
    *,
    offer_ipc=True,
    try_ipc=True,
    block_ids=(1, 4, 2),
    give_block_ids=True,
    sender_key=KEY,
    kind="inproc",
):
    """One transfer of len(block_ids) blocks, two layers in two pieces each; returns what the
    receiver's write_layer got, the status, the handle's path and the sender's fallback reasons."""
    receiver = make_receiver(kind, auth_key=KEY)
    await receiver.start()
    receiver.identity = receiver.address
    if offer_ipc:
        receiver.ipc = (kv, backend)
    written = []
    receiver.expect(
        "t",
        LAYOUT,
        len(block_ids),
        lambda layer, p, first: written.append((layer, first, p.shape[1])),
        10.0,
        block_ids=list(block_ids) if give_block_ids else None,
    )
    sender = make_sender(kind, auth_key=sender_key)
    if try_ipc:
        sender.ipc_backend = backend
    try:
        handle = await sender.open(receiver.address, "t", LAYOUT, len(block_ids))
        for layer in range(2):
            await handle.send_layer(layer, payload(10 * layer + 1, 1), 0)
            await handle.send_layer(layer, payload(10 * layer + 2, len(block_ids) - 1), 1)
        error = None
        try:
            await handle.finish()
        except TransferError as exc:
            error = str(exc)
        status = await receiver.wait("t")
        return written, status, handle.path, sender.ipc_fallbacks, error
    finally:
        receiver.release("t")
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_kv_goes_straight_into_the_destination_blocks_with_no_payload(kind):
    kv, backend = caches(), cuda_ipc.LocalIpcBackend()
    written, status, path, fallbacks, error = asyncio.run(transfer(kv, backend, kind=kind))
    assert error is None and status.state is TransferState.DONE and path == "cuda_ipc" and fallbacks == []
    assert written == []  # nothing came through write_layer: no bytes
    assert status.num_bytes == 2 * LAYOUT.layer_payload_nbytes(3)
    for layer in range(2):
        for value, blocks in ((10 * layer + 1, [1]), (10 * layer + 2, [4, 2])):
            for b in blocks:
                assert torch.all(kv[layer][0][b] == value) and torch.all(kv[layer][1][b] == value)
        for b in (0, 3, 5):  # blocks of no one else were touched
            assert torch.all(kv[layer][0][b] == 0)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("handles do not open", "do not open here"),
        ("gpu not reachable", "not visible to this process"),
        ("receiver offers nothing", "does not offer CUDA IPC"),
        ("no auth", "not authenticated"),
    ],
)
def test_any_ipc_failure_falls_back_to_bytes_and_the_transfer_completes(case, reason):
    kv, backend = caches(), cuda_ipc.LocalIpcBackend()
    sender_backend = backend
    if case == "handles do not open":
        backend.fail_open = True
    if case == "gpu not reachable":
        sender_backend = cuda_ipc.LocalIpcBackend(reachable=False)

    async def go():
        if case == "no auth":  # a receiver and sender without a secret: no offer is ever made
            receiver = make_receiver("inproc")
            await receiver.start()
            receiver.ipc = (kv, backend)
            written = []
            receiver.expect("t", LAYOUT, 1, lambda layer, p, first: written.append(layer), 10.0, block_ids=[0])
            sender = make_sender("inproc")
            sender.ipc_backend = backend
            handle = await sender.open(receiver.address, "t", LAYOUT, 1)
            for layer in range(2):
                await handle.send_layer(layer, payload(1, 1), 0)
            await handle.finish()
            status = await receiver.wait("t")
            receiver.release("t")
            await sender.close()
            await receiver.close()
            return written, status, handle.path, sender.ipc_fallbacks, None
        return await transfer(
            kv,
            sender_backend if case != "receiver offers nothing" else backend,
            offer_ipc=case != "receiver offers nothing",
        )

    written, status, path, fallbacks, error = asyncio.run(go())
    assert error is None and status.state is TransferState.DONE and path == "inproc"
    assert written and any(reason in f for f in fallbacks), fallbacks
    assert all(torch.all(t == 0) for pair in kv for t in pair)  # nothing was written through a mapping


def test_a_transfer_without_destination_blocks_goes_as_bytes_on_an_ipc_connection():
    kv, backend = caches(), cuda_ipc.LocalIpcBackend()
    written, status, path, fallbacks, error = asyncio.run(transfer(kv, backend, give_block_ids=False))
    assert error is None and status.state is TransferState.DONE and path == "inproc" and fallbacks == []
    assert sorted(written) == [(0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2)]


# -- a failed IPC copy fails the transfer, and the decode engine answers by itself --------------------
def test_a_failing_ipc_copy_leaves_the_request_answered_correctly_and_no_block_held(make_engine, monkeypatch):
    p_engine, d_engine, local = make_engine(), make_engine(), make_engine()
    layout = KVLayout("smollm2-135m", "float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    prompt = [(i * 7919) % 40000 + 100 for i in range(40)]
    [ref] = local.generate([prompt], GREEDY)
    free_before = d_engine.pool.num_free_blocks
    d_engine.add_request(params=GREEDY, prompt_token_ids=prompt, req_id="r", remote_prefill=True)
    [ready] = [o.kv_ready for o in d_engine.step() if o.kv_ready is not None]
    pieces = []
    p_engine.add_request(
        params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        prompt_token_ids=prompt,
        req_id="p",
        kv_export=KVExport(ready.start_block, lambda *a: pieces.append(a), on_device=True),
    )
    while p_engine.has_work():
        p_engine.step()
    backend = cuda_ipc.LocalIpcBackend()
    calls = []

    def failing_write(self, layer, block_ids, data):
        calls.append(layer)
        if layer == 7:
            raise RuntimeError("an injected CUDA error in the IPC copy")
        return real_write(self, layer, block_ids, data)

    real_write = cuda_ipc.BlockWriter.write
    monkeypatch.setattr(cuda_ipc.BlockWriter, "write", failing_write)

    async def go():
        receiver = make_receiver("inproc", auth_key=KEY)
        await receiver.start()
        receiver.ipc = (d_engine.kv_connector.kv_caches, backend)
        dst = list(ready.block_ids[ready.start_block :])
        receiver.expect("t", layout, len(dst), lambda *a: None, 10.0, block_ids=dst)
        sender = make_sender("inproc", auth_key=KEY)
        sender.ipc_backend = backend
        handle = await sender.open(receiver.address, "t", layout, len(dst))
        for layer, staged, first in pieces:
            await handle.send_layer(layer, staged.tensor, first)
        with pytest.raises(TransferError):
            await handle.finish()
        status = await receiver.wait("t")
        receiver.release("t")
        await sender.close()
        await receiver.close()
        return status

    status = asyncio.run(go())
    assert status.state is TransferState.FAILED and calls[-1] == 7
    d_engine.fallback_to_local_prefill("r")  # what the decode worker does after a failed transfer
    outs = []
    while d_engine.has_work():
        outs += d_engine.step()
    assert outs[-1].finished and outs[-1].output_token_ids == ref.output_token_ids
    d_engine.kv.check_invariants()
    assert d_engine.kv.num_requests == 0 and d_engine.pool.num_free_blocks == free_before


def test_an_offer_too_large_for_one_header_falls_back_to_bytes():
    """126 layers with handles the size of CUDA's (~400 bytes a tensor): the offer would not fit
    the 64 KiB header, so the decode worker declines it and the transfer goes as bytes."""
    big = KVLayout("m", "float32", block_size=4, num_layers=126, num_kv_heads=1, head_dim=8)
    kv, backend = caches(num_blocks=2, layout=big), cuda_ipc.LocalIpcBackend(handle_bytes=400)
    declined = cuda_ipc.offer(kv, backend, hello=cuda_ipc.hello(), session_key=KEY)
    assert declined["type"] == "ipc_declined" and "more than one KV header holds" in declined["reason"]
    small = cuda_ipc.offer(caches(), backend, hello=cuda_ipc.hello(), session_key=KEY)
    assert small["type"] == "ipc_offer"  # two layers of the same handles fit

    async def go():
        receiver = make_receiver("inproc", auth_key=KEY)
        await receiver.start()
        receiver.ipc = (kv, backend)
        written = []
        receiver.expect("t", big, 1, lambda layer, p, first: written.append(layer), 10.0, block_ids=[1])
        sender = make_sender("inproc", auth_key=KEY)
        sender.ipc_backend = backend
        try:
            handle = await sender.open(receiver.address, "t", big, 1)
            for layer in range(big.num_layers):
                await handle.send_layer(layer, payload(layer, 1, big), 0)
            await handle.finish()
            return written, await receiver.wait("t"), handle.path, sender.ipc_fallbacks
        finally:
            receiver.release("t")
            await sender.close()
            await receiver.close()

    written, status, path, fallbacks = asyncio.run(go())
    assert status.state is TransferState.DONE and path == "inproc" and sorted(written) == list(range(126))
    assert any("more than one KV header holds" in f for f in fallbacks), fallbacks
    assert all(torch.all(t == 0) for pair in kv for t in pair)  # nothing went through a mapping


def test_after_the_receiver_aborts_no_layer_is_written_through_the_mapping():
    """The decode worker aborts a transfer after layer 0 landed and hands block 1 to its next
    request; the sender's later layers do not reach that block (CPU reference backend)."""
    kv, backend = caches(), cuda_ipc.LocalIpcBackend()

    async def go():
        receiver = make_receiver("inproc", auth_key=KEY)
        await receiver.start()
        receiver.ipc = (kv, backend)
        receiver.expect("t", LAYOUT, 1, lambda *a: None, 10.0, block_ids=[1])
        sender = make_sender("inproc", auth_key=KEY)
        sender.ipc_backend = backend
        try:
            handle = await sender.open(receiver.address, "t", LAYOUT, 1)
            await handle.send_layer(0, payload(5, 1), 0)
            for _ in range(200):
                if receiver.poll("t").num_layers_done == 1:
                    break
                await asyncio.sleep(0.01)
            assert handle.path == "cuda_ipc" and torch.all(kv[0][0][1] == 5)
            receiver.abort("t")
            kv[1][0][1].fill_(-1.0)  # the next request's KV in the freed block
            for _ in range(200):
                if handle.error is not None:
                    break
                await asyncio.sleep(0.01)
            await handle.send_layer(1, payload(7, 1), 0)
            with pytest.raises(TransferError):
                await handle.finish()
        finally:
            receiver.release("t")
            await sender.close()
            await receiver.close()

    asyncio.run(go())
    assert torch.all(kv[1][0][1] == -1.0) and torch.all(kv[1][1][1] == 0)  # layer 1 never written
