"""Weight loading: GGUF (real SmolLM2 file and hand-written tiny files), HF folders, random presets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from splitserve.platform.config import ModelConfig, RopeScaling
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.model_source import ModelSource, resolve_model
from splitserve.platform.weights import PRESETS, expected_weight_shapes, iter_weights, load_model_config
from splitserve.platform.weights.rope_freqs import llama3_divisors

QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)  # gguf can write these
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf can only read these
# Byte offsets of the float16 scale fields (d, dmin) inside one 256-element K-quant block.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Worst-case |dequantized - original| for normal(0, 1) data, per type (loose: catches garbage).
QUANT_TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-2,
    Q.BF16: 5e-2,
    Q.Q8_0: 0.05,
    Q.Q5_0: 0.3,
    Q.Q5_1: 0.3,
    Q.Q4_0: 0.6,
    Q.Q4_1: 0.6,
}

# A one-layer llama whose every row is one K-quant block long (256 elements).
TINY = dict(hidden=256, intermediate=256, vocab=64, heads=4, kv_heads=2, head_dim=64)


# -- helpers: write GGUF files the way llama.cpp's converter does --------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF half-split RoPE rows -> interleaved rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_tiny_weights(arch: str, tied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values in HF layout ([out, in]) for the TINY shape."""
    h, i, v = TINY["hidden"], TINY["intermediate"], TINY["vocab"]
    q, kv = TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"]
    shapes = {
        "token_embd.weight": (v, h),
        "output_norm.weight": (h,),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.attn_q.weight": (q, h),
        "blk.0.attn_k.weight": (kv, h),
        "blk.0.attn_v.weight": (kv, h),
        "blk.0.attn_output.weight": (h, q),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.ffn_gate.weight": (i, h),
        "blk.0.ffn_up.weight": (i, h),
        "blk.0.ffn_down.weight": (h, i),
    }
    if not tied:
        shapes["output.weight"] = (v, h)
    if arch == "qwen2":
        shapes.update({"blk.0.attn_q.bias": (q,), "blk.0.attn_k.bias": (kv,), "blk.0.attn_v.bias": (kv,)})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def random_k_quant_bytes(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant bytes: random quants and sub-scales, finite float16 super-block scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


def write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], metadata: dict | None = None) -> None:
    """A GGUF with the TINY shape; `tensors`: name -> (stored array, ggml type)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["intermediate"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def stored_tensor(name: str, values: np.ndarray, qtype: Q, arch: str, rng) -> np.ndarray:
    """What the converter stores for HF `values`: permuted q/k for llama, then quantized."""
    if arch == "llama" and name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        values = llama_cpp_permute(values, TINY["heads"] if "attn_q" in name else TINY["kv_heads"])
    if values.ndim == 1:
        return values  # norms and biases stay float32, as in real files
    if qtype in K_QUANTS:
        return random_k_quant_bytes(qtype, values.shape, rng)
    return quantize(values, qtype)


def load_all(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    source = ModelSource(model_id="tiny.gguf", kind="gguf", path=str(path))
    config = load_model_config(source)
    return config, dict(iter_weights(source, config, torch.float32))


def gguf_to_hf_name(name: str) -> str:
    table = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    if name in table:
        return table[name]
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{table[part]}.{kind}"


def unpermute_reference(stored: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama_cpp_permute by index bookkeeping (independent of the loader's reshape)."""
    where = llama_cpp_permute(np.arange(stored.shape[0]), num_heads)  # stored row r holds HF row where[r]
    restored = np.empty_like(stored)
    restored[where] = stored
    return restored


# -- the real SmolLM2 file ------------------------------------------------------------------------


def test_smollm2_config(smollm2_gguf_path):
    config = load_model_config(resolve_model("smollm2-135m"))
    assert config == ModelConfig(
        model_id="smollm2-135m",
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(2,),
    )


