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

The scheduler never touches a tensor: `schedule()` returns an immutable SchedulerPlan, the
model runner executes it, and `update(plan, result)` applies the sampled tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from splitserve.platform.config import SchedulerConfig
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.sched.plan import SchedulerPlan, ScheduledSeq, StepResult
from splitserve.platform.sched.request import Request, RequestStatus


@dataclass(frozen=True)
class TokenUpdate:
    """One request's progress after a step: its new token, if any, and whether it finished."""

    req_id: str
    new_token_id: int | None
    finish_status: RequestStatus | None


@dataclass
class SchedulerStats:
    num_prefix_hit_tokens: int = 0
    num_computed_tokens: int = 0   # tokens run through the model, all requests
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # -- intake ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id}"
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort or stop string): free its blocks, forget it."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
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
            budget -= n
        if not preempted:
            budget = self._admit_waiting(budget, num_new)
        seqs = tuple(self._seq(self.requests[rid], n) for rid, n in num_new.items())
        return SchedulerPlan(seqs=seqs, preempted_req_ids=tuple(preempted))

    def _num_tokens_to_run(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(n, budget)

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[str]) -> bool:
        while not self.kv.allocate(req, n):
            victim = self.running[-1]
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
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: int, num_new: dict[str, int]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            num_hit_tokens = len(cached) * self.kv.block_size
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
        return budget

    def _start(self, req: Request, num_hit_tokens: int) -> None:
        if req.num_cached_tokens < 0:  # first time, not a resume after preemption
            req.num_cached_tokens = num_hit_tokens
            req.first_scheduled_time = time.monotonic()
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.stats.num_prefix_hit_tokens += num_hit_tokens

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(
            req_id=req.req_id,
            token_ids=tuple(req.all_token_ids[start:start + n]),
            start_pos=start,
            block_ids=tuple(self.kv.block_ids(req.req_id)),
            do_sample=start + n == req.num_tokens,
        )

    # -- applying results ------------------------------------------------------------------
    def update(self, plan: SchedulerPlan, result: StepResult) -> list[TokenUpdate]:
        updates = []
        for seq in plan.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += seq.num_tokens
            self.stats.num_computed_tokens += seq.num_tokens
            if not seq.do_sample:
                self.kv.register_computed_blocks(req)
                continue
            token_id = result.sampled[seq.req_id]
            req.append_output_token(token_id)
            self.kv.register_computed_blocks(req)
            status = req.check_stop()
            if status is None and req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish_request(req.req_id, status)
            updates.append(TokenUpdate(req.req_id, token_id, status))
        return updates
