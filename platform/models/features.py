"""What a model family can run beside plain generation, decided once at engine start.

The 2026 families (GLM-4.5, gpt-oss, DeepSeek-V3) are checked against transformers on the
torch path only: weights in the model dtype, eager steps. So for them, at start:
- `--quantization auto` means "none"; a packed mode by name (int4, w4a8, ...) is refused: the
  packed kernels serve Llama-shaped linears, and these families' experts, latent projections
  and sinks would stay unpacked or be computed differently;
- LoRA adapters are refused (`--lora-modules` at start, and any runtime load): the adapters
  target Llama's q/k/v/o and MLP projections, which MLA and gpt-oss's stacked experts do not
  have, and no family here has been checked against PEFT;
- speculative decoding is refused: its verification step runs the drafted tokens as a prefill
  chunk, never compared with the reference for these families;
- on CUDA, decode CUDA graphs are refused (pass --enforce-eager): never captured or checked on
  a GPU for these families.
Structured output, prefix caching, P/D, the KV pull and the KV tier work: they act on logits
and on KV blocks, whatever computes them. Refusing is a ConfigError naming the family and
the flag, never a silent fallback.
"""

from __future__ import annotations

from splitserve.platform.config import EngineConfig, ModelConfig
from splitserve.platform.errors import ConfigError

TORCH_ONLY_FAMILIES = ("glm4_moe", "gpt_oss", "deepseek_v3")


def family_quantization(model: ModelConfig, config: EngineConfig, quantization: str) -> str:
    """The quantization `model` runs in given the resolved `quantization`; ConfigError for a
    feature the family cannot run (module docstring)."""
    family = model.architecture
    if family not in TORCH_ONLY_FAMILIES:
        return quantization
    requested = config.device.quantization
    if requested not in ("none", "auto"):
        raise ConfigError(
            f"{family} runs its weights in the model dtype only; quantization {requested!r} is not supported "
            "(allowed: none, auto)"
        )
    if config.lora.modules:
        raise ConfigError(f"{family} does not run LoRA adapters; remove --lora-modules")
    if config.speculative is not None:
        raise ConfigError(f"{family} does not run speculative decoding; remove --speculative-config")
    if config.device.device != "cpu" and not config.device.enforce_eager:
        raise ConfigError(f"{family} does not run decode CUDA graphs yet; pass --enforce-eager")
    return "none"


def lora_refusal(model: ModelConfig) -> str | None:
    """Why adapters cannot be loaded for `model` at run time, or None when they can."""
    if model.architecture in TORCH_ONLY_FAMILIES:
        return f"{model.architecture} does not run LoRA adapters"
    return None
