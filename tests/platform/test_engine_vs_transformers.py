"""Our engine against transformers, the reference implementation, on the same weights.

SmolLM2 is loaded by both from the same GGUF (transformers dequantizes it with `gguf` too).
Qwen2 has no small real checkpoint here, so a randomly initialised transformers Qwen2 is
saved as a Hugging Face folder and loaded by both.
"""

import pytest
import torch
from gguf_reference import hf_greedy  # noqa: F401 (other test files import it from here)

from splitserve.platform.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.kv.cache import allocate_kv_cache
from splitserve.platform.models.attention import AttentionMetadata, PrefillChunk
from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Translate to French: I love cheese.",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\nx = np.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def prompt_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """All-position logits of one prompt through our model, on a scratch KV cache."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_cache(model.config, num_blocks, block_size, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decodes=0,
        decode_block_table=None,
        decode_mask=None,
        prefills=[PrefillChunk(0, n, 0, None, None)],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), caches, meta)
        return model.compute_logits(hidden)


def test_smollm2_logits_match_transformers(smollm2_model, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    worst = 0.0
    for prompt in PROMPTS:
        ids = hf_tok(prompt).input_ids
        ours = prompt_logits(smollm2_model, ids)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0]
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst <= 2e-3, f"max |dlogit| = {worst}"


def test_smollm2_greedy_64_tokens_match_transformers(make_engine, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    engine = make_engine()
    prompt_ids = [hf_tok(p).input_ids for p in PROMPTS]
    outs = engine.generate(prompt_ids, GREEDY)
    for ids, out in zip(prompt_ids, outs):
        assert out.output_token_ids == hf_greedy(hf_model, ids, 64), f"diverged on {hf_tok.decode(ids)!r}"


def save_random_qwen2(folder, gguf_path: str, seed: int, init_std: float):
    """A randomly initialised transformers Qwen2 (untied head, q/k/v biases that count) saved as a
    Hugging Face folder with SmolLM2's tokenizer; returns the transformers model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from splitserve.platform.tokenizer import Tokenizer

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, init_std)
    model.save_pretrained(folder)
    Tokenizer.from_gguf(gguf_path).save_tokenizer_json(str(folder / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory, smollm2_gguf_path):
    folder = tmp_path_factory.mktemp("qwen2-random")
    return folder, save_random_qwen2(folder, smollm2_gguf_path, seed=0, init_std=0.2)


def test_random_qwen2_matches_transformers(qwen2_folder):
    folder, hf_model = qwen2_folder
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_batched_tokens=64)
        )
    )
    assert engine.model_config.architecture == "qwen2" and engine.model_config.attention_bias
    prompt_ids = [[(7 * i + 3 * j) % 49000 + 100 for j in range(5 + 9 * i)] for i in range(8)]
    worst = 0.0
    for ids in prompt_ids:
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0]
        worst = max(worst, (prompt_logits(engine.model, ids) - ref).abs().max().item())
    assert worst <= 2e-3, f"max |dlogit| = {worst}"
    outs = engine.generate(prompt_ids, GREEDY)
    for ids, out in zip(prompt_ids, outs):
        assert out.output_token_ids == hf_greedy(hf_model, ids, 64)
