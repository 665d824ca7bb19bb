"""Model families, by ModelConfig.architecture: one small file per family over the shared
Llama block (llama.py), layers (layers.py), attention (attention.py) and experts (moe.py)."""

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.deepseek_v3 import DeepseekV3ForCausalLM
from splitserve.platform.models.gemma3 import Gemma3ForCausalLM
from splitserve.platform.models.glm4_moe import Glm4MoeForCausalLM
from splitserve.platform.models.gpt_oss import GptOssForCausalLM
from splitserve.platform.models.llama import LlamaForCausalLM
from splitserve.platform.models.mistral import MistralForCausalLM
from splitserve.platform.models.mixtral import MixtralForCausalLM
from splitserve.platform.models.phi3 import Phi3ForCausalLM
from splitserve.platform.models.qwen2 import Qwen2ForCausalLM
from splitserve.platform.models.qwen3 import Qwen3ForCausalLM
from splitserve.platform.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}


def build_model(config: ModelConfig, quantization: str = "none") -> LlamaForCausalLM:
    """An uninitialised model for `config` (weights come from load_weights); `quantization` is
    "none" or a fast mode of platform/quant, already resolved (never "auto" for a non-CPU device)."""
    return MODEL_CLASSES[config.architecture](config, quantization)
