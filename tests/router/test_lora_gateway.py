"""LoRA adapters through `splitserve up` as a user meets them: the official `openai` client,
vLLM's load/unload endpoints, `model` selecting an adapter, /v1/models listing adapters with
their parent, and every bad input answered with its status and reason.

`splitserve up` runs a real prefill and a real decode worker; `--lora-modules` loads one adapter
at start, the others are loaded and unloaded at run time through the gateway (which sends the
load to both workers). The reference answer is the engine in the test process with the same
weights, quantization and adapter.
"""

import json
import threading

import openai
import pytest
from lora_folders import write_adapter
from upkit import running_up
from workerproc import WORKER_QUANTIZATION

from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

BASE = "smollm2-135m"
PROMPT = "The best way to learn a language is"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway-adapters")
    return {
        "sql": write_adapter(root / "sql", alpha=128, modules=("q_proj", "v_proj", "gate_proj"), seed=21),
        "chat": write_adapter(root / "chat", r=16, alpha=256, modules=("k_proj", "o_proj", "down_proj"), seed=22),
        "big": write_adapter(root / "big", r=32, seed=23),
        "lmhead": write_adapter(root / "lmhead", modules=("q_proj", "lm_head"), seed=24),
        "root": root,
    }


@pytest.fixture(scope="module")
def up(folders):
    yield from running_up(
        "--lora-modules", f"sql={folders['sql']}", "--max-loras", "2", "--worker-arg=--max-lora-rank", "--worker-arg=16"
    )


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def reference(make_engine, folders):
    engine = make_engine(quantization=WORKER_QUANTIZATION)
    for name in ("sql", "chat"):
        engine.load_lora_adapter(name, folders[name])

    def ref(lora, max_tokens=16):
        rid = engine.add_request(
            PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), lora_name=lora
        )
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.req_id: o for o in engine.step() if o.finished})
        return final[rid].text

    return ref


def complete(client, model, max_tokens=16):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def load(client, name, path):
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": path}, cast_to=object)


def unload(client, name):
    return client.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=object)


def test_models_lists_adapters_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert models["sql"].parent == BASE and models["sql"].root == "sql"
    assert models[BASE].parent is None


def test_model_selects_the_adapter(client, reference):
    sql = complete(client, "sql")
    assert sql == reference("sql") and sql != complete(client, BASE)


def test_load_use_and_unload_under_traffic(client, reference, folders):
    answer = load(client, "chat", folders["chat"])
    assert answer["status"] == "loaded" and "chat" in {m.id for m in client.models.list().data}
    assert complete(client, "chat") == reference("chat")
    results, errors, started = [], [], [threading.Event() for _ in range(3)]

    def stream(first_chunk: threading.Event):  # long streams with the adapter, running while it is unloaded
        try:
            chunks = []
            for chunk in client.completions.create(
                model="chat", prompt=PROMPT, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True}
            ):
                chunks.append(chunk)
                first_chunk.set()
            results.append(
                ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason)
            )
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            first_chunk.set()

    threads = [threading.Thread(target=stream, args=(e,)) for e in started]
    for t in threads:
        t.start()
    for e in started:  # every stream is running on the workers before the unload
        assert e.wait(300)
    base_during = complete(client, BASE, max_tokens=4)  # traffic of the base model goes on too
    assert unload(client, "chat")["status"] == "unloaded"
    for t in threads:
        t.join(300)
    assert not errors, errors
    full = reference("chat", max_tokens=48)
    assert [r for r in results] == [(full, "length")] * 3, "in-flight requests finish with the adapter"
    assert base_during
    with pytest.raises(openai.NotFoundError, match="chat"):
        complete(client, "chat")
    assert "chat" not in {m.id for m in client.models.list().data}


@pytest.mark.parametrize(
    "body, status, reason",
    [
        ({"lora_name": "x", "lora_path": "/does/not/exist"}, 404, "is not a folder"),  # as vLLM: not found
        ({"lora_name": "big", "lora_path": "big"}, 400, "rank 32 is over this server's max_lora_rank 16"),
        ({"lora_name": "lmhead", "lora_path": "lmhead"}, 400, "lm_head"),
        ({"lora_name": "cfg", "lora_path": "badcfg"}, 400, "not valid JSON"),
        ({"lora_name": BASE, "lora_path": "sql"}, 400, "base model"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "has space", "lora_path": "sql"}, 400, "lora_name"),
    ],
)
def test_bad_loads_are_4xx_with_the_reason(client, folders, body, status, reason):
    bad = folders["root"] / "badcfg"
    if not bad.exists():
        write_adapter(bad)
        (bad / "adapter_config.json").write_text("{nope")
    if "lora_path" in body and not body["lora_path"].startswith("/"):
        body = {**body, "lora_path": str(folders["root"] / body["lora_path"])}
    with pytest.raises(openai.APIStatusError) as err:
        client.post("/load_lora_adapter", body=body, cast_to=object)
    assert err.value.status_code == status and reason in json.dumps(err.value.body)
    assert body["lora_name"] not in {m.id for m in client.models.list().data} or body["lora_name"] == BASE


def test_unknown_adapter_and_unknown_unload_are_404(client):
    with pytest.raises(openai.NotFoundError, match="nope"):
        complete(client, "nope")
    with pytest.raises(openai.NotFoundError, match="nope"):
        unload(client, "nope")
