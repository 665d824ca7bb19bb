"""The KV receiver's connection handling against a peer that holds the service's secret but
misbehaves, and against unauthenticated sockets, over real TCP in one process
(workers/transfer/receiver.py): an "end" for a transfer bound on another connection, a payload
before any "open", a connection left idle after the handshake, and a flood of connections that
never answer the challenge; on a receiver that offers its cache over CUDA IPC (the reference
backend, cuda_ipc.LocalIpcBackend), IPC writes announced before an "open" or for another
connection's transfer, and the handle exchange out of turn. Each misbehaving connection is
closed; honest transfers still work."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from splitserve.workers.transfer import KVLayout, auth, cuda_ipc, make_receiver, make_sender
from splitserve.workers.transfer.stream import ChannelClosed
from splitserve.workers.transfer.tcp import TcpSender

LAYOUT = KVLayout("smollm2-135m", "float32", block_size=16, num_layers=2, num_kv_heads=3, head_dim=64)
KEY = auth.derive_key(b"service-secret-0123456789abcdef")
TID = "req-1/0123456789ab"


async def authenticated(receiver):
    """A raw channel that completed the handshake as an honest sender would; (channel, session key)."""
    channel = await TcpSender()._connect(receiver.address.removeprefix("tcp://"))
    nr = (await channel.recv())["nonce"]
    ns = "cd" * 16
    await channel.send({"op": "auth", "nonce": ns, "mac": auth.proof(KEY, "sender", nr, ns, receiver.address)})
    assert (await channel.recv())["type"] == "auth_ok"
    return channel, auth._mac(KEY, "session", nr, ns, receiver.address)


async def is_closed_by_receiver(channel, timeout_s: float = 10.0) -> bool:
    try:
        await asyncio.wait_for(channel.recv(), timeout_s)
    except ChannelClosed:
        return True
    except TimeoutError:
        return False
    return False


def layer_payload() -> list:
    return [torch.ones(LAYOUT.layer_payload_shape(1)).reshape(-1).view(torch.uint8).numpy()]


def test_an_end_for_another_connections_transfer_is_refused():
    """Connection A opens the transfer and sends layer 0; authenticated connection B sends an
    aborting "end" for it. B is closed, A's transfer is untouched and completes."""

    async def main():
        receiver = make_receiver("tcp", auth_key=KEY)
        await receiver.start()
        receiver.expect(TID, LAYOUT, 1, lambda *a: None, 30)
        a, a_key = await authenticated(receiver)
        await a.send(
            {
                "op": "open",
                "transfer_id": TID,
                "layout": LAYOUT.to_dict(),
                "num_blocks": 1,
                "tag": auth.transfer_tag(a_key, TID),
            }
        )
        await a.send(
            {"op": "layers", "transfer_id": TID, "layers": [0], "nbytes": layer_payload()[0].nbytes}, layer_payload()
        )
        b, _ = await authenticated(receiver)
        await b.send({"op": "end", "transfer_id": TID, "aborted": True})
        b_closed = await is_closed_by_receiver(b)
        state_after_b = receiver.poll(TID).state.name
        await a.send(
            {"op": "layers", "transfer_id": TID, "layers": [1], "nbytes": layer_payload()[0].nbytes}, layer_payload()
        )
        await a.send({"op": "end", "transfer_id": TID, "aborted": False})
        final = await asyncio.wait_for(a.recv(), 10)
        for channel in (a, b):
            await channel.close()
        await receiver.close()
        return b_closed, state_after_b, final

    b_closed, state_after_b, final = asyncio.run(main())
    assert b_closed and state_after_b == "RECEIVING"
    assert final["type"] == "final" and final["ok"] and final["state"] == "DONE"


def test_no_payload_is_read_before_an_open():
    """A "layers" header announcing 1 GiB on a connection that opened nothing closes it at once."""

    async def main():
        receiver = make_receiver("tcp", auth_key=KEY)
        await receiver.start()
        channel, _ = await authenticated(receiver)
        await channel.send({"op": "layers", "transfer_id": TID, "layers": [0], "nbytes": 1 << 30})
        closed = await is_closed_by_receiver(channel, timeout_s=5)
        await channel.close()
        await receiver.close()
        return closed

    assert asyncio.run(main())