@pytest.fixture(scope="module")
def smollm2_transformers_state(hf_smollm2):
    """transformers' own tensors from the same GGUF (the session's reference model, read only)."""
    return hf_smollm2[0].state_dict()


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_transformers_state):
    source = resolve_model("smollm2-135m")
    config = load_model_config(source)
    names = []
    for name, tensor in iter_weights(source, config, torch.float32):
        reference = smollm2_transformers_state[name]
        assert tensor.dtype == torch.float32 and tensor.shape == reference.shape, name
        assert (tensor - reference).abs().max().item() == 0.0, name
        names.append(name)
    assert len(names) == 272
    assert set(names) == set(smollm2_transformers_state) - {"lm_head.weight"}


# -- hand-written GGUF files ----------------------------------------------------------------------


def test_bf16_is_the_rounded_fp32(tmp_path):
    rng = np.random.default_rng(7)
    values = hf_tiny_weights("llama", tied=True, rng=rng)
    write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {
            name: (stored_tensor(name, v, Q.Q4_K, "llama", rng), Q.Q4_K if v.ndim == 2 else Q.F32)
            for name, v in values.items()
        },
    )
    source = ModelSource(model_id="m", kind="gguf", path=str(tmp_path / "m.gguf"))
    config = load_model_config(source)
    fp32 = dict(iter_weights(source, config, torch.float32))
    bf16 = dict(iter_weights(source, config, torch.bfloat16))
    assert list(fp32) == list(bf16)
    for name, weight in bf16.items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, fp32[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_every_supported_type_dequantizes(tmp_path, qtype):
    rng = np.random.default_rng(0)
    values = hf_tiny_weights("llama", tied=False, rng=rng)
    stored = {name: stored_tensor(name, v, qtype, "llama", rng) for name, v in values.items()}
    types = {name: (qtype if array.ndim == 2 or qtype == Q.F32 else Q.F32) for name, array in stored.items()}
    write_gguf(tmp_path / "m.gguf", "llama", {name: (stored[name], types[name]) for name in stored})
    config, loaded = load_all(tmp_path / "m.gguf")
    assert len(loaded) == len(values)
    for name, array in stored.items():
        expected = dequantize(array, types[name]).reshape(values[name].shape)
        if name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            expected = unpermute_reference(expected, TINY["heads"] if "attn_q" in name else TINY["kv_heads"])
        got = loaded[gguf_to_hf_name(name)].numpy()
        np.testing.assert_array_equal(got, expected, err_msg=name)
        if qtype in QUANT_TOLERANCE:  # we also know the values before quantization
            assert np.abs(got - values[name]).max() <= QUANT_TOLERANCE[qtype], name


def test_llama_qk_rows_are_unpermuted_exactly(tmp_path):
    rng = np.random.default_rng(1)
    values = hf_tiny_weights("llama", tied=True, rng=rng)
    write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {name: (stored_tensor(name, v, Q.F32, "llama", rng), Q.F32) for name, v in values.items()},
    )
    config, loaded = load_all(tmp_path / "m.gguf")
    assert config.tie_word_embeddings and "lm_head.weight" not in loaded
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[gguf_to_hf_name(name)].numpy(), value, err_msg=name)


