"""Weights kept in the form they are served in (`--quantization`).

Modes (vLLM's flag name; the fast modes are ours):

- `none`  dequantize every weight to the model dtype (float32 by default): the bit-faithful
          reference every fidelity test compares against.
- `int4`  every linear on packed 4-bit weights with one scale and zero per group of 32 inputs
          (GGUF Q4_0/Q4_1 are that format exactly; other types are re-quantized), float32
          activations (kernels/cpu_ops.c; torch's packed kernel in bfloat16 without a compiler):
          the float32 model on these weights.
- `w4a16` the same weights times activations held as two int8 digits per group of 32 (16-bit
          precision), integer dot products in 16-row tiles (kernels/cpu_a8.c, quant/a8.py); the
          LM head is the int8 table over int8 activations. `auto` takes it for 4-bit files.
- `w4a8`  the same with one int8 digit (llama.cpp's arithmetic): prefills in two thirds of the
          time, batches of 8-32 in ~85 %; within the logit gates on SmolLM2, but its greedy
          answers leave transformers' on 5 of 8 prompts within 64 tokens, so auto does not take
          it (quant/a8.py).
- `int8`  every linear on int8 weights with one scale per output row, bfloat16 activations,
          `_weight_int8pack_mm`.
- `fp16`  every linear on float16 weights prepacked for fbgemm (`linear_dynamic_fp16`), float32
          activations and outputs.
- `auto`  each linear in the fast format nearest its stored type (kernels.nearest_kernel):
          Q4_x/Q3_K/Q2_K -> w4a16 (int4 where the CPU kernels cannot be built), Q5_x/Q6_K/Q8_0 ->
          int8, F16/BF16/F32 -> fp16; `none` where the host lacks AVX2 or the device is not a CPU.
          A family may build it as `auto-exact` instead (Gemma 3): every linear in the kernel that
          keeps the file's codes, Q4_x/Q4_K -> w4a16, Q5_0/Q8_0 -> `w8a16` (int8 groups, two-digit
          activations), others fp16 (kernels.exact_kernel); not a --quantization value.

In every fast mode the embedding table is int8 with a float scale per group of 32 (GGUF Q8_0
exactly); the LM head reads that table (kernels.build_head). Each fast mode is held to the
fidelity gates in tests/platform/test_quantization.py.
"""

from __future__ import annotations

QUANTIZATION_MODES = ("none", "auto", "int4", "w4a16", "w4a8", "int8", "fp16")


def resolve_quantization(requested: str, device: str) -> str:
    """The mode a model is built with: "auto" becomes "none" off the CPU or without AVX2."""
    if requested != "auto":
        return requested
    from splitserve.platform.quant.cpu import has_fast_quant_kernels

    return "auto" if device == "cpu" and has_fast_quant_kernels() else "none"
