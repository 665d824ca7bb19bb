"""The 2026 families against transformers: GLM-4.5, gpt-oss, DeepSeek-V3 and a Kimi-K2-shaped
DeepSeek-V3 (more experts, one group), each on a tiny random checkpoint transformers writes.

Per family a randomly initialised transformers model (every weight but the norms drawn at std
0.15, biases, sinks and the routers' correction biases included, so greedy references do not
sit on near-ties and every term is exercised) is saved with `save_pretrained` next to SmolLM2's
tokenizer.json and loaded by our engine from that folder, fp32, quantization "none". Greedy on
6 prompts (5 to 68 tokens, 24 generated) must equal transformers' own greedy decoding:
batched, after a prefix-cache hit, and through prefill/decode disaggregation in the engine;
seeded sampling through P/D equals the colocated run. tests/workers/test_families_2026_pd.py
runs the same folders through two worker processes over TCP.
"""

import copy
import json

import pytest
import torch
from test_disaggregation_engine import disaggregated
from test_engine_vs_transformers import hf_greedy

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, SpeculativeConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.model_source import resolve_model
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.weights import load_model_config

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
WINDOW = 16  # gpt-oss's sliding layers: most prompts and all generations run past it
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 49000 + 100 for j in range(5 + 12 * i)] for i in range(6)]
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SIGMOID_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True)
FAMILIES = {
    # name: (config class, model class, options)
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            SIGMOID_MOE,
            head_dim=16,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=1.5,  # low enough that the clamps bite at std 0.15
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            SIGMOID_MOE,
            num_key_value_heads=4,  # the reference expands K/V to every head, as the releases say
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                mscale=1.0,
                mscale_all_dim=0.8,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
        ),
    ),
    # Kimi K2's shape: more experts in one group; and no q_lora_rank (DeepSeek-V2-Lite's q_proj)
    "kimi_k2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            SIGMOID_MOE,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            kv_lora_rank=24,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=False,
        ),
    ),
}


def save_family(folder, name: str, gguf_path: str):
    """A random transformers model of family `name` saved in `folder` with SmolLM2's tokenizer."""
    import transformers

    from splitserve.platform.tokenizer import Tokenizer

    config_name, model_name, options = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **options})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" not in key and tensor.is_floating_point() and "inv_freq" not in key:
                tensor.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    Tokenizer.from_gguf(gguf_path).save_tokenizer_json(str(folder / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory, smollm2_gguf_path):
    """name -> (folder, transformers model): each family saved once per module; a test that
    changes a folder works on a copy (`copy_of`)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = folder, save_family(folder, name, smollm2_gguf_path)
        return cache[name]

    return get


def copy_of(saved, name: str, tmp_path):
    import shutil

    folder, model = saved(name)
    shutil.copytree(folder, tmp_path / name)
    return tmp_path / name, model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, saved):
    folder, model = saved(request.param)
    return request.param, folder, model, [hf_greedy(model, ids, MAX_TOKENS) for ids in PROMPTS]


def engine_for(folder, **device) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            cache=CacheConfig(num_blocks=96),
            device=DeviceConfig(**{"dtype": "float32", "quantization": "none", **device}),
        )
    )


def test_greedy_equals_transformers_batched_and_after_a_prefix_hit(family):
    name, folder, _, reference = family
    engine = engine_for(folder)
    assert [out.output_token_ids for out in engine.generate(PROMPTS, GREEDY)] == reference
    hits = engine.scheduler.stats.num_prefix_hit_tokens
    again = engine.generate([PROMPTS[5]], GREEDY)[0]  # every full block of it is cached now
    assert engine.scheduler.stats.num_prefix_hit_tokens - hits == 64
    assert again.output_token_ids == reference[5]
    engine.kv.check_invariants()


def test_disaggregated_greedy_and_seeded_sampling_equal_colocated(family):
    name, folder, _, reference = family
    p_engine, d_engine, local = engine_for(folder), engine_for(folder), engine_for(folder)
    prompt = PROMPTS[4]
    outs, received, _ = disaggregated(p_engine, d_engine, prompt, params=GREEDY, req_id="g")
    assert outs[-1].finished and outs[-1].output_token_ids == reference[4]
    assert sorted({layer for _, layer, _, _ in received}) == [0, 1, 2]
    [colocated] = local.generate([prompt], SEEDED)
    outs, _, _ = disaggregated(p_engine, d_engine, prompt, params=SEEDED, req_id="s")
    assert outs[-1].output_token_ids == colocated.output_token_ids
    assert colocated.output_token_ids != reference[4], "sampling at 0.9 should leave the greedy path"
    for e in (p_engine, d_engine):
        e.kv.check_invariants()
        assert e.pool.num_free_blocks == e.pool.num_blocks


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, in, out] floats -> MXFP4 as gpt-oss releases store it: blocks [experts, out,
    in / 32, 16] (two E2M1 codes a byte, low nibble first) and scales [experts, out, in / 32]
    (a power of two per 32 values, biased by 127), each value rounded to the nearest code."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weight.transpose(1, 2).reshape(weight.shape[0], weight.shape[2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_equal_transformers_dequantized_reference(tmp_path, saved):
    """A gpt-oss folder whose experts are MXFP4 (quantized here from the random weights) gives
    transformers' greedy over the weights transformers' own MXFP4 dequantizer reads from it."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from splitserve.platform.weights.mxfp4 import dequantize

    tmp_path, model = copy_of(saved, "gpt_oss", tmp_path)
    model = copy.deepcopy(model)  # its experts get the dequantized weights
    weights = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        original = weights.pop(name)
        blocks, scales = mxfp4_quantize(original)
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
        reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(dequantize(blocks, scales, torch.float32).transpose(-1, -2), reference)
        assert not torch.equal(reference, original) and (reference - original).abs().max() < 0.2
        model.get_parameter(name).data.copy_(reference)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"quantization_config": {"quant_method": "mxfp4"}}))
    reference = [hf_greedy(model, ids, MAX_TOKENS) for ids in PROMPTS]
    assert [out.output_token_ids for out in engine_for(tmp_path).generate(PROMPTS, GREEDY)] == reference


