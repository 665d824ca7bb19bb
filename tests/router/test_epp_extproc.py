"""The EPP's ext_proc server spoken to as Envoy speaks it: a real gRPC ExternalProcessor stream
(envoy.service.ext_proc.v3 messages from xds-protos) in front of fake workers that speak the
real Worker protocol (routerkit.FakeWorker: real KV events and load reports). No model and no
Envoy here; tests/router/test_epp_envoy.py runs the whole path with both."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from routerkit import FakeWorker, router_config

from splitserve.platform.errors import ConfigError
from splitserve.router.epp.endpoints import EndpointMap
from splitserve.router.epp.extproc import ExternalProcessor, Metrics, add_to_server
from splitserve.router.epp.picker import Picker
from splitserve.router.router import Router

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY_BYTES = 1 << 20


@pytest.fixture(scope="module")
def epp(loop, tokenizer):
    """Two decode and one prefill FakeWorker, a Router over them and the ext_proc server."""
    decode = [loop.run(FakeWorker(tokenizer=tokenizer).start()) for _ in range(2)]
    prefill = loop.run(FakeWorker("prefill", tokenizer=tokenizer).start())
    endpoints = EndpointMap({decode[0].address: "10.0.0.1:8200", decode[1].address: "10.0.0.2:8200"})

    async def start():
        config = router_config([w.address for w in decode + [prefill]])
        config = dataclasses.replace(config, gateway=dataclasses.replace(config.gateway, max_body_bytes=MAX_BODY_BYTES))
        router = Router(config)
        await router.start()
        await router.wait_ready(30, num_decode=2, num_prefill=1)
        server = grpc.aio.server()
        processor = ExternalProcessor(Picker(router, endpoints), Metrics(router.metrics.registry))
        add_to_server(server, processor)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return router, server, port

    router, server, port = loop.run(start())
    yield {"loop": loop, "router": router, "port": port, "decode": decode, "prefill": prefill}

    async def stop():
        await server.stop(0)
        await router.stop()
        for w in [*decode, prefill]:
            await w.stop()

    loop.run(stop())


def headers_message(
    path: str, extra: dict[str, str] | None = None, end_of_stream: bool = False, subset: list[str] | None = None
) -> ep.ProcessingRequest:
    values = {
        ":method": "POST" if not end_of_stream else "GET",
        ":path": path,
        "content-type": "application/json",
        **(extra or {}),
    }
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])
    request = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers, end_of_stream=end_of_stream))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        request.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return request


def body_message(body: dict | bytes) -> ep.ProcessingRequest:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=True))


def exchange(epp, messages: list[ep.ProcessingRequest], then_response_headers: bool = True) -> list:
    """Send the messages one at a time, as Envoy does, and collect the answers."""

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp['port']}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            answers = []
            for message in messages:
                await call.write(message)
                answers.append(await call.read())
                if answers[-1].HasField("immediate_response"):
                    break
            else:
                if then_response_headers:
                    await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
                    answers.append(await call.read())
            await call.done_writing()
            return answers

    return epp["loop"].run(run())


def mutation(answer: ep.ProcessingResponse):
    which = answer.WhichOneof("response")
    common = getattr(answer, which).response
    return (
        {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers},
        list(common.header_mutation.remove_headers),
        common.clear_route_cache,
    )


def chat(content: str, **kw) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}], **kw}


def test_pick_sets_the_destination_header_and_lb_metadata(epp):
    answers = exchange(epp, [headers_message(CHAT), body_message(chat("Hello"))])
    assert answers[0].WhichOneof("response") == "request_headers"
    set_headers, removed, cleared = mutation(answers[1])
    assert set_headers["x-gateway-destination-endpoint"] in ("10.0.0.1:8200", "10.0.0.2:8200")
    assert cleared
    lb = answers[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    primary, *fallbacks = lb["x-gateway-destination-endpoint"].string_value.split(",")
    assert primary == set_headers["x-gateway-destination-endpoint"]
    assert fallbacks == [e for e in ("10.0.0.1:8200", "10.0.0.2:8200") if e != primary], "the other endpoint follows"
    assert "x-prefiller-host-port" in removed and "x-prefiller-host-port" not in set_headers
    assert answers[2].WhichOneof("response") == "response_headers"


def test_a_long_prompt_names_the_prefill_worker_and_a_client_cannot(epp):
    long = " ".join(f"word{i}" for i in range(400))  # far past min_prefill_tokens (256)
    answers = exchange(epp, [headers_message(CHAT, {"x-prefiller-host-port": "10.9.9.9:1"}), body_message(chat(long))])
    set_headers, _, _ = mutation(answers[1])
    assert set_headers["x-prefiller-host-port"] == epp["prefill"].address
    short = exchange(epp, [headers_message(CHAT, {"x-prefiller-host-port": "10.9.9.9:1"}), body_message(chat("Hi"))])
    set_headers, removed, _ = mutation(short[1])
    assert "x-prefiller-host-port" not in set_headers and "x-prefiller-host-port" in removed


def test_subset_hint_from_metadata_only(epp):
    for _ in range(3):
        answers = exchange(epp, [headers_message(CHAT, subset=["10.0.0.2:8200"]), body_message(chat("Hello"))])
        assert mutation(answers[1])[0]["x-gateway-destination-endpoint"] == "10.0.0.2:8200"
    # A client's header of that name is not the gateway's hint: it pins nothing.
    picked = set()
    for _ in range(8):
        answers = exchange(
            epp,
            [
                headers_message(CHAT, {"x-gateway-destination-endpoint-subset": "10.9.9.9:1"}),
                body_message(chat("Hello")),
            ],
        )
        picked.add(mutation(answers[1])[0]["x-gateway-destination-endpoint"])
    assert picked <= {"10.0.0.1:8200", "10.0.0.2:8200"} and picked


def test_no_endpoint_in_the_subset_is_an_immediate_503(epp):
    answers = exchange(epp, [headers_message(CHAT, subset=["10.7.7.7:8200"]), body_message(chat("Hello"))])
    immediate = answers[-1].immediate_response
    assert immediate.status.code == 503
    error = json.loads(immediate.body)["error"]
    assert error["code"] == "no_worker_available" and "subset" in error["message"]


def immediate_error(answers) -> tuple[int, dict]:
    assert answers[-1].HasField("immediate_response"), answers[-1]
    immediate = answers[-1].immediate_response
    return immediate.status.code, json.loads(immediate.body)["error"]


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),  # RecursionError in the parser
        (b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests too deeply"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "m", "messages": "not a list"}).encode(), 400, "messages"),
    ],
    ids=["not-json", "deep-array", "deep-field", "not-object", "invalid-field"],
)
def test_a_body_the_gateway_would_refuse_is_a_400_in_openai_json(epp, body, status, needle):
    code, error = immediate_error(exchange(epp, [headers_message(CHAT), body_message(body)]))
    assert code == status and needle in error["message"] and error["type"] == "invalid_request_error"


def test_a_bodiless_request_is_placed_by_load(epp):
    answers = exchange(epp, [headers_message("/v1/models", end_of_stream=True)])
    assert answers[0].WhichOneof("response") == "request_headers"
    assert mutation(answers[0])[0]["x-gateway-destination-endpoint"]


def test_the_gateways_caps_apply_before_any_work(epp):
    """prompts x n over max_choices_per_request (1024) is a 400 read from the raw body; a body
    over max_body_bytes (1 MiB here) a 413; neither builds a job or tokenizes a prompt."""
    many = {"model": "smollm2-135m", "prompt": ["x"] * 65, "n": 16}
    code, error = immediate_error(exchange(epp, [headers_message(COMPLETIONS), body_message(many)]))
    assert code == 400 and "1040 choices" in error["message"] and error["param"] == "n"
    huge = b'{"model": "smollm2-135m", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    code, error = immediate_error(exchange(epp, [headers_message(COMPLETIONS), body_message(huge)]))
    assert code == 413 and "max_body_bytes" in error["message"]
    ok = {"model": "smollm2-135m", "prompt": ["first prompt", "second"], "n": 2}
    assert mutation(exchange(epp, [headers_message(COMPLETIONS), body_message(ok)])[1])[0]


def test_the_pick_comes_with_the_body_when_trailers_follow_or_with_the_trailers(epp):
    """HTTP/2 request trailers: Envoy sends the whole body with end_of_stream=false, then the
    trailers. The EPP picks on that body; with no body at all, on the trailers (metadata only)."""
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(chat("Hi")).encode(), end_of_stream=False))
    trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())
    answers = exchange(epp, [headers_message(CHAT), body, trailers])
    assert mutation(answers[1])[0]["x-gateway-destination-endpoint"]
    assert answers[2].WhichOneof("response") == "request_trailers"
    answers = exchange(epp, [headers_message("/v1/models"), trailers])
    assert answers[1].WhichOneof("response") == "request_trailers"
    assert answers[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]


def test_fifty_bodies_on_one_stream_make_one_pick_and_leave_no_pending_count(epp):
    pool = epp["router"].pool
    metrics = epp["router"].metrics.registry
    before = metrics.get_sample_value("splitserve_epp_picks_total", {"result": "picked"}) or 0
    bodies = [body_message(chat(f"Hello {i}")) for i in range(50)]
    answers = exchange(epp, [headers_message(CHAT), *bodies])
    assert sum(1 for a in answers if a.WhichOneof("response") == "request_body" and mutation(a)[0]) == 1
    assert metrics.get_sample_value("splitserve_epp_picks_total", {"result": "picked"}) == before + 1
    assert epp["loop"].run(settled(pool))


def test_the_pending_count_ends_with_the_response_not_the_stream(epp):
    """The response's last body chunk finishes the request while the ext_proc stream stays open."""
    pool = epp["router"].pool

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp['port']}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            for message in (headers_message(CHAT), body_message(chat("Hello"))):
                await call.write(message)
                await call.read()
            await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
            await call.read()
            busy = sum(w.num_inflight for w in pool.workers.values())
            await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: x", end_of_stream=True)))
            await call.read()
            done = await settled(pool)
            await call.done_writing()
            return busy, done

    busy, done = epp["loop"].run(run())
    assert busy == 1 and done


