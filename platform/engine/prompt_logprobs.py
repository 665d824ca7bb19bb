"""Prompt logprobs: the log probability of every prompt token given the tokens before it.

What the OpenAI `echo` + `logprobs` (and vLLM's `prompt_logprobs`) ask for, and what
lm-evaluation-harness scores multiple-choice answers with. The logits at position p predict
token p + 1, so a prompt of n tokens has n - 1 logprobs (the first token has none) and they come
from the hidden states the prefill forward computes anyway; nothing runs a second time.

Memory is bounded twice over. The scheduler already cuts a long prompt into chunks of at most
the step's token budget; within a chunk the logits are computed SLICE_ROWS positions at a time,
log-softmaxed, and reduced at once to the chosen token's logprob and the top-k (k <= 20), so the
largest temporary is [SLICE_ROWS, vocab] floats (256 x 49152 x 4 B = 48 MiB for SmolLM2) whatever
the prompt length, never the [prompt, vocab] matrix.

Every position must be computed for its logits, so a request that wants prompt logprobs does not
reuse prefix-cache hits (KVCacheManager.find_cached_prefix returns none for it) and is never held
back to share an in-flight prefix. A request preempted and recomputed overwrites the same
positions with the same values.

A request that wants them carries a `Collected` on its RequestState (engine/request_state.py):
the engine asks `wants` which positions each step should score, `absorb`s the step's results,
and the output processor hands the whole list over once, with the request's first output
(`take`). The state goes with the request, so an abort forgets it with everything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from splitserve.platform.engine.outputs import TokenLogprob

SLICE_ROWS = 256


@dataclass(frozen=True)
class Want:
    """One request's slice of this step whose logits give prompt logprobs."""

    num_top: int  # top-k alternatives per position (0: the chosen token only)
    targets: tuple[int, ...]  # the prompt tokens the slice's positions predict, in order


@dataclass
class Collected:
    """One request's prompt logprobs so far (entry i: prompt token i's; None until scored)."""

    num_top: int
    prompt_token_ids: list[int]
    entries: list[TokenLogprob | None] = field(default_factory=list)

    @classmethod
    def start(cls, num_top: int, prompt_token_ids: list[int]) -> Collected:
        return cls(num_top, list(prompt_token_ids), [None] * len(prompt_token_ids))


def compute(model, hidden: torch.Tensor, rows: dict[str, tuple[int, Want]]) -> dict[str, list[TokenLogprob]]:
    """Logprobs for each wanted slice: `rows` maps req_id -> (first row in `hidden`, Want);
    the slice's positions are rows first .. first + len(targets) - 1."""
    out: dict[str, list[TokenLogprob]] = {}
    for req_id, (first, want) in rows.items():
        entries: list[TokenLogprob] = []
        targets = torch.tensor(want.targets, dtype=torch.long, device=hidden.device)
        for start in range(0, len(want.targets), SLICE_ROWS):
            end = min(start + SLICE_ROWS, len(want.targets))
            logprobs = torch.log_softmax(model.compute_logits(hidden[first + start : first + end]).float(), dim=-1)
            chosen = logprobs.gather(1, targets[start:end, None]).squeeze(1).tolist()
            if want.num_top:
                top_values, top_ids = logprobs.topk(want.num_top, dim=-1)
                tops = [tuple(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
            else:
                tops = [()] * (end - start)
            entries += [TokenLogprob(t, lp, top) for t, lp, top in zip(want.targets[start:end], chosen, tops)]
        out[req_id] = entries
    return out


def wants(seqs, collected: Mapping[str, Collected]) -> dict[str, Want]:
    """For the plan's slices: the prompt positions p < n - 1 they compute (each predicts p + 1).
    `collected`: req_id -> Collected of the requests that want prompt logprobs."""
    out = {}
    for seq in seqs:
        st = collected.get(seq.req_id)
        if st is None:
            continue
        end = min(seq.context_len, len(st.prompt_token_ids) - 1)
        if seq.start_pos < end:
            out[seq.req_id] = Want(st.num_top, tuple(st.prompt_token_ids[seq.start_pos + 1 : end + 1]))
    return out


def absorb(seqs, computed: dict[str, list[TokenLogprob]] | None, collected: Mapping[str, Collected]) -> None:
    """Store a step's results at their positions (entry i of the prompt: token i's logprob)."""
    if not computed:
        return
    for seq in seqs:
        entries = computed.get(seq.req_id)
        st = collected.get(seq.req_id)
        if entries is None or st is None:
            continue
        st.entries[seq.start_pos + 1 : seq.start_pos + 1 + len(entries)] = entries


def finished(st: Collected, req_id: str) -> list[TokenLogprob | None]:
    """The whole list (None first: the first token has no logprob)."""
    assert all(e is not None for e in st.entries[1:]), f"{req_id}: prompt logprobs incomplete"
    return st.entries
