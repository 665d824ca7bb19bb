"""KV groups (platform/kv/groups.py, kv/grouped.py): one group per layer type over one pool.

The block accounting runs the real scheduler and KV managers on plain requests (no tensors):
  * Gemma 3 270M's layout read from its real GGUF: 1 full group and 5 sliding groups of 3 layers;
  * at 32k tokens of context its request holds <= 0.25x the KV bytes of the one-group cache;
  * at a fixed KV budget >= 3x as many 8k-token requests decode at once;
  * a sliding group holds only its window as prefill and decode advance, and a prefix hit needs
    only the last window's blocks of it (exact block-level assertions, invariants every step).
The engine part runs a tiny random Gemma 3 (transformers' save_pretrained, window 24, block 16):
greedy through P/D over the engine's KV export/import equals transformers', with the sliding
layers' blocks released as decode goes on. tests/platform/test_model_families.py checks the same
family colocated, chunked and after a prefix hit, and test_gemma3.py the real 270M model (with a
prompt longer than its window) against transformers.
"""

import pytest
import torch
from test_disaggregation_engine import disaggregated
from test_model_families import engine_for, save_family

from splitserve.platform.config import SchedulerConfig
from splitserve.platform.hashing import BlockHasher
from splitserve.platform.kv.block_pool import BlockPool, BlockStored
from splitserve.platform.kv.cache import bytes_per_block
from splitserve.platform.kv.grouped import GroupedKVCacheManager
from splitserve.platform.kv.groups import KVGroup, KVLayout, describe, plan_layout
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.model_source import resolve_model
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sched.plan import StepResult
from splitserve.platform.sched.request import Request, RequestStatus
from splitserve.platform.sched.scheduler import Scheduler
from splitserve.platform.weights import load_model_config
from splitserve.platform.weights.presets import preset_config

BS = 16


@pytest.fixture(scope="module")
def gemma_config():
    return load_model_config(resolve_model("gemma3-270m"))


def request(req_id: str, num_tokens: int, max_tokens: int = 4, seed: int = 0) -> Request:
    tokens = [(seed * 7919 + i * 31) % 50000 + 10 for i in range(num_tokens)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, tokens, params, BlockHasher("m", BS))


def step(scheduler: Scheduler):
    """One scheduler step with a fixed sampled token: plan, (no model), apply."""
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(sampled={s.req_id: 5 for s in plan.seqs if s.do_sample}))
    return plan


def manager(layout: KVLayout, num_blocks: int):
    if layout.is_single:
        return KVCacheManager(BlockPool(num_blocks), BS)
    return GroupedKVCacheManager(BlockPool(num_blocks - 1, null_block=True), BS, layout)


def test_gemma3_270m_layout_is_one_full_and_five_sliding_groups_of_three(gemma_config):
    layout = plan_layout(gemma_config)
    sliding = [layer for layer in range(18) if (layer + 1) % 6]
    assert [(g.layers, g.window) for g in layout.groups] == [((5, 11, 17), None)] + [
        (tuple(sliding[i : i + 3]), 512) for i in range(0, 15, 3)
    ]
    assert layout.num_slots == 3 and layout.layer_group[17] == 0 and layout.layer_slot[17] == 2
    for name in ("tiny-qwen3", "tiny-mistral"):  # one layer type: one group, as before
        assert plan_layout(preset_config(name, "m")).is_single


def test_start_up_line_reports_each_group_and_the_maximum_concurrency(gemma_config):
    layout = plan_layout(gemma_config)
    block_bytes = bytes_per_block(gemma_config, BS, torch.float32, layout)
    line = describe(layout, 13_000, BS, block_bytes, 32768, 512)
    # per request of 32768 tokens: 2048 blocks of the full group, cdiv(511 + 512, 16) + 1 = 65 per sliding group
    assert "group 0 full layers [5, 11, 17]: 2048 blocks per 32768-token request" in line
    assert line.count("sliding_window_512") == 5 and "65 blocks per 32768-token request" in line
    assert line.endswith(f"Maximum concurrency for 32768 tokens per request: {13_000 / (2048 + 5 * 65):.2f}x")


def held_bytes(config, layout, kv, req_id) -> int:
    return sum(kv.num_blocks_held(req_id)) * bytes_per_block(config, BS, torch.float32, layout)


