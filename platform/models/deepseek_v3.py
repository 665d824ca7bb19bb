"""DeepSeek-V3 and Kimi K2 (`DeepseekV3ForCausalLM`; Kimi K2 is the same graph with 384
experts, one expert group and 64 heads): Llama's pre-norm block with multi-head latent
attention (models/mla.py: the KV cache holds one latent entry per token, attention runs in the
latent space) and, from layer first_k_dense_replace on, sigmoid group-limited experts plus a
shared expert (models/sigmoid_moe.py). Rotary (YaRN in the releases) turns the
qk_rope_head_dim dimensions of q and k only. The multi-token-prediction layer of the release
is not loaded (weights/hf_families.py).
"""

from __future__ import annotations

import re

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.mla import MlaAttention
from splitserve.platform.models.sigmoid_moe import SigmoidMoeDecoderLayer, SigmoidMoeForCausalLM

_Q_PROJ = re.compile(r"(model\.layers\.\d+\.self_attn)\.q_proj\.weight$")


class DeepseekV3DecoderLayer(SigmoidMoeDecoderLayer):
    ATTENTION = MlaAttention


class DeepseekV3ForCausalLM(SigmoidMoeForCausalLM):
    DECODER_LAYER = DeepseekV3DecoderLayer

    @staticmethod
    def rotary_width(config: ModelConfig) -> int:
        return config.qk_rope_head_dim

    def own_name(self, name: str) -> str:
        """Without q_lora_rank the checkpoint's `q_proj` is MlaAttention's `q_dense` (Llama's
        loader would take `q_proj` for a fused q|k|v)."""
        return _Q_PROJ.sub(r"\1.q_dense.weight", name)
