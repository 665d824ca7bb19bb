"""The Endpoint Picker's ext_proc server: Envoy's External Processing protocol, GIE's answer.

One gRPC stream per HTTP request. Envoy sends the request headers, then the whole body (the
filter's `request_body_mode: BUFFERED`), then the response headers. The EPP answers:

    request headers  -> nothing to change (the pick needs the body), or, for a request without a
                        body, the pick at once
    request body     -> the pick: `x-gateway-destination-endpoint: <sidecar host:port>` set on the
                        request, the same in the dynamic metadata `envoy.lb`, `x-prefiller-host-port`
                        set for a remote prefill and removed otherwise (a client cannot name one),
                        and the route cache cleared so the route on the header applies
    no endpoint      -> an immediate 503 (429 when every worker is saturated) in OpenAI's error JSON
    response headers -> the request got its first token (the sidecar sends headers with it)
    stream end       -> the request is finished on the picked workers

The gateway's subset hint, the endpoints it allows, comes as filter metadata
(`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, a list or a comma-separated
string) or, where a static gateway has no metadata to send, as the request header of that name.
Flow-control headers (`x-gateway-inference-objective`, `x-gateway-inference-fairness-id`) pass
through untouched. Fail-open or fail-close is the gateway's choice when the EPP does not answer
(Envoy's `failure_mode_allow`, GIE's `endpointPickerRef.failureMode`).
"""

from __future__ import annotations

import json
import logging

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
            "Requests the EPP answered, by result (picked, pd, refused)",
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
        headers: dict[str, str] = {}
        subset: set[str] | None = None
        body = bytearray()
        pick: Pick | None = None
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    headers = _headers(request.request_headers.headers)
                    subset = _subset(request.metadata_context, headers)
                    if request.request_headers.end_of_stream:
                        response, pick = await self._pick(headers, b"", subset, "request_headers")
                        yield response
                    else:
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif kind == "request_body":
                    body += request.request_body.body
                    if request.request_body.end_of_stream:
                        response, pick = await self._pick(headers, bytes(body), subset, "request_body")
                        yield response
                    else:
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                elif kind == "response_headers":
                    if pick is not None:
                        self.picker.first_token(pick)
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif kind == "request_trailers":
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        finally:
            if pick is not None:
                self.picker.finish(pick)

    async def _pick(self, headers: dict[str, str], body: bytes, subset, phase: str):
        # A child of the client's traceparent; the request goes on carrying the pick's context,
        # so the sidecar's and the workers' spans nest under it (W3C context, as llm-d does).
        span = tracing.tracer().start("epp.pick", headers, attributes={"url.path": headers.get(":path", "")})
        with self.metrics.pick_seconds.time(), span:
            try:
                pick = await self.picker.pick(headers.get(":path", "").split("?", 1)[0], body, subset)
            except APIError as exc:
                self.metrics.picks.labels(result="refused").inc()
                log.warning("no endpoint for %s: %s", headers.get(":path"), exc.message)
                span.set("http.response.status_code", exc.status)
                return _immediate(exc), None
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
        set_headers = [_header(DESTINATION, pick.endpoint), *(_header(k, v) for k, v in carried.items())]
        remove = []
        if pick.prefill:
            set_headers.append(_header(PREFILLER, pick.prefill))
        else:
            remove.append(PREFILLER)
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=set_headers, remove_headers=remove), clear_route_cache=True
        )
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: pick.endpoint}})
        if phase == "request_headers":
            response = ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        else:
            response = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)
        return response, pick


def _headers(header_map) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in header_map.headers}


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _subset(metadata_context, headers: dict[str, str]) -> set[str] | None:
    """The endpoints the gateway allows, from its filter metadata or the header; None: any."""
    ns = metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    value = None
    if ns is not None and SUBSET in ns.fields:
        field = ns.fields[SUBSET]
        if field.HasField("list_value"):
            value = [v.string_value for v in field.list_value.values]
        else:
            value = field.string_value.split(",")
    elif SUBSET in headers:
        value = headers[SUBSET].split(",")
    if value is None:
        return None
    return {v.strip() for v in value if v.strip()}


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
