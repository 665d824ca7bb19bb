"""Per-request sampling parameters, validated on construction.

The OpenAI gateway maps its JSON onto this one dataclass; a bad value raises
`InvalidRequestError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.constraints import StructuredSpec, validate_logit_bias

MAX_LOGPROBS = 20
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would
# overflow float32 to inf and turn the probabilities into NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (anything below 1e-5) is greedy. top_k 0 (or -1) disables top-k; top_p 1 and
    min_p 0 disable theirs.
    repetition_penalty (1 = off) divides positive / multiplies negative logits of every token seen
    in the prompt or output; presence_penalty and frequency_penalty (0 = off) subtract from the
    logits of tokens in the output, once and per occurrence. `seed` makes sampling reproducible
    per request regardless of batch. `logprobs` (None = off) returns the sampled token's log
    probability plus the top-n alternatives. Generation stops at max_tokens, at an EOS token
    (unless ignore_eos), at any of stop_token_ids, or when the text contains one of `stop`
    (the stop string is not included unless include_stop_str_in_output). EOS and stop tokens
    are suppressed until min_tokens tokens have been generated.
    `structured` constrains the output to a grammar (JSON schema, regex, choice, Lark);
    `logit_bias` ((token id, bias in [-100, 100]) pairs, or a dict) is added to the logits
    (ids are checked against the vocabulary by the engine).
    `prompt_logprobs` (None = off) also returns each prompt token's log probability given the
    tokens before it, with the top-n alternatives (platform/engine/prompt_logprobs.py); such a
    request computes its whole prompt (no prefix-cache reuse).
    `embed` also returns the prompt's embedding: the final-norm hidden state of its last token,
    L2-normalized (last-token pooling, what vLLM uses for decoder models), with the first output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    embed: bool = False

    def __post_init__(self) -> None:
        # Accept lists from JSON callers but store tuples so the params stay hashable/immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", validate_logit_bias(self.logit_bias))
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise InvalidRequestError(f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
        self._validate()

    def _validate(self) -> None:
        _check(
            0 <= self.temperature < math.inf,
            "temperature",
            self.temperature,
            "a finite number >= 0 (below 1e-5 is greedy)",
        )
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            self.top_k,
            "an integer >= 1, or 0 / -1 to disable",
        )
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(
            0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0 (1 is off)",
        )
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1"
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer or null")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"null or an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            self.prompt_logprobs,
            f"null or an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", list(self.stop), "non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            list(self.stop_token_ids),
            "non-negative token ids",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}={value!r} is invalid; allowed: {allowed}")
