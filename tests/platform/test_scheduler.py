"""The scheduler on plain objects: plans, chunking, prefix reuse, preemption, aborts, no leaks."""

import random

import pytest

from splitserve.platform.config import SchedulerConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.hashing import BlockHasher
from splitserve.platform.kv.block_pool import BlockPool
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sched.plan import StepResult
from splitserve.platform.sched.request import Request, RequestStatus
from splitserve.platform.sched.scheduler import Scheduler

BS = 4
HASHER = BlockHasher("test-model", BS)


def make(num_blocks=64, max_num_seqs=8, budget=16, chunked=True, caching=True, max_model_len=256, share=True):
    pool = BlockPool(num_blocks, enable_caching=caching)
    kv = KVCacheManager(pool, BS)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        share_prefix_in_flight=share,
    )
    return Scheduler(cfg, kv, max_model_len), pool, kv


def req(rid, tokens, max_tokens=4, **kw):
    return Request(
        rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw), HASHER, eos_token_ids=frozenset({0})
    )


def fake_token(seq):
    """A deterministic 'model': the next token depends on the whole context."""
    return (sum(seq.token_ids) + seq.context_len) % 97 + 1


def run_step(sched):
    plan = sched.schedule()
    result = StepResult(sampled={s.req_id: fake_token(s) for s in plan.seqs if s.do_sample})
    return plan, sched.update(plan, result)


def test_chunked_prefill_plan_and_decode():
    sched, pool, kv = make(budget=8)
    sched.add_request(req("a", list(range(1, 14)), max_tokens=2))  # 13 tokens
    plan, ups = run_step(sched)
    (s,) = plan.seqs
    assert (s.start_pos, s.num_tokens, s.do_sample) == (0, 8, False)
    assert s.block_ids == (0, 1)
    assert ups == []
    plan, ups = run_step(sched)
    (s,) = plan.seqs
    assert (s.start_pos, s.num_tokens, s.do_sample) == (8, 5, True)
    assert s.block_ids == (0, 1, 2, 3)
    assert len(ups) == 1 and ups[0].finish_status is None
    plan, ups = run_step(sched)
    (s,) = plan.seqs
    assert (s.start_pos, s.num_tokens) == (13, 1)
    assert ups[0].finish_status == RequestStatus.FINISHED_LENGTH
    assert pool.num_free_blocks == 64
    kv.check_invariants()


def test_without_chunking_a_long_prompt_waits_for_a_full_budget():
    sched, _, _ = make(budget=8, chunked=False, max_model_len=8)
    sched.add_request(req("a", [5] * 6, max_tokens=3))
    sched.add_request(req("b", [6] * 7, max_tokens=3))
    plan, _ = run_step(sched)
    assert [s.req_id for s in plan.seqs] == ["a"]  # b (7) does not fit in 8 - 6
    plan, _ = run_step(sched)
    assert [(s.req_id, s.num_tokens) for s in plan.seqs] == [("a", 1), ("b", 7)]


def test_max_num_seqs_caps_running():
    sched, _, _ = make(max_num_seqs=2, budget=64)
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1] * 5))
    plan, _ = run_step(sched)
    assert [s.req_id for s in plan.seqs] == ["r0", "r1"]


def test_prefix_reuse_counts_cached_tokens():
    sched, pool, _ = make(budget=64)
    shared = list(range(1, 17))
    sched.add_request(req("a", shared + [50, 51], max_tokens=1))
    run_step(sched)
    sched.add_request(req("b", shared + [60, 61, 62], max_tokens=1))
    plan, _ = run_step(sched)
    (s,) = plan.seqs
    assert (s.start_pos, s.num_tokens) == (16, 3)
    assert sched.stats.num_prefix_hit_tokens == 16


def test_preemption_by_recompute_then_everyone_finishes():
    # 6 blocks: two requests of 8 prompt tokens + 8 outputs need 4 blocks each.
    sched, pool, kv = make(num_blocks=6, budget=32)
    sched.add_request(req("a", [1] * 8, max_tokens=8))
    sched.add_request(req("b", [2] * 8, max_tokens=8))
    finished, preempted = {}, set()
    for _ in range(100):
        if not sched.num_unfinished:
            break
        plan, ups = run_step(sched)
        preempted.update(plan.preempted_req_ids)
        kv.check_invariants()
        for u in ups:
            if u.finish_status:
                finished[u.req_id] = u.finish_status
    assert preempted == {"b"}, "the most recently arrived request is the victim"
    assert finished == {"a": RequestStatus.FINISHED_LENGTH, "b": RequestStatus.FINISHED_LENGTH}
    assert pool.num_free_blocks == 6


