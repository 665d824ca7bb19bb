"""Authenticated KV-transfer connections: a mutual challenge-response before any block moves.

Every worker of one InferenceService gets the same secret (a file, in Kubernetes a mounted
Secret; `splitserve up` writes a throwaway one). Both sides derive the connection key
K = HMAC-SHA256(secret, "splitserve-kv-transfer-v2"). On every new connection, before the
first "open" (stream.py), for tcp and ucx alike:

    receiver -> sender   {"type": "challenge", "nonce": Nr}
    sender -> receiver   {"op": "auth", "nonce": Ns, "mac": M("sender", Nr, Ns, R)}
    receiver -> sender   {"type": "auth_ok", "mac": M("receiver", Nr, Ns, R)}

with Nr, Ns 16 fresh random bytes (hex) per connection and side, and
M(label, ...) = hex HMAC-SHA256(K, JSON [label, Nr, Ns, R]). R is the receiver's identity:
its advertised KV address (`scheme://host:port`). The sender puts in the address *it dialed*;
the receiver checks against *its own*. Then the session key
S = HMAC-SHA256(K, JSON ["session", Nr, Ns, R]) authenticates each transfer on the connection:
every "open" header carries "tag": hex HMAC-SHA256(S, transfer_id), checked before the
transfer is bound.

Why each part:
- Nr: a recorded answer is useless on a new connection (replay).
- R: a rogue receiver that relays an honest sender's answer to a real decode worker fails, because
  the sender bound its MAC to the rogue's address, not the decode worker's (relay).
- auth_ok with Ns: the sender learns the receiver holds K before any block goes out, so a rogue
  listener on a decode worker's address gets no KV blocks (and thereby no prompt contents).
- labels: neither side's MAC can be replayed as the other's.
- tag: an "open" for a transfer id is accepted only from the party that ran this handshake;
  a guessed id (`{req_id}/{12 hex}`) is not enough.

A wrong or missing message closes the connection before any header is acted on: logged,
counted, and the worker keeps serving everyone else. What this does not do: encrypt or sign
the block payloads after the handshake (an attacker on the path could alter a connection it
can hijack; see docs/security.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import pathlib

from splitserve.workers.transfer.stream import Channel

CONTEXT = b"splitserve-kv-transfer-v2"
HANDSHAKE_TIMEOUT_S = 10.0


class AuthError(Exception):
    """The peer did not prove it holds the service's secret (or answered for another receiver)."""


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


def _mac(key: bytes, label: str, nr: str, ns: str, receiver: str) -> bytes:
    return hmac.new(key, json.dumps([label, nr, ns, receiver]).encode(), hashlib.sha256).digest()


def proof(key: bytes, label: str, nr: str, ns: str, receiver: str) -> str:
    return _mac(key, label, nr, ns, receiver).hex()


def transfer_tag(session_key: bytes, transfer_id: str) -> str:
    """The "tag" of an "open" header: binds the transfer to the authenticated connection."""
    return hmac.new(session_key, transfer_id.encode(), hashlib.sha256).hexdigest()


def is_valid_tag(session_key: bytes, transfer_id: str, tag: object) -> bool:
    return isinstance(tag, str) and hmac.compare_digest(tag.encode(), transfer_tag(session_key, transfer_id).encode())


async def _recv(channel: Channel, timeout_s: float, waiting_for: str) -> dict:
    try:
        msg = await asyncio.wait_for(channel.recv(), timeout_s)
    except TimeoutError:
        raise AuthError(f"no {waiting_for} within {timeout_s:g} s") from None
    if not isinstance(msg, dict):
        raise AuthError(f"expected {waiting_for}, got {msg!r}")
    return msg


def _check(mac: object, want: str, what: str) -> None:
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), want.encode()):
        raise AuthError(what)


def _nonce(msg: dict) -> str:
    nonce = msg.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 32:
        raise AuthError(f"a handshake nonce must be 32 hex characters, got {nonce!r}")
    return nonce


async def challenge(channel: Channel, key: bytes, identity: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bytes:
    """Receiver side, as `identity` (its advertised KV address): returns the session key, or
    raises AuthError unless the peer proves it holds K and meant to reach this receiver."""
    nr = os.urandom(16).hex()
    await channel.send({"type": "challenge", "nonce": nr})
    msg = await _recv(channel, timeout_s, "answer to the challenge")
    if msg.get("op") != "auth":
        raise AuthError(f"expected an auth message first, got op={msg.get('op')!r}")
    ns = _nonce(msg)
    _check(
        msg.get("mac"),
        proof(key, "sender", nr, ns, identity),
        f"wrong KV-transfer proof (the peer's secret differs, or it answered for another receiver than {identity})",
    )
    await channel.send({"type": "auth_ok", "mac": proof(key, "receiver", nr, ns, identity)})
    return _mac(key, "session", nr, ns, identity)


async def answer(channel: Channel, key: bytes, receiver: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bytes:
    """Sender side, on a fresh connection to the receiver it dialed as `receiver`: returns the
    session key, or raises AuthError unless the receiver proves it holds K too."""
    msg = await _recv(channel, timeout_s, "challenge from the receiver (is its KV auth on?)")
    if msg.get("type") != "challenge":
        raise AuthError(f"expected a challenge from the receiver, got {msg!r}")
    nr, ns = _nonce(msg), os.urandom(16).hex()
    await channel.send({"op": "auth", "nonce": ns, "mac": proof(key, "sender", nr, ns, receiver)})
    reply = await _recv(channel, timeout_s, "proof from the receiver")
    if reply.get("type") != "auth_ok":
        raise AuthError(f"the receiver did not accept our proof: {reply!r}")
    _check(
        reply.get("mac"),
        proof(key, "receiver", nr, ns, receiver),
        f"the receiver at {receiver} could not prove it holds the service's secret",
    )
    return _mac(key, "session", nr, ns, receiver)