def test_qwen2_is_not_permuted_and_has_biases(tmp_path):
    rng = np.random.default_rng(2)
    values = hf_tiny_weights("qwen2", tied=False, rng=rng)
    write_gguf(tmp_path / "m.gguf", "qwen2", {name: (v, Q.F32) for name, v in values.items()})
    config, loaded = load_all(tmp_path / "m.gguf")
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, False)
    assert (config.head_dim, config.num_kv_heads, config.vocab_size) == (64, 2, 64)
    assert set(loaded) == set(expected_weight_shapes(config))
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[gguf_to_hf_name(name)].numpy(), value, err_msg=name)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    rng = np.random.default_rng(3)
    values = hf_tiny_weights("llama", tied=True, rng=rng)
    tensors = {name: (v, Q.F32) for name, v in values.items()}
    block_size, type_size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    tensors["blk.0.ffn_up.weight"] = (np.zeros((256, 256 // block_size * type_size), np.uint8), Q.IQ2_XXS)
    write_gguf(tmp_path / "m.gguf", "llama", tensors)
    source = ModelSource(model_id="m", kind="gguf", path=str(tmp_path / "m.gguf"))
    config = load_model_config(source)
    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.ffn_up\.weight' has type IQ2_XXS; supported types: F32"):
        list(iter_weights(source, config, torch.float32))


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_unsupported_architecture_is_named(tmp_path, arch):
    write_gguf(tmp_path / "m.gguf", arch, {"token_embd.weight": (np.zeros((64, 256), np.float32), Q.F32)})
    with pytest.raises(
        UnsupportedModelError, match=rf"architecture '{arch}' is not supported; supported: llama, qwen2"
    ):
        load_model_config(ModelSource(model_id="m", kind="gguf", path=str(tmp_path / "m.gguf")))


def test_missing_tensor_is_reported(tmp_path):
    values = hf_tiny_weights("llama", tied=True, rng=np.random.default_rng(4))
    del values["blk.0.ffn_up.weight"]
    write_gguf(tmp_path / "m.gguf", "llama", {name: (v, Q.F32) for name, v in values.items()})
    with pytest.raises(ConfigError, match=r"1 weight\(s\) missing, first: model\.layers\.0\.mlp\.up_proj\.weight"):
        load_all(tmp_path / "m.gguf")


def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path):
    values = hf_tiny_weights("llama", tied=True, rng=np.random.default_rng(5))
    scaling = RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    divisors = llama3_divisors(scaling, 500000.0, TINY["head_dim"]).astype(np.float32)
    assert ((divisors > 1) & (divisors < 8)).sum() >= 2  # the smoothed band is present
    tensors = {name: (v, Q.F32) for name, v in values.items()} | {"rope_freqs.weight": (divisors, Q.F32)}
    write_gguf(tmp_path / "m.gguf", "llama", tensors)
    config, loaded = load_all(tmp_path / "m.gguf")
    assert config.rope_scaling == scaling
    assert len(loaded) == len(values)  # rope_freqs is configuration, not a weight


def test_linear_and_unsupported_rope_scaling_keys(tmp_path):
    from gguf import GGUFValueType as V

    values = {name: (v, Q.F32) for name, v in hf_tiny_weights("llama", True, np.random.default_rng(6)).items()}
    write_gguf(
        tmp_path / "linear.gguf",
        "llama",
        values,
        {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (4.0, V.FLOAT32)},
    )
    config, _ = load_all(tmp_path / "linear.gguf")
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    write_gguf(tmp_path / "yarn.gguf", "llama", values, {"llama.rope.scaling.type": ("yarn", V.STRING)})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn' is not supported"):
        load_all(tmp_path / "yarn.gguf")


# -- Hugging Face folders -------------------------------------------------------------------------


def save_hf_model(folder, model_type: str, max_shard_size: str = "5GB", **overrides):
    transformers = pytest.importorskip("transformers")
    kwargs = (
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
        )
        | overrides
    )
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them distinguishable
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_()
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return model.state_dict()


def load_folder(folder) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    source = resolve_model(str(folder))
    assert source.kind == "hf"
    config = load_model_config(source)
    return config, dict(iter_weights(source, config, torch.float32))


def assert_same_tensors(loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor], tied: bool) -> None:
    assert set(loaded) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name]), name


def test_hf_llama_folder_with_llama3_rope(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    state = save_hf_model(tmp_path, "llama", rope_parameters=rope, head_dim=16, tie_word_embeddings=False)
    config, loaded = load_folder(tmp_path)
    assert config == ModelConfig(
        model_id=str(tmp_path),
        architecture="llama",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 256),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_ids=(2,),
    )
    assert_same_tensors(loaded, state, tied=False)


