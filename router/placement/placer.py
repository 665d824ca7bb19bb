"""Placement: which decode worker serves a request, and which prefill workers (if any) compute
its prompt (docs/workers.md, docs/router.md).

    1. one index lookup: consecutive cached blocks of the prompt on every candidate worker;
    2. decode profile: filters (healthy, not draining, not saturated) -> weighted scorers ->
       the maximum, ties broken at random;
    3. disaggregation decision on the chosen decode worker D: `never` -> local prefill;
       `always` -> remote; `conditional` -> remote only if the tokens D would compute
       (prompt - D's cached prefix) are at least `min_prefill_tokens`;
    4. if remote: prefill profile over the prefill-capable workers other than D, best first,
       the top `max_prefill_candidates` (D tries them in order and prefills locally if all fail);
       if none passes the filters, D prefills locally;
    4a. pull instead of recompute, when D prefills locally (router/placement/pull_cost.py): if another
       healthy prefill-capable worker H holds more of the prompt's prefix than D and pulling
       the difference is estimated cheaper than computing it, D is told to pull those blocks
       from H (a remote prefill already reuses the prefill worker's cache); D recomputes if the
       pull fails;
    5. speculative index entries for the prompt's blocks on D (and the first prefill worker);
    6. for a LoRA request, when the decode profile scores adapter affinity: the adapters D holds
       in memory that another decode worker holds too (`lora_evict_first`), which D evicts first
       if it must read this request's adapter into a full memory.

The Placer reads the pool and the index and writes only speculative entries; the dispatcher
records the assignment. Scores are kept in the Decision for logs and tests.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from splitserve.router.config.placement import PlacementConfig, ProfileConfig
from splitserve.router.errors import NoWorkerError
from splitserve.router.placement.filters import make_filter
from splitserve.router.placement.index import PrefixIndex
from splitserve.router.placement.pool import WorkerPool, WorkerState
from splitserve.router.placement.pull_cost import PullCost
from splitserve.router.placement.scorers import LoraAffinity, ScoringContext, make_scorer

log = logging.getLogger(__name__)

TIE_DIGITS = 9  # scores equal to 9 decimals are a tie


@dataclass(frozen=True)
class PlacementRequest:
    """What placement reads of one attempt: the gateway's dispatcher and the EPP each build one."""

    num_tokens: int  # the prompt (plus, on a resume, the output so far)
    hashes: list[bytes]  # its full blocks' prefix hashes (empty: no prefix matching, e.g. LoRA)
    exclude: frozenset[str] = frozenset()  # workers this request already failed on
    lora_name: str | None = None  # a LoRA adapter; None: the base model
    lora_workers: set[str] | None = None  # for a LoRA request: the workers that have it loaded


@dataclass(frozen=True)
class Decision:
    decode: str
    prefill: tuple[str, ...] = ()
    num_cached_blocks: int = 0  # the decode worker's matched prefix, per the index
    num_uncached_tokens: int = 0
    scores: dict = field(default_factory=dict)  # role -> {address: total}
    lora_evict_first: tuple[str, ...] = ()  # step 6 of the module docstring
    pull: tuple[str, int] | None = None  # step 4a: (holder's address, its matched blocks)


class Profile:
    """Filters and weighted scorers of one role, built once from its ProfileConfig."""

    def __init__(self, role: str, config: ProfileConfig):
        self.role = role
        self.filters = [make_filter(name, config.filter_params.get(name), role) for name in config.filters]
        self.scorers = [(make_scorer(s.name, s.params), float(s.weight)) for s in config.scorers if s.weight > 0]
        self.scores_adapters = any(isinstance(scorer, LoraAffinity) for scorer, _ in self.scorers)

    def filter(self, workers: list[WorkerState], now: float) -> list[WorkerState]:
        """Workers passing every filter; NoWorkerError naming the filter that left nobody."""
        if not workers:
            raise NoWorkerError(f"no {self.role} worker is known to the router")
        for f in self.filters:
            kept = f.select(workers, now)
            if not kept:
                raise NoWorkerError(f"{f.empty_reason} ({self.role}, {len(workers)} considered)", f.empty_status)
            workers = kept
        return workers

    def rank(self, ctx: ScoringContext, workers: list[WorkerState], rng: random.Random) -> list[tuple[str, float]]:
        """(address, weighted score), best first; equal scores in random order."""
        totals = dict.fromkeys((w.address for w in workers), 0.0)
        for scorer, weight in self.scorers:
            for address, value in scorer.score(ctx, workers).items():
                assert 0.0 <= value <= 1.0, f"scorer {scorer.name} gave {value} for {address}"
                totals[address] += weight * value
        order = list(totals.items())
        rng.shuffle(order)  # random tie-break survives the stable sort
        order.sort(key=lambda item: -round(item[1], TIE_DIGITS))
        return order


