"""Model families, by ModelConfig.architecture."""

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.llama import LlamaForCausalLM
from splitserve.platform.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}


def build_model(config: ModelConfig, quantization: str = "none") -> LlamaForCausalLM:
    """An uninitialised model for `config` (weights come from load_weights); `quantization` is
    "none" or a fast mode of platform/quant, already resolved (never "auto" for a non-CPU device)."""
    return MODEL_CLASSES[config.architecture](config, quantization)