def test_flow_control_headers_pass_through(epp):
    answers = exchange(
        epp,
        [
            headers_message(
                CHAT, {"x-gateway-inference-objective": "premium", "x-gateway-inference-fairness-id": "tenant-a"}
            ),
            body_message(chat("Hello")),
        ],
    )
    set_headers, removed, _ = mutation(answers[1])
    assert not {"x-gateway-inference-objective", "x-gateway-inference-fairness-id"} & (set(set_headers) | set(removed))


async def settled(pool) -> bool:
    for _ in range(100):
        if all(w.num_inflight == 0 and w.num_pending == 0 for w in pool.workers.values()):
            return True
        await asyncio.sleep(0.02)
    return False


def test_assignments_are_released_when_the_stream_ends(epp):
    pool = epp["router"].pool
    exchange(epp, [headers_message(CHAT), body_message(chat("Hello"))])
    assert epp["loop"].run(settled(pool))


def test_endpoint_map_rules():
    m = EndpointMap.parse(["127.0.0.1:50051=127.0.0.1:8201"], sidecar_port=8200)
    assert m.endpoint("127.0.0.1:50051") == "127.0.0.1:8201"
    assert m.endpoint("10.1.2.3:50051") == "10.1.2.3:8200"
    assert EndpointMap().endpoint("10.1.2.3:50051") is None
    for bad in (["127.0.0.1:50051"], ["127.0.0.1:50051=nohost"], ["x:1=127.0.0.1:70000"]):
        with pytest.raises(ConfigError, match="allowed"):
            EndpointMap.parse(bad)


