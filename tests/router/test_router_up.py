"""`splitserve up` — the embedded default — as a user meets it: the official `openai` client
against its URL, the README's curl example, `make run` calling it, Ctrl-C stopping everything."""

import pathlib
import re
import signal
import subprocess

import openai
import psutil
import pytest
from upkit import running_up
from workerproc import WORKER_QUANTIZATION

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def up():
    yield from running_up()


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=120)


def test_prints_url_and_a_curl_example(up):
    assert up.url == f"http://127.0.0.1:{up.port}/v1"
    assert any(line.strip().startswith(f"curl {up.url}/chat/completions") for line in up.lines)


def test_openai_client_chat_completion_is_correct(client, tokenizer, make_engine):
    from splitserve.platform.sampling.params import SamplingParams

    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    prompt_ids = tokenizer.encode_chat(MESSAGES)
    [ref] = make_engine(quantization=WORKER_QUANTIZATION).generate(
        [prompt_ids], SamplingParams(temperature=0, max_tokens=24)
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ("length" if len(ref.output_token_ids) == 24 else "stop")
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(ref.output_token_ids)
    assert out.usage.total_tokens == len(prompt_ids) + len(ref.output_token_ids)


def test_openai_client_stream_equals_the_whole_answer_for_a_seed(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0.9, seed=1234)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    deltas, usage = [], None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(deltas) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_repeated_prompt_reports_cached_tokens(client):
    messages = [{"role": "user", "content": "List three colours of the rainbow, please."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_openai_client_sees_errors_as_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
    assert [m.id for m in client.models.list()] == [MODEL]


def readme_curl_example() -> str:
    """The README's curl example against the gateway (a ```bash block's curl command)."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        command = block.replace("\\\n", " ")
        for line in command.splitlines():
            if line.strip().startswith("curl") and "/v1/chat/completions" in line:
                return line.strip()
    raise AssertionError("README.md has no curl example for /v1/chat/completions (see docs/router.md)")


def test_readme_curl_example_works(up):
    command = readme_curl_example()
    assert "127.0.0.1:8000" in command or "localhost:8000" in command
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{up.port}").replace(
        "localhost:8000", f"127.0.0.1:{up.port}"
    )
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import json

    answer = json.loads(result.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]


def test_make_run_starts_splitserve_up():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and re.search(r"splitserve up\b", recipe.group(1)), "`make run` must call `splitserve up`"


def test_ctrl_c_stops_every_process(up):
    """Last in this module: SIGINT to `splitserve up` stops the gateway and both workers."""
    children = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(children) == 2
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
