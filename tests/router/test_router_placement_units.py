"""Scorers, filters and the placement pipeline, table-driven on plain objects (no network)."""

import asyncio
import random

import pytest

from splitserve.platform.errors import ConfigError
from splitserve.platform.hashing import BlockHasher
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import (
    DisaggregationConfig,
    PlacementConfig,
    ProfileConfig,
    ScorerSpec,
    default_decode_profile,
)
from splitserve.router.errors import NoWorkerError
from splitserve.router.placement.filters import FILTERS, make_filter
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.placer import PlacementRequest, Placer, Profile
from splitserve.router.placement.pool import WorkerPool, WorkerState
from splitserve.router.placement.scorers import NEUTRAL, SCORERS, ScoringContext, make_scorer

MODEL, BS = "smollm2-135m", 16


def worker(
    address="w",
    role="decode",
    waiting=0,
    running=0,
    kv=0.0,
    queued=0,
    pending=0,
    pending_tokens=0,
    draining=False,
    load=True,
    connected=True,
    cached=0,
    total=0,
):
    w = WorkerState(
        address,
        role=role,
        is_connected=connected,
        num_pending=pending,
        num_pending_prefill_tokens=pending_tokens,
        num_total_blocks=total,
    )
    if load:
        w.load = pb.LoadReport(
            num_waiting=waiting,
            num_running=running,
            kv_usage=kv,
            queued_prefill_tokens=queued,
            draining=draining,
            num_cached_blocks=cached,
        )
    return w


# ---- scorers: (scorer, params, worker kwargs, matched blocks, prompt blocks, expected score) ----------
SCORER_CASES = [
    ("prefix-overlap", {}, {}, 8, 8, 1.0),
    ("prefix-overlap", {}, {}, 2, 8, 0.25),
    ("prefix-overlap", {}, {}, 0, 8, 0.0),
    ("prefix-overlap", {}, {}, 0, 0, NEUTRAL),  # nothing to reuse: neutral
    ("queue-depth", {}, dict(waiting=0, running=0), 0, 1, 1.0),
    ("queue-depth", {}, dict(waiting=2, running=2), 0, 1, 0.5),  # 4 of saturation 8
    ("queue-depth", {}, dict(waiting=20), 0, 1, 0.0),
    ("queue-depth", {"saturation": 4}, dict(running=1), 0, 1, 0.75),
    ("queue-depth", {}, dict(load=False), 0, 1, NEUTRAL),  # no load report yet
    ("kv-usage", {}, dict(kv=0.25), 0, 1, 0.75),
    ("kv-usage", {}, dict(kv=1.0), 0, 1, 0.0),
    ("kv-usage", {}, dict(load=False), 0, 1, NEUTRAL),
    ("cache-room", {}, dict(cached=7, total=28), 0, 4, 0.75),  # a quarter full, all 4 blocks to add
    ("cache-room", {}, dict(cached=28, total=28), 0, 4, 0.0),  # full: adding evicts cached prefixes
    ("cache-room", {}, dict(cached=28, total=28), 2, 4, 0.5),  # full, half the prompt to add
    ("cache-room", {}, dict(cached=28, total=28), 4, 4, 1.0),  # holds the whole prompt: adds nothing
    ("cache-room", {}, dict(cached=40, total=28), 0, 4, 0.0),  # more than the total (a stale pair): clamped
    ("cache-room", {}, dict(cached=8, total=32, pending_tokens=128), 0, 4, 0.5),  # 8 blocks on their way
    ("cache-room", {}, dict(cached=8, total=28), 0, 0, NEUTRAL),  # no full block to cache
    ("cache-room", {}, dict(load=False, total=28), 0, 4, NEUTRAL),
    ("cache-room", {}, dict(cached=8), 0, 4, NEUTRAL),  # no WorkerInfo yet: size unknown
    ("pending-assignments", {}, dict(pending=0), 0, 1, 1.0),
    ("pending-assignments", {}, dict(pending=1), 0, 1, 0.75),
    ("pending-assignments", {"saturation": 2}, dict(pending=5), 0, 1, 0.0),
    ("queued-prefill-tokens", {}, dict(queued=2048, pending_tokens=2048), 0, 1, 0.5),
    ("queued-prefill-tokens", {"saturation": 100}, dict(queued=500), 0, 1, 0.0),
    ("queued-prefill-tokens", {}, dict(load=False), 0, 1, NEUTRAL),
    ("round-robin", {}, {}, 0, 1, 1.0),  # a single worker always has the turn
    ("expected-latency", {}, dict(queued=500, running=3), 0, 4, 1.0),  # relative: a lone worker is the best
    ("expected-latency", {}, dict(load=False), 0, 4, NEUTRAL),
    ("lora-affinity", {}, {}, 0, 1, 1.0),  # a base-model request: no preference
    # (adapter requests: the table in tests/router/test_lora_router.py)
]


