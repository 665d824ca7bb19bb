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
    return list(pool._free)


def test_allocate_pops_lru_head_and_free_appends_tail():
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert free_order(pool) == [2, 3, 4, 5]
    pool.free(reversed(a))
    assert free_order(pool) == [2, 3, 4, 5, 1, 0]
    assert all(b.ref_cnt == 0 for b in a)
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
    assert free_order(pool) == [3, 2, 1, 0]  # tail of the chain first
    # Same prefix: both full blocks hit (the request has 12 tokens, at most 11 can be reused).
    r2 = make_req("r2", list(range(8)) + [99, 98, 97, 96])
    hits = kv.find_cached_prefix(r2)
    assert [b.block_id for b in hits] == [0, 1]
    assert kv.allocate(r2, 4, hits)
    assert kv.block_ids("r2") == [0, 1, 3]
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    kv.check_invariants()
    # A request needing 2 new blocks evicts block 2 (uncached) then... only 1 is free: refused.
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
