"""What a request used: the typed usage record, and the per-choice state it is counted from.

The pipeline (core/pipeline.py) adds every chunk to its choice's `ChoiceState` and, when the
request ends, counts one `Usage` from them. The same record settles the key's quota
(tenancy/quota.py: its counters and its Redis usage rows) and is written into every answer
(api/formatting.py turns it into OpenAI's usage object; the Responses API and embeddings into
theirs). A distinct prompt is counted once (n choices of one prompt share it); completion
tokens are summed over choices; `cached_tokens` are prompt tokens the decode worker served from
its prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.router.core.job import Chunk


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChoiceState:
    """One choice of a request, accumulated chunk by chunk (a whole answer is built from it)."""

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.last: Chunk | None = None
        self.prompt_logprobs: list = []  # what the worker scored of the prompt (api/echo.py)
        self.is_echoed = False  # a stream sent the echoed prompt

    def add(self, chunk: Chunk) -> None:
        self.prompt_logprobs = chunk.prompt_logprobs or self.prompt_logprobs
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.last = chunk


def count_usage(num_prompt_tokens: int, choices: list[ChoiceState], *, counts_completion: bool = True) -> Usage:
    """The usage of a request whose choices got what `choices` hold (a cut stream: so far).
    counts_completion=False for answers that bill no generated token (embeddings, echo-only)."""
    completion = sum(c.last.num_completion_tokens for c in choices if c.last is not None) if counts_completion else 0
    cached = next((c.last.num_cached_tokens for c in choices if c.last is not None), 0)
    return Usage(num_prompt_tokens, completion, cached)
