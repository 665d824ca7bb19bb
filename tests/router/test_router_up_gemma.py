"""`splitserve up --model gemma3-270m`: a second real model family through the whole stack (router,
a prefill and a decode worker, KV between them), met with the official `openai` client.

Gemma 3 270M is a base model without a chat template: completions work, streamed or not; a chat
request gets a 400 that says to send a plain prompt. The workers run `--quantization fp16`
(with its float16 KV cache it keeps transformers' greedy answers on 7 of the 8 prompts of
tests/platform/test_gemma3.py, this one among them; `auto`, which keeps the file's codes, on all
8; docs/models.md), so the answer is transformers' own greedy continuation.
"""

import json
import shlex
import subprocess

import openai
import pytest
from upkit import running_up

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
PROMPT = "The capital of France is"
ANSWER = " the capital of the country of France. It is the largest"  # 12 greedy tokens


@pytest.fixture(scope="module")
def up():
    yield from running_up("--model", MODEL, "--quantization", "fp16")


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=300)


def test_the_printed_example_is_a_completion_and_it_works(up):
    """A model without a chat template gets a plain-completion curl to try, not a chat one that
    would answer 400; the printed command runs as printed."""
    [command] = [line.strip() for line in up.lines if line.strip().startswith("curl ")]
    assert command.startswith(f"curl {up.url}/completions ")
    proc = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300)
    body = json.loads(proc.stdout)
    assert body["object"] == "text_completion" and body["choices"][0]["text"], body


def test_completions_streamed_or_not_give_the_greedy_answer(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == ANSWER
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 12)  # <bos> + 5 pieces
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == ANSWER


def test_chat_without_a_template_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert info.value.status_code == 400
    assert "no chat template; send a plain prompt (completions)" in info.value.body["message"]