def test_hf_qwen2_folder_tied_with_biases(tmp_path):
    state = save_hf_model(tmp_path, "qwen2", tie_word_embeddings=True, rope_theta=1000000.0)
    config, loaded = load_folder(tmp_path)
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, True)
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (8, 1000000.0, None)
    assert "model.layers.1.self_attn.k_proj.bias" in loaded
    assert_same_tensors(loaded, state, tied=True)


def test_hf_sharded_checkpoint(tmp_path):
    state = save_hf_model(tmp_path, "llama", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _, loaded = load_folder(tmp_path)
    assert_same_tensors(loaded, state, tied=False)


def test_hf_mistral_keeps_its_full_context_with_the_window_per_layer(tmp_path):
    save_hf_model(tmp_path, "mistral", sliding_window=128, max_position_embeddings=4096)
    config, _ = load_folder(tmp_path)
    assert (config.architecture, config.max_position_embeddings, config.sliding_window) == ("mistral", 4096, 128)
    assert config.layer_types == ("sliding_attention",) * 2
    assert [config.layer_window(i) for i in range(2)] == [128, 128]


def test_hf_partial_rotary_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "phi3", "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.75}}'
    )
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.75 is not supported; supported: 1.0"):
        load_model_config(resolve_model(str(tmp_path)))


def test_hf_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(
        UnsupportedModelError,
        match="model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, qwen3_moe, phi3",
    ):
        load_model_config(resolve_model(str(tmp_path)))


def test_hf_eos_ids_merge_generation_config(tmp_path):
    save_hf_model(tmp_path, "llama", eos_token_id=2)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 2, 7]}')
    config, _ = load_folder(tmp_path)
    assert config.eos_token_ids == (2, 5, 7)


# -- random presets -------------------------------------------------------------------------------


def test_random_tiny_shapes_values_and_seed():
    source = resolve_model("random:tiny")
    config = load_model_config(source)
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.head_dim) == (49152, 64, 2, 16)
    first = dict(iter_weights(source, config, torch.float32))
    assert {name: tuple(t.shape) for name, t in first.items()} == expected_weight_shapes(config)
    assert list(first)[:3] == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    assert torch.equal(first["model.norm.weight"], torch.ones(64))
    assert abs(first["model.embed_tokens.weight"].std().item() - 0.02) < 0.001
    again = dict(iter_weights(source, config, torch.float32))
    other = dict(iter_weights(source, config, torch.float32, seed=1))
    for name in first:
        assert torch.equal(first[name], again[name]), name
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_random_tiny_qwen2_bf16():
    source = resolve_model("random:tiny-qwen2")
    config = load_model_config(source)
    weights = dict(iter_weights(source, config, torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert weights["model.layers.1.self_attn.v_proj.bias"].shape == (32,)
    assert weights["model.layers.1.self_attn.v_proj.bias"].abs().max().item() > 0
    assert "lm_head.weight" in weights


def test_random_llama3_8b_config_and_shapes_without_materialising():
    config = load_model_config(resolve_model("random:llama-3-8b"))
    assert config == ModelConfig(
        model_id="random:llama-3-8b",
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        eos_token_ids=(128001, 128008, 128009),
    )
    shapes = expected_weight_shapes(config)
    assert len(shapes) == 1 + 32 * 9 + 2
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert sum(math.prod(shape) for shape in shapes.values()) == 8_030_261_248  # Meta's published count


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_a_valid_config(preset):
    config = load_model_config(resolve_model(f"random:{preset}"))
    assert config.num_heads * config.head_dim > 0 and config.model_id == f"random:{preset}"


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match=r"unknown random preset 'huge'; allowed: tiny, tiny-qwen2, smollm2-135m"):
        load_model_config(resolve_model("random:huge"))
