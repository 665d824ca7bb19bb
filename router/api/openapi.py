"""The gateway's OpenAPI document as the server really answers (FastAPI's default lists only 200
and 422; this server never sends 422).

Starting from FastAPI's generated document it: declares OpenAI's error body (`ErrorResponse`)
for every status an operation can answer with (400 invalid input, 401 bad API key, 404 unknown
model, 413 body too large, 429 rate limit / queue full / saturated and 503 no worker, both with
Retry-After, 500 a bug); gives the completion endpoints both `application/json` and
`text/event-stream` 200 answers (the LoRA load/unload endpoints a JSON status object; /tokenize,
/detokenize, /version and /v1/embeddings their own JSON objects) and
/metrics its Prometheus text; and writes the bounds the
engine checks (platform/sampling/params.py, router/api/prompts.py) into the request schemas, so a
value outside them is schema-invalid and a value inside them is never refused for its range.
Checked by schemathesis in tests/router/test_router_openapi.py.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from splitserve.platform.sampling.params import MAX_LOGPROBS
from splitserve.router.api.sampling import INT32, INT64

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "title": "ErrorResponse",
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_DESCRIPTIONS = {
    400: "Invalid request (OpenAI error body naming the field)",
    401: "Missing or wrong API key",
    404: "Unknown model, adapter or path",
    409: "The adapters are declared (spec.adapters / adapters.file), not loaded through the API",
    413: "Request body over gateway.max_body_bytes",
    429: "Rate limited, admission queue full, or every worker saturated",
    500: "Internal error",
    503: "No worker can serve the request (after gateway.worker_wait_s)",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "string"}}}

# property -> JSON-schema bounds, as the engine and the gateway enforce them
BOUNDS = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "max_output_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0, "maximum": INT32 - 1},
    "seed": {"minimum": -INT64, "maximum": INT64 - 1},
    "top_k": {"minimum": -1, "maximum": INT32 - 1},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
}
_ITEM_BOUNDS = {"stop_token_ids": {"minimum": 0, "maximum": INT32 - 1}}
_COMPLETION_LOGPROBS = {"minimum": 0, "maximum": MAX_LOGPROBS}


def build(app, model_names: tuple[str, ...], vocab_size: int | None = None) -> dict:
    """The document for `app` (cached on it by `install`). With `vocab_size`, token-id lists
    (a completion's prompt, /detokenize's tokens, an embedding's input) say which ids exist."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for name, schema in schemas.items():
        _bound(name, schema, model_names)
        if vocab_size:
            for prop in _TOKEN_ID_LISTS.get(name, ()):
                if prop in schema.get("properties", {}):
                    _bound_ids(schema["properties"][prop], vocab_size)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            _responses(path, method, op)
    return doc


# schema -> its properties that hold token ids (or lists of them)
_TOKEN_ID_LISTS = {"CompletionRequest": ("prompt",), "DetokenizeRequest": ("tokens",), "EmbeddingRequest": ("input",)}


def _bound_ids(prop: dict, vocab_size: int) -> None:
    """Every integer array item below `prop` (through anyOf and nested arrays) is a token id."""
    for variant in _variants(prop):
        if variant.get("type") != "array":
            continue
        items = variant.setdefault("items", {})
        if items.get("type") == "integer":
            items.update({"minimum": 0, "maximum": vocab_size - 1})
        else:
            _bound_ids(items, vocab_size)


def install(app, model_names: tuple[str, ...], vocab_size: int | None = None) -> None:
    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = build(app, model_names, vocab_size)
        return app.openapi_schema

    app.openapi = openapi


_LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_INT_LIST = {"type": "array", "items": {"type": "integer"}}
# Endpoints answering one JSON object of their own (vLLM's shapes), never a stream.
_OBJECT_ANSWERS = {
    "/tokenize": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": _INT_LIST,
            "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        },
    },
    "/detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "/version": {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
    "/v1/embeddings": {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "model": {"type": "string"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["object", "index", "embedding"],
                    "properties": {
                        "object": {"type": "string"},
                        "index": {"type": "integer"},
                        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
                    },
                },
            },
            "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"]},
        },
    },
}


def _error(status: int) -> dict:
    out = {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if status in (429, 503):
        out["headers"] = _RETRY_AFTER
    return out


def _responses(path: str, method: str, op: dict) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    statuses = [500]
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        statuses += [401, 429]
    if path in _OBJECT_ANSWERS:
        if method == "post":
            statuses += [400, 404, 413]
        if path.startswith("/v1/"):
            statuses.append(503)
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok["content"] = {"application/json": {"schema": _OBJECT_ANSWERS[path]}}
    elif path in _LORA_PATHS:
        statuses += [400, 404, 409, 413, 503]
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok["content"] = {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["lora_name", "status"],
                    "properties": {
                        "lora_name": {"type": "string"},
                        "status": {"type": "string", "enum": ["loaded", "unloaded"]},
                        "message": {"type": "string"},
                        "object": {"type": "string"},
                    },
                }
            }
        }
    elif method == "post":
        statuses += [400, 404, 413, 503]
        ok = responses.setdefault("200", {"description": "Successful Response"})
        is_responses = path == "/v1/responses"
        required = ["id", "object", "output", "status"] if is_responses else ["id", "object", "choices"]
        events = (
            "With stream=true: `event: <type>` + `data: {event}` pairs, response.created first, "
            "response.completed (or response.incomplete) last"
            if is_responses
            else "With stream=true: `data: {chunk}` events, then `data: [DONE]`"
        )
        ok["content"] = {
            "application/json": {"schema": {"type": "object", "required": required}},
            "text/event-stream": {"schema": {"type": "string"}, "description": events},
        }
    if path == "/ready":
        statuses.append(503)
    if path == "/metrics":
        responses["200"]["content"] = {
            "text/plain": {"schema": {"type": "string"}, "description": "Prometheus text exposition format 0.0.4"}
        }
    for status in sorted(set(statuses)):
        responses[str(status)] = _error(status)


def _bound(name: str, schema: dict, model_names: tuple[str, ...]) -> None:
    props = schema.get("properties", {})
    for prop, bounds in BOUNDS.items():
        if prop in props:
            _apply(props[prop], bounds)
    for prop, bounds in _ITEM_BOUNDS.items():
        if prop in props:
            for variant in _variants(props[prop]):
                if variant.get("type") == "array":
                    variant.setdefault("items", {}).update(bounds)
    if name == "CompletionRequest" and "logprobs" in props:
        _apply(props["logprobs"], _COMPLETION_LOGPROBS)
        _apply(props["prompt_logprobs"], _COMPLETION_LOGPROBS)
        _apply(props["max_tokens"], {"minimum": 0})  # 0 with echo: the prompt alone (router/api/echo.py)
    if "model" in props and model_names and name.endswith("Request"):
        props["model"]["description"] = f"A served model: {', '.join(model_names)} (others: 404)"


def _variants(prop: dict) -> list[dict]:
    return prop.get("anyOf", [prop])


def _apply(prop: dict, bounds: dict) -> None:
    for variant in _variants(prop):
        if variant.get("type") in ("integer", "number"):
            variant.update(bounds)