@pytest.mark.parametrize("name,params,kw,matched,blocks,expected", SCORER_CASES)
def test_scorer_table(name, params, kw, matched, blocks, expected):
    w = worker(**kw)
    ctx = ScoringContext(num_prompt_tokens=blocks * BS, num_prompt_blocks=blocks, matched_blocks={"w": matched})
    assert make_scorer(name, params).score(ctx, [w]) == {"w": pytest.approx(expected)}


def test_every_registered_scorer_has_a_case_and_stays_in_range():
    assert {case[0] for case in SCORER_CASES} == set(SCORERS)
    rng = random.Random(0)
    for name in SCORERS:
        for _ in range(50):
            w = worker(
                waiting=rng.randint(0, 100),
                running=rng.randint(0, 100),
                kv=rng.random(),
                queued=rng.randint(0, 10**5),
                pending=rng.randint(0, 10),
                pending_tokens=rng.randint(0, 10**4),
                cached=rng.randint(0, 100),
                total=rng.randint(0, 64),
            )
            blocks = rng.randint(0, 20)
            ctx = ScoringContext(blocks * BS, blocks, {"w": rng.randint(0, blocks)})
            assert 0.0 <= make_scorer(name).score(ctx, [w])["w"] <= 1.0


def test_round_robin_takes_turns_in_address_order_regardless_of_load_and_cache():
    scorer = make_scorer("round-robin")
    workers = [worker("b", waiting=9), worker("a"), worker("c", kv=0.9)]
    ctx = ScoringContext(4 * BS, 4, {"a": 4, "b": 0, "c": 0})
    picks = []
    for _ in range(7):
        scores = scorer.score(ctx, workers)
        assert sorted(scores.values()) == [0.0, 0.0, 1.0]
        picks.append(max(scores, key=scores.get))
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("nope", {}, "unknown scorer 'nope'; allowed: prefix-overlap"),
        ("queue-depth", {"saturatoin": 3}, "unknown parameter(s) ['saturatoin']; allowed: saturation"),
        ("queue-depth", {"saturation": -1}, "saturation=-1 is invalid"),
        ("kv-usage", {"x": 1}, "allowed: none"),
    ],
)
def test_scorer_params_are_checked(name, params, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        make_scorer(name, params)


# ---- filters: (filter, params, worker kwargs, kept) ----------------------------------------------
FILTER_CASES = [
    ("healthy", {}, {}, True),
    ("healthy", {}, dict(connected=False), False),
    ("not-draining", {}, dict(draining=True), False),
    ("not-draining", {}, dict(load=False), True),
    ("not-saturated", {}, dict(waiting=63), True),
    ("not-saturated", {}, dict(waiting=64), False),
    ("not-saturated", {"max_waiting": 2}, dict(waiting=2), False),
    ("not-saturated", {}, dict(kv=0.995), True),  # a full cache alone queues (below: it steers)
    ("not-saturated", {}, dict(kv=0.995, waiting=64), False),
    ("not-saturated", {}, dict(load=False), True),
    ("balanced", {}, dict(waiting=100, pending=9), True),  # a worker alone is never out of balance
]


@pytest.mark.parametrize("name,params,kw,kept", FILTER_CASES)
def test_filter_table(name, params, kw, kept):
    w = worker(**kw)
    assert make_filter(name, params).select([w], now=0.0) == ([w] if kept else [])


# ({address: worker kwargs}, addresses kept)
SATURATION_CASES = [
    (dict(a=dict(kv=0.995), b=dict(kv=0.5)), "b"),  # a full cache loses to one with room
    (dict(a=dict(kv=0.995), b=dict(kv=1.0, waiting=3)), "ab"),  # every cache full: the workers queue it
    (dict(a=dict(kv=0.995, waiting=64), b=dict(kv=1.0, waiting=3)), "b"),  # but not past max_waiting
    (dict(a=dict(kv=0.2, waiting=64), b=dict(kv=1.0)), "b"),  # a queue at its bound is out, room or not
    (dict(a=dict(load=False), b=dict(kv=1.0)), "a"),  # no report yet: counts as room
    (dict(a=dict(waiting=64), b=dict(kv=1.0, waiting=70)), ""),  # 429
]


@pytest.mark.parametrize("loads,kept", SATURATION_CASES)
def test_a_full_cache_steers_requests_and_only_a_full_queue_refuses_them(loads, kept):
    """Two workers whose caches a burst filled, nothing waiting on either: the request queues
    on them as on one vLLM server instead of a 429 (the sweep's run 2 ended on one)."""
    ws = [worker(address, **kw) for address, kw in loads.items()]
    assert "".join(w.address for w in make_filter("not-saturated", {}).select(ws, 0.0)) == kept


def test_a_prefill_worker_with_a_full_cache_is_passed_over_even_when_every_one_is():
    """As a prefill candidate a full worker is skipped (the decode worker then prefills itself,
    refusing nobody), where a decode candidate would queue the request."""
    ws = [worker("a", role="prefill", kv=0.995), worker("b", role="prefill", kv=1.0, waiting=3)]
    assert make_filter("not-saturated", {}, role="prefill").select(ws, 0.0) == []
    assert make_filter("not-saturated", {}).select(ws, 0.0) == ws


# (params, {address: worker kwargs}, addresses kept): load = waiting + running + router-side pending
BALANCE_CASES = [
    ({}, dict(a=dict(), b=dict(running=16)), "ab"),  # 16 more: within the slack
    ({}, dict(a=dict(), b=dict(running=9, waiting=8)), "a"),  # 17 more than an idle worker
    ({}, dict(a=dict(running=40), b=dict(running=60)), "ab"),  # 60 <= 1.5 x 40
    ({}, dict(a=dict(running=40), b=dict(running=61)), "a"),  # 21 more and over 1.5 x
    ({}, dict(a=dict(load=False), b=dict(load=False, pending=17)), "a"),  # sent, not yet reported
    ({"slack": 4}, dict(a=dict(), b=dict(running=3, waiting=2)), "a"),
    ({"slack": 8}, dict(a=dict(), b=dict(running=8), c=dict(waiting=9)), "ab"),
    ({"ratio": 3, "slack": 1}, dict(a=dict(running=4), b=dict(running=12), c=dict(running=13)), "ab"),
]


@pytest.mark.parametrize("params,loads,kept", BALANCE_CASES)
def test_balanced_keeps_workers_within_the_slack_or_ratio_of_the_least_loaded(params, loads, kept):
    ws = [worker(address, **kw) for address, kw in loads.items()]
    assert "".join(w.address for w in make_filter("balanced", params).select(ws, 0.0)) == kept


def test_balanced_ratio_below_one_is_refused():
    with pytest.raises(ConfigError, match="ratio=0.5 is invalid; allowed: a number >= 1"):
        make_filter("balanced", {"ratio": 0.5})


def test_a_prefix_and_adapter_holder_that_is_far_busier_loses_to_an_idle_worker():
    """W5's failure before the `balanced` filter: the worker holding a request's prefix runs 8
    and queues 20; every load scorer already reads 0 there, so its prefix hit outscored the
    other worker's 3 running requests and the queue kept growing. The default profile now
    sends the request to the other worker, and still follows the prefix between equals."""
    ids = tokens(160, salt=5)
    stored = {"d1": HASHER.hash_blocks(ids)}
    p, _ = placer([worker("d1", running=8, waiting=20), worker("d2", running=3)], mode="never", stored=stored)
    assert place(p, ids).decode == "d2"
    p, _ = placer([worker("d1", running=4), worker("d2", running=3)], mode="never", stored=stored)
    assert place(p, ids).decode == "d1"


def test_a_burst_on_the_prefix_holder_keeps_its_group_until_the_queue_outweighs_the_hit():
    """`balanced` guards against a runaway, not a burst: a holder 5 requests busier than an idle
    worker keeps the request (its hit saves a miss that would also evict another group's
    prefix there); 7 busier, the queue-depth scorer outweighs the hit and it moves. With the
    first slack (4) the filter moved it at 5 already."""
    ids = tokens(160, salt=6)
    stored = {"d1": HASHER.hash_blocks(ids)}
    p, _ = placer([worker("d1", running=5), worker("d2")], mode="never", stored=stored)
    assert place(p, ids).decode == "d1"
    p, _ = placer([worker("d1", running=7), worker("d2")], mode="never", stored=stored)
    assert place(p, ids).decode == "d2"


def test_every_filter_has_a_case():
    assert {case[0] for case in FILTER_CASES} == set(FILTERS)


def test_unhealthy_reasons():
    w = worker()
    assert w.is_healthy(0.0)
    w.incompatible = "it serves another model"
    assert not w.is_healthy(0.0)
    w.incompatible, w.down_until = "", 5.0
    assert not w.is_healthy(4.9) and w.is_healthy(5.0)


# ---- profile: weighted sum, pick, tie-break -------------------------------------------------------
def profile(*scorers, filters=("healthy",)):
    return Profile("decode", ProfileConfig(filters=filters, scorers=tuple(ScorerSpec(n, w) for n, w in scorers)))


RANK_CASES = [
    # prefix hit on a, equal load: a wins
    (dict(a=dict(), b=dict()), dict(a=8, b=0), [("prefix-overlap", 2), ("queue-depth", 3)], "a"),
    # prefix hit on a, but a's queue is saturated: load wins
    (dict(a=dict(running=8), b=dict()), dict(a=8, b=0), [("prefix-overlap", 2), ("queue-depth", 3)], "b"),
    # a moderately busier (2 of 8) still wins on its prefix hit
    (dict(a=dict(running=2), b=dict()), dict(a=8, b=0), [("prefix-overlap", 2), ("queue-depth", 3)], "a"),
    # a longer partial hit beats a shorter one
    (dict(a=dict(), b=dict()), dict(a=2, b=5), [("prefix-overlap", 1)], "b"),
    # kv usage breaks an otherwise even race
    (dict(a=dict(kv=0.9), b=dict(kv=0.1)), dict(a=0, b=0), [("kv-usage", 1), ("queue-depth", 1)], "b"),
    # router-side pending assignments steer away before any load report shows them
    (dict(a=dict(pending=3), b=dict()), dict(a=0, b=0), [("pending-assignments", 1)], "b"),
    # a weight of 0 turns a scorer off
    (dict(a=dict(running=8), b=dict()), dict(a=8, b=0), [("prefix-overlap", 1), ("queue-depth", 0)], "a"),
]


@pytest.mark.parametrize("workers,matched,scorers,winner", RANK_CASES)
def test_profile_rank_table(workers, matched, scorers, winner):
    ws = [worker(address, **kw) for address, kw in workers.items()]
    ctx = ScoringContext(8 * BS, 8, matched)
    ranked = profile(*scorers).rank(ctx, ws, random.Random(0))
    assert ranked[0][0] == winner, ranked


# The default decode profile with cache-room: two workers with 28 blocks each, a prompt of 8 blocks;
# (workers, matched blocks, winner). docs/router.md ("Default weights") states these levels.
T = 28
DEFAULT_RANK_CASES = [
    # (a) a prompt no worker holds goes to the emptier cache, whichever address it has
    (dict(a=dict(cached=20), b=dict(cached=4)), dict(a=0, b=0), "b"),
    (dict(a=dict(cached=4), b=dict(cached=20)), dict(a=0, b=0), "a"),
    (dict(a=dict(cached=0, pending_tokens=320), b=dict(cached=8)), dict(a=0, b=0), "b"),  # 20 blocks sent to a
    # (a) ...while the queue decides beyond about 1.3 requests: full against empty is worth 0.5 = 4/3 x 3/8
    (dict(a=dict(cached=T), b=dict(cached=0, running=1)), dict(a=0, b=0), "b"),
    (dict(a=dict(cached=T), b=dict(cached=0, running=2)), dict(a=0, b=0), "a"),
    # (b) the holder wins over an empty non-holder, its own cache full
    (dict(a=dict(cached=T), b=dict(cached=0)), dict(a=8, b=0), "a"),
    # (b) ...and stays ahead with a queue of 5 (a full hit, 2, against 5 x 3/8), the other's cache empty or full
    (dict(a=dict(cached=T, running=5), b=dict(cached=0)), dict(a=8, b=0), "a"),
    (dict(a=dict(cached=T, running=5), b=dict(cached=T)), dict(a=8, b=0), "a"),
    # (b) against a full non-holder, where a copy would evict another prefix, it keeps up to 6 (2.5 / (3/8))
    (dict(a=dict(cached=T, running=6), b=dict(cached=T)), dict(a=8, b=0), "a"),
    (dict(a=dict(cached=T, running=7), b=dict(cached=T)), dict(a=8, b=0), "b"),
    # (c) a holder with 6 loses to an idle worker with room: cache-room does not make it stickier there
    (dict(a=dict(cached=T, running=6), b=dict(cached=0)), dict(a=8, b=0), "b"),
    # (c) a saturated holder loses even to a non-holder whose cache is full, its only other gain
    #     (2 + 0.5 < 3), with kv usage equal (as if the holder's requests held no block)
    (dict(a=dict(cached=T, running=8), b=dict(cached=T)), dict(a=8, b=0), "b"),
]


@pytest.mark.parametrize("workers,matched,winner", DEFAULT_RANK_CASES)
def test_default_profile_with_cache_room(workers, matched, winner):
    ws = [worker(address, total=T, **kw) for address, kw in workers.items()]
    ctx = ScoringContext(8 * BS, 8, matched, block_size=BS)
    for seed in range(5):  # no tie decides it: the same winner for every tie-break order
        ranked = Profile("decode", default_decode_profile()).rank(ctx, ws, random.Random(seed))
        assert ranked[0][0] == winner, ranked
        assert ranked[0][1] > ranked[1][1], ranked


def test_cache_room_is_in_the_default_decode_profile_below_a_saturated_queue():
    """The levels above hold for the shipped weights: a full hit plus cache-room's whole weight
    stays below queue-depth's (docs/router.md)."""
    weights = {s.name: s.weight for s in default_decode_profile().scorers}
    assert weights["prefix-overlap"] + weights["cache-room"] < weights["queue-depth"]


def test_ties_are_broken_at_random():
    ws = [worker(a) for a in "abcd"]
    ctx = ScoringContext(8 * BS, 8, dict.fromkeys("abcd", 0))
    rng = random.Random(1)
    winners = {profile(("queue-depth", 1)).rank(ctx, ws, rng)[0][0] for _ in range(200)}
    assert winners == set("abcd")


@pytest.mark.parametrize(
    "kw,status,reason",
    [
        (dict(connected=False), 503, "no healthy worker"),
        (dict(draining=True), 503, "every worker is draining"),
        (dict(waiting=100), 429, "every worker is saturated"),
    ],
)
def test_profile_empty_after_filter(kw, status, reason):
    p = profile(("queue-depth", 1), filters=("healthy", "not-draining", "not-saturated"))
    with pytest.raises(NoWorkerError, match=reason) as exc:
        p.filter([worker("a", **kw), worker("b", **kw)], 0.0)
    assert exc.value.status == status


# ---- the whole placer: decode, disaggregation decision, prefill --------------------------------------
def placer(workers: list[WorkerState], mode="conditional", min_prefill=256, stored=None, ttl=10.0):
    pool = WorkerPool(MODEL, BS, clock=lambda: 0.0)
    for w in workers:
        pool.workers[w.address] = w
    index = InMemoryPrefixIndex(ttl_s=ttl, clock=lambda: 0.0)
    for address, hashes in (stored or {}).items():
        index.apply_now(address, pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes)))
    config = PlacementConfig(
        decode=default_decode_profile(), disaggregation=DisaggregationConfig(mode=mode, min_prefill_tokens=min_prefill)
    )
    return Placer(config, pool, index, random.Random(0)), index


