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

from splitserve.platform.models.sigmoid_moe import SigmoidMoeForCausalLM


class Glm4MoeForCausalLM(SigmoidMoeForCausalLM):
    """GLM-4.5: the module docstring."""
