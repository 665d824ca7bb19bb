"""Pull instead of recompute in the router (placement step 4a, router/placement/pull_cost.py, the request's
kv_pull), on plain objects."""

import asyncio
import random

import pytest
from test_router_placement_units import BS, HASHER, MODEL, tokens, worker

from splitserve.platform.errors import ConfigError
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import (
    DisaggregationConfig,
    KVPullConfig,
    PlacementConfig,
    default_decode_profile,
)
from splitserve.router.config.file import from_dict
from splitserve.router.core.worker_messages import generate_request
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.placer import Decision, PlacementRequest, Placer
from splitserve.router.placement.pool import WorkerPool
from splitserve.router.placement.pull_cost import PullCost

BUSY = dict(waiting=60, running=60, kv=0.99, pending=10, queued=20000)  # the holder the placer avoids


def placer(workers, kv_pull=None, mode="never", stored=None):
    kv_pull = kv_pull or KVPullConfig()
    pool = WorkerPool(MODEL, BS, clock=lambda: 0.0)
    for w in workers:
        pool.workers[w.address] = w
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    for address, hashes in (stored or {}).items():
        index.apply_now(address, pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes)))
    config = PlacementConfig(
        decode=default_decode_profile(), disaggregation=DisaggregationConfig(mode=mode), kv_pull=kv_pull
    )
    return Placer(config, pool, index, random.Random(0))


def decide(p, ids, lora_name=None):
    return asyncio.run(
        p.place(
            PlacementRequest(
                len(ids), HASHER.hash_blocks(ids), lora_name=lora_name, lora_workers={"h", "w"} if lora_name else None
            )
        )
    )


IDS = tokens(600, salt=9)  # 37 full blocks
HELD = {"h": HASHER.hash_blocks(IDS)[:30]}


@pytest.mark.parametrize(
    "holder, kv_pull, mode, expected",
    [
        (dict(), KVPullConfig(), "never", ("h", 30)),
        (dict(), KVPullConfig(enabled=False), "never", None),
        (dict(connected=False), KVPullConfig(), "never", None),  # an unhealthy holder is not asked
        (dict(draining=True), KVPullConfig(), "never", None),
        (dict(), KVPullConfig(min_blocks=31), "never", None),  # too little to gain
        (dict(), KVPullConfig(block_transfer_s=1.0), "never", None),  # slower than computing
        (dict(), KVPullConfig(), "always", ("h", 30)),  # the busy holder is filtered as a prefill worker: pull
    ],
)
def test_pull_decision(holder, kv_pull, mode, expected):
    p = placer([worker("h", role="both", **BUSY, **holder), worker("w", role="both")], kv_pull, mode, HELD)
    decision = decide(p, IDS)
    assert decision.decode == "w" and decision.num_cached_blocks == 0
    assert decision.pull == expected


def test_a_remote_prefill_replaces_the_pull():
    p = placer(
        [worker("h", role="both", **BUSY), worker("w", role="both"), worker("p", role="prefill")],
        mode="always",
        stored=HELD,
    )
    decision = decide(p, IDS)
    assert decision.prefill and decision.pull is None


def test_no_pull_when_the_chosen_worker_holds_as_much():
    p = placer(
        [worker("h", role="both", **BUSY), worker("w", role="both")], stored={**HELD, "w": HASHER.hash_blocks(IDS)[:30]}
    )
    assert decide(p, IDS).pull is None


def test_a_lora_request_never_pulls():
    p = placer([worker("h", role="both", **BUSY), worker("w", role="both")], stored=HELD)
    assert decide(p, IDS, lora_name="a").pull is None


def test_the_request_carries_the_pull_only_where_the_worker_prefills_the_base_model():
    d = Decision("w", pull=("h:1", 30))
    config = DisaggregationConfig()
    request = generate_request("r", IDS, SamplingParams(), d, config)
    assert (request.kv_pull.holder, request.kv_pull.num_blocks) == ("h:1", 30)
    for kwargs in (dict(resume_output_token_ids=[5]), dict(lora_name="a")):
        assert not generate_request("r", IDS, SamplingParams(max_tokens=4), d, config, **kwargs).HasField("kv_pull")
    assert not generate_request("r", IDS, SamplingParams(prompt_logprobs=0), d, config).HasField("kv_pull")
    assert not generate_request("r", IDS, SamplingParams(), Decision("w"), config).HasField("kv_pull")


def test_cost_model_follows_observed_pulls_and_prefills():
    cost = PullCost(KVPullConfig(block_transfer_s=0.004, prefill_token_s=0.002, min_blocks=2), BS)
    assert cost.is_worth(2) and not cost.is_worth(1)
    first = pb.GenerateResponse(
        usage=pb.Usage(cached_tokens=0, pulled_tokens=10 * BS),
        timings=pb.Timings(queue_s=0.01, kv_pull_s=5.0, first_token_s=5.5),
    )
    for _ in range(40):  # pulls of 0.5 s a block; 0.49 s for the 22 tokens computed after them
        cost.observe(10 * BS + 22, first)
    assert cost.block_transfer_s == pytest.approx(0.5, rel=1e-2)
    assert cost.prefill_token_s == pytest.approx(0.49 / 22, rel=1e-2)
    assert not cost.is_worth(30)  # 0.5 s a block > 16 x 0.022 s: computing is cheaper now


@pytest.mark.parametrize(
    "section, message",
    [
        ({"min_blocks": 0}, "placement.kv_pull.min_blocks must be >= 1"),
        ({"enabled": "yes"}, "placement.kv_pull.enabled must be true or false"),
        ({"block_transfer_s": 0}, "must be > 0"),
        ({"max_blocks": 3}, "unknown key(s) ['max_blocks'] in placement.kv_pull; allowed: enabled, min_blocks"),
    ],
)
def test_router_config_validates_kv_pull(section, message):
    with pytest.raises(ConfigError) as err:
        from_dict({"placement": {"kv_pull": section}})
    assert message in str(err.value)


def test_a_sidecar_pulls_from_a_pool_worker_holding_the_prefix_unless_a_prefiller_is_named():
    """The sidecar behind an inference gateway has one decode candidate, its own worker: it makes
    the gateway's pull decision for it, from the pool it discovers, and only when the request
    names no prefill worker (the EPP's P/D choice replaces the pull, as a remote prefill does)."""
    from splitserve.router.epp.sidecar import LocalPlacer, prefiller

    def sidecar(workers, stored=HELD):
        return LocalPlacer(placer(workers, stored=stored), "w")

    both = [worker("h", role="both", **BUSY), worker("w", role="both")]
    assert decide(sidecar(both), IDS).pull == ("h", 30)
    assert decide(sidecar(both), IDS).decode == "w"
    assert decide(sidecar([worker("w", role="both")]), IDS).pull is None  # no pool: nothing to pull from
    assert decide(sidecar(both), IDS, lora_name="a").pull is None
    assert decide(sidecar([worker("h", role="both", connected=False), worker("w", role="both")]), IDS).pull is None
    held_here = {**HELD, "w": HASHER.hash_blocks(IDS)[:30]}
    assert decide(sidecar(both, held_here), IDS).pull is None
    excluded = asyncio.run(
        sidecar(both).place(PlacementRequest(len(IDS), HASHER.hash_blocks(IDS), exclude=frozenset({"h"})))
    )
    assert excluded.pull is None
    token = prefiller.set("h")
    try:
        named = decide(sidecar(both), IDS)
    finally:
        prefiller.reset(token)
    assert named.prefill == ("h",) and named.pull is None
