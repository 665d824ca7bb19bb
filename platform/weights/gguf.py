"""Llama, Qwen2 and Gemma 3 models from a GGUF file: ModelConfig from metadata, tensors in HF layout.

Config: `{arch}.*` metadata keys (arch = `general.architecture`, "llama", "qwen2" or "gemma3"):
block_count, embedding_length, feed_forward_length, attention.head_count(_kv),
attention.key_length (head_dim; default hidden / heads), attention.layer_norm_rms_epsilon,
rope.freq_base, context_length. Vocabulary size = rows of `token_embd.weight`; tied
embeddings = no `output.weight`; end-of-generation ids = tokenizer.ggml.eos_token_id, then
eot/eom ids when present (llama.cpp stops on all of them).

RoPE scaling supported: none; `rope.scaling.type == "linear"` (-> RopeScaling "linear");
Llama-3.1 scaling, which llama.cpp stores as a `rope_freqs.weight` tensor of per-frequency
divisors (-> RopeScaling "llama3", see rope_freqs.py). YaRN and others are rejected.

Tensors: GGUF names map to Hugging Face names (`blk.N.attn_q.weight` ->
`model.layers.N.self_attn.q_proj.weight`, ...) and are dequantized to float32 one at a time
with `gguf.quants.dequantize`. The numpy shape is the ggml shape reversed, which is already HF's
[out_features, in_features].

Gemma 3: tensor names map to its block (`ffn_norm` is the pre-feedforward norm there,
`post_attention_norm`, `post_ffw_norm`, `attn_q_norm`, `attn_k_norm`); norm weights are stored
as 1 + w and come out as w (HF's convention, which transformers' GGUF loader applies too).
What llama.cpp implies rather than stores is filled in as transformers does: every 6th layer
global, the others sliding (`attention.sliding_window`), local rope base 10 000,
query_pre_attn_scalar 256, tanh GELU. No q/k permutation (llama.cpp runs it in NEOX mode).

Q/K un-permutation: for arch "llama", llama.cpp's converter reorders the rows of q_proj and
k_proj within each head from HF's half-split RoPE layout (pairs (j, j + d/2)) to ggml's
interleaved layout (pairs (2j, 2j + 1)):  W.reshape(heads, 2, d/2, in).swapaxes(1, 2).
We apply the inverse, W.reshape(heads, d/2, 2, in).swapaxes(1, 2), so the model uses HF's
rotate_half RoPE (the same as transformers' GGUF loader). Qwen2 is converted without the
permutation (llama.cpp runs it in NEOX mode), so its tensors are taken as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from splitserve.platform.config import ModelConfig, RopeScaling
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.formats.gguf_file import GGUFFile, TensorInfo
from splitserve.platform.quant.formats import RawQuant
from splitserve.platform.weights.rope_freqs import llama3_scaling_from_divisors

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
SUPPORTED_TENSOR_TYPES = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
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
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GEMMA3_GLOBAL_EVERY = 6  # layer i is global when (i + 1) % 6 == 0 (transformers' default)
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # consumed into ModelConfig.rope_scaling, not a weight
_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def load_gguf_config(path: str, model_id: str) -> ModelConfig:
    """Read the ModelConfig of the GGUF file at `path` (header only, no tensor is dequantized)."""
    return config_from_gguf(GGUFFile(path), model_id)


def config_from_gguf(file: GGUFFile, model_id: str) -> ModelConfig:
    arch = _architecture(file)

    def key(name: str, default: Any = None) -> Any:
        value = file.metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"{file.path}: metadata key {arch}.{name} is missing")
        return _uniform(value, f"{arch}.{name}")

    num_heads = key("attention.head_count")
    hidden_size = key("embedding_length")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    _check_head_dims(file, arch, head_dim)
    rope_theta = float(key("rope.freq_base", 10000.0))
    eog = [file.metadata[k] for k in _EOG_KEYS if k in file.metadata]
    return ModelConfig(
        model_id=model_id,
        architecture=arch,
        vocab_size=_tensor_info(file, "token_embd.weight").shape[0],
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(file, arch, rope_theta, head_dim),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias=arch == "qwen2",
        eos_token_ids=tuple(dict.fromkeys(eog)),
        **(_gemma3_options(file, key("block_count")) if arch == "gemma3" else {}),
    )


def _gemma3_options(file: GGUFFile, num_layers: int) -> dict[str, Any]:
    window = file.metadata.get("gemma3.attention.sliding_window")
    if not window:
        raise ConfigError(f"{file.path}: metadata key gemma3.attention.sliding_window is missing")
    types = tuple(
        "full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention" for i in range(num_layers)
    )
    return dict(
        sliding_window=int(window),
        layer_types=types,
        qk_norm=True,
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=GEMMA3_QUERY_PRE_ATTN_SCALAR,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
    )


def iter_gguf_weights(
    path: str, config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu", keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | RawQuant]]:
    """Yield (HF name, tensor in `dtype` on `device`) for every weight, one at a time, file order.

    `keep_quantized`: a 2-D tensor stored in a quantized type comes as a RawQuant (its blocks,
    rows already in HF order) for the fast kernels of platform/quant to pack as they are."""
    file = GGUFFile(path)
    for info in file.tensors.values():
        if info.name == _ROPE_FREQS:
            continue
        hf_name = hf_tensor_name(info.name, config.architecture)
        if keep_quantized and len(info.shape) == 2 and info.tensor_type not in (Q.F32, Q.F16, Q.BF16):
            _check_type(file, info)
            raw = RawQuant(info.tensor_type, np.asarray(file.raw(info.name)), tuple(info.shape))
            if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                num_heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
                raw = raw.permute_rows(unpermute_qk(torch.arange(info.shape[0])[:, None], num_heads)[:, 0])
            yield hf_name, raw
            continue
        weight = torch.from_numpy(dequantize_tensor(file, info))
        if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            num_heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
            weight = unpermute_qk(weight, num_heads)
        if config.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # stored as 1 + w
        yield hf_name, weight.to(device=device, dtype=dtype)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of architecture `arch`; UnsupportedModelError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise UnsupportedModelError(
            f"GGUF tensor {gguf_name!r} is not part of a supported {arch} model "
            f"(supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def dequantize_tensor(file: GGUFFile, info: TensorInfo) -> np.ndarray:
    """The float32 values of tensor `info` in numpy shape, in memory we own (not the mmap)."""
    _check_type(file, info)
    values = dequantize(file.raw(info.name), info.tensor_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    assert values.shape == info.shape, (info.name, values.shape, info.shape)
    return values


def _check_type(file: GGUFFile, info: TensorInfo) -> None:
    if info.tensor_type not in SUPPORTED_TENSOR_TYPES:
        type_name = getattr(info.tensor_type, "name", f"unknown type id {info.tensor_type}")
        raise UnsupportedModelError(
            f"{file.path}: tensor {info.name!r} has type {type_name}; supported types: "
            f"{', '.join(t.name for t in SUPPORTED_TENSOR_TYPES)}"
        )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row order of a q/k projection (see module docstring)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _architecture(file: GGUFFile) -> str:
    arch = file.metadata.get("general.architecture")
    if arch is None:
        raise ConfigError(f"{file.path}: metadata key general.architecture is missing")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{file.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _uniform(value: Any, key: str) -> Any:
    """Some GGUF files store per-layer arrays (e.g. head counts); we need one value for all."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedModelError(
                f"metadata {key} varies per layer ({value[:8]}...); only uniform models are supported"
            )
        return value[0]
    return value


