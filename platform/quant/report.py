"""What a loaded model keeps resident, per kernel: for the load log line and the benchmarks."""

from __future__ import annotations

from collections import Counter

from torch import nn


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of every weight the model keeps: float parameters, packed kernels, int8 tables."""
    from splitserve.platform.models.layers import MergedLinear, QuantizedEmbedding

    total = sum(p.nbytes for p in model.parameters())
    for module in model.modules():
        if isinstance(module, MergedLinear) and module.kernel is not None:
            total += module.kernel.nbytes
        elif isinstance(module, QuantizedEmbedding) and module.codes is not None:
            total += module.nbytes
    head = getattr(model, "lm_head_kernel", None)
    return total + (head.nbytes if head is not None else 0)


def describe_kernels(model: nn.Module) -> str:
    """e.g. '210 linears int4 (210 exact), 1 fp16; embedding int8; lm_head fp16'."""
    from splitserve.platform.models.layers import MergedLinear

    kinds: Counter[str] = Counter()
    exact = 0
    for module in model.modules():
        if isinstance(module, MergedLinear) and module.kernel is not None:
            kinds[module.kernel.name] += 1
            exact += bool(getattr(module.kernel, "exact", False))
    linears = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    head = getattr(model, "lm_head_kernel", None)
    return f"linears: {linears} ({exact} exact from the file); embedding int8; lm_head {head.name if head else 'none'}"
