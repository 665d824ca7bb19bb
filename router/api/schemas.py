"""The OpenAI request bodies the gateway accepts (pydantic: this is the JSON edge).

Strict types: a string where a number belongs is a 400, not a silent conversion. Integer fields
take a whole-number float (2.0), which JSON Schema counts as an integer (`Int`). Fields of the
OpenAI API that change what the model must do and that splitserve does not implement (suffix,
best_of > n, echo with several choices) are rejected with a 400 naming them rather than ignored.
`echo` (the prompt back in `text`, its tokens' logprobs with `logprobs`; `max_tokens: 0` then
means the prompt alone) and vLLM's `prompt_logprobs` are served (router/api/echo.py). vLLM's
sampling extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens, include_stop_str_in_output) are accepted, and so is its `return_token_ids`
(the generated token ids beside the text, so a client can compare answers exactly); the openai
client sends them through `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

MAX_N = 16


def _whole_float_to_int(value: object) -> object:
    """JSON Schema's `integer` includes 2.0 (a number with no fraction), and the OpenAPI document
    promises `integer`: so 2.0 is taken as 2; 2.5, "2" and true stay errors under strict types."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_float_to_int)]


def _whole_floats_to_ints(value: object) -> object:
    """`Int` for a whole list in one call: a prompt of 8k token ids is one Python call, not 8k."""
    if type(value) is list and float in map(type, value):
        return [_whole_float_to_int(v) for v in value]
    return value


TokenIds = Annotated[list[int], BeforeValidator(_whole_floats_to_ints)]


def _prompt_form(value: object) -> str | None:
    """Which form of a prompt `value` takes, read from its first element, so pydantic validates it
    as that form alone: a plain union tries each form in turn, and failing `list[str]` on 8k token
    ids made validation 10x slower. An error then names the element that broke the form."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


def _any_of(schema: dict) -> None:
    # An empty list is each list form, so JSON Schema's oneOf (pydantic's default for a tagged union)
    # would refuse it; the forms the server takes are "any of".
    schema["anyOf"] = schema.pop("oneOf")


# A completion's prompt or an embedding's input: text, texts, token ids, or lists of token ids.
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[TokenIds], Tag("list[list[int]]")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids",
    ),
    Field(json_schema_extra=_any_of),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: Int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: Int | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's extension: each choice (and stream chunk) carries `token_ids`
    include_stop_str_in_output: bool = False
    logit_bias: dict | None = None
    user: str | None = None
    response_format: dict | None = None  # see router/api/structured.py
    structured_outputs: dict | None = None  # vLLM's extension (extra_body)
    priority: Int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower first, within a flow-control band


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None
    prompt_logprobs: Int | None = None  # vLLM's extension: top-n per prompt token, in `prompt_logprobs`


def unsupported_fields(req: SamplingFields) -> list[str]:
    """Names of set fields that would change the answer in ways splitserve does not implement."""
    bad = []
    if not isinstance(req, ChatCompletionRequest):
        if req.suffix:
            bad.append("suffix")
        if req.best_of is not None and req.best_of != req.n:
            bad.append("best_of")
    return bad


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: content parts of type text joined into one string."""
    out = []
    for message in messages:
        data = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            data["content"] = "".join(part.text or "" for part in content if part.type == "text")
        elif content is None:
            data["content"] = ""
        out.append(data)
    return out


ObjectKind = Literal["chat.completion", "text_completion"]


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's runtime adapter load: a name for `model` and a PEFT folder the workers can read."""

    model_config = ConfigDict(strict=True, extra="forbid")
    # ASCII on purpose: the same names as an InferenceService's spec.adapters, and a pattern that
    # means the same in Python's and JSON Schema's regex engines (their \s differ, e.g. on U+0085).
    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
