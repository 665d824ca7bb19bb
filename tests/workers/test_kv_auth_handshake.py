"""The KV-transfer handshake (workers/transfer/auth.py) against the attacks it is built for, over
real TCP connections in one process: a relaying rogue receiver, a rogue receiver that fakes the
receiver's proof, a replayed proof, and an "open" injected without the connection's tag. Each
attack is checked to fail where it should (the decode worker's receiver rejects and counts it;
the honest sender sends no block), and the honest path, through the same code, to work."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from splitserve.workers.transfer import KVLayout, TransferError, auth, make_receiver, make_sender
from splitserve.workers.transfer.stream import ChannelClosed

LAYOUT = KVLayout("smollm2-135m", "float32", block_size=16, num_layers=2, num_kv_heads=3, head_dim=64)
KEY = auth.derive_key(b"service-secret-0123456789abcdef")


class ByteRelay:
    """A rogue listener: every connection it accepts is piped, byte for byte both ways, to
    `target` (the real decode worker's KV port). The honest sender dials the relay."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.num_connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer):
        self.num_connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst):
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self):
        self.server.close()


async def decode_receiver():
    receiver = make_receiver("tcp", auth_key=KEY)
    await receiver.start()
    return receiver


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def transfer(sender, address, transfer_id="req-1/0123456789ab"):
    """One whole one-block transfer through `sender`; returns the handle after finish()."""
    handle = await sender.open(address, transfer_id, LAYOUT, 1)
    for layer in range(LAYOUT.num_layers):
        await handle.send_layer(layer, torch.ones(LAYOUT.layer_payload_shape(1)))
    await handle.finish()
    return handle


def test_the_honest_sender_authenticates_and_delivers():
    async def main():
        receiver = await decode_receiver()
        written = {}
        receiver.expect("req-1/0123456789ab", LAYOUT, 1, lambda i, t, first: written.__setitem__(i, t.clone()), 10)
        sender = make_sender("tcp", auth_key=KEY)
        await transfer(sender, receiver.address)
        status = await receiver.wait("req-1/0123456789ab")
        await sender.close()
        await receiver.close()
        return status, written, receiver.num_auth_failures

    status, written, failures = asyncio.run(main())
    assert status.state.name == "DONE" and sorted(written) == [0, 1] and failures == 0


def test_a_relaying_rogue_receiver_gets_the_honest_senders_proof_refused():
    """The rogue relays the whole handshake between an honest prefill worker (which dialed the
    rogue) and the real decode worker; the proof names the rogue's address, so the decode
    worker refuses it, and the honest sender, getting no receiver proof, sends nothing."""

    async def main():
        receiver = await decode_receiver()
        relay = ByteRelay(port_of(receiver.address))
        rogue_address = await relay.start()
        receiver.expect("req-1/0123456789ab", LAYOUT, 1, lambda *a: written.append(a[0]), 10)
        sender = make_sender("tcp", auth_key=KEY)
        with pytest.raises(TransferError, match=f"KV-transfer handshake with {rogue_address} failed"):
            await transfer(sender, rogue_address)
        for _ in range(100):
            if receiver.num_auth_failures:
                break
            await asyncio.sleep(0.02)
        receiver.abort("req-1/0123456789ab")
        await sender.close()
        await relay.close()
        await receiver.close()
        return relay.num_connections, receiver.num_auth_failures

    written: list[int] = []  # layers written; the callback records, the test asserts (a raise there is swallowed)
    assert asyncio.run(main()) == (1, 1)
    assert written == [], "a relayed block was written"


def test_a_rogue_receiver_without_the_secret_gets_no_blocks():
    """A listener on a decode worker's address that cannot prove it holds the secret: it replays
    the sender's own proof as its reply. The sender refuses before any "open" or block."""
    seen: list[dict] = []

    async def main():
        async def rogue(reader, writer):
            from splitserve.workers.transfer.stream import encode_header

            writer.write(encode_header({"type": "challenge", "nonce": "ab" * 16}))
            await writer.drain()
            n = int.from_bytes(await reader.readexactly(4), "little")
            import json

            msg = json.loads(await reader.readexactly(n))
            seen.append(msg)
            writer.write(encode_header({"type": "auth_ok", "mac": msg["mac"]}))
            await writer.drain()
            with contextlib.suppress(Exception):
                while data := await reader.read(65536):
                    seen.append({"bytes": len(data)})

        server = await asyncio.start_server(rogue, "127.0.0.1", 0)
        address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        sender = make_sender("tcp", auth_key=KEY)
        with pytest.raises(TransferError, match="could not prove it holds the service's secret"):
            await transfer(sender, address)
        await sender.close()
        await asyncio.sleep(0.1)
        server.close()

    asyncio.run(main())
    assert [m.get("op") for m in seen] == ["auth"]  # the handshake answer, then nothing


def test_a_replayed_proof_and_an_untagged_open_are_refused():
    """A proof recorded from one connection fails on the next (fresh nonces); a connection that
    completes the handshake cannot open a transfer without the session's tag."""
    from splitserve.workers.transfer.tcp import TcpSender

    async def main():
        receiver = await decode_receiver()
        sender = TcpSender()  # no key: we play the peer by hand
        channel = await sender._connect(receiver.address.removeprefix("tcp://"))
        challenge = await channel.recv()
        ns = "cd" * 16
        recorded = auth.proof(KEY, "sender", challenge["nonce"], ns, receiver.address)
        await channel.send({"op": "auth", "nonce": ns, "mac": recorded})
        assert (await channel.recv())["type"] == "auth_ok"
        receiver.expect("req-2/0123456789ab", LAYOUT, 1, lambda *a: written.append(a[0]), 10)
        await channel.send(
            {"op": "open", "transfer_id": "req-2/0123456789ab", "layout": LAYOUT.to_dict(), "num_blocks": 1}
        )
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(channel.recv(), 10)
        await channel.close()
        replay = await sender._connect(receiver.address.removeprefix("tcp://"))
        await replay.recv()  # a new challenge, with a new nonce
        await replay.send({"op": "auth", "nonce": ns, "mac": recorded})
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(replay.recv(), 10)
        await replay.close()
        receiver.abort("req-2/0123456789ab")
        await receiver.close()
        return receiver.num_auth_failures

    written: list[int] = []  # layers written; the callback records, the test asserts (a raise there is swallowed)
    assert asyncio.run(main()) == 2
    assert written == [], "an untagged open wrote a block"
