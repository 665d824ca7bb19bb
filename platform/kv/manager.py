"""Per-request block tables on top of the block pool, and prefix-cache lookup.

A request's blocks are a list in token order: block i holds tokens [i*B, (i+1)*B). On first
scheduling the longest run of the request's block hashes found in the pool is reused; at most
(num_tokens - 1) // B blocks are reused so the last prompt token is always computed again (its
logits are needed to sample). A run of blocks the pool lacks but the second tier holds (`tier`,
platform/kv/tier.py) is copied back into the pool first and counts as hits. After each step the
blocks that became full *and* computed are registered in the prefix cache under the request's block
hashes.
"""

from __future__ import annotations

from splitserve.platform.kv.block_pool import Block, BlockPool
from splitserve.platform.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the mapping req_id -> blocks; the pool owns the blocks themselves. A single-group
    model's manager (a model mixing layer types has grouped.GroupedKVCacheManager)."""

    is_grouped = False

    def __init__(self, pool: BlockPool, block_size: int, tier=None):
        self.pool = pool
        self.tier = tier  # the second tier (KVTier) or None
        self.block_size = block_size
        self._req_blocks: dict[str, list[Block]] = {}
        self._num_registered: dict[str, int] = {}

    def find_cached_prefix(self, req: Request) -> list[Block]:
        """The longest prefix of `req`'s blocks already in the cache (not yet referenced). None
        for a request that wants prompt logprobs: it needs every position's logits."""
        if not self.pool.enable_caching or req.params.prompt_logprobs is not None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes[:max_blocks]
        hits = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.tier is not None and len(hits) < len(hashes):
            parent = hashes[len(hits) - 1] if hits else None
            hits += self.tier.restore(self.pool, hashes[len(hits) :], parent, hits)
        return hits

    def num_cached_prefix_tokens(self, num_tokens: int, block_hashes) -> int:
        """How many leading tokens of a prompt with these block hashes the cache holds now, at most
        num_tokens - 1, the second tier's blocks included (a read-only estimate: nothing is referenced)."""
        max_blocks = (num_tokens - 1) // self.block_size
        n = 0
        for block_hash in block_hashes[:max_blocks]:
            if not self.pool.peek(block_hash) and not (self.tier is not None and self.tier.holds(block_hash)):
                break
            n += self.block_size
        return n

    def can_fit(self, req: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        return self._num_blocks_needed(req, num_new_tokens, cached) <= self.pool.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens of `req` (after `cached` hits, if any).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        need = self._num_blocks_needed(req, num_new_tokens, cached)
        if need > self.pool.num_free_blocks:
            return False
        blocks = self._req_blocks.setdefault(req.req_id, [])
        self.pool.touch(cached, hit=True)
        blocks.extend(cached)
        self._num_registered.setdefault(req.req_id, 0)
        self._num_registered[req.req_id] += len(cached)
        num_new_blocks = cdiv(
            req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens, self.block_size
        ) - len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        return True

    def _num_blocks_needed(self, req: Request, num_new_tokens: int, cached: list[Block]) -> int:
        """Free-queue blocks consumed: new blocks plus cached hits revived from the free queue."""
        num_held = len(self._req_blocks.get(req.req_id, ())) + len(cached)
        num_tokens = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_new = max(0, cdiv(num_tokens, self.block_size) - num_held)
        return num_new + sum(1 for b in cached if b.ref_cnt == 0)

    def register_computed_blocks(self, req: Request) -> None:
        """Put the blocks that are now full and computed into the prefix cache."""
        blocks = self._req_blocks.get(req.req_id)
        if not blocks:
            return
        start = self._num_registered[req.req_id]
        end = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(blocks))
        if end <= start:
            return
        parent = req.block_hashes[start - 1] if start > 0 else None
        self.pool.cache_blocks(blocks[start:end], req.block_hashes[start:end], parent)
        self._num_registered[req.req_id] = end

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free `req`'s blocks past those `num_tokens` tokens need (rejected speculative tokens'
        slots), tail first, as if those tokens had never been scheduled. Only blocks never
        registered in the prefix cache can be past that point."""
        blocks = self._req_blocks.get(req.req_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        assert self._num_registered[req.req_id] <= keep, "a registered block would be trimmed"
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(extra))

    def free(self, req: Request) -> None:
        """Release all of `req`'s blocks, tail first (its last blocks are evicted first)."""
        blocks = self._req_blocks.pop(req.req_id, [])
        self._num_registered.pop(req.req_id, None)
        self.pool.free(reversed(blocks))

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def num_blocks_held(self, req_id: str) -> list[int]:
        """Blocks `req_id` holds now, as a one-group list (grouped.GroupedKVCacheManager's shape)."""
        return [len(self._req_blocks.get(req_id, ()))]

    def group_usage(self) -> list[dict]:
        """The one group's usage, in GroupedKVCacheManager.group_usage's shape."""
        held = {b.block_id for blocks in self._req_blocks.values() for b in blocks}
        return [
            {
                "group": 0,
                "kind": "full",
                "layers": "all",
                "num_blocks_in_use": len(held),
                "num_cached_blocks": self.pool.num_cached_blocks,
            }
        ]

    @property
    def num_requests(self) -> int:
        return len(self._req_blocks)

    def check_invariants(self) -> None:
        """Pool invariants, plus: every held block's ref count covers its holders."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for blocks in self._req_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} requests"
            )
