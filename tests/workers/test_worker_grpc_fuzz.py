"""A protobuf fuzzer against a live worker process (role both, the real model, TCP KV transport):
random bytes, valid messages mutated (bit flips, truncation, spliced bytes), fields sent with the
wrong wire type, invalid UTF-8 in string fields, random well-formed messages with extreme
values, oversized messages, and streams cut mid-message (calls cancelled after the first token,
raw HTTP/2 connections closed mid-frame, inside TLS and as plaintext bytes sent to the TLS port)
on every RPC. The worker runs as tests/workerproc.py starts it, with mTLS on (the fuzzer holds the
test process' client certificate, so its messages reach the handlers). It must never crash, must answer
an undecodable request with INVALID_ARGUMENT (workers/grpc_guard.py), must still answer a normal
request correctly afterwards, and must hold no blocks or requests once the fuzzing stops."""

import asyncio
import random
import socket
import ssl
import time

import grpc
import pytest
from workerproc import WorkerProc, security

from splitserve.platform.wire import worker_pb2 as pb

pytestmark = pytest.mark.slow

SEED = 1717
SERVICE = "/splitserve.v1.Worker/"
STREAMING = {"Generate": True, "WatchEvents": True, "Prefill": False, "Abort": False}
# the codes a worker may answer a well-formed but wrong request with (never INTERNAL/UNKNOWN)
CALLER_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
}


@pytest.fixture(scope="module")
def worker():
    w = WorkerProc("both", "tcp").start()
    yield w
    w.terminate()