def test_multi_token_prediction_layers_are_skipped(tmp_path, saved):
    """A release's MTP layer (model.layers.<num_hidden_layers>) is in the file but not loaded."""
    from safetensors.torch import load_file, save_file

    tmp_path, model = copy_of(saved, "glm4_moe", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    [out] = engine_for(tmp_path).generate([PROMPTS[2]], GREEDY)
    assert out.output_token_ids == hf_greedy(model, PROMPTS[2], MAX_TOKENS)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("glm4_moe", {"model_type": "glm5_moe"}, "model_type 'glm5_moe' is not supported"),
        ("deepseek_v3", {"index_topk": 2048}, "index_topk=2048 .DeepSeek-V3.2's sparse attention"),
        ("deepseek_v3", {"model_type": "deepseek_v32"}, "model_type 'deepseek_v32' is not supported"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported; supported: 'sigmoid'"),
        ("kimi_k2", {"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8' is not supported"),
        ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("gpt_oss", {"quantization_config": {"quant_method": "bitsandbytes"}}, "supported: none, mxfp4"),
        ("gpt_oss", {"rope_parameters": {"rope_type": "longrope"}}, "RoPE type 'longrope' is not supported"),
    ],
)
def test_config_fields_the_engine_cannot_honour_are_named(tmp_path, saved, name, change, message):
    tmp_path, _ = copy_of(saved, name, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_config(resolve_model(str(tmp_path)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(device=DeviceConfig(dtype="float32", quantization="int8")), "quantization 'int8' is not supported"),
        (dict(lora=LoraConfig(modules=(("a", "/nowhere"),))), "does not run LoRA adapters; remove --lora-modules"),
        (dict(speculative=SpeculativeConfig()), "does not run speculative decoding"),
        (
            dict(device=DeviceConfig(device="cuda", dtype="bfloat16")),
            "does not run decode CUDA graphs yet; pass --enforce-eager",
        ),
    ],
)
def test_features_a_family_cannot_run_are_refused_at_start(saved, change, message):
    folder, _ = saved("gpt_oss")
    with pytest.raises(ConfigError, match=f"gpt_oss {message}|gpt_oss runs .*{message}"):
        LLMEngine(EngineConfig(model=str(folder), cache=CacheConfig(num_blocks=96), **change))


def test_auto_quantization_runs_the_reference_and_adapters_are_refused(family):
    """`--quantization auto` (the workers' default) serves these families in the model dtype:
    the same tokens as "none"; a runtime adapter load is refused, naming the family."""
    from splitserve.platform.lora.adapter import AdapterError

    name, folder, _, reference = family
    engine = engine_for(folder, quantization="auto")
    assert engine.quantization == "none"
    assert engine.generate([PROMPTS[3]], GREEDY)[0].output_token_ids == reference[3]
    with pytest.raises(AdapterError, match=f"{engine.model_config.architecture} does not run LoRA adapters"):
        engine.loras.add("a", str(folder))
