"""Which attention kernels a device runs: the Triton ones on CUDA when triton imports, else torch;
and how many context splits the Triton decode attention takes (kernels/triton_split_decode.py).

Importing this module never imports triton; the import is tried once, on the first CUDA query.
"""

from __future__ import annotations

import functools

import torch


def triton_available(device: torch.device | str) -> bool:
    """True when `device` is a CUDA device and the triton package imports."""
    return torch.device(device).type == "cuda" and _triton_imports()


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# The split rule (its reasons are in kernels/triton_split_decode.py's docstring).
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256
PROGRAMS_PER_SM = 2


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_context: int) -> int:
    """Context splits for a decode batch shape; 1 means the single-pass kernel. Pure: no tensor value
    enters, so a CUDA graph captured for a bucket keeps its count."""
    programs = batch * num_kv_heads
    if programs >= num_sms or max_context <= MIN_SPLIT_TOKENS:
        return 1
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    return max(1, min(wanted, MAX_SPLITS, max_context // MIN_SPLIT_TOKENS))
