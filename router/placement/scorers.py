"""Scorers: each rates every candidate worker in [0, 1] for one request (1 = best), by the rules
of scoring.py (neutral 0.5 without data, load terms against a saturation point). Registered in
SCORERS; docs/router.md has a paragraph per scorer.
"""

from __future__ import annotations

from splitserve.platform.errors import ConfigError
from splitserve.router.placement.pool import WorkerState
from splitserve.router.placement.scoring import NEUTRAL, Scorer, ScoringContext, headroom, missing

__all__ = ["NEUTRAL", "SCORERS", "Scorer", "ScoringContext", "make_scorer"]


class PrefixOverlap(Scorer):
    """Fraction of the prompt's full blocks the worker holds as a prefix (index.match)."""

    name = "prefix-overlap"

    def score(self, ctx, workers):
        if ctx.num_prompt_blocks == 0:
            return {w.address: NEUTRAL for w in workers}  # nothing to reuse: no preference
        return {w.address: min(ctx.matched_blocks.get(w.address, 0) / ctx.num_prompt_blocks, 1.0) for w in workers}


class QueueDepth(Scorer):
    """Reported waiting + running requests, 1 when idle, 0 at `saturation` or more."""

    name = "queue-depth"
    DEFAULTS = {"saturation": 8}

    def score(self, ctx, workers):
        sat = self.params["saturation"]
        return {
            w.address: (
                headroom(w.load.num_waiting + w.load.num_running, sat)
                if w.load is not None
                else missing(self.name, w.address, "load report")
            )
            for w in workers
        }


class KVUsage(Scorer):
    """1 - the reported fraction of KV blocks in use."""

    name = "kv-usage"

    def score(self, ctx, workers):
        return {
            w.address: (
                1.0 - min(max(w.load.kv_usage, 0.0), 1.0)
                if w.load is not None
                else missing(self.name, w.address, "load report")
            )
            for w in workers
        }


class CacheRoom(Scorer):
    """Room in the worker's prefix cache for the blocks this request would add to it, so that a
    prompt no worker holds (a new prefix group) goes where it evicts no other group's prefix:

        fullness(w) = (num_cached_blocks(w) + pending_prefill_tokens(w) / block_size) / num_total_blocks(w)
        score(w)    = 1 - fullness(w) * (prompt_blocks - matched(w)) / prompt_blocks

    num_cached_blocks is the load report's count of blocks under a hash, held or evictable; the
    pending tokens are the uncached prompt tokens of this router's requests that w computes and
    that have no first token yet, which no report shows (a remote prefill counts them on the
    prefill worker; w's report catches up within 0.5 s). Each group's prefix then lives in one
    worker's cache. Without it two idle workers tie and a coin places the group: 8 new groups
    split 6 to 2 or worse 29 % of the time (2 * (28 + 8 + 1) / 256), and a cache with room for 5
    prefixes then evicts its own groups' while the other has room. llm-d spreads such cold
    requests with its no-hit-lru-scorer (the pod least recently sent one); this measures the
    room instead of taking turns.

    It decides only among workers that would add the prompt's blocks. A worker holding the
    whole prompt adds none and scores 1 whatever its fullness, so a holder never loses by this
    term; against a non-holder with a full cache it gains the weight, since a copy there would
    evict another group's prefix. In the default decode profile its weight (0.5) keeps a full
    prefix hit with that gain (2 + 0.5) below a saturated queue's 3 (docs/router.md).

    Every full block a request computes stays cached until it is evicted, so a worker that has
    served for long reads full; among such workers only the holder's gain is left."""

    name = "cache-room"

    def score(self, ctx, workers):
        if ctx.num_prompt_blocks == 0:
            return {w.address: NEUTRAL for w in workers}  # nothing to cache: no preference
        out = {}
        for w in workers:
            if w.load is None or w.num_total_blocks <= 0:
                out[w.address] = missing(self.name, w.address, "load report" if w.load is None else "pool size")
                continue
            claimed = w.load.num_cached_blocks + w.num_pending_prefill_tokens / ctx.block_size
            fullness = min(max(claimed / w.num_total_blocks, 0.0), 1.0)
            added = max(ctx.num_prompt_blocks - ctx.matched_blocks.get(w.address, 0), 0) / ctx.num_prompt_blocks
            out[w.address] = 1.0 - fullness * added
        return out


class PendingAssignments(Scorer):
    """Requests this router sent to the worker that have no first token yet (so no load report
    shows them): 1 at none, 0 at `saturation` or more."""

    name = "pending-assignments"
    DEFAULTS = {"saturation": 4}

    def score(self, ctx, workers):
        sat = self.params["saturation"]
        return {w.address: headroom(w.num_pending, sat) for w in workers}


class QueuedPrefillTokens(Scorer):
    """Prompt tokens the worker has yet to compute (its report plus this router's pending
    prefills): 1 at none, 0 at `saturation` tokens or more."""

    name = "queued-prefill-tokens"
    DEFAULTS = {"saturation": 8192}

    def score(self, ctx, workers):
        sat = self.params["saturation"]
        out = {}
        for w in workers:
            if w.load is None:
                out[w.address] = missing(self.name, w.address, "load report")
            else:
                out[w.address] = headroom(w.load.queued_prefill_tokens + w.num_pending_prefill_tokens, sat)
        return out


