"""Echo and prompt logprobs on /v1/completions against `splitserve up --quantization none` (a real
gateway in front of a prefill and a decode worker process; echo requests are prefilled by the
decode worker itself, router/api/echo.py).

lm-evaluation-harness (`local-completions`, the client platform teams check deployments with) runs
a multiple-choice task from a JSON file written here, no hub: its per-choice loglikelihoods equal
transformers' on the same SmolLM2 weights within 1e-3, and so does its accuracy. The openai client
checks the response shapes (echo, max_tokens 0, streaming, vLLM's prompt_logprobs) and the 400s."""

import json
import math

import openai
import pytest
import torch

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " volts", " meters"], 0),
    ("The opposite of hot is", [" cold", " green", " seven"], 0),
    ("Two plus two equals", [" four", " nine", " banana"], 0),
    ("The sun rises in the", [" west", " east", " basement"], 1),
    ("A baby cat is called a", [" puppy", " calf", " kitten"], 2),
    ("Bees make", [" honey", " iron", " glass"], 0),
    ("The largest ocean on Earth is the", [" Atlantic", " Pacific", " Arctic"], 1),
]
TASK = """task: splitserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def up(shared_up):
    return shared_up("--quantization", "none", "--kv-transport", "tcp")


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=300)


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def test_lm_eval_local_completions_scores_as_transformers(up, hf_smollm2, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    hf_model, hf_tok = hf_smollm2
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tokenizer_dir = tmp_path / "tokenizer"
    hf_tok.save_pretrained(tokenizer_dir)
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "splitserve_mc.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={up.url}/completions,tokenizer={tokenizer_dir},"
        "tokenizer_backend=huggingface,max_retries=1,timeout=300",
        tasks=["splitserve_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=4,
    )
    samples = sorted(results["samples"]["splitserve_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    num_correct = 0
    for sample, (question, choices, answer) in zip(samples, QUESTIONS):
        served = [float(resp[0][0]) for resp in sample["resps"]]
        expected = []
        for choice in choices:
            whole = hf_tok(question + choice, add_special_tokens=False).input_ids
            num_context = len(hf_tok(question, add_special_tokens=False).input_ids)
            ref = hf_logprobs(hf_model, whole)
            expected.append(sum(float(ref[p - 1, whole[p]]) for p in range(num_context, len(whole))))
        assert served == pytest.approx(expected, abs=1e-3), question
        num_correct += int(max(range(len(expected)), key=expected.__getitem__) == answer)
    assert results["results"]["splitserve_mc"]["acc,none"] == pytest.approx(num_correct / len(QUESTIONS))


def test_echo_shapes_with_the_openai_client(client, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    prompt = "The capital of France is"
    ids = hf_tok(prompt, add_special_tokens=False).input_ids
    ref = hf_logprobs(hf_model, ids)
    only = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    choice = only.choices[0]
    assert choice.text == prompt and only.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert choice.logprobs.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-3)
        assert len(choice.logprobs.top_logprobs[p]) == 2
    assert "".join(choice.logprobs.tokens) == prompt

    generated = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=3, temperature=0, logprobs=0)
    text = generated.choices[0].text
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert len(generated.choices[0].logprobs.token_logprobs) == len(ids) + generated.usage.completion_tokens

    streamed = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, max_tokens=3, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text

    vllm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    scored = vllm.model_dump()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert scored[1][str(ids[1])]["logprob"] == pytest.approx(float(ref[0, ids[1]]), abs=1e-3)
    assert math.isclose(max(e["logprob"] for e in scored[1].values()), float(ref[0].max()), abs_tol=1e-3)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"echo": True, "n": 2}, "echo"),
        ({"echo": True, "best_of": 2, "n": 1}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_echo_requests_get_a_clear_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.status_code == 400


@pytest.mark.parametrize("path", ["/completions", "/responses"])
def test_a_stream_with_unicode_line_separators_reads_whole_with_any_line_splitter(up, path):
    """JSON may carry U+2028, U+2029 and U+0085 raw; httpx's iter_lines (str.splitlines rules) ends
    a line at each. The gateway writes them as \\u escapes, so every data line is whole JSON even
    read that way, and the text is the same. Echo streams the prompt back; the Responses API
    streams its events the same way."""
    import httpx

    prompt = "Line one\u2028line two\u2029line three\x85end."
    if path == "/completions":
        body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 1, "temperature": 0, "stream": True}
    else:
        body = {"model": MODEL, "input": prompt, "instructions": prompt, "max_output_tokens": 2, "stream": True}
    events = []
    with httpx.stream("POST", up.url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))  # a cut line would not parse
    assert events
    if path == "/completions":
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")).startswith(prompt)
    else:
        created = next(e for e in events if e["type"] == "response.created")
        assert created["response"]["instructions"] == prompt
