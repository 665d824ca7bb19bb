"""OpenAI response JSON of chat and text completions: whole answers, stream chunks, usage, logprobs.

The Formatter reads what the pipeline (core/pipeline.py) accumulated per choice and the request's
typed Usage (router/usage.py); `usage_json` writes that record as OpenAI's usage object, with
`prompt_tokens_details.cached_tokens` the prompt tokens served from the decode worker's prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
import time

from splitserve.platform.tokenizer import Tokenizer
from splitserve.router.api import echo, tools
from splitserve.router.core.choices import ChoiceState
from splitserve.router.core.job import Chunk
from splitserve.router.core.prepared import Prepared
from splitserve.router.usage import Usage

MAX_CACHED_TOKENS = 65536  # token texts a TokenText keeps


class TokenText:
    """Token id -> its text and bytes, for logprobs (cached per id, up to MAX_CACHED_TOKENS)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                return f"<{token_id}>"
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < MAX_CACHED_TOKENS:
                self._texts[token_id] = text
        return text

    def chat_entry(self, lp) -> dict:
        text = self.text(lp.token_id)
        return {
            "token": text,
            "logprob": lp.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": self.text(t.token_id),
                    "logprob": t.logprob,
                    "bytes": list(self.text(t.token_id).encode("utf-8")),
                }
                for t in lp.top
            ],
        }


def usage_json(usage: Usage) -> dict:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class Formatter:
    """Builds the JSON of one request's responses (chat or text completion)."""

    def __init__(self, prepared: Prepared, is_chat: bool, tokens: TokenText):
        self.prepared = prepared
        self.is_chat = is_chat
        self.tokens = tokens
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.prepared.request_id, "object": obj, "created": self.created, "model": self.prepared.model}

    def logprobs(self, entries: list) -> dict | None:
        if self.prepared.logprobs is None:
            return None
        if self.is_chat:
            return {"content": [self.tokens.chat_entry(lp) for lp in entries]}
        texts = [self.tokens.text(lp.token_id) for lp in entries]
        offsets, pos = [], 0
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [
                None if lp.top is None else {self.tokens.text(t.token_id): t.logprob for t in lp.top} for lp in entries
            ],
            "text_offset": offsets,
        }

    def complete(self, choices: list[ChoiceState], usage: Usage) -> dict:
        out = self._head("chat.completion" if self.is_chat else "text_completion")
        out["choices"] = [self._choice(i, c) for i, c in enumerate(choices)]
        out["usage"] = usage_json(usage)
        return out

    def _choice(self, index: int, c: ChoiceState) -> dict:
        body = {"message": {"role": "assistant", "content": c.text}} if self.is_chat else {"text": c.text}
        finish_reason = c.finish_reason
        calls = self._tool_calls(c.text, c.finish_reason)
        if calls:
            body["message"] = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
            finish_reason = "tool_calls"
        entries = c.logprobs
        if self.prepared.echo is not None:
            body["text"], entries = echo.echoed(self.prepared.echo, index, c.text, c.logprobs, c.prompt_logprobs, True)
            scored = echo.vllm_prompt_logprobs(self.prepared.echo, index, c.prompt_logprobs, self.tokens.text)
            if scored is not None:
                body["prompt_logprobs"] = scored
        out = {"index": index, **body, "logprobs": self.logprobs(entries), "finish_reason": finish_reason}
        if self.prepared.return_token_ids:
            out["token_ids"] = list(c.token_ids)
        return out

    def _tool_calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict]] | None:
        """(content, OpenAI tool_calls) when the answer holds tool calls, else None."""
        if self.prepared.tools is None or finish_reason != "stop":
            return None
        try:
            content, calls = tools.parse_calls(self.prepared.tools, text)
        except ValueError:
            return None
        return (content, tools.openai_tool_calls(calls)) if calls else None

    def stream(self, index: int, chunk: Chunk, state: ChoiceState) -> list[dict]:
        """The stream events for one chunk (`state` already holds it). With tools the answer is
        held back until it finishes, then sent as tool-call deltas or as content."""
        if self.prepared.echo is not None and not self.is_chat:
            text, entries = echo.echoed(
                self.prepared.echo, index, chunk.text, chunk.logprobs, state.prompt_logprobs, not state.is_echoed
            )
            state.is_echoed = True
            return [self.chunk(index, dataclasses.replace(chunk, text=text, logprobs=entries))]
        if self.prepared.tools is None or not self.is_chat:
            return [self.chunk(index, chunk)]
        if chunk.finish_reason is None:
            return []
        calls = self._tool_calls(state.text, chunk.finish_reason)
        if calls is None:
            return [self.chunk(index, dataclasses.replace(chunk, text=state.text, token_ids=list(state.token_ids)))]
        events = []
        if calls[0]:
            events.append(self._delta(index, {"content": calls[0]}, None))
        events += [self._delta(index, delta, None) for delta in tools.stream_deltas(calls[1])]
        events.append(self._delta(index, {}, "tool_calls"))
        return events

    def _delta(self, index: int, delta: dict, finish_reason: str | None) -> dict:
        out = self._head("chat.completion.chunk")
        out["choices"] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        if self.prepared.include_usage:
            out["usage"] = None
        return out

    def chunk(self, index: int, chunk: Chunk | None, role: bool = False) -> dict:
        """One stream event for choice `index` (role=True: the chat stream's opening delta)."""
        out = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        text = chunk.text if chunk is not None else ""
        if self.is_chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = self.logprobs(chunk.logprobs) if chunk is not None and chunk.logprobs else None
        choice["finish_reason"] = chunk.finish_reason if chunk is not None else None
        if self.prepared.return_token_ids:
            choice["token_ids"] = list(chunk.token_ids) if chunk is not None else []
        out["choices"] = [choice]
        if self.prepared.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        out = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out


# Characters JSON leaves raw in a string that Python's str.splitlines() (and so httpx's
# iter_lines/aiter_lines, which many clients read SSE with) takes for line ends. SSE ends a line at
# CR or LF only, so the stream is correct either way; escaped, a client splitting more eagerly
# still gets whole JSON. A model emits them (SmolLM2 did, in a benchmark run: the client's JSON
# broke mid-string). JSON escapes every other such character (below U+0020) itself.
_UNSPLITTABLE = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data: dict) -> str:
    """`data` as one line of JSON for an SSE `data:` field, safe for any line splitter."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_UNSPLITTABLE)


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else sse_json(data)
    return f"data: {payload}\n\n".encode()
