"""What the engine hands back per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.platform.engine.kv_handoff import KVReady


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first


@dataclass
class RequestOutput:
    """The increment of one request in one step, plus running totals.

    `new_text` is UTF-8-safe (never half a character) and never contains a stop string unless
    include_stop_str_in_output. `finish_reason` is None until the last output, then "stop"
    (EOS, stop token or stop string), "length" (max_tokens or max_model_len) or "abort".
    """

    req_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[TokenLogprob] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    kv_ready: KVReady | None = None  # set once for a remote-prefill request: where its KV goes
    # With params.prompt_logprobs, on the request's first output: one entry per prompt token,
    # None for the first (nothing precedes it); see prompt_logprobs.py.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With params.embed, on the first output: the prompt's last-token embedding, L2-normalized.
    embedding: list[float] | None = None
    # When the scheduler first gave the request KV blocks and compute (time.monotonic()); None
    # before. A caller that knows when it submitted the request splits its TTFT into the queue
    # (submitted -> scheduled) and the prefill (scheduled -> first token) from this.
    first_scheduled_time: float | None = None
