"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step is planned afresh (step-level continuous batching). A request is just a token list
and a count of tokens already computed; a step gives each chosen request its next slice of
uncomputed tokens, so "prefill", "chunked prefill" and "decode" are one mechanism:

1. Running requests first, in arrival order. Each takes min(uncomputed tokens, budget left);
   with chunked prefill off, a prompt that does not fit the budget waits for the next step.
   If the KV pool cannot supply the blocks, the most recently arrived running request is
   preempted (its blocks freed, its progress reset, so it recomputes later) until the
   request fits or is itself the victim.
2. Then waiting requests, in arrival order, while the token budget, `max_num_seqs` and the
   pool allow, and only if nothing was preempted this step (so a preempted request is not
   immediately overtaken). A request's first scheduling reuses the longest cached prefix of
   its block hashes (never its last token: its logits are needed).
3. In-flight prefix sharing: a waiting request whose next uncached prompt blocks (at least
   MIN_SHARED_BLOCKS of them) are being computed right now by another request (a prompt in
   prefill, or one waiting for its KV from a prefill worker) is passed over for this step and
   keeps its place at the head of the queue, so it reuses those blocks once they are
   registered instead of computing the same prefix a second time in the same batch. A burst
   of requests sharing a system prompt then costs one prefill of it, not one per request.
   (SGLang's scheduler does the same for requests with a common prefix in one batch, its
   "in-batch prefix caching"; vLLM computes each copy.)