class Placer:
    def __init__(self, config: PlacementConfig, pool: WorkerPool, index: PrefixIndex, rng: random.Random | None = None):
        self.config = config
        self.pool = pool
        self.index = index
        self.rng = rng or random.Random()
        self.decode_profile = Profile("decode", config.decode)
        self.prefill_profile = Profile("prefill", config.prefill)
        self.pull_cost = PullCost(config.kv_pull, pool.block_size)

    async def place(self, request: PlacementRequest) -> Decision:
        """For a LoRA request the decode candidates are only `request.lora_workers` (the others
        would refuse it)."""
        num_tokens, hashes, exclude, lora_name = request.num_tokens, request.hashes, request.exclude, request.lora_name
        now = self.pool.clock()
        candidates = [w for w in self.pool.decode_workers() if w.address not in exclude]
        if request.lora_workers is not None:
            candidates = [w for w in candidates if w.address in request.lora_workers]
            if not candidates:
                raise NoWorkerError(f"no decode worker has adapter {lora_name!r} loaded")
        decode = self.decode_profile.filter(candidates, now)
        prefill = [w for w in self.pool.prefill_workers() if w.address not in exclude]
        addresses = list(dict.fromkeys([w.address for w in decode] + [w.address for w in prefill]))
        matched = await self.index.match(addresses, hashes)
        ctx = ScoringContext(num_tokens, len(hashes), matched, now, lora_name, self.pool.block_size)
        ranked = self.decode_profile.rank(ctx, decode, self.rng)
        chosen = ranked[0][0]
        cached = ctx.matched_blocks.get(chosen, 0)
        uncached = max(num_tokens - cached * self.pool.block_size, 0)
        scores = {"decode": dict(ranked)}
        prefill_list = ()
        pull = None
        if self._wants_remote(uncached, prefill):
            prefill_list, scores["prefill"] = self._pick_prefill(ctx, prefill, chosen, now)
        if not prefill_list and lora_name is None:
            pull = self._pull_from(ctx, prefill, chosen, cached, now)
        await self.index.add_speculative(chosen, hashes)
        if prefill_list:
            await self.index.add_speculative(prefill_list[0], hashes)
        evict_first = self._evict_first(chosen, lora_name, now) if self.decode_profile.scores_adapters else ()
        return Decision(chosen, prefill_list, cached, uncached, scores, evict_first, pull)

    def _pull_from(
        self, ctx: ScoringContext, workers: list[WorkerState], chosen: str, cached: int, now: float
    ) -> tuple[str, int] | None:
        """Step 4a: (the holder with the longest match, its match) when pulling beats computing."""
        best, best_blocks = None, cached
        for w in workers:
            blocks = ctx.matched_blocks.get(w.address, 0)
            if (
                w.address != chosen
                and blocks > best_blocks
                and w.is_healthy(now)
                and not (w.load is not None and w.load.draining)
            ):
                best, best_blocks = w.address, blocks
        if best is None or not self.pull_cost.is_worth(best_blocks - cached):
            return None
        return best, best_blocks

    def _evict_first(self, chosen: str, lora_name: str | None, now: float) -> tuple[str, ...]:
        """The adapters `chosen` holds in memory that another healthy decode worker holds too,
        less those its requests use now (the scorer sends their next requests back to it).

        Each worker keeps its --max-cpu-loras adapters by its own LRU, so adapters that load
        spilled onto a second worker crowd out ones only it holds, and the pool as a whole holds
        fewer distinct adapters than it has room for; every request for one it lost waits for a
        disk read. Evicting a duplicate first costs nothing while its twin stays resident: the
        adapter-affinity scorer already prefers the worker that holds it. Only with that scorer
        (a policy that ignores residency would send the next request anywhere)."""
        if lora_name is None:
            return ()
        mine, in_use, elsewhere = set(), {lora_name}, set()
        for w in self.pool.decode_workers():
            if w.load is None:
                continue
            if w.address == chosen:
                mine = set(w.load.resident_lora_adapters)
                in_use.update(w.load.running_lora_adapters, w.load.waiting_lora_adapters)
            elif w.is_healthy(now):
                elsewhere.update(w.load.resident_lora_adapters)
        return tuple(sorted((mine & elsewhere) - in_use))

    def _wants_remote(self, num_uncached: int, prefill: list[WorkerState]) -> bool:
        mode = self.config.disaggregation.mode
        if mode == "never" or not prefill:
            return False
        return mode == "always" or num_uncached >= self.config.disaggregation.min_prefill_tokens

    def _pick_prefill(self, ctx: ScoringContext, prefill: list[WorkerState], decode: str, now: float):
        candidates = [w for w in prefill if w.address != decode]
        try:
            kept = self.prefill_profile.filter(candidates, now)
        except NoWorkerError as exc:
            log.info("prefilling on the decode worker: %s", exc)
            return (), {}
        ranked = self.prefill_profile.rank(ctx, kept, self.rng)
        top = tuple(address for address, _ in ranked[: self.config.disaggregation.max_prefill_candidates])
        return top, dict(ranked)
