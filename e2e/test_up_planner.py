"""`splitserve up --planner` on loopback with real workers: a step of long prompts adds a
prefill worker, a step of long answers adds a decode worker, no request fails while workers
come and go, and both pools return to one worker after the load stops. The planner's decisions
carry the TTFT and ITL p90 it measured from the router and the decode workers' /metrics.

The capacity profile is written by the test and deliberately small (a prefill worker is
planned at 120 prompt tokens/s, a decode worker at 8 output tokens/s within a 250 ms ITL), so
the steps clearly exceed one worker on a shared 2-core machine; the test checks the control
loop, not this machine's speed."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import openai
import pytest
from workerproc import CLI, free_port

from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint

pytestmark = pytest.mark.slow
PROFILE = CapacityProfile(
    prefill=(PrefillPoint(64, 120.0), PrefillPoint(2048, 120.0)),
    decode=(DecodePoint(256, 1, 5.0, 0.2), DecodePoint(256, 2, 8.0, 0.25), DecodePoint(256, 4, 10.0, 0.4)),
    kv_tokens=20000,
)
LONG_PROMPT = "Summarise the following notes. " + " ".join(
    f"Note {i}: the river rose by {i} centimetres." for i in range(120)
)


class Up:
    def __init__(self, tmp_path, flags: list[str] | None = None):
        prof = tmp_path / "profile.json"
        prof.write_text(PROFILE.to_json())
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                CLI,
                "up",
                "--port",
                str(self.port),
                "--planner",
                *(
                    [
                        "--profile",
                        str(prof),
                        "--max-workers",
                        "4",
                        "--planner-tick",
                        "2",
                        "--scale-down-window",
                        "10",
                        "--kv-cache-memory",
                        "0.25",
                    ]
                    if flags is None
                    else flags
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.serving = {"prefill": 1, "decode": 1}
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.match(r"splitserve up: planner: (prefill|decode) workers serving: (\d+)", line)
            if m:
                self.serving[m.group(1)] = int(m.group(2))

    def wait_for(self, cond, what, timeout_s):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert self.proc.poll() is None, "".join(self.lines[-40:])
            assert time.monotonic() < deadline, f"{what} not within {timeout_s} s:\n" + "".join(self.lines[-40:])
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def load(client, stop: threading.Event, errors: list, done: list, prompt: str, max_tokens: int):
    while not stop.is_set():
        try:
            # A unique first block: no prefix-cache hits, every prompt token is demand.
            client.completions.create(
                model="smollm2-135m", prompt=f"[{time.monotonic_ns()}] {prompt}", max_tokens=max_tokens
            )
            done.append(1)
        except Exception as e:  # noqa: BLE001 - every failure is a test failure, reported below
            errors.append(repr(e))


def step(client, prompt, max_tokens, n):
    stop, errors, done = threading.Event(), [], []
    threads = [threading.Thread(target=load, args=(client, stop, errors, done, prompt, max_tokens)) for _ in range(n)]
    for t in threads:
        t.start()
    return stop, threads, errors, done


def test_planner_scales_each_pool_with_its_load_and_back(tmp_path):
    up = Up(tmp_path)
    try:
        up.wait_for(lambda: any("splitserve up: serving" in ln for ln in up.lines), "startup", 240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="none", timeout=120, max_retries=0)
        # Long prompts, short answers: prefill demand.
        stop, threads, errors, done = step(client, LONG_PROMPT, 2, 3)
        up.wait_for(lambda: up.serving["prefill"] >= 2, "a second prefill worker", 180)
        stop.set()
        [t.join(180) for t in threads]
        assert errors == [] and done
        # Short prompts, long answers: decode demand.
        stop, threads, errors2, done2 = step(client, "Tell a long story about a lighthouse keeper.", 48, 4)
        up.wait_for(lambda: up.serving["decode"] >= 2, "a second decode worker", 180)
        stop.set()
        [t.join(180) for t in threads]
        assert errors2 == [] and done2
        # No load: both pools drain back to their minimum (1).
        up.wait_for(lambda: up.serving == {"prefill": 1, "decode": 1}, "the pools back at 1/1", 180)
    finally:
        up.stop()
    assert up.proc.returncode == 0, "".join(up.lines[-40:])
    # Real measurements reached the law: a decision line with a measured TTFT and ITL p90.
    decisions = [ln for ln in up.lines if re.match(r"splitserve up: planner: (prefill|decode) \d+ -> \d+", ln)]
    assert any(re.search(r"measured TTFT p90 \d+ ms, ITL p90 \d+ ms", ln) for ln in decisions), "".join(decisions)


def test_up_planner_with_no_flags_uses_the_shipped_profile_and_serves(tmp_path):
    """The plain `splitserve up --planner` a new user types: no --profile, nothing else."""
    up = Up(tmp_path, flags=[])
    try:
        up.wait_for(lambda: any("splitserve up: serving" in ln for ln in up.lines), "startup", 240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="none", timeout=120, max_retries=0)
        reply = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4)
        assert reply.choices[0].text and reply.usage.completion_tokens == 4
    finally:
        up.stop()
    assert up.proc.returncode == 0, "".join(up.lines[-40:])
    assert any(
        "splitserve up: planner: using the capacity profile shipped for smollm2-135m (measured on 2 CPU cores" in ln
        for ln in up.lines
    ), "".join(up.lines[-40:])
