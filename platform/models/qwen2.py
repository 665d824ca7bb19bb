"""Qwen2: the Llama block with biases on the q/k/v projections (ModelConfig.attention_bias)."""

from splitserve.platform.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; the config's attention_bias=True gives qkv_proj its bias."""
