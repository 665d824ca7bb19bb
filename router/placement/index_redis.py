"""The prefix index in Redis, so several router replicas share one view (index.py explains the
entries and the match rule).

Layout, per worker address W (prefix P = `index.key_prefix`):

    {P}:kv:W    sorted set  block hash -> time stored (wall clock)      stored entries, LRU by score
    {P}:kv2:W   sorted set  the same, for W's second tier (events with tier=2)
    {P}:spec:W  sorted set  block hash -> expiry time (wall clock)     speculative entries

Every replica watches every worker and applies the same events; the writes are idempotent
(ZADD / ZREM / DEL), and a replica that (re)subscribes applies the worker's snapshot (AllCleared
+ BlockStored of everything cached), which is the worker's current truth. A speculative entry
written by one replica is seen by all, which is what keeps a burst of shared-prefix requests
spread over replicas on the same worker. `match` is one round trip: a Lua script walks each
candidate's entries server-side and returns one count per worker (the keys share the hash tag
{P}, so the script also runs on a Redis Cluster). Expiry uses wall-clock time, so replicas need
synchronised clocks (NTP) only to within a fraction of the TTL.

Events of KV groups > 0 (a model mixing layer types) are not kept here yet: this backend matches on
group 0 alone, as if every group held what group 0 holds (the in-memory index applies the groups'
windows, index.py); a worker may then be scored for a prefix its sliding layers dropped, which
costs that request a recompute there, never a wrong token.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.placement.index import SECOND_TIER

# KEYS: kv, kv2, spec of each worker in turn; ARGV: now, then the prompt's block hashes in order.
# Returns each worker's run of held blocks from block 0, walking server-side and stopping at the
# first miss (one round trip, one integer per worker back).
_MATCH = """
local now = tonumber(ARGV[1])
local out = {}
for w = 1, #KEYS, 3 do
  local n = 0
  local has_second = redis.call('EXISTS', KEYS[w + 1]) == 1
  local has_spec = redis.call('EXISTS', KEYS[w + 2]) == 1
  for i = 2, #ARGV do
    if not redis.call('ZSCORE', KEYS[w], ARGV[i])
        and not (has_second and redis.call('ZSCORE', KEYS[w + 1], ARGV[i])) then
      if not has_spec then break end
      local expiry = redis.call('ZSCORE', KEYS[w + 2], ARGV[i])
      if not expiry or tonumber(expiry) <= now then break end
    end
    n = n + 1
  end
  out[#out + 1] = n
end
return out
"""


class RedisPrefixIndex:
    def __init__(
        self,
        url: str,
        key_prefix: str = "splitserve",
        ttl_s: float = 10.0,
        max_blocks_per_worker: int = 262_144,
        clock=time.time,
    ):
        self.redis = aioredis.from_url(url)
        self.prefix = "{" + key_prefix + "}"  # a hash tag: all keys in one cluster slot, for the script
        self._match_script = self.redis.register_script(_MATCH)
        self.ttl_s = ttl_s
        self.max_blocks_per_worker = max_blocks_per_worker
        self.clock = clock

    def _kv(self, worker: str) -> str:
        return f"{self.prefix}:kv:{worker}"

    def _tier(self, worker: str, tier: int) -> str:
        return f"{self.prefix}:kv2:{worker}" if tier == SECOND_TIER else self._kv(worker)

    def _spec(self, worker: str) -> str:
        return f"{self.prefix}:spec:{worker}"

    async def apply(self, worker: str, event: pb.KVEvent) -> None:
        kind = event.WhichOneof("event")
        if kind in ("stored", "removed") and getattr(event, kind).group:
            return  # KV groups > 0: module docstring
        pipe = self.redis.pipeline(transaction=False)
        if kind == "stored" and event.stored.block_hashes:
            hashes = list(event.stored.block_hashes)
            now = self.clock()
            # Later blocks of the chain score slightly older, so the bound drops a chain's tail first.
            key = self._tier(worker, event.stored.tier)
            pipe.zadd(key, {h: now - i * 1e-6 for i, h in enumerate(hashes)})
            pipe.zremrangebyrank(key, 0, -(self.max_blocks_per_worker + 1))
            pipe.zrem(self._spec(worker), *hashes)
        elif kind == "removed" and event.removed.block_hashes:
            pipe.zrem(self._tier(worker, event.removed.tier), *event.removed.block_hashes)
        elif kind == "cleared":
            pipe.delete(self._kv(worker), self._tier(worker, SECOND_TIER), self._spec(worker))
        await pipe.execute()

    async def clear(self, worker: str) -> None:
        await self.redis.delete(self._kv(worker), self._tier(worker, SECOND_TIER), self._spec(worker))

    async def add_speculative(self, worker: str, hashes: list[bytes]) -> None:
        if self.ttl_s <= 0 or not hashes:
            return
        now = self.clock()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(self._spec(worker), "-inf", now)
        pipe.zadd(self._spec(worker), dict.fromkeys(hashes, now + self.ttl_s))
        pipe.zremrangebyrank(self._spec(worker), 0, -(self.max_blocks_per_worker + 1))
        pipe.expire(self._spec(worker), max(1, int(self.ttl_s * 2)))
        await pipe.execute()

    async def match(self, workers: list[str], hashes: list[bytes]) -> dict[str, int]:
        if not hashes or not workers:
            return dict.fromkeys(workers, 0)
        keys = [
            key for worker in workers for key in (self._kv(worker), self._tier(worker, SECOND_TIER), self._spec(worker))
        ]
        counts = await self._match_script(keys=keys, args=[repr(self.clock()), *hashes])
        return dict(zip(workers, (int(c) for c in counts), strict=False))

    async def num_blocks(self, worker: str) -> int:
        return await self.redis.zcard(self._kv(worker))

    async def close(self) -> None:
        await self.redis.aclose()
