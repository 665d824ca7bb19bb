"""Authenticated KV-transfer connections: a challenge-response before any block is accepted.

Every worker of one InferenceService gets the same secret (a file, in Kubernetes a mounted
Secret; `splitserve up` writes a throwaway one). Both sides derive the connection key
K = HMAC-SHA256(secret, "splitserve-kv-transfer-v1"). On every new connection, before the
first "open" (stream.py), for tcp and ucx alike:

    receiver -> sender   {"type": "challenge", "nonce": 32 hex chars, fresh per connection}
    sender -> receiver   {"op": "auth", "mac": hex HMAC-SHA256(K, nonce)}

The receiver compares the mac in constant time; a wrong or missing one (or a sender that
starts with "open") closes the connection before any header is acted on: logged, counted, and
the worker keeps serving everyone else. The nonce makes a recorded handshake useless on a new
connection. What this does not do: encrypt or sign the blocks after the handshake (an
attacker on the path could still alter a connection it can hijack; see docs/security.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import pathlib

from splitserve.workers.transfer.stream import Channel

CONTEXT = b"splitserve-kv-transfer-v1"
HANDSHAKE_TIMEOUT_S = 10.0


class AuthError(Exception):
    """The peer did not prove it holds the service's secret."""


def derive_key(secret: bytes) -> bytes:
    if len(secret) < 16:
        raise ValueError(f"a KV-transfer secret needs at least 16 bytes, got {len(secret)}")
    return hmac.new(secret, CONTEXT, hashlib.sha256).digest()


def load_key(path: str) -> bytes:
    """The connection key from a secret file (surrounding whitespace ignored)."""
    try:
        secret = pathlib.Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the KV-transfer secret file {path!r}: {e.strerror}") from None
    return derive_key(secret)


def proof(key: bytes, nonce: str) -> str:
    return hmac.new(key, nonce.encode(), hashlib.sha256).hexdigest()


async def challenge(channel: Channel, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Receiver side: raises AuthError unless the peer answers the challenge correctly."""
    nonce = os.urandom(16).hex()
    await channel.send({"type": "challenge", "nonce": nonce})
    try:
        msg = await asyncio.wait_for(channel.recv(), timeout_s)
    except asyncio.TimeoutError:
        raise AuthError(f"no answer to the challenge within {timeout_s:g} s") from None
    if not isinstance(msg, dict) or msg.get("op") != "auth":
        raise AuthError(f"expected an auth message first, got op={msg.get('op') if isinstance(msg, dict) else msg!r}")
    mac = msg.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), proof(key, nonce).encode()):
        raise AuthError("wrong KV-transfer token (the peer's secret differs)")


async def answer(channel: Channel, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Sender side: answer the receiver's challenge on a fresh connection."""
    try:
        msg = await asyncio.wait_for(channel.recv(), timeout_s)
    except asyncio.TimeoutError:
        raise AuthError(f"the receiver sent no challenge within {timeout_s:g} s (is its KV auth on?)") from None
    if not isinstance(msg, dict) or msg.get("type") != "challenge" or not isinstance(msg.get("nonce"), str):
        raise AuthError(f"expected a challenge from the receiver, got {msg!r}")
    await channel.send({"op": "auth", "mac": proof(key, msg["nonce"])})
