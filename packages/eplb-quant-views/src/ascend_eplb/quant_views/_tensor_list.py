"""`ExpertTensorList`: one expert-first weight view kept as a list of per-expert tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ExpertTensorList"]


class ExpertTensorList(list[torch.Tensor]):
    """A weight view stored as ``p`` separate per-expert tensors instead of one stacked tensor.

    On NPU the Ascend grouped-matmul kernels read NZ-formatted (``ACL_FORMAT_FRACTAL_NZ``) weights
    only as per-expert lists, so vllm-ascend unbinds the stacked parameters into cloned lists
    (``w13_weight_list`` ...) when EPLB is on (vllm-ascend ``routed_experts.py``
    ``EplbExpertTensorList``). This class lets upstream vLLM's EPLB treat such a list like a stacked
    ``(p, ...)`` tensor:

    - ``view[row]`` is the tensor of local row ``row`` (plain list indexing), so upstream
      ``rebalance_execute.move_to_buffer`` / ``move_from_buffer`` (``w[src]``, ``b[dst].copy_(...)``)
      move one expert at a time through it;
    - ``.shape`` is ``(p, *self[0].shape)``, so ``expert_weights[0][0].shape[0]`` is ``p``;
    - ``.dtype`` / ``.device`` are those of the elements;
    - ``torch.empty_like(view)`` (dispatched through ``__torch_function__``) returns a new
      ``ExpertTensorList`` of per-expert buffers, which is how upstream ``EplbState`` allocates its
      one-layer ``expert_buffer``.

    Every element must have the same shape, dtype and device; `validate_weight_views` checks that.
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
