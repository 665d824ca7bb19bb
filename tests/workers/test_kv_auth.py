"""KV-transfer authentication (workers/transfer/auth.py) with real `splitserve worker` processes,
over TCP and UCX, with mTLS on their gRPC APIs as everywhere in the suite (an intruder below holds
a valid client certificate but another service's KV secret): prefill and decode workers sharing a
secret file serve disaggregated requests;
a peer with a wrong token, or none, is refused before any header is acted on, logged, counted
in `splitserve_kv_auth_failures_total`, and the decode worker keeps serving."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_worker_disaggregation import generate, prompt
from workerproc import WorkerProc

from splitserve.workers.transfer import KVLayout, make_sender
from splitserve.workers.transfer.auth import answer, derive_key, transfer_tag
from splitserve.workers.transfer.stream import ChannelClosed

SECRET = b"service-secret-0123456789abcdef"
LAYOUT = KVLayout("smollm2-135m", "float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def pair(request, tmp_path_factory):
    secret = tmp_path_factory.mktemp("kv") / "secret"
    secret.write_bytes(SECRET + b"\n")
    d = WorkerProc("decode", request.param, "--kv-secret-file", str(secret)).start()
    p = WorkerProc("prefill", request.param, "--kv-secret-file", str(secret)).start()
    yield request.param, d, p
    for w in (d, p):
        w.terminate()


async def _knock(kind: str, port: int, key: bytes | None) -> dict | None:
    """Connect to a receiver, answer its challenge with `key` (None: skip the handshake), ask
    for an unknown transfer; the reply, or None when the receiver closed the connection."""
    sender = make_sender(kind)
    channel = await sender._connect(f"127.0.0.1:{port}")
    try:
        header = {"op": "open", "transfer_id": "not-a-pending-id", "layout": LAYOUT.to_dict(), "num_blocks": 1}
        if key is not None:
            session_key = await answer(channel, key, f"{kind}://127.0.0.1:{port}")
            header["tag"] = transfer_tag(session_key, header["transfer_id"])
        await channel.send(header)
        while True:
            msg = await asyncio.wait_for(channel.recv(), 30)
            if msg.get("type") != "challenge":
                return msg
    except ChannelClosed:
        return None
    finally:
        await channel.close()


def test_wrong_or_missing_token_is_refused_and_the_worker_keeps_serving(pair, loop):
    kind, d, p = pair
    assert d.metric("splitserve_kv_auth_enabled") == 1 and d.metric("splitserve_grpc_tls_enabled") == 1
    before = d.metric("splitserve_kv_auth_failures_total")
    assert loop.run_until_complete(_knock(kind, d.kv_port, derive_key(b"another-service-secret-000"))) is None
    assert loop.run_until_complete(_knock(kind, d.kv_port, None)) is None
    assert d.metric("splitserve_kv_auth_failures_total") - before == 2
    deadline = time.monotonic() + 30  # the log line reaches us through the process's stdout pipe
    while "rejected a KV transfer connection: wrong KV-transfer proof" not in d.log():
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.05)
    # The right token gets through the handshake: the receiver answers the (unknown) transfer.
    reply = loop.run_until_complete(_knock(kind, d.kv_port, derive_key(SECRET)))
    assert reply is not None and reply["type"] == "failed"
    assert d.metric("splitserve_kv_auth_failures_total") - before == 2
    # ... and the decode worker still takes KV from its own prefill worker.
    tokens, last = loop.run_until_complete(generate(d.address, prompt(40, salt=7), [p.address]))
    assert len(tokens) == 8 and last.prefill_worker == p.address
    assert d.proc.poll() is None


def test_a_prefill_worker_of_another_service_cannot_push(pair, loop, tmp_path):
    kind, d, _ = pair
    other_secret = tmp_path / "other"
    other_secret.write_bytes(b"a-different-service-secret-42")
    intruder = WorkerProc("prefill", kind, "--kv-secret-file", str(other_secret)).start()
    try:
        before = d.metric("splitserve_kv_auth_failures_total")
        tokens, last = loop.run_until_complete(generate(d.address, prompt(40, salt=8), [intruder.address]))
        # The decode worker refused the intruder's blocks and prefilled locally instead.
        assert len(tokens) == 8 and last.prefill_worker != intruder.address
        assert d.metric("splitserve_kv_auth_failures_total") - before >= 1
    finally:
        intruder.terminate()


def test_a_worker_started_by_hand_without_a_secret_says_so_in_its_log_and_metrics():
    w = WorkerProc("decode", "tcp", secure=False).start()
    try:
        assert w.metric("splitserve_kv_auth_enabled") == 0 and w.metric("splitserve_grpc_tls_enabled") == 0
        log = w.log()
        assert (
            f"INSECURE: no --kv-secret-file: this decode worker accepts KV blocks from anyone who can reach port "
            f"{w.kv_port}" in log
        )
        assert "INSECURE: no --tls-cert/--tls-key/--tls-ca" in log
    finally:
        w.terminate()
