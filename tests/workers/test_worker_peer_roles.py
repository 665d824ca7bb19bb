"""Per-role certificates on a real `splitserve worker` process: the operator's CA (operator/pki.py)
issues a worker certificate and a client-only router certificate, and a worker started with
--tls-check-peer-roles serves each RPC only to the role that calls it (workers/grpc_guard.py):
Generate to the router, Prefill to a worker. A worker's certificate cannot drive Generate, the
router's cannot call Prefill, and the router's cannot serve as a worker."""

from __future__ import annotations

import asyncio
import datetime

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from workerproc import WorkerProc

from splitserve.operator import pki
from splitserve.platform.errors import ConfigError
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.platform.wire.grpc_tls import TlsFiles, aio_channel
from splitserve.workers.config import WorkerConfig

NOW = datetime.datetime.now(datetime.UTC)


def write(directory, name: str, pair: pki.KeyPair, ca: pki.KeyPair) -> TlsFiles:
    for suffix, data in (("crt", pair.cert), ("key", pair.key)):
        (directory / f"{name}.{suffix}").write_bytes(data)
    (directory / "ca.crt").write_bytes(ca.cert)
    return TlsFiles(str(directory / f"{name}.crt"), str(directory / f"{name}.key"), str(directory / "ca.crt"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("roles")
    ca = pki.make_ca("ns/svc", NOW)
    return {
        "worker": write(directory, "worker", pki.issue_leaf(ca, "svc-decode", NOW, role="worker"), ca),
        "prefill": write(directory, "prefill", pki.issue_leaf(ca, "svc-prefill", NOW, role="worker"), ca),
        "router": write(directory, "router", pki.issue_leaf(ca, "svc-router", NOW, role="router"), ca),
    }


@pytest.fixture(scope="module")
def worker(certs):
    tls = certs["worker"]
    w = WorkerProc(
        "both",
        "tcp",
        "--tls-cert",
        tls.cert,
        "--tls-key",
        tls.key,
        "--tls-ca",
        tls.ca,
        "--tls-check-peer-roles",
        secure=False,
    ).start()
    yield w
    w.terminate()


async def _call(address: str, tls: TlsFiles, method: str):
    async with aio_channel(address, tls) as channel:
        stub = pb_grpc.WorkerStub(channel)
        if method == "Generate":
            request = pb.GenerateRequest(
                request_id="roles",
                prompt_token_ids=[1, 2, 3, 4],
                params=pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            )
            return [t for m in [m async for m in stub.Generate(request, timeout=60)] for t in m.token_ids]
        return await stub.Prefill(
            pb.PrefillRequest(
                request_id="roles", prompt_token_ids=[1, 2, 3, 4], params=pb.SamplingParams(temperature=0, max_tokens=1)
            ),
            timeout=60,
        )


def call(address: str, tls: TlsFiles, method: str):
    """The call's result, or the status code it failed with."""
    try:
        return asyncio.run(_call(address, tls, method))
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_each_rpc_is_served_only_to_its_callers_role(worker, certs):
    assert len(call(worker.address, certs["router"], "Generate")) == 3
    assert call(worker.address, certs["prefill"], "Generate") == grpc.StatusCode.PERMISSION_DENIED
    assert call(worker.address, certs["router"], "Prefill") == grpc.StatusCode.PERMISSION_DENIED
    prefilled = call(worker.address, certs["prefill"], "Prefill")  # a worker may: past the role check
    assert prefilled != grpc.StatusCode.PERMISSION_DENIED
    assert len(call(worker.address, certs["router"], "Generate")) == 3  # still serving
    assert worker.proc.poll() is None


def test_the_router_certificate_cannot_pose_as_a_worker(certs):
    cert = x509.load_pem_x509_certificate(open(certs["router"].cert, "rb").read())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert "splitserve-worker" not in sans and "splitserve-router" in sans
    assert usages == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.role_of(open(certs["router"].cert, "rb").read()) == "router"
    assert pki.role_of(open(certs["worker"].cert, "rb").read()) == "worker"


def test_checking_roles_needs_tls():
    with pytest.raises(ConfigError, match="--tls-check-peer-roles needs mutual TLS"):
        WorkerConfig(role="decode", tls_check_peer_roles=True)
