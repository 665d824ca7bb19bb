"""The engine's speculative decoding policy: who speculates this step, and how well it went.

Before each step the engine asks `propose` for the running requests. A request gets n-gram proposals
(platform/spec/ngram.py) when it is decoding (its last token is its only uncomputed one), is not
grammar-constrained (proposals would have to be checked against the grammar; such requests decode
one token at a time), and has room: proposals plus the token after them stay within its max_tokens
and the engine's max_model_len. Speculation is off for the whole step when more than
`max_batch_size` requests run (verification multiplies the batch's tokens by up to k + 1, and past
some batch size the forward is compute-bound, so the extra tokens cost more than the steps they
save), and off for a request whose acceptance rate (accepted over proposed tokens), after
`min_proposals` verification rounds, fell below `min_acceptance_rate`. The proposals ride on
`Request.spec_token_ids`; the scheduler trims them to what the token budget and the KV pool allow.

How many tokens a request proposes adapts to how its last verification went (`next_k`): it starts at
`num_speculative_tokens`; all accepted doubles its k (up to that maximum), a rejection sets it to
one more than the number accepted. A verification row is not free (each proposal is one more row
through every linear of the step), and n-gram acceptance is bimodal: a request copying a run of its
prompt takes every proposal, one writing something new takes none. So a request that is copying
proposes the most, and one that just diverged proposes one token, whose verification costs little
more than a plain step, until it matches again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from splitserve.platform.config import SpeculativeConfig
from splitserve.platform.engine.request_state import RequestState
from splitserve.platform.sched.plan import SchedulerPlan, StepResult
from splitserve.platform.sched.request import Request
from splitserve.platform.spec import ngram


@dataclass
class SpecStats:
    """Counters since start (vLLM's names in the worker's /metrics)."""

    num_drafts: int = 0  # verification steps (requests x steps that carried proposals)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposals accepted
    # accepted_lengths[n]: verification steps that accepted exactly n proposals
    accepted_lengths: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_lengths=[0] * (config.num_speculative_tokens + 1))

    def propose(self, running: Iterable[Request], states: Mapping[str, RequestState]) -> None:
        """Before a step: set `spec_token_ids` on the running requests that speculate in it."""
        running = list(running)
        cfg = self.config
        on = len(running) <= cfg.max_batch_size
        for req in running:
            req.spec_token_ids = []
            state = states[req.req_id]
            if not on or state.matcher is not None or req.num_computed_tokens != req.num_tokens - 1:
                continue
            if (
                state.num_spec_rounds >= cfg.min_proposals
                and state.num_spec_accepted < cfg.min_acceptance_rate * state.num_spec_proposed
            ):
                continue
            room = min(
                state.spec_k or cfg.num_speculative_tokens,
                req.params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                req.spec_token_ids = ngram.propose(
                    req.all_token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max
                )

    def record(self, plan: SchedulerPlan, result: StepResult, states: Mapping[str, RequestState]) -> None:
        """After a step: count each verification, per request and in total."""
        for seq in plan.seqs:
            tokens = (result.spec_tokens or {}).get(seq.req_id)
            if not seq.num_draft_tokens or tokens is None:
                continue
            num_accepted = len(tokens) - 1
            state = states[seq.req_id]
            state.num_spec_proposed += seq.num_draft_tokens
            state.num_spec_accepted += num_accepted
            state.num_spec_rounds += 1
            state.spec_k = next_k(
                state.spec_k or self.config.num_speculative_tokens,
                seq.num_draft_tokens,
                num_accepted,
                self.config.num_speculative_tokens,
            )
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += seq.num_draft_tokens
            self.stats.num_accepted_tokens += num_accepted
            self.stats.accepted_lengths[num_accepted] += 1


def next_k(k: int, num_proposed: int, num_accepted: int, max_k: int) -> int:
    """A request's proposal budget after a verification that accepted `num_accepted` of its
    `num_proposed` tokens under budget `k` (fewer than k are proposed where the n-gram's
    continuation or the request's room is shorter; that is no reason to shrink)."""
    if num_accepted >= num_proposed:
        return min(max_k, max(k, 2 * num_proposed))
    return min(max_k, num_accepted + 1)


def token_result(result: StepResult, req_id: str, i: int) -> StepResult:
    """The step result as output processing sees the i-th token a request got in this step
    (a speculating request gets several; every other request one, i = 0)."""
    if not result.spec_tokens or req_id not in result.spec_tokens:
        return result
    token = result.spec_tokens[req_id][i]
    logprob = (result.spec_logprobs or {}).get(req_id)
    if logprob is None:
        return StepResult(sampled={req_id: token})
    value, top = logprob[i]
    return StepResult(sampled={req_id: token}, logprobs={req_id: value}, top_logprobs={req_id: top})
