"""A request as the API edge prepared it: the jobs the pipeline runs, and what its formatter needs.

api/prompts.py (chat and completions) and api/embeddings.py build one `Prepared` per request; the
pipeline (core/pipeline.py) reads its jobs and prompt tokens, and the formatter (api/formatting.py)
its answer plans: `echo` (api/echo.py fills it) and `tools` (api/tools.py). The plans are plain
data, so core carries them without importing the API layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.router.core.job import Job


@dataclass(frozen=True)
class ToolPlan:
    """How to read tool calls from the answer of a chat request with tools."""

    forced: bool  # required or named: the output is the forced JSON list
    parser: str  # for auto
    names: tuple[str, ...]


@dataclass(frozen=True)
class EchoPlan:
    """What `echo` and `prompt_logprobs` put in front of a completions answer."""

    texts: tuple[str, ...]  # per choice: the prompt as it comes back in `text`
    token_ids: tuple[tuple[int, ...], ...]  # per choice: the prompt's token ids
    is_echo: bool  # prompt text (and logprobs) at the start of the choice
    is_prompt_only: bool  # max_tokens 0: no generated token in the answer
    has_prompt_logprobs_field: bool  # vLLM's `prompt_logprobs` was asked for


@dataclass(frozen=True)
class Prepared:
    request_id: str
    model: str
    jobs: list[Job]
    num_prompt_tokens: int  # summed over distinct prompts
    logprobs: int | None  # top-n alternatives per token, None: no logprobs
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None  # chat with tools: how to read tool calls from the answer
    return_token_ids: bool = False  # answer the generated token ids too (vLLM's extension)
    echo: EchoPlan | None = None  # completions with echo / prompt_logprobs (router/api/echo.py)
