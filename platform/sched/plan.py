"""The scheduler's output: an immutable plan of which tokens of which requests run this step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's slice of a step.

    `token_ids` are the input tokens at positions [start_pos, start_pos + len(token_ids));
    `block_ids` is the request's whole block table (covering start_pos + len(token_ids) tokens);
    `do_sample` is True when this slice reaches the request's last known token, so its logits
    pick the next token (a chunk in the middle of a prompt samples nothing).
    `num_draft_tokens`: the last this many of `token_ids` are speculative proposals to verify
    (the slice then samples at each of its last num_draft_tokens + 1 positions).
    `group_block_ids`: a model with several KV groups (platform/kv/groups.py) has one table per
    group (holes out of a sliding window read as NULL_BLOCK_ID) and `block_ids` is group 0's;
    None for a single-group model.
    """

    req_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    do_sample: bool
    num_draft_tokens: int = 0
    group_block_ids: tuple[tuple[int, ...], ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A slice the batched decode path computes, one row per token: a single new token, or a
        verifying slice (its last known token and the proposals after it). The decode kernels
        write every row's K/V before any row attends, and row i sees keys up to its own position,
        so proposals are verified causally with the per-token numbers of plain decode steps."""
        return len(self.token_ids) == 1 or len(self.token_ids) == self.num_draft_tokens + 1


@dataclass(frozen=True)
class SchedulerPlan:
    seqs: tuple[ScheduledSeq, ...]
    preempted_req_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class StepResult:
    """What the model runner returns: the sampled token (and logprobs) per sampling request."""

    sampled: dict[str, int]
    logprobs: dict[str, float] | None = None
    top_logprobs: dict[str, list[tuple[int, float]]] | None = None
    # Speculating requests: every token the step produced, in order (the accepted proposals,
    # then the token sampled where verification stopped); `sampled` holds the first of them.
    # Per-token logprobs of those requests, when asked for, as (logprob, top) pairs.
    spec_tokens: dict[str, list[int]] | None = None
    spec_logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] | None = None
    # Prompt logprobs of the slices that asked (req_id -> TokenLogprobs, in position order).
    prompt_logprobs: dict[str, list] | None = None
    # Embeddings of the requests with params.embed whose prompt ended this step (req_id -> floats).
    embeddings: dict[str, list[float]] | None = None
