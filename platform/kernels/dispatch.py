"""Which attention kernels a device runs: the Triton ones on CUDA when triton imports, else torch.

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
