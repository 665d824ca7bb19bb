"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): Llama's block with three changes, each as the
reference computes it:
- rotary turns only the first partial_rotary_factor (0.5) of each head, in the rotate-half
  layout over those dimensions; the rest of the head passes through (layers.apply_rotary);
- q/k/v biases, and RMSNorm over each head of q and k before rotary where `use_qk_norm` is set;
- from layer first_k_dense_replace on, the MLP is sigmoid-routed experts plus shared experts
  (models/sigmoid_moe.py); the first layers keep a dense SwiGLU MLP.
The multi-token-prediction layer of the release is not loaded (weights/hf_families.py).
"""

from __future__ import annotations

from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.block import FamilyDecoderLayer
from splitserve.platform.models.llama import LlamaForCausalLM
from splitserve.platform.models.sigmoid_moe import SHARED_NAME, SigmoidMoeBlock
from splitserve.platform.models.yarn import rotary_for


class SigmoidMoeDecoderLayer(FamilyDecoderLayer):
    """The shared block with a SigmoidMoeBlock on the sparse layers, a dense MLP before them."""

    def mlp_for(self, config: ModelConfig, quantization: str, layer: int) -> nn.Module:
        if config.is_moe_layer(layer):
            return SigmoidMoeBlock(config, quantization)
        return super().mlp_for(config, quantization, layer)


class SigmoidMoeForCausalLM(LlamaForCausalLM):
    """The loading both sigmoid-routed families share: shared-expert tensors, rotary table."""

    DECODER_LAYER = SigmoidMoeDecoderLayer

    def __init__(self, config: ModelConfig, quantization: str = "none"):
        super().__init__(config, quantization)
        self.rotary = rotary_for(config, self.rotary_width(config))

    @staticmethod
    def rotary_width(config: ModelConfig) -> int:
        return config.rotary_dim

    def _load_one(self, name, tensor, params):
        m = SHARED_NAME.match(name)
        if m is None:
            return super()._load_one(name, tensor, params)
        layer, proj = m.groups()
        return [f"layers.{layer}.mlp." + self.layers[int(layer)].mlp.load_shared(proj, tensor)]


class Glm4MoeForCausalLM(SigmoidMoeForCausalLM):
    """GLM-4.5: the module docstring."""
