"""`ExpertTensorList`: one expert-first weight view kept as a list of per-expert tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ExpertTensorList"]


class ExpertTensorList(list[torch.Tensor]):
    """A weight view stored as ``p`` separate per-expert tensors instead of one stacked tensor.

    vllm-ascend's NZ weights on NPU (``EplbExpertTensorList``, ``routed_experts.py``). Upstream EPLB
    treats it as a stacked ``(p, ...)`` tensor: ``view[row]`` is local row ``row`` (what
    ``move_to_buffer`` / ``move_from_buffer`` index), ``.shape`` is ``(p, *self[0].shape)``,
    ``.dtype`` / ``.device`` the elements', and ``torch.empty_like(view)`` a new list of per-expert
    buffers (how ``EplbState`` allocates ``expert_buffer``). Elements share shape, dtype and device
    (`validate_weight_views`).
    """

    __slots__ = ()

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(tensors)

    @property
    def shape(self) -> torch.Size:
        """``torch.Size((p, *self[0].shape))``. Raises ``ValueError`` when the list is empty."""
        if not self:
            raise ValueError("ExpertTensorList is empty: it has no shape (expected one tensor per expert)")
        return torch.Size((len(self), *self[0].shape))

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the per-expert tensors (of element 0)."""
        if not self:
            raise ValueError("ExpertTensorList is empty: it has no dtype")
        return self[0].dtype

    @property
    def device(self) -> torch.device:
        """Device of the per-expert tensors (of element 0)."""
        if not self:
            raise ValueError("ExpertTensorList is empty: it has no device")
        return self[0].device

    def element_size(self) -> int:
        """Bytes per element of the per-expert tensors (upstream ``set_eplb_state`` views 1-byte dtypes
        as uint8 for the transfer)."""
        if not self:
            raise ValueError("ExpertTensorList is empty: it has no element size")
        return self[0].element_size()

    def view(self, dtype: torch.dtype) -> ExpertTensorList:
        """``ExpertTensorList`` of ``t.view(dtype)`` per element: the same memory read as ``dtype``
        (what upstream ``set_eplb_state`` does to stacked 1-byte weights: ``w.view(torch.uint8)``)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"ExpertTensorList.view takes a torch.dtype, got {dtype!r}")
        return ExpertTensorList(t.view(dtype) for t in self)

    def __repr__(self) -> str:
        if not self:
            return "ExpertTensorList([])"
        return f"ExpertTensorList(p={len(self)}, element_shape={tuple(self[0].shape)}, dtype={self[0].dtype})"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty_like and args and isinstance(args[0], ExpertTensorList):
            return ExpertTensorList(torch.empty_like(t, *args[1:], **kwargs) for t in args[0])
        return NotImplemented