def test_the_pick_is_a_span_of_the_clients_trace_and_its_context_travels_on(epp):
    """With tracing on, the EPP's pick is a child of the client's traceparent (exported over OTLP to
    a real receiver), and the request goes on to the sidecar carrying the pick's context."""
    from otlp_receiver import OtlpReceiver

    from splitserve.platform.observability import tracing

    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with OtlpReceiver() as receiver:
        tracing.configure(tracing.TracingConfig(role="epp", endpoint=receiver.endpoint, sample_ratio=1.0))
        try:
            answers = exchange(
                epp,
                [
                    headers_message(CHAT, {"traceparent": f"00-{client_trace}-{client_span}-01"}),
                    body_message(chat("Hello")),
                ],
            )
        finally:
            tracing.configure(tracing.TracingConfig(role="epp"))  # off again: exports what is buffered
        (pick,) = receiver.wait_for(client_trace, {"epp.pick"})
    set_headers, _, _ = mutation(answers[1])
    assert pick.parent_id == client_span and pick.service == "splitserve-epp"
    assert pick.attributes["splitserve.placement.endpoint"] == set_headers["x-gateway-destination-endpoint"]
    assert set_headers["traceparent"] == f"00-{client_trace}-{pick.span_id}-01"


def test_no_request_content_in_the_epps_logs_at_info(epp, caplog):
    secret = "zebra-octopus-71"
    bodies = [
        chat(f"My secret is {secret}"),
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": secret}], "n": f"{secret}"},
        b'{"model": "' + secret.encode() + b'", "messages": 5}',
        secret.encode(),
    ]
    with caplog.at_level("INFO", logger="splitserve"):
        for body in bodies:
            exchange(epp, [headers_message(CHAT), body_message(body)])
    assert len(caplog.records) >= len(bodies)  # picks and refusals were logged...
    assert not [r for r in caplog.records if secret in r.getMessage()]  # ...without what the client sent


def test_epp_listens_on_loopback_unless_told():
    import argparse

    from splitserve.router.epp.main import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["epp", "--sidecar-port", "8200"])
    assert args.host == "127.0.0.1" and args.serve_tls_client_ca is None
