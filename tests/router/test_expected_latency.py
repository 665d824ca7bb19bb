"""The expected-latency scorer orders workers by the prompt tokens each computes before the
request's first token. Inputs shaped like the shared-prefix sweep's (docs/benchmarks/sweep.md):
an 80-token prompt whose 64-token system prompt (4 blocks of 16) one worker holds, and load
reports as two pinned workers send them under load."""

import asyncio
import random

import pytest

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import PlacementConfig, ProfileConfig, ScorerSpec
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.placer import PlacementRequest, Placer
from splitserve.router.placement.pool import WorkerPool, WorkerState
from splitserve.router.placement.scorers import ScoringContext, make_scorer

BS = 16
PROMPT = 80  # 64-token system prompt + 16-token question
SYSTEM_BLOCKS = 4


def worker(address, waiting=0, running=0, queued=0, pending=0, pending_tokens=0):
    w = WorkerState(
        address, role="both", is_connected=True, num_pending=pending, num_pending_prefill_tokens=pending_tokens
    )
    w.load = pb.LoadReport(num_waiting=waiting, num_running=running, queued_prefill_tokens=queued)
    return w


def ranked(scores: dict[str, float]) -> list[str]:
    return sorted(scores, key=lambda a: -scores[a])


def score(workers, matched, params=None):
    ctx = ScoringContext(PROMPT, PROMPT // BS, matched, block_size=BS)
    return make_scorer("expected-latency", params).score(ctx, workers)


def test_idle_workers_the_holder_of_the_prompt_wins_by_the_tokens_it_saves():
    s = score([worker("hit"), worker("miss")], {"hit": SYSTEM_BLOCKS})
    # 16 uncached tokens against 80 plus the 64 held elsewhere (floor 16): 32 / 32 against 32 / 160
    assert s == {"hit": pytest.approx(1.0), "miss": pytest.approx(0.2)}
    once = score([worker("hit"), worker("miss")], {"hit": SYSTEM_BLOCKS}, {"duplicate_cost": 1e-9})
    assert once["miss"] == pytest.approx(1 / 3)  # the copy's later cost off: 32 / 96


def test_a_few_queued_requests_do_not_move_a_group_off_its_prompt():
    """Three more running requests and a waiting miss of another group (prefix+queue's default
    weights move the group at about this imbalance) cost 12 + 4 + 80 tokens; the copy of the
    prompt costs 64 now and 64 later: the holder still wins. Counted once, the copy would win."""
    hit = worker("hit", running=3, waiting=1, queued=80)
    miss = worker("miss", running=1)
    assert ranked(score([hit, miss], {"hit": SYSTEM_BLOCKS})) == ["hit", "miss"]
    assert ranked(score([hit, miss], {"hit": SYSTEM_BLOCKS}, {"duplicate_cost": 1e-9})) == ["miss", "hit"]


def test_a_queue_deeper_than_the_prompt_sends_the_request_to_the_idle_worker():
    hit = worker("hit", running=4, waiting=4, queued=4 * PROMPT)
    miss = worker("miss")
    assert ranked(score([hit, miss], {"hit": SYSTEM_BLOCKS})) == ["miss", "hit"]


def test_pending_prefills_this_router_sent_count_before_any_load_report_shows_them():
    """A burst: three requests of another group just went to `hit`, no report yet."""
    quiet = score([worker("hit"), worker("miss")], {"hit": SYSTEM_BLOCKS})
    burst = score([worker("hit", pending=3, pending_tokens=3 * PROMPT), worker("miss")], {"hit": SYSTEM_BLOCKS})
    assert ranked(quiet) == ["hit", "miss"] and ranked(burst) == ["miss", "hit"]


def test_equal_load_and_cache_is_a_tie_and_more_cache_is_better_at_equal_load():
    assert score([worker("a", running=2), worker("b", running=2)], {}) == {"a": 1.0, "b": 1.0}
    s = score([worker("a", running=2), worker("b", running=2)], {"a": 2, "b": 4})
    assert ranked(s) == ["b", "a"]


def test_request_tokens_sets_what_one_request_on_a_worker_weighs():
    hit = worker("hit", running=8)
    miss = worker("miss")
    assert ranked(score([hit, miss], {"hit": SYSTEM_BLOCKS})) == ["hit", "miss"]  # 8 x 4 < 2 x 64
    assert ranked(score([hit, miss], {"hit": SYSTEM_BLOCKS}, {"request_tokens": 20})) == ["miss", "hit"]


def test_scores_stay_in_range_and_the_least_work_scores_one():
    rng = random.Random(1)
    for _ in range(200):
        workers = [
            worker(
                a, rng.randint(0, 30), rng.randint(0, 30), rng.randint(0, 5000), rng.randint(0, 5), rng.randint(0, 800)
            )
            for a in "abc"
        ]
        s = score(workers, {a: rng.randint(0, PROMPT // BS) for a in "abc"})
        assert all(0.0 < v <= 1.0 for v in s.values()) and max(s.values()) == pytest.approx(1.0)


def test_a_placer_with_the_scorer_keeps_a_group_on_its_worker_through_a_burst():
    """The Placer end to end: eight requests of one group arrive before any load report changes;
    each placement adds a pending request and its uncached tokens on its worker. `a` holds the
    system prompt: the k-th request there costs 16 + 20k tokens (its question, k pending
    questions and 4 per pending request), on `b` 80 + 64 (the whole prompt, and the copy's
    later cost), so `a` takes seven before the eighth is cheaper on `b`."""
    pool = WorkerPool("smollm2-135m", BS)
    for address in ("a", "b"):
        state = pool.add(address)
        state.role, state.is_connected = "both", True
        state.load = pb.LoadReport()
    index = InMemoryPrefixIndex()
    profile = ProfileConfig(filters=("healthy",), scorers=(ScorerSpec("expected-latency", 1.0),))
    placer = Placer(PlacementConfig(decode=profile), pool, index, random.Random(0))
    hashes = [bytes([i]) * 8 for i in range(PROMPT // BS)]

    async def run():
        await index.add_speculative("a", hashes[:SYSTEM_BLOCKS])
        picks = []
        for i in range(8):
            request_hashes = hashes[:SYSTEM_BLOCKS] + [bytes([100 + i]) * 8]
            decision = await placer.place(PlacementRequest(PROMPT, request_hashes))
            pool.assign(decision.decode, "", decision.num_uncached_tokens)
            picks.append(decision.decode)
        return picks

    picks = asyncio.run(run())
    assert picks == ["a"] * 7 + ["b"]
