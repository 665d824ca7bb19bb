"""One streamed /v1/completions request and its timings, measured as `vllm bench serve` does.

The clock starts just before the request is written. Every SSE event whose `choices` is
non-empty is a token chunk (its text may be empty, e.g. a special token): the first one sets
TTFT, each later one appends the gap since the previous token chunk to ITL, and the last one
ends the request (E2E). The usage event (`choices: []`, requested by
`stream_options.include_usage`) gives the output token count and the server's cached prompt
tokens; it carries no token, so it moves no timestamp. A request succeeds when at least one
token chunk arrived; an HTTP error status, an `error` event or a broken stream fails it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from splitserve.bench.loadgen.workloads import BenchRequest


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; `start_s` is relative to the run's start."""

    index: int
    category: str
    tag: str
    num_prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0
    client_queue_s: float = 0.0  # waiting for the client's concurrency limit before sending
    success: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    num_output_tokens: int | None = None  # from usage; None if the server sent none
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    decode_worker: str = ""  # the splitserve gateway's x-splitserve-decode-worker ("" from other servers)
    num_pulled_tokens: int = 0  # its x-splitserve-pulled-tokens: prompt tokens pulled, not computed
    error: str = ""

    @property
    def output_tokens(self) -> int:
        """vLLM counts usage.completion_tokens; without usage, we count the token chunks."""
        return self.num_output_tokens if self.num_output_tokens is not None else 1 + len(self.itl_s)


# Fields the harness owns: --extra-body may add or change any other.
RESERVED_FIELDS = ("model", "prompt", "max_tokens", "stream", "stream_options")


def encode_payload(model: str, req: BenchRequest, extra: dict | None = None) -> bytes:
    """The request body, built before the run so the client does no work at send time."""
    prompt = req.prompt_text if req.prompt_text is not None else list(req.prompt_token_ids)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps({**body, **(extra or {})}, separators=(",", ":")).encode()


async def send(client: httpx.AsyncClient, url: str, body: bytes, out: RequestResult, t0: float) -> RequestResult:
    """POST `body` to `url`, stream the answer and fill `out`'s timings (`t0`: the run's start on
    the perf_counter clock). Never raises for a failed request: `out.success` is False and
    `out.error` says why."""
    st = time.perf_counter()
    out.start_s = st - t0
    last = st
    try:
        async with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:300]}"
                return out
            out.decode_worker = resp.headers.get("x-splitserve-decode-worker", "")
            out.num_pulled_tokens = int(resp.headers.get("x-splitserve-pulled-tokens", "0") or 0)
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments (": ping")
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if event.get("choices"):
                    choice = event["choices"][0]
                    if not choice.get("text") and choice.get("finish_reason") and out.success:
                        continue  # a closing chunk (llama-cpp-python's): no token, so no ITL gap
                    if out.success:
                        out.itl_s.append(now - last)
                    else:
                        out.success, out.ttft_s = True, now - st
                    last = now
                elif event.get("usage"):
                    _read_usage(event["usage"], out)
                elif "error" in event:
                    out.success, out.error = False, f"error event: {json.dumps(event['error'])[:300]}"
                    return out
        if not out.success:
            out.error = "the stream ended without a token"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        out.success, out.error = False, f"{type(exc).__name__}: {exc}"
    out.e2e_s = last - st
    return out


async def sse_lines(resp: httpx.Response):
    """The stream's lines as SSE ends them: at CR LF, LF or CR only. httpx's aiter_lines also
    ends a line at U+0085, U+2028, U+2029 and others (str.splitlines), which JSON leaves raw in a
    string: a server that writes model text as UTF-8 (not \\u escapes) would have its chunk cut
    in two mid-JSON."""
    pending = ""
    async for text in resp.aiter_text():
        pending += text
        cut = len(pending) - pending.endswith("\r")  # a last CR may be half of a CR LF: wait for more
        *lines, rest = pending[:cut].replace("\r\n", "\n").replace("\r", "\n").split("\n")
        pending = rest + pending[cut:]
        for line in lines:
            yield line
    if pending.rstrip("\r"):
        yield pending.rstrip("\r")


def _read_usage(usage: dict, out: RequestResult) -> None:
    out.num_output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    out.num_cached_tokens = details.get("cached_tokens")