def tokens(n, salt=0):
    return [(i * 31 + salt * 7) % 40000 + 5 for i in range(n)]


HASHER = BlockHasher(MODEL, BS)


def place(p, token_ids, exclude=frozenset()):
    return asyncio.run(p.place(PlacementRequest(len(token_ids), HASHER.hash_blocks(token_ids), exclude)))


DISAGG_CASES = [
    # (mode, prompt tokens, blocks cached on d1, expect remote)
    ("conditional", 600, 0, True),
    ("conditional", 600, 30, False),  # 600 - 480 = 120 uncached < 256
    ("conditional", 200, 0, False),
    ("always", 40, 0, True),
    ("never", 1500, 0, False),
]


@pytest.mark.parametrize("mode,n,cached_blocks,remote", DISAGG_CASES)
def test_disaggregation_decision(mode, n, cached_blocks, remote):
    ids = tokens(n)
    stored = {"d1": HASHER.hash_blocks(ids)[:cached_blocks]}
    p, _ = placer([worker("d1"), worker("p1", role="prefill")], mode=mode, stored=stored)
    decision = place(p, ids)
    assert decision.decode == "d1"
    assert decision.num_cached_blocks == cached_blocks
    assert decision.num_uncached_tokens == n - cached_blocks * BS
    assert decision.prefill == (("p1",) if remote else ())