def test_an_idle_connection_is_closed_and_the_sender_reconnects():
    async def main():
        receiver = make_receiver("tcp", auth_key=KEY, idle_timeout_s=0.5)
        await receiver.start()
        idle, _ = await authenticated(receiver)
        idle_closed = await is_closed_by_receiver(idle, timeout_s=10)
        await idle.close()
        sender = make_sender("tcp", auth_key=KEY)
        states = []
        for i in range(2):  # the pooled connection of the first goes idle and is closed before the second
            tid = f"req-{i}/0123456789ab"
            receiver.expect(tid, LAYOUT, 1, lambda *a: None, 30)
            handle = await sender.open(receiver.address, tid, LAYOUT, 1)
            for layer in range(LAYOUT.num_layers):
                await handle.send_layer(layer, torch.ones(LAYOUT.layer_payload_shape(1)))
            await handle.finish()
            states.append((await receiver.wait(tid)).state.name)
            await asyncio.sleep(1.5)
        connects = sender.num_connects
        await sender.close()
        await receiver.close()
        return idle_closed, states, connects

    idle_closed, states, connects = asyncio.run(main())
    assert idle_closed and states == ["DONE", "DONE"] and connects == 2


def test_connections_waiting_for_the_handshake_are_capped():
    """12 sockets that never answer the challenge: 4 get a challenge and wait, 8 are closed on
    arrival. Once the waiting ones go, an honest sender is served."""

    async def main():
        receiver = make_receiver("tcp", auth_key=KEY, max_pending_handshakes=4)
        await receiver.start()
        host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
        sockets = [await asyncio.open_connection(host, int(port)) for _ in range(12)]
        outcomes = []
        for reader, _ in sockets:
            data = await asyncio.wait_for(reader.read(4), 5)  # a challenge's length prefix, or EOF
            outcomes.append("challenged" if data else "closed")
        pending = receiver.num_pending_handshakes
        for _, writer in sockets:
            writer.close()
        for _ in range(100):
            if receiver.num_pending_handshakes == 0:
                break
            await asyncio.sleep(0.02)
        receiver.expect(TID, LAYOUT, 1, lambda *a: None, 30)
        sender = make_sender("tcp", auth_key=KEY)
        handle = await sender.open(receiver.address, TID, LAYOUT, 1)
        for layer in range(LAYOUT.num_layers):
            await handle.send_layer(layer, torch.ones(LAYOUT.layer_payload_shape(1)))
        await handle.finish()
        state = (await receiver.wait(TID)).state.name
        await sender.close()
        await receiver.close()
        return outcomes, pending, receiver.num_refused_connections, state

    outcomes, pending, refused, state = asyncio.run(main())
    assert sorted(outcomes) == ["challenged"] * 4 + ["closed"] * 8
    assert pending == 4 and refused == 8 and state == "DONE"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(idle_timeout_s=0), "idle_timeout_s must be a positive number of seconds"),
        (dict(max_pending_handshakes=0), "max_pending_handshakes must be a positive integer"),
    ],
)
def test_receiver_limits_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_receiver("tcp", auth_key=KEY, **kwargs)


def test_the_wire_format_is_unchanged_for_honest_peers():
    """An honest sender's full transfer is still a single open, layers and end on one connection."""
    seen = []

    async def main():
        receiver = make_receiver("tcp", auth_key=KEY)
        await receiver.start()
        receiver.expect(TID, LAYOUT, 1, lambda layer, *a: seen.append(layer), 30)
        sender = make_sender("tcp", auth_key=KEY)
        handle = await sender.open(receiver.address, TID, LAYOUT, 1)
        for layer in range(LAYOUT.num_layers):
            await handle.send_layer(layer, torch.ones(LAYOUT.layer_payload_shape(1)))
        await handle.finish()
        status = await receiver.wait(TID)
        await sender.close()
        await receiver.close()
        return status.state.name, json.dumps(sorted(seen))

    assert asyncio.run(main()) == ("DONE", "[0, 1]")


def ipc_caches(num_blocks: int = 4) -> list:
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]


