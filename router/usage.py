"""What a request used: one typed record, produced once per request and read by quota, metrics and
the answer.

The pipeline (core/pipeline.py) counts it from the request's choices (core/choices.py) when the
request ends. The same record settles the key's quota (tenancy/quota.py: its counters and its Redis
usage rows) and is written into every answer (api/formatting.py turns it into OpenAI's usage object;
the Responses API and embeddings into theirs). A distinct prompt is counted once (n choices of one
prompt share it); completion tokens are summed over choices; `cached_tokens` are prompt tokens the
decode worker served from its prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
