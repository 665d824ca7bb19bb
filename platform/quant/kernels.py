"""Linear kernels, one per weight format; a layer holds one and calls it like F.linear.

Each kernel is built once at load from the layer's full weight (a float tensor or the GGUF
blocks, see formats.py) and prepacks it for its torch op; `nbytes` is what it keeps resident.
`build_kernel` picks the kernel for a mode and a stored type, and falls back, with one log
line, to the model-dtype dense kernel when a shape does not fit the packed format (int4 needs
inputs in groups of 32 and outputs in multiples of 16): a model loads in every mode.

Activations: int4 runs float32 math where the fused CPU kernels are built (else torch's packed
kernel in bfloat16); int8 runs in bfloat16 (the only fast activation type of its op on CPU;
float32 takes a reference path ~10x slower) and hands float32 back; fp16 is float32 throughout.
All are weight-only, so a row's result never depends on the other rows of the batch (no
per-tensor activation scale).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.quant import a8, formats
from splitserve.platform.quant.formats import RawQuant

log = logging.getLogger(__name__)

_INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q3_K, Q.Q2_K)
_INT8_TYPES = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0)


class LinearKernel(Protocol):
    name: str
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseKernel:
    name = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.weight = weight.to(dtype).contiguous()
        self.bias = None if bias is None else bias.to(dtype)
        self.nbytes = self.weight.nbytes

    def __call__(self, x):
        return F.linear(x, self.weight, self.bias)


class Int4Kernel:
    """4-bit weights with a scale and a minimum per group of 32 inputs (Q4_0/Q4_1 exactly).

    Where the fused CPU kernels are built (kernels/cpu_ops.c), the math is float32 throughout:
    - fewer than GEMM_MIN_ROWS rows (decode steps): `ss_q4_linear` widens the codes in registers
      and multiplies float32 activations, 4 rows per unpacked group;
    - more rows (prefill, big batches): `ss_q4_dequant` unpacks the weights once and the float32
      GEMM runs (1.7x the packed kernel at 512 rows; the unpacking costs ~0.4 ns per weight).
    Both are float32 on the same weights, so which one a step takes moves the result only by
    float32 rounding, as the GEMM's own blocking does in `--quantization none`: greedy outputs
    stay the same whatever the batch or the chunking. (Rounding activations to bfloat16, as
    torch's packed kernel does, turns such rounding noise into 0.4 % jumps that flip near-ties.)

    Without the fused kernels: torch's `_weight_int4pack_mm_for_cpu`, bfloat16 activations.
    """

    name = "int4"
    GEMM_MIN_ROWS = 32

    def __init__(self, weight: torch.Tensor | RawQuant, bias: torch.Tensor | None):
        groups, self.exact = formats.int4_groups(weight)
        n, k = groups.codes.shape
        self.out_features = n
        self.bias = None if bias is None else bias.float()
        self.ops = cpu_ops()
        if self.ops is not None:  # GGUF's nibble order; w = d * q + mn
            codes = groups.codes.view(n, k // formats.GROUP, formats.GROUP)
            self.qs = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2).contiguous()
            self.d = groups.scale.contiguous()
            self.mn = groups.minimum.contiguous()
            self.nbytes = self.qs.nbytes + self.d.nbytes + self.mn.nbytes
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 8)
        # [groups, out, 2]: the op's layout of per-group (scale, zero)
        self.scales_zeros = torch.stack([groups.scale.t(), groups.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.nbytes = self.packed.nbytes + self.scales_zeros.nbytes

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return in_features % formats.GROUP == 0 and out_features % 16 == 0

    def __call__(self, x):
        if self.ops is None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, formats.GROUP, self.scales_zeros
            ).to(x.dtype)
        elif x.shape[0] >= self.GEMM_MIN_ROWS:
            return F.linear(x.float(), self.ops.q4_dequant(self.qs, self.d, self.mn), self.bias).to(x.dtype)
        else:
            y = self.ops.q4_linear(x.float().contiguous(), self.qs, self.d, self.mn).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Kernel:
    name = "int8"

    def __init__(self, weight: torch.Tensor | RawQuant, bias: torch.Tensor | None):
        self.exact = False
        self.codes, scale = formats.int8_rows(formats.as_float(weight))
        self.scale = scale.to(torch.bfloat16)
        self.bias = None if bias is None else bias.float()
        self.nbytes = self.codes.nbytes + self.scale.nbytes

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return True

    def __call__(self, x):
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Fp16Kernel:
    name = "fp16"

    def __init__(self, weight: torch.Tensor | RawQuant, bias: torch.Tensor | None):
        self.exact = False
        w = formats.as_float(weight)
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, None if bias is None else bias.float())
        self.nbytes = w.numel() * 2

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return True

    def __call__(self, x):
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)


class RescoredHead:
    """The LM head of the fast modes: a 4-bit pass over the whole vocabulary, then the `top`
    best of each row re-scored exactly (float32, from the int8 table) and written back.

    A full-precision head reads 57 MB (float16) per step for SmolLM2's 49,152 x 576, more than
    all 30 layers in int4; the 4-bit pass reads 17 MB. Its logits carry bfloat16 rounding and
    4-bit weight error (~1e-2 relative), which could reorder near-ties at the top: re-scoring
    the best 64 makes the top of every row (what greedy, top-k/top-p sampling and logprobs
    read) exact to float32 rounding of the int8 values, and the tail keeps the approximation.
    The int8 table is the embedding's own when the head is tied.
    """

    name = "int4+rescore"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, top: int = 64, ops=None):
        """`ops` (the CPU kernels): the 4-bit pass runs as `w4a8` (int8 activations, float16
        scales: a fifth fewer bytes per step than `int4`'s float32 ones); only its top is read,
        and that is re-scored exactly. None: the `int4` kernel (float32 activations)."""
        self.codes, self.scale, self.top = codes, scale, min(top, codes.shape[0])
        values = formats.Int8Groups(codes, scale).dequantize()
        if ops is not None and a8.fits(*values.shape):
            self.approx = a8.Int4A8Kernel(values, None, ops, 1)
            self.name = "w4a8+rescore"
        else:
            self.approx = Int4Kernel(values, None) if Int4Kernel.fits(*values.shape) else Fp16Kernel(values, None)
        self.exact = False
        self.nbytes = self.approx.nbytes  # the int8 table is counted where it is owned

    def __call__(self, hidden):
        logits = self.approx(hidden).float()
        ids = top_ids(logits, self.top)  # [M, top]
        rows = self.codes.index_select(0, ids.view(-1)).view(*ids.shape, -1, formats.GROUP).float()
        rows = rows * self.scale.index_select(0, ids.view(-1)).view(*ids.shape, -1, 1)
        exact = (rows.view(*ids.shape, -1) * hidden.float()[:, None, :]).sum(-1)  # [M, top]
        return logits.scatter_(1, ids, exact)


CHUNK = 64


def top_ids(logits: torch.Tensor, top: int) -> torch.Tensor:
    """The ids of each row's `top` largest logits (unordered), as topk finds them, in two small
    passes where the vocabulary is large: every one of the `top` largest values lies in a chunk
    of CHUNK columns whose maximum is among the `top` largest chunk maxima (each chunk holding
    one of them has a maximum at least that value, and at most `top` chunks have a maximum at
    least the `top`-th value), so a topk over those chunks' columns finds them all. On Gemma 3's
    262,144 logits that replaces one topk of the whole row, the largest part of its head after
    the matmul, by a max and two topks over 4,096 values. Ties at the `top`-th value may keep
    another of the tied ids than one topk would."""
    m, vocab = logits.shape
    if vocab % CHUNK or vocab < 4 * CHUNK * top:
        return logits.topk(top, dim=-1, sorted=False).indices
    chunks = logits.view(m, vocab // CHUNK, CHUNK).amax(-1).topk(top, dim=-1, sorted=False).indices
    columns = (chunks[..., None] * CHUNK + torch.arange(CHUNK, device=logits.device)).view(m, -1)
    return columns.gather(1, logits.gather(1, columns).topk(top, dim=-1, sorted=False).indices)


KERNELS = {
    "int4": Int4Kernel,
    "int8": Int8Kernel,
    "fp16": Fp16Kernel,
    "w4a8": a8.Int4A8Kernel,
    "w4a16": a8.Int4A8Kernel,
    "w8a16": a8.Int8A16Kernel,
}
A8_DIGITS = {"w4a8": 1, "w4a16": 2, "w8a16": 2}
# A mode a family may build with instead of `auto` (never a user's --quantization value): every
# linear in the kernel that keeps its stored codes (exact_kernel).
AUTO_EXACT = "auto-exact"


def nearest_kernel(tensor_type: Q | None) -> str:
    """The fast kernel whose format is nearest a stored GGUF type (None: a float tensor).
    4-bit types take `w4a16` where the CPU kernels are built here (else `int4`): of the 4-bit
    kernels it is the fastest whose fidelity gates pass on SmolLM2 (`w4a8`'s greedy answers leave
    transformers' on 5 of 8 prompts, quant/a8.py)."""
    if tensor_type in _INT4_TYPES:
        return "w4a16" if cpu_ops() is not None else "int4"
    if tensor_type in _INT8_TYPES:
        return "int8"
    return "fp16"


def exact_kernel(tensor_type: Q | None) -> str:
    """The fast kernel that reads a stored GGUF type's codes as they are (None: a float tensor),
    with activations in two int8 digits: Q4_0/Q4_1/Q4_K -> `w4a16`, Q5_0/Q8_0 -> `w8a16`;
    anything else (Q6_K, Q5_K, floats) -> `fp16`. Without the CPU kernels (or AVX2) `fp16`
    throughout. Gemma 3 builds `auto` this way (models/gemma3.py, docs/models.md)."""
    if cpu_ops() is None:
        return "fp16"
    if tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        return "w4a16"
    if tensor_type in (Q.Q5_0, Q.Q8_0):
        return "w8a16"
    return "fp16"


def kernel_for(mode: str, weight: torch.Tensor | RawQuant) -> str:
    tensor_type = weight.tensor_type if isinstance(weight, RawQuant) else None
    if mode == "auto":
        return nearest_kernel(tensor_type)
    if mode == AUTO_EXACT:
        return exact_kernel(tensor_type)
    return mode


def build_kernel(
    mode: str, name: str, weight: torch.Tensor | RawQuant, bias: torch.Tensor | None, dtype: torch.dtype
) -> LinearKernel:
    """The kernel of `mode` (a fast mode or `auto`) for the linear `name`; dense if it cannot take it."""
    kind = kernel_for(mode, weight)
    ops = cpu_ops() if kind in A8_DIGITS else None
    if kind in A8_DIGITS and ops is None:
        log.warning("%s: %s needs the fused CPU kernels, which are not built here; using int4", name, kind)
        kind = "int4"
    out_features, in_features = weight.shape
    kernel_cls = KERNELS[kind]
    if not kernel_cls.fits(out_features, in_features):
        log.warning(
            "%s: %s weights need inputs in groups of %d and outputs in multiples of 16, got %dx%d; "
            "this layer runs dense in %s",
            name,
            kind,
            formats.GROUP,
            out_features,
            in_features,
            str(dtype).removeprefix("torch."),
        )
        return DenseKernel(formats.as_float(weight), bias, dtype)
    kernel = kernel_cls(weight, bias, ops, A8_DIGITS[kind]) if kind in A8_DIGITS else kernel_cls(weight, bias)
    if isinstance(weight, RawQuant) and not kernel.exact:
        log.debug("%s: %s re-quantized to %s", name, weight.type_name, kind)
    return kernel


def build_head(mode: str, codes: torch.Tensor, scale: torch.Tensor) -> RescoredHead | a8.Int8A8Head:
    """The LM head of a fast mode over its int8 table: int8 activations over the whole vocabulary
    under `w4a8`, `w4a16` and `auto` (where the CPU kernels are built and the vocabulary fills 16-row tiles),
    else the 4-bit pass re-scored exactly at the top of each row (under `auto-exact` that pass in
    `w4a8`: for a vocabulary as large as Gemma 3's the head reads more than the layers)."""
    ops = cpu_ops() if mode in ("w4a8", "w4a16", "auto", AUTO_EXACT) else None
    if mode == AUTO_EXACT:
        return RescoredHead(codes, scale, ops=ops)
    if ops is not None and a8.fits(*codes.shape):
        return a8.Int8A8Head(codes, scale, ops)
    return RescoredHead(codes, scale)
