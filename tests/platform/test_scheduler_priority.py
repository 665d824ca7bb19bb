"""The "priority" scheduling policy on plain objects: waiting order by band then body priority,
preemption of the least important running request only when blocks run out (as vLLM does)."""

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


def make(policy="priority", num_blocks=64, max_num_seqs=8, budget=64):
    pool = BlockPool(num_blocks, enable_caching=False)
    kv = KVCacheManager(pool, BS)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy)
    return Scheduler(cfg, kv, 256), pool, kv


def req(rid, tokens, max_tokens=4, priority=0, band=0, arrival=0.0):
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        HASHER,
        arrival_time=arrival,
        priority=priority,
        band=band,
    )


def step(sched):
    plan = sched.schedule()
    sched.update(plan, StepResult(sampled={s.req_id: 7 for s in plan.seqs if s.do_sample}))
    return plan


def test_waiting_order_is_band_then_body_priority_then_arrival():
    sched, _, _ = make(max_num_seqs=1)
    sched.add_request(req("low-band", [1] * 4, band=0, arrival=0))
    sched.add_request(req("b10-p5", [2] * 4, band=10, priority=5, arrival=1))
    sched.add_request(req("b10-p1", [3] * 4, band=10, priority=1, arrival=2))
    sched.add_request(req("b10-p1-late", [4] * 4, band=10, priority=1, arrival=3))
    assert [r.req_id for r in sched.waiting] == ["b10-p1", "b10-p1-late", "b10-p5", "low-band"]
    assert [s.req_id for s in step(sched).seqs] == ["b10-p1"]


def test_fcfs_keeps_arrival_order():
    sched, _, _ = make(policy="fcfs", max_num_seqs=1)
    sched.add_request(req("a", [1] * 4, band=0, arrival=0))
    sched.add_request(req("b", [2] * 4, band=10, priority=-5, arrival=1))
    assert [r.req_id for r in sched.waiting] == ["a", "b"]


def test_a_waiting_request_does_not_preempt_a_running_one():
    sched, _, _ = make(max_num_seqs=1)
    sched.add_request(req("batch", [1] * 4, max_tokens=3, band=0, arrival=0))
    step(sched)
    sched.add_request(req("chat", [2] * 4, band=10, arrival=1))
    plan = step(sched)
    assert [s.req_id for s in plan.seqs] == ["batch"] and plan.preempted_req_ids == ()
    assert sched.waiting[0].req_id == "chat"


def test_out_of_blocks_preempts_the_least_important_running_request():
    # 5 blocks of 4 tokens; each request holds 2 blocks after its 8-token prompt.
    sched, pool, kv = make(num_blocks=5, budget=64)
    sched.add_request(req("important", [1] * 8, max_tokens=8, band=10, arrival=0))
    sched.add_request(req("sheddable", [2] * 8, max_tokens=8, band=-1, arrival=1))
    step(sched)  # both prefilled: 4 blocks used
    assert {r.req_id for r in sched.running} == {"important", "sheddable"}
    preempted = []
    for _ in range(8):
        plan = step(sched)
        preempted += plan.preempted_req_ids
        kv.check_invariants()
        if preempted:
            break
    assert preempted == ["sheddable"]  # fcfs would pick the latest arrival too; here by band
    assert sched.waiting[0].req_id == "sheddable" and sched.requests["sheddable"].num_computed_tokens == 0


def test_priority_victim_planned_earlier_in_the_step_is_unplanned():
    # The victim comes first in the running list: its planned tokens must leave the plan.
    sched, pool, kv = make(num_blocks=5, budget=64)
    sched.add_request(req("sheddable", [2] * 8, max_tokens=8, band=-1, arrival=0))
    step(sched)
    sched.add_request(req("important", [1] * 7, max_tokens=8, band=10, arrival=1))
    step(sched)
    assert [r.req_id for r in sched.running] == ["sheddable", "important"]
    for _ in range(8):
        plan = step(sched)
        kv.check_invariants()
        if plan.preempted_req_ids:
            assert plan.preempted_req_ids == ("sheddable",)
            assert [s.req_id for s in plan.seqs] == ["important"]
            assert sched.requests["sheddable"].status == RequestStatus.PREEMPTED
            break
    else:
        pytest.fail("nothing was preempted")


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="fcfs, priority"):
        SchedulerConfig(policy="wspt")


def test_engine_runs_waiting_requests_by_band_then_priority(make_engine):
    """The real engine (SmolLM2-135M) with --scheduling-policy priority and one sequence at a time:
    requests finish in band order, then by the body's priority, whatever their arrival order."""
    engine = make_engine(max_num_seqs=1, policy="priority")
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    for req_id, priority, band in (("batch", 0, 0), ("sheddable", 0, -1), ("chat-late", 3, 10), ("chat", 1, 10)):
        engine.add_request(prompt_token_ids=[1, 2, 3, 4, 5], params=params, req_id=req_id, priority=priority, band=band)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.req_id for o in engine.step() if o.finish_reason is not None]
    assert finished == ["chat", "chat-late", "batch", "sheddable"]
    engine.kv.check_invariants()


def test_band_and_priority_reach_the_worker_request():
    from types import SimpleNamespace

    from splitserve.router.config import DisaggregationConfig
    from splitserve.router.core.worker_messages import generate_request

    decision = SimpleNamespace(prefill=(), lora_evict_first=[], pull=None)
    request = generate_request(
        "r", [1, 2], SamplingParams(max_tokens=1), decision, DisaggregationConfig(), priority=-3, band=10
    )
    assert (request.priority, request.band) == (-3, 10)
