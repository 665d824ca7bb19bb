"""The per-choice state a request's usage is counted from.

The pipeline (core/pipeline.py) adds every chunk to its choice's `ChoiceState` and, when the
request ends, `count_usage` turns them into the one `Usage` record (router/usage.py): a distinct
prompt is counted once, completion tokens are summed over choices, and the cached tokens are those
the decode worker reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.router.usage import Usage

if TYPE_CHECKING:
    from splitserve.router.core.job import Chunk


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
