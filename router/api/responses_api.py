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

How: the request becomes a chat completion (messages, tools, response_format) served by the
gateway's ordinary path — access, quota, admission, placement, tool-call parsing and the
structured-output grammar — and its answer (or stream of chunks) is rewritten as a Response.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from splitserve.router.api.errors import bad_request
from splitserve.router.api.schemas import ChatCompletionRequest, Int

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
        raise bad_request("previous_response_id is not supported: this server stores no responses; send the "
                          "whole conversation in `input` (with store=false)", "previous_response_id")
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
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls)):
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
                raise bad_request(f"input[{i}].role={role!r} is invalid; allowed: user, system, developer, assistant",
                                  "input")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function",
                    "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, i)
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
        else:
            raise bad_request(f"input[{i}].type={kind!r} is not supported; allowed: message, function_call, "
                              "function_call_output", "input")
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
            raise bad_request(f"input[{i}].content: part type {kind!r} is not supported; allowed: input_text, "
                              "output_text (this model reads text only)", "input")
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{i}]: only function tools {{type: 'function', name, parameters}} are supported, "
                          f"got type {tool.get('type')!r}", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice={choice!r} is not supported; allowed: auto, none, required, "
                      "{type: 'function', name}", "tool_choice")


def _format(text: dict) -> dict:
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict", False)}}
    raise bad_request(f"text.format.type={kind!r} is unknown; allowed: text, json_object, json_schema", "text")


# -- answers -----------------------------------------------------------------------------------
class _Builder:
    """A Response object and its output items, built from a chat completion or its chunks."""

    def __init__(self, req: ResponsesRequest):
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.status = "in_progress"
        self.incomplete_details: dict | None = None

    def response(self) -> dict:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "model": req.model, "output": self.output, "error": None,
                "incomplete_details": self.incomplete_details, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "text": req.text or {"format": {"type": "text"}}, "store": False, "previous_response_id": None,
                "metadata": req.metadata or {}, "truncation": "disabled", "usage": self.usage}

    def finish(self, finish_reason: str | None, usage: dict | None) -> None:
        if finish_reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        if usage is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.usage = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status ==
            "completed" else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def from_completion(req: ResponsesRequest, completion: dict) -> dict:
    builder = _Builder(req)
    choice = completion["choices"][0]
    message = choice["message"]
    if message.get("content") or not message.get("tool_calls"):
        builder.output.append(message_item(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        builder.output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    builder.finish(choice.get("finish_reason"), completion.get("usage"))
    return builder.response()


class _StreamState:
    """Rewrites chat completion chunks as Responses stream events."""

    def __init__(self, req: ResponsesRequest):
        self.builder = _Builder(req)
        self.seq = 0
        self.text_item: dict | None = None
        self.text = ""
        self.calls: dict[int, dict] = {}   # chat tool-call index -> its function_call item
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.builder.response()),
                self.event("response.in_progress", response=self.builder.response())]

    def chunk(self, data: dict) -> list[bytes]:
        if "error" in data:
            return [self.event("error", code=data["error"].get("code"), message=data["error"].get("message"),
                               param=data["error"].get("param"))]
        out = []
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _text_delta(self, text: str) -> list[bytes]:
        out = []
        if self.text_item is None:
            self.text_item = message_item("", "in_progress")
            self.builder.output.append(self.text_item)
            index = len(self.builder.output) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=self.text_item))
            out.append(self.event("response.content_part.added", item_id=self.text_item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text += text
        out.append(self.event("response.output_text.delta", item_id=self.text_item["id"],
                              output_index=self.builder.output.index(self.text_item), content_index=0, delta=text,
                              logprobs=[]))
        return out

    def _call_delta(self, call: dict) -> list[bytes]:
        out = []
        item = self.calls.get(call.get("index", 0))
        function = call.get("function") or {}
        if item is None:
            out += self._close_text()
            item = call_item(call.get("id", f"call_{uuid.uuid4().hex}"), function.get("name", ""), "", "in_progress")
            self.calls[call.get("index", 0)] = item
            self.builder.output.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.builder.output) - 1,
                                  item=dict(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.builder.output.index(item), delta=function["arguments"]))
        return out

    def _close_text(self) -> list[bytes]:
        item = self.text_item
        if item is None or item["status"] == "completed":
            return []
        index = self.builder.output.index(item)
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item.update(status="completed", content=[part])
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=self.text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def end(self) -> list[bytes]:
        out = self._close_text()
        for item in self.calls.values():
            index = self.builder.output.index(item)
            item["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.builder.finish(self.finish_reason, getattr(self, "usage", None))
        kind = "response.incomplete" if self.builder.status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.builder.response()))
        return out


async def _events(req: ResponsesRequest, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    state = _StreamState(req)
    for event in state.start():
        yield event
    buffer = b""
    async for piece in chunks:
        buffer += piece if isinstance(piece, bytes) else piece.encode()
        while b"\n\n" in buffer:
            line, buffer = buffer.split(b"\n\n", 1)
            payload = line.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                for event in state.end():
                    yield event
                return
            for event in state.chunk(json.loads(payload)):
                yield event


class _ForwardingResponse(StreamingResponse):
    """Streams the rewritten events and runs the chat stream's own cleanup however this ends."""

    def __init__(self, content, inner: StreamingResponse, **kwargs):
        super().__init__(content, **kwargs)
        self.inner = inner

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cleanup = getattr(self.inner, "cleanup", None)
            if cleanup is not None:
                await cleanup()


async def serve(gateway, request: Request, body: ResponsesRequest) -> Response:
    gateway.check_model(body.model)   # 404 before the body's content, as for chat completions
    chat = chat_request(body)
    answer = await gateway.serve(request, chat, True)
    if answer.status_code != 200:
        return answer
    headers = {k: v for k, v in answer.headers.items() if k.startswith(("x-splitserve", "x-ratelimit"))}
    if isinstance(answer, StreamingResponse):
        return _ForwardingResponse(_events(body, answer.body_iterator), answer, media_type="text/event-stream",
                                   headers=headers)
    return JSONResponse(from_completion(body, json.loads(answer.body)), headers=headers)


def add_routes(app: FastAPI, gateway) -> None:
    @app.post("/v1/responses", dependencies=[Depends(gateway.access)], summary="Responses (OpenAI, a subset)")
    async def responses(body: ResponsesRequest, request: Request):
        return await serve(gateway, request, body)

