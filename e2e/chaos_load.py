"""The chaos soak's load (e2e/chaos.py): request kinds whose answers must never change (greedy or
seeded), one request sent to a router replica with fail-over, what came back, and the tally.

Every request asks for the generated token ids (`return_token_ids`, vLLM's extension), so the
soak compares answers by token id, not by decoded text. `run_request` returns a `Reply`:
`answer` (complete, with [DONE] for a stream), `error` (a documented 429/503 with OpenAI's error
body before any output, or every replica refusing the connection), `cut` (the answer stopped
early: an error event after some tokens, or the connection dropped; `token_ids` holds what had
arrived), `disconnected` (a stream the caller asked to cut), `hung` (nothing received for
DEADLINE_S), `lost` (an undocumented status, a broken stream, an unparsable answer). A Reply
also names its path: the router replica it went to and, from the response headers, the decode
and prefill workers that served it, and when it was sent and ended.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from chaos_procs import MODEL, RouterProc

DEADLINE_S = 180  # `hung`: nothing received for this long (httpx read timeout; 5 s to connect)
FAILING = ("wrong", "hung", "lost", "cut_unexplained")  # any of these fails the soak


@dataclass(frozen=True)
class Spec:
    """One kind of request; its answer must be the same every time (greedy or seeded)."""

    prompt: str
    stream: bool
    seed: int | None
    max_tokens: int

    def body(self) -> dict:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "return_token_ids": True,
        }
        if self.seed is None:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, seed=self.seed)
        return body


def make_specs(rng: random.Random, n: int) -> list[Spec]:
    prefixes = [
        " ".join(f"Section {i}.{j}: the quick brown fox jumps over the lazy dog number {j}." for j in range(30))
        for i in range(2)
    ]  # long shared prefixes (~500 tokens)
    specs = []
    for i in range(n):
        prompt = f"{prefixes[i % 2]}\nQuestion {i}: summarise section {i % 7} in one sentence."
        specs.append(Spec(prompt, stream=bool(i % 2), seed=None if i % 3 else 1000 + i, max_tokens=4 + i % 6))
    rng.shuffle(specs)
    return specs


@dataclass
class Reply:
    kind: str  # answer, error, cut, disconnected, hung, lost
    detail: str = ""
    token_ids: list = field(default_factory=list)
    text: str = ""
    router: str = ""  # the replica that answered (or was tried last)
    decode: str = ""  # worker addresses from the response headers
    prefill: str = ""
    started: float = 0.0  # monotonic
    ended: float = 0.0


def run_request(routers: list[RouterProc], spec: Spec, rng: random.Random, disconnect: bool = False) -> Reply:
    """Tries a random replica, the other one if it refuses the connection."""
    order = routers[:] if rng.random() < 0.5 else routers[::-1]
    reply = Reply("error", started=time.monotonic())
    last = ""
    for router in order:
        reply.router = router.name
        try:
            _send(router, spec, disconnect, reply)
            break
        except httpx.ConnectError as exc:
            last = f"connect: {exc}"
            continue  # this replica is down: the other one
        except httpx.TimeoutException:
            reply.kind, reply.detail = (
                "hung",
                (
                    f"{router.name}: nothing received for {DEADLINE_S} s "
                    f"(stream={spec.stream}, {len(reply.token_ids)} tokens before)"
                ),
            )
            break
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:  # dropped or reset mid-answer
            reply.kind, reply.detail = "cut", f"{router.name}: connection dropped: {exc}"
            break
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
            reply.kind, reply.detail = "lost", f"{type(exc).__name__}: {exc}"
            break
    else:
        reply.kind, reply.detail = "error", f"every replica refused the connection ({last})"
    reply.ended = time.monotonic()
    return reply


def _send(router: RouterProc, spec: Spec, disconnect: bool, reply: Reply) -> None:
    with httpx.Client(base_url=router.url, timeout=httpx.Timeout(DEADLINE_S, connect=5)) as client:
        if not spec.stream:
            r = client.post("/v1/chat/completions", json=spec.body())
            _path(reply, r)
            if r.status_code != 200:
                _status(reply, r.status_code, r.text)
                return
            choice = r.json()["choices"][0]
            reply.kind, reply.token_ids, reply.text = "answer", list(choice["token_ids"]), choice["message"]["content"]
            return
        with client.stream("POST", "/v1/chat/completions", json=spec.body()) as r:
            _path(reply, r)
            if r.status_code != 200:
                r.read()
                _status(reply, r.status_code, r.text)
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    reply.kind = "answer"
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:  # after the 200: the router gave up on this request mid-answer
                    documented = _is_documented(503 if chunk["error"].get("code") else 500, json.dumps(chunk))
                    reply.kind = "cut" if documented else "lost"
                    reply.detail = f"{router.name}: error event after {len(reply.token_ids)} tokens: {chunk['error']}"
                    return
                for choice in chunk["choices"]:
                    reply.token_ids += choice.get("token_ids") or []
                    reply.text += choice["delta"].get("content") or ""
                if disconnect and reply.token_ids:
                    reply.kind = "disconnected"
                    return
            reply.kind, reply.detail = "lost", f"{router.name}: stream ended without [DONE]"


def _path(reply: Reply, response: httpx.Response) -> None:
    reply.decode = response.headers.get("x-splitserve-decode-worker", "")
    reply.prefill = response.headers.get("x-splitserve-prefill-worker", "")


def _is_documented(status: int, text: str) -> bool:
    try:
        return bool(status in (429, 503) and json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False


def _status(reply: Reply, status: int, text: str) -> None:
    if _is_documented(status, text):
        reply.kind, reply.detail = "error", f"{reply.router}: {status} {text[:160]}"
    else:
        reply.kind, reply.detail = "lost", f"{reply.router}: status {status}: {text[:200]}"


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)
    causes: dict = field(default_factory=dict)  # outcome -> Counter of causes
    successes: list = field(default_factory=list)  # monotonic times of ok answers
    fault_times: list = field(default_factory=list)  # (kind, monotonic time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, outcome: str, detail: str = "", cause: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if cause:
                self.causes.setdefault(outcome, Counter())[cause] += 1
            if outcome == "ok":
                self.successes.append(time.monotonic())
            if outcome in FAILING:
                # Said at once, with the faults just before it, so a long run can be diagnosed live.
                now = time.monotonic()
                recent = ", ".join(f"{kind} {now - at:.1f} s before" for kind, at in self.fault_times[-3:])
                print(
                    f"chaos: {outcome} at {time.strftime('%H:%M:%S')}: {detail} (last faults: {recent or 'none'})",
                    flush=True,
                )
                if len(self.problems) < 50:
                    self.problems.append((outcome, detail))
