"""Reading a request body for placement, with bounded work: raw JSON in, the part placement
reads out.

    read_for_placement(body, max_choices) -> the body as a dict, cut to one choice of its first
        prompt ("n": 1, "prompt": [first]); or a Refusal (status, message, param)

The checks run on the raw JSON, before anything is validated or tokenized: not JSON (also JSON
nested too deep for the parser, whose RecursionError is a refusal like any other), not an
object, prompts x n over the gateway's `max_choices_per_request`. Large bodies are read in a
child process (`BodyReader`): parsing a mebibyte of JSON holds the interpreter lock for tens of
milliseconds, and in the EPP's own process that would stall its event loop (health, other
picks) for as long. A small body is read in a thread of the EPP, where the round trip to a
child costs more than the parse. Only the standard library is imported here, so the child
starts light.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

LARGE_BODY_BYTES = 64 * 1024  # from here on a body is read in the child process


@dataclass(frozen=True)
class Refusal:
    """Why a body is refused, as the gateway would say it (an OpenAI 400)."""

    status: int
    message: str
    param: str | None = None


def read_for_placement(body: bytes, max_choices: int) -> dict | Refusal:
    try:
        data = json.loads(body)
    except RecursionError:
        return Refusal(400, "the request body nests too deeply to be read")
    except ValueError:
        return Refusal(400, "the request body is not valid JSON")
    if not isinstance(data, dict):
        return Refusal(400, "the request body must be a JSON object")
    choices = _num_choices(data)
    if choices > max_choices:
        return Refusal(
            400,
            f"the request asks for {choices} choices (prompts x n); one request may ask for at "
            f"most {max_choices} (gateway.max_choices_per_request)",
            "n",
        )
    placed = {**data, "n": 1}
    prompts = _prompts(data)
    if prompts is not None:
        placed["prompt"] = prompts[:1]
    return placed


def _prompts(data: dict) -> list | None:
    """A completions body's prompts as a list (each a string or token ids); None for chat or one prompt."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return None


def _num_choices(data: dict) -> int:
    """Prompts x n, from the raw body (an n that is no positive integer counts 1: validation says why)."""
    n = data.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompts = _prompts(data)
    return (len(prompts) if prompts is not None else 1) * n


class BodyReader:
    """read_for_placement, one body at a time: a small one in a thread, a large one in a child
    process (started on first use, restarted if it dies)."""

    def __init__(self) -> None:
        self._slot = asyncio.Semaphore(1)
        self._pool: ProcessPoolExecutor | None = None

    async def read(self, body: bytes, max_choices: int) -> dict | Refusal:
        async with self._slot:
            if len(body) < LARGE_BODY_BYTES:
                return await asyncio.to_thread(read_for_placement, body, max_choices)
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(self._executor(), read_for_placement, body, max_choices)
            except RecursionError:  # the parse outlived the child's stack: still the body's fault
                return Refusal(400, "the request body nests too deeply to be read")
            except Exception:  # a dead child (killed, out of memory): a fresh one for the next body
                self.close()
                raise

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(1, mp_context=context, initializer=_die_with_parent)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _die_with_parent() -> None:
    """In the child: the kernel ends it when the EPP dies, even by SIGKILL (Linux; elsewhere the
    child ends when its call queue closes)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
