"""POST /v1/responses: a Response (or the SDK's stream events) over the gateway's one pipeline.

The request (api/responses_request.py) becomes a chat completion that runs the ordinary path —
access, quota, admission, placement, tool-call parsing and the structured-output grammar
(api/gateway.py, core/pipeline.py). Its chunks go through the chat formatter (api/formatting.py),
whose deltas and whole answers are rewritten here as Responses output items and events; the
usage is the pipeline's Usage record.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from splitserve.router.api.formatting import Formatter, sse_json
from splitserve.router.api.responses_request import ResponsesRequest, chat_request
from splitserve.router.core.pipeline import ChoiceChunk, Run
from splitserve.router.errors import APIError
from splitserve.router.usage import Usage


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
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": req.model,
            "output": self.output,
            "error": None,
            "incomplete_details": self.incomplete_details,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}},
            "store": False,
            "previous_response_id": None,
            "metadata": req.metadata or {},
            "truncation": "disabled",
            "usage": self.usage,
        }

    def finish(self, finish_reason: str | None, usage: Usage | None) -> None:
        if finish_reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        if usage is not None:
            self.usage = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }


def message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def from_completion(req: ResponsesRequest, completion: dict, usage: Usage) -> dict:
    """The Response of a whole chat completion (the chat formatter's JSON) and its usage."""
    builder = _Builder(req)
    choice = completion["choices"][0]
    message = choice["message"]
    if message.get("content") or not message.get("tool_calls"):
        builder.output.append(message_item(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        builder.output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    builder.finish(choice.get("finish_reason"), usage)
    return builder.response()


class ResponseEvents:
    """The Responses stream: the chat formatter's chunks of each increment rewritten as the SDK's
    events (the gateway calls start, chunk per increment, then end or error)."""

    def __init__(self, req: ResponsesRequest, formatter: Formatter):
        self.formatter = formatter
        self.builder = _Builder(req)
        self.seq = 0
        self.text_item: dict | None = None
        self.text = ""
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {sse_json(data)}\n\n".encode()

    def start(self, run: Run) -> list[bytes]:
        return [
            self.event("response.created", response=self.builder.response()),
            self.event("response.in_progress", response=self.builder.response()),
        ]

    def chunk(self, run: Run, item: ChoiceChunk) -> list[bytes]:
        out = []
        for data in self.formatter.stream(item.index, item.chunk, run.choices[item.index]):
            out += self._chat_chunk(data)
        return out

    def error(self, run: Run, exc: APIError) -> list[bytes]:
        """The error event, then the Response as it stands (no usage: the stream was cut)."""
        return [self.event("error", code=exc.code, message=exc.message, param=exc.param), *self._end(None)]

    def end(self, run: Run) -> list[bytes]:
        return self._end(run.usage())

    def _chat_chunk(self, data: dict) -> list[bytes]:
        out = []
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
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.text_item["id"],
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        self.text += text
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text_item["id"],
                output_index=self.builder.output.index(self.text_item),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
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
            out.append(
                self.event("response.output_item.added", output_index=len(self.builder.output) - 1, item=dict(item))
            )
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.builder.output.index(item),
                    delta=function["arguments"],
                )
            )
        return out

    def _close_text(self) -> list[bytes]:
        item = self.text_item
        if item is None or item["status"] == "completed":
            return []
        index = self.builder.output.index(item)
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item.update(status="completed", content=[part])
        return [
            self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _end(self, usage: Usage | None) -> list[bytes]:
        out = self._close_text()
        for item in self.calls.values():
            index = self.builder.output.index(item)
            item["status"] = "completed"
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.builder.finish(self.finish_reason, usage)
        kind = "response.incomplete" if self.builder.status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.builder.response()))
        return out


async def serve(gateway, request: Request, body: ResponsesRequest) -> Response:
    gateway.scoped_model(request, body.model)  # 404 before the body's content, as for chat completions
    chat = chat_request(body)
    run, formatter = await gateway.open(request, chat, is_chat=True)
    return await gateway.respond(
        request,
        run,
        ResponseEvents(body, formatter),
        lambda run: from_completion(body, formatter.complete(run.choices, run.usage()), run.usage()),
    )


def add_routes(app: FastAPI, gateway) -> None:
    @app.post("/v1/responses", dependencies=[Depends(gateway.access)], summary="Responses (OpenAI, a subset)")
    async def responses(body: ResponsesRequest, request: Request):
        return await serve(gateway, request, body)
