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
from family_folders import FAMILIES, MAX_TOKENS, PROMPTS, save_family
from gguf_reference import hf_greedy
from test_disaggregation_engine import disaggregated

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, SpeculativeConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.model_source import resolve_model
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.weights import load_model_config

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)


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


@pytest.mark.parametrize("preset", ["tiny-glm4-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
def test_random_presets_generate(preset):
    """`random:<preset>` (weights/presets.py) builds each family from its config alone."""
    engine = LLMEngine(EngineConfig(model=f"random:{preset}", cache=CacheConfig(num_blocks=160)))
    [out] = engine.generate([PROMPTS[5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.output_token_ids) == 4 and engine.model_config.architecture == preset[5:].replace("-", "_")


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
