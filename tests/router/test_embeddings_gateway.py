"""/v1/embeddings against `splitserve up --quantization none` (prefill + decode worker processes)
with the official openai client: last-token pooling after the final norm, L2-normalized, equal
to transformers' last hidden state of the same SmolLM2 weights (cosine >= 0.999), in both
encodings, for text and token ids; usage counts the prompt tokens; bad input is a clear 400."""

import base64

import numpy as np
import openai
import pytest
import torch

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TEXTS = [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "def add(a, b):\n    return a + b",
    "A much longer sentence about the weather, which today is sunny "
    "with a light breeze from the west and a few clouds over the hills.",
]


@pytest.fixture(scope="module")
def client(shared_up):
    process = shared_up("--quantization", "none", "--kv-transport", "tcp")
    return openai.OpenAI(base_url=process.url, api_key="unused", max_retries=0, timeout=300)


def decode(embedding):
    """A base64 answer (asked for explicitly, the client hands it over as is): little-endian float32."""
    return np.frombuffer(base64.b64decode(embedding), dtype="<f4").copy() if isinstance(embedding, str) else embedding


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        last = hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(last, dim=-1)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_embeddings_equal_transformers_last_hidden_state(client, hf_smollm2, encoding_format):
    """None: the client's default, which asks for base64 and decodes it itself."""
    hf_model, hf_tok = hf_smollm2
    extra = {"encoding_format": encoding_format} if encoding_format else {}
    answer = client.embeddings.create(model=MODEL, input=TEXTS, **extra)
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    ids = [hf_tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for item, token_ids in zip(answer.data, ids):
        vector = torch.tensor(decode(item.embedding))
        assert vector.shape == (hf_model.config.hidden_size,)
        assert float(vector.norm()) == pytest.approx(1.0, abs=1e-4)
        assert float(vector @ reference(hf_model, token_ids)) >= 0.999
    # different texts give different vectors (not one constant answer)
    first, third = (torch.tensor(decode(answer.data[i].embedding)) for i in (0, 2))
    assert float(first @ third) < 0.99


def test_embeddings_of_token_ids_and_one_string(client, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    ids = hf_tok(TEXTS[1], add_special_tokens=False).input_ids
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    assert float(torch.tensor(by_ids) @ reference(hf_model, ids)) >= 0.999
    assert float(torch.tensor(by_ids) @ torch.tensor(by_text)) >= 0.9999


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "Hi", "dimensions": 8}, "dimensions"),
        ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embedding_requests_get_a_clear_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, **kwargs)
    assert err.value.body["param"] == param, err.value.body