4. Adapter slots: the requests running (or waiting for remote KV) use at most `max_loras`
   distinct LoRA adapters. A waiting request whose adapter is not among them when all slots are
   taken is passed over for this step and keeps its place; requests behind it (base requests,
   or ones whose adapter is already running) are still admitted (vLLM's rule: skip, not block).

5. Scheduling policy (vLLM's --scheduling-policy). "fcfs": as above. "priority": the waiting
   queue is kept ordered by Request.priority_key() (band from the gateway, higher first; then the
   body's priority, lower first; then arrival), a preempted request goes back in that order,
   and when blocks run out the victim is the running request with the largest key (the least
   important, latest) instead of the latest arrival. As in vLLM, a waiting request never
   preempts a running one to get in: preemption happens only when a running request needs
   blocks the pool cannot supply.

A request whose prompt KV comes from a prefill worker (`remote_prefill`) is admitted without
computing anything: it gets blocks for its whole prompt (after its own prefix-cache hits) and
waits in WAITING_FOR_KV, outside the running batch, until the engine reports the KV landed
(`complete_remote_prefill`, with the first token the prefill worker sampled) or failed
(`fallback_to_local_prefill`, which makes it an ordinary running request that computes the
rest of its prompt here). `take_kv_ready()` hands the engine the requests whose blocks are
ready to be written.

A model with several KV groups (platform/kv/groups.py) changes nothing here but the KV manager
(kv/grouped.py): its `allocate` counts what each group really needs (a sliding-window group
releases the blocks its window left behind first), so a long request that fits only thanks to
the window is admitted, and a request waiting for remote KV keeps only the window of its
sliding groups (the KV its first decode step reads). Each slice carries every group's table.

The scheduler never touches a tensor: `schedule()` returns an immutable SchedulerPlan, the
model runner executes it, and `update(plan, result)` applies the sampled tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from splitserve.platform.config import SchedulerConfig
from splitserve.platform.kv.grouped import GroupedKVCacheManager
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.sched.plan import ScheduledSeq, SchedulerPlan, StepResult
from splitserve.platform.sched.request import Request, RequestStatus

# Rule 3 holds a request back only for at least this many shared blocks in flight (SGLang's
# in-batch prefix check uses a like threshold of 32 tokens, two of our default blocks).
MIN_SHARED_BLOCKS = 2


@dataclass(frozen=True)
class TokenUpdate:
    """One request's progress after a step: its new token, if any, and whether it finished."""

    req_id: str
    new_token_id: int | None
    finish_status: RequestStatus | None


@dataclass
class SchedulerStats:
    # Prompt tokens looked up in the prefix cache and found there, once per request at its
    # first scheduling (vLLM's prefix_cache_queries/hits): a request that waits and is looked
    # up again on the next step is not counted twice.
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_computed_tokens: int = 0  # tokens run through the model, all requests
    num_preemptions: int = 0
    num_remote_prefill_tokens: int = 0  # prompt tokens whose KV came from a prefill worker
    num_prefix_waits: int = 0  # steps a waiting request sat out for a prefix in flight (rule 3)
    num_lora_waits: int = 0  # steps a waiting request sat out for an adapter slot (rule 4)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager | GroupedKVCacheManager,
        max_model_len: int,
        max_loras: int = 1,
    ):
        self.config = config.resolved(max_model_len)
        self.max_loras = max_loras
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.awaiting_kv: dict[str, Request] = {}
        self._kv_ready: list[Request] = []
        self.stats = SchedulerStats()

    # -- intake ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id}"
        self.requests[req.req_id] = req
        self._enqueue(req, front=False)

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: fcfs at the back (a preempted request at the front); priority
        in priority_key() order."""
        if self.config.policy == "fcfs":
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        key = req.priority_key()
        index = next((i for i, other in enumerate(self.waiting) if other.priority_key() > key), len(self.waiting))
        self.waiting.insert(index, req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort or stop string): free its blocks, forget it."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_KV:
            del self.awaiting_kv[req_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- planning --------------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted: list[str] = []
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._num_tokens_to_run(req, budget)
            if n == 0:
                continue
            if not self._allocate_or_preempt(req, n, preempted):
                break
            num_new[req.req_id] = n
            # A "priority" victim may be a request planned earlier in this loop: unplan it.
            for req_id in preempted:
                num_new.pop(req_id, None)
            budget = self.config.max_num_batched_tokens - sum(num_new.values())
        if not preempted:
            budget = self._admit_waiting(budget, num_new)
        seqs = tuple(self._seq(self.requests[rid], n) for rid, n in num_new.items())
        return SchedulerPlan(seqs=seqs, preempted_req_ids=tuple(preempted))

    def _num_tokens_to_run(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if req.spec_token_ids:
            # A decode step that verifies proposals: only what the budget and the pool allow
            # without preempting anyone for them (speculation never costs another request).
            fits = max(0, min(len(req.spec_token_ids), budget - n))
            while fits and not self.kv.can_fit(req, n + fits):
                fits -= 1
            del req.spec_token_ids[fits:]
            return min(n + fits, budget) if n <= budget else 0
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(n, budget)

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[str]) -> bool:
        while not self.kv.allocate(req, n):
            victim = self.running[-1] if self.config.policy == "fcfs" else max(self.running, key=Request.priority_key)
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(req, front=True)

    def _admit_waiting(self, budget: int, num_new: dict[str, int]) -> int:
        in_flight = self._prompt_blocks_in_flight() if self.waiting else set()
        active_loras = self.active_lora_ids()
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.lora_id is not None and req.lora_id not in active_loras and len(active_loras) >= self.max_loras:
                passed_over.append(self.waiting.popleft())  # rule 4: no adapter slot this step
                self.stats.num_lora_waits += 1
                continue
            cached = self.kv.find_cached_prefix(req)
            if self._waits_for_prefix(req, cached, in_flight):
                passed_over.append(self.waiting.popleft())
                self.stats.num_prefix_waits += 1
                continue
            num_hit_tokens = len(cached) * self.kv.block_size
            if req.remote_prefill and req.num_cached_tokens < 0:
                if not self._admit_remote(req, cached, num_hit_tokens):
                    break
            else:
                n = req.num_tokens - num_hit_tokens
                if n > budget and not self.config.enable_chunked_prefill:
                    break
                n = min(n, budget)
                if not self.kv.allocate(req, n, cached):
                    break
                self.waiting.popleft()
                self._start(req, num_hit_tokens)
                num_new[req.req_id] = n
                budget -= n
            in_flight.update(self._uncomputed_prompt_blocks(req))
            if req.lora_id is not None:
                active_loras.add(req.lora_id)
        self.waiting.extendleft(reversed(passed_over))
        return budget

    def active_lora_ids(self) -> set[str]:
        """Adapters of the requests running or waiting for remote KV (those hold the slots)."""
        return {r.lora_id for r in (*self.running, *self.awaiting_kv.values()) if r.lora_id is not None}

    def _prompt_blocks_in_flight(self) -> set:
        """Hashes of the full prompt blocks that running or KV-awaiting requests have yet to fill."""
        in_flight = set()
        for req in (*self.running, *self.awaiting_kv.values()):
            in_flight.update(self._uncomputed_prompt_blocks(req))
        return in_flight

    def _uncomputed_prompt_blocks(self, req: Request) -> list:
        bs = self.kv.block_size
        return req.block_hashes[req.num_computed_tokens // bs : req.num_prompt_tokens // bs]

    def _waits_for_prefix(self, req: Request, cached: list, in_flight: set) -> bool:
        """Rule 3: the next MIN_SHARED_BLOCKS blocks `req` would compute are being computed by
        another request. (Sharing a single block, typically a chat template's opening, is not
        worth a step's delay.)"""
        if not in_flight or not self.config.share_prefix_in_flight or req.params.prompt_logprobs is not None:
            return False
        start = len(cached)
        reusable = (req.num_tokens - 1) // self.kv.block_size
        upcoming = req.block_hashes[start : min(start + MIN_SHARED_BLOCKS, reusable)]
        return len(upcoming) == MIN_SHARED_BLOCKS and all(h in in_flight for h in upcoming)

    def _admit_remote(self, req: Request, cached, num_hit_tokens: int) -> bool:
        """Blocks for the whole prompt, no compute: the KV of the uncached part will arrive."""
        if not self.kv.allocate(req, req.num_tokens - num_hit_tokens, cached):
            return False
        if self.kv.is_grouped:  # sliding-window layers receive only the window their first decode sees
            self.kv.release_out_of_window(req, req.num_tokens)
        self.waiting.popleft()
        self._record_first_scheduling(req, num_hit_tokens)
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.WAITING_FOR_KV
        self.awaiting_kv[req.req_id] = req
        self._kv_ready.append(req)
        return True

    def take_kv_ready(self) -> list[Request]:
        """Requests admitted for remote prefill since the last call (their blocks are allocated)."""
        ready, self._kv_ready = self._kv_ready, []
        return [r for r in ready if r.status == RequestStatus.WAITING_FOR_KV]

    def complete_remote_prefill(self, req_id: str, first_token_id: int) -> TokenUpdate | None:
        """The prompt's KV has landed and the prefill worker sampled `first_token_id`."""
        req = self.awaiting_kv.pop(req_id, None)
        if req is None:
            return None
        req.num_computed_tokens = req.num_tokens
        self.stats.num_remote_prefill_tokens += req.num_tokens - req.num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return self._apply_token(req, first_token_id)

    def fallback_to_local_prefill(self, req_id: str, num_computed_tokens: int | None = None) -> bool:
        """The remote prefill failed, or a pull brought only a prefix: compute the rest of the
        prompt here, in the blocks we hold. `num_computed_tokens`: the prompt tokens whose KV is
        now in those blocks (a pull's end, whole blocks below the last prompt token); None: only
        the local prefix-cache hits."""
        req = self.awaiting_kv.pop(req_id, None)
        if req is None:
            return False
        if num_computed_tokens is not None:
            assert req.num_computed_tokens <= num_computed_tokens < req.num_tokens, (
                f"pulled up to {num_computed_tokens} of {req.num_tokens} tokens"
            )
            req.num_computed_tokens = num_computed_tokens
            # The pulled blocks hold their KV now: into the prefix cache at once. Left to the
            # step that computes the rest, they would be neither cached nor in flight (rule 3)
            # until it ends, and a request waiting for them would compute them again beside it.
            self.kv.register_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _start(self, req: Request, num_hit_tokens: int) -> None:
        if req.num_cached_tokens < 0:  # first time, not a resume after preemption
            self._record_first_scheduling(req, num_hit_tokens)
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _record_first_scheduling(self, req: Request, num_hit_tokens: int) -> None:
        req.num_cached_tokens = num_hit_tokens
        req.first_scheduled_time = time.monotonic()
        self.stats.num_prefix_query_tokens += req.num_prompt_tokens
        self.stats.num_prefix_hit_tokens += num_hit_tokens

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        num_known = min(n, req.num_tokens - start)
        drafts = tuple(req.spec_token_ids[: n - num_known])
        return ScheduledSeq(
            req_id=req.req_id,
            token_ids=tuple(req.all_token_ids[start : start + num_known]) + drafts,
            start_pos=start,
            block_ids=tuple(self.kv.block_ids(req.req_id)),
            do_sample=start + num_known == req.num_tokens,
            num_draft_tokens=len(drafts),
            group_block_ids=self.kv.group_block_ids(req.req_id) if self.kv.is_grouped else None,
        )

    # -- applying results ------------------------------------------------------------------
    def update(self, plan: SchedulerPlan, result: StepResult) -> list[TokenUpdate]:
        updates = []
        for seq in plan.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self.stats.num_computed_tokens += seq.num_tokens
            if seq.num_draft_tokens:
                updates += self._apply_verified(req, seq, result.spec_tokens[seq.req_id])
                continue
            req.num_computed_tokens += seq.num_tokens
            if not seq.do_sample:
                self.kv.register_computed_blocks(req)
                continue
            updates.append(self._apply_token(req, result.sampled[seq.req_id]))
        return updates

    def _apply_verified(self, req: Request, seq: ScheduledSeq, tokens: list[int]) -> list[TokenUpdate]:
        """A verification step's tokens: the accepted proposals, then the one sampled where
        verification stopped. The KV of the accepted proposals is kept (it was computed from
        exactly those tokens); the rejected ones' slots are rolled back and their blocks freed."""
        req.spec_token_ids = []
        num_accepted = len(tokens) - 1
        assert 0 <= num_accepted <= seq.num_draft_tokens, (num_accepted, seq.num_draft_tokens)
        req.num_computed_tokens += seq.num_tokens - seq.num_draft_tokens + num_accepted
        updates = []
        for token_id in tokens:
            update = self._apply_token(req, token_id)
            updates.append(update)
            if update.finish_status is not None:
                return updates
        self.kv.trim(req, req.num_tokens)
        return updates

    def _apply_token(self, req: Request, token_id: int) -> TokenUpdate:
        req.append_output_token(token_id)
        self.kv.register_computed_blocks(req)
        status = req.check_stop()
        if status is None and req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_request(req.req_id, status)
        return TokenUpdate(req.req_id, token_id, status)
