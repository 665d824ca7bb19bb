"""Mutual TLS on a real `splitserve worker` process (platform/wire/grpc_tls.py): a client holding a
certificate from the service's CA is served; one without a certificate, with only the CA, or
with a certificate from another CA is refused in the handshake, and the worker keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from workerproc import WorkerProc

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.platform.wire.grpc_tls import TlsFiles, aio_channel, generate_dev_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return generate_dev_pki(tmp_path_factory.mktemp("pki")), generate_dev_pki(tmp_path_factory.mktemp("other"))


@pytest.fixture(scope="module")
def worker(pki):
    tls, _ = pki
    # secure=False: this worker gets this test's own CA, not the suite's (workerproc.security)
    w = WorkerProc(
        "both", "tcp", "--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca, secure=False
    ).start()
    yield w
    w.terminate()


async def _generate_on(make_channel) -> list[int]:
    async with make_channel() as channel:
        stub = pb_grpc.WorkerStub(channel)
        request = pb.GenerateRequest(
            request_id="mtls",
            prompt_token_ids=[1, 2, 3, 4],
            params=pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        )
        msgs = [m async for m in stub.Generate(request, timeout=60)]
    return [t for m in msgs for t in m.token_ids]


def _generate(make_channel) -> list[int]:
    """Generate over a channel made inside the event loop that uses it (grpc.aio binds to it)."""
    return asyncio.run(_generate_on(make_channel))


def _refused(make_channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _generate(make_channel)
    return exc.value.code()


def test_right_certificate_is_served_and_others_are_refused(worker, pki):
    tls, other = pki
    assert len(_generate(lambda: aio_channel(worker.address, tls))) == 3
    ca_only = grpc.ssl_channel_credentials(root_certificates=open(tls.ca, "rb").read())
    options = [("grpc.ssl_target_name_override", tls.server_name)]
    # A stranger's certificate, checked by its own CA: our worker does not accept it.
    stranger = TlsFiles(other.cert, other.key, tls.ca, tls.server_name)
    for make in (
        lambda: grpc.aio.insecure_channel(worker.address),  # plaintext
        lambda: grpc.aio.secure_channel(worker.address, ca_only, options=options),  # no client cert
        lambda: aio_channel(worker.address, stranger),
    ):
        assert _refused(make) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the worker in turn.
    assert _refused(lambda: aio_channel(worker.address, other)) == grpc.StatusCode.UNAVAILABLE
    assert len(_generate(lambda: aio_channel(worker.address, tls))) == 3  # still serving
    assert worker.proc.poll() is None


def test_splitserve_up_makes_throwaway_credentials(tmp_path):
    import os
    import stat

    from splitserve.launch.up import throwaway_security
    from splitserve.platform.settings.worker_args import WorkerArgs

    overrides, files = throwaway_security(str(tmp_path))
    args = WorkerArgs(**files).to_argv()
    assert set(overrides) == {"discovery.tls_cert", "discovery.tls_key", "discovery.tls_ca"}
    flags = dict(zip(args[::2], args[1::2]))
    assert set(flags) == {"--tls-cert", "--tls-key", "--tls-ca", "--kv-secret-file"}
    for path in flags.values():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert len(open(flags["--kv-secret-file"]).read()) == 64
    assert overrides["discovery.tls_cert"] == flags["--tls-cert"]
