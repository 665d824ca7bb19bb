"""POST /v1/responses: the subset of OpenAI's Responses API a chat app and a tool-using agent need.

    input                 a string, or a list of items: messages ({role, content} with content a
                          string or input_text / output_text parts), function_call and
                          function_call_output items (an agent's earlier turns, sent back whole)
    instructions          a system message in front
    max_output_tokens, temperature, top_p
    tools                 [{type: "function", name, description, parameters}]; tool_choice
                          auto / none / required / {type: "function", name}
    text.format           text, json_object, or json_schema {name, schema, strict}
    stream                the SDK's events: response.created, response.in_progress,
                          response.output_item.added, response.content_part.added,
                          response.output_text.delta / .done, response.content_part.done,
                          response.function_call_arguments.delta / .done,
                          response.output_item.done, response.completed
    store                 false (or unset): nothing is kept; true is a 400
    previous_response_id  a 400: responses are not stored, send the conversation in `input`

Anything else the API defines that would change the answer (background, conversation,
include, reasoning, prompt, non-function tools, image or file inputs) is a 400 naming the
field; unknown fields are a 400 too. Known fields with no effect here (metadata, user,
parallel_tool_calls, service_tier, truncation "disabled", ...) are accepted.

Here: the request body and the chat completion it becomes (messages, tools, response_format);
api/responses_api.py serves it and writes the Response.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.router.api.schemas import ChatCompletionRequest, Int
from splitserve.router.errors import bad_request

# Fields of the API that would change the answer and are not implemented: a 400 naming them.
UNSUPPORTED = ("background", "conversation", "include", "reasoning", "prompt", "max_tool_calls", "top_logprobs")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    # accepted, no effect on the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict[str, Any] | None = None
    # rejected with a 400 (UNSUPPORTED)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: Int | None = None
    top_logprobs: Int | None = None


def check(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation in `input` (with store=false)",
            "previous_response_id",
        )
    if req.store:
        raise bad_request("store=true is not supported: this server keeps no responses; send store=false", "store")
    for name in UNSUPPORTED:
        if getattr(req, name) not in (None, False, [], {}):
            raise bad_request(f"{name} is not supported by this server", name)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that computes this response (400 for what cannot be expressed)."""
    check(req)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages(req.input)
    if not messages:
        raise bad_request("input is empty; allowed: a string or a non-empty list of items", "input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("parallel_tool_calls", req.parallel_tool_calls),
    ):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None:
        body["response_format"] = _format(req.text)
    return ChatCompletionRequest.model_validate(body)


def _messages(value) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"input[{i}].role={role!r} is invalid; allowed: user, system, developer, assistant", "input"
                )
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _str(item, "call_id", i),
                "type": "function",
                "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, i)
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
        else:
            raise bad_request(
                f"input[{i}].type={kind!r} is not supported; allowed: message, function_call, function_call_output",
                "input",
            )
    return out


def _str(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{key} must be a string", "input")
    return value


def _text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{i}].content: part type {kind!r} is not supported; allowed: input_text, "
                "output_text (this model reads text only)",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(
            f"tools[{i}]: only function tools {{type: 'function', name, parameters}} are supported, "
            f"got type {tool.get('type')!r}",
            "tools",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice={choice!r} is not supported; allowed: auto, none, required, {{type: 'function', name}}",
        "tool_choice",
    )


def _format(text: dict) -> dict:
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text")
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "output"),
                "schema": fmt["schema"],
                "strict": fmt.get("strict", False),
            },
        }
    raise bad_request(f"text.format.type={kind!r} is unknown; allowed: text, json_object, json_schema", "text")
