"""Block hashing: the identity of a block of KV, shared by engine, KV events and router.

A block's hash covers everything that determines its keys and values: the hash of the block
before it (so equal tokens after different prefixes hash differently), the block's token ids,
and extra keys (a LoRA adapter's identity, a cache salt). Only full blocks are hashed: a partial block may
still change, so it is never shared.

    root   = sha256("splitserve-block-hash" | version | block_size | model_id)[:16]
    hash_i = sha256(hash_{i-1} | uint32-le token ids | encoded extra keys)[:16]   (hash_{-1} = root)

Extra keys are domain-tagged tuples (`lora_extra_keys`: "lora", name, weights digest), put into
every block's hash, not only the first: a base request and an adapter request, or two adapters,
or two different adapters loaded one after the other under one name, never share a block.
A base request has no extra keys, so its hashes are those of a server without LoRA.

The model id and block size sit in the root, so two workers only agree on a hash when they run
the same weights with the same block size. Hashes are 16-byte digests (collisions need ~2^64
blocks), never Python's `hash()` (salted per process). Bump HASH_VERSION whenever this encoding
changes: the golden vectors in tests/platform/test_hashing.py pin it. Torch-free.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = 1
DIGEST_BYTES = 16

BlockHash = bytes
ExtraKey = str | int | bytes


def root_hash(model_id: str, block_size: int) -> BlockHash:
    """The parent hash of a sequence's first block for this model and block size."""
    h = hashlib.sha256(b"splitserve-block-hash")
    h.update(struct.pack("<II", HASH_VERSION, block_size))
    h.update(model_id.encode("utf-8"))
    return h.digest()[:DIGEST_BYTES]


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """The hash of one full block, given its parent's hash."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    for key in extra_keys:
        h.update(_encode_extra_key(key))
    return h.digest()[:DIGEST_BYTES]


def lora_extra_keys(name: str | None, digest: bytes | None) -> tuple[ExtraKey, ...]:
    """The extra keys of an adapter request: ("lora", name, digest); () for the base model.
    Engine, KV events and router all use this one function."""
    if name is None:
        return ()
    if not isinstance(digest, bytes) or not digest:
        raise ValueError(f"adapter {name!r} needs its weights digest (bytes) in the block hash")
    return ("lora", name, digest)


def _encode_extra_key(key: ExtraKey) -> bytes:
    # type tag + length + payload: "1" and 1 and b"1" must not collide.
    if isinstance(key, bool) or not isinstance(key, (str, int, bytes)):
        raise TypeError(f"extra key must be str, int or bytes, got {type(key).__name__}")
    if isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode("ascii")
    else:
        tag, payload = b"b", key
    return tag + struct.pack("<I", len(payload)) + payload


class BlockHasher:
    """Hashes the full blocks of token sequences for one model and block size."""

    def __init__(self, model_id: str, block_size: int):
        self.block_size = block_size
        self.root = root_hash(model_id, block_size)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKey] = (),
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Hashes of the full blocks from `start_block` on; `parent` is block start_block-1's hash."""
        if parent is None:
            assert start_block == 0, "a parent hash is needed to continue a chain"
            parent = self.root
        hashes = []
        bs = self.block_size
        for i in range(start_block, len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
            hashes.append(parent)
        return hashes