async def ipc_hello(channel) -> dict:
    await channel.send(cuda_ipc.hello())
    return await asyncio.wait_for(channel.recv(), 10)


def test_ipc_writes_count_only_for_the_connections_own_open_transfer():
    """On a receiver offering its cache over CUDA IPC: C announces IPC writes before any "open",
    B (which got the offer too) announces writes for the transfer A opened; both are closed and
    A's transfer has no layer counted. A then announces its own writes and completes."""

    async def main():
        receiver = make_receiver("tcp", auth_key=KEY)
        receiver.ipc = (ipc_caches(), cuda_ipc.LocalIpcBackend())
        await receiver.start()
        receiver.expect(TID, LAYOUT, 1, lambda *a: None, 30, block_ids=[3])
        written = {"op": "ipc_layers", "transfer_id": TID, "layers": [0, 1], "first_block": 0, "num_blocks": 1}
        c, _ = await authenticated(receiver)
        c_offer = (await ipc_hello(c))["type"]
        await c.send(written)
        c_closed = await is_closed_by_receiver(c)
        a, a_key = await authenticated(receiver)
        a_offer = (await ipc_hello(a))["type"]
        await a.send(
            {
                "op": "open",
                "transfer_id": TID,
                "layout": LAYOUT.to_dict(),
                "num_blocks": 1,
                "tag": auth.transfer_tag(a_key, TID),
                "ipc": True,
            }
        )
        ready = await asyncio.wait_for(a.recv(), 10)
        b, _ = await authenticated(receiver)
        b_offer = (await ipc_hello(b))["type"]
        await b.send(written)
        b_closed = await is_closed_by_receiver(b)
        bytes_after_b = receiver.poll(TID).num_bytes
        state_after_b = receiver.poll(TID).state.name
        await a.send(written)
        await a.send({"op": "end", "transfer_id": TID, "aborted": False})
        final = await asyncio.wait_for(a.recv(), 10)
        for channel in (a, b, c):
            await channel.close()
        await receiver.close()
        return (c_offer, a_offer, b_offer), c_closed, ready, b_closed, (state_after_b, bytes_after_b), final

    offers, c_closed, ready, b_closed, after_b, final = asyncio.run(main())
    assert offers == ("ipc_offer",) * 3
    assert c_closed and b_closed
    assert ready == {"transfer_id": TID, "type": "ipc_ready", "block_ids": [3]}
    assert after_b == ("RECEIVING", 0)
    assert final["type"] == "final" and final["ok"] and final["state"] == "DONE"


@pytest.mark.parametrize("when", ["twice", "after an open"])
def test_the_ipc_handle_exchange_comes_once_before_the_first_open(when):
    async def main():
        receiver = make_receiver("tcp", auth_key=KEY)
        receiver.ipc = (ipc_caches(), cuda_ipc.LocalIpcBackend())
        await receiver.start()
        receiver.expect(TID, LAYOUT, 1, lambda *a: None, 30, block_ids=[1])
        channel, key = await authenticated(receiver)
        if when == "twice":
            first = (await ipc_hello(channel))["type"]
        else:
            await channel.send(
                {
                    "op": "open",
                    "transfer_id": TID,
                    "layout": LAYOUT.to_dict(),
                    "num_blocks": 1,
                    "tag": auth.transfer_tag(key, TID),
                }
            )
            first = "opened"
        await channel.send(cuda_ipc.hello())
        closed = await is_closed_by_receiver(channel)
        await channel.close()
        await receiver.close()
        return first, closed

    first, closed = asyncio.run(main())
    assert first in ("ipc_offer", "opened") and closed


def test_an_unauthenticated_receiver_declines_to_hand_out_its_cache():
    """Without --kv-secret-file there is no session key: the cache's handles never leave."""

    async def main():
        receiver = make_receiver("tcp")
        receiver.ipc = (ipc_caches(), cuda_ipc.LocalIpcBackend())
        await receiver.start()
        channel = await TcpSender()._connect(receiver.address.removeprefix("tcp://"))
        reply = await ipc_hello(channel)
        await channel.close()
        await receiver.close()
        return reply

    reply = asyncio.run(main())
    assert reply["type"] == "ipc_declined" and "not authenticated" in reply["reason"] and "tensors" not in reply