def valid_generate(rng: random.Random, max_tokens: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"fuzz-{rng.getrandbits(40)}",
        prompt_token_ids=[rng.randrange(1, 40000) for _ in range(rng.randrange(1, 40))],
        params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0 and b:  # bit flips
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1 and b:  # truncation
        del b[rng.randrange(len(b)) :]
    elif kind == 2:  # spliced random bytes
        at = rng.randrange(len(b) + 1)
        b[at:at] = rng.randbytes(rng.randrange(1, 16))
    else:  # a varint that never ends
        b += b"\x08" + b"\xff" * rng.randrange(1, 12)
    return bytes(b)


def wrong_wire_types() -> list[bytes]:
    return [
        b"\x0a\x03abc",  # field 1 (request_id: string) is fine; then
        b"\x12\x05hello",  # field 2 (prompt ids: packed varints) as a string of junk varints
        b"\x0d\x00\x00\x80\x3f",  # field 1 as a fixed32
        b"\x0a\x02\xff\xfe",  # request_id with invalid UTF-8
        b"\x1a\x03\x0d\x00\x00",  # params (message) truncated inside
        b"\x0f",
        b"\x07",
        b"\x0a\xff\xff\xff\xff\x0f",
    ]  # bad wire types, a length past the end


async def call_raw(channel, method: str, data: bytes):
    """Send raw bytes; (status code, number of messages received)."""
    if STREAMING[method]:
        call = channel.unary_stream(SERVICE + method)(data, timeout=30)
        n = 0
        try:
            async for _ in call:
                n += 1
                if method == "WatchEvents":
                    call.cancel()
                    return grpc.StatusCode.OK, n
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED, n
        except grpc.aio.AioRpcError as exc:
            return exc.code(), n
        return grpc.StatusCode.OK, n
    try:
        await channel.unary_unary(SERVICE + method)(data, timeout=30)
        return grpc.StatusCode.OK, 1
    except grpc.aio.AioRpcError as exc:
        return exc.code(), 0


def parses(method: str, data: bytes) -> bool:
    types = {
        "Generate": pb.GenerateRequest,
        "WatchEvents": pb.WatchEventsRequest,
        "Prefill": pb.PrefillRequest,
        "Abort": pb.AbortRequest,
    }
    try:
        types[method].FromString(data)
        return True
    except Exception:  # noqa: BLE001 - any parse failure
        return False


def test_fuzzed_requests_never_crash_or_leak(worker):
    rng = random.Random(SEED)
    codes: dict[str, int] = {}

    async def fuzz():
        async with worker.channel([("grpc.max_send_message_length", 80 << 20)]) as channel:
            cases = []
            for _ in range(120):
                method = rng.choice(list(STREAMING))
                choice = rng.randrange(4)
                if choice == 0:
                    data = rng.randbytes(rng.randrange(0, 200))
                elif choice == 1:
                    data = mutate(rng, valid_generate(rng).SerializeToString())
                elif choice == 2:
                    data = rng.choice(wrong_wire_types())
                else:
                    data = mutate(
                        rng, pb.PrefillRequest(request_id="p", prompt_token_ids=[1, 2, 3]).SerializeToString()
                    )
                cases.append((method, data))
            for method, data in cases:
                code, _ = await call_raw(channel, method, data)
                codes[code.name] = codes.get(code.name, 0) + 1
                if not parses(method, data):
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, data, code)
                else:
                    assert code == grpc.StatusCode.OK or code in CALLER_ERRORS, (method, data, code)
            # extreme but well-formed values
            for params in (
                pb.SamplingParams(max_tokens=2**31 - 1),
                pb.SamplingParams(temperature=float("nan")),
                pb.SamplingParams(top_p=float("inf")),
                pb.SamplingParams(top_k=-(2**31)),
                pb.SamplingParams(seed=-(2**63), max_tokens=2),
            ):
                request = pb.GenerateRequest(request_id="x", prompt_token_ids=[1, 2], params=params)
                code, _ = await call_raw(channel, "Generate", request.SerializeToString())
                assert code == grpc.StatusCode.OK or code in CALLER_ERRORS, (params, code)
            for ids in ([], [-1], [2**31 - 1], list(range(5000))):
                request = pb.GenerateRequest(
                    request_id="y", prompt_token_ids=ids, params=pb.SamplingParams(max_tokens=2)
                )
                code, _ = await call_raw(channel, "Generate", request.SerializeToString())
                assert code in CALLER_ERRORS, (len(ids), code)
            # oversized: past the worker's 64 MiB receive limit
            code, _ = await call_raw(channel, "Generate", b"\x0a" + b"\x80\x80\x80\x28" + b"x" * (80 << 20))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
            # streams cut mid-message: cancel after the first token, many at once
            calls = [
                channel.unary_stream(SERVICE + "Generate")(
                    valid_generate(rng, max_tokens=64).SerializeToString(), timeout=60
                )
                for _ in range(6)
            ]
            for call in calls:
                async for _ in call:
                    break
                call.cancel()

    asyncio.run(fuzz())
    cut_raw_connections(worker, rng)

    assert worker.proc.poll() is None, "the worker crashed:\n" + worker.log()[-3000:]
    state = wait_idle(worker)
    assert state["invariants_ok"], state
    assert state["num_requests"] == 0 and state["num_requests_holding_blocks"] == 0, state
    assert state["num_free_blocks"] > 0

    async def normal():  # still serves, deterministically
        request = valid_generate(random.Random(1), max_tokens=4)
        async with worker.channel() as channel:
            outs = []
            for _ in range(2):
                call = channel.unary_stream(SERVICE + "Generate", response_deserializer=pb.GenerateResponse.FromString)
                outs.append([t async for m in call(request.SerializeToString(), timeout=60) for t in m.token_ids])
        return outs

    a, b = asyncio.run(normal())
    assert len(a) == 4 and a == b
    assert "INVALID_ARGUMENT" in codes


def cut_raw_connections(worker, rng: random.Random) -> None:
    """HTTP/2 connections that stop mid-preface, mid-frame and mid-message, then close: inside
    a TLS session made with the client certificate, and as plaintext bytes (a TLS handshake cut
    or garbage) to the TLS port."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    payloads = (
        preface[:10],
        preface + settings[:5],
        preface + settings + b"\x00\x10\x00\x01\x04",
        rng.randbytes(64),
        preface + settings + rng.randbytes(200),
    )
    tls = security().tls
    context = ssl.create_default_context(cafile=tls.ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols(["h2"])
    for payload in payloads:
        with socket.create_connection(("127.0.0.1", worker.grpc_port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=tls.server_name) as s:
                s.sendall(payload)
    for payload in (*payloads, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(40)):
        with socket.create_connection(("127.0.0.1", worker.grpc_port), timeout=10) as s:
            s.sendall(payload)


def wait_idle(worker, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = worker.kv_state()
        idle = state["num_requests"] == 0 and state["num_requests_holding_blocks"] == 0
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.1)