def _check_head_dims(file: GGUFFile, arch: str, head_dim: int) -> None:
    for name in ("attention.value_length", "rope.dimension_count"):
        value = file.metadata.get(f"{arch}.{name}", head_dim)
        if value != head_dim:
            raise UnsupportedModelError(
                f"{file.path}: {arch}.{name} = {value} differs from head_dim {head_dim}; "
                "only models with full-width RoPE and equal key/value head sizes are supported"
            )


def _rope_scaling(file: GGUFFile, arch: str, rope_theta: float, head_dim: int) -> RopeScaling | None:
    scaling_type = file.metadata.get(f"{arch}.rope.scaling.type", "none")
    if _ROPE_FREQS in file.tensors:
        if scaling_type != "none":
            raise UnsupportedModelError(
                f"{file.path}: both {_ROPE_FREQS} and RoPE scaling {scaling_type!r}; only one is supported"
            )
        divisors = dequantize_tensor(file, file.tensors[_ROPE_FREQS])
        original_context = file.metadata.get(f"{arch}.rope.scaling.original_context_length")
        return llama3_scaling_from_divisors(divisors, rope_theta, head_dim, original_context)
    factor = float(file.metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if scaling_type == "none" or (scaling_type == "linear" and factor == 1.0):
        return None
    if scaling_type == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    raise UnsupportedModelError(
        f"{file.path}: RoPE scaling {scaling_type!r} is not supported; supported: none, linear, "
        "llama3 (a rope_freqs.weight tensor)"
    )


def _tensor_info(file: GGUFFile, name: str) -> TensorInfo:
    if name not in file.tensors:
        raise ConfigError(f"{file.path}: tensor {name!r} is missing")
    return file.tensors[name]
