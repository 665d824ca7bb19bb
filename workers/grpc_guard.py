"""The Worker gRPC service registered so that malformed requests are the caller's error.

gRPC's generated registration deserializes each request before the servicer runs; bytes that
are not a valid message (random or truncated bytes, a field sent with the wrong wire type, a
string that is not UTF-8) then fail inside gRPC, which answers INTERNAL. Here the handlers take
the raw bytes and parse them themselves: a message that does not parse is INVALID_ARGUMENT
naming the method and the parse error, and nothing reaches the engine. Valid messages run the
servicer exactly as the generated registration would (same method names, same serializers).

Peer roles (`check_peer_roles`, on behind mutual TLS with per-role certificates): the caller's
certificate names its role in a SAN, `splitserve-router` or `splitserve-worker`
(platform/wire/grpc_tls.py). Each method admits the roles that call it: Generate, WatchEvents and the
LoRA calls the router; Prefill a decode worker; Abort either. Another caller gets
PERMISSION_DENIED before its request is parsed, so a stolen router certificate cannot pose as a
decode worker, nor a worker's as the router.
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


ROLE_OF_SAN = {b"splitserve-router": "router", b"splitserve-worker": "worker"}
ALLOWED_ROLES = {
    "Generate": {"router"},
    "WatchEvents": {"router"},
    "LoadLoraAdapter": {"router"},
    "UnloadLoraAdapter": {"router"},
    "Prefill": {"worker"},
    "Abort": {"router", "worker"},
}


def add_worker_servicer(servicer, server, check_peer_roles: bool = False) -> None:
    """Register `servicer` (a WorkerServicer) on the aio `server` with guarded parsing (and, with
    `check_peer_roles`, each method only for the roles in ALLOWED_ROLES)."""
    handlers = {}
    for name, (request_type, response_type, streaming) in METHODS.items():
        behavior = getattr(servicer, name)
        roles = ALLOWED_ROLES[name] if check_peer_roles else None
        if streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _streaming(name, behavior, request_type, roles), response_serializer=response_type.SerializeToString
            )
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary(name, behavior, request_type, roles), response_serializer=response_type.SerializeToString
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _parse(name: str, request_type, data: bytes, context):
    try:
        return request_type.FromString(data)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name}: the request is not a valid {request_type.DESCRIPTOR.full_name} ({exc})",
        )


def peer_roles(context) -> set[str]:
    """The roles the caller's verified certificate names in its SANs (empty without TLS)."""
    sans = (context.auth_context() or {}).get("x509_subject_alternative_name", [])
    return {ROLE_OF_SAN[san] for san in sans if san in ROLE_OF_SAN}


async def _check_role(name: str, roles: set[str] | None, context) -> None:
    if roles is None:
        return
    have = peer_roles(context)
    if not have & roles:
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{name} is for the {' or '.join(sorted(roles))} role; the caller's certificate names "
            f"{', '.join(sorted(have)) or 'no role'} (SAN splitserve-router or splitserve-worker)",
        )


def _streaming(name: str, behavior, request_type, roles: set[str] | None = None):
    async def handler(data: bytes, context):
        await _check_role(name, roles, context)
        request = await _parse(name, request_type, data, context)
        async for message in behavior(request, context):
            yield message

    return handler


def _unary(name: str, behavior, request_type, roles: set[str] | None = None):
    async def handler(data: bytes, context):
        await _check_role(name, roles, context)
        request = await _parse(name, request_type, data, context)
        return await behavior(request, context)

    return handler
