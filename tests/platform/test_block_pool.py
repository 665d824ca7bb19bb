"""Block pool and KV manager, driven step by step on plain objects with exact expectations."""

import random

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.kv.block_pool import AllCleared, BlockPool, BlockRemoved, BlockStored
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sched.request import Request

BS = 4
HASHER = BlockHasher("test-model", BS)


def make_req(req_id, tokens):
    return Request(req_id, tokens, SamplingParams(max_tokens=8), HASHER)


def free_order(pool):
    """The free blocks in the order allocate takes them: probation, then protected."""
    return list(pool._free) + list(pool._protected)


def test_blocks_without_a_hash_are_taken_before_cached_ones_and_cached_ones_in_lru_order():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert free_order(pool) == [3, 4, 5]
    pool.cache_blocks(a[:2], [b"a" * 16, b"b" * 16], None)
    pool.free(reversed(a))  # tail first: 2 (no hash) to the head, 1 and 0 (cached) to the tail
    assert free_order(pool) == [2, 3, 4, 5, 1, 0]
    assert all(b.ref_cnt == 0 for b in a)
    assert [b.block_id for b in pool.allocate(5)] == [2, 3, 4, 5, 1]  # 1 is evicted before 0
    assert pool.cached_hashes() == [b"a" * 16]
    pool.check_invariants()


def serve_once(kv, req):
    """Allocate `req` after its cached prefix, compute it, register its blocks and free them:
    the number of prompt tokens the cache gave it."""
    hits = kv.find_cached_prefix(req)
    assert kv.allocate(req, req.num_tokens - len(hits) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    kv.register_computed_blocks(req)
    kv.free(req)
    kv.check_invariants()
    return len(hits) * BS


def test_a_prefix_that_was_hit_outlives_younger_blocks_nobody_reused():
    """A group's system prompt (2 blocks), hit once, then unique requests that cycle the other
    8 blocks of the pool several times over: the system prompt is still cached for the group's
    next request. Without the hit it is evicted like any other block (the LRU order)."""
    system = [7] * 8

    def run(hit_first: bool) -> int:
        kv = KVCacheManager(BlockPool(10), BS)
        serve_once(kv, make_req("g1", system + [1, 2, 3, 4, 5]))
        if hit_first:
            assert serve_once(kv, make_req("g2", system + [6, 7, 8, 9, 10])) == 8
        for i in range(8):  # 3 blocks each, 2 of them cached and never asked for again
            serve_once(kv, make_req(f"u{i}", [100 + i] * 8 + [1]))
        assert kv.pool.stats.num_evictions >= 8  # the pool was full and turned over
        return serve_once(kv, make_req("g3", system + [11, 12, 13, 14, 15]))

    assert run(hit_first=True) == 8
    assert run(hit_first=False) == 0


def test_protected_blocks_age_out_past_their_share():
    """Five prefixes of 2 blocks, each hit once, in a pool of 10 whose protected queue holds 8:
    the first one hit goes back on probation (still cached, evicted first, tail first)."""
    pool = BlockPool(10)
    assert pool.max_protected == 8
    for i in range(5):
        blocks = pool.allocate(2)
        pool.cache_blocks(blocks, [bytes([i, 0]) * 8, bytes([i, 1]) * 8], None)
        pool.free(reversed(blocks))
        pool.touch(blocks, hit=True)
        pool.free(reversed(blocks))
        pool.check_invariants()
    assert free_order(pool) == [1, 0, 3, 2, 5, 4, 7, 6, 9, 8]
    assert list(pool._free) == [1, 0] and not pool.blocks[0].reused
    assert pool.lookup(bytes([0, 0]) * 8) is pool.blocks[0]  # aged out, not evicted
    pool.allocate(1)
    assert pool.lookup(bytes([0, 1]) * 8) is None and pool.lookup(bytes([0, 0]) * 8) is pool.blocks[0]
    pool.check_invariants()


def test_prefix_hit_revives_free_block_and_eviction_emits_events():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    r1 = make_req("r1", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate(r1, 10)
    assert kv.block_ids("r1") == [0, 1, 2]
    r1.num_computed_tokens = 10
    kv.register_computed_blocks(r1)
    assert pool.take_events() == [BlockStored(tuple(r1.block_hashes[:2]), None)]
    kv.free(r1)
    assert free_order(pool) == [2, 3, 1, 0]  # 2 has no hash: first; the chain's tail before its head
    # Same prefix: both full blocks hit (the request has 12 tokens, at most 11 can be reused).
    r2 = make_req("r2", list(range(8)) + [99, 98, 97, 96])
    hits = kv.find_cached_prefix(r2)
    assert [b.block_id for b in hits] == [0, 1]
    assert kv.allocate(r2, 4, hits)
    assert kv.block_ids("r2") == [0, 1, 2]
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]
    kv.check_invariants()
    # A request needing 2 new blocks: only block 3 is free, so it is refused.
    r3 = make_req("r3", [7] * 8)
    assert not kv.allocate(r3, 8)
    kv.check_invariants()


def test_last_token_is_always_recomputed():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    r1 = make_req("r1", list(range(8)))
    kv.allocate(r1, 8)
    r1.num_computed_tokens = 8
    kv.register_computed_blocks(r1)
    kv.free(r1)
    r2 = make_req("r2", list(range(8)))  # identical prompt, exactly 2 blocks
    assert len(kv.find_cached_prefix(r2)) == 1  # not 2: the last token's logits are needed


def test_evicting_cached_block_removes_hash():
    pool = BlockPool(2)
    kv = KVCacheManager(pool, BS)
    r1 = make_req("r1", list(range(8)))
    kv.allocate(r1, 8)
    r1.num_computed_tokens = 8
    kv.register_computed_blocks(r1)
    stored = r1.block_hashes
    kv.free(r1)
    pool.take_events()
    r2 = make_req("r2", [50] * 8)
    assert kv.allocate(r2, 8)
    assert pool.take_events() == [BlockRemoved((stored[1], stored[0]))]
    assert pool.cached_hashes() == []
    assert pool.stats.num_evictions == 2
    kv.check_invariants()


def test_duplicate_content_keeps_first_block():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    a, b = make_req("a", [1, 2, 3, 4, 5]), make_req("b", [1, 2, 3, 4, 6])
    kv.allocate(a, 5)
    kv.allocate(b, 5)  # scheduled together: neither can hit the other's uncomputed block
    for r in (a, b):
        r.num_computed_tokens = 5
        kv.register_computed_blocks(r)
    assert pool.lookup(a.block_hashes[0]).block_id == kv.block_ids("a")[0]
    kv.free(a)
    kv.free(b)
    kv.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.cache_blocks(blocks, [b"x" * 16], None)
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events()[-1] == AllCleared()
    pool.check_invariants()


def test_randomised_allocate_free_keeps_invariants():
    rng = random.Random(1234)
    pool = BlockPool(32)
    kv = KVCacheManager(pool, BS)
    live = {}
    for step in range(2000):
        if live and rng.random() < 0.4:
            req = live.pop(rng.choice(sorted(live)))
            kv.free(req)
        else:
            prefix = [rng.randrange(3)] * rng.choice([0, 4, 8])
            req = make_req(f"r{step}", prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 20))])
            hits = kv.find_cached_prefix(req)
            if kv.allocate(req, req.num_tokens - len(hits) * BS, hits):
                req.num_computed_tokens = req.num_tokens
                kv.register_computed_blocks(req)
                live[req.req_id] = req
        kv.check_invariants()
    for req in live.values():
        kv.free(req)
    kv.check_invariants()
    assert pool.num_free_blocks == 32
