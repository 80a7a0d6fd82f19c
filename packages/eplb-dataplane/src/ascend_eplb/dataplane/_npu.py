"""Guarded probe of ``torch_npu`` (needs the Ascend toolkit; never in CI): the one module that imports it.

The data plane is pure torch; only device selection asks whether an NPU is usable.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - depends on the Ascend toolkit being installed
    import torch_npu  # noqa: F401

    HAS_TORCH_NPU = True
except ImportError:  # pragma: no cover - the normal case off Ascend hosts
    HAS_TORCH_NPU = False

__all__ = ["HAS_TORCH_NPU", "default_device"]


def default_device() -> str:
    """The best available torch device type: ``"npu"``, then ``"cuda"``, else ``"cpu"``."""
    if HAS_TORCH_NPU and torch.npu.is_available():  # pragma: no cover - needs an Ascend host
        return "npu"
    if torch.cuda.is_available():  # pragma: no cover - needs a CUDA host
        return "cuda"
    return "cpu"
