"""The Endpoint Picker's ext_proc server: Envoy's External Processing protocol, GIE's answer.

One gRPC stream per HTTP request. Envoy sends the request headers, then the whole body (the
filter's `request_body_mode: BUFFERED`: one message, whose `end_of_stream` is false only when
HTTP/2 trailers follow), maybe the trailers, then the response headers and the response body in
chunks. The EPP picks once per stream, at the first of:

    request headers with end_of_stream (no body)   -> the pick in the HeadersResponse
    request body (the whole body, trailers or not) -> the pick in the BodyResponse
    request trailers, no body before               -> the pick in the TrailersResponse

A pick is `x-gateway-destination-endpoint: <sidecar host:port>` set on the request, and the same
with the pick's fallbacks (`primary,fallback,...`) in the dynamic metadata `envoy.lb`, where the
gateway's override_host load balancing reads it; `x-prefiller-host-port` set for a remote
prefill and removed otherwise (a client cannot name one); the route cache cleared. Later bodies
on the same stream are answered and ignored: one stream is one request, one pick, one pending
count.

    a body the gateway would refuse -> an immediate 400 / 413 in OpenAI's error JSON
    no endpoint                     -> an immediate 503 (429 when every worker is saturated)
    anything else going wrong       -> an immediate 500: never a broken stream, which a gateway
                                       failing open would take as "route anywhere"
    response headers                -> the request got its first token (the sidecar sends headers with it)
    response body end_of_stream,
    or the stream's end             -> the request is finished on the picked workers (the shipped
                                       Envoy config sends no response body: the stream's end)

The gateway's subset hint, the endpoints it allows, comes as filter metadata only
(`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, a list or a comma-separated
string); a client's header of that name is not read. Flow-control headers
(`x-gateway-inference-objective`, `x-gateway-inference-fairness-id`) pass through untouched.
Fail-open or fail-close is the gateway's choice when the EPP does not answer (Envoy's
`failure_mode_allow`, GIE's `endpointPickerRef.failureMode`). Nothing of the request's content
is logged at INFO.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from prometheus_client import Counter, Histogram

from splitserve.platform.observability import tracing
from splitserve.router.epp.picker import Pick, Picker
from splitserve.router.errors import APIError

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
PREFILLER = "x-prefiller-host-port"


class Metrics:
    def __init__(self, registry):
        self.picks = Counter(
            "splitserve_epp_picks",
            "Requests the EPP answered, by result (picked, pd, refused, failed)",
            ["result"],
            registry=registry,
        )
        self.pick_seconds = Histogram(
            "splitserve_epp_pick_seconds", "Time from the request body to the pick", registry=registry
        )


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, metrics: Metrics):
        self.picker = picker
        self.metrics = metrics

    async def Process(self, request_iterator, context):
        stream = _Stream()
        try:
            async for request in request_iterator:
                yield await self._answer(stream, request)
        finally:
            self._finish(stream)

    async def _answer(self, stream: _Stream, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            stream.headers = _headers(request.request_headers.headers)
            stream.subset = _subset(request.metadata_context)
            if request.request_headers.end_of_stream:
                return await self._pick(stream, b"", "request_headers")
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        if kind == "request_body":
            if not stream.is_picked:
                return await self._pick(stream, request.request_body.body, "request_body")
            return ep.ProcessingResponse(request_body=ep.BodyResponse())
        if kind == "request_trailers":
            if not stream.is_picked:
                return await self._pick(stream, b"", "request_trailers")
            return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        if kind == "response_headers":
            if stream.pick is not None:
                self.picker.first_token(stream.pick)
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        if kind == "response_body":
            if request.response_body.end_of_stream:
                self._finish(stream)
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    def _finish(self, stream: _Stream) -> None:
        if stream.pick is not None:
            self.picker.finish(stream.pick)
            stream.pick = None

    async def _pick(self, stream: _Stream, body: bytes, phase: str) -> ep.ProcessingResponse:
        stream.is_picked = True
        headers = stream.headers
        # A child of the client's traceparent; the request goes on carrying the pick's context,
        # so the sidecar's and the workers' spans nest under it (W3C context, as llm-d does).
        span = tracing.tracer().start("epp.pick", headers, attributes={"url.path": headers.get(":path", "")})
        with self.metrics.pick_seconds.time(), span:
            try:
                pick = await self.picker.pick(headers.get(":path", "").split("?", 1)[0], body, stream.subset)
            except APIError as exc:
                self.metrics.picks.labels(result="refused").inc()
                log.warning("refused %s with %d: %s", headers.get(":path"), exc.status, exc.message[:200])
                span.set("http.response.status_code", exc.status)
                return _immediate(exc)
            except Exception:
                self.metrics.picks.labels(result="failed").inc()
                log.exception("the pick of a %s request failed", headers.get(":path"))
                return _immediate(APIError(500, "the endpoint picker failed on this request", code="epp_error"))
            stream.pick = pick
            span.update(
                {
                    "splitserve.placement.decode": pick.decode,
                    "splitserve.placement.prefill": pick.prefill,
                    "splitserve.placement.endpoint": pick.endpoint,
                    "splitserve.placement.cached_blocks": pick.num_cached_blocks,
                    "gen_ai.usage.input_tokens": pick.num_prompt_tokens,
                }
            )
        carried: dict[str, str] = {}
        span.inject(carried)
        self.metrics.picks.labels(result="pd" if pick.prefill else "picked").inc()
        log.info(
            "picked %s (decode %s, prefill %s, %d prompt tokens, %d cached blocks)",
            pick.endpoint,
            pick.decode,
            pick.prefill or "local",
            pick.num_prompt_tokens,
            pick.num_cached_blocks,
        )
        return _picked(pick, carried, phase)


@dataclass
class _Stream:
    """One ext_proc stream: one HTTP request."""

    headers: dict[str, str] = field(default_factory=dict)
    subset: set[str] | None = None
    is_picked: bool = False
    pick: Pick | None = None  # until the request is finished


def _picked(pick: Pick, carried: dict[str, str], phase: str) -> ep.ProcessingResponse:
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: ",".join([pick.endpoint, *pick.fallbacks])}})
    if phase == "request_trailers":  # the headers went upstream already: only the metadata counts
        return ep.ProcessingResponse(request_trailers=ep.TrailersResponse(), dynamic_metadata=metadata)
    set_headers = [_header(DESTINATION, pick.endpoint), *(_header(k, v) for k, v in carried.items())]
    remove = []
    if pick.prefill:
        set_headers.append(_header(PREFILLER, pick.prefill))
    else:
        remove.append(PREFILLER)
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=set_headers, remove_headers=remove), clear_route_cache=True
    )
    if phase == "request_headers":
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def _headers(header_map) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in header_map.headers}


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _subset(metadata_context) -> set[str] | None:
    """The endpoints the gateway allows, from its filter metadata; None: any."""
    ns = metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    value = ns.fields[SUBSET]
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values]
    else:
        items = value.string_value.split(",")
    return {v.strip() for v in items if v.strip()}


def _immediate(exc: APIError) -> ep.ProcessingResponse:
    headers = [_header("content-type", "application/json")]
    headers += [_header(k.lower(), v) for k, v in exc.headers().items()]
    immediate = ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status),
        headers=ep.HeaderMutation(set_headers=headers),
        body=json.dumps(exc.body()).encode(),
        details=exc.message[:200],
    )
    return ep.ProcessingResponse(immediate_response=immediate)


def add_to_server(server: grpc.aio.Server, processor: ExternalProcessor) -> None:
    ep_grpc.add_ExternalProcessorServicer_to_server(processor, server)
