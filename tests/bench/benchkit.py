"""A scripted OpenAI-compatible server for the bench tests.

`ScriptedServer` serves POST /v1/completions on 127.0.0.1 from an asyncio loop in its own
thread. For each request it asks `script(n, payload)` (n: the request's arrival number from 0)
for a `Script`: wait `ttft_s`, send a token chunk, then one more chunk after each gap in
`gaps_s`; then (after `usage_delay_s`) the usage event and [DONE]. It records, on the same perf_counter clock as the
client in the test thread, when each request arrived and when each chunk was written, so a
test can compare the client's measurements with what actually happened on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    ttft_s: float = 0.0
    gaps_s: tuple[float, ...] = ()
    completion_tokens: int | None = None  # usage value; default: the number of chunks; -1: no usage
    cached_tokens: int | None = None
    status: int = 200
    usage_delay_s: float = 0.0  # between the last token and the usage event
    closing_chunk_s: float | None = None  # after the last token: a chunk with no text and a finish_reason
    token_text: str = "t{i}"  # each token chunk's text ({i}: its number), written as raw UTF-8 JSON
    decode_worker: str = ""  # sent as x-splitserve-decode-worker (as the splitserve gateway does) unless ""
    pulled_tokens: int = 0  # sent as x-splitserve-pulled-tokens unless 0


@dataclass
class Served:
    """What the server saw and did for one request (perf_counter times)."""

    payload: dict
    arrived: float
    sent: list[float] = field(default_factory=list)


def cpu_wait_s() -> float:
    """Seconds the threads of this process have spent runnable but waiting for a CPU (Linux
    schedstat run_delay; 0 where the kernel does not report it)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
    return total / 1e9


@contextlib.contextmanager
def stalls():
    """`with stalls() as s:` … `s.seconds`: how long the threads of this process waited for a CPU
    inside the block. Not a tolerance (it sums every wake-up, not just the one that matters), but
    it explains a failed timing check on a busy machine."""
    box = type("Stalls", (), {})()
    start = cpu_wait_s()
    yield box
    box.seconds = cpu_wait_s() - start


def retry_timing(scenario, attempts: int = 5):
    """Run a timing scenario until one run is not spoiled by a scheduling stall of this shared
    2-core machine (other processes run beside the tests: when it is busy, a stall of tens of ms
    spoils a few runs out of ten). `scenario` asserts; a wrong metric definition or measurement
    point fails every attempt, so it still fails. The last failure says how long this process
    waited for a CPU during that run."""
    for attempt in range(attempts):
        with stalls() as stall:
            try:
                return scenario()
            except AssertionError as exc:
                error = exc
        if attempt == attempts - 1:
            raise AssertionError(
                f"{error}\n(in this run the test process waited {1000 * stall.seconds:.0f} ms for a CPU)"
            ) from error


class ScriptedServer:
    def __init__(self):
        self.script: Callable[[int, dict], Script] = lambda n, payload: Script()
        self.served: list[Served] = []
        self.in_flight = self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def reset(self, script: Callable[[int, dict], Script]) -> None:
        self.script, self.served, self.max_in_flight = script, [], 0

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                fields = (line.partition(":") for line in lines[1:] if line)
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self._request(json.loads(body), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _request(self, payload: dict, writer: asyncio.StreamWriter) -> None:
        served = Served(payload, time.perf_counter())
        n = len(self.served)
        self.served.append(served)
        script = self.script(n, payload)
        if script.status != 200:
            msg = b'{"error": "scripted failure"}'
            writer.write(b"HTTP/1.1 %d Error\r\nContent-Length: %d\r\n\r\n%s" % (script.status, len(msg), msg))
            await writer.drain()
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            worker = f"x-splitserve-decode-worker: {script.decode_worker}\r\n" if script.decode_worker else ""
            if script.pulled_tokens:
                worker += f"x-splitserve-pulled-tokens: {script.pulled_tokens}\r\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                + worker.encode()
                + b"\r\n"
            )
            await self._stream(script, served, writer)
        finally:
            self.in_flight -= 1

    async def _stream(self, script: Script, served: Served, writer: asyncio.StreamWriter) -> None:
        for i, delay in enumerate((script.ttft_s, *script.gaps_s)):
            await asyncio.sleep(delay)
            text = script.token_text.format(i=i)
            await _event(writer, {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None})
            served.sent.append(time.perf_counter())
        if script.closing_chunk_s is not None:  # as llama-cpp-python's server ends a stream
            await asyncio.sleep(script.closing_chunk_s)
            await _event(writer, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        await asyncio.sleep(script.usage_delay_s)
        if script.completion_tokens != -1:
            usage = {
                "prompt_tokens": len(served.payload["prompt"]),
                "completion_tokens": script.completion_tokens or len(served.sent),
            }
            if script.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": script.cached_tokens}
            await _event(writer, {"choices": [], "usage": usage})
        await _event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def _event(writer: asyncio.StreamWriter, data) -> None:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    frame = f"data: {text}\n\n".encode()
    writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
    await writer.drain()