class LoraAffinity(Scorer):
    """Where the request's LoRA adapter already runs (the Gateway API Inference Extension's
    lora-affinity-scorer): 1.0 if the worker runs requests with it, 0.8 if the worker has a free
    adapter slot (fewer distinct running + waiting adapters than its max_loras), 0.6 if the
    adapter only waits there, else 0. A base-model request: 1.0 everywhere (no preference).

    One step GIE does not have: a free slot on a worker that holds the adapter in memory (its
    `resident_lora_adapters`, the --max-cpu-loras LRU) scores 0.9. A GPU server's "load" is a
    host-to-device copy; here a worker that has evicted the adapter reads its folder from disk
    again (0.2 s for a rank-64 SmolLM2 adapter), which this request waits for, so between two free
    slots the one that needs no read wins. It stays below a running adapter's 1.0: that adds no
    new adapter to the worker's steps, while each distinct adapter in a step reads its own A and
    B once per step (16 adapters in a batch of 16 decode at 0.84x the base model, one at 0.96x:
    docs/benchmarks.md, multi-LoRA)."""

    name = "lora-affinity"

    def score(self, ctx, workers):
        if ctx.lora_name is None:
            return {w.address: 1.0 for w in workers}
        out = {}
        for w in workers:
            if w.load is None:
                out[w.address] = missing(self.name, w.address, "load report")
                continue
            running, waiting = set(w.load.running_lora_adapters), set(w.load.waiting_lora_adapters)
            if ctx.lora_name in running:
                out[w.address] = 1.0
            elif len(running | waiting) < max(w.load.max_loras, 1):
                out[w.address] = 0.9 if ctx.lora_name in w.load.resident_lora_adapters else 0.8
            elif ctx.lora_name in waiting:
                out[w.address] = 0.6
            else:
                out[w.address] = 0.0
        return out


class ExpectedLatency(Scorer):
    """The prefix hit and the load in one unit: the prompt tokens the worker must compute before
    this request's first token, plus what a copy of a prefix costs the caches (docs/router.md):

        work(w) = uncached(w) + duplicate_cost * (max_v cached(v) - cached(w))
                  + queued_prefill_tokens(w) + pending_prefill_tokens(w)
                  + request_tokens * (running(w) + waiting(w) + pending(w))
        score(w) = (min_v work(v) + floor_tokens) / (work(w) + floor_tokens)

    uncached(w) is the prompt less the tokens w holds as cached blocks: a miss costs its tokens,
    not a fixed weight. Recomputing a prefix another worker holds costs twice (duplicate_cost
    1): now, and again later, because the copy takes cache room from another group's prefix,
    which that group then recomputes (a cache smaller than all prefixes holds fewer of them the
    more are held twice). The queue and this router's pending prefills are tokens too; each
    request on the worker adds `request_tokens` for its share of every step. The best worker
    scores 1, one expected to take twice as long about 0.5. `floor_tokens` keeps a few tokens'
    difference between idle workers from counting as a large ratio."""

    name = "expected-latency"
    DEFAULTS = {"request_tokens": 4, "floor_tokens": 16, "duplicate_cost": 1}

    def score(self, ctx, workers):
        most = max((ctx.matched_blocks.get(w.address, 0) for w in workers), default=0) * ctx.block_size
        work = {w.address: self.work(ctx, w, most) for w in workers if w.load is not None}
        floor = self.params["floor_tokens"]
        best = min(work.values(), default=0.0) + floor
        return {
            w.address: best / (work[w.address] + floor)
            if w.address in work
            else missing(self.name, w.address, "load report")
            for w in workers
        }

    def work(self, ctx: ScoringContext, w: WorkerState, most_cached: int) -> float:
        """Token-equivalents of w for this request (w has a load report); `most_cached`: the
        longest cached prefix, in tokens, of any candidate."""
        cached = min(ctx.matched_blocks.get(w.address, 0) * ctx.block_size, ctx.num_prompt_tokens)
        duplicate = self.params["duplicate_cost"] * (min(most_cached, ctx.num_prompt_tokens) - cached)
        queued = w.load.queued_prefill_tokens + w.num_pending_prefill_tokens
        requests = w.load.num_running + w.load.num_waiting + w.num_pending
        return ctx.num_prompt_tokens - cached + duplicate + queued + self.params["request_tokens"] * requests


class RoundRobin(Scorer):
    """A baseline, not a policy: 1 for the next worker in address order, 0 for the others; each
    placement moves the turn on. Used alone it is plain round-robin (the benchmarks' arm (a));
    the cursor is per router replica."""

    name = "round-robin"

    def __init__(self, params: dict | None = None):
        super().__init__(params)
        self._turn = 0

    def score(self, ctx, workers):
        addresses = sorted(w.address for w in workers)
        chosen = addresses[self._turn % len(addresses)] if addresses else None
        self._turn += 1
        return {a: 1.0 if a == chosen else 0.0 for a in addresses}


SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (
        PrefixOverlap,
        QueueDepth,
        KVUsage,
        CacheRoom,
        PendingAssignments,
        QueuedPrefillTokens,
        ExpectedLatency,
        LoraAffinity,
        RoundRobin,
    )
}


def make_scorer(name: str, params: dict | None = None) -> Scorer:
    if name not in SCORERS:
        raise ConfigError(f"unknown scorer {name!r}; allowed: {', '.join(SCORERS)}")
    return SCORERS[name](params)
