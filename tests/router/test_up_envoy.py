"""`splitserve up --gateway envoy`: the embedded default served by a real Envoy in front of
`splitserve epp` and the decode worker's sidecar, as a user meets it (the official openai
client against the printed URL, Ctrl-C stopping every process)."""

import signal

import openai
import psutil
import pytest
from test_router_up import MESSAGES, MODEL, UpProcess

pytestmark = pytest.mark.slow


def test_up_with_envoy_serves_streams_and_stops_cleanly():
    up = UpProcess("--gateway", "envoy", "--kv-transport", "tcp").wait()
    try:
        assert up.url == f"http://127.0.0.1:{up.port}/v1"
        children = psutil.Process(up.proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "envoy" in names and " epp " in names and " sidecar " in names
        client = openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
        )
        whole = raw.parse().choices[0].message.content
        assert whole and raw.headers["x-splitserve-decode-worker"]
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == whole
        long = " ".join(["a river runs past the old stone mill"] * 40)  # past the P/D threshold (256 tokens)
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=long, max_tokens=2)
        assert raw.headers.get("x-splitserve-prefill-worker"), "a long prompt should be prefilled apart"
    finally:
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(90) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
