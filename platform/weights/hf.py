"""Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3 and Gemma 3 (text) models from a Hugging Face folder;
GLM-4.5, gpt-oss and DeepSeek-V3 / Kimi K2 through weights/hf_families.py (their fields, what is
refused, multi-token-prediction layers skipped). RoPE also `yarn` (models/yarn.py). Packed uint8
tensors (gpt-oss's MXFP4 `*_blocks` / `*_scales`) pass through unconverted for weights/mxfp4.py.

Config: config.json, as written by transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x
(`rope_parameters`). `eos_token_id` from config.json and generation_config.json together
(Llama-3 instruct stops on several ids that only the latter lists). Rejected: other model
types, activations other than SiLU, Llama's o_proj/MLP biases (`attention_bias` / `mlp_bias`),
RoPE types other than default, linear and llama3.

Sliding-window attention (Mistral, Phi-3, Qwen2/Qwen3 with `use_sliding_window`): the
`layer_types` transformers 5 writes, or, for older files, what transformers derives (every
layer for Mistral and Phi-3; layers from `max_window_layers` on for Qwen). The context stays
`max_position_embeddings`: the window is applied by the attention, never used as a cap.
Mixtral: `num_local_experts` experts of `intermediate_size` on every layer, top-k renormalised.
Qwen3-MoE: `num_experts`, or `num_local_experts` as transformers 5's save_pretrained writes it.
Phi-3: rejected with a clear error when its rope is `longrope` or partial (`partial_rotary_factor`).

Weights: `model.safetensors.index.json`'s weight map when present (sharded checkpoints), else
every `*.safetensors` in the folder. Each tensor is read alone with `safe_open` and converted
to the requested dtype and device before the next one is read. Names are already HF names;
`rotary_emb.inv_freq` buffers (old checkpoints) and a stored `lm_head.weight` of a tied model
are skipped.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from splitserve.platform.config import ModelConfig, RopeScaling
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.parallel.layout import Slices
from splitserve.platform.weights.hf_families import (
    FAMILY_MODEL_TYPES,
    check_family_options,
    family_options,
    is_extra_layer,
)

# model_type -> architecture (ModelConfig.architecture, a family of platform/models)
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
    "mixtral": "mixtral",
    **FAMILY_MODEL_TYPES,
}
INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(folder: str, model_id: str) -> ModelConfig:
    """Read the ModelConfig of the Hugging Face folder `folder` (config.json only)."""
    raw = _read_json(os.path.join(folder, "config.json"))
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{folder}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    is_2026_family = model_type in FAMILY_MODEL_TYPES
    if is_2026_family:
        check_family_options(folder, raw)
    else:
        _check_supported_options(folder, raw)
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(folder, raw)
    fields = dict(
        model_id=model_id,
        architecture=SUPPORTED_MODEL_TYPES[model_type],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",
        eos_token_ids=_eos_token_ids(folder, raw),
        **_windows(raw),
        **_family_options(raw),
    )
    if is_2026_family:
        fields.update(family_options(raw))
    return ModelConfig(**fields)


def iter_hf_weights(
    folder: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    shard: Callable[[str], Slices | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in `dtype` on `device`) for every weight, one at a time.
    `shard` (tensor parallelism): the ranges of each tensor to read; only those bytes are read."""
    for path, names in safetensors_files(folder).items():
        with safe_open(path, framework="pt") as file:
            for name in names:
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if is_extra_layer(name, config.num_layers):
                    continue  # a multi-token-prediction layer (hf_families)
                slices = shard(name) if shard is not None else None
                tensor = file.get_tensor(name) if slices is None else _read_slices(file.get_slice(name), slices)
                if tensor.dtype == torch.uint8:  # packed codes (MXFP4 blocks and scales): weights/mxfp4.py
                    yield name, tensor.to(device=device)
                    continue
                yield name, tensor.to(device=device, dtype=dtype)


def _read_slices(lazy, slices: Slices) -> torch.Tensor:
    """The ranges of a safetensors slice handle along one dimension, concatenated."""
    dim, ranges = slices
    parts = [lazy[start:stop] if dim == 0 else lazy[:, start:stop] for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def safetensors_files(folder: str) -> dict[str, list[str]]:
    """Shard path -> tensor names in it, from the index when sharded, else by listing the files."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        shards: dict[str, list[str]] = {}
        for name, shard in _read_json(index_path)["weight_map"].items():
            shards.setdefault(os.path.join(folder, shard), []).append(name)
        return shards
    paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        raise ConfigError(
            f"{folder}: no *.safetensors file; convert .bin checkpoints with transformers' save_pretrained"
        )
    shards = {}
    for path in paths:
        with safe_open(path, framework="pt") as file:
            shards[path] = list(file.keys())
    return shards


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def _check_supported_options(folder: str, raw: dict[str, Any]) -> None:
    if raw.get("model_type") == "gemma3_text":
        act = raw.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"{folder}: hidden_activation {act!r} is not supported; supported: gelu_pytorch_tanh"
            )
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(cap) is not None:
                raise UnsupportedModelError(f"{folder}: {cap}={raw[cap]} is not supported; supported: null")
    elif raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{folder}: hidden_act {raw['hidden_act']!r} is not supported; supported: 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get("model_type") != "qwen2" and raw.get(flag):
            raise UnsupportedModelError(f"{folder}: {flag}=true is not supported for {raw['model_type']}")
    params = _global_rope_params(raw)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(
            f"{folder}: partial_rotary_factor={partial} is not supported; supported: 1.0 (rotary over the whole head)"
        )


def _global_rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters`, or its "full_attention" entry where it is given per layer type (Gemma 3)."""
    params = raw.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _rope(folder: str, raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(_global_rope_params(raw) or raw.get("rope_scaling") or {})
    rope_theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "linear":
        return rope_theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        return rope_theta, _yarn(params)
    if rope_type == "llama3":
        return rope_theta, RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(
        f"{folder}: RoPE type {rope_type!r} is not supported; supported: default, linear, llama3, yarn"
    )


def _yarn(params: dict[str, Any]) -> RopeScaling:
    attention_factor = params.get("attention_factor")
    return RopeScaling(
        rope_type="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _windows(raw: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as transformers applies them (see the module docstring)."""
    window = raw.get("sliding_window")
    num_layers = raw["num_hidden_layers"]
    model_type = raw.get("model_type")
    if not window:
        return {}
    if raw.get("layer_types"):
        types = tuple(raw["layer_types"])
    elif model_type in ("mistral", "phi3", "mixtral"):
        types = ("sliding_attention",) * num_layers
    elif raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", num_layers)
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    else:
        return {}
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(window), "layer_types": types}


def _family_options(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields only some families have: q/k norm (Qwen3) and the experts (Qwen3-MoE)."""
    model_type = raw.get("model_type")
    options: dict[str, Any] = {}
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        options["qk_norm"] = True
    if model_type == "mixtral":  # every layer sparse, always renormalised, experts as wide as intermediate_size
        options.update(
            num_experts=int(raw["num_local_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
    if model_type == "gemma3_text":
        local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
        options.update(
            hidden_act="gelu_tanh",
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))),
        )
    if model_type == "qwen3_moe":
        options.update(
            num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        )
    return options


def _eos_token_ids(folder: str, raw: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    generation_path = os.path.join(folder, "generation_config.json")
    sources = [raw] + ([_read_json(generation_path)] if os.path.isfile(generation_path) else [])
    for source in sources:
        value = source.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(dict.fromkeys(ids))
