"""`ExpertStorage`: the tensors one rank's fused MoE kernel reads for one MoE layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ascend_eplb.quant_views._tensor_list import ExpertTensorList

__all__ = ["ExpertStorage", "KernelTensor"]

KernelTensor = torch.Tensor | ExpertTensorList
"""A stacked ``(p, ...)`` tensor or a per-expert `ExpertTensorList`, in the layout the kernel reads."""


@dataclass(frozen=True, eq=False)
class ExpertStorage:
    """The expert storage of one MoE layer on one rank, as built by `ExpertWeightFormat.create_storage`.

    Attributes:
        format_name: the `ExpertWeightFormat.name` that built and reads it.
        num_local_experts: ``p``, the local physical experts (rows) of this rank.
        hidden_size: ``H``.
        intermediate_size: ``I`` (per partition).
        per_expert_lists: every kernel tensor an `ExpertTensorList` of ``p`` tensors (vllm-ascend
            ``*_list``), else one stacked ``(p, ...)`` tensor.
        kernel_tensors: every per-expert tensor the kernel reads, by vllm-ascend parameter name (no
            ``_list`` suffix), in `weight_views` order and the kernel's layout (MXFP: transposed views);
            all that `expert_fingerprint` and `apply` read.
        unread_tensors: checkpoint tensors the kernel never reads (W8A8 offsets): kept, never moved.
        options: the format options it was built with (``fused_scales``, ``has_bias`` ...).

    Frozen: the set of tensors never changes; EPLB rewrites their contents through the weight views.
    """

    format_name: str
    num_local_experts: int
    hidden_size: int
    intermediate_size: int
    per_expert_lists: bool
    kernel_tensors: Mapping[str, KernelTensor]
    unread_tensors: Mapping[str, KernelTensor] = field(default_factory=dict)
    options: Mapping[str, object] = field(default_factory=dict)

    def expert_tensors(self, name: str, local_row: int) -> torch.Tensor:
        """Kernel tensor ``name`` of local row ``local_row`` (kernel layout; a view, never a copy).

        Raises ``KeyError`` for an unknown name and ``IndexError`` for a row outside ``[0, p)``.
        """
        if not 0 <= local_row < self.num_local_experts:
            raise IndexError(
                f"local_row={local_row} is outside [0, num_local_experts={self.num_local_experts})"
            )
        return self.kernel_tensors[name][local_row]

    @property
    def device(self) -> torch.device:
        """Device of the kernel tensors."""
        first = next(iter(self.kernel_tensors.values()))
        return first.device
