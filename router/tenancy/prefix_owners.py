"""Which tenants sent which prompt prefixes: `cached_tokens` reports only a tenant's own prefixes.

The workers' prefix cache is shared by every tenant (it is what makes a repeated system prompt
cheap), and `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were served
from it. Reported as is, that number answers another tenant's question "did someone send this
prefix?": guess a prompt, read how many tokens hit.

So with API keys the gateway reports a cache hit only as far as the tenant itself sent the
prefix before: `PrefixOwners` remembers, per block hash of the prompts (the same hashes
placement uses, platform/hashing.py), the keys that sent it; a response's cached_tokens is
clamped to the leading blocks the asking key already sent. Each block's hash chains over every
token before it, so owning block i means having sent the whole prefix up to it.

Bounded: at most `max_blocks` hashes (least recently sent dropped first) and `MAX_OWNERS` keys
per hash (a prefix sent by more keys than that is common knowledge, reported to the keys
remembered). Per router replica: a tenant's own hit through another replica, or after a
restart, is under-reported, never over-reported.

What this does not hide: the time to first token still shows a cache hit. The engine-side cure is
to salt the block hash chain per tenant (vLLM's `cache_salt`), at the price of every tenant's
shared prefixes; docs/security.md names both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MAX_BLOCKS = 200_000
MAX_OWNERS = 16


class PrefixOwners:
    def __init__(self, block_size: int, max_blocks: int = MAX_BLOCKS):
        assert block_size > 0 and max_blocks > 0
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._owners: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def owned_tokens(self, tenant: str, hashes: Sequence[bytes]) -> int:
        """Prompt tokens, from the start, in blocks `tenant` sent before."""
        num_blocks = 0
        for block_hash in hashes:
            if tenant not in self._owners.get(block_hash, ()):
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def record(self, tenant: str, hashes: Sequence[bytes]) -> None:
        """`tenant` sent a prompt with these block hashes."""
        for block_hash in hashes:
            owners = self._owners.pop(block_hash, ())
            if tenant not in owners and len(owners) < MAX_OWNERS:
                owners = (*owners, tenant)
            self._owners[block_hash] = owners
        while len(self._owners) > self.max_blocks:
            self._owners.popitem(last=False)

    def clamp(self, tenant: str, hashes: Sequence[bytes]) -> int:
        """owned_tokens before this prompt, then record it: the cap of its cached_tokens."""
        owned = self.owned_tokens(tenant, hashes)
        self.record(tenant, hashes)
        return owned
