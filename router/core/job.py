"""One generation as the dispatcher runs it: the `Job` it places, the `Chunk`s the client gets, and
the `Progress` a resume continues from (what the client has been sent so far)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.tokenizer import Tokenizer


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None  # a LoRA adapter the workers have loaded; None: the base model
    priority: int = 0  # the body's priority (vLLM's: lower first) and the flow-control band
    band: int = 0  # (higher first): the workers' "priority" scheduling policy reads both


@dataclass
class Chunk:
    """An increment for the client; `usage` totals are over the whole request so far."""

    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_pulled_tokens: int = 0  # prompt tokens whose KV the decode worker pulled from another (usage.pulled_tokens)
    decode_worker: str = ""
    prefill_worker: str = ""
    prompt_logprobs: list = field(default_factory=list)  # pb.TokenLogprob of prompt tokens 1..n-1 (first chunk)
    embedding: list = field(default_factory=list)  # the prompt's embedding (params.embed; first chunk)


class WorkerLost(Exception):
    """The attempt's worker failed; the dispatcher retries or resumes elsewhere."""


@dataclass
class Progress:
    """What the client has been sent so far (the state a resume continues from)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int | None = None
    num_pulled_tokens: int = 0
    is_resumed: bool = False  # the next text is the first after a resume

    def add(self, token_ids: list[int], text: str, tokenizer: Tokenizer | None, params: SamplingParams) -> str:
        """Record an increment; returns its text, re-derived from the token ids for the first one
        after a resume (see `_resumed_text`)."""
        if self.is_resumed:
            self.is_resumed = False
            text = self._resumed_text(token_ids, text, tokenizer, params)
        self.token_ids += token_ids
        self.text += text
        return text

    def _resumed_text(self, new_ids: list[int], text: str, tokenizer: Tokenizer | None, params: SamplingParams) -> str:
        """The new worker's first text, from the token ids when they explain it: a character the old
        worker held back (half of a UTF-8 sequence) or a leading space a SentencePiece decoder strips
        from the new worker's first word is not lost."""
        if tokenizer is None:
            return text
        full = tokenizer.decode(self.token_ids + new_ids, skip_special_tokens=params.skip_special_tokens)
        if full.startswith(self.text) and not full.endswith("\ufffd"):
            derived = full[len(self.text) :]
            if derived.endswith(text):
                return derived
        return text
