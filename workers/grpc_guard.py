"""The Worker gRPC service registered so that malformed requests are the caller's error.

gRPC's generated registration deserializes each request before the servicer runs; bytes that
are not a valid message (random or truncated bytes, a field sent with the wrong wire type, a
string that is not UTF-8) then fail inside gRPC, which answers INTERNAL. Here the handlers take
the raw bytes and parse them themselves: a message that does not parse is INVALID_ARGUMENT
naming the method and the parse error, and nothing reaches the engine. Valid messages run the
servicer exactly as the generated registration would (same method names, same serializers).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from splitserve.platform.wire import worker_pb2 as pb

SERVICE = "splitserve.v1.Worker"
# method -> (request type, response type, server-streaming)
METHODS = {
    "Generate": (pb.GenerateRequest, pb.GenerateResponse, True),
    "Prefill": (pb.PrefillRequest, pb.PrefillResponse, False),
    "Abort": (pb.AbortRequest, pb.AbortResponse, False),
    "WatchEvents": (pb.WatchEventsRequest, pb.WorkerEvent, True),
    "LoadLoraAdapter": (pb.LoadLoraAdapterRequest, pb.LoraAdapterInfo, False),
    "UnloadLoraAdapter": (pb.UnloadLoraAdapterRequest, pb.UnloadLoraAdapterResponse, False),
}


def add_worker_servicer(servicer, server) -> None:
    """Register `servicer` (a WorkerServicer) on the aio `server` with guarded parsing."""
    handlers = {}
    for name, (request_type, response_type, streaming) in METHODS.items():
        behavior = getattr(servicer, name)
        if streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _streaming(name, behavior, request_type), response_serializer=response_type.SerializeToString)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary(name, behavior, request_type), response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _parse(name: str, request_type, data: bytes, context):
    try:
        return request_type.FromString(data)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{name}: the request is not a valid {request_type.DESCRIPTOR.full_name} ({exc})")


def _streaming(name: str, behavior, request_type):
    async def handler(data: bytes, context):
        request = await _parse(name, request_type, data, context)
        async for message in behavior(request, context):
            yield message
    return handler


def _unary(name: str, behavior, request_type):
    async def handler(data: bytes, context):
        request = await _parse(name, request_type, data, context)
        return await behavior(request, context)
    return handler
