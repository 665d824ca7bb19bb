"""Structured-output fields of an OpenAI request -> the engine's StructuredSpec and logit_bias.

Accepted (OpenAI's shapes, and vLLM's extensions the openai client sends via `extra_body`):

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
  object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (always
  enforced, `strict` or not, as vLLM does);
- `structured_outputs`: exactly one of {"json": schema, "regex": str, "choice": [str, ...],
  "grammar": Lark text} (vLLM);
- `logit_bias`: {token id (string or int): bias in [-100, 100]}, ids inside the vocabulary.

Both endpoints accept them. A malformed value is a 400 naming the field here; a schema or
pattern the grammar compiler rejects, or one that does not compile within the worker's limit,
is a 400 from the worker whose message starts with the field name.
"""

from __future__ import annotations

import json

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.constraints import StructuredSpec, validate_logit_bias
from splitserve.router.errors import bad_request

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar")


def constraint_fields(req, vocab_size: int | None) -> dict:
    """{"structured": StructuredSpec | None, "logit_bias": pairs} for SamplingParams; raises 400."""
    spec = _spec(getattr(req, "response_format", None), getattr(req, "structured_outputs", None))
    return {"structured": spec, "logit_bias": _logit_bias(req.logit_bias, vocab_size)}


def _spec(response_format: dict | None, structured_outputs: dict | None) -> StructuredSpec | None:
    if response_format is not None and structured_outputs:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in (None, "text"):
            raise bad_request("give either response_format or structured_outputs, not both", "structured_outputs")
    try:
        if structured_outputs:
            return _from_structured_outputs(structured_outputs)
        if response_format is not None:
            return _from_response_format(response_format)
    except InvalidRequestError as exc:
        message = str(exc)
        raise bad_request(message, message.split(":", 1)[0]) from None
    return None


def _from_response_format(value: dict) -> StructuredSpec | None:
    field = "response_format"
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"response_format.type={kind!r} is unknown; allowed: {', '.join(RESPONSE_FORMAT_TYPES)}", field
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", field)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise bad_request(
            "response_format.json_schema must be an object {name, schema, strict} whose schema is a JSON schema object",
            field,
        )
    return StructuredSpec("json", json.dumps(spec.get("schema", {})), field)


def _from_structured_outputs(value: dict) -> StructuredSpec:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(
            "structured_outputs must be an object with one of: " + ", ".join(STRUCTURED_OUTPUT_KEYS), field
        )
    given = [key for key in STRUCTURED_OUTPUT_KEYS if value.get(key) is not None]
    if len(given) != 1:
        raise bad_request(
            f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}; "
            f"got {given or list(value)}",
            field,
        )
    key = given[0]
    item = value[key]
    if key == "json":
        text = item if isinstance(item, str) else json.dumps(item)
        return StructuredSpec("json", text, f"{field}.json")
    if key == "choice":
        if not isinstance(item, list):
            raise bad_request("structured_outputs.choice must be a list of strings", f"{field}.choice")
        return StructuredSpec("choice", json.dumps(item), f"{field}.choice")
    if not isinstance(item, str):
        raise bad_request(f"structured_outputs.{key} must be a string", f"{field}.{key}")
    return StructuredSpec(key, item, f"{field}.{key}")


def _logit_bias(value, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    try:
        pairs = validate_logit_bias(value)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "logit_bias") from None
    bad = [t for t, _ in pairs if vocab_size is not None and t >= vocab_size]
    if bad:
        raise bad_request(
            f"logit_bias: token ids {bad[:5]} are outside the vocabulary; allowed: [0, {vocab_size})", "logit_bias"
        )
    return pairs
