"""The chaos soak's load (e2e/chaos.py): request kinds whose answers must never change (greedy or
seeded), one request sent to a router replica with fail-over and its outcome, and the tally.

Outcomes of `run_request`: `answer` (the text; the soak compares it with the undisturbed one),
`error` (a documented 429/503 with OpenAI's error body, or every replica refusing the
connection), `disconnected` (a stream the caller asked to cut), `cut` (the connection dropped
mid-answer: the soak decides whether a router kill explains it), `hung` (nothing received for
DEADLINE_S), `lost` (an undocumented status, a broken stream, or an unparsable answer).
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

DEADLINE_S = 180                 # `hung`: nothing received for this long (httpx read timeout; 5 s to connect)


@dataclass(frozen=True)
class Spec:
    """One kind of request; its answer must be the same every time (greedy or seeded)."""

    prompt: str
    stream: bool
    seed: int | None
    max_tokens: int

    def body(self) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.prompt}], "max_tokens": self.max_tokens,
                "stream": self.stream}
        if self.seed is None:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, seed=self.seed)
        return body


def make_specs(rng: random.Random, n: int) -> list[Spec]:
    prefixes = [" ".join(f"Section {i}.{j}: the quick brown fox jumps over the lazy dog number {j}."
                         for j in range(30)) for i in range(2)]      # long shared prefixes (~500 tokens)
    specs = []
    for i in range(n):
        prompt = f"{prefixes[i % 2]}\nQuestion {i}: summarise section {i % 7} in one sentence."
        specs.append(Spec(prompt, stream=bool(i % 2), seed=None if i % 3 else 1000 + i, max_tokens=4 + i % 6))
    rng.shuffle(specs)
    return specs


def run_request(routers: list[RouterProc], spec: Spec, rng: random.Random, disconnect: bool = False):
    """(outcome, detail, text): tries a random replica, the other one if it refuses the connection."""
    order = routers[:] if rng.random() < 0.5 else routers[::-1]
    t0 = time.time()
    last = ""
    for router in order:
        try:
            with httpx.Client(base_url=router.url, timeout=httpx.Timeout(DEADLINE_S, connect=5)) as client:
                if not spec.stream:
                    r = client.post("/v1/chat/completions", json=spec.body())
                    if r.status_code == 200:
                        return "answer", "", r.json()["choices"][0]["message"]["content"]
                    return classify_status(r.status_code, r.text)
                with client.stream("POST", "/v1/chat/completions", json=spec.body()) as r:
                    if r.status_code != 200:
                        r.read()
                        return classify_status(r.status_code, r.text)
                    text, done = "", False
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return classify_status(chunk["error"].get("code") and 503, json.dumps(chunk))
                        if chunk["choices"]:
                            text += chunk["choices"][0]["delta"].get("content") or ""
                        if disconnect and len(text) > 0:
                            return "disconnected", "", text
                    return ("answer", "", text) if done else ("lost", "stream ended without [DONE]", text)
        except httpx.ConnectError as exc:
            last = f"connect: {exc}"
            continue                                  # this replica is down: the other one
        except httpx.TimeoutException:
            return "hung", (f"{router.name}: nothing received for {DEADLINE_S} s (stream={spec.stream}, "
                            f"sent {time.strftime('%H:%M:%S', time.localtime(t0))}, gave up after "
                            f"{time.time() - t0:.0f} s)"), ""
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:   # dropped or reset mid-answer
            return "cut", f"{router.name}: {exc}", ""     # `cut_by_router_kill` if that replica was killed
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
            return "lost", f"{type(exc).__name__}: {exc}", ""
    return "error", f"every replica refused the connection ({last})", ""


def classify_status(status: int, text: str):
    try:
        documented = status in (429, 503) and json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        documented = False
    return ("error", f"{status}", "") if documented else ("lost", f"status {status}: {text[:200]}", "")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)
    successes: list = field(default_factory=list)          # monotonic times of ok answers
    fault_times: list = field(default_factory=list)        # (kind, monotonic time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome == "ok":
                self.successes.append(time.monotonic())
            if outcome in ("wrong", "hung", "lost"):
                # Said at once, with the faults just before it, so a long run can be diagnosed live.
                now = time.monotonic()
                recent = ", ".join(f"{kind} {now - at:.1f} s before" for kind, at in self.fault_times[-3:])
                print(f"chaos: {outcome} at {time.strftime('%H:%M:%S')}: {detail} (last faults: {recent or 'none'})",
                      flush=True)
                if len(self.problems) < 50:
                    self.problems.append((outcome, detail))