def test_abort_running_and_waiting_frees_blocks():
    sched, pool, kv = make(max_num_seqs=1)
    sched.add_request(req("a", [1] * 9))
    sched.add_request(req("b", [2] * 9))
    plan, _ = run_step(sched)
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None
    assert sched.finish_request("zzz", RequestStatus.FINISHED_ABORTED) is None
    # The plan computed before the abort is applied harmlessly.
    assert sched.update(plan, StepResult(sampled={"a": 3})) == []
    assert pool.num_free_blocks == 64 and sched.num_unfinished == 0
    kv.check_invariants()


def test_max_model_len_finishes_with_length():
    sched, _, _ = make(max_model_len=10)
    sched.add_request(req("a", [3] * 8, max_tokens=100))
    statuses = []
    while sched.num_unfinished:
        statuses += [u.finish_status for u in run_step(sched)[1]]
    assert statuses == [None, RequestStatus.FINISHED_LENGTH]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomised_add_abort_finish_never_leaks(seed):
    rng = random.Random(seed)
    sched, pool, kv = make(num_blocks=24, max_num_seqs=6, budget=rng.choice([4, 8, 16]))
    prefixes = [[rng.randrange(1, 90) for _ in range(8)] for _ in range(3)]
    n = 0
    for _ in range(400):
        if rng.random() < 0.3 and n < 60:
            tokens = rng.choice(prefixes)[: rng.choice([0, 4, 8])] + [
                rng.randrange(1, 90) for _ in range(rng.randrange(1, 12))
            ]
            sched.add_request(req(f"r{n}", tokens, max_tokens=rng.randrange(1, 10)))
            n += 1
        if sched.requests and rng.random() < 0.1:
            sched.finish_request(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
        run_step(sched)
        kv.check_invariants()
    while sched.num_unfinished:
        run_step(sched)
        kv.check_invariants()
    assert pool.num_free_blocks == 24
    assert kv.num_requests == 0


def test_without_chunked_prefill_the_budget_defaults_to_max_model_len():
    """Regression: unchunked, a prompt longer than the default 512-token budget was never admitted
    and the engine loop spun at 100 % CPU with the request waiting forever."""
    sched, _, _ = make(num_blocks=200, budget=None, chunked=False, max_model_len=600)
    assert sched.config.max_num_batched_tokens == 600
    sched.add_request(req("long", [7] * 550, max_tokens=2))
    plan, _ = run_step(sched)
    assert [(s.req_id, s.num_tokens) for s in plan.seqs] == [("long", 550)]


def test_scheduler_budget_resolution_and_its_error():
    assert SchedulerConfig().resolved(2048).max_num_batched_tokens == 512
    assert SchedulerConfig(enable_chunked_prefill=False).resolved(2048).max_num_batched_tokens == 2048
    assert SchedulerConfig(max_num_batched_tokens=64).resolved(2048).max_num_batched_tokens == 64
    with pytest.raises(
        ConfigError,
        match=r"max_num_batched_tokens=512 is below max_model_len=2048 with chunked "
        r"prefill off.*allowed: max_num_batched_tokens >= 2048",
    ):
        SchedulerConfig(max_num_batched_tokens=512, enable_chunked_prefill=False).resolved(2048)


# -- in-flight prefix sharing (the scheduler's rule 3) ---------------------------------------

SHARED = list(range(1, 17))  # four full blocks


def test_a_burst_sharing_a_prefix_computes_it_once():
    sched, pool, kv = make(budget=64)
    sched.add_request(req("a", SHARED + [50, 51], max_tokens=1))
    sched.add_request(req("b", SHARED + [60, 61, 62], max_tokens=1))
    sched.add_request(req("c", [70] * 6, max_tokens=1))  # unrelated: not held back
    plan, _ = run_step(sched)
    assert [s.req_id for s in plan.seqs] == ["a", "c"]
    assert sched.stats.num_prefix_waits == 1
    plan, _ = run_step(sched)
    (s,) = plan.seqs
    assert (s.req_id, s.start_pos, s.num_tokens) == ("b", 16, 3)
    assert sched.stats.num_computed_tokens == 18 + 6 + 3
    # The prefix-cache metrics count each request once, though b was looked up on both steps.
    assert (sched.stats.num_prefix_query_tokens, sched.stats.num_prefix_hit_tokens) == (18 + 19 + 6, 16)
    kv.check_invariants()


def test_one_shared_block_is_not_worth_a_wait():
    sched, _, _ = make(budget=64)
    sched.add_request(req("a", SHARED + [50, 51], max_tokens=1))
    sched.add_request(req("b", SHARED[:4] + [60] * 14, max_tokens=1))  # shares only a's first block
    plan, _ = run_step(sched)
    assert [(s.req_id, s.start_pos) for s in plan.seqs] == [("a", 0), ("b", 0)]
    assert sched.stats.num_prefix_waits == 0


def test_without_sharing_the_burst_computes_the_prefix_twice():
    sched, _, _ = make(budget=64, share=False)
    sched.add_request(req("a", SHARED + [50, 51], max_tokens=1))
    sched.add_request(req("b", SHARED + [60, 61, 62], max_tokens=1))
    plan, _ = run_step(sched)
    assert [(s.req_id, s.start_pos) for s in plan.seqs] == [("a", 0), ("b", 0)]
    assert sched.stats.num_prefix_hit_tokens == 0


def test_a_follower_waits_through_every_chunk_of_the_leaders_prefill():
    sched, _, kv = make(budget=8)
    sched.add_request(req("a", SHARED + [50], max_tokens=1))  # 17 tokens: chunks 8, 8, 1
    sched.add_request(req("b", SHARED + [60], max_tokens=1))
    steps = [[(s.req_id, s.start_pos) for s in run_step(sched)[0].seqs] for _ in range(3)]
    # b sits out while a fills the shared blocks, and joins as soon as all four are cached.
    assert steps == [[("a", 0)], [("a", 8)], [("a", 16), ("b", 16)]]
    kv.check_invariants()


def test_a_follower_is_freed_when_the_leader_is_aborted():
    sched, pool, kv = make(budget=8)
    sched.add_request(req("a", SHARED + [50], max_tokens=1))
    sched.add_request(req("b", SHARED + [60], max_tokens=1))
    run_step(sched)  # a computes 8 tokens (2 blocks, cached); b waits
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    plan, _ = run_step(sched)
    assert [(s.req_id, s.start_pos) for s in plan.seqs] == [("b", 8)]  # reuses what a finished
    kv.check_invariants()


def test_a_remote_follower_waits_for_the_leaders_kv_and_transfers_less():
    sched, pool, kv = make(budget=64)
    lead = Request("a", SHARED + [50], SamplingParams(max_tokens=2, ignore_eos=True), HASHER, remote_prefill=True)
    follow = Request("b", SHARED + [60], SamplingParams(max_tokens=2, ignore_eos=True), HASHER, remote_prefill=True)
    sched.add_request(lead)
    sched.add_request(follow)
    sched.schedule()
    assert [r.req_id for r in sched.take_kv_ready()] == ["a"]
    sched.schedule()
    assert sched.take_kv_ready() == []  # b still waits: a's KV has not landed
    sched.complete_remote_prefill("a", 7)
    sched.schedule()
    assert [r.req_id for r in sched.take_kv_ready()] == ["b"]
    assert follow.num_cached_tokens == 16  # only its last block must travel
    kv.check_invariants()


def test_a_follower_reuses_a_pulled_prefix_as_soon_as_it_lands():
    """A pull brings the shared prefix and the rest of the leader's prompt is computed here
    (`fallback_to_local_prefill` with the pulled end). The follower, which waited while the pull
    was in flight (rule 3), hits the pulled blocks in the very step that computes the leader's
    rest, instead of computing the prefix a second time beside it."""
    sched, pool, kv = make(budget=64)
    lead = Request("a", SHARED + [50], SamplingParams(max_tokens=2, ignore_eos=True), HASHER, remote_prefill=True)
    follow = req("b", SHARED + [60], max_tokens=1)
    sched.add_request(lead)
    sched.add_request(follow)
    plan, _ = run_step(sched)
    assert plan.seqs == () and [r.req_id for r in sched.take_kv_ready()] == ["a"]
    assert sched.stats.num_prefix_waits == 1  # b waits for the blocks the pull brings
    assert sched.fallback_to_local_prefill("a", 16)  # the pull landed all four shared blocks
    plan, _ = run_step(sched)
    assert [(s.req_id, s.start_pos, s.num_tokens) for s in plan.seqs] == [("a", 16, 1), ("b", 16, 1)]
    assert follow.num_cached_tokens == 16
    kv.check_invariants()