def test_gemma3_270m_holds_under_a_quarter_of_the_kv_at_32k_context(gemma_config):
    """A 32k-token request through the real scheduler and managers: bytes held after its prompt
    and a few decode steps, by the engine's accounting (blocks held x bytes_per_block)."""
    num_prompt = gemma_config.max_position_embeddings - 8
    held = {}
    for grouped in (False, True):
        layout = plan_layout(gemma_config) if grouped else None
        kv = manager(layout, 3000) if grouped else KVCacheManager(BlockPool(2100), BS)
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=512), kv, gemma_config.max_position_embeddings)
        scheduler.add_request(request("long", num_prompt, max_tokens=8))
        while scheduler.requests["long"].num_output_tokens < 4:
            step(scheduler)
            kv.check_invariants()
        held[grouped] = held_bytes(gemma_config, layout, kv, "long")
        assert scheduler.stats.num_preemptions == 0
    ratio = held[True] / held[False]
    print(f"KV bytes at {num_prompt + 4} tokens: {held[True]} grouped vs {held[False]} one group ({ratio:.3f}x)")
    assert ratio <= 0.25
    # the full group keeps all 2048 blocks, each sliding group at most its window plus one chunk
    assert held[False] == 2048 * bytes_per_block(gemma_config, BS, torch.float32)


def decoding_at_once(config, grouped: bool, budget_bytes: int, num_requests: int = 20) -> int:
    """The most requests of 8k tokens (7808 of prompt, 384 generated) decoding at the same time at
    this KV budget, until the first one finishes (each decodes longer than 20 others take to
    prefill at 512 tokens a step, so memory, not the token budget, is what limits them)."""
    layout = plan_layout(config) if grouped else None
    num_blocks = budget_bytes // bytes_per_block(config, BS, torch.float32, layout)
    kv = manager(layout, num_blocks) if grouped else KVCacheManager(BlockPool(num_blocks), BS)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64), kv, 8192)
    for i in range(num_requests):
        scheduler.add_request(request(f"r{i}", 8192 - 384, max_tokens=384, seed=i + 1))
    best = 0
    while scheduler.num_unfinished == num_requests:
        step(scheduler)
        best = max(best, sum(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running))
    kv.check_invariants()
    for req_id in list(scheduler.requests):
        scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    return best


def test_gemma3_270m_admits_over_3x_the_concurrent_8k_requests_at_a_fixed_budget(gemma_config):
    budget = 4 * 512 * bytes_per_block(gemma_config, BS, torch.float32)  # four 8k requests today
    today = decoding_at_once(gemma_config, False, budget)
    grouped = decoding_at_once(gemma_config, True, budget)
    print(f"8k-token requests decoding at once at {budget / 2**20:.0f} MiB: {grouped} grouped vs {today} one group")
    assert today == 4 and grouped >= 3 * today


