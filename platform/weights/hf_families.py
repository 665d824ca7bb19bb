"""config.json of the 2026 families: GLM-4.5 (`glm4_moe`), gpt-oss (`gpt_oss`) and DeepSeek-V3
(`deepseek_v3`; Kimi K2's `kimi_k2` is the same architecture with more experts).

`family_options(folder, raw)` gives the ModelConfig fields that differ from the common ones
hf.py reads, after refusing every setting the engine cannot honour, by name:
- a `quantization_config` other than gpt-oss's MXFP4 experts (DeepSeek-V3's and GLM-4.5's FP8
  releases need a block-scaled FP8 loader the engine does not have; weights/mxfp4.py reads
  MXFP4);
- DeepSeek-V3.2's sparse attention (`index_topk`, `index_n_heads`, `index_head_dim`): its
  indexer picks the keys each query sees, which dense attention would not reproduce;
- DeepSeek's routing other than `scoring_func: sigmoid` with `topk_method: noaux_tc`, and
  attention biases (no released checkpoint has them);
- an activation other than SiLU.
Multi-token-prediction layers (`num_nextn_predict_layers`: GLM-4.5, DeepSeek-V3) are stored as
extra decoder layers past `num_hidden_layers`; they are only for speculative decoding, which
the engine does not run with them, so hf.py skips their tensors at load.
"""

from __future__ import annotations

from typing import Any

from splitserve.platform.errors import UnsupportedModelError

# model_type -> ModelConfig.architecture
FAMILY_MODEL_TYPES = {
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
# config.json fields that change the computation in a way the engine does not implement
_UNHONOURED = {
    "index_topk": "DeepSeek-V3.2's sparse attention (its indexer)",
    "index_n_heads": "DeepSeek-V3.2's sparse attention (its indexer)",
    "index_head_dim": "DeepSeek-V3.2's sparse attention (its indexer)",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
}


def check_family_options(folder: str, raw: dict[str, Any]) -> None:
    """Refuse, naming the field, a config the engine would not compute exactly."""
    model_type = raw["model_type"]
    for name, what in _UNHONOURED.items():
        if raw.get(name) is not None:
            raise UnsupportedModelError(f"{folder}: {name}={raw[name]!r} ({what}) is not supported for {model_type}")
    quant = raw.get("quantization_config")
    if quant is not None and not (model_type == "gpt_oss" and quant.get("quant_method") == "mxfp4"):
        raise UnsupportedModelError(
            f"{folder}: quantization_config with quant_method {quant.get('quant_method')!r} is not supported for "
            f"{model_type}; supported: none{', mxfp4' if model_type == 'gpt_oss' else ''} (dequantize the "
            "checkpoint to bfloat16 first)"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{folder}: hidden_act {raw['hidden_act']!r} is not supported; supported: 'silu'")
    if FAMILY_MODEL_TYPES[model_type] == "deepseek_v3":
        _check_deepseek(folder, raw)


def _check_deepseek(folder: str, raw: dict[str, Any]) -> None:
    for name, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, allowed) != allowed:
            raise UnsupportedModelError(f"{folder}: {name}={raw[name]!r} is not supported; supported: {allowed!r}")
    if raw.get("attention_bias"):
        raise UnsupportedModelError(f"{folder}: attention_bias=true is not supported for deepseek_v3")


def family_options(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a checked 2026-family config.json (over hf.py's common ones)."""
    architecture = FAMILY_MODEL_TYPES[raw["model_type"]]
    if architecture == "gpt_oss":
        return dict(
            attention_bias=True,
            num_experts=int(raw["num_local_experts"]),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or raw["experts_per_token"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        )
    options = dict(
        num_experts=int(raw.get("n_routed_experts") or raw.get("num_local_experts")),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
    )
    if architecture == "glm4_moe":
        params = raw.get("rope_parameters") or {}
        options.update(
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=bool(raw.get("use_qk_norm", False)),
            partial_rotary_factor=float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))),
        )
        return options
    latent = int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])
    options.update(
        kv_lora_rank=int(raw["kv_lora_rank"]),
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        num_kv_heads=1,
        head_dim=latent // 2,
    )
    return options


def is_extra_layer(name: str, num_layers: int) -> bool:
    """True for a tensor of a multi-token-prediction layer (`model.layers.<n>.` with n past the
    decoder's layers), which the engine does not load."""
    if not name.startswith("model.layers."):
        return False
    return int(name.split(".", 3)[2]) >= num_layers
