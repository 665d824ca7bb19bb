"""`splitserve up --gateway envoy`: the embedded default served by a real Envoy in front of
`splitserve epp` and the decode worker's sidecar, as a user meets it (the official openai
client against the printed URL, Ctrl-C stopping every process). With an API key: the key
reaches the sidecar in a file, on no process' command line; a caller without it gets 401; the
answers carry no internal worker address."""

import signal

import openai
import psutil
import pytest
from test_router_up import MESSAGES, MODEL
from upkit import UpProcess

pytestmark = pytest.mark.slow

KEY = "sk-up-envoy-test-key"


def test_up_with_envoy_serves_streams_and_stops_cleanly():
    up = UpProcess("--gateway", "envoy", "--kv-transport", "tcp", "--api-key", KEY).wait()
    try:
        assert up.url == f"http://127.0.0.1:{up.port}/v1"
        children = psutil.Process(up.proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "envoy" in names and " epp " in names and " sidecar " in names
        assert KEY not in names, "an API key on a child's command line"
        assert "--serve-tls-client-ca" in names, "ext_proc is not served over mTLS"
        client = openai.OpenAI(base_url=up.url, api_key=KEY, max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
        )
        whole = raw.parse().choices[0].message.content
        assert whole
        assert not [k for k in raw.headers if k.startswith("x-splitserve-") and k.endswith("-worker")]
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == whole
        stranger = openai.OpenAI(base_url=up.url, api_key="sk-wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    finally:
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(90) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
