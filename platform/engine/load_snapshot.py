"""What a worker reports about its engine's load: queue depth, KV usage, prefix-cache counters,
LoRA adapters. The engine thread takes the snapshot after each step; it is immutable, so the
event loop (metrics, the router's load reports) reads it without touching engine state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from splitserve.platform.engine.request_state import RequestState
from splitserve.platform.kv.block_pool import BlockPool
from splitserve.platform.lora.registry import LoraRegistry
from splitserve.platform.sched.request import Request
from splitserve.platform.sched.scheduler import Scheduler


@dataclass(frozen=True)
class LoadSnapshot:
    num_waiting: int
    num_running: int  # includes requests waiting for remote KV
    kv_usage: float  # 0..1 of blocks in use
    queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    num_free_blocks: int
    num_total_blocks: int
    # Blocks holding a cached (hashed) prefix, in use or evictable: how full the prefix cache is.
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int = 0  # of which were found (counted once per request)
    num_prefix_waits: int = 0  # steps requests sat out to reuse a prefix in flight (scheduler rule 3)
    running_loras: tuple[str, ...] = ()  # adapters of running requests (names, sorted)
    waiting_loras: tuple[str, ...] = ()  # adapters of waiting requests (names, sorted)
    max_loras: int = 1
    resident_loras: tuple[str, ...] = ()  # adapters in memory (the --max-cpu-loras LRU; names, sorted)
    lora_adapters: tuple[tuple[str, bytes, str], ...] = ()  # (name, digest, folder) of known adapters
    spec_num_drafts: int = 0  # speculative decoding since start (platform/spec/speculator.py)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_lengths: tuple[int, ...] = ()  # [n]: verification steps that accepted n proposals
    # A model with several KV groups (platform/kv/groups.py): per group (group, kind, blocks held by
    # requests, blocks cached under a hash); () for a single-group model.
    kv_groups: tuple[tuple[int, str, int, int], ...] = ()


def take_snapshot(
    sched: Scheduler,
    pool: BlockPool,
    states: Mapping[str, RequestState],
    loras: LoraRegistry,
    max_loras: int,
    spec=None,
) -> LoadSnapshot:
    """The load now. Call on the engine thread (it reads the scheduler's queues)."""
    queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    queued += sum(
        r.num_prompt_tokens - r.num_computed_tokens
        for r in sched.running
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    return LoadSnapshot(
        num_waiting=len(sched.waiting),
        num_running=len(sched.running) + len(sched.awaiting_kv),
        kv_usage=pool.usage,
        queued_prefill_tokens=queued,
        num_free_blocks=pool.num_free_blocks,
        num_total_blocks=pool.num_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        prefix_cache_queries=sched.stats.num_prefix_query_tokens,
        prefix_cache_hits=sched.stats.num_prefix_hit_tokens,
        num_prefix_waits=sched.stats.num_prefix_waits,
        running_loras=_lora_names(sched.running, states),
        waiting_loras=_lora_names(sched.waiting, states),
        max_loras=max_loras,
        resident_loras=tuple(sorted(a.name for a in loras.loaded())),
        lora_adapters=tuple(loras.known()),
        kv_groups=_kv_groups(sched.kv),
        **(
            {}
            if spec is None
            else dict(
                spec_num_drafts=spec.num_drafts,
                spec_num_draft_tokens=spec.num_draft_tokens,
                spec_num_accepted_tokens=spec.num_accepted_tokens,
                spec_accepted_lengths=tuple(spec.accepted_lengths),
            )
        ),
    )


def _lora_names(reqs: Iterable[Request], states: Mapping[str, RequestState]) -> tuple[str, ...]:
    names = set()
    for req in reqs:
        state = states.get(req.req_id)
        if state is not None and state.adapter is not None:
            names.add(state.adapter.name)
    return tuple(sorted(names))


def _kv_groups(kv) -> tuple[tuple[int, str, int, int], ...]:
    if not kv.is_grouped:
        return ()
    return tuple((u["group"], u["kind"], u["num_blocks_in_use"], u["num_cached_blocks"]) for u in kv.group_usage())