def test_gemma3_270m_pd_of_a_prompt_over_4x_the_window_sends_the_window_of_sliding_layers(gemma_config):
    """The bytes P/D puts on the wire for a 2100-token prompt, by the engine's own plan
    (KVConnector.layer_skip, what the export and the receiver follow)."""
    from splitserve.platform.engine.kv_connector import KVConnector

    layout = plan_layout(gemma_config)
    connector = KVConnector(None, None, BS, torch.device("cpu"))
    connector.kv_layout, connector.layer_group = layout, layout.layer_group
    num_prompt = 2100
    num_blocks = -(-num_prompt // BS)
    skip = connector.layer_skip(num_prompt, 0)
    sent_blocks = [num_blocks - k for k in skip]
    assert [sent_blocks[layer] for layer in (5, 11, 17)] == [num_blocks] * 3  # full layers: everything
    assert {sent_blocks[layer] for layer in range(18) if (layer + 1) % 6} == {num_blocks - (2100 - 511) // BS}
    layer_block = 2 * BS * gemma_config.num_kv_heads * gemma_config.head_dim * 4  # float32 K and V
    sent, today = sum(sent_blocks) * layer_block, 18 * num_blocks * layer_block
    print(f"Gemma 3 270M P/D of {num_prompt} tokens: {sent} bytes vs {today} ({sent / today:.3f}x)")
    assert sent / today < 0.4


# -- a sliding group's blocks, step by step --------------------------------------------------------

WINDOW_LAYOUT = KVLayout((KVGroup((1,), None), KVGroup((0,), 32)), (1, 0), (0, 0))


def test_sliding_group_holds_only_its_window_as_prefill_and_decode_advance():
    kv = manager(WINDOW_LAYOUT, 64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, 512)
    req = request("a", 100, max_tokens=40)
    scheduler.add_request(req)
    while not req.is_finished:
        computed = req.num_computed_tokens
        plan = step(scheduler)
        kv.check_invariants()
        if req.is_finished:
            break
        full, sliding = plan.seqs[0].group_block_ids
        # the full table is dense; the sliding one has holes before the window of the step's first query
        first_needed = max(0, computed - 32 + 1) // BS
        assert 0 not in full[1:] or full.count(0) <= 1
        assert all(b == 0 for b in sliding[:first_needed]) and kv.num_blocks_held("a")[1] <= 4
        assert kv.num_blocks_held("a")[0] == -(-req.num_computed_tokens // BS) or req.num_computed_tokens % BS == 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks  # nothing leaks


def test_remote_prefill_keeps_the_window_and_a_fallback_refills_the_holes_it_computes():
    kv = manager(WINDOW_LAYOUT, 64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, 512)
    req = request("r", 100, max_tokens=3)
    req.remote_prefill = True
    scheduler.add_request(req)
    scheduler.schedule()
    assert scheduler.take_kv_ready() == [req]
    # the full group holds all 7 blocks; the sliding one only blocks 4..6 (the window of position 100)
    assert kv.num_blocks_held("r") == [7, 3] and kv.group_block_ids("r")[1][:4] == (0, 0, 0, 0)
    assert scheduler.fallback_to_local_prefill("r")  # the KV never came: compute the prompt here
    while not req.is_finished:
        plan = step(scheduler)
        kv.check_invariants()
        for seq in plan.seqs:  # every slot the step writes is a real block of its group
            for table in seq.group_block_ids:
                assert all(table[pos // BS] != 0 for pos in range(seq.start_pos, seq.context_len))
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def cache(pool: BlockPool, group: int, hashes, indices) -> None:
    blocks = pool.allocate(len(indices))
    pool.cache_blocks(blocks, [hashes[i] for i in indices], None, group=group)
    pool.free(blocks)


def test_a_prefix_hit_needs_the_whole_full_group_and_only_the_window_of_a_sliding_one():
    req = request("b", 10 * BS + 1)
    hashes = req.block_hashes
    # the full group holds all 10 blocks; the sliding group (window 32: 2 blocks back) lost 0..5
    kv = manager(WINDOW_LAYOUT, 32)
    cache(kv.pool, 0, hashes, range(10))
    cache(kv.pool, 1, hashes, range(6, 10))
    hits = kv.find_cached_prefix(req)
    assert len(hits) == 10 and hits.tables[1][:8] == [None] * 8 and None not in hits.tables[1][8:]
    assert kv.num_cached_prefix_tokens(req.num_tokens, hashes) == 10 * BS
    # a shorter prompt sharing only the first 4 blocks cannot reuse them: the sliding group dropped them
    short = request("c", 4 * BS + 1)
    assert short.block_hashes == hashes[:4] and len(kv.find_cached_prefix(short)) == 0
    # the sliding group holding only blocks 4, 5 and 8: the hit stops where a window is whole
    # (a hit of L blocks needs sliding blocks (L*16 - 31) // 16 .. L - 1: 6 needs 4 and 5)
    kv = manager(WINDOW_LAYOUT, 32)
    cache(kv.pool, 0, hashes, range(10))
    cache(kv.pool, 1, hashes, [4, 5, 8])
    assert len(kv.find_cached_prefix(req)) == 6
    assert kv.allocate(req, req.num_tokens - 6 * BS, kv.find_cached_prefix(req))
    kv.check_invariants()
    assert kv.num_blocks_held("b") == [11, 7]  # 6 hits + 5 new; sliding: hits 4, 5 + 5 new
    kv.free(req)
    kv.check_invariants()


def test_events_name_their_group():
    pool = BlockPool(8)
    req = request("d", 2 * BS)
    cache(pool, 0, req.block_hashes, [0, 1])
    cache(pool, 3, req.block_hashes, [1])
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert [(e.group, e.block_hashes) for e in stored] == [(0, tuple(req.block_hashes)), (3, (req.block_hashes[1],))]
    pool.allocate(8)  # evicts all three cached blocks
    removed = pool.take_events()
    assert sorted((e.group, len(e.block_hashes)) for e in removed) == [(0, 2), (3, 1)]
    pool.check_invariants()


# -- the engine on a tiny random Gemma 3 -----------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory, smollm2_gguf_path):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, save_family(folder, "gemma3_text", smollm2_gguf_path)


def test_tiny_gemma3_through_pd_equals_transformers_and_releases_window_blocks(gemma_folder):
    from gguf_reference import hf_greedy

    folder, hf_model = gemma_folder
    p_engine, d_engine = engine_for(folder), engine_for(folder)
    assert [g.window for g in d_engine.kv_layout.groups] == [None, 24, 24]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = [(11 * i) % 40000 + 100 for i in range(130)]  # over 4x the window of 24
    outs, received, ready = disaggregated(p_engine, d_engine, prompt, params=params)
    assert outs[-1].output_token_ids == hf_greedy(hf_model, prompt, 32)
    # sliding layers (0 and 2) receive only blocks 6..8: the window of position 130 starts at 107
    assert ready.layer_skip == (6, 0, 6)
    per_layer = {layer: sum(shape[1] for _, l_, _, shape in received if l_ == layer) for layer in range(3)}
    assert per_layer == {0: 3, 1: 9, 2: 3}
    m = d_engine.model_config
    block_bytes = 2 * 16 * m.num_kv_heads * m.head_dim * 4  # one layer's K and V of a block, float32
    sent = sum(per_layer.values()) * block_bytes
    today = 9 * m.num_layers * block_bytes
    print(f"P/D of a 130-token prompt, window 24: {sent} bytes vs {today} with every block ({sent / today:.2f}x)")
    assert sent == 15 * block_bytes
    for engine in (p_engine, d_engine):
        engine.kv.check_invariants()
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    # decoding alone, a long request's sliding groups hold about two blocks while the full one grows
    d_engine.add_request(params=params, prompt_token_ids=prompt, req_id="alone")
    for _ in range(3):
        d_engine.step()
    full, *sliding = d_engine.kv.num_blocks_held("alone")
    assert full == -(-(len(prompt) + 2) // 16) and all(n <= 3 for n in sliding)
    # /metrics and /debug/kv report each group's blocks
    from splitserve.workers.main import kv_state
    from splitserve.workers.metrics import WorkerMetrics

    groups = kv_state(d_engine)["groups"]
    assert [(g["kind"], g["num_blocks_in_use"]) for g in groups] == [
        ("full", full),
        *(("sliding_window_24", n) for n in sliding),
    ]
    metrics = WorkerMetrics("decode", "tiny-gemma3")
    metrics.update_load(d_engine.load())
    text = metrics.render().decode()
    assert f'splitserve_kv_group_blocks{{group="1",kind="sliding_window_24",state="in_use"}} {sliding[0]}.0' in text
    assert f'splitserve_kv_group_blocks{{group="0",kind="full",state="in_use"}} {full}.0' in text


# -- the router's prefix index over a worker's group events ----------------------------------------


def worker_after_conversation(evict: int):
    """A worker (scheduler + grouped manager, window 32) that ran one 8-block conversation, then
    lent `evict` blocks to other work (evicting the oldest free blocks: the sliding group's first)."""
    kv = manager(WINDOW_LAYOUT, 24)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, 512)
    scheduler.add_request(request("conv", 8 * BS + 1, max_tokens=3))
    while scheduler.num_unfinished:
        step(scheduler)
    if evict:
        kv.pool.free(kv.pool.allocate(evict))
    kv.check_invariants()
    return kv


def test_router_index_scores_a_worker_only_on_the_blocks_its_groups_can_reuse():
    import asyncio

    from splitserve.router.placement.index import InMemoryPrefixIndex
    from splitserve.workers.events import to_proto

    workers = {"dropped": worker_after_conversation(evict=10), "kept": worker_after_conversation(evict=0)}
    index = InMemoryPrefixIndex()
    for name, kv in workers.items():
        for event in kv.pool.take_events():
            index.apply_now(name, to_proto(event))
    conv = request("conv", 8 * BS + 1).block_hashes
    # a prompt sharing the conversation's first 4 blocks: "dropped" lost its sliding blocks 0..3
    short = conv[:4]
    assert workers["dropped"].num_cached_prefix_tokens(4 * BS + 1, short) == 0
    assert workers["kept"].num_cached_prefix_tokens(4 * BS + 1, short) == 4 * BS
    assert index.match_now(list(workers), short) == {"dropped": 0, "kept": 4}
    # the router's score equals what each engine can reuse, for every prefix of the conversation
    for n in range(1, 9):
        engine_hits = {name: kv.num_cached_prefix_tokens(n * BS + 1, conv[:n]) // BS for name, kv in workers.items()}
        assert index.match_now(list(workers), conv[:n]) == engine_hits, n
    assert index.match_now(["dropped"], conv[:8]) == {"dropped": 8}  # the window at its end is still held
    asyncio.run(index.close())


def test_kv_tier_refuses_a_grouped_model_at_start(gemma_folder):
    from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, KVTierConfig
    from splitserve.platform.engine.llm_engine import LLMEngine
    from splitserve.platform.errors import ConfigError

    folder, _ = gemma_folder
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(num_blocks=64),
        device=DeviceConfig(dtype="float32", quantization="none"),
        kv_tier=KVTierConfig(max_bytes=1 << 20),
    )
    with pytest.raises(ConfigError, match="--kv-tier needs a model with one KV group"):
        LLMEngine(config)
