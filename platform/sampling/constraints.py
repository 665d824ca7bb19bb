"""What a request asks of its output beyond sampling: a grammar constraint and logit_bias.

Torch-free (the router validates requests with it); the engine side is `structured`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from splitserve.platform.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint. `kind` is one of KINDS; `value` is its text: the JSON schema
    (JSON text) for "json", ignored ("") for "json_object", the regex, a JSON list of strings for
    "choice", or a Lark grammar (llguidance's dialect) for "grammar". `field` names the API field
    it came from, for error messages."""

    kind: str
    value: str = ""
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"{self.field}: constraint kind {self.kind!r} is unknown; allowed: {', '.join(KINDS)}"
            )
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.field}: the {self.kind} constraint must be given as text")
        if self.kind == "json":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise InvalidRequestError(f"{self.field}: the JSON schema is not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    f"{self.field}: a JSON schema must be an object or a boolean, got {type(schema).__name__}"
                )
        if self.kind == "choice":
            try:
                choices = json.loads(self.value)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequestError(f"{self.field}: choice must be a non-empty list of non-empty strings")
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(f"{self.field}: the {self.kind} must not be empty")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value


def validate_logit_bias(logit_bias, field: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """A logit_bias mapping (token id, as int or decimal string, -> bias) as sorted pairs."""
    if logit_bias is None:
        return ()
    items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
    pairs = {}
    for key, value in items:
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"{field}: key {key!r} is not a token id; allowed: integer token ids") from None
        if token_id < 0 or isinstance(key, bool):
            raise InvalidRequestError(f"{field}: token id {key!r} is invalid; allowed: ids >= 0 in the vocabulary")
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"{field}: the bias {value!r} of token {token_id} is invalid; allowed: numbers in [-100, 100]"
            )
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))
