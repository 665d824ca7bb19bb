"""Mistral: the Llama block with sliding-window attention on every layer (ModelConfig.layer_types).

Served at its full `max_position_embeddings`: each layer sees the last `sliding_window` keys,
as the reference does, rather than capping the context at the window.
"""

from splitserve.platform.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; the window comes from the config, layer by layer."""