def test_prefill_choice_follows_its_prefix_and_lists_fallbacks():
    ids = tokens(800, salt=3)
    stored = {"p2": HASHER.hash_blocks(ids)[:40]}
    ws = [worker("d1"), worker("p1", role="prefill"), worker("p2", role="prefill"), worker("p3", role="prefill")]
    p, _ = placer(ws, stored=stored)
    decision = place(p, ids)
    assert decision.prefill[0] == "p2"
    assert len(decision.prefill) == 2  # max_prefill_candidates


def test_no_usable_prefill_worker_means_local_prefill():
    p, _ = placer([worker("d1"), worker("p1", role="prefill", draining=True)])
    assert place(p, tokens(800)).prefill == ()


def test_a_both_worker_never_prefills_for_itself():
    p, _ = placer([worker("b1", role="both")], mode="always")
    decision = place(p, tokens(800))
    assert decision.decode == "b1" and decision.prefill == ()


def test_speculative_entries_pull_a_burst_onto_one_worker():
    """Requests sharing a prefix, routed before any KV event: the first one's speculative
    entries make the next ones follow it."""
    p, index = placer([worker(a) for a in ("d1", "d2", "d3")], mode="never")
    prefix = tokens(320, salt=9)
    first = place(p, prefix + tokens(20, salt=1)).decode
    assert [place(p, prefix + tokens(20, salt=i)).decode for i in range(2, 6)] == [first] * 4


def test_excluded_workers_are_not_chosen():
    p, _ = placer([worker("d1"), worker("d2")])
    assert place(p, tokens(10), frozenset({"d1"})).decode == "d2"
    with pytest.raises(NoWorkerError, match="no decode worker is known"):
        place(p, tokens(10), frozenset({"d1", "d2"}))


def test_a_lora_request_without_an_adapter_catalog_is_placed_like_a_base_request():
    """A Dispatcher built without an adapter catalog (adapters=None, as embedded users build it)
    places an adapter request on any decode worker, without prefix hints (the adapter's digest is
    unknown), instead of failing on the missing catalog."""
    from splitserve.platform.sampling.params import SamplingParams
    from splitserve.router.core.dispatch import Dispatcher
    from splitserve.router.core.job import Job, Progress

    place, index = placer([worker("w")], stored={"w": HASHER.hash_blocks(tokens(64))})
    dispatcher = Dispatcher(place.pool, place, HASHER, None, channels=None, adapters=None)
    job = Job("r", tokens(64), SamplingParams(max_tokens=4), lora_name="sql")
    decision = asyncio.run(dispatcher._place(job, Progress(), set(), 1))
    assert decision.decode == "w" and decision.num_cached_blocks == 0
